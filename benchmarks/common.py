"""What the benchmark scripts share: configs, run directories, ``dp`` and its logs, options.

Not a script: ``benchmarks/*.py`` import it (their own directory is on ``sys.path`` when run
as ``python benchmarks/<script>.py``). No torch or deepmd import at module level: the
training benchmarks run ``dp`` in child processes and must not take GPU memory themselves;
the model helpers import them when called.
"""

from __future__ import annotations

import ast
import copy
import datetime as _dt
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The water inputs shipped with the repository (their data in ``data/`` beside them).
DEFAULT_CONFIG_DIR = REPO_ROOT / "examples" / "water"
#: The optimizer's log lines: variants compiling in the background, and the step the kernels came in.
COMPILING_MARK = "variants in the background"
KERNELS_FROM_STEP_RE = re.compile(r"Triton kernels in use from step (\d+)")
#: deepmd's ``dp`` with every optimizer step timed (``timed_dp.py``).
TIMED_DP = Path(__file__).resolve().with_name("timed_dp.py")
#: Set to 1, this package's plugin steps aside and deepmd-kit's own HybridMuon runs.
DISABLE_ENV = "DEEPMD_HYBRIDMUON_DISABLE"
#: The plugin's log line when it builds the optimizer.
OURS_LOG_MARK = "optimizer: deepmd-hybridmuon"
#: Multi-GPU runs keep NVLink multicast off (the lent machines do not support it).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NAME_PREFIX = "model.Default."  # what deepmd's ModelWrapper puts before the model's names

AVERAGE_RE = re.compile(r"average training time:\s*([0-9.eE+-]+)\s*s/batch(?:\s*\((\d+) batches excluded\))?")
BATCH_RE = re.compile(r"Batch\s+(\d+):\s*total wall time\s*=\s*([0-9.eE+-]+)\s*s")

#: train_quality results files.
QUALITY_SCHEMA = "train_quality/1"
#: Validation error columns of deepmd's lcurve.out, by loss: (force, energy, what the table calls them).
ERROR_COLUMNS = (("rmse_f_val", "rmse_e_val", "RMSE"), ("mae_f_val", "mae_e_val", "MAE"))


# ----------------------------------------------------------------------------- small


def utc_now(seconds: bool = True) -> str:
    """The current UTC time as the reports print it."""
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC" if seconds else "%Y-%m-%d %H:%M UTC")


def shown(path: str | Path) -> str:
    """``path`` as results record it: relative to the repository, else ``$TMPDIR/...``, else its name alone.

    No absolute path of the machine that ran a benchmark goes into its results.
    """
    path = Path(path).resolve()
    for root, prefix in ((REPO_ROOT, ""), (Path(tempfile.gettempdir()).resolve(), "$TMPDIR/")):
        if path.is_relative_to(root):
            rel = path.relative_to(root).as_posix()
            return prefix + rel if rel != "." else prefix.rstrip("/") or "."
    return path.name


def shown_command(cmd: Sequence[str]) -> str:
    """A command line as results record it: this Python as ``python``, absolute paths through :func:`shown`."""
    return shlex.join("python" if a == sys.executable else shown(a) if os.path.isabs(a) else a for a in cmd)


def command_line(argv: list[str] | None = None) -> str:
    """The command line of this process (``argv``: the arguments main() was given instead), as results record it."""
    return shown_command([sys.executable, *sys.argv] if argv is None else argv)


def first_line(err: BaseException) -> str:
    """``Type: first line of the message`` of an exception."""
    msg = str(err).strip().splitlines()
    return f"{type(err).__name__}: {msg[0] if msg else ''}".rstrip(": ")


