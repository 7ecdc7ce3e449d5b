"""The check (`dp check`, `dp-hybridmuon check`): exit codes and messages on the examples and on bad inputs;
the `dp` command with `check` added and every other command as deepmd-kit's."""

from __future__ import annotations

import json
import logging
import math
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from conftest import multi_task_input

from deepmd_hybridmuon.cli import (
    ADAM_LR_BELOW,
    ECHO_CHARS,
    MAX_DEPTH,
    MAX_INPUT_BYTES,
    MAX_VALUES,
    MUON_LR_FACTOR,
    main,
    triton_decision,
)
from deepmd_hybridmuon.plugin import add_dp_check

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WATER = EXAMPLES / "water"
BIN = Path(sys.executable).parent
DP = str(BIN / "dp")
DP_HYBRIDMUON = str(BIN / "dp-hybridmuon")


def _write(tmp_path: Path, config: dict, name: str = "input.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def _example(legacy: bool = False) -> dict:
    return json.loads((EXAMPLES / ("input_legacy.json" if legacy else "input.json")).read_text())


@pytest.mark.parametrize("legacy", [False, True])
def test_examples_pass_and_print_settings_and_routing(legacy, capsys):
    assert main(["check", str(EXAMPLES / ("input_legacy.json" if legacy else "input.json"))]) == 0
    out = capsys.readouterr().out
    assert "optimizer: HybridMuon (deepmd-hybridmuon)" in out
    assert "muon_mode        'slice'" in out
    assert "routing (muon_mode='slice'):" in out
    # the example's se_e2_a: embedding/fitting matrices on Muon, biases on Adam; a summary per route only
    assert "fitting_net.filter_layers.networks.0.layers.1.matrix" not in out
    muon_line = next(line for line in out.splitlines() if line.strip().startswith("muon "))
    assert int(muon_line.split()[1]) > 0
    assert "on this machine" in out and "Triton kernels" in out and "zero_stage 0    " in out


def test_the_readme_quotes_the_legacy_examples_warning(capsys):
    """The README says which warning the legacy example gets (deepmd-kit's, expected), as dp check prints it."""
    assert main(["check", "--no-routing", str(EXAMPLES / "input_legacy.json")]) == 0
    [warning] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    readme = " ".join((EXAMPLES.parent / "README.md").read_text().split())
    assert f"`{warning.split(' is deprecated.')[0]} is deprecated. …`" in readme, warning


def test_the_readme_shows_what_the_check_prints_for_the_example(capsys, monkeypatch):
    """Every line of the README's dp check output for examples/input.json, on a machine without a GPU, is printed."""
    from deepmd_hybridmuon import cli

    monkeypatch.setattr(cli, "_training_device", lambda: torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.chdir(EXAMPLES.parent)
    readme = (EXAMPLES.parent / "README.md").read_text()
    shown = readme.split("On `examples/input.json`:\n\n```text\n", 1)[1].split("```", 1)[0]
    assert main(["check", "examples/input.json"]) == 0
    printed = iter(capsys.readouterr().out.splitlines())
    missing = [line for line in shown.splitlines() if line.strip() not in ("", "...") and line not in printed]
    assert not missing, missing  # each in order (`in` consumes the iterator up to the line it finds)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (
            {"muon_mode": "3d"},
            "key `muon_mode` gets bad value that fails to pass its extra checking. "
            "expected one of '2d', 'flat', 'slice' (got '3d')",
        ),
        ({"momentum": "high"}, "key `momentum` gets wrong value type, requires <float>"),
        ({"momentun": 0.9}, "undefined key `momentun` is not allowed in strict mode. Did you mean: momentum?"),
        (  # dargs reads an alias only in place of its key
            {"momentum": 0.9, "muon_momentum": 0.95},
            "Did you mean: momentum? (muon_momentum is another name for momentum, which is set too: keep one of "
            "them) (got 0.95)",
        ),
        ({"adam_beta2": 1.5}, "key `adam_beta2` gets bad value that fails to pass its extra checking. "),
        (
            {"ddp_split": "auto"},
            "key `ddp_split` gets bad value that fails to pass its extra checking. ddp_split was removed; remove the "
            "key: under DDP every replica orthogonalises all the Muon matrices, which measured cheaper for DeePMD "
            "models than splitting them across the replicas (BENCHMARKS.md) (got 'auto')",
        ),
    ],
)
def test_bad_inputs_exit_1_naming_key_value_and_allowed(tmp_path, capsys, change, expected):
    config = _example()
    config["optimizer"].update(change)
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'input.json'}: [at location `optimizer`]"), err
    assert expected in err


def test_legacy_keys_pass_with_a_warning(tmp_path, capsys):
    config = _example(legacy=True)
    config["training"]["muon_2d_only"] = True
    config["training"]["min_2d_dim"] = 4
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0
    captured = capsys.readouterr()
    assert "muon_2d_only=True is deprecated" in captured.err and "muon_mode='2d'" in captured.err
    assert "min_2d_dim=4 is deprecated" in captured.err and "ignored" in captured.err
    assert "opt_type" in captured.err  # deepmd's own warning about the legacy optimizer placement
    assert "muon_mode        '2d'" in captured.out


