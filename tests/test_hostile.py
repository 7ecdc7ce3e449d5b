"""Hostile inputs ("nothing poisons a model"): one row per case, on every implementation that runs here.

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
import warnings
from collections.abc import Callable

import numpy as np
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
    ("lr", _edit(("param_groups", 0, "lr"), -1), "Invalid lr: -1; expected a value in [0, 1e+08]"),
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


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0-d", "1-element"])
def test_adam_powers_saved_as_tensors_resume_as_the_numbers_do(implementation, dtype, shape):
    # The check accepts a one-element tensor for beta1_pow / beta2_pow (deepmd's built-in steps on with
    # one); torch's load casts it to the parameter's dtype. The run goes on as from the saved numbers.
    def resumed(tensors: bool) -> list[torch.Tensor]:
        named = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in _named()]
        saved = _stepped(named).state_dict()
        if tensors:
            for entry in saved["state"].values():
                for key in ("beta1_pow", "beta2_pow"):
                    if key in entry:
                        entry[key] = torch.tensor(entry[key], dtype=torch.float64).reshape(shape)
        opt = make_optimizer([p for _, p in named], implementation, lr=1e-2, named_parameters=named)
        opt.load_state_dict(saved)
        for step in range(2):
            for _, p in named:
                p.grad = torch.full_like(p, 0.5 + step)
            opt.step()
        return [p.detach() for _, p in named]

    for got, want in zip(resumed(tensors=True), resumed(tensors=False), strict=True):
        assert torch.equal(got, want)


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


# ---------------------------------------------------------------------- round two: schedulers, values, state


def _net() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _loss(net: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return net(torch.randn(5, 6, generator=gen)).pow(2).mean()


SWA = torch.optim.swa_utils
LR = torch.optim.lr_scheduler
SCHEDULERS: dict[str, Callable] = {
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.9**s),
    "MultiplicativeLR": lambda o: torch.optim.lr_scheduler.MultiplicativeLR(o, lambda s: 0.95),
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "MultiStepLR": lambda o: torch.optim.lr_scheduler.MultiStepLR(o, milestones=[2, 4], gamma=0.5),
    "ConstantLR": lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4),
    "LinearLR": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.2, total_iters=5),
    "ExponentialLR": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.8),
    "PolynomialLR": lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=6),
    "CosineAnnealingWarmRestarts": lambda o: torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(o, T_0=3),
    "CyclicLR": lambda o: torch.optim.lr_scheduler.CyclicLR(o, base_lr=1e-3, max_lr=1e-2, step_size_up=2),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=20),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
    "SequentialLR": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [LR.ConstantLR(o, factor=0.5, total_iters=2), LR.ExponentialLR(o, 0.9)],
        milestones=[2],
    ),
    "ChainedScheduler": lambda o: torch.optim.lr_scheduler.ChainedScheduler(
        [LR.ConstantLR(o, factor=0.5, total_iters=2), LR.ExponentialLR(o, 0.9)]
    ),
    "SWALR": lambda o: SWA.SWALR(o, swa_lr=5e-3, anneal_epochs=3),
}


def test_the_scheduler_table_is_torchs_whole_list():
    schedulers = {
        name
        for name, value in vars(torch.optim.lr_scheduler).items()
        if isinstance(value, type) and name.endswith(("LR", "Scheduler", "Plateau", "Restarts"))
    }
    schedulers -= {"LRScheduler", "_LRScheduler"}  # the base classes
    assert schedulers | {"SWALR"} == set(SCHEDULERS)


def _run(net, opt, sched, steps: range) -> None:
    for step in steps:
        opt.zero_grad()
        loss = _loss(net, step)
        loss.backward()
        opt.step()
        sched.step(loss.item()) if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau) else sched.step()


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_state_saved_with_any_scheduler_resumes_as_an_uninterrupted_run(implementation, name):
    """Schedulers add keys to the param_groups (OneCycleLR max_lr, SWALR swa_lr, ...): the state loads with them."""
    net = _net()
    opt = make_optimizer(net.parameters(), implementation, lr=1e-2, named_parameters=net.named_parameters())
    sched = SCHEDULERS[name](opt)
    _run(net, opt, sched, range(3))
    saved = {"model": copy.deepcopy(net.state_dict()), "opt": opt.state_dict(), "sched": sched.state_dict()}
    _run(net, opt, sched, range(3, 6))

    resumed = _net()
    resumed.load_state_dict(saved["model"])
    fresh = make_optimizer(resumed.parameters(), implementation, lr=1e-2, named_parameters=resumed.named_parameters())
    fresh_sched = SCHEDULERS[name](fresh)
    fresh.load_state_dict(saved["opt"])
    fresh_sched.load_state_dict(saved["sched"])
    _run(resumed, fresh, fresh_sched, range(3, 6))
    for p, q in zip(net.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(p, q)  # the same arithmetic on the same values: bit for bit


def test_a_group_with_scheduler_keys_can_be_added():
    opt = HybridMuonOptimizer([torch.nn.Parameter(torch.randn(4, 4))])
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 5))], "initial_lr": 0.1, "max_lr": 1.0})
    assert opt.param_groups[1]["max_lr"] == 1.0


BAD_GROUP_VALUES: list[tuple[str, object, str]] = [
    ("lr", float("nan"), "Invalid lr: nan; expected a finite number"),
    ("lr", float("inf"), "Invalid lr: inf; expected a finite number"),
    ("momentum", float("nan"), "Invalid momentum: nan; expected a finite number"),
    ("momentum", 1.5, "Invalid momentum: 1.5; expected a value in [0, 1)"),
    ("weight_decay", -100.0, "Invalid weight_decay: -100.0; expected a value in [0, 1e+08]"),
    ("adam_betas", (0.9, float("nan")), "Invalid adam_betas[1]: nan; expected a finite number"),
    ("muon_mode", "3d", "Invalid muon_mode: '3d'; expected one of '2d', 'flat', 'slice'"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    ("key", "value", "message"), BAD_GROUP_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_GROUP_VALUES]
)
def test_a_bad_value_written_into_a_group_stops_the_step_before_anything_changes(implementation, key, value, message):
    named = _named()
    opt = make_optimizer([p for _, p in named], implementation, lr=1e-2, named_parameters=named)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(3, 5))]})
    params = [p for g in opt.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    before = [p.detach().clone() for p in params]
    state = {id(p): {k: torch.as_tensor(v).clone() for k, v in entry.items()} for p, entry in opt.state.items()}
    good = opt.param_groups[1][key]
    opt.param_groups[1][key] = value  # as a scheduler or a user's schedule may for one step
    with pytest.raises(ValueError, match=re.escape(message + " (in param_groups[1] at step(); nothing was changed)")):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))  # group 0 did not step either
    for p, entry in opt.state.items():
        assert all(torch.equal(torch.as_tensor(v), state[id(p)][k]) for k, v in entry.items())
    opt.param_groups[1][key] = good  # the value recovers: the run goes on, finite
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, q) for p, q in zip(params, before, strict=True))


def test_a_list_of_betas_changed_in_place_is_checked_at_the_next_step():
    """``adam_betas`` given as a list stays the group's object: a change in place is a change all the same."""
    w, b = torch.nn.Parameter(torch.randn(4, 5)), torch.nn.Parameter(torch.ones(5))
    opt = HybridMuonOptimizer([w], lr=1e-2)
    opt.add_param_group({"params": [b], "adam_betas": [0.9, 0.95]})
    w.grad, b.grad = torch.randn(4, 5), torch.ones(5)
    opt.step()
    opt.param_groups[1]["adam_betas"][1] = 1.0
    with pytest.raises(ValueError, match=re.escape("Invalid adam_betas[1]: 1.0; expected a value in [0, 1)")):
        opt.step()