def last_line(text: str, width: int = 300) -> str:
    """The last non-blank line of a log (what a failed ``dp`` said last)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:width] if lines else ""


def package_version(dist: str) -> str | None:
    """The installed version of a distribution, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` (parents made; replaced at once, so a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


# --------------------------------------------------------------------------- options


def parse_value(value: str) -> Any:
    """A Python/JSON literal (``true``/``false``/``null``/``none`` too), else the bare string."""
    value = value.strip()
    lowered = {"true": "True", "false": "False", "null": "None", "none": "None"}.get(value.lower(), value)
    try:
        return ast.literal_eval(lowered)
    except (ValueError, SyntaxError):
        return value  # a bare string, e.g. muon_mode=flat


def parse_kw(items: list[str], flag: str = "--opt-kw") -> dict[str, Any]:
    """``key=value`` options (see :func:`parse_value`); ``flag`` names the option in errors."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{flag} expects key=value, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


# ---------------------------------------------------------------------------- config


def resolve_config(spec: str, config_dir: Path) -> Path:
    """A path, or the name of a config in ``config_dir`` (with or without ``.json``)."""
    path = Path(spec)
    if path.is_file():
        return path.resolve()
    for candidate in (config_dir / spec, config_dir / f"{spec}.json"):
        if candidate.is_file():
            return candidate.resolve()
    raise SystemExit(f"config {spec!r} not found (as a path or in {config_dir})")


def absolute_systems(systems: Any, base: Path) -> Any:
    """Data system paths (a string or a list) made absolute against ``base``."""
    if isinstance(systems, str):
        p = Path(systems)
        return str(p if p.is_absolute() else (base / p).resolve())
    if isinstance(systems, list):
        return [absolute_systems(s, base) for s in systems]
    return systems


def absolute_data_paths(training: dict[str, Any], base: Path) -> None:
    """Make the training and validation systems of a ``training`` section absolute, in place (each multi-task
    branch's, in ``data_dict``, too)."""
    for section in [training, *(training.get("data_dict") or {}).values()]:
        for key in ("training_data", "validation_data"):
            data = section.get(key)
            if isinstance(data, dict) and "systems" in data:
                data["systems"] = absolute_systems(data["systems"], base)


def timing_input(
    config: dict[str, Any],
    config_path: Path,
    variant: str,
    *,
    steps: int,
    disp_freq: int,
    stat_file: Path,
    opt_kw: dict[str, Any],
) -> dict[str, Any]:
    """The input of one timed run: ``config`` with the run length, optimizer and absolute paths.

    ``variant``: ``ours`` or ``builtin`` (a HybridMuon section with ``opt_kw``) or ``adamw``
    (the config's own section if it is AdamW).
    """
    cfg = copy.deepcopy(config)
    training = cfg.setdefault("training", {})
    training["numb_steps"] = steps
    training["disp_freq"] = disp_freq
    training["save_freq"] = max(steps, 1)  # no intermediate checkpoint inside the timed intervals
    training["disp_file"] = "lcurve.out"
    branches = training.get("data_dict") or {}
    for name, branch in branches.items():  # multi-task: a statistics file per branch
        branch["stat_file"] = str(stat_file.with_name(f"{stat_file.stem}_{name}{stat_file.suffix}"))
    if not branches:
        training["stat_file"] = str(stat_file)
    absolute_data_paths(training, config_path.parent)
    if variant in ("ours", "builtin"):
        section: dict[str, Any] = {"type": "HybridMuon", **opt_kw}
    elif variant == "adamw":
        own = cfg.get("optimizer") or {}
        section = dict(own) if own.get("type") == "AdamW" else {"type": "AdamW"}
    else:
        raise ValueError(f"unknown variant {variant!r}")
    cfg["optimizer"] = section
    return cfg


# ------------------------------------------------------------------------------- dp


def find_dp(spec: str | None = None) -> list[str]:
    """The ``dp`` command: ``spec`` split, else dp next to this Python, on PATH, else ``python -m deepmd``."""
    if spec:
        return shlex.split(spec)
    local = Path(sys.executable).with_name("dp")
    if local.exists():
        return [str(local)]
    found = shutil.which("dp")
    return [found] if found else [sys.executable, "-m", "deepmd"]


def torchrun_dp(gpus: int, dp: list[str]) -> list[str]:
    """``torchrun`` with ``gpus`` ranks on this host, running the ``dp`` command as it is."""
    return ["torchrun", "--standalone", f"--nproc_per_node={gpus}", "--no-python", *dp]


def prepare_run(rundir: Path, cfg: dict[str, Any], builtin: bool) -> dict[str, str]:
    """A fresh ``rundir`` with ``input.json``; the environment of its ``dp`` process.

    ``builtin``: deepmd-kit's own HybridMuon (our plugin switched off), else ours.
    """
    if rundir.exists():
        shutil.rmtree(rundir)
    rundir.mkdir(parents=True)
    with open(rundir / "input.json", "w") as f:
        json.dump(cfg, f, indent=2)
    env = dict(os.environ)
    if builtin:
        env[DISABLE_ENV] = "1"
    else:
        env.pop(DISABLE_ENV, None)
    return env


def run_logged(cmd: list[str], rundir: Path, env: dict[str, str], timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` in ``rundir``: its return code (-9 when it ran past ``timeout`` s), output and wall seconds.

    The output is also written to ``rundir/train.log``.
    """
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=rundir, capture_output=True, text=True, env=env, timeout=timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = -9
        log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        log += f"\n(timed out after {timeout} s)"
    (rundir / "train.log").write_text(log)
    return rc, log, time.perf_counter() - t0


def parse_log(text: str) -> dict[str, Any]:
    """deepmd's timing lines of one ``dp train`` log, and whether our plugin's log line is in it."""
    batches = [(int(m.group(1)), float(m.group(2))) for m in BATCH_RE.finditer(text)]
    avg = AVERAGE_RE.findall(text)
    return {
        "average_s_per_batch": float(avg[-1][0]) if avg else None,
        "batches_excluded": int(avg[-1][1]) if avg and avg[-1][1] else 0,
        "intervals": batches,
        "ours_active": OURS_LOG_MARK in text,
    }


def parse_lcurve(path: Path) -> dict[str, list[float]] | None:
    """The columns of deepmd's lcurve.out by name (``step``, ``rmse_f_val``, ..., ``lr``); None without one."""
    if not path.is_file():
        return None
    names: list[str] | None = None
    rows: list[list[float]] = []
    for line in path.read_text().splitlines():
        s = line.strip()
        if not s:
            continue
        if s.startswith("#"):
            fields = s.lstrip("#").split()
            if names is None and fields and fields[0] == "step":
                names = fields
            continue
        try:
            rows.append([float(x) for x in s.split()])
        except ValueError:
            continue
    if names is None:
        return None
    out: dict[str, list[float]] = {n: [] for n in names}
    for row in rows:
        if len(row) != len(names):
            continue  # a line being written when the run was cut off
        for n, v in zip(names, row, strict=True):
            out[n].append(v)
    out["step"] = [int(v) for v in out["step"]]
    return out


