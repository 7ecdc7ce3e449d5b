"""A step whose gradients hold NaN or inf is skipped: parameters and state keep their values."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_optimizer

SHAPES = {"fit.matrix": (12, 8), "fit.sq": (6, 6), "fit.bias": (8,), "desc.adamw_g": (4, 4), "t.w": (2, 3, 5)}


def _setup(implementation: str):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen)) for k, s in SHAPES.items()}
    opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
    return params, opt, gen


def _grads(params, gen):
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)


def _tensors(opt):
    return {
        (i, k): v.clone()
        for i, p in enumerate(opt.param_groups[0]["params"])
        for k, v in opt.state[p].items()
        if isinstance(v, torch.Tensor)
    }


@pytest.mark.parametrize("implementation", ["engine", "loop"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradient_skips_the_step(implementation, bad):
    params, opt, gen = _setup(implementation)
    for _ in range(3):  # state exists, the engine (if any) is warm
        _grads(params, gen)
        opt.step()
    before = {k: p.detach().clone() for k, p in params.items()}
    state_before = _tensors(opt)
    _grads(params, gen)
    params["fit.matrix"].grad[3, 2] = bad  # one bad element in one parameter
    opt.step()
    for k, p in params.items():
        assert torch.equal(p.detach(), before[k]), k
    after = _tensors(opt)
    assert after.keys() == state_before.keys()
    for key, value in after.items():
        assert torch.equal(value, state_before[key]), key
    # the next finite step moves everything again
    _grads(params, gen)
    opt.step()
    assert all(not torch.equal(p.detach(), before[k]) for k, p in params.items())
    assert all(torch.isfinite(p).all() for p in params.values())


@pytest.mark.parametrize("implementation", ["engine", "loop"])
def test_float64_huge_finite_gradient_steps_as_scaled_down(implementation):
    """A float64 model's gradients of 2^70 (beyond what float32 sums of squares hold) step as the same ones times
    2^-70: Newton–Schulz and Magma's cosine are scale-invariant (README, "bad gradients")."""
    moved = []
    for scale in (1.0, 2.0**70):
        gen = torch.Generator().manual_seed(0)
        shapes = {"fit.matrix": (12, 8), "fit.sq": (6, 6), "t.w": (2, 3, 5)}  # Muon routes only
        params = {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64)) for k, s in shapes.items()}
        opt = make_optimizer(list(params.values()), implementation, lr=1e-2, named_parameters=params.items())
        start = {k: p.detach().clone() for k, p in params.items()}
        for _ in range(3):
            for p in params.values():
                p.grad = scale * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            opt.step()
        moved.append({k: p.detach() - start[k] for k, p in params.items()})
    for k in moved[0]:
        # A power of two scales every number exactly: Newton-Schulz brings each matrix into the same binade before
        # its norm, and Magma's float64 sums (taken directly unscaled, after a downscale when scaled: they overflow
        # float32 there) give the same cosine up to float64 rounding and MAGMA_EPS (1e-12 against sums near 1);
        # then the float64 rounding of p + update.
        torch.testing.assert_close(moved[1][k], moved[0][k], rtol=1e-12, atol=1e-15, msg=k)


