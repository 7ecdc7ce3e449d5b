"""Every user input is checked, with a ValueError that names the key, the value and what is allowed."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import make_optimizer
from test_parity import TORCH_MUON_TOL

from deepmd_hybridmuon import HybridMuonOptimizer

MODES = "expected one of '2d', 'flat', 'slice'"
UNIT = "expected a value in [0, 1)"
RATE = "expected a value in [0, 1e+08]"  # options.RATE_LIMIT
FINITE = "expected a finite number"
REAL = "expected a real number"
BOOL = "expected true or false"

#: (keyword arguments, exact message). Every message names the key, shows the value
#: as repr() and says what is allowed.
BAD_ARGUMENTS = [
    ({"muon_mode": "3d"}, f"Invalid muon_mode: '3d'; {MODES}"),
    ({"muon_mode": "Slice "}, f"Invalid muon_mode: 'Slice '; {MODES}"),
    ({"muon_mode": ""}, f"Invalid muon_mode: ''; {MODES}"),
    ({"muon_mode": None}, f"Invalid muon_mode: None; {MODES}"),
    ({"muon_mode": 2}, f"Invalid muon_mode: 2; {MODES}"),
    ({"lr": -1e-3}, f"Invalid lr: -0.001; {RATE}"),
    ({"lr": math.nan}, f"Invalid lr: nan; {FINITE}"),
    ({"lr": math.inf}, f"Invalid lr: inf; {FINITE}"),
    ({"lr": -math.inf}, f"Invalid lr: -inf; {FINITE}"),
    ({"lr": "1e-3"}, f"Invalid lr: '1e-3'; {REAL}"),
    ({"lr": True}, f"Invalid lr: True; {REAL}"),
    ({"lr": None}, f"Invalid lr: None; {REAL}"),
    ({"momentum": -0.1}, f"Invalid momentum: -0.1; {UNIT}"),
    ({"momentum": 1.0}, f"Invalid momentum: 1.0; {UNIT}"),
    ({"momentum": 1.5}, f"Invalid momentum: 1.5; {UNIT}"),
    ({"momentum": math.nan}, f"Invalid momentum: nan; {FINITE}"),
    ({"adam_betas": (-0.1, 0.95)}, f"Invalid adam_betas[0]: -0.1; {UNIT}"),
    ({"adam_betas": (0.9, -0.5)}, f"Invalid adam_betas[1]: -0.5; {UNIT}"),
    ({"adam_betas": (1.0, 0.95)}, f"Invalid adam_betas[0]: 1.0; {UNIT}"),
    ({"adam_betas": (0.9, 1.0)}, f"Invalid adam_betas[1]: 1.0; {UNIT}"),
    ({"adam_betas": (0.9, 1.01)}, f"Invalid adam_betas[1]: 1.01; {UNIT}"),
    ({"adam_betas": (0.9, math.nan)}, f"Invalid adam_betas[1]: nan; {FINITE}"),
    ({"adam_betas": (0.9,)}, "Invalid adam_betas: (0.9,); expected a pair (beta1, beta2)"),
    ({"adam_betas": (0.9, 0.95, 0.99)}, "Invalid adam_betas: (0.9, 0.95, 0.99); expected a pair (beta1, beta2)"),
    ({"adam_betas": 0.9}, "Invalid adam_betas: 0.9; expected a pair (beta1, beta2)"),
    ({"adam_betas": "ab"}, "Invalid adam_betas: 'ab'; expected a pair (beta1, beta2)"),
    ({"adam_betas": ("0.9", 0.95)}, f"Invalid adam_betas[0]: '0.9'; {REAL}"),
    ({"weight_decay": -1e-3}, f"Invalid weight_decay: -0.001; {RATE}"),
    ({"weight_decay": math.inf}, f"Invalid weight_decay: inf; {FINITE}"),
    ({"lr_adjust": math.nan}, f"Invalid lr_adjust: nan; {FINITE}"),
    ({"lr_adjust_coeff": -0.18}, f"Invalid lr_adjust_coeff: -0.18; {RATE}"),
    ({"enable_gram": "yes"}, f"Invalid enable_gram: 'yes'; {BOOL}"),
    ({"enable_gram": 1}, f"Invalid enable_gram: 1; {BOOL}"),
    ({"enable_gram": None}, f"Invalid enable_gram: None; {BOOL}"),
    ({"magma_muon": 0}, f"Invalid magma_muon: 0; {BOOL}"),
    ({"magma_muon": "false"}, f"Invalid magma_muon: 'false'; {BOOL}"),
    ({"flash_muon": "true"}, f"Invalid flash_muon: 'true'; {BOOL}"),
    ({"flash_muon": 1}, f"Invalid flash_muon: 1; {BOOL}"),
    ({"flash_muon": None}, f"Invalid flash_muon: None; {BOOL}"),
    ({"nonfinite_across_ranks": "yes"}, f"Invalid nonfinite_across_ranks: 'yes'; {BOOL}"),
]


def _ids(cases) -> list[str]:
    return [",".join(f"{k}={v!r}" for k, v in kwargs.items()) for kwargs, _ in cases]


def _param() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.ones(4, 3))


@pytest.mark.parametrize(("kwargs", "message"), BAD_ARGUMENTS, ids=_ids(BAD_ARGUMENTS))
def test_bad_constructor_argument(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        HybridMuonOptimizer([_param()], **kwargs)


#: The group-level hyperparameters (the other flags are optimizer-level).
OPTIMIZER_FLAGS = ("flash_muon", "nonfinite_across_ranks")
BAD_GROUP_VALUES = [(kw, msg) for kw, msg in BAD_ARGUMENTS if not set(kw) & set(OPTIMIZER_FLAGS)]


@pytest.mark.parametrize(("kwargs", "message"), BAD_GROUP_VALUES, ids=_ids(BAD_GROUP_VALUES))
def test_bad_param_group_value(kwargs: dict, message: str) -> None:
    # In a param_group dict given to the constructor ...
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        HybridMuonOptimizer([{"params": [_param()], **kwargs}])
    # ... and through add_param_group, which leaves the optimizer as it was.
    opt = HybridMuonOptimizer([_param()])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        opt.add_param_group({"params": [_param()], **kwargs})
    assert len(opt.param_groups) == 1


NO_SUCH = "remove it: HybridMuon has no such setting"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"betas": (0.9, 0.99)}, "Invalid param_group key 'betas': (0.9, 0.99); use adam_betas"),  # torch's Adam
        ({"nesterov": True}, f"Invalid param_group key 'nesterov': True; {NO_SUCH} (Muon always takes the Nesterov "),
        ({"Lr": 1e-3}, "Invalid param_group key 'Lr': 0.001; use lr"),
        # all of them, sorted; zeta is no hyperparameter (kept, with a warning)
        (
            {"betas": 1, "alpha": 2, "zeta": 3},
            f"Invalid param_group key 'alpha': 2; {NO_SUCH}; Invalid param_group key 'betas': 1; use adam_betas",
        ),
        # misspelt; the input's alias
        (
            {"momentun": 0.9, "muon_momentum": 0.9},
            "Invalid param_group key 'momentun': 0.9; use momentum; Invalid param_group key 'muon_momentum': 0.9; "
            "use momentum",
        ),
        ({"differentiable": False}, f"Invalid param_group key 'differentiable': False; {NO_SUCH}"),
    ],
)
def test_misnamed_param_group_keys(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        HybridMuonOptimizer([{"params": [_param()], **extra}])
    opt = HybridMuonOptimizer([_param()])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
        opt.add_param_group({"params": [_param()], **extra})
    assert len(opt.param_groups) == 1


def test_optimizer_level_keys_in_a_group_are_dropped() -> None:
    # ZeroRedundancyOptimizer copies every constructor keyword (deepmd's trainer passes
    # flash_muon and use_foreach) into the groups it hands to the local optimizer.
    group = {"params": [_param()], "flash_muon": True, "use_foreach": None, "nonfinite_across_ranks": False}
    opt = HybridMuonOptimizer([group])
    from deepmd_hybridmuon.validation import GROUP_KEYS

    assert set(opt.param_groups[0]) == {"params", *GROUP_KEYS}


@pytest.mark.parametrize(("key", "value"), [("flash_muon", False), ("nonfinite_across_ranks", True)])
def test_an_optimizer_setting_of_another_value_in_a_group_is_refused(key: str, value: object) -> None:
    # It would be dropped, and the group would run with the optimizer's setting instead.
    opt = HybridMuonOptimizer([_param()])
    default = getattr(opt, key)
    message = (
        f"Invalid param_group key {key}: {value!r}; it is a setting of the whole optimizer ({default!r} here), "
        "given to the constructor, not per param_group"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        opt.add_param_group({"params": [_param()], key: value})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [_param()], key: default})  # the same value: ZeRO-1's copy
    assert len(opt.param_groups) == 2


REMOVED = (
    "ddp_split was removed; remove the key: under DDP every replica orthogonalises all the Muon matrices, "
    "which measured cheaper for DeePMD models than splitting them across the replicas (BENCHMARKS.md)"
)


@pytest.mark.parametrize("value", ["auto", "off", "always", None])
def test_the_removed_ddp_split_is_refused_by_name(value: object) -> None:
    """Any value, to the constructor, in a param_group given to it, and through add_param_group."""
    with pytest.raises(ValueError, match=f"^{re.escape(REMOVED)}$"):
        HybridMuonOptimizer([_param()], ddp_split=value)
    with pytest.raises(ValueError, match=f"^{re.escape(REMOVED)}$"):
        HybridMuonOptimizer([{"params": [_param()], "ddp_split": value}])
    opt = HybridMuonOptimizer([_param()])
    with pytest.raises(ValueError, match=f"^{re.escape(REMOVED)}$"):
        opt.add_param_group({"params": [_param()], "ddp_split": value})
    assert len(opt.param_groups) == 1


def test_an_unknown_keyword_is_a_type_error() -> None:
    with pytest.raises(
        TypeError, match=r"^HybridMuonOptimizer.__init__\(\) got an unexpected keyword argument 'zeta'$"
    ):
        HybridMuonOptimizer([_param()], zeta=1)


def test_bad_use_foreach() -> None:
    with pytest.raises(ValueError, match=r"^Invalid use_foreach: 'yes'; expected true, false or None$"):
        HybridMuonOptimizer([_param()], use_foreach="yes")


@pytest.mark.parametrize("key", ["batched", "cuda_graph"])
def test_implementation_switches_are_no_options(key: str) -> None:
    # Which implementation runs is chosen inside the optimizer (optimizer.IMPLEMENTATIONS).
    with pytest.raises(TypeError, match=key):
        HybridMuonOptimizer([_param()], **{key: False})


def test_use_foreach_is_accepted_and_ignored() -> None:
    moved = []
    for use_foreach in (None, True, False):
        p = torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0)))
        opt = HybridMuonOptimizer([p], use_foreach=use_foreach)
        for step in range(2):
            p.grad = torch.randn(6, 4, generator=torch.Generator().manual_seed(step + 1))
            opt.step()
        moved.append(p.detach())
    assert torch.equal(moved[0], moved[1]) and torch.equal(moved[0], moved[2])


@pytest.mark.parametrize(
    ("kwargs", "check"),
    [
        ({"lr": 0.0}, ("lr", 0.0)),
        ({"lr": 1}, ("lr", 1)),  # an int is a real number
        ({"lr": torch.tensor(1e-3)}, None),  # a scalar tensor (LR schedulers may set one)
        ({"lr": np.float32(1e-3)}, None),  # a NumPy number (a schedule computed with NumPy)
        ({"adam_betas": (np.float32(0.9), np.float64(0.99))}, None),
        ({"momentum": 0.0}, ("momentum", 0.0)),
        ({"momentum": 0.999}, ("momentum", 0.999)),
        ({"adam_betas": (0.0, 0.0)}, ("adam_betas", (0.0, 0.0))),
        ({"adam_betas": [0.9, 0.999]}, ("adam_betas", (0.9, 0.999))),  # a list becomes a tuple
        ({"weight_decay": 0.0}, ("weight_decay", 0.0)),
        ({"lr_adjust": -5.0}, ("lr_adjust", -5.0)),  # any finite value
        ({"lr_adjust": 10.0}, ("lr_adjust", 10.0)),
        ({"lr_adjust_coeff": 0.0}, ("lr_adjust_coeff", 0.0)),
        ({"muon_mode": "SLICE"}, ("muon_mode", "slice")),  # case-insensitive, stored lower-case
        ({"muon_mode": "Flat"}, ("muon_mode", "flat")),
        ({"muon_mode": "2D"}, ("muon_mode", "2d")),
        ({"enable_gram": False, "magma_muon": False, "flash_muon": False}, ("enable_gram", False)),
        ({"use_foreach": False}, None),
    ],
)
def test_good_arguments_are_accepted(kwargs: dict, check) -> None:
    moved = {}
    for implementation in ("engine", "loop"):
        p = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))
        start = p.detach().clone()
        opt = make_optimizer([p], implementation, **kwargs)
        if check is not None:
            key, value = check
            assert opt.param_groups[0][key] == value
        p.grad = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
        opt.step()
        moved[implementation] = p.detach() - start
    # The accepted value takes effect, the same in both implementations (tolerance: tests/test_parity.py).
    ref = moved["loop"]
    if float(opt.param_groups[0]["lr"]) == 0.0:
        assert torch.equal(ref, torch.zeros_like(ref)) and torch.equal(moved["engine"], ref)
    else:
        assert ((moved["engine"] - ref).norm() / ref.norm()).item() < TORCH_MUON_TOL


def test_scheduler_keys_are_allowed() -> None:
    p = _param()
    # a label is kept and ignored, with a warning (once with Python's default filter; pytest shows every one)
    with pytest.warns(UserWarning, match="param_group key 'name' is no HybridMuon setting: kept and ignored"):
        opt = HybridMuonOptimizer([{"params": [p], "name": "matrices"}], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        assert opt.param_groups[0]["initial_lr"] == 1e-3
        p.grad = torch.ones_like(p)
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_a_scheduler_that_sets_numpy_numbers_steps_as_with_floats() -> None:
    moved = []
    for number in (float, np.float32):
        p = _param()
        opt = HybridMuonOptimizer([p], lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step, number=number: number(0.5) ** step)
        for step in range(3):
            p.grad = torch.full_like(p, 1.0 + step)
            opt.step()
            scheduler.step()
        moved.append(p.detach())
    assert torch.equal(moved[0], moved[1])


def test_import_has_no_side_effects() -> None:
    code = (
        "import torch, torch._dynamo.config as c; before = c.cache_size_limit; "
        "import deepmd_hybridmuon, sys; "
        "assert c.cache_size_limit == before, (before, c.cache_size_limit); "
        "assert not any(m.startswith('deepmd.') or m == 'deepmd' for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith('deepmd'))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_import_loads_neither_triton_nor_dynamo() -> None:
    # Every `dp` command imports the plugin: Triton and dynamo (with inductor and sympy) cost about 2 s there, and
    # load only where a step runs.
    code = "import deepmd_hybridmuon, sys; print(sorted(m for m in ('triton', 'torch._dynamo') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
