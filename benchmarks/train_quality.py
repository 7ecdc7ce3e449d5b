#!/usr/bin/env python
"""Training quality of deepmd-hybridmuon vs deepmd-kit's built-in HybridMuon vs Adam(W) on DFT water.

Two subcommands, so that the training can run on a machine without matplotlib and the
plots can be made elsewhere:

``run``
    For each config × optimizer × seed, writes a modified copy of a shared deepmd input
    (absolute data paths, ``numb_steps``, ``disp_freq`` = steps/20, ``save_freq`` = steps, an
    exponential learning rate from ``start_lr`` to ``start_lr/30`` with ``decay_steps`` = steps/20,
    training and model seeds = the seed, ``numb_btch`` validation batches per lcurve point, no
    ``stat_file``: each run computes the data statistics itself, so all runs of a seed see the
    same batches) into ``WORKDIR/<config>/<optimizer>/seed<k>/``, runs
    ``dp --pt train input.json`` there (log in ``train.log``), then by default
    ``dp --pt test`` of the final checkpoint on the whole validation system (log in ``test.log``).
    After each run, everything (lcurve included) goes into one JSON file, so that partial
    results survive an interruption; a run whose input is unchanged and which already
    succeeded in that JSON is skipped (``--rerun`` to force), so an interrupted sweep resumes.

    Optimizers:

    * ``ours``: ``{"type": "HybridMuon", **hm_kw}`` with this package's plugin active (checked:
      the log line "optimizer: deepmd-hybridmuon" must appear);
    * ``builtin``: the same section with ``DEEPMD_HYBRIDMUON_DISABLE=1``, deepmd-kit's own
      HybridMuon (checked: that log line must not appear);
    * ``adam``: ``{"type": "Adam"}``, or the config's own section when that is AdamW (dpa3);
      without one for dpa3, ``{"type": "AdamW"}``.

``report``
    Reads one or more results JSON files, prints a markdown table per config and writes
    learning curves (validation force and energy RMSE vs step) as ``quality_<config>.png``.

Units: deepmd's lcurve ``rmse_e_*`` is the energy RMSE divided by the number of atoms
(``rmse_e = sqrt(mean((E - E_ref)^2)) / natoms`` in ``deepmd/pt/loss/ener.py``), i.e. eV/atom;
``rmse_f_*`` is the force RMSE over all components, eV/Å. The tables show meV/atom and meV/Å.
The ``_val`` columns are evaluated on ``numb_btch`` batches of the validation system at each
lcurve point, the ``_trn`` columns on the single training batch of that step.

Usage::

    # on the GPU machine (python3 with torch, deepmd-kit and this package)
    python3 benchmarks/train_quality.py run --workdir /tmp/tq --seeds 1,2
    python3 benchmarks/train_quality.py run --configs dpa3_water --steps dpa3_water=800 \\
        --optimizers ours,builtin --lr ours=2e-3,builtin=2e-3 --hm-kw enable_gram=False --tag nogram
    # smoke test (CPU)
    python benchmarks/train_quality.py run --configs se_e2_a_water --steps se_e2_a_water=20 --seeds 1
    # here (needs matplotlib)
    python benchmarks/train_quality.py report /tmp/tq/results.json --plots plots/
"""

from __future__ import annotations

import argparse
import ast
import copy
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import DISABLE_ENV, _absolute_systems, prepare_run, resolve_config  # shared with the speed benchmark

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG_DIR = REPO_ROOT.parent / "shared" / "configs"
DEFAULT_CONFIGS = ("se_e2_a_water", "dpa3_water")
DEFAULT_STEPS = {"se_e2_a_water": 2000, "dpa3_water": 1000}
FALLBACK_STEPS = 1000
OPTIMIZERS = ("ours", "builtin", "adam")
DEFAULT_LR = 1e-3
LR_RATIO = 30.0  # stop_lr = start_lr / LR_RATIO
N_DISP = 20  # lcurve points (plus step 1)
OURS_LOG_MARK = "optimizer: deepmd-hybridmuon"
SCHEMA = "train_quality/1"

