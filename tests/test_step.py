"""The step's order is written once (``deepmd_hybridmuon.step.run``), and every implementation follows it.

Each implementation's step is recorded through ``step.run``: the phases it is asked for, in
order, and the gate it returns. The arithmetic of each implementation against the loop is
tests/test_parity.py (FSDP2: tests/test_distributed.py, which records its phases with
:func:`recording` in the spawned ranks).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_optimizer

from deepmd_hybridmuon import step

ALL_PHASES = ["gate", "adam", "before_orthogonalize", "complete_sums", "orthogonalize", "apply"]
ADAM_ONLY = ["gate", "adam", "apply"]
PHASES = set(ALL_PHASES)


class _Recorder:
    """Stands in for an implementation's phases and writes down each phase asked for."""

    def __init__(self, inner: Any, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if name in PHASES:
            self._calls.append(name)
        return value


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[str, list[str]]]]:
    """Record every ``step.run`` while active: (the phases' class, qualified, the phases called in order)."""
    runs: list[tuple[str, list[str]]] = []
    real = step.run

    def run(phases: Any) -> torch.Tensor:
        calls: list[str] = []
        runs.append((f"{type(phases).__module__}.{type(phases).__qualname__}", calls))
        return real(_Recorder(phases, calls))

    step.run = run
    try:
        yield runs
    finally:
        step.run = real


def _model(muon: bool) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"fit.matrix": (12, 8), "fit.bias": (8,)} if muon else {"fit.bias": (8,), "fit.scale": (4,)}
    return {k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in shapes.items()}


#: The class that supplies each implementation's phases.
SUPPLIER = {"loop": "deepmd_hybridmuon.loop._Phases", "engine-eager": "deepmd_hybridmuon.engine.batched.BatchedStep"}


@pytest.mark.parametrize("implementation", ["loop", "engine-eager"])
@pytest.mark.parametrize(("muon", "expected"), [(True, ALL_PHASES), (False, ADAM_ONLY)], ids=["muon", "adam-only"])
def test_every_implementation_runs_the_phases_in_the_one_order(implementation: str, muon: bool, expected: list[str]):
    params = _model(muon)
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
    for p in params.values():
        p.grad = torch.ones_like(p)
    with recording() as runs:
        opt.step()
    assert runs == [(SUPPLIER[implementation], expected)]


@pytest.mark.parametrize("implementation", ["loop", "engine-eager"])
def test_a_skipped_step_runs_every_phase_with_the_gate_at_zero(implementation: str):
    """No phase is left out on a non-finite gradient: none may wait for the device to read the gate."""
    params = _model(True)
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
    before = {k: p.detach().clone() for k, p in params.items()}
    for p in params.values():
        p.grad = torch.ones_like(p)
    params["fit.bias"].grad[0] = float("nan")
    with recording() as runs:
        opt.step()
    assert runs == [(SUPPLIER[implementation], ALL_PHASES)]
    for k, p in params.items():
        assert torch.equal(p.detach(), before[k]), k
