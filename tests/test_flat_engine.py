"""The flat engine (default, ``batched=True``) against the per-parameter loop, the specification.

Runs on the CPU always and on CUDA when a GPU is present (the GPU parity check of the
fast path).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from deepmd_hybridmuon import HybridMuonOptimizer

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

# Shapes of the kinds DeePMD models have: embedding and fitting matrices (square, wide, tall),
# 3-D stacks, size-1 dimensions, biases, adam_/adamw_ names, a size-0 tensor.
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
}


def _params(dtype: torch.dtype, device: str) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for k, s in SHAPES.items()}


def _run(batched: bool, dtype: torch.dtype, device: str, steps: int = 6, **options):
    params = _params(dtype, device)
    opt = HybridMuonOptimizer(
        list(params.values()), lr=1e-2, named_parameters=params.items(), batched=batched, **options
    )
    gen = torch.Generator().manual_seed(1)
    start = {k: p.detach().clone() for k, p in params.items()}
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
    return {k: (p.detach() - start[k]) for k, p in params.items()}, opt


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("enable_gram", "magma_muon", "muon_mode", "lr_adjust"),
    list(itertools.product([True, False], [True, False], ["2d", "flat", "slice"], [0.0, 3.0])),
)
def test_engine_matches_the_loop(device, dtype, enable_gram, magma_muon, muon_mode, lr_adjust):
    options = {"enable_gram": enable_gram, "magma_muon": magma_muon, "muon_mode": muon_mode, "lr_adjust": lr_adjust}
    fast, opt = _run(True, dtype, device, **options)
    ref, _ = _run(False, dtype, device, **options)
    assert opt._engines, "the flat engine did not run"
    for name, r in ref.items():
        route = opt.route_of(dict(zip(SHAPES, opt.param_groups[0]["params"], strict=True))[name], opt.param_groups[0])
        if r.numel() == 0:
            continue
        err = ((fast[name] - r).norm() / r.norm()).item()
        if route.route == "muon":
            # The loop multiplies the bf16 Newton-Schulz output by its scale in bf16 (as the
            # built-in does); the engine does it in float32, and pads matrices into shared
            # stacks, which changes the summation order of the bf16/fp16 products. Each step
            # then differs by about one bf16 rounding (2^-8 ~ 0.4 %) of some elements; the
            # accumulated change over 6 steps measured <= 0.3 %.
            assert err < 1e-2, (name, err)
        else:
            # Adam and AdamW run the same float32 operations in the same order.
            assert err < 1e-6, (name, err)


@pytest.mark.parametrize("device", DEVICES)
def test_state_is_the_builtin_layout_and_survives_a_round_trip(device):
    _, opt = _run(True, torch.float32, device, steps=2)
    sd = opt.state_dict()
    for p in opt.param_groups[0]["params"]:
        if p.numel() == 0:
            continue
        state = opt.state[p]
        # per-parameter tensors, shaped like the built-in's, even though they are views
        if "momentum_buffer" in state:
            assert state["momentum_buffer"].shape == p.shape
        if "exp_avg" in state:
            assert state["exp_avg"].shape == p.shape and state["exp_avg"].dtype == torch.float32
            assert isinstance(state["beta1_pow"], float)
    # saved tensors do not share the engine's flat buffers
    saved = [t for s in sd["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in saved)


def test_engine_falls_back_to_the_loop_when_a_gradient_is_missing():
    params = _params(torch.float32, "cpu")
    opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items())
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    params["fit.layers.1.matrix"].grad = None
    before = params["fit.layers.1.matrix"].detach().clone()
    opt.step()  # the loop, for this step
    assert torch.equal(params["fit.layers.1.matrix"].detach(), before)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()  # back on the engine
    assert all(torch.isfinite(p).all() for p in params.values())


def test_add_param_group_after_steps_rebuilds_the_engine():
    params = _params(torch.float32, "cpu")
    opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items())
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()
    extra = torch.nn.Parameter(torch.randn(12, 6))
    opt.add_param_group({"params": [extra], "lr": 1e-3})
    extra.grad = torch.randn_like(extra)
    before = extra.detach().clone()
    opt.step()
    assert not torch.equal(extra.detach(), before)
    assert "momentum_buffer" in opt.state[extra]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_replay_matches_eager_steps_with_a_changing_lr():
    def run(cuda_graph: bool):
        params = _params(torch.float32, "cuda")
        opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items(), cuda_graph=cuda_graph)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.8)
        gen = torch.Generator().manual_seed(3)
        for _ in range(8):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen).cuda()
            opt.step()
            sched.step()
        return params, opt

    graphed, opt = run(True)
    eager, _ = run(False)
    assert opt._engines[0].graph is not None, "no graph was captured"
    for name, p in graphed.items():
        # the same kernels on the same inputs: identical but for cuBLAS picking another
        # algorithm inside the capture, which moves bf16 results by an ulp at most
        torch.testing.assert_close(p, eager[name], rtol=1e-2, atol=1e-5, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_step_does_not_synchronise_inside_deepmds_device_context():
    """deepmd's trainer steps inside ``with torch.device(DEVICE)``; a step must not wait for the GPU there.

    torch's sync debug mode raises on any operation that synchronises the host with the GPU
    (a D2H copy, ``.item()``, a tensor built from host data on the device...).
    """
    from deepmd_hybridmuon import kernels

    shapes = dict(SHAPES, **{"fit.layers.3.matrix": (240, 240), "fit.layers.4.matrix": (136, 240)})
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for k, s in shapes.items()}
    opt = HybridMuonOptimizer(list(params.values()), named_parameters=params.items())
    grads = [[torch.randn(p.shape, generator=gen).cuda() for p in params.values()] for _ in range(3)]

    def step(k: int) -> None:
        for p, g in zip(params.values(), grads[k % 3], strict=True):
            p.grad = g
        with torch.device("cuda"):
            opt.step()

    step(0)
    assert kernels.wait_ready(600), "background compilation did not finish"
    for k in range(4):  # engine rebuilt with the kernels, eager steps, graph captured
        step(k)
    assert opt._engines[0].graph is not None and opt._engines[0].triton
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(3):
            step(k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert all(torch.isfinite(p).all() for p in params.values())
