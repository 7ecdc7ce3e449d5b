"""`dp-hybridmuon check`: exit codes and messages on the examples and on bad inputs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deepmd_hybridmuon.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


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
    # the example's se_e2_a: embedding/fitting matrices on Muon, biases on Adam, totals printed
    assert "fitting_net.filter_layers.networks.0.layers.1.matrix" in out
    assert "totals:" in out
    muon_line = next(line for line in out.splitlines() if line.strip().startswith("muon "))
    assert int(muon_line.split()[1]) > 0


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
        ({"adam_beta2": 1.5}, "key `adam_beta2` gets bad value that fails to pass its extra checking. "),
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