AVERAGE_RE = re.compile(r"average training time:\s*([0-9.eE+-]+)\s*s/batch(?:\s*\((\d+) batches excluded\))?")
TEST_RE = {
    "rmse_e_per_atom": re.compile(r"Energy RMSE/Natoms\s*:\s*([0-9.eE+-]+|nan)"),
    "rmse_e": re.compile(r"Energy RMSE\s*:\s*([0-9.eE+-]+|nan)"),
    "rmse_f": re.compile(r"Force\s+RMSE\s*:\s*([0-9.eE+-]+|nan)"),
    "rmse_v_per_atom": re.compile(r"Virial RMSE/Natoms\s*:\s*([0-9.eE+-]+|nan)"),
    "nframes": re.compile(r"number of test data\s*:\s*(\d+)"),
}


# ============================================================================ run: inputs


def optimizer_section(name: str, config: dict[str, Any], hm_kw: dict[str, Any]) -> dict[str, Any]:
    """The ``optimizer`` section of one optimizer variant."""
    if name in ("ours", "builtin"):
        return {"type": "HybridMuon", **hm_kw}
    if name == "adam":
        own = config.get("optimizer") or {}
        if own.get("type") == "AdamW":
            return dict(own)
        model = config.get("model") or {}
        kind = str((model.get("descriptor") or {}).get("type") or model.get("type", ""))  # DPA-4: the model's type
        return {"type": "AdamW"} if kind.startswith("dpa") else {"type": "Adam"}
    raise ValueError(f"unknown optimizer {name!r}")


