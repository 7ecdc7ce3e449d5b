"""DPA-4 (deepmd-kit's ``"type": "dpa4"`` models) with our optimizer.

Every DPA-4 example of deepmd-kit trains with HybridMuon. Here a shrunk copy of the upstream
water example (deepmd-kit's ``examples/water/dpa4/input.json``, here ``examples/water/dpa4_water.json``)
trains and restarts with ``dp --pt train`` and ``dp --pt-expt train``, keeping its loss
(``loss_func: mae``), its wsd learning rate, EMA and ``zero_stage: 1`` (which deepmd ignores in
a single process; ZeRO-1 itself is tested in test_distributed.py); and our routing of its
parameters is compared with the routing deepmd-kit's built-in optimizer applies.
"""

from __future__ import annotations

import copy
import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import OURS_LOG_LINE, make_example_data, read_lcurve, run_dp

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon.cli import check_input, main
from deepmd_hybridmuon.functional import route_parameter

#: The upstream example, shrunk. Changed: the type map (the generated example data's
#: species), ``rcut`` 6 -> 3.5 (that data's cutoff), ``channels`` 32 -> 4, ``n_radial``
#: 16 -> 4, ``lmax`` 2 -> 1, ``n_blocks`` 2 -> 1, ``mixing_layers`` 3 -> 1, and the run's
#: length, data and output frequencies (set by :func:`dpa4_input`). Every other key keeps
#: the example's value, so the model still has rank-3 (sliced) Muon matrices, ``adam_`` /
#: ``adamw_`` names, biases and vectors.
DPA4_WATER_SHRUNK: dict = {
    "model": {
        "type": "dpa4",
        "type_map": ["A", "B"],
        "descriptor": {
            "rcut": 3.5,
            "channels": 4,
            "n_radial": 4,
            "edge_norm": False,
            "use_env_seed": True,
            "lmax": 1,
            "mmax": 1,
            "n_blocks": 1,
            "mixing_layers": 1,
            "radial_so2_mode": "degree_channel",
            "radial_so2_rank": 1,
            "n_focus": 1,
            "focus_dim": 0,
            "n_atten_head": 1,
            "message_node_so3": True,
            "ffn_neurons": 0,
            "ffn_so3_grid": True,
            "grid_mlp": False,
            "grid_branch": [0, 0, 1],
            "ffn_blocks": 1,
            "so3_readout": "mlp",
            "use_amp": True,
            "precision": "float32",
            "seed": 42,
        },
        "fitting_net": {"neuron": [0], "precision": "float32", "seed": 42},
        "use_compile": False,
        "enable_tf32": True,
    },
    "learning_rate": {
        "type": "wsd",
        "start_lr": 0.00045,
        "stop_lr": 1e-06,
        "warmup_ratio": 0.003,
        "warmup_start_factor": 0.2,
        "decay_phase_ratio": 0.65,
        "decay_type": "cosine",
    },
    "loss": {
        "type": "ener",
        "loss_func": "mae",
        "f_use_norm": True,
        "start_pref_e": 20,
        "limit_pref_e": 20,
        "start_pref_f": 20,
        "limit_pref_f": 20,
        "start_pref_v": 5,
        "limit_pref_v": 5,
    },
    "optimizer": {"type": "HybridMuon", "weight_decay": 0.001},
    "training": {
        "stat_file": "./dpa4.hdf5",
        "stat_file_mode": "update",
        "training_data": {"systems": [], "batch_size": 1},
        "validation_data": {"systems": [], "batch_size": 1, "numb_batch": 1},
        "numb_steps": 0,
        "gradient_max_norm": 5.0,
        "save_freq": 0,
        "save_dir": "ckpt",
        "max_ckpt_keep": 3,
        "enable_ema": True,
        "ema_decay": 0.999,
        "ema_ckpt_keep": 3,
        "disp_file": "lcurve.out",
        "disp_freq": 2,
        "disp_avg": True,
        "disp_training": True,
        "time_training": True,
        "tensorboard": False,
        "enable_profiler": False,
        "tensorboard_freq": 1000,
        "tensorboard_log_dir": "tb_log",
        "profiling": False,
        "profiling_file": "timeline.json",
        "zero_stage": 1,
        "seed": 42,
    },
    "validating": {"compiled_infer": False, "tf32_infer": False, "amp_infer": False, "save_best_dir": "ckpt_best"},
}

FIRST_STEPS = 4  # the first run
TOTAL_STEPS = 6  # the restart continues to here
BACKENDS = {"pt": "--pt", "pt_expt": "--pt-expt"}


def dpa4_input(data: Path, steps: int) -> dict:
    """The shrunk example on the generated data, ``steps`` long, one checkpoint at the end."""
    config = copy.deepcopy(DPA4_WATER_SHRUNK)
    training = config["training"]
    training["training_data"]["systems"] = [str(data / "train")]
    training["validation_data"]["systems"] = [str(data / "valid")]
    training.update(numb_steps=steps, save_freq=steps)
    return config


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_example_data(tmp_path_factory.mktemp("dpa4"), ntrain=6, nvalid=2)