def test_missing_file_exits_1(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.json")]) == 1
    assert "no such file" in capsys.readouterr().err


def test_console_script_and_module_entry(tmp_path):
    config = _example()
    config["optimizer"]["muon_mode"] = "3D "
    path = _write(tmp_path, config)
    for cmd in ([sys.executable, "-m", "deepmd_hybridmuon", "check", "--no-routing", path],):
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 1
        assert "(got '3D ')" in proc.stderr


def test_table_lists_every_parameter_after_the_summary(capsys):
    assert main(["check", "--table", str(EXAMPLES / "input.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    summary = {line.split()[0]: int(line.split()[1]) for line in lines if " tensors " in line}
    assert set(summary) == {"muon", "adam", "adamw"}
    header = next(
        i for i, line in enumerate(lines) if line.split()[:5] == ["parameter", "shape", "route", "matrices", "reason"]
    )
    assert header > next(i for i, line in enumerate(lines) if " tensors " in line)
    rows = [line.split() for line in lines[header + 1 :] if line.startswith("  atomic_model.")]
    assert len(rows) == sum(summary.values())
    by_name = {row[0]: row for row in rows}
    matrix = by_name["atomic_model.fitting_net.filter_layers.networks.0.layers.1.matrix"]
    assert matrix[-3:] == ["muon", "1x32x32", "matrix"]
    assert by_name["atomic_model.fitting_net.filter_layers.networks.0.layers.1.bias"][-3:] == ["adam", "-", "name"]
    assert sum(row[-3] == "muon" for row in rows) == summary["muon"]


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    with pytest.raises(SystemExit):
        main(["check", "-h"])
    out = capsys.readouterr().out
    assert "``" not in out and "--table" in out and "dp check" in out


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"flash_muon": False}, "Triton kernels  off: flash_muon is false; Newton-Schulz runs batched torch kernels"),
        ({"zero_stage": 0}, "DDP under torchrun: every GPU holds the whole model and optimizer state"),
        ({"zero_stage": 1}, "ZeRO-1 under torchrun: the optimizer state is split across the GPUs"),
        ({"zero_stage": 2}, "FSDP2 under torchrun: parameters, gradients and optimizer state are"),
        ({"zero_stage": 3}, "FSDP2 under torchrun: as zero_stage 2, and each GPU frees"),
    ],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_says_what_the_run_does_on_this_machine(tmp_path, capsys, monkeypatch, change, expected, device):
    """On a GPU the zero_stage line says what torchrun makes of the run; on the CPU (one process: deepmd-kit's
    torchrun training puts each rank on a GPU) that the stage is not used there, and with -v what GPUs make of it."""
    from deepmd_hybridmuon import cli

    monkeypatch.setattr(cli, "_training_device", lambda: torch.device(device))
    if device == "cuda":  # without asking a GPU for the Triton line: this test is about the zero_stage line
        monkeypatch.setattr(
            cli, "triton_decision", lambda flash, _: (False, f"off: flash_muon is {str(flash).lower()}")
        )
    config = _example()
    stage = change.get("zero_stage", 0)
    config["training" if "zero_stage" in change else "optimizer"].update(change)
    path = _write(tmp_path, config)
    if "zero_stage" not in change:
        expected = "Triton kernels  off: flash_muon is false; Newton-Schulz runs batched torch kernels"
    elif device == "cuda":
        expected = f"zero_stage {stage}    {expected}"
    else:
        expected = f"zero_stage {stage}    not used here: on the CPU, dp --pt train trains in one process\n"
    assert main(["check", "--no-routing", path]) == 0
    out = capsys.readouterr().out
    assert expected in out, out
    assert ("under torchrun: " in out) == (device == "cuda")
    # the mechanism only with -v (or --table)
    for word in ("batched step", "owner rank", "ZeroRedundancyOptimizer", "DTensor", "with GPUs, "):
        assert word not in out
    assert main(["check", "--no-routing", "-v", path]) == 0
    verbose = capsys.readouterr().out
    assert expected in verbose and "how: " in verbose
    assert ("with GPUs, " in verbose) == (device == "cpu")


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("flash_muon", [True, False])
def test_fsdp2_owners_use_the_triton_kernels_where_the_engine_would(tmp_path, capsys, monkeypatch, stage, flash_muon):
    """distributed/fsdp.py runs the owners' orthogonalisation on the engine's Triton kernels: the check says what
    triton_decision says (on under Triton's interpreter on the CPU, when Triton is installed)."""
    config = _example()
    config["training"]["zero_stage"] = stage
    config["optimizer"]["flash_muon"] = flash_muon
    path = _write(tmp_path, config)
    for interpret in ("0", "1"):
        monkeypatch.setenv("TRITON_INTERPRET", interpret)
        assert main(["check", "--no-routing", "-v", path]) == 0
        out = capsys.readouterr().out
        on, _ = triton_decision(flash_muon, torch.device("cpu"))
        assert "no Triton kernels" not in out
        expected = "with the Triton kernels" if on else "with batched torch kernels (Triton off, as above)"
        assert f"the owner ranks orthogonalise {expected}" in out, out


@pytest.mark.parametrize("name", ["input.json", "dpa4_water.json"])
def test_learning_rate_schedule_is_deepmds(tmp_path, capsys, name):
    from deepmd.dpmodel.utils.learning_rate import make_learning_rate_schedule

    path = EXAMPLES / name if name == "input.json" else WATER / name
    config = json.loads(path.read_text())
    assert main(["check", "--no-routing", str(path)]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("learning rate: "))
    steps, lr = config["training"]["numb_steps"], config["learning_rate"]
    schedule = make_learning_rate_schedule(lr, steps)
    assert line.startswith(
        f"learning rate: {lr['type']}, start_lr {lr['start_lr']:g} to stop_lr {lr['stop_lr']:g} over {steps:,} steps "
        f"(training.numb_steps): {schedule.value(0):.3g} at step 0, {schedule.value(steps - 1):.3g} at step "
        f"{steps - 1:,}"
    ), line
    if lr.get("warmup_ratio"):
        assert line.endswith(f"; warm-up over the first {int(lr['warmup_ratio'] * steps):,} steps")


@pytest.mark.parametrize(
    ("optimizer", "start_lr", "hint"),
    [
        ("HybridMuon", ADAM_LR_BELOW * 0.99, True),
        ("HybridMuon", 1e-3, True),
        ("HybridMuon", ADAM_LR_BELOW, False),
        ("HybridMuon", 0.03, False),
        ("Adam", 1e-3, False),
    ],
)
def test_hint_for_an_adam_sized_start_lr(tmp_path, capsys, optimizer, start_lr, hint):
    config = _example()
    config["learning_rate"].update(start_lr=start_lr, stop_lr=start_lr / 50)
    if optimizer != "HybridMuon":
        config["optimizer"] = {"type": optimizer}
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0
    out = capsys.readouterr().out
    expected = (
        f"  hint: start_lr {start_lr:g} is an Adam-sized rate; in BENCHMARKS.md HybridMuon trained best at about "
        f"{MUON_LR_FACTOR}x Adam's rate (here {start_lr * MUON_LR_FACTOR:g})"
    )
    assert (expected in out) == hint, out
    assert out.count("hint:") == hint


def test_the_hints_factor_is_the_readmes():
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert f"about **{MUON_LR_FACTOR} \N{MULTIPLICATION SIGN} Adam's usual 1e-3**" in readme


def test_triton_decision_follows_the_engine_condition(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = torch.device("cpu")
    assert triton_decision(True, cpu) == (False, "off: not a CUDA GPU (deepmd's device is cpu)")
    assert triton_decision(False, cpu)[1].startswith("off: flash_muon is false")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0):
        on, why = triton_decision(True, torch.device("cuda", 0))
        assert on and why.startswith("on: flash_muon is true, Triton"), why


@pytest.mark.parametrize("routing", [True, False])
def test_without_the_kernels_one_line_says_what_orthogonalises(tmp_path, capsys, monkeypatch, routing):
    """Where triton_decision says off (here: no CUDA GPU), one line says so and that batched torch kernels take every
    Muon matrix (as many as the routing table lists), and no line speaks of Triton programs."""
    from deepmd_hybridmuon import cli

    monkeypatch.setattr(cli, "_training_device", lambda: torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    path = str(EXAMPLES / "input.json")
    assert main(["check", path, "--table"] if routing else ["check", path, "--no-routing"]) == 0
    out = capsys.readouterr().out
    _, why = triton_decision(True, torch.device("cpu"))
    matrices = sum(int(m.group(1)) for m in re.finditer(r" muon +(\d+)x\d+x\d+ ", out))
    what = f"all {matrices}" if routing else "the"
    assert f"  Triton kernels  {why}; Newton-Schulz runs batched torch kernels for {what} Muon matrices\n" in out
    assert matrices == (8 if routing else 0)  # the example's se_e2_a: 8 weight matrices
    assert "Triton program" not in out and "Newton-Schulz   " not in out


def _lr_lines(tmp_path, capsys, lr: dict, steps: int) -> list[str]:
    config = _example()
    config["learning_rate"] = lr
    config["training"]["numb_steps"] = steps
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("learning rate: "))
    return lines[first : first + 2]


def test_a_stepped_schedule_says_why_it_ends_above_stop_lr(tmp_path, capsys):
    """deepmd's stepped exp schedule reaches stop_lr at step numb_steps, one past the last: the check says so, and
    from which step the last rate holds, as deepmd's schedule gives it."""
    from deepmd.dpmodel.utils.learning_rate import make_learning_rate_schedule

    lr = {"type": "exp", "start_lr": 0.03, "stop_lr": 0.0006, "decay_steps": 100}
    schedule = make_learning_rate_schedule(lr, 2000)
    held, last = schedule.value(1900), schedule.value(1999)
    assert held == last < schedule.value(1899) and math.isclose(schedule.value(2000), 0.0006)  # what it explains
    assert _lr_lines(tmp_path, capsys, lr, 2000)[1] == (
        "  it ends above stop_lr, which is the rate at step 2,000, one past the last: the rate falls every 100 steps, "
        f"so steps 1,900-1,999 all run at {last:.3g}"
    )


def test_the_decay_interval_is_the_one_deepmd_uses(tmp_path, capsys):
    """deepmd shortens a decay_steps that is not below the run's steps; the line gives the interval that runs."""
    from deepmd.dpmodel.utils.learning_rate import make_learning_rate_schedule

    lr = {"type": "exp", "start_lr": 0.03, "stop_lr": 0.0006, "decay_steps": 5000}
    every = make_learning_rate_schedule(lr, 2000).decay_steps
    assert every == 100  # deepmd's own choice
    line = _lr_lines(tmp_path, capsys, lr, 2000)[0]
    assert line.endswith("; decays every 100 steps"), line


@pytest.mark.parametrize(
    ("lr", "said"),
    [
        ({"type": "exp", "start_lr": 0.03, "stop_lr": 0.0006, "decay_steps": 100, "smooth": True}, "one past the last"),
        ({"type": "cosine", "start_lr": 0.03, "stop_lr": 0.0006}, None),
    ],
)
def test_a_smooth_schedule_names_no_stairs(tmp_path, capsys, lr, said):
    """A smooth decay ends above stop_lr without stairs; a schedule that ends at stop_lr, as far as the line's three
    significant figures show, gets no explanation."""
    from deepmd.dpmodel.utils.learning_rate import make_learning_rate_schedule

    schedule = make_learning_rate_schedule(lr, 2000)
    assert (f"{schedule.value(1999):.3g}" != f"{schedule.stop_lr:.3g}") == (said is not None)
    lines = _lr_lines(tmp_path, capsys, lr, 2000)
    if said:
        assert lines[1] == "  it ends above stop_lr, which is the rate at step 2,000, one past the last"
    else:
        assert not lines[1].startswith("  it ends")


@pytest.mark.parametrize("stage", [2, 3])
def test_ema_with_fsdp2_exits_1_naming_both_keys(tmp_path, capsys, stage):
    config = _example()
    config["training"].update(zero_stage=stage, enable_ema=True)
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert f"`enable_ema` is true with `zero_stage` {stage}" in err and "zero_stage 0 or 1" in err
    config["training"]["zero_stage"] = 1  # EMA is fine with ZeRO-1 (DPA-4's own setting)
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0


def test_zero_stage_out_of_range_exits_1(tmp_path, capsys):
    config = _example()
    config["training"]["zero_stage"] = 4
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    assert "key `zero_stage` must be 0, 1, 2 or 3 (got 4)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "name", "expected"),
    [
        ("{}", "input.json", "no `model` and no `training` section: a dp train input needs `model` and `training`"),
        ("[1, 2]", "input.json", "the top level must be an object of sections (model, learning_rate, loss, training"),
        ("", "empty.json", "cannot be parsed as JSON: Expecting value"),
        ("", "empty.yaml", "the top level must be an object of sections"),
        ("a: [", "bad.yaml", "cannot be parsed as YAML"),
        ('{"model": {"type_map": ["A"]}, "training": 3}', "input.json", "`training` must be an object, got int 3"),
        ("{}", "input.txt", "unknown file type '.txt': expected .json, .yaml or .yml"),
        # a deepmd-kit v0 input (use_smooth) without sections: deepmd's conversion fails, named as such
        ('{"use_smooth": 1}', "input.json", "deepmd-kit's conversion of older input layouts failed (KeyError"),
    ],
)
def test_bad_files_get_a_message_naming_the_file_once(tmp_path, capsys, text, name, expected):
    path = tmp_path / name
    path.write_text(text)
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: ") and err.count(str(path)) == 1, err
    assert expected in err


