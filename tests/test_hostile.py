"""Hostile inputs (issue 25, "Nothing poisons a model"): one row per case, on every implementation that runs here.

Each row failed on the code before the fix: a huge but finite gradient turned parameters or
state into NaN (or froze Adam with an infinite second moment), a foreign or corrupted state
dict loaded and failed later, complex and sparse parameters were stepped wrongly or half-way,
an in-place reshape crashed the engine, and the optimizer could not be copied or pickled.
"""

from __future__ import annotations

import copy
import io
import logging
import pickle
import re
from collections.abc import Callable

import pytest
import torch
from conftest import make_optimizer, use_implementation

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import functional as F

IMPLEMENTATIONS = ["engine", "loop"]

# ---------------------------------------------------------------------- huge gradients


def _muon_model(dtype: torch.dtype, scale: float | None) -> tuple[list[torch.nn.Parameter], list[torch.Tensor]]:
    """Two Muon matrices and their gradients, the largest element of each of magnitude ``scale`` (dtype max: None)."""
    gen = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in ((8, 4), (2, 6, 5))]
    top = float(torch.finfo(dtype).max) if scale is None else scale
    grads = []
    for p in params:
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        grads.append((g / g.abs().max() * top).to(dtype))
    return params, grads


def _one_step(implementation: str, dtype: torch.dtype, scale: float | None) -> tuple[list, HybridMuonOptimizer]:
    params, grads = _muon_model(dtype, scale)
    opt = make_optimizer(params, implementation, lr=0.5, magma_muon=True, muon_mode="slice", weight_decay=0.01)
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    opt.step()
    return params, opt


