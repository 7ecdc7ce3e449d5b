"""Real `dp --pt train` runs on the bundled example (fewer steps): our optimizer is used,
loss decreases, restarts continue, both input styles work.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import EXAMPLES, make_example_data, multi_task_input
from conftest import OURS_LOG_LINE as LOG_LINE
from conftest import read_lcurve as _lcurve
from conftest import run_dp as _dp

from deepmd_hybridmuon.validation import GROUP_KEYS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example's data (fewer frames) and its input.json with a short schedule."""
    root = tmp_path_factory.mktemp("dp_train")
    make_example_data(root, ntrain=60, nvalid=12)
    return root


def _input(workdir: Path, steps: int, *, legacy: bool = False, **optimizer: object) -> dict:
    source = EXAMPLES / ("input_legacy.json" if legacy else "input.json")
    config = copy.deepcopy(json.loads(source.read_text()))
    training = config["training"]
    training["training_data"]["systems"] = [str(workdir / "data" / "train")]
    training["validation_data"]["systems"] = [str(workdir / "data" / "valid")]
    training.update(numb_steps=steps, disp_freq=10, save_freq=steps)
    training.pop("stat_file", None)
    config["learning_rate"]["decay_steps"] = max(1, steps // 4)
    if optimizer:
        section = training if legacy else config["optimizer"]
        section.update(optimizer)
    return config


def _run(workdir: Path, name: str, config: dict, extra: list[str] = ()) -> tuple[Path, str]:
    run_dir = workdir / name
    run_dir.mkdir(exist_ok=True)
    (run_dir / "input.json").write_text(json.dumps(config, indent=1))
    return run_dir, _dp(["--pt", "train", "input.json", *extra], run_dir)


@pytest.fixture(scope="module")
def first_run(workdir: Path) -> tuple[Path, str]:
    return _run(workdir, "new_style", _input(workdir, 60))


def test_trains_with_our_optimizer_and_loss_decreases(first_run):
    run_dir, log = first_run
    assert log.count(LOG_LINE) == 1, log[-3000:]
    assert "routing: muon" in log
    curve = _lcurve(run_dir / "lcurve.out")
    # columns: step, rmse_val, rmse_trn, ...; compare the validation loss of the first and
    # last lines (60 steps at the example's learning rate cut it several-fold).
    assert curve[-1, 0] == 60
    assert curve[-1, 1] < 0.7 * curve[0, 1], curve[:, :3]

    ckpt = torch.load(run_dir / "model.ckpt-60.pt", map_location="cpu", weights_only=False)
    optim = ckpt["optimizer"]
    assert optim["hybridmuon"]["version"]  # written by our optimizer
    assert set(optim["param_groups"][0]) >= set(GROUP_KEYS)
    states = list(optim["state"].values())
    assert any("momentum_buffer" in s and "magma_score" in s for s in states)
    assert any("exp_avg" in s and s["exp_avg"].dtype == torch.float32 for s in states)


def test_restart_continues_and_input_settings_win(workdir, first_run):
    run_dir, _ = first_run
    restart_dir = workdir / "restart"
    shutil.copytree(run_dir, restart_dir)
    config = _input(workdir, 80, weight_decay=0.002)
    (restart_dir / "input.json").write_text(json.dumps(config))
    log = _dp(["--pt", "train", "input.json", "--restart", "model.ckpt-60.pt"], restart_dir)
    assert LOG_LINE in log
    assert "restart: optimizer weight_decay = 0.002 from the input file (checkpoint had 0.001)" in log
    curve = _lcurve(restart_dir / "lcurve.out")
    assert curve[-1, 0] == 80
    ckpt = torch.load(restart_dir / "model.ckpt-80.pt", map_location="cpu", weights_only=False)
    assert ckpt["optimizer"]["param_groups"][0]["weight_decay"] == 0.002


def test_legacy_input_style_trains_with_our_optimizer(workdir):
    _, log = _run(workdir, "legacy", _input(workdir, 10, legacy=True))
    assert LOG_LINE in log


def test_disable_switch_trains_with_the_builtin(workdir):
    run_dir = workdir / "builtin"
    run_dir.mkdir()
    (run_dir / "input.json").write_text(json.dumps(_input(workdir, 10, enable_gram=False)))
    log = _dp(["--pt", "train", "input.json"], run_dir, env={"DEEPMD_HYBRIDMUON_DISABLE": "1"})
    assert LOG_LINE not in log
    notice = (
        "deepmd-hybridmuon is off (DEEPMD_HYBRIDMUON_DISABLE=1 in the environment): deepmd-kit's built-in "
        "HybridMuon optimizer runs"
    )
    assert log.count(notice) == 1, log[-3000:]
    ckpt = torch.load(run_dir / "model.ckpt-10.pt", map_location="cpu", weights_only=False)
    assert "hybridmuon" not in ckpt["optimizer"]


def test_builtin_checkpoint_resumes_with_ours(workdir):
    """A checkpoint written by deepmd-kit's built-in HybridMuon continues with ours (float64 model)."""
    run_dir = workdir / "builtin_to_ours"
    run_dir.mkdir()
    (run_dir / "input.json").write_text(json.dumps(_input(workdir, 10, enable_gram=False)))
    _dp(["--pt", "train", "input.json"], run_dir, env={"DEEPMD_HYBRIDMUON_DISABLE": "1"})
    (run_dir / "input.json").write_text(json.dumps(_input(workdir, 20, enable_gram=False)))
    log = _dp(["--pt", "train", "input.json", "--restart", "model.ckpt-10.pt"], run_dir)
    assert LOG_LINE in log
    assert _lcurve(run_dir / "lcurve.out")[-1, 0] == 20
    ckpt = torch.load(run_dir / "model.ckpt-20.pt", map_location="cpu", weights_only=False)
    assert ckpt["optimizer"]["hybridmuon"]["version"]


def test_our_checkpoint_resumes_with_the_builtin(workdir):
    """And back: ours writes, the built-in continues (float32 model: the built-in cannot resume float64)."""
    run_dir = workdir / "ours_to_builtin"
    run_dir.mkdir()
    config = _input(workdir, 10, enable_gram=False)
    for part in ("descriptor", "fitting_net"):
        config["model"][part]["precision"] = "float32"
    (run_dir / "input.json").write_text(json.dumps(config))
    assert LOG_LINE in _dp(["--pt", "train", "input.json"], run_dir)
    config["training"]["numb_steps"] = 20
    (run_dir / "input.json").write_text(json.dumps(config))
    log = _dp(
        ["--pt", "train", "input.json", "--restart", "model.ckpt-10.pt"],
        run_dir,
        env={"DEEPMD_HYBRIDMUON_DISABLE": "1"},
    )
    assert LOG_LINE not in log
    assert _lcurve(run_dir / "lcurve.out")[-1, 0] == 20


def test_pt_expt_backend_trains_and_restarts_with_our_optimizer(workdir):
    run_dir = workdir / "pt_expt"
    run_dir.mkdir()
    (run_dir / "input.json").write_text(json.dumps(_input(workdir, 10)))
    assert LOG_LINE in _dp(["--pt-expt", "train", "input.json"], run_dir)
    (run_dir / "input.json").write_text(json.dumps(_input(workdir, 20)))
    log = _dp(["--pt-expt", "train", "input.json", "--restart", "model.ckpt-10.pt"], run_dir)
    assert LOG_LINE in log
    assert _lcurve(run_dir / "lcurve.out")[-1, 0] == 20


@pytest.mark.parametrize(
    ("first", "then"), [("AdamW", "HybridMuon"), ("HybridMuon", "AdamW"), ("AdaMuon", "HybridMuon")]
)
def test_restart_from_another_optimizers_checkpoint_starts_the_optimizer_afresh(workdir, first, then):
    """--restart with another optimizer type than the checkpoint's: fresh optimizer state, one log line, no crash.

    deepmd's AdaMuon writes lr, momentum and adam_betas too (it was taken for HybridMuon and refused).
    """

    def config(steps: int, kind: str) -> dict:
        out = _input(workdir, steps)
        if kind != "HybridMuon":
            out["optimizer"] = {"type": kind}
            out["learning_rate"]["start_lr"] = 1e-3
        return out

    run_dir = workdir / f"{first}_to_{then}"
    run_dir.mkdir()
    (run_dir / "input.json").write_text(json.dumps(config(10, first)))
    _dp(["--pt", "train", "input.json"], run_dir)
    (run_dir / "input.json").write_text(json.dumps(config(20, then)))
    log = _dp(["--pt", "train", "input.json", "--restart", "model.ckpt-10.pt"], run_dir)
    writer = "HybridMuon" if first == "HybridMuon" else "another optimizer"
    assert f"restart: the checkpoint's optimizer state was written by {writer}" in log, log[-3000:]
    assert _lcurve(run_dir / "lcurve.out")[-1, 0] == 20
    ckpt = torch.load(run_dir / "model.ckpt-20.pt", map_location="cpu", weights_only=False)
    assert ("hybridmuon" in ckpt["optimizer"]) == (then == "HybridMuon")


def test_a_checkpoint_without_a_later_option_resumes_with_its_state(workdir, first_run):
    """A checkpoint written before an option existed (its param_groups lack the key) restarts with its optimizer
    state: the option takes its default, and the run continues exactly as from the complete checkpoint."""
    run_dir, _ = first_run
    finals = {}
    for name, strip in (("complete", ()), ("older_writer", ("magma_muon", "enable_gram"))):
        restart_dir = workdir / f"restart_{name}"
        shutil.copytree(run_dir, restart_dir)
        ckpt = torch.load(restart_dir / "model.ckpt-60.pt", map_location="cpu", weights_only=False)
        for group in ckpt["optimizer"]["param_groups"]:
            for key in strip:
                del group[key]  # the defaults (True) are what the first run used
        torch.save(ckpt, restart_dir / "model.ckpt-60.pt")
        (restart_dir / "input.json").write_text(json.dumps(_input(workdir, 62)))
        log = _dp(["--pt", "train", "input.json", "--restart", "model.ckpt-60.pt"], restart_dir)
        assert "optimizer starts with fresh state" not in log, log[-3000:]
        saved = torch.load(restart_dir / "model.ckpt-62.pt", map_location="cpu", weights_only=False)["optimizer"]
        finals[name] = [entry["momentum_buffer"] for entry in saved["state"].values() if "momentum_buffer" in entry]
    assert finals["complete"] and len(finals["complete"]) == len(finals["older_writer"])
    for a, b in zip(finals["complete"], finals["older_writer"], strict=True):
        # The same state, data and arithmetic: equal, and bit for bit in a quiet run. Two processes may still round
        # a reduction differently under load (two threads), which the bfloat16 Newton-Schulz can amplify to about
        # 1e-3 of a parameter's change; a restart from fresh state would leave only 2 of 62 steps of momentum (~90 %).
        assert float((a - b).norm()) <= 1e-2 * float(a.norm())


def test_multi_task_branches_take_turns_and_each_trains(workdir, first_run):
    """A two-branch multi-task input (one shared descriptor): each batch trains one branch, whose fitting net moves,
    while the other's keeps its values and optimizer state (tests/test_flat_engine.py checks that bit for bit)."""
    config = multi_task_input(_input(workdir, 24))
    run_dir, log = _run(workdir, "multi_task", config)
    assert log.count(LOG_LINE) == 1, log[-3000:]
    assert "model_dict" in log or "one" in log, log[-3000:]
    optim = torch.load(run_dir / "model.ckpt-24.pt", map_location="cpu", weights_only=False)["optimizer"]
    single = torch.load(first_run[0] / "model.ckpt-60.pt", map_location="cpu", weights_only=False)["optimizer"]
    # A parameter has state once it has been stepped: the second branch's parameters (those the single-task model
    # lacks) all have state, so both branches trained; and every state tensor is finite.
    extra = len(optim["param_groups"][0]["params"]) - len(single["param_groups"][0]["params"])
    assert extra > 0 and len(optim["state"]) - len(single["state"]) == extra, (extra, len(optim["state"]))
    states = optim["state"].values()
    assert all(torch.isfinite(v).all() for s in states for v in s.values() if isinstance(v, torch.Tensor))