def test_a_tensor_learning_rate_changed_in_place_is_checked_at_the_next_step():
    """torch's schedulers write a tensor learning rate with ``fill_``: the same object, another value."""
    w = torch.nn.Parameter(torch.randn(4, 5))
    opt = HybridMuonOptimizer([w], lr=torch.tensor(1e-2))
    w.grad = torch.randn(4, 5)
    opt.step()
    before = w.detach().clone()
    opt.param_groups[0]["lr"].fill_(float("nan"))
    with pytest.raises(ValueError, match=re.escape("Invalid lr: tensor(nan); expected a finite number")):
        opt.step()
    assert torch.equal(w, before)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("first", "then", "kept"), [("slice", "2d", "exp_avg"), ("2d", "slice", "momentum_buffer")])
def test_a_route_changed_between_steps_keeps_one_rule_and_a_loadable_checkpoint(implementation, first, then, kept):
    """A 3-D weight is Muon's under "slice" and AdamW's under "2d": the rule it leaves takes its state along."""
    w = torch.nn.Parameter(torch.randn(4, 8, 8))
    opt = make_optimizer([w], implementation, lr=1e-2, muon_mode=first)
    for mode in (first, then):
        opt.param_groups[0]["muon_mode"] = mode
        w.grad = torch.randn(4, 8, 8)
        opt.step()
    assert kept in opt.state[w] and not {"exp_avg", "momentum_buffer"} - {kept} & set(opt.state[w])
    HybridMuonOptimizer([torch.nn.Parameter(w.detach().clone())], muon_mode=then).load_state_dict(opt.state_dict())


