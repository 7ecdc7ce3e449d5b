"""Every fast implementation of the step against the per-parameter loop, the specification.

One table of implementations (like torch's ``OptimizerInfo``): each row is a way to run
the step (``optimizer.IMPLEMENTATIONS`` plus the ``flash_muon`` option and a device) with
the option sets it is checked on, the tolerance of its Muon updates, and what it must
report in ``execution_table()`` (so that a row cannot silently test another path). Each
case runs the row and the loop from the same start over several steps with a decaying
learning rate (a CUDA graph must read it from the device) and compares what every
parameter moved.

The Triton rows need the kernels: compiled on a GPU, or under Triton's CPU interpreter,
which the last test switches on in a subprocess (see the ``kernels`` fixture, conftest.py).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from conftest import KERNEL_MUON_TOL, make_optimizer, run_interpreted

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# Shapes of the kinds DeePMD models have: embedding and fitting matrices (square, wide, tall),
# 3-D stacks (a batch of matrices in "slice" mode), size-1 dimensions, biases, adam_/adamw_
# names, a size-0 tensor, and a matrix that never gets a gradient.
SHAPES = {
    "emb.layers.0.matrix": (1, 25),
    "emb.layers.1.matrix": (25, 50),
    "emb.layers.2.matrix": (50, 40),
    "emb.layers.2.bias": (40,),
    "fit.layers.0.matrix": (96, 24),
    "fit.layers.1.matrix": (24, 24),
    "fit.layers.1.idt": (24,),
    "fit.layers.2.matrix": (24, 1),
    "rep.linear.weight": (3, 16, 20),
    "rep.gate.weight": (2, 1, 16, 8),
    "rep.norm.adam_scale": (32, 4),
    "rep.ls.adamw_gamma": (16, 16),
    "compress.0": (0,),
    "frozen.matrix": (8, 12),
}
#: Parameters that get no gradient (the engine leaves them out; nothing may touch them).
GRADLESS = {"frozen.matrix"}

# The Triton rows (the interpreter is slow: fewer, larger matrices): every path of the kernels
# in one step, and each decay route (Adam, AdamW, Muon) of the update kernel.
KERNEL_SHAPES = {
    "emb.layers.1.matrix": (25, 50),
    "emb.layers.2.matrix": (50, 40),
    "emb.layers.2.bias": (40,),
    "fit.layers.1.matrix": (24, 24),
    "fit.layers.2.matrix": (24, 1),
    "rep.linear.weight": (3, 16, 20),
    "rep.ls.adamw_gamma": (5, 7),
    "fit.long.matrix": (40, 300),  # too long to stay in registers: streamed through the workspace
    # smaller side above MAX_ROWS: the torch path (tall and wide, Gram and standard; one stack per
    # shape), in the same step as the Triton launches
    "big.matrix": (160, 136),
    "big.square": (144, 144),
    "huge.matrix": (264, 270),
    "frozen.matrix": (8, 12),
}

#: Every combination of the options that change the arithmetic.
OPTION_SETS = [
    {"enable_gram": g, "magma_muon": m, "muon_mode": mode, "lr_adjust": adj, "weight_decay": wd, "dtype": dt}
    for g, m, mode, adj, wd, dt in itertools.product(
        [True, False], [True, False], ["2d", "flat", "slice"], [0.0, 3.0], [0.0, 1e-3], [torch.float32, torch.float64]
    )
]
#: Fewer for the Triton rows (the interpreter is slow); every kernel and both dtypes are in.
KERNEL_OPTION_SETS = [
    {"enable_gram": True, "magma_muon": True, "dtype": torch.float32},
    {"enable_gram": False, "magma_muon": False, "dtype": torch.float32, "muon_mode": "flat", "lr_adjust": 3.0},
    {"enable_gram": True, "magma_muon": False, "dtype": torch.float64, "weight_decay": 0.0},
]
GRAPH_OPTION_SETS = [
    {"enable_gram": True, "magma_muon": True, "dtype": torch.float32},
    {"enable_gram": False, "magma_muon": True, "dtype": torch.float64},
]

# The loop multiplies the bf16 Newton-Schulz output by its scale in bf16 (as the built-in
# does); the engine does it in float32. Each step then differs by about one bf16
# rounding (2^-8 ~ 0.4 %) of some elements; the accumulated change over 6 steps measured <= 0.3 %.
TORCH_MUON_TOL = 1e-2
# The Triton kernels against the loop: conftest.KERNEL_MUON_TOL.
# Adam and AdamW run the same float32 operations in the same order in every implementation.
ADAM_TOL = 1e-6


@dataclass(frozen=True)
class Implementation:
    """One way to run the step, and what it is checked on."""

    name: str
    implementation: str  # optimizer.IMPLEMENTATIONS
    flash_muon: bool
    device: str  # "cpu", "cuda", or "kernels": the device of the kernels fixture
    kernels: str  # execution_table()[...]["kernels"]
    cuda_graph: bool  # execution_table()[...]["cuda_graph"]
    muon_tol: float
    option_sets: list[dict[str, Any]]
    shapes: dict[str, tuple[int, ...]] = field(default_factory=lambda: SHAPES)
    steps: int = 6
    needs_cuda: bool = False


TORCH = {"flash_muon": False, "kernels": "torch", "muon_tol": TORCH_MUON_TOL}
TRITON = {"flash_muon": True, "device": "kernels", "kernels": "triton", "muon_tol": KERNEL_MUON_TOL}
IMPLEMENTATIONS = [
    Implementation("engine-torch", "engine", device="cpu", cuda_graph=False, option_sets=OPTION_SETS, **TORCH),
    Implementation(
        "engine-torch-cuda",
        "engine-eager",
        device="cuda",
        cuda_graph=False,
        option_sets=OPTION_SETS,
        needs_cuda=True,
        **TORCH,
    ),
    # captured after two eager steps
    Implementation(
        "engine-torch-graph",
        "engine",
        device="cuda",
        cuda_graph=True,
        option_sets=GRAPH_OPTION_SETS,
        needs_cuda=True,
        **TORCH,
    ),
    Implementation(
        "engine-triton",
        "engine-eager",
        cuda_graph=False,
        option_sets=KERNEL_OPTION_SETS,
        shapes=KERNEL_SHAPES,
        steps=3,
        **TRITON,
    ),
    # captured: the Triton launches and the torch buckets in one graph
    Implementation(
        "engine-triton-graph",
        "engine",
        cuda_graph=True,
        option_sets=GRAPH_OPTION_SETS,
        shapes=KERNEL_SHAPES,
        steps=5,
        needs_cuda=True,
        **TRITON,
    ),
]


def _option_id(options: dict[str, Any]) -> str:
    return ",".join(f"{k}={str(v).removeprefix('torch.')}" for k, v in options.items())


CASES = [
    pytest.param(impl, options, id=f"{impl.name}-{_option_id(options)}", marks=_marks)
    for impl in IMPLEMENTATIONS
    for options in impl.option_sets
    for _marks in [[pytest.mark.skipif(impl.needs_cuda and not CUDA, reason="needs a CUDA GPU")]]
]


def _run(impl: str, flash_muon: bool, device: torch.device, shapes: dict, steps: int, options: dict[str, Any]):
    """``steps`` steps (lr decaying by 0.8 per step) from a seeded start; what each parameter moved, the optimizer."""
    options = dict(options)
    dtype = options.pop("dtype")
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for k, s in shapes.items()}
    opt = make_optimizer(
        list(params.values()), impl, lr=1e-2, named_parameters=params.items(), flash_muon=flash_muon, **options
    )
    schedule = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
    start = {k: p.detach().clone() for k, p in params.items()}
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for name, p in params.items():
            p.grad = None if name in GRADLESS else torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
        schedule.step()
    return {k: p.detach() - start[k] for k, p in params.items()}, opt


@pytest.mark.parametrize(("impl", "options"), CASES)
def test_implementation_matches_the_loop(request, impl: Implementation, options: dict[str, Any]) -> None:
    device = request.getfixturevalue("kernels")[1] if impl.device == "kernels" else torch.device(impl.device)
    fast, opt = _run(impl.implementation, impl.flash_muon, device, impl.shapes, impl.steps, options)
    ref, loop = _run("loop", impl.flash_muon, device, impl.shapes, impl.steps, options)

    [row] = opt.execution_table()
    assert row["implementation"] == "engine", row
    assert (row["kernels"], row["cuda_graph"]) == (impl.kernels, impl.cuda_graph), row
    assert loop.execution_table() == [{"implementation": "loop"}]
    if impl.shapes is KERNEL_SHAPES:  # every path of the kernels took part
        assert row["program_matrices"] > 0, row
        assert sorted(row["torch_matrices"]) == [(144, 144), (160, 136), (264, 270)], row  # sides > MAX_ROWS

    group = opt.param_groups[0]
    for (name, r), p in zip(ref.items(), group["params"], strict=True):
        if name in GRADLESS or r.numel() == 0:
            assert torch.equal(fast[name], torch.zeros_like(r)) and torch.equal(r, torch.zeros_like(r)), name
            assert not opt.state.get(p), name
            continue
        err = ((fast[name] - r).norm() / r.norm()).item()
        tol = impl.muon_tol if opt.route_of(p, group).route == "muon" else ADAM_TOL
        assert err < tol, (name, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["2d", "slice"])
def test_magma_over_segments_matches_the_loop(monkeypatch, dtype: torch.dtype, mode: str) -> None:
    """The engine's Magma sums over segments of the flat buffer (a GPU's way) give the loop's step, here on the CPU."""
    from deepmd_hybridmuon import functional as F

    monkeypatch.setattr(F, "SEGMENT_SUM_DEVICES", frozenset({"cpu", "cuda"}))
    monkeypatch.setattr(F, "SEGMENT_PART", 1000)  # several parts: one float64 buffer rewritten for each sum of each
    calls = []
    sums = F.magma_segment_sums
    monkeypatch.setattr(F, "magma_segment_sums", lambda *a: calls.append(1) or sums(*a))
    options = {"magma_muon": True, "muon_mode": mode, "weight_decay": 1e-3, "dtype": dtype}
    fast, opt = _run("engine", False, torch.device("cpu"), SHAPES, 6, options)
    assert len(calls) == 6  # every step took the sums over segments
    ref, _ = _run("loop", False, torch.device("cpu"), SHAPES, 6, options)
    group = opt.param_groups[0]
    for (name, r), p in zip(ref.items(), group["params"], strict=True):
        if name not in GRADLESS and r.numel():
            err = ((fast[name] - r).norm() / r.norm()).item()
            tol = TORCH_MUON_TOL if opt.route_of(p, group).route == "muon" else ADAM_TOL  # as the CPU engine's rows
            assert err < tol, (name, err)