def test_legacy_optimizer_key_overriding_the_optimizer_section_is_reported(tmp_path, capsys):
    config = _example(legacy=True)
    config["optimizer"] = {"type": "HybridMuon", "momentum": 0.9}
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0
    captured = capsys.readouterr()
    assert (
        "warning: training.momentum=0.95 and optimizer.momentum=0.9 are both set: deepmd-kit's conversion "
        "of the legacy layout lets training.momentum win, so dp train uses 0.95"
    ) in captured.err
    assert "momentum         0.95" in captured.out  # what deepmd will really do


def test_legacy_opt_type_contradicting_the_optimizer_section_is_an_error(tmp_path, capsys):
    config = _example(legacy=True)
    config["optimizer"] = {"type": "Adam"}
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        f"error: {tmp_path / 'input.json'}: training.opt_type='HybridMuon' contradicts optimizer.type='Adam': "
        "deepmd-kit's conversion of the legacy layout lets training.opt_type win, so dp train would use the "
        "'HybridMuon' optimizer, not 'Adam'. Fix: remove training.opt_type to train with 'Adam' (or set "
        "optimizer.type to 'HybridMuon' and remove training.opt_type)\n"
    )
    config["optimizer"]["type"] = "HybridMuon"  # the same optimizer twice: valid
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 0