IMPOSSIBLE_STATE = [
    ("negative-second-moment", ("state", 1, "exp_avg_sq"), -torch.ones(4), "state exp_avg_sq of parameter 1"),
    ("huge-first-moment", ("state", 1, "exp_avg"), torch.full((4,), 3e38), "state exp_avg of parameter 1"),
    ("huge-momentum", ("state", 0, "momentum_buffer"), torch.full((8, 4), 3e38), "momentum_buffer of parameter 0"),
    ("magma-length-5", ("state", 0, "magma_score"), torch.full((5,), 0.5), "shape (5,); expected one score per matrix"),
    ("magma-length-0", ("state", 0, "magma_score"), torch.zeros(0), "shape (0,); expected one score per matrix"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("case", "path", "value", "message"), IMPOSSIBLE_STATE, ids=[c[0] for c in IMPOSSIBLE_STATE])
def test_state_no_run_can_write_is_refused(implementation, case, path, value, message):
    named = _named()
    opt = _stepped(named)
    use_implementation(opt, implementation)
    bad = _edit(path, value)(opt.state_dict())
    before = opt.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k, entry in before["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][kk])) for kk, v in entry.items())


def test_deepmds_adamuon_state_dict_is_another_optimizers():
    """AdaMuon's groups have lr, momentum and adam_betas too, and no routing key: not taken for HybridMuon's."""
    from deepmd.pt.optimizer import AdaMuonOptimizer

    from deepmd_hybridmuon.state import written_by_hybridmuon

    w = torch.nn.Parameter(torch.randn(4, 4))
    saved = AdaMuonOptimizer([w]).state_dict()
    assert written_by_hybridmuon(saved) is False
    with pytest.raises(ValueError, match=re.escape("lacks the HybridMuon keys ['muon_mode']")):
        HybridMuonOptimizer([w]).load_state_dict(saved)


def test_a_state_dict_without_a_later_option_takes_its_default_and_keeps_its_state():
    """A checkpoint written before an option existed (or by the built-in) resumes with the option's default."""
    named = _named()
    saved = _stepped(named).state_dict()
    for group in saved["param_groups"]:
        del group["magma_muon"], group["enable_gram"]
    opt = HybridMuonOptimizer([p for _, p in _named()], lr=1e-2, magma_muon=False, named_parameters=_named())
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["magma_muon"] is True and opt.param_groups[0]["enable_gram"] is True  # the defaults
    momentum = next(entry["momentum_buffer"] for entry in opt.state.values() if "momentum_buffer" in entry)
    assert torch.equal(momentum, saved["state"][0]["momentum_buffer"])


@pytest.mark.parametrize(("only_2d", "mode"), [(True, "2d"), (False, "flat")])
def test_a_deepmd_3_1_state_dict_keeps_its_routing_and_its_momentum(only_2d, mode):
    """deepmd-kit 3.1 wrote ``muon_2d_only`` (and ``min_2d_dim``) where later versions write ``muon_mode``.

    It is read as the checkpoint's ``muon_mode``, not the default, so its state matches the routing it was
    written under.
    """
    saved = _stepped(_named()).state_dict()
    for group in saved["param_groups"]:
        del group["muon_mode"], group["magma_muon"], group["enable_gram"]
        group.update(muon_2d_only=only_2d, min_2d_dim=1)
    opt = HybridMuonOptimizer([p for _, p in _named()], lr=1e-2, named_parameters=_named())
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["muon_mode"] == mode
    assert not {"muon_2d_only", "min_2d_dim"} & set(opt.param_groups[0])
    momentum = next(entry["momentum_buffer"] for entry in opt.state.values() if "momentum_buffer" in entry)
    assert torch.equal(momentum, saved["state"][0]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_precision_model_resumes_with_its_float32_moments_and_scores(dtype):
    """torch casts the loaded state to each parameter's dtype: float16 made an exp_avg_sq above 65504 inf."""
    w, b = torch.nn.Parameter(torch.randn(8, 16).to(dtype)), torch.nn.Parameter(torch.zeros(16, dtype=dtype))
    opt = HybridMuonOptimizer([w, b], lr=1e-3, named_parameters=[("w", w), ("bias", b)])
    for _ in range(2):
        w.grad, b.grad = torch.randn(8, 16).to(dtype), torch.full((16,), 3000.0, dtype=dtype)
        opt.step()
    saved = opt.state_dict()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer))
    kept = [(p, key) for p in (w, b) for key in ("exp_avg", "exp_avg_sq", "magma_score") if key in opt.state[p]]
    assert len(kept) == 3  # both moments of the bias, the score of the matrix
    for p, key in kept:
        assert torch.equal(opt.state[p][key], saved["state"][int(p is b)][key]), key  # bit for bit, float32
    w.grad, b.grad = torch.randn(8, 16).to(dtype), torch.full((16,), 3000.0, dtype=dtype)
    opt.step()
    assert torch.isfinite(b).all()


def test_triton_interpret_in_the_environment_trains_on_the_cpu():
    """A user who sets TRITON_INTERPRET=1 to debug other kernels still trains: the package keeps the torch path."""
    import os
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from deepmd_hybridmuon import HybridMuonOptimizer\n"
        "w = torch.nn.Parameter(torch.randn(8, 4))\n"
        "opt = HybridMuonOptimizer([w], lr=1e-2)\n"
        "for _ in range(2):\n"
        "    w.grad = torch.randn(8, 4)\n"
        "    opt.step()\n"
        "assert torch.isfinite(w).all()\n"
        "print(opt.execution_table()[0]['kernels'])\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["torch"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_same_tensor_twice_in_a_group_is_refused(implementation):
    w = torch.nn.Parameter(torch.randn(4, 4))
    message = "Invalid parameter 1 of param_group 0: the same tensor as parameter 0; expected each parameter once"
    with pytest.warns(UserWarning, match="duplicate parameters"), pytest.raises(ValueError, match=re.escape(message)):
        make_optimizer([w, w], implementation)
    opt = make_optimizer([torch.nn.Parameter(torch.randn(2, 2))], implementation)
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=re.escape(message.replace("group 0", "group 1"))):
        opt.add_param_group({"params": [w, w]})
    assert len(opt.param_groups) == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_parameter_replaced_by_another_size_is_named_before_anything_changes(implementation):
    named = _named()
    opt = _stepped(named)
    use_implementation(opt, implementation)
    (_, w), (_, b) = named
    w.data = torch.randn(5, 4)  # another size: its state has no element-wise meaning any more
    before = [w.detach().clone(), b.detach().clone()]
    w.grad, b.grad = torch.ones_like(w), torch.ones_like(b)
    message = "Invalid parameter 'fit.w': 20 elements, but its state momentum_buffer has 32"
    with pytest.raises(ValueError, match=re.escape(message)):
        opt.step()
    assert torch.equal(w, before[0]) and torch.equal(b, before[1])
    del opt.state[w]  # what the message says to do
    opt.step()
    assert opt.state[w]["momentum_buffer"].shape == (5, 4)