def make_input(
    config: dict[str, Any],
    config_path: Path,
    section: dict[str, Any],
    *,
    steps: int,
    start_lr: float,
    seed: int,
    valid_batches: int,
    keep_schedule: bool = False,
) -> dict[str, Any]:
    """The input of one run: ``config`` with run length, schedule, optimizer, seeds, absolute paths.

    ``keep_schedule``: the config's own ``learning_rate`` section (e.g. DPA-4's wsd) with its
    ``start_lr`` replaced and ``stop_lr`` scaled by the same factor; otherwise an exponential
    schedule from ``start_lr`` to ``start_lr / LR_RATIO``.
    """
    cfg = copy.deepcopy(config)
    base = config_path.parent
    disp_freq = max(1, steps // N_DISP)
    own = cfg.get("learning_rate") or {}
    if keep_schedule and "start_lr" in own:
        ratio = start_lr / float(own["start_lr"])
        cfg["learning_rate"] = {**own, "start_lr": start_lr}
        if "stop_lr" in own:
            cfg["learning_rate"]["stop_lr"] = float(own["stop_lr"]) * ratio
    else:
        cfg["learning_rate"] = {
            "type": "exp",
            "start_lr": start_lr,
            "stop_lr": start_lr / LR_RATIO,
            "decay_steps": max(1, steps // N_DISP),
        }
    cfg["optimizer"] = copy.deepcopy(section)
    model = cfg.setdefault("model", {})
    for key in ("descriptor", "fitting_net"):
        if isinstance(model.get(key), dict):
            model[key]["seed"] = seed
    training = cfg.setdefault("training", {})
    training["numb_steps"] = steps
    training["disp_freq"] = disp_freq
    training["save_freq"] = steps
    training["disp_file"] = "lcurve.out"
    training["seed"] = seed
    # Every run computes the data statistics itself: loading them from a file shared with an
    # earlier run skips the random sampling of the statistics frames, which shifts the random
    # stream and so the training batches (the first run would see other batches than the rest).
    training.pop("stat_file", None)
    training.pop("max_ckpt_keep", None)
    for key in ("training_data", "validation_data"):
        data = training.get(key)
        if isinstance(data, dict) and "systems" in data:
            data["systems"] = _absolute_systems(data["systems"], base)
    if isinstance(training.get("validation_data"), dict):
        training["validation_data"].pop("numb_batch", None)  # deepmd's alias of numb_btch (DPA-4's example)
        training["validation_data"]["numb_btch"] = valid_batches
    return cfg


def input_digest(cfg: dict[str, Any], optimizer: str) -> str:
    blob = json.dumps({"input": cfg, "optimizer": optimizer}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


# ============================================================================ run: parsing


def parse_lcurve(path: Path) -> dict[str, list[float]] | None:
    """The columns of deepmd's lcurve.out by name (``step``, ``rmse_f_val``, ..., ``lr``)."""
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


def parse_test_log(text: str) -> dict[str, float]:
    """The weighted-average block of ``dp test`` (the last occurrence of each line)."""
    out: dict[str, float] = {}
    for key, rx in TEST_RE.items():
        found = rx.findall(text)
        if found:
            out[key] = float(found[-1])
    return out


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def run_cmd(cmd: list[str], cwd: Path, env: dict[str, str], log_path: Path, timeout: float) -> tuple[int, bool, float]:
    """Run ``cmd`` in its own process group with output to ``log_path``: (returncode, timed_out, wall)."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
            rc = proc.returncode
        except BaseException:
            _kill(proc)
            raise
    return rc, timed_out, time.perf_counter() - t0


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""


def run_one(
    *,
    config_name: str,
    config: dict[str, Any],
    config_path: Path,
    optimizer: str,
    label: str,
    seed: int,
    steps: int,
    start_lr: float,
    hm_kw: dict[str, Any],
    workdir: Path,
    dp: list[str],
    args: argparse.Namespace,
    cfg: dict[str, Any],
    digest: str,
) -> dict[str, Any]:
    rundir = workdir / config_name / label / f"seed{seed}"
    env = prepare_run(rundir, cfg, optimizer == "builtin")
    cmd = [*dp, "--pt", "train", "input.json"]
    prefix = f"[{config_name}/{label}/seed{seed}]"
    print(f"{prefix} {'DEEPMD_HYBRIDMUON_DISABLE=1 ' if optimizer == 'builtin' else ''}{shlex.join(cmd)}", flush=True)
    print(f"{prefix}   in {rundir}", flush=True)
    rc, timed_out, wall = run_cmd(cmd, rundir, env, rundir / "train.log", args.timeout)
    text = (rundir / "train.log").read_text(errors="replace")
    avg = AVERAGE_RE.findall(text)
    lcurve = parse_lcurve(rundir / "lcurve.out")
    plugin_seen = OURS_LOG_MARK in text
    mark_line = next((ln.strip() for ln in text.splitlines() if OURS_LOG_MARK in ln), None)
    result: dict[str, Any] = {
        "config": config_name,
        "config_path": str(config_path),
        "optimizer": optimizer,
        "label": label,
        "seed": seed,
        "steps": steps,
        "disp_freq": cfg["training"]["disp_freq"],
        "start_lr": start_lr,
        "stop_lr": cfg["learning_rate"].get("stop_lr"),
        "decay_steps": cfg["learning_rate"].get("decay_steps"),
        "lr_schedule": cfg["learning_rate"].get("type", "exp"),
        "valid_batches": args.valid_batches,
        "optimizer_section": cfg["optimizer"],
        "hm_kw": {k: repr(v) for k, v in hm_kw.items()} if optimizer in ("ours", "builtin") else {},
        "env": {DISABLE_ENV: "1"} if optimizer == "builtin" else {},
        "input_digest": digest,
        "rundir": str(rundir),
        "returncode": rc,
        "timed_out": timed_out,
        "wall_s": wall,
        "s_per_batch": float(avg[-1][0]) if avg else None,
        "batches_excluded": int(avg[-1][1]) if avg and avg[-1][1] else 0,
        "plugin_log_line_seen": plugin_seen,
        "plugin_log_line": mark_line,
        "lcurve": lcurve,
        "test": None,
    }
    problems: list[str] = []
    if timed_out:
        problems.append(f"timed out after {args.timeout:.0f} s")
    elif rc != 0:
        problems.append(f"dp train exited with {rc}: {_last_line(text)}")
    if optimizer == "ours" and not plugin_seen:
        problems.append("the plugin's log line is missing: ours was not used?")
    if optimizer != "ours" and plugin_seen:
        problems.append("the plugin's log line is present: the plugin was not disabled?")
    if lcurve is None or not lcurve.get("step"):
        problems.append("no lcurve.out")
    elif "rmse_f_val" not in lcurve:
        problems.append(f"no rmse_f_val column in lcurve.out (columns: {list(lcurve)})")
    elif lcurve["step"][-1] != steps and not timed_out and rc == 0:
        problems.append(f"lcurve ends at step {lcurve['step'][-1]}, not {steps}")
    if rc == 0 and not timed_out and avg == []:
        problems.append("no 'average training time' line in the log")

    # Full validation-set test of the final checkpoint (a more stable final number than the lcurve's).
    ckpt = rundir / "model.ckpt.pt"
    if not args.no_test and rc == 0 and not timed_out and ckpt.exists():
        systems = cfg["training"]["validation_data"]["systems"]
        systems = systems if isinstance(systems, list) else [systems]
        tcmd = [*dp, "--pt", "test", "-m", ckpt.name, "-n", str(args.test_frames)]
        for s in systems:
            tcmd += ["-s", s]
        trc, tto, twall = run_cmd(tcmd, rundir, env, rundir / "test.log", args.timeout)
        ttext = (rundir / "test.log").read_text(errors="replace")
        test = parse_test_log(ttext)
        test.update({"returncode": trc, "timed_out": tto, "wall_s": twall, "systems": systems})
        result["test"] = test
        if trc != 0 or "rmse_f" not in test:
            problems.append(f"dp test failed ({trc}): {_last_line(ttext)}")
    result["problems"] = problems
    result["ok"] = not problems
    return result


def summary_line(r: dict[str, Any]) -> str:
    lc = r.get("lcurve") or {}
    parts = [f"wall {r['wall_s']:.1f} s"]
    if r.get("s_per_batch") is not None:
        parts.append(f"{r['s_per_batch']:.4f} s/batch")
    if lc.get("rmse_f_val"):
        parts.append(f"val F {lc['rmse_f_val'][-1]:.3e} eV/Å")
    if lc.get("rmse_e_val"):
        parts.append(f"val E {lc['rmse_e_val'][-1]:.3e} eV/atom")
    t = r.get("test") or {}
    if "rmse_f" in t:
        parts.append(f"test F {t['rmse_f']:.3e} E/atom {t.get('rmse_e_per_atom', float('nan')):.3e}")
    parts.append("plugin line " + ("seen" if r["plugin_log_line_seen"] else "absent"))
    parts.append("OK" if r["ok"] else "PROBLEMS: " + "; ".join(r["problems"]))
    return ", ".join(parts)


# ============================================================================ run: options


def parse_value(value: str) -> Any:
    value = value.strip()
    lowered = {"true": "True", "false": "False", "null": "None", "none": "None"}.get(value.lower(), value)
    try:
        return ast.literal_eval(lowered)
    except (ValueError, SyntaxError):
        return value  # a bare string, e.g. muon_mode=slice


def parse_hm_kw(items: list[str]) -> dict[str, dict[str, Any]]:
    """``key=value`` for ours and builtin, ``ours:key=value`` / ``builtin:key=value`` for one of them."""
    out: dict[str, dict[str, Any]] = {"ours": {}, "builtin": {}}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise SystemExit(f"--hm-kw expects key=value, got {item!r}")
        target, colon, name = key.partition(":")
        targets = [target] if colon else ["ours", "builtin"]
        name = name if colon else key
        for t in targets:
            if t not in out:
                raise SystemExit(f"--hm-kw {item!r}: prefix must be ours: or builtin:")
            out[t][name.strip()] = parse_value(value)
    return out


def parse_mapping(text: str | None, what: str, conv: Any) -> tuple[Any, dict[str, Any]]:
    """``"x"`` (one value for all) or ``"a=x,b=y"``: (value for all or None, per-name values)."""
    if not text:
        return None, {}
    common = None
    per: dict[str, Any] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        name, sep, value = part.partition("=")
        try:
            if sep:
                per[name.strip()] = conv(value.strip())
            else:
                common = conv(part)
        except ValueError as exc:
            raise SystemExit(f"{what}: bad value in {part!r}: {exc}") from exc
    return common, per


def find_dp(spec: str | None) -> list[str]:
    if spec:
        return shlex.split(spec)
    local = Path(sys.executable).with_name("dp")
    if local.exists():
        return [str(local)]
    return [sys.executable, "-m", "deepmd"]


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "versions": {d: _version(d) for d in ("torch", "deepmd-kit", "deepmd-hybridmuon")},
    }
    # no torch import here: a CUDA context in this process would take GPU memory from the runs
    if shutil.which("nvidia-smi"):
        try:
            gpu = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
            info["gpu"] = gpu or None
        except (OSError, subprocess.SubprocessError):
            info["gpu"] = None
    return info


def load_results(path: Path) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or "runs" not in data:
        raise SystemExit(f"{path}: not a train_quality results file")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def cmd_run(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if bad := [o for o in optimizers if o not in OPTIMIZERS]:
        raise SystemExit(f"unknown optimizers {bad}; choose from {','.join(OPTIMIZERS)}")
    try:
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        raise SystemExit(f"--seeds: {exc}") from exc
    steps_all, steps_per = parse_mapping(args.steps, "--steps", int)
    lr_all, lr_per = parse_mapping(args.lr, "--lr", float)
    if bad := [k for k in lr_per if k not in OPTIMIZERS]:
        raise SystemExit(f"--lr: unknown optimizers {bad}")
    hm_kw = parse_hm_kw(args.hm_kw)
    dp = find_dp(args.dp)
    workdir = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    json_path = (args.json or workdir / "results.json").resolve()

    resolved = {}
    for spec in configs:
        path = resolve_config(spec, args.config_dir)
        with open(path) as f:
            resolved[path.stem] = (path, json.load(f))
    if bad := [k for k in steps_per if k not in resolved]:
        raise SystemExit(f"--steps: unknown configs {bad} (running {list(resolved)})")

    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    command = shlex.join([sys.executable, *sys.argv])
    if json_path.exists() and not args.fresh:
        data = load_results(json_path)
        data.setdefault("invocations", []).append({"date_utc": date, "command": command})
    else:
        data = {"schema": SCHEMA, "invocations": [{"date_utc": date, "command": command}], "runs": []}
    data["machine"] = machine_info()
    data["units"] = {
        "rmse_e_*": "eV/atom (deepmd lcurve: energy RMSE / natoms)",
        "rmse_f_*": "eV/Angstrom (all force components)",
        "test.rmse_e_per_atom": "eV/atom (dp test on the whole validation system, final checkpoint)",
        "test.rmse_f": "eV/Angstrom",
        "s_per_batch": "deepmd's 'average training time' (first disp_freq batches excluded)",
        "wall_s": "wall time of the whole dp train process (start-up, statistics, validation included)",
    }
    print(f"# train_quality run, {date}\n- command: `{command}`\n- workdir: {workdir}\n- json: {json_path}")
    print(f"- machine: {data['machine']}\n", flush=True)

    plan = []
    for name, (path, config) in resolved.items():
        steps = steps_per.get(name, steps_all or DEFAULT_STEPS.get(name, FALLBACK_STEPS))
        if steps < N_DISP:
            print(f"note: {name}: {steps} steps < {N_DISP}: disp_freq and decay_steps are 1", flush=True)
        for opt in optimizers:
            label = f"{opt}-{args.tag}" if args.tag else opt
            start_lr = lr_per.get(opt, lr_all if lr_all is not None else DEFAULT_LR)
            kw = hm_kw.get(opt, {})
            section = optimizer_section(opt, config, kw)
            for seed in seeds:
                cfg = make_input(
                    config,
                    path,
                    section,
                    steps=steps,
                    start_lr=start_lr,
                    seed=seed,
                    valid_batches=args.valid_batches,
                    keep_schedule=args.keep_lr_schedule,
                )
                plan.append((name, path, config, opt, label, seed, steps, start_lr, kw, cfg))

    n_ok = n_bad = 0
    for i, (name, path, config, opt, label, seed, steps, start_lr, kw, cfg) in enumerate(plan, 1):
        digest = input_digest(cfg, opt)
        key = (name, label, seed)
        old = [r for r in data["runs"] if (r["config"], r["label"], r["seed"]) == key]
        if not args.rerun and any(r.get("ok") and r.get("input_digest") == digest for r in old):
            print(f"[{i}/{len(plan)}] {name}/{label}/seed{seed}: done already in {json_path.name}, skipped", flush=True)
            n_ok += 1
            continue
        print(f"[{i}/{len(plan)}] {name}/{label}/seed{seed}: {steps} steps, start_lr {start_lr:g}", flush=True)
        r = run_one(
            config_name=name,
            config=config,
            config_path=path,
            optimizer=opt,
            label=label,
            seed=seed,
            steps=steps,
            start_lr=start_lr,
            hm_kw=kw,
            workdir=workdir,
            dp=dp,
            args=args,
            cfg=cfg,
            digest=digest,
        )
        r["date_utc"] = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
        data["runs"] = [x for x in data["runs"] if (x["config"], x["label"], x["seed"]) != key] + [r]
        write_json(json_path, data)
        print(f"[{i}/{len(plan)}]   {summary_line(r)}", flush=True)
        n_ok += r["ok"]
        n_bad += not r["ok"]
    print(f"\n{n_ok} ok, {n_bad} with problems; wrote {json_path}")
    return 0 if n_bad == 0 else 1


# ============================================================================ report


def _mean_sd(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    vals = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    m = statistics.fmean(vals)
    if len(vals) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ± {fmt.format(statistics.stdev(vals))}"


def _at_fraction(lc: dict[str, list[float]], col: str, steps: int, frac: float) -> float | None:
    """The lcurve value at the point nearest to ``frac * steps``."""
    if not lc or col not in lc or not lc["step"]:
        return None
    target = frac * steps
    i = min(range(len(lc["step"])), key=lambda j: (abs(lc["step"][j] - target), -lc["step"][j]))
    return lc[col][i]


def _final(lc: dict[str, list[float]] | None, col: str) -> float | None:
    if not lc or col not in lc or not lc[col]:
        return None
    return lc[col][-1]


def collect(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """All runs of the files; a later file replaces a run of the same config/label/seed unless only the older is ok."""
    runs: dict[tuple, dict[str, Any]] = {}
    metas = []
    for p in paths:
        data = load_results(p)
        metas.append({"file": str(p), "machine": data.get("machine"), "invocations": data.get("invocations")})
        for r in data["runs"]:
            key = (r["config"], r["label"], r["seed"])
            if key not in runs or r.get("ok") or not runs[key].get("ok"):
                runs[key] = r
    return list(runs.values()), metas


def report_table(runs: list[dict[str, Any]]) -> str:
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        labels.setdefault(r["label"], []).append(r)
    has_test = any(r.get("test") and "rmse_f" in r["test"] for r in runs)
    head = [
        "optimizer",
        "seeds",
        "steps",
        "start_lr",
        "val F RMSE final (meV/Å)",
        "val E RMSE final (meV/atom)",
        "val F @25% (meV/Å)",
        "val F @50% (meV/Å)",
    ]
    if has_test:
        head += ["test F RMSE (meV/Å)", "test E RMSE (meV/atom)"]
    head += ["s/batch", "wall s", "notes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for label, rs in labels.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        good = [r for r in rs if r.get("lcurve") and r["lcurve"].get("step")]
        sec = rs[0].get("optimizer_section") or {}
        name = label if rs[0]["optimizer"] != "adam" else f"{label} ({sec.get('type', '?')})"
        steps = sorted({r["steps"] for r in rs})
        lrs = sorted({r["start_lr"] for r in rs})
        cells = [
            name,
            ",".join(str(r["seed"]) for r in rs),
            ",".join(map(str, steps)),
            ",".join(f"{x:g}" for x in lrs),
            _mean_sd([_final(r["lcurve"], "rmse_f_val") for r in good], 1e3),
            _mean_sd([_final(r["lcurve"], "rmse_e_val") for r in good], 1e3),
            _mean_sd([_at_fraction(r["lcurve"], "rmse_f_val", r["steps"], 0.25) for r in good], 1e3),
            _mean_sd([_at_fraction(r["lcurve"], "rmse_f_val", r["steps"], 0.5) for r in good], 1e3),
        ]
        if has_test:
            tests = [r["test"] for r in rs if r.get("test")]
            cells += [
                _mean_sd([t.get("rmse_f") for t in tests], 1e3),
                _mean_sd([t.get("rmse_e_per_atom") for t in tests], 1e3),
            ]
        cells += [
            _mean_sd([r.get("s_per_batch") for r in rs], fmt="{:.4f}"),
            _mean_sd([r.get("wall_s") for r in rs], fmt="{:.0f}"),
        ]
        notes = []
        for r in rs:
            notes += [f"seed {r['seed']}: {p}" for p in r.get("problems", [])]
        if rs[0]["optimizer"] in ("ours", "builtin"):
            seen = sum(bool(r.get("plugin_log_line_seen")) for r in rs)
            notes.append(f"plugin line in {seen}/{len(rs)} logs")
        if any(r.get("hm_kw") for r in rs):
            notes.append("kw " + ", ".join(f"{k}={v}" for k, v in rs[0]["hm_kw"].items()))
        cells.append("; ".join(notes).replace("|", "/") or "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_config(config: str, runs: list[dict[str, Any]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in runs))
    colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    # Identical curves (ours and builtin can coincide) stay visible: earlier labels are drawn
    # thicker and underneath, with their own marker.
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    marker = {lab: markers[i % len(markers)] for i, lab in enumerate(labels)}
    width = {lab: max(1.0, 3.2 - 0.9 * i) for i, lab in enumerate(labels)}
    seeds = sorted({r["seed"] for r in runs})
    styles = ["-", "--", ":", "-."]
    seed_style = {s: styles[i % len(styles)] for i, s in enumerate(seeds)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    panels = [("rmse_f_val", "validation force RMSE (meV/Å)"), ("rmse_e_val", "validation energy RMSE (meV/atom)")]
    for ax, (col, title) in zip(axes, panels, strict=True):
        for r in sorted(runs, key=lambda r: (labels.index(r["label"]), r["seed"])):
            lc = r.get("lcurve") or {}
            if col not in lc or not lc["step"]:
                continue
            pts = [(s, v * 1e3) for s, v in zip(lc["step"], lc[col], strict=True) if v > 0 and math.isfinite(v)]
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = [y for _, y in pts]
            ax.plot(
                xs,
                ys,
                color=colors[r["label"]],
                linestyle=seed_style[r["seed"]],
                marker=marker[r["label"]],
                markersize=width[r["label"]] + 2,
                linewidth=width[r["label"]],
                alpha=0.85,
                label=f"{r['label']} seed {r['seed']}" + ("" if r.get("ok") else " (!)"),
            )
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    steps = sorted({r["steps"] for r in runs})
    fig.suptitle(f"{config}: validation RMSE vs step ({','.join(map(str, steps))} steps, exp lr decay to start/30)")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def same_start_check(runs: list[dict[str, Any]]) -> str:
    """Whether the runs of each seed start alike: same step-1 training RMSE (same initial model, same batch)."""
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        firsts = {}
        for r in runs:
            lc = r.get("lcurve") or {}
            if r["seed"] == seed and lc.get("step") and lc["step"][0] == 1 and "rmse_trn" in lc:
                firsts[r["label"]] = lc["rmse_trn"][0]
        if len(firsts) < 2:
            continue
        if len(set(firsts.values())) == 1:
            out.append(f"seed {seed}: same ({next(iter(firsts.values())):.3g})")
        else:
            out.append(f"seed {seed}: DIFFERENT (" + ", ".join(f"{k} {v:.3g}" for k, v in firsts.items()) + ")")
    if not out:
        return ""
    return "step-1 training rmse (initial model on the first batch) across optimizers: " + "; ".join(out)


def cmd_report(args: argparse.Namespace) -> int:
    runs, metas = collect(args.results)
    if not runs:
        raise SystemExit("no runs in the results files")
    by_config: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_config.setdefault(r["config"], []).append(r)
    print("# Training quality: deepmd-hybridmuon (ours) vs built-in HybridMuon vs Adam(W)\n")
    for m in metas:
        mach = m.get("machine") or {}
        gpu = mach.get("gpu") or "no GPU seen"
        print(f"- {m['file']}: {mach.get('hostname', '?')}, {gpu}, versions {mach.get('versions')}")
    print(
        "- val = lcurve's rmse on validation batches at the last point; @25%/@50% = lcurve point nearest to"
        " that fraction of the steps; test = `dp test` of the final checkpoint on the whole validation"
        " system; energy RMSE is per atom (deepmd lcurve convention); values are mean ± sample sd over seeds\n"
    )
    for config, rs in by_config.items():
        print(f"## {config}\n")
        print(report_table(rs))
        print()
        if check := same_start_check(rs):
            print(f"{check}\n")
        if args.plots:
            png = plot_config(config, rs, args.plots / f"quality_{config}.png")
            print(f"![{config} learning curves]({png})\n")
    return 0


# ============================================================================ main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="train and record results (no matplotlib needed)")
    r.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR, help=f"default {DEFAULT_CONFIG_DIR}")
    r.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of config names or paths")
    r.add_argument(
        "--steps",
        default=None,
        help="N for all, or per config: se_e2_a_water=2000,dpa3_water=800 "
        f"(defaults {', '.join(f'{k}={v}' for k, v in DEFAULT_STEPS.items())})",
    )
    r.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma list of: " + ",".join(OPTIMIZERS))
    r.add_argument("--seeds", default="1,2", help="comma list of seeds (default 1,2)")
    r.add_argument(
        "--lr",
        default=None,
        help=f"start_lr for all, or per optimizer: ours=1e-3,builtin=1e-3,adam=1e-3 (default {DEFAULT_LR:g})",
    )
    r.add_argument(
        "--hm-kw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra HybridMuon key for ours and builtin, or ours:KEY=VALUE for one (repeatable)",
    )
    r.add_argument("--tag", default="", help="suffix of the optimizer labels (e.g. for a --hm-kw variant)")
    r.add_argument(
        "--keep-lr-schedule",
        action="store_true",
        help="keep the config's learning_rate section (e.g. DPA-4's wsd), only start_lr/stop_lr scaled",
    )
    r.add_argument("--valid-batches", type=int, default=8, help="validation_data numb_btch (default 8)")
    r.add_argument("--workdir", type=Path, default=Path("train_quality_runs"), help="default ./train_quality_runs")
    r.add_argument("--json", type=Path, default=None, help="results file (default WORKDIR/results.json)")
    r.add_argument("--timeout", type=float, default=3600.0, help="seconds per dp process (default 3600)")
    r.add_argument("--no-test", action="store_true", help="skip dp test of the final checkpoint")
    r.add_argument("--test-frames", type=int, default=100000, help="dp test -n (default: all frames)")
    r.add_argument("--rerun", action="store_true", help="rerun runs already done with the same input")
    r.add_argument("--fresh", action="store_true", help="start a new results file instead of adding to it")
    r.add_argument("--dp", default=None, help="dp command (default: dp next to this Python, else python -m deepmd)")
    r.set_defaults(func=cmd_run)

    p = sub.add_parser("report", help="markdown tables and learning-curve PNGs from results files")
    p.add_argument("results", type=Path, nargs="+", help="results JSON files")
    p.add_argument("--plots", type=Path, default=None, help="write quality_<config>.png here")
    p.set_defaults(func=cmd_report)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