@pytest.mark.parametrize(
    ("legacy", "section", "fix"),
    [
        ("HybridMoun", "Adam", "Fix: remove training.opt_type to train with 'Adam'"),
        ("Adam", "HybridMoun", "Fix: set optimizer.type to 'Adam' and remove training.opt_type"),
        (
            "HybridMoun",
            "Adamm",
            "Fix: remove training.opt_type and set optimizer.type to one of 'Adam', 'AdamW', 'LKF', 'AdaMuon', "
            "'HybridMuon'",
        ),
    ],
)
def test_a_contradicting_opt_type_fix_never_offers_a_misspelled_optimizer(tmp_path, capsys, legacy, section, fix):
    config = _example()
    config["training"]["opt_type"] = legacy
    config["optimizer"] = {"type": section}
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert f"training.opt_type={legacy!r} contradicts optimizer.type={section!r}" in err
    assert f"{fix}\n" in err, err
    assert "(or " not in err


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        (
            "opt_type",
            "HybridMoun",
            "[at location `training`] get invalid choice `HybridMoun` for flag key `opt_type`. Did you mean: "
            "HybridMuon? (got 'HybridMoun')",
        ),
        ("momentum", "high", "[at location `training`] key `momentum` gets wrong value type, requires <float>"),
    ],
)
def test_a_bad_legacy_key_is_named_as_the_input_has_it(tmp_path, capsys, key, value, expected):
    config = _example(legacy=True)
    config["training"][key] = value
    assert main(["check", "--no-routing", _write(tmp_path, config)]) == 1
    err = capsys.readouterr().err
    assert expected in err, err
    assert "`optimizer`" not in err and ".Did" not in err


# ------------------------------------------------------------------ the real `dp`