# --- the masked step and frozen parameters


def _branch_steps(implementation: str, edit: Callable | None, **options) -> tuple[list[dict], list[bool]]:
    """Two branches (a Muon matrix and an Adam bias each) step together once, ``edit`` changes the state, then branch
    a steps twice alone (b's gradients None). The parameters after each lone step; whether b and its state stayed."""
    gen = torch.Generator().manual_seed(7)
    shapes = (("a.w", (2, 6, 5)), ("a.bias", (5,)), ("b.w", (2, 6, 5)), ("b.bias", (5,)))
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes]
    options = {"lr": 1e-2, "weight_decay": 0.01, "muon_mode": "slice", **options}
    opt = make_optimizer([p for _, p in named], implementation, named_parameters=named, **options)
    for _, p in named:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    if edit is not None:
        edit(opt.state, dict(named))
    moved, kept = [], []
    b = [p for n, p in named if n.startswith("b.")]
    for _ in range(2):
        for name, p in named:
            p.grad = None if name.startswith("b.") else torch.randn(p.shape, generator=gen)
        before = [(p.detach().clone(), {k: _copy(v) for k, v in opt.state[p].items()}) for p in b]
        opt.step()
        moved.append({n: p.detach().clone() for n, p in named})
        same = [
            torch.equal(p, v) and all(_same(s[k], opt.state[p][k]) for k in s)
            for p, (v, s) in zip(b, before, strict=True)
        ]
        kept.append(all(same))
    return moved, kept


def _copy(value):
    return value.detach().clone() if torch.is_tensor(value) else value


def _same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) else a == b


def _set(name: str, **values) -> Callable[[dict, dict], None]:
    """An edit of ``name``'s state: each key's new value, or a function of the old one."""

    def edit(state: dict, params: dict) -> None:
        entry = state[params[name]]
        for key, value in values.items():
            entry[key] = value(entry[key]) if callable(value) else value

    return edit


#: State of the branch without gradients, each value in state.STATE_RANGES, that the step must not read:
#: (case, edit, options).
UNREAD_STATE = [
    ("beta1_pow-1", _set("b.bias", beta1_pow=1.0), {}),  # engine: ZeroDivisionError, a's powers advanced
    ("exp_avg-9e18", _set("b.bias", exp_avg=lambda t: torch.full_like(t, 9e18), exp_avg_sq=torch.zeros_like), {}),
    ("beta2_pow-1", _set("b.bias", beta2_pow=1.0, exp_avg_sq=torch.zeros_like), {}),  # engine: NaN in b.bias
    (
        "momentum-at-GRAD_LIMIT",
        _set("b.w", momentum_buffer=lambda t: t.index_fill(0, torch.tensor(0), F.GRAD_LIMIT)),
        {},
    ),
    # The last step's Adam update, left in b's slot, reached the gate (at an Adam rate of 1e19, which the settings'
    # bounds now refuse: the largest rate they allow, 1e16).
    ("adam-rate-1e16", None, {"lr": 1e8, "lr_adjust": 1e-8, "weight_decay": 0.0}),
]