# ------------------------------------------------------------ training and restart


def _finite_loss_columns(path: Path) -> np.ndarray:
    """The energy and force columns of ``lcurve.out``: the generated data has no virial,
    so deepmd prints NaN for the virial errors of the example's loss."""
    header = next(line for line in path.read_text().splitlines() if line.startswith("#")).lstrip("#").split()
    keep = [i for i, name in enumerate(header) if re.fullmatch(r"(mae|rmse)(_[ef])?_(val|trn)", name)]
    assert len(keep) >= 4, header
    return read_lcurve(path)[:, keep]


def _adam_counters(optim_state: dict) -> list[float]:
    """``beta1_pow`` of every Adam-routed tensor (beta1 ** number of steps taken)."""
    return [s["beta1_pow"] for s in optim_state["state"].values() if "exp_avg" in s]


@pytest.mark.slow
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_trains_and_restarts_with_our_optimizer(backend, data, tmp_path):
    flag = BACKENDS[backend]
    (tmp_path / "input.json").write_text(json.dumps(dpa4_input(data, FIRST_STEPS)))
    log = run_dp([flag, "train", "input.json"], tmp_path)
    assert log.count(OURS_LOG_LINE) == 1, log[-3000:]
    # the routing line names all three routes: the tiny model keeps each kind of parameter
    summary = log[log.index(OURS_LOG_LINE) :].splitlines()[0]
    assert all(f"{route} " in summary for route in ("muon", "adam", "adamw")), summary

    first = torch.load(tmp_path / "ckpt" / f"model.ckpt-{FIRST_STEPS}.pt", map_location="cpu", weights_only=False)
    assert first["optimizer"]["hybridmuon"]["version"]  # written by our optimizer
    assert "ema" in first  # enable_ema: deepmd keeps the EMA weights beside the model's
    assert (tmp_path / "ckpt" / f"model_ema.ckpt-{FIRST_STEPS}.pt").is_file()
    states = list(first["optimizer"]["state"].values())
    assert any("momentum_buffer" in s and "magma_score" in s for s in states)
    beta1 = first["optimizer"]["param_groups"][0]["adam_betas"][0]
    before = _adam_counters(first["optimizer"])
    # one optimizer step per training step, none skipped (a non-finite gradient would skip
    # one); the counters are products of Python floats, a few ulps from beta1**n
    assert before and before == pytest.approx([beta1**FIRST_STEPS] * len(before), rel=1e-12)
    lcurve = read_lcurve(tmp_path / "lcurve.out")
    # the example's wsd schedule: the start rate (no warm-up in 4 steps), then its decay phase
    assert lcurve[0, -1] == pytest.approx(4.5e-4) and lcurve[-1, -1] < 4.5e-4

    config = dpa4_input(data, TOTAL_STEPS)
    (tmp_path / "input.json").write_text(json.dumps(config))
    log = run_dp([flag, "train", "input.json", "--restart", f"ckpt/model.ckpt-{FIRST_STEPS}.pt"], tmp_path)
    assert log.count(OURS_LOG_LINE) == 1, log[-3000:]
    assert read_lcurve(tmp_path / "lcurve.out")[-1, 0] == TOTAL_STEPS
    assert np.isfinite(_finite_loss_columns(tmp_path / "lcurve.out")).all()

    last = torch.load(tmp_path / "ckpt" / f"model.ckpt-{TOTAL_STEPS}.pt", map_location="cpu", weights_only=False)
    assert last["optimizer"]["hybridmuon"]["version"]
    assert "ema" in last
    # The restart loaded the optimizer state and advanced it once per step it ran: deepmd
    # resumes at the step recorded in the checkpoint (pt: the last step index, which it
    # runs again; pt_expt: the step after it), so the counters say exactly how many ran.
    resumed_at = first["model"]["_extra_state"]["train_infos"]["step"]
    ran = TOTAL_STEPS - resumed_at
    assert ran >= TOTAL_STEPS - FIRST_STEPS
    after = _adam_counters(last["optimizer"])
    assert after == pytest.approx([b * beta1**ran for b in before], rel=1e-12)
    momentum = {k: s["momentum_buffer"] for k, s in last["optimizer"]["state"].items() if "momentum_buffer" in s}
    assert momentum and all(
        not torch.equal(m, first["optimizer"]["state"][k]["momentum_buffer"]) for k, m in momentum.items()
    )


# --------------------------------------------------------------------------- routing

#: The probe's rate and decay: one step multiplies Muon and AdamW parameters by
#: 1 - LR * WD = 0.99 and leaves Adam ones alone.
LR, WD = 0.1, 0.1