def _run(
    cmd: list[str], cwd: Path | None = None, disable: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEEPMD_HYBRIDMUON_DISABLE"}
    env["OMP_NUM_THREADS"] = "1"
    if disable:
        env["DEEPMD_HYBRIDMUON_DISABLE"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The example as JSON, as YAML and in the legacy layout."""
    root = tmp_path_factory.mktemp("check_inputs")
    config = _example()
    (root / "input.yaml").write_text(yaml.safe_dump(config))
    return {
        "json": str(EXAMPLES / "input.json"),
        "yaml": str(root / "input.yaml"),
        "legacy": str(EXAMPLES / "input_legacy.json"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "kind", "table"),
    [([], "json", ["--table"]), (["--pt"], "yaml", []), (["--pt-expt"], "legacy", ["--table"])],
)
def test_dp_check_is_dp_hybridmuon_check(inputs, capsys, backend, kind, table):
    assert main(["check", *table, inputs[kind]]) == 0  # what `dp-hybridmuon check` prints (the same function)
    ours = capsys.readouterr().out
    dp = _run([DP, *backend, "check", *table, inputs[kind]])
    assert dp.returncode == 0, dp.stderr[-3000:]
    assert dp.stdout == ours
    assert "optimizer: HybridMuon (deepmd-hybridmuon)" in dp.stdout and "on this machine" in dp.stdout
    assert ("routing table:" in dp.stdout) == bool(table)


@pytest.mark.slow
def test_dp_train_with_a_bad_optimizer_value_ends_in_one_line_not_a_traceback(tmp_path):
    """And a legacy optimizer key that contradicts the optimizer section is named (deepmd-kit lets it win)."""
    config = _example()
    config["optimizer"]["muon_mode"] = "3d"
    proc = _run([DP, "--pt", "train", _write(tmp_path, config)], cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        f"error: {tmp_path / 'input.json'}: [at location `optimizer`] key `muon_mode` gets bad value that fails to "
        "pass its extra checking. expected one of '2d', 'flat', 'slice' (got '3d')"
    )
    config["optimizer"]["muon_mode"] = "slice"
    config["model"]["descriptor"]["rcut"] = "far"  # not the optimizer's: deepmd-kit's own error, as before
    proc = _run([DP, "--pt", "train", _write(tmp_path, config)], cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "key `rcut`" in proc.stderr
    # a legacy key that contradicts the optimizer section wins in deepmd-kit's conversion: dp train says so first
    config["training"].update(momentum=0.5, opt_type="AdamW")
    proc = _run([DP, "--pt", "train", _write(tmp_path, config)], cwd=tmp_path)
    assert "training.momentum=0.5 and optimizer.momentum=0.95 are both set" in proc.stderr, proc.stderr[-2000:]
    assert "so dp train would use the 'AdamW' optimizer, not 'HybridMuon'" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_dp_check_invalid_input_exits_1_and_usage_error_exits_2(tmp_path):
    config = _example()
    config["optimizer"]["muon_mode"] = "3d"
    path = _write(tmp_path, config)
    ours = _run([DP_HYBRIDMUON, "check", "--no-routing", path])
    dp = _run([DP, "--pt", "check", "--no-routing", path])
    assert ours.returncode == dp.returncode == 1
    assert dp.stderr.splitlines()[-1] == ours.stderr.splitlines()[-1]
    assert "key `muon_mode`" in dp.stderr and "expected one of '2d', 'flat', 'slice' (got '3d')" in dp.stderr
    usage = _run([DP, "check"])
    assert usage.returncode == 2 and "dp check: error: the following arguments are required: input" in usage.stderr
    helped = _run([DP, "check", "-h"])
    assert helped.returncode == 0 and "usage: dp check [-h] [--table] [--no-routing] [-v] input" in helped.stdout


def _without_check(help_text: str) -> str:
    """dp's help with our `check` line and choice taken out, whitespace normalised (argparse rewraps)."""
    lines = [line for line in help_text.splitlines() if not line.strip().startswith("check ")]
    return " ".join("\n".join(lines).replace(",check}", "}").split())


@pytest.mark.slow
def test_dp_help_version_and_other_commands_are_deepmds():
    ours, theirs = _run([DP, "-h"]), _run([DP, "-h"], disable=True)
    assert ours.returncode == theirs.returncode == 0
    check_lines = [line for line in ours.stdout.splitlines() if line.strip().startswith("check ")]
    assert len(check_lines) == 1 and "HybridMuon" in check_lines[0]
    assert "check" not in theirs.stdout
    assert _without_check(ours.stdout) == _without_check(theirs.stdout)
    for args in (["--version"], ["--pt", "train", "-h"], ["--pt", "freeze", "-h"], ["--pt", "train"]):
        ours, theirs = _run([DP, *args]), _run([DP, *args], disable=True)
        assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr), args
    # with the plugin off, `dp` is deepmd's own: no check command, and it says why
    off = _run([DP, "check", "x.json"], disable=True)
    assert off.returncode == 2 and "deepmd-hybridmuon is off (DEEPMD_HYBRIDMUON_DISABLE=1" in off.stderr


@pytest.mark.slow
def test_dp_train_and_freeze_run_as_before(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / "make_data.py"),
            "--out",
            str(tmp_path / "data"),
            "--ntrain",
            "4",
            "--nvalid",
            "2",
        ],
        check=True,
        capture_output=True,
    )
    config = _example()
    training = config["training"]
    training["training_data"]["systems"] = [str(tmp_path / "data" / "train")]
    training["validation_data"]["systems"] = [str(tmp_path / "data" / "valid")]
    training.update(numb_steps=2, disp_freq=1, save_freq=2)
    training.pop("stat_file", None)
    _write(tmp_path, config)
    train = _run([DP, "--pt", "train", "input.json"], cwd=tmp_path)
    assert train.returncode == 0, train.stderr[-3000:]
    assert "optimizer: deepmd-hybridmuon" in train.stderr + train.stdout
    freeze = _run([DP, "--pt", "freeze", "-o", "frozen.pth"], cwd=tmp_path)
    assert freeze.returncode == 0, freeze.stderr[-3000:]
    assert (tmp_path / "frozen.pth").stat().st_size > 0