@pytest.mark.parametrize(("case", "edit", "options"), UNREAD_STATE, ids=[c[0] for c in UNREAD_STATE])
def test_a_parameter_without_a_gradient_takes_no_part_in_the_step(case, edit, options):
    """The engine's masked step leaves b alone, as the loop does: not in the gate, the powers or any ratio."""
    engine, kept = _branch_steps("engine", edit, **options)
    loop, kept_loop = _branch_steps("loop", edit, **options)
    assert kept_loop == [True, True] and kept == [True, True]  # b and its state bit for bit
    for step, (ours, ref) in enumerate(zip(engine, loop, strict=True)):
        for name, value in ref.items():
            assert torch.equal(ours[name], value), (step, name)  # the engine's CPU step is the loop's, bit for bit
    assert not torch.equal(engine[0]["a.w"], engine[1]["a.w"])  # a stepped (not skipped)


def _mode_changes(implementation: str) -> tuple[list[torch.Tensor], list[bool]]:
    """Two Muon matrices of three dimensions step under "slice"; then under "flat", w without a gradient; then
    under "slice" again. Their values and scores; whether w's scores stayed in the "flat" step."""
    gen = torch.Generator().manual_seed(8)
    w, v = (torch.nn.Parameter(torch.randn(2, 6, 5, generator=gen)) for _ in range(2))
    opt = make_optimizer([w, v], implementation, lr=1e-2, magma_muon=True, muon_mode="slice")
    kept = []
    for mode, trained in (("slice", (w, v)), ("flat", (v,)), ("slice", (w, v))):
        opt.param_groups[0]["muon_mode"] = mode
        for p in (w, v):
            p.grad = torch.randn(p.shape, generator=gen) if any(p is q for q in trained) else None
        scores = opt.state[w]["magma_score"].clone() if w in opt.state else None
        opt.step()
        kept.append(scores is not None and torch.equal(opt.state[w]["magma_score"], scores))
    return [w.detach(), v.detach(), opt.state[w]["magma_score"], opt.state[v]["magma_score"]], kept


def test_muon_mode_changed_while_a_matrix_has_no_gradient_leaves_its_scores_alone():
    """Magma's scores of a matrix without a gradient are not laid out again for another view: it takes no step."""
    engine, kept = _mode_changes("engine")
    loop, kept_loop = _mode_changes("loop")
    assert kept_loop[1] and kept[1]  # w's two scores (one per matrix of its "slice" view) stay in the "flat" step
    for ours, ref in zip(engine, loop, strict=True):
        assert torch.equal(ours, ref)  # the engine's CPU step is the loop's, bit for bit


def _state_bytes(opt: HybridMuonOptimizer) -> int:
    """Bytes of the storages behind the optimizer's state tensors, each storage counted once."""
    storages = {}
    for entry in opt.state.values():
        for value in entry.values():
            if torch.is_tensor(value):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _frozen_one_at_a_time(implementation: str) -> tuple[HybridMuonOptimizer, list[torch.Tensor]]:
    """Nine layers (a Muon matrix and an Adam bias each); after each step one more layer is frozen, eight in all."""
    gen = torch.Generator().manual_seed(9)
    layers = [(torch.randn(16, 16, generator=gen), torch.randn(16, generator=gen)) for _ in range(9)]
    params = [torch.nn.Parameter(t) for layer in layers for t in layer]
    named = [(f"layers.{i // 2}.{'bias' if i % 2 else 'weight'}", p) for i, p in enumerate(params)]
    opt = make_optimizer(params, implementation, lr=1e-2, named_parameters=named)
    for frozen in range(9):
        for i, p in enumerate(params):
            p.requires_grad_(i >= 2 * frozen)
            p.grad = torch.randn(p.shape, generator=gen) if p.requires_grad else None
        opt.step()
    return opt, params


def test_parameters_frozen_one_at_a_time_release_the_engines_buffers():
    """A frozen layer's state is its own, not a view that keeps an earlier engine's flat buffers alive."""
    engine, ours = _frozen_one_at_a_time("engine")
    loop, ref = _frozen_one_at_a_time("loop")
    # The loop's state: the moments and momenta themselves. The engine's: the frozen layers' the same, the trained
    # layer's views of the flat buffers of the one engine alive, its size (5 times the loop's before the fix: the
    # frozen layers' views kept each earlier engine's buffers); 1.2: room for buffers a later layout may pad.
    assert _state_bytes(engine) <= 1.2 * _state_bytes(loop)
    for p, q in zip(ours, ref, strict=True):
        assert torch.equal(p, q)  # the engine's CPU step is the loop's, bit for bit


# --- settings, keys, names and loaded state