#: float16's largest number (65504, scale None) is its only huge one; float32's and bfloat16's
#: largest (beyond functional.GRAD_LIMIT) skip the step: their own test below.
HUGE = [(dtype, scale) for dtype in (torch.float32, torch.bfloat16) for scale in (1e20, 1e30)]
HUGE.append((torch.float16, None))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("dtype", "scale"), HUGE, ids=[f"{str(d).removeprefix('torch.')}-{s or 'max'}" for d, s in HUGE]
)
def test_huge_finite_gradient_steps_muon_as_a_small_one(implementation, dtype, scale):
    """Newton–Schulz and Magma's cosine are scale-invariant: the step equals the step on the gradient scaled to 1."""
    params, opt = _one_step(implementation, dtype, scale)
    small, _ = _one_step(implementation, dtype, 1.0)
    for p, q in zip(params, small, strict=True):
        assert torch.isfinite(p).all()
        # One rounding of the inputs of Newton–Schulz (bfloat16) differs: about one ulp of the
        # parameters' dtype (bfloat16: 2^-8 relative) of the update of 0.5 * sqrt(8) * 0.1.
        torch.testing.assert_close(p, q, rtol=2**-7, atol=2e-2)
    for entry in opt.state.values():
        for key, value in entry.items():
            if torch.is_tensor(value):
                assert torch.isfinite(value).all(), key
    scores = [e["magma_score"] for e in opt.state.values()]
    # the first score from 0.5: 0.9 * 0.5 + 0.1 * raw, raw in [0, 1] (NaN before the fix)
    assert all(((s >= 0.45) & (s <= 0.55)).all() for s in scores)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_muon_gradient_at_half_float32s_largest_number_skips_the_step(implementation, dtype):
    """|g| >= 2^127, in any dtype: the momentum's lerp of two such numbers would overflow.

    Two steps of float32's largest gradients (of opposite signs in places: the lerp's
    difference) would leave an infinite momentum; each such step is skipped like a non-finite
    one, and gradients of half the limit step, leaving everything finite.
    """
    params, grads = _muon_model(dtype, float(torch.finfo(torch.float32).max))
    before = [p.detach().clone() for p in params]
    opt = make_optimizer(params, implementation, lr=0.5, magma_muon=True, muon_mode="slice")
    for sign in (1, -1):
        for p, g in zip(params, grads, strict=True):
            p.grad = sign * g
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    below = F.GRAD_LIMIT / 2  # exact in every dtype (bfloat16 rounds the numbers next to the limit up to it)
    for sign in (1, -1):
        for p in params:
            g = torch.randn(p.shape, dtype=torch.float64)
            p.grad = sign * (g / g.abs().max() * below).to(dtype)
        opt.step()
    assert not any(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert all(torch.isfinite(p).all() for p in params)
    assert all(torch.isfinite(v).all() for e in opt.state.values() for v in e.values() if torch.is_tensor(v))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("size", [1e20, 1e30])
def test_adam_gradient_beyond_float32_moments_skips_the_step_with_one_log_line(implementation, size, caplog):
    """|g| >= 2^63: g^2 does not fit the float32 second moment (torch's AdamW stores inf and freezes)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(8, 4, generator=gen))
    b = torch.nn.Parameter(torch.randn(4, generator=gen))
    opt = make_optimizer([w, b], implementation, lr=1e-2, named_parameters=[("w", w), ("b", b)])
    before = [w.detach().clone(), b.detach().clone()]
    w.grad, b.grad = torch.randn(8, 4, generator=gen), size * torch.randn(4, generator=gen)
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        opt.step()
        opt.step()
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    assert all(torch.isfinite(v).all() for e in opt.state.values() for v in e.values() if torch.is_tensor(v))
    assert len([r for r in caplog.records if "step skipped" in r.getMessage()]) == 1
    w.grad, b.grad = torch.randn(8, 4, generator=gen), torch.randn(4, generator=gen)
    opt.step()  # a sane gradient steps again
    assert not torch.equal(b, before[1]) and torch.isfinite(b).all()


# ---------------------------------------------------------------------- state dicts


def _named() -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(5)
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in (("fit.w", (8, 4)), ("fit.b", (4,)))]


def _stepped(named) -> HybridMuonOptimizer:
    opt = HybridMuonOptimizer([p for _, p in named], lr=1e-2, magma_muon=True, named_parameters=named)
    for _, p in named:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def _foreign(kind: str) -> Callable[[dict], dict]:
    def make(good: dict) -> dict:
        params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
        other = torch.optim.AdamW(params) if kind.startswith("AdamW") else torch.optim.Muon(params[:1])
        for p in params:
            p.grad = torch.ones_like(p)
        other.step()
        out = other.state_dict()
        if kind == "AdamW-state":
            return {**copy.deepcopy(good), "state": out["state"]}
        return out

    return make


def _edit(path: tuple, value) -> Callable[[dict], dict]:
    def make(good: dict) -> dict:
        out = copy.deepcopy(good)
        target = out
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
        return out

    return make


BAD_STATE_DICTS = [
    ("AdamW", _foreign("AdamW"), "Invalid param_groups[0]: lacks the HybridMuon keys ['momentum', 'adam_betas'"),
    ("Muon", _foreign("Muon"), "Invalid param_groups[0]: lacks the HybridMuon keys ['adam_betas'"),
    ("AdamW-state", _foreign("AdamW-state"), "Invalid state of parameter 0 ('fit.w'): unknown keys ['step']"),
    ("momentum", _edit(("param_groups", 0, "momentum"), 1.5), "Invalid momentum: 1.5; expected a value in [0, 1)"),
    ("lr", _edit(("param_groups", 0, "lr"), -1), "Invalid lr: -1; expected a value in [0, inf)"),
    ("betas", _edit(("param_groups", 0, "adam_betas"), (1, 2)), "Invalid adam_betas[0]: 1; expected a value in [0, 1)"),
    ("magma", _edit(("param_groups", 0, "magma_muon"), "yes"), "Invalid magma_muon: 'yes'; expected true or false"),
    (
        "shape",
        _edit(("state", 0, "momentum_buffer"), torch.zeros(4, 8)),
        "Invalid state momentum_buffer of parameter 0 ('fit.w'): shape (4, 8); expected the parameter's (8, 4)",
    ),
    (
        "dtype",
        _edit(("state", 0, "momentum_buffer"), torch.zeros(8, 4, dtype=torch.int64)),
        "Invalid state momentum_buffer of parameter 0 ('fit.w'): torch.int64; expected a real floating-point tensor",
    ),
    (
        "adam-partial",
        _edit(("state", 1, "beta1_pow"), None),
        "Invalid state beta1_pow of parameter 1 ('fit.b'): None; expected a number in [0, 1]",
    ),
    (
        "nan-moment",
        _edit(("state", 1, "exp_avg_sq"), torch.full((4,), float("nan"))),
        "Invalid state exp_avg_sq of parameter 1 ('fit.b'): holds NaN or infinity",
    ),
    ("index", _edit(("state", 7), {}), "Invalid state key 7; expected one of the saved param_groups' params [0, 1]"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("case", "make", "message"), BAD_STATE_DICTS, ids=[c for c, _, _ in BAD_STATE_DICTS])
def test_bad_state_dict_is_refused_before_anything_changes(implementation, case, make, message):
    if case == "Muon" and not hasattr(torch.optim, "Muon"):
        pytest.skip("this torch has no torch.optim.Muon")
    source = _named()
    bad = make(_stepped(source).state_dict())
    named = _named()
    opt = _stepped(named)
    use_implementation(opt, implementation)
    before = {k: {kk: vv.clone() if torch.is_tensor(vv) else vv for kk, vv in v.items()} for k, v in opt.state.items()}
    groups_before = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(bad)
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == groups_before
    for p, entry in opt.state.items():
        for key, value in entry.items():
            assert torch.equal(value, before[p][key]) if torch.is_tensor(value) else value == before[p][key]
    for _, p in named:  # and it steps on
        p.grad = torch.ones_like(p)
    opt.step()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_state_dict_keyed_by_parameter_names_loads(implementation):
    # torch.distributed's get/set_optimizer_state_dict (deepmd's FSDP2 checkpoints) key the state
    # by parameter name; torch pairs the saved groups' params with the current ones by position.
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = HybridMuonOptimizer(net.parameters(), lr=1e-2, named_parameters=net.named_parameters())
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    saved = get_optimizer_state_dict(net, opt)
    assert "0.weight" in saved["state"]  # keyed by name, not index
    other = copy.deepcopy(net)
    fresh = HybridMuonOptimizer(other.parameters(), lr=1e-2, named_parameters=other.named_parameters())
    use_implementation(fresh, implementation)
    set_optimizer_state_dict(other, fresh, saved)
    for p, q in zip(net.parameters(), other.parameters(), strict=True):
        for key, value in opt.state[p].items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(fresh.state[q][key])), key


# ---------------------------------------------------------------------- parameters it cannot handle


def test_complex_parameter_is_refused_at_construction_and_add_param_group():
    z = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    message = "Invalid parameter 0 of param_group 0: dtype torch.complex64; expected a real floating-point parameter"
    with pytest.raises(ValueError, match=re.escape(message)):
        HybridMuonOptimizer([z])
    opt = HybridMuonOptimizer([torch.nn.Parameter(torch.randn(3, 3))])
    with pytest.raises(ValueError, match=re.escape(message.replace("group 0", "group 1"))):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sparse_gradient_is_refused_before_any_parameter_changes(implementation):
    torch.manual_seed(0)
    lin, emb = torch.nn.Linear(4, 4), torch.nn.Embedding(10, 4, sparse=True)
    opt = make_optimizer([*lin.parameters(), *emb.parameters()], implementation)
    lin(emb(torch.tensor([1, 2]))).sum().backward()
    before = [p.detach().clone() for p in lin.parameters()]
    with pytest.raises(ValueError, match=re.escape("Invalid gradient of parameter 2 of param_group 0: layout")):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(lin.parameters(), before, strict=True))
    assert not opt.state


def test_parameter_reshaped_in_place_steps_as_in_the_loop():
    """``p.data = p.data.view(...)``: same storage, new shape; the state follows element by element."""
    moved = {}
    for implementation in IMPLEMENTATIONS:
        gen = torch.Generator().manual_seed(2)
        w = torch.nn.Parameter(torch.randn(6, 8, generator=gen))
        b = torch.nn.Parameter(torch.randn(4, generator=gen))
        opt = make_optimizer([w, b], implementation, lr=1e-2, magma_muon=True)
        for step in range(4):
            if step == 2:
                w.data = w.data.view(8, 6)
            w.grad, b.grad = torch.randn(w.shape, generator=gen), torch.randn(4, generator=gen)
            opt.step()
        assert opt.state[w]["momentum_buffer"].shape == (8, 6)
        moved[implementation] = w.detach().clone()
    # the engine against the loop: tests/test_parity.py's tolerance (bf16 rounding of the scale product)
    torch.testing.assert_close(moved["engine"], moved["loop"], rtol=1e-2, atol=1e-4)


# ---------------------------------------------------------------------- copies


def _deepcopy(opt):
    return copy.deepcopy(opt)


def _pickle(opt):
    return pickle.loads(pickle.dumps(opt))


def _torch_save(opt):
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("fresh", [True, False], ids=["fresh", "stepped"])
@pytest.mark.parametrize("clone", [_deepcopy, _pickle, _torch_save], ids=["deepcopy", "pickle", "torch.save"])
def test_copy_of_the_optimizer_steps_identically(implementation, fresh, clone):
    named = _named()
    opt = make_optimizer([p for _, p in named], implementation, lr=1e-2, magma_muon=True, named_parameters=named)
    if not fresh:
        for _, p in named:
            p.grad = torch.randn(p.shape)
        opt.step()
    twin = clone(opt)
    twin_params = twin.param_groups[0]["params"]
    assert [twin.param_name(p) for p in twin_params] == [n for n, _ in named]
    gen = torch.Generator().manual_seed(8)
    for _ in range(2):
        for (_, p), q in zip(named, twin_params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        twin.step()
    assert all(torch.equal(p, q) for (_, p), q in zip(named, twin_params, strict=True))