def test_dp_main_is_left_alone_when_not_being_imported():
    """deepmd.backend imported before deepmd.main (as if deepmd.main no longer imported it): dp is deepmd's."""
    script = (
        "import logging, sys\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(name)s %(levelname)s %(message)s')\n"
        "import deepmd.backend, deepmd.main\n"
        "deepmd.main.main(['check', 'input.json'])\n"
    )
    proc = _run([sys.executable, "-c", script])
    assert proc.returncode == 2 and "invalid choice: 'check'" in proc.stderr
    assert "deepmd.hybridmuon DEBUG dp check not added: deepmd.main is not being imported" in proc.stderr


def _other_deepmd_main(main_parser=None) -> tuple[types.ModuleType, list]:
    """A module shaped like another deepmd-kit's ``deepmd.main``; its ``main`` records its calls."""
    module = types.ModuleType("deepmd_main_elsewhere")
    calls: list = []
    module.main = lambda args=None: calls.append(args)
    if main_parser is not None:
        module.main_parser = main_parser
    return module, calls


@pytest.mark.parametrize("shape", ["no main_parser", "no subparsers"])
def test_dp_main_of_another_shape_runs_unchanged(caplog, shape):
    import argparse

    module, calls = _other_deepmd_main(None if shape == "no main_parser" else argparse.ArgumentParser)
    add_dp_check(module)
    with caplog.at_level(logging.DEBUG, logger="deepmd.hybridmuon"):
        module.main(["check", "input.json"])
    assert calls == [["check", "input.json"]]
    expected = "has no main_parser()" if shape == "no main_parser" else "has no subparsers action 'command'"
    assert any(expected in r.getMessage() for r in caplog.records), caplog.text