def _two_routes(implementation: str, **options) -> tuple[list[torch.nn.Parameter], HybridMuonOptimizer]:
    """A Muon matrix and an Adam bias, named, with gradients; not stepped yet."""
    named = _named()
    opt = make_optimizer([p for _, p in named], implementation, lr=1e-2, named_parameters=named, **options)
    for _, p in named:
        p.grad = torch.ones_like(p)
    return [p for _, p in named], opt


def _refused_at_step(opt: HybridMuonOptimizer, params: list[torch.Tensor], message: str) -> None:
    """``opt.step()`` raises ``message`` (as the start of its text) and changes no parameter."""
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_compiled_step_steps_as_the_step(implementation):
    """``torch.compile(opt.step)`` runs (dynamo failed on the check of the groups' keys) and steps as ``opt.step``.

    The "eager" backend: what failed was dynamo's tracing, which every backend shares; this one adds no code
    generation (no C compiler, seconds less on a CPU).
    """
    moved = []
    for compiled in (False, True):
        params, opt = _two_routes(implementation)
        step = torch.compile(opt.step, backend="eager") if compiled else opt.step
        for i in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.5 + i)
            step()
        moved.append([p.detach().clone() for p in params])
    assert all(torch.equal(p, q) for p, q in zip(*moved, strict=True))  # the same arithmetic: bit for bit


#: Keys another Muon or Adam optimizer reads (its routing, per-route settings) or another spelling of an option, with
#: the start of what the message says to use instead.
MISNAMED = [
    ("use_muon", True, "use param_names"),
    ("adam_lr", 1e-3, "use lr"),
    ("muon_lr", 2e-2, "use lr"),
    ("adamw_lr", 1e-3, "use lr"),
    ("beta1", 0.9, "use adam_betas"),
    ("beta2", 0.99, "use adam_betas"),
    ("adam_eps", 1e-8, "remove it: HybridMuon has no such setting"),
    ("wd", 0.1, "use weight_decay"),
    ("weight_decay_muon", 0.1, "use weight_decay"),
    ("muon_weight_decay", 0.1, "use weight_decay"),
    ("adam_weight_decay", 0.1, "use weight_decay"),
    ("nesterov_momentum", 0.9, "use momentum"),
    ("learning_rate", 1e-3, "use lr"),
    ("lr_scale", 2.0, "use lr"),
    (" lr", 1e-3, "use lr"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("key", "value", "use"), MISNAMED, ids=[k.strip() for k, _, _ in MISNAMED])
def test_a_key_that_names_a_setting_otherwise_is_refused_with_the_key_to_use(implementation, key, value, use):
    message = f"Invalid param_group key {key!r}: {value!r}; {use}"
    w = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        HybridMuonOptimizer([{"params": [w], key: value}])
    params, opt = _two_routes(implementation)
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        opt.add_param_group({"params": [w], key: value})
    assert len(opt.param_groups) == 1
    opt.step()
    opt.param_groups[0][key] = value  # written between steps
    _refused_at_step(opt, params, message)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("key", "value"), [("flash_muon", False), ("nonfinite_across_ranks", True)])
def test_an_optimizer_setting_written_into_a_group_is_refused_at_step(implementation, key, value):
    """Refused at construction and by add_param_group; written after, it was ignored without a word."""
    params, opt = _two_routes(implementation)
    opt.step()
    opt.param_groups[0][key] = getattr(opt, key)  # the optimizer's own value (ZeRO-1's copy): accepted
    opt.step()
    opt.param_groups[0][key] = value
    _refused_at_step(opt, params, f"Invalid param_group key {key}: {value!r}; it is a setting of the whole optimizer")