def test_engine_and_loop_agree_across_a_skipped_step():
    results = []
    for implementation in ("engine", "loop"):
        params, opt, gen = _setup(implementation)
        for i in range(5):
            _grads(params, gen)
            if i == 2:
                params["fit.bias"].grad[0] = float("nan")
            opt.step()
        results.append(copy.deepcopy({k: p.detach() for k, p in params.items()}))
    for k in SHAPES:
        # same tolerance as tests/test_parity.py (bf16 rounding of the scale product)
        torch.testing.assert_close(results[0][k], results[1][k], rtol=1e-2, atol=1e-4, msg=k)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_group_on_the_cpu_and_a_gpu_steps_each_part_as_alone_and_skips_together():
    """One gate for a group whose parameters span devices (the loop runs it; the engine takes one device).

    A finite step equals two optimizers, one per device (same loop arithmetic on the same
    devices: bitwise); a NaN in the CPU part leaves the GPU part unchanged too.
    """
    gen = torch.Generator().manual_seed(1)
    shapes = {"cpu.w": ("cpu", (6, 4)), "cpu.b": ("cpu", (4,)), "gpu.w": ("cuda", (8, 5)), "gpu.b": ("cuda", (5,))}
    start = {k: (d, torch.randn(s, generator=gen)) for k, (d, s) in shapes.items()}
    grads = [{k: torch.randn(s, generator=gen) for k, (_, s) in shapes.items()} for _ in range(3)]

    def params(keys):
        return {k: torch.nn.Parameter(start[k][1].to(start[k][0])) for k in keys}

    mixed = params(shapes)
    parts = [params([k for k in shapes if k.startswith(d)]) for d in ("cpu", "gpu")]
    # the mixed group asks for the engine and gets the loop; the parts run the loop
    optimizers = [
        make_optimizer(list(ps.values()), impl, lr=1e-2, named_parameters=ps.items())
        for ps, impl in zip([mixed, *parts], ["engine", "loop", "loop"], strict=True)
    ]
    for step in grads:
        for ps, opt in zip([mixed, *parts], optimizers, strict=True):
            for k, p in ps.items():
                p.grad = step[k].to(p.device)
            opt.step()
    assert optimizers[0].execution_table()[0]["implementation"] == "loop"
    for ps in parts:
        for k, p in ps.items():
            assert torch.equal(mixed[k].detach(), p.detach()), k

    before = {k: p.detach().clone() for k, p in mixed.items()}
    for k, p in mixed.items():
        p.grad = grads[0][k].to(p.device)
    mixed["cpu.w"].grad[1, 2] = float("nan")
    optimizers[0].step()
    for k, p in mixed.items():
        assert torch.equal(p.detach(), before[k]), k


@pytest.mark.parametrize("implementation", ["engine", "loop"])
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU"))]
)
def test_skipped_steps_are_logged_once(implementation, device, caplog):
    """The first skipped steps get one warning (on a GPU at a later read: the count is read without waiting)."""
    import logging

    from deepmd_hybridmuon.optimizer import SKIPPED_LOG

    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((8, 4), (4,))]
    opt = make_optimizer(params, implementation, lr=1e-2)
    marker = SKIPPED_LOG.split(":")[0]
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        for k in range(12):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            if k in (3, 6):
                params[0].grad[0, 0] = float("nan")
            opt.step()
            if k == 2:  # nothing skipped yet: nothing logged
                if device == "cuda":
                    torch.cuda.synchronize()
                assert not [r for r in caplog.records if marker in r.getMessage()]
        if device == "cuda":
            torch.cuda.synchronize()
        opt.step()  # reads the last copy
    lines = [r.getMessage() for r in caplog.records if marker in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith("steps skipped: 1 of the first") or lines[0].startswith("steps skipped: 2 of")


def test_gate_across_ranks_runs_on_a_torch_without_distributed(monkeypatch):
    # Such a build has torch.distributed.is_available() False and no is_initialized at all.
    monkeypatch.setattr(torch.distributed, "is_available", lambda: False)
    monkeypatch.delattr(torch.distributed, "is_initialized")
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(12, 8, generator=gen))
    opt = make_optimizer([w], "engine", lr=1e-2, named_parameters=[("fit.matrix", w)], nonfinite_across_ranks=True)
    w.grad = torch.randn(w.shape, generator=gen)
    before = w.detach().clone()
    opt.step()  # one process: its own gate, nothing to agree with
    assert not torch.equal(w, before)
    w.grad = torch.full(w.shape, float("nan"))
    taken = w.detach().clone()
    opt.step()
    assert torch.equal(w, taken)