# ----------------------------------------------------------------------------- Triton path specifics


def _matrix_and_bias_run(impl: str, device: torch.device, seed: int, steps: int, set_grads) -> tuple:
    """A 24 x 40 matrix ``w`` and a bias ``b``, ``steps`` steps; ``set_grads(step, w, b, gen)`` gives the gradients.

    Returns what ``w`` moved and the optimizer.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(24, 40, generator=gen).to(device))
    b = torch.nn.Parameter(torch.randn(40, generator=gen).to(device))
    opt = make_optimizer([w, b], impl, lr=1e-2, named_parameters=[("w", w), ("b", b)])
    start = w.detach().clone()
    for step in range(steps):
        set_grads(step, w, b, gen)
        opt.step()
    return w.detach() - start, opt


def test_triton_engine_reads_non_contiguous_gradients(kernels):
    """A non-contiguous gradient (a transposed view) steps as its contiguous copy, with the Triton kernels."""
    _, device = kernels

    def transposed(step, w, b, gen):
        w.grad = torch.randn(40, 24, generator=gen).to(device).T  # a transposed view
        b.grad = torch.randn(40, generator=gen).to(device)

    moved = []
    for impl in ("engine-eager", "loop"):
        dw, opt = _matrix_and_bias_run(impl, device, 6, 3, transposed)
        moved.append(dw)
        assert opt.execution_table()[0].get("kernels") == ("triton" if impl != "loop" else None)
    err = ((moved[0] - moved[1]).norm() / moved[1].norm()).item()
    assert err < KERNEL_MUON_TOL, err


@pytest.mark.parametrize("impl", ["engine-eager", "engine"])  # "engine": captured in a CUDA graph on a GPU
def test_triton_engine_follows_a_parameter_given_new_storage(kernels, impl):
    """``p.data = ...`` between steps (``module.half()``, an EMA swap): the new storage moves, the old does not."""
    _, device = kernels
    old: dict[str, torch.Tensor] = {}

    def swapping(step, w, b, gen):
        if step == 3:  # after the capture (the third step) on a GPU
            old["storage"], old["before"] = w.data, w.data.clone()
            w.data = w.data.clone()
        w.grad = torch.randn(24, 40, generator=gen).to(device)
        b.grad = torch.randn(40, generator=gen).to(device)

    moved = []
    for implementation in (impl, "loop"):
        dw, _ = _matrix_and_bias_run(implementation, device, 7, 5, swapping)
        moved.append(dw)
        assert torch.equal(old["storage"], old["before"]), implementation
    err = ((moved[0] - moved[1]).norm() / moved[1].norm()).item()
    assert err < KERNEL_MUON_TOL, err


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_triton_engine_skips_a_non_finite_step(kernels, bad):
    """A non-finite gradient skips the step with the Triton kernels: parameters, moments, momentum, Magma stay."""
    _, device = kernels
    _, opt = _run("engine-eager", True, device, KERNEL_SHAPES, 2, KERNEL_OPTION_SETS[0])
    assert opt.execution_table()[0]["kernels"] == "triton"
    params = opt.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    state = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items() if torch.is_tensor(v)}
    gen = torch.Generator().manual_seed(9)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    params[list(KERNEL_SHAPES).index("fit.layers.1.matrix")].grad.view(-1)[-1] = bad  # in one Muon matrix
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    after = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items() if torch.is_tensor(v)}
    assert all(torch.equal(after[key], v) for key, v in state.items())


@pytest.mark.skipif(not CUDA, reason="Triton compiles only for a GPU")
def test_first_steps_take_the_torch_path_while_triton_compiles(kernels, monkeypatch, tmp_path):
    K, device = kernels
    # as in a fresh process whose Triton cache has never held the variants (an empty ledger)
    monkeypatch.setattr(K.compile, "registry", K.KernelRegistry(ledger=tmp_path))
    options = {"enable_gram": True, "magma_muon": True, "dtype": torch.float32}
    _, opt = _run("engine", True, device, KERNEL_SHAPES, 1, options)
    row = opt.execution_table()[0]
    assert row["kernels"] == "compiling" and row["program_matrices"] == 0, row
    assert K.wait_ready(300), "compilation did not finish"
    gen = torch.Generator().manual_seed(5)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt.step()
    row = opt.execution_table()[0]
    assert row["kernels"] == "triton" and row["program_matrices"] > 0, row


@pytest.mark.skipif(CUDA or INTERPRET, reason="the kernels run directly here")
def test_triton_rows_under_the_interpreter():
    run_interpreted(__file__, "triton and not under_the_interpreter")