def test_torchs_keys_are_silent_and_another_key_warns_once():
    torchs = {"initial_lr": 1e-2, "max_lr": 1e-1, "min_lr": 1e-4, "base_momentum": 0.85, "max_momentum": 0.95}
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = HybridMuonOptimizer([{"params": [("w", w)], **torchs, "swa_lr": 1e-3}])
        w.grad = torch.ones_like(w)
        opt.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's own filter
        opt.add_param_group({"params": [("b", b)], "name": "biases"})
        b.grad = torch.ones_like(b)
        opt.step()
        opt.param_groups[0]["name"] = "weights"
        opt.step()
    assert [str(w.message) for w in caught] == ["param_group key 'name' is no HybridMuon setting: kept and ignored"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_tensor_betas_changed_in_place_are_checked_at_the_next_step(implementation):
    params, opt = _two_routes(implementation, adam_betas=(torch.tensor(0.9), torch.tensor(0.95)))
    opt.step()
    opt.param_groups[0]["adam_betas"][1].fill_(1.5)
    message = "Invalid adam_betas[1]: tensor(1.5000); expected a value in [0, 1)"
    _refused_at_step(opt, params, message)
    opt.param_groups[0]["adam_betas"] = (0.9, 1.5)  # and a plain pair after them
    _refused_at_step(opt, params, "Invalid adam_betas[1]: 1.5; expected a value in [0, 1)")


#: Finite settings whose first step overflowed into inf or NaN parameters, and the bound that refuses them.
OVERFLOWING = [
    ("weight_decay", 1e308, "expected a value in [0, 1e+08]"),
    ("lr_adjust_coeff", 1e308, "expected a value in [0, 1e+08]"),
    ("lr_adjust", 5e-324, "expected a finite number <= 0 or >= 1e-08"),
    ("lr", 1e308, "expected a value in [0, 1e+08]"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(("key", "value", "allowed"), OVERFLOWING, ids=[k for k, _, _ in OVERFLOWING])
def test_a_setting_that_overflows_the_first_step_is_refused(implementation, key, value, allowed):
    message = f"Invalid {key}: {value!r}; {allowed}"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        make_optimizer([torch.nn.Parameter(torch.randn(4, 3))], implementation, **{key: value})
    params, opt = _two_routes(implementation)
    opt.param_groups[0][key] = value
    _refused_at_step(opt, params, message)


@pytest.mark.parametrize(
    ("section", "key", "value", "shown"),
    [
        ("optimizer", "lr_adjust", 1e-320, "key `lr_adjust`"),
        ("optimizer", "lr_adjust_coeff", 1e300, "key `lr_adjust_coeff`"),
        ("learning_rate", "start_lr", 1e300, "Invalid lr: 1e+300; expected a value in [0, 1e+08]"),
    ],
)
def test_dp_check_refuses_a_setting_that_overflows_the_first_step(tmp_path, capsys, section, key, value, shown):
    import json
    from pathlib import Path

    from deepmd_hybridmuon.cli import main

    config = json.loads((Path(__file__).resolve().parents[1] / "examples" / "input.json").read_text())
    config[section][key] = value
    path = tmp_path / "input.json"
    path.write_text(json.dumps(config))
    assert main(["check", "--no-routing", str(path)]) == 1
    err = capsys.readouterr().err
    assert shown in err and repr(value) in err, err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 10**400}, "Invalid lr: 1000000"),
        ({"lr": torch.tensor(1e-3, device="meta")}, "Invalid lr: tensor(..., device='meta', size=()); expected a real"),
        ({"adam_betas": np.array([0.9, 0.95])}, "Invalid adam_betas: array([0.9 , 0.95]); expected a pair"),
    ],
    ids=["lr-10**400", "lr-meta", "betas-numpy"],
)
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_value_without_a_number_is_named_in_the_message(implementation, options, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        HybridMuonOptimizer([torch.nn.Parameter(torch.randn(4, 3))], **options)
    params, opt = _two_routes(implementation)
    opt.step()
    opt.param_groups[0].update(options)  # written between steps
    _refused_at_step(opt, params, message)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_param_names_of_another_length_are_refused_before_anything_changes(implementation):
    w1, w2, w3 = (torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3))
    message = "Invalid param_names of param_group 0: ['w1']; expected one name per parameter (2)"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        HybridMuonOptimizer([{"params": [w1, w2], "param_names": ["w1"]}])
    opt = make_optimizer([{"params": [w1], "param_names": ["w1"]}], implementation)
    with pytest.raises(ValueError, match="^" + re.escape(message.replace("0: ['w1']", "1: ['adamw_x']"))):
        opt.add_param_group({"params": [w2, w3], "param_names": ["adamw_x"]})
    assert len(opt.param_groups) == 1 and opt.param_name(w2) is None
    before = [w2.detach().clone(), w3.detach().clone()]
    for w in (w1, w2, w3):
        w.grad = torch.ones_like(w)
    opt.step()
    assert torch.equal(w2, before[0]) and torch.equal(w3, before[1])  # they are no part of the optimizer
    saved = _edit(("param_groups", 0, "param_names"), ["w1", "w2"])(opt.state_dict())
    message = "Invalid param_names of param_groups[0] of the state dict: ['w1', 'w2']; expected one name per parameter"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        opt.load_state_dict(saved)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_state_dict_saved_with_names_routes_as_when_saved(implementation):
    """Built from named parameters (torch's ``param_names``), loaded into an optimizer built without names."""
    gen = torch.Generator().manual_seed(7)
    gain, w = (torch.nn.Parameter(torch.randn(6, 4, generator=gen)) for _ in range(2))
    grads = [torch.randn(6, 4, generator=gen) for _ in range(3)]
    opt = make_optimizer([("adamw_gain", gain), ("w", w)], implementation, lr=1e-2)
    twin = [torch.nn.Parameter(gain.detach().clone()), torch.nn.Parameter(w.detach().clone())]
    gain.grad = w.grad = grads[0]
    opt.step()
    fresh = make_optimizer(twin, implementation, lr=1e-2)
    for p, q in zip(twin, (gain, w), strict=True):
        p.data.copy_(q)
    fresh.load_state_dict(opt.state_dict())
    for grad in grads[1:]:
        for p in (gain, w, *twin):
            p.grad = grad
        opt.step()
        fresh.step()
    assert [row["route"] for row in fresh.routing_table()] == ["adamw", "muon"]
    assert torch.equal(twin[0], gain) and torch.equal(twin[1], w)  # the same run on: bit for bit
    assert torch.equal(fresh.state[twin[0]]["exp_avg"], opt.state[gain]["exp_avg"])