def error_columns(lcurve: dict[str, Any] | None) -> tuple[str, str, str] | None:
    """(force column, energy column, ``RMSE`` or ``MAE``) of an lcurve's validation errors, or None.

    deepmd writes ``rmse_*`` columns for the default mse loss and ``mae_*`` ones (no
    ``rmse_f_val``) for ``loss_func: mae`` (DPA-4's example).
    """
    for force, energy, kind in ERROR_COLUMNS:
        if lcurve and force in lcurve:
            return force, energy, kind
    return None


# -------------------------------------------------------------------- quality results


def load_results(path: Path) -> dict[str, Any]:
    """A train_quality results file; runs recorded as failed only for lacking ``rmse_f_val`` are mended.

    Before the MAE columns were understood, a run with ``loss_func: mae`` was recorded with the
    problem "no rmse_f_val column"; its ``mae_f_val`` column serves, so that problem is dropped.
    """
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "runs" not in data:
        raise SystemExit(f"{path}: not a train_quality results file")
    for r in data["runs"]:
        if error_columns(r.get("lcurve")) and any(p.startswith("no rmse_f_val column") for p in r.get("problems", [])):
            r["problems"] = [p for p in r["problems"] if not p.startswith("no rmse_f_val column")]
            r["ok"] = not r["problems"]
    return data


# ----------------------------------------------------------------------------- models


def load_model_params(path: Path) -> dict[str, Any]:
    """The normalised ``model`` section of a deepmd input file (the raw one if normalising fails)."""
    from deepmd.utils.argcheck import normalize
    from deepmd.utils.compat import update_deepmd_input

    with open(path) as f:
        config = json.load(f)
    config.pop("optimizer", None)  # only the model is needed
    config = update_deepmd_input(config, warning=False)
    try:
        config = normalize(config)
    except Exception as err:  # only the model is needed: fall back to the raw section
        print(f"  (argcheck normalize failed for {path.name}: {first_line(err)}; using the raw model section)")
    return config["model"]


def build_model(path: Path) -> Any:
    """deepmd's torch model of one input file (on the CPU, its own dtype)."""
    from deepmd.pt.model.model import get_model

    return get_model(load_model_params(path))


def build_named_params(path: Path, device: Any) -> tuple[list[tuple[str, Any]], list[bool]]:
    """(trainer-style name, detached parameter on ``device``) of one config's model, and requires_grad."""
    model = build_model(path).to(device)
    try:
        from deepmd.pt.train.wrapper import ModelWrapper

        named = list(ModelWrapper(model).named_parameters())
    except Exception:  # names are what matters: mimic the wrapper
        named = [(NAME_PREFIX + n, p) for n, p in model.named_parameters()]
    return [(n, p.detach().clone()) for n, p in named], [p.requires_grad for _, p in named]