@pytest.fixture(scope="module")
def input_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The input, for the check (which builds the model from it and reads no data)."""
    path = tmp_path_factory.mktemp("dpa4_check") / "input.json"
    path.write_text(json.dumps(dpa4_input(path.parent / "data", 2)))
    return path


@pytest.fixture(scope="module")
def dpa4_named(input_file: Path) -> list[tuple[str, torch.nn.Parameter]]:
    """The model's parameters, built as ``dp-hybridmuon check`` builds it: deepmd's
    normalisation of the input (our :func:`check_input`), then deepmd's ``get_model``."""
    from deepmd.pt.model.model import get_model

    jdata = check_input(str(input_file), out=io.StringIO())
    return list(get_model(jdata["model"]).named_parameters())


def observed_routes(optimizer_class: type, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, str]:
    """Each parameter's route, as one step with zero gradients shows it.

    The optimizer's state tells Muon (``momentum_buffer``) from Adam (``exp_avg``), and the
    parameter's value tells decayed (AdamW: multiplied by 1 - LR * WD) from not (Adam: a
    zero gradient gives a zero Adam update). Magma is off (its score of a zero momentum is
    0/0) and so is the Gram path (the built-in compiles it; the routing does not depend on it).
    """
    named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in named]
    params = [p for _, p in named]
    opt = optimizer_class(
        params, lr=LR, weight_decay=WD, named_parameters=named, enable_gram=False, flash_muon=False, magma_muon=False
    )
    start = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    routes = {}
    for (name, p), p0 in zip(named, start, strict=True):
        state = opt.state[p]
        family = "muon" if "momentum_buffer" in state else "adam" if "exp_avg" in state else "none"
        if torch.equal(p, p0):
            routes[name] = family
            continue
        # one float32 multiplication by 0.99: within one rounding (2^-24 relative) of the product
        assert torch.allclose(p, p0 * (1 - LR * WD), rtol=2**-23, atol=0), name
        routes[name] = {"muon": "muon", "adam": "adamw"}.get(family, f"{family}+decay")
    return routes


@pytest.fixture(scope="module")
def builtin_routes(dpa4_named) -> dict[str, str]:
    from deepmd.pt.optimizer import HybridMuonOptimizer as Builtin

    assert Builtin.__module__.startswith("deepmd.")  # deepmd's own class, not ours
    return observed_routes(Builtin, dpa4_named)


def test_our_routes_equal_the_builtin_routes(dpa4_named, builtin_routes):
    ours = observed_routes(HybridMuonOptimizer, dpa4_named)
    assert set(builtin_routes.values()) == {"muon", "adam", "adamw"}  # every route is exercised
    assert ours == builtin_routes
    # and the routing function behind `dp-hybridmuon check` and the training log agrees
    assert {n: route_parameter(n, tuple(p.shape), "slice").route for n, p in dpa4_named} == builtin_routes
    # the model has sliced Muon tensors: rank 3 with more than one matrix
    views = [route_parameter(n, tuple(p.shape), "slice").view for n, p in dpa4_named if builtin_routes[n] == "muon"]
    assert any(view[0] > 1 for view in views), views


def test_muon_matrix_views_equal_the_builtin_views(dpa4_named, builtin_routes):
    """One step with random gradients: the Muon updates agree, so the matrices are the same.

    Seen as other matrices (a rank-3 tensor flattened instead of sliced, or transposed) the
    orthogonalised update differs by O(1). What remains is rounding: both run the bfloat16
    Newton-Schulz iteration (Gram path off), and ours applies the Muon scale and the Magma
    damping in float32 where the built-in multiplies in bfloat16 (a few 2^-8 roundings):
    measured 3.8e-3 (worst tensor, (2, 12, 4)); 2% leaves a factor of five. Flattening the
    rank-3 tensors instead (``muon_mode="flat"``) measured 0.67.
    """
    from deepmd.pt.optimizer import HybridMuonOptimizer as Builtin

    gen = torch.Generator().manual_seed(7)
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) for _, p in dpa4_named]
    changes = {}
    for cls in (HybridMuonOptimizer, Builtin):
        named = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in dpa4_named]
        opt = cls([p for _, p in named], lr=1e-2, named_parameters=named, enable_gram=False, flash_muon=False)
        for (_, p), g in zip(named, grads, strict=True):
            p.grad = g.clone()
        opt.step()
        changes[cls] = {n: p.detach() - p0.detach() for (n, p), (_, p0) in zip(named, dpa4_named, strict=True)}
    worst = 0.0
    for name, route in builtin_routes.items():
        if route != "muon":
            continue
        ours, theirs = changes[HybridMuonOptimizer][name].double(), changes[Builtin][name].double()
        worst = max(worst, float((ours - theirs).norm() / theirs.norm()))
    assert math.isfinite(worst) and worst < 0.02, worst


def test_check_table_shows_the_builtin_routes(input_file, builtin_routes, capsys):
    assert main(["check", "--table", str(input_file)]) == 0
    out = capsys.readouterr().out
    table = {}
    for line in out.splitlines():
        tokens = line.split()
        if tokens and tokens[0] in builtin_routes:
            assert tokens[0] not in table, line
            table[tokens[0]] = next(t for t in tokens[1:] if t in ("muon", "adam", "adamw"))
    assert table == builtin_routes