def _aliased(kind: str) -> Callable[[dict], dict]:
    """A state dict whose tensors share memory: ``kind`` says how."""

    def make(good: dict) -> dict:
        out = copy.deepcopy(good)
        bias = out["state"][1]
        if kind == "one-tensor-both-moments":
            bias["exp_avg_sq"] = bias["exp_avg"] = bias["exp_avg_sq"].clone()
        elif kind == "views-of-another-parameters":  # the bias's moments are rows of the matrix's momentum
            momentum = out["state"][0]["momentum_buffer"]
            momentum[0].copy_(bias["exp_avg"])
            momentum[1].copy_(bias["exp_avg_sq"])
            bias["exp_avg"], bias["exp_avg_sq"] = momentum[0], momentum[1]
        else:  # expanded: every element one number, stride 0
            bias["exp_avg"] = bias["exp_avg"][:1].clone().expand(4)
        return out

    return make


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["one-tensor-both-moments", "views-of-another-parameters", "expanded"])
def test_state_tensors_that_share_memory_load_as_copies(implementation, kind):
    """The run on equals the run on the same values in tensors of their own."""
    runs = []
    for share in (True, False):
        named = _named()
        opt = _stepped(named)
        use_implementation(opt, implementation)
        saved = _aliased(kind)(opt.state_dict())
        if not share:
            saved["state"] = {k: {kk: copy.deepcopy(v) for kk, v in e.items()} for k, e in saved["state"].items()}
            for entry in saved["state"].values():
                entry.update({k: v.contiguous() for k, v in entry.items() if torch.is_tensor(v)})
        opt.load_state_dict(saved)
        for step in range(2):
            for _, p in named:
                p.grad = torch.full_like(p, 0.5 + step)
            opt.step()
        runs.append([p.detach() for _, p in named])
    assert all(torch.isfinite(p).all() for p in runs[0])
    assert all(torch.equal(p, q) for p, q in zip(*runs, strict=True))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_moments_no_run_can_write_together_are_refused(implementation):
    """Each in its range, jointly impossible: exp_avg 9e18 where exp_avg_sq is 0 gave -inf at a zero gradient."""
    named = _named()
    opt = _stepped(named)
    use_implementation(opt, implementation)
    bad = _edit(("state", 1, "exp_avg"), torch.full((4,), 9e18))(opt.state_dict())
    bad["state"][1]["exp_avg_sq"] = torch.zeros(4)
    before = opt.state_dict()
    message = "Invalid state exp_avg of parameter 1 ('fit.b'): |exp_avg| / (sqrt(exp_avg_sq) + 1e-20) reaches 9e+38"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    for k, entry in before["state"].items():
        assert all(torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][k][kk])) for kk, v in entry.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_load_post_hook_edit_survives(dtype):
    """The float32 moments of a half-precision model were put back after the post-hooks ran, undoing their edits."""
    named = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in _named()]
    opt = _stepped(named)
    saved = opt.state_dict()

    def edit(optimizer: HybridMuonOptimizer) -> None:
        optimizer.state[named[1][1]]["exp_avg"].fill_(0.25)

    opt.register_load_state_dict_post_hook(edit)
    opt.load_state_dict(saved)
    assert torch.equal(opt.state[named[1][1]]["exp_avg"], torch.full((4,), 0.25))


# --- review of round three


def test_a_zero1_checkpoints_groups_resume_without_zero1():
    # ZeroRedundancyOptimizer writes the constructor's settings into its groups, and so into every ZeRO-1 checkpoint;
    # torch's load keeps a saved group's keys. Resumed on one GPU (or DDP, FSDP2) they must not stop the step.
    p = torch.nn.Parameter(torch.randn(4, 3))
    p.grad = torch.randn(4, 3)
    opt = HybridMuonOptimizer([p], lr=1e-3)
    opt.step()
    saved = opt.state_dict()
    saved["param_groups"][0].update(flash_muon=True, nonfinite_across_ranks=True, use_foreach=None)
    resumed = HybridMuonOptimizer([p], lr=1e-3)
    resumed.load_state_dict(saved)
    resumed.step()
    assert not {"flash_muon", "nonfinite_across_ranks", "use_foreach"} & resumed.param_groups[0].keys()


def test_a_learning_rate_beyond_floats_range_of_any_real_type_names_key_and_value():
    import fractions

    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match=r"Invalid lr: .*expected a finite number"):
        HybridMuonOptimizer([p], lr=fractions.Fraction(10**400))