def test_dp_check_with_the_plugin_off_says_why_and_what_checks_anyway(monkeypatch, capsys):
    import argparse

    from deepmd_hybridmuon import plugin

    def main_parser() -> argparse.ArgumentParser:
        parser = argparse.ArgumentParser(prog="dp")
        parser.add_subparsers(dest="command").add_parser("train")
        return parser

    module, calls = _other_deepmd_main(main_parser)
    monkeypatch.setitem(sys.modules, plugin.DP_MAIN_MODULE, module)
    monkeypatch.setenv(plugin.DISABLE_ENV, "1")
    plugin.on_deepmd_backend()  # what every `dp` command runs first
    with pytest.raises(SystemExit) as stop:
        module.main(["check", "input.json"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "no `check` command: deepmd-hybridmuon is off (DEEPMD_HYBRIDMUON_DISABLE=1 in the environment)" in err
    assert "`dp-hybridmuon check` and `python -m deepmd_hybridmuon check`" in err
    module.main(["train", "input.json"])
    module.main([])  # `dp` alone: deepmd's own help, without check
    assert calls == [["train", "input.json"], []]


def test_add_dp_check_is_idempotent_and_leaves_other_module_classes_alone(caplog):
    module, _ = _other_deepmd_main()
    add_dp_check(module)
    cls, main_attr = type(module), module.main
    add_dp_check(module)
    assert type(module) is cls and module.main is main_attr

    class Custom(types.ModuleType):
        pass

    custom = Custom("custom")
    custom.main = print
    with caplog.at_level(logging.DEBUG, logger="deepmd.hybridmuon"):
        add_dp_check(custom)
    assert type(custom) is Custom and custom.main is print
    assert "dp check not added: custom is a Custom, not a plain module" in caplog.text


# ------------------------------------------------------------------ hostile inputs


def _multi_task(config: dict | None = None) -> dict:
    """The example as a two-branch multi-task input (conftest.multi_task_input)."""
    return multi_task_input(config or _example())


def _nested(levels: int) -> str:
    return '{"model": {"type_map": ' + "[" * levels + "]" * levels + '}, "training": {}}'


def _alias_bomb() -> str:
    """YAML whose aliases expand the optimizer's unknown key to 10**9 strings (a few hundred bytes on disk)."""
    levels = ['&a0 ["d","d","d","d","d","d","d","d","d","d"]']
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    config = _example()
    del config["_comment"]
    config["optimizer"]["zzz"] = "BOMB"
    return "_comment: [" + ", ".join(levels) + "]\n" + yaml.safe_dump(config).replace("zzz: BOMB", "zzz: *a8")


def _hostile(kind: str, tmp_path: Path) -> Path:
    """Write one hostile input; returns its path."""
    path = tmp_path / "input.json"
    config = _example()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev_zero":
        path.symlink_to("/dev/zero")
    elif kind == "too_large":
        with open(path, "wb") as f:  # sparse: no disk used
            f.truncate(MAX_INPUT_BYTES + 1)
    elif kind == "deep_10000":
        path.write_text(_nested(10_000))
    elif kind == "deep_100":
        path.write_text(_nested(100))
    elif kind == "alias_bomb":
        path = tmp_path / "input.yaml"
        path.write_text(_alias_bomb())
    elif kind == "long_unknown_value":
        config["optimizer"]["zzz"] = "y" * 1_000_000
        path.write_text(json.dumps(config))
    elif kind == "long_unknown_key":
        config["optimizer"]["k" * 100_000] = 1
        path.write_text(json.dumps(config))
    elif kind == "multi_task":
        path.write_text(json.dumps(_multi_task()))
    elif kind == "multi_task_unknown_shared_item":
        config = _multi_task()
        config["model"]["model_dict"]["two"]["descriptor"] = "no_such_item"
        path.write_text(json.dumps(config))
    elif kind == "multi_task_model_dict_not_object":
        config = _multi_task()
        config["model"]["model_dict"] = ["one", "two"]
        path.write_text(json.dumps(config))
    elif kind == "multi_task_zero_stage":
        config = _multi_task()
        config["training"]["zero_stage"] = 1
        path.write_text(json.dumps(config))
    elif kind == "warmup_beyond_numb_steps":
        config["learning_rate"]["warmup_steps"] = config["training"]["numb_steps"]
        path.write_text(json.dumps(config))
    elif kind == "yaml_boolean_key":  # YAML 1.1 reads an unquoted `on` as true
        path = tmp_path / "input.yaml"
        path.write_text(yaml.safe_dump(config).replace("optimizer:\n", "optimizer:\n  on: 1\n", 1))
    elif kind == "yaml_null_key":
        path = tmp_path / "input.yaml"
        path.write_text(yaml.safe_dump(config).replace("optimizer:\n", "optimizer:\n  ~: 1\n", 1))
    elif kind == "stop_lr_inf_num_epoch":
        config["learning_rate"]["stop_lr"] = float("inf")
        config["training"]["num_epoch"] = 2
        del config["training"]["numb_steps"]
        path.write_text(json.dumps(config))
    elif kind == "muon_mode_upper_case":
        config["optimizer"]["muon_mode"] = "Flat"
        path.write_text(json.dumps(config))
    elif kind == "num_epoch":
        config["training"]["num_epoch"] = 2
        del config["training"]["numb_steps"]
        path.write_text(json.dumps(config))
    elif kind == "no_learning_rate":
        del config["learning_rate"]
        path.write_text(json.dumps(config))
    elif kind == "stop_lr_inf":
        config["learning_rate"]["stop_lr"] = float("inf")
        path.write_text(json.dumps(config))
    elif kind in ("opt_type", "opt_type_and_bad_muon_mode"):
        config["training"]["opt_type"] = "Adam"
        if kind == "opt_type_and_bad_muon_mode":
            config["optimizer"]["muon_mode"] = "3d"
        path.write_text(json.dumps(config))
    else:
        raise AssertionError(kind)
    return path


#: (kind, exit status, what the output holds). Each row failed on the code before its fix: the FIFO hung, /dev/zero
#: and the alias bomb ran out of memory, the 10,000 levels raised RecursionError (a traceback), the long value was
#: echoed whole, the multi-task input was refused (type_map 'type_map_all' not a list), the opt_type contradiction
#: was a warning with exit 0 and, with another error, was left out, a warm-up longer than the run passed; the YAML
#: boolean and null keys, the upper-case muon_mode (dp train accepts it), num_epoch (dp train too) and the missing
#: schedule were tracebacks, an infinite stop_lr passed (dp train refused it at its first step).
HOSTILE = [
    ("yaml_boolean_key", 1, "has a key True (bool): keys are names; in YAML, quote it"),
    ("muon_mode_upper_case", 0, "routing (muon_mode='flat'):"),
    ("num_epoch", 0, "start_lr 0.03, over training.num_epoch(_dict) 2 (dp train counts the steps from the data)"),
    ("no_learning_rate", 1, "no `learning_rate` section: dp train needs one"),
    ("yaml_null_key", 1, "has a key None (NoneType): keys are names; in YAML, quote it"),
    (
        "stop_lr_inf",
        1,
        "[at location `learning_rate`] the schedule (start_lr 0.03, stop_lr inf) gives lr inf at step 0: Invalid lr: "
        "inf; expected a finite number",
    ),
    ("stop_lr_inf_num_epoch", 1, "the schedule (start_lr 0.03, stop_lr inf) gives stop_lr inf: Invalid lr: inf"),
    ("fifo", 1, "is a named pipe (FIFO), not a regular file"),
    ("dev_zero", 1, "is a character device, not a regular file"),
    ("too_large", 1, f"is {MAX_INPUT_BYTES + 1:,} bytes, more than the {MAX_INPUT_BYTES:,} bytes dp check reads"),
    ("deep_10000", 1, f"nests objects and lists too deeply to be parsed (dp check takes up to {MAX_DEPTH} levels)"),
    ("deep_100", 1, f"nests objects and lists more than {MAX_DEPTH} levels deep"),
    ("alias_bomb", 1, f"holds more than {MAX_VALUES:,} values (a value repeated through YAML aliases counts once"),
    ("long_unknown_value", 1, f"undefined key `zzz` is not allowed in strict mode.  (got '{'y' * ECHO_CHARS}'..."),
    ("long_unknown_key", 1, f"has a key '{'k' * ECHO_CHARS}'... (100,000 characters): keys are names of at most"),
    ("multi_task", 0, "routing (muon_mode='slice') of each branch (model_dict key):\n  one: "),
    (
        "multi_task_unknown_shared_item",
        1,
        "[at location `model`] deepmd-kit cannot apply `shared_dict` to `model_dict`",
    ),
    ("multi_task_model_dict_not_object", 1, "`model_dict` must be an object of branches (objects), got list ['one'"),
    ("multi_task_zero_stage", 1, "key `zero_stage` is 1 in a multi-task input; deepmd-kit shards only single-task"),
    (
        "warmup_beyond_numb_steps",
        1,
        "[at location `learning_rate`] deepmd-kit rejects the schedule with training.numb_steps 2000: warmup_steps "
        "must be smaller than num_steps",
    ),
    ("opt_type", 1, "training.opt_type='Adam' contradicts optimizer.type='HybridMuon': deepmd-kit's conversion"),
    (
        "opt_type_and_bad_muon_mode",
        1,
        "so dp train would use the 'Adam' optimizer, not 'HybridMuon'. Fix: remove training.opt_type to train with "
        "'HybridMuon' (or set optimizer.type to 'Adam' and remove training.opt_type)\n  besides, deepmd-kit's checks "
        "of the input with training.opt_type applied (as dp train applies it) fail: [at location `optimizer`] "
        "undefined key `momentum`",
    ),
]


def test_a_30_mb_key_costs_about_its_own_size_in_memory(tmp_path, capsys):
    """dargs' "Did you mean" for an unknown key built difflib's index of every character of it (1.1 GB here)."""
    import tracemalloc

    main(["check", "--no-routing", str(EXAMPLES / "input.json")])  # deepmd's imports and schema, before measuring
    config = _example()
    config["optimizer"]["k" * 30_000_000] = 1
    path = _write(tmp_path, config)
    tracemalloc.start()
    try:
        assert main(["check", "--no-routing", path]) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"has a key '{'k' * ECHO_CHARS}'... (30,000,000 characters)" in capsys.readouterr().err
    # the text read and the key parsed from it are 30 MB each: allow 4 such copies, 1.1 GB before
    assert peak < 4 * 30e6, f"{peak / 1e6:.0f} MB"


@pytest.mark.parametrize(("kind", "status", "expected"), HOSTILE, ids=[row[0] for row in HOSTILE])
def test_hostile_inputs(tmp_path, capsys, kind, status, expected):
    path = _hostile(kind, tmp_path)
    assert main(["check", str(path)]) == status
    captured = capsys.readouterr()
    if status:
        assert captured.err.startswith(f"error: {path}: "), captured.err[:500]
        assert expected in captured.err, captured.err[:500]
        assert len(captured.err) < 1000  # values cut to a short prefix; no traceback
    else:
        assert expected in captured.out, captured.out


@pytest.mark.slow
def test_multi_task_routing_is_what_dp_train_steps(tmp_path, capsys):
    """A multi-task input with shared_dict: dp check passes, shows each branch, and its count of the parameters dp
    train steps (shared ones once) is the one dp train's optimizer logs."""
    from conftest import make_example_data, run_dp

    data = make_example_data(tmp_path, ntrain=4, nvalid=2)
    config = _multi_task()
    for branch in ("one", "two"):
        systems = config["training"]["data_dict"][branch]
        systems["training_data"]["systems"] = [str(data / "train")]
        systems["validation_data"]["systems"] = [str(data / "valid")]
    config["training"].update(numb_steps=2, disp_freq=1, save_freq=2)
    path = _write(tmp_path, config)
    assert main(["check", path]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("  one: ") for line in lines) and any(line.startswith("  two: ") for line in lines)
    block = lines[next(i for i, line in enumerate(lines) if line.startswith("  dp train steps ")) :][1:4]
    ours = {line.split()[0]: (int(line.split()[1]), line.split()[3]) for line in block}
    log = run_dp(["--pt", "train", "input.json"], tmp_path)
    logged = log[log.index("routing: muon ") :].splitlines()[0]
    for route, (count, elements) in ours.items():
        assert f"{route} {count} tensors / {elements} elements" in logged, (out, logged)


def test_multi_task_table_marks_the_shared_descriptor(tmp_path, capsys):
    assert main(["check", "--table", _write(tmp_path, _multi_task())]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("  one.") or line.startswith("  two.")]
    shared = [row[0] for row in rows if "(shared with one: stepped there)" in " ".join(row)]
    assert shared and all(name.startswith("two.atomic_model.descriptor.") for name in shared)
    assert not any(name.startswith("two.atomic_model.fitting_net.") for name in shared)  # not in shared_dict
    two = next(line for line in lines if line.startswith("  two: "))
    assert two.endswith(f"({len(shared)} shared with one through shared_dict)")


def test_the_check_counts_each_newton_schulz_path_as_the_engine_lays_it_out(tmp_path, capsys):
    """The check's count of the matrices one Triton program takes is the engine layout's (functional.on_triton)."""
    K = pytest.importorskip("deepmd_hybridmuon.kernels")
    from deepmd_hybridmuon import cli
    from deepmd_hybridmuon import functional as F
    from deepmd_hybridmuon.engine.layout import assign

    config = json.loads((WATER / "se_e2_a_water.json").read_text())
    config["optimizer"] = {"type": "HybridMuon"}
    with pytest.MonkeyPatch.context() as mp:  # where the kernels run (a GPU): the split between the two paths
        mp.setattr(cli, "triton_decision", lambda flash, _: (True, "on: as on a GPU"))
        assert main(["check", _write(tmp_path, config), "--table"]) == 0
    out = capsys.readouterr().out
    [line] = [ln for ln in out.splitlines() if ln.startswith("  Newton-Schulz   ")]
    triton, _, total = line.split()[1:4]
    views = [tuple(map(int, m.groups())) for m in re.finditer(r" muon +(\d+)x(\d+)x(\d+) ", out)]
    fused, buckets = assign(views, K, True)
    assert int(total) == sum(bs for bs, _, _ in views) == 10  # the 240-wide fitting layers among them
    assert int(triton) == sum(len(f.meta) for f in fused) == 4, line
    assert sum(b.batch for b in buckets) == 6 and all(not F.on_triton(min(b.rows, b.cols)) for b in buckets)


def test_optimizer_error_words_dargs_errors_with_or_without_the_input_file(tmp_path):
    """dp train's dargs error about the optimizer section, as dp check words it; other sections are not ours."""
    from dargs.dargs import ArgumentError

    from deepmd_hybridmuon.cli import optimizer_error

    err = ArgumentError("optimizer", "key `momentum` gets wrong value type, requires <float> but gets <str>")
    path = _write(tmp_path, _example())
    assert optimizer_error(err, path).startswith(f"{path}: [at location `optimizer`] key `momentum`")
    assert optimizer_error(err, None).startswith("[at location `optimizer`] key `momentum`")  # no file: no prefix
    assert optimizer_error(ArgumentError("training", "key `numb_steps` gets wrong value type"), path) is None
