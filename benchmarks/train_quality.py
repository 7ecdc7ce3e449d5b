#!/usr/bin/env python
"""Training quality: deepmd-hybridmuon against deepmd-kit's built-in HybridMuon and Adam or AdamW, on DFT water.

``run`` trains each config × optimizer × seed: a copy of the shared deepmd input with absolute data paths,
``numb_steps``, ``disp_freq`` = steps/20, an exponential learning rate from ``start_lr`` to ``start_lr/30``
(or, with ``--keep-lr-schedule``, the input's own schedule rescaled), training and model seeds = the seed, and
no ``stat_file`` (each run computes the data statistics itself, so all runs of a seed see the same batches), in
``WORKDIR/<config>/<optimizer>/seed<k>/``; then ``dp --pt test`` of the final checkpoint on the validation
system. Each result (learning curve included) goes into one JSON file as it ends, and a run already done with
the same input is skipped, so an interrupted sweep resumes. Optimizers: ``ours`` (``{"type": "HybridMuon",
...}``, this package's log line checked), ``builtin`` (the same with ``DEEPMD_HYBRIDMUON_DISABLE=1``, the log line
checked absent), ``adam`` (the input's own AdamW section, else AdamW for DPA models and Adam for the others).

``report`` draws each config's learning curves (validation force and energy error against the step) as
``quality_<config>.png``; BENCHMARKS.md's tables come from the same files through ``benchmarks_doc.py``, which
uses this module's readers. Units: deepmd's lcurve ``rmse_e_*`` is eV/atom, ``rmse_f_*`` eV/Å (inputs with
``loss_func: mae``, DPA-4's, have ``mae_*`` columns instead).

Usage::

    python benchmarks/train_quality.py run --configs dpa3_water --steps 1200 --optimizers ours,adam \
        --lr ours=2e-2,adam=1e-2 --seeds 1,2 --workdir runs/q
    python benchmarks/train_quality.py run --configs se_e2_a_water --steps 20 --seeds 1   # a smoke test (CPU)
    python benchmarks/train_quality.py report runs/q/results.json --plots plots/          # needs matplotlib
"""

from __future__ import annotations

import argparse
import copy
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
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    AVERAGE_RE,
    DEFAULT_CONFIG_DIR,
    DISABLE_ENV,
    ERROR_COLUMNS,
    OURS_LOG_MARK,
    QUALITY_SCHEMA,
    absolute_data_paths,
    command_line,
    error_columns,
    find_dp,
    last_line,
    load_results,
    package_version,
    parse_lcurve,
    parse_value,
    prepare_run,
    resolve_config,
    shown,
    utc_now,
    write_json,
)

DEFAULT_CONFIGS = ("se_e2_a_water", "dpa3_water")
DEFAULT_STEPS = {"se_e2_a_water": 2000, "dpa3_water": 1000}
FALLBACK_STEPS = 1000
OPTIMIZERS = ("ours", "builtin", "adam")
DEFAULT_LR = 1e-3
LR_RATIO = 30.0  # stop_lr = start_lr / LR_RATIO
N_DISP = 20  # lcurve points (plus step 1)

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


def quality_input(
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
    absolute_data_paths(training, base)
    if isinstance(training.get("validation_data"), dict):
        training["validation_data"].pop("numb_batch", None)  # deepmd's alias of numb_btch (DPA-4's example)
        training["validation_data"]["numb_btch"] = valid_batches
    return cfg


def input_digest(cfg: dict[str, Any], optimizer: str) -> str:
    blob = json.dumps({"input": cfg, "optimizer": optimizer}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


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
        "config_path": shown(config_path),
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
        "loss": cfg.get("loss"),  # the lcurve's columns depend on it (loss_func mae: mae_*)
        "hm_kw": {k: repr(v) for k, v in hm_kw.items()} if optimizer in ("ours", "builtin") else {},
        "env": {DISABLE_ENV: "1"} if optimizer == "builtin" else {},
        "input_digest": digest,
        "rundir": shown(rundir),
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
        problems.append(f"dp train exited with {rc}: {last_line(text)}")
    if optimizer == "ours" and not plugin_seen:
        problems.append("the plugin's log line is missing: ours was not used?")
    if optimizer != "ours" and plugin_seen:
        problems.append("the plugin's log line is present: the plugin was not disabled?")
    if lcurve is None or not lcurve.get("step"):
        problems.append("no lcurve.out")
    elif error_columns(lcurve) is None:
        problems.append(f"no rmse_f_val or mae_f_val column in lcurve.out (columns: {list(lcurve)})")
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
            problems.append(f"dp test failed ({trc}): {last_line(ttext)}")
    result["problems"] = problems
    result["ok"] = not problems
    return result


def summary_line(r: dict[str, Any]) -> str:
    cols, lc = error_columns(r.get("lcurve")), r.get("lcurve") or {}
    final = f", final val force {cols[2]} {lc[cols[0]][-1]:.3e} eV/Å" if cols and lc[cols[0]] else ""
    return f"wall {r['wall_s']:.1f} s{final}, " + ("OK" if r["ok"] else "PROBLEMS: " + "; ".join(r["problems"]))


# ============================================================================ run: options


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


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "versions": {d: package_version(d) for d in ("torch", "deepmd-kit", "deepmd-hybridmuon")},
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

    date = utc_now()
    command = command_line()
    if json_path.exists() and not args.fresh:
        data = load_results(json_path)
        data.setdefault("invocations", []).append({"date_utc": date, "command": command})
    else:
        data = {"schema": QUALITY_SCHEMA, "invocations": [{"date_utc": date, "command": command}], "runs": []}
    data["machine"] = machine_info()
    data["units"] = {
        "rmse_e_*": "eV/atom (deepmd lcurve: energy RMSE / natoms)",
        "rmse_f_*": "eV/Angstrom (all force components)",
        "mae_e_*, mae_f_*": "as rmse_*, mean absolute errors (inputs with loss_func mae have these instead)",
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
                cfg = quality_input(
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
        r["date_utc"] = utc_now()
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


def _complete(r: dict[str, Any]) -> bool:
    """Whether the run's lcurve reaches its last step (a crashed or timed-out run's may stop early)."""
    lc = r.get("lcurve") or {}
    return bool(lc.get("step")) and lc["step"][-1] >= r["steps"]


def _final(lc: dict[str, list[float]] | None, col: str) -> float | None:
    if not lc or col not in lc or not lc[col]:
        return None
    return lc[col][-1]


def _by_label(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        labels.setdefault(r["label"], []).append(r)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in labels.items()}


def config_columns(runs: list[dict[str, Any]]) -> tuple[str, str, str] | None:
    """(force, energy, ``RMSE``/``MAE``) validation columns of a config's lcurves: RMSE where any run has them."""
    for force, energy, kind in ERROR_COLUMNS:
        if any(force in (r.get("lcurve") or {}) for r in runs):
            return force, energy, kind
    return None


def adamw_target(runs: list[dict[str, Any]], force: str) -> tuple[str, float, int] | None:
    """(label, mean final validation force error, runs) of the best Adam(W) label with complete lcurves."""
    best = None
    for label, rs in _by_label(runs).items():
        if rs[0]["optimizer"] != "adam":
            continue
        finals = [_final(r["lcurve"], force) for r in rs if _complete(r)]
        finals = [v for v in finals if v is not None and math.isfinite(v)]
        if finals and (best is None or statistics.fmean(finals) < best[1]):
            best = (label, statistics.fmean(finals), len(finals))
    return best


def steps_to(lc: dict[str, list[float]] | None, col: str, target: float) -> int | None:
    """The first lcurve step whose ``col`` is at or below ``target``, or None."""
    if not lc or col not in lc:
        return None
    return next((s for s, v in zip(lc["step"], lc[col], strict=True) if v <= target), None)


def _reach_cell(rs: list[dict[str, Any]], force: str, target: float) -> str:
    """Mean steps (and training seconds, steps x s/batch) to ``target`` over the runs with an lcurve."""
    tried = [r for r in rs if force in (r.get("lcurve") or {})]
    if not tried:
        return ""
    hits = [(steps_to(r["lcurve"], force, target), r.get("s_per_batch")) for r in tried]
    hits = [(n, spb) for n, spb in hits if n is not None]
    count = "" if len(hits) == len(tried) else f" (reached in {len(hits)} of {len(tried)} runs)"
    if not hits:
        return f"not reached{count}"
    steps = statistics.fmean(n for n, _ in hits)
    secs = [n * spb for n, spb in hits if spb]
    time = f" ({statistics.fmean(secs):.0f} s)" if secs else ""
    return f"{steps:.0f}{time}{count}"


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


def plot_config(
    config: str, runs: list[dict[str, Any]], out: Path, *, mean: bool = False, ymax: float | None = None
) -> Path:
    """Validation force and energy errors against step, one line per run (``mean``: per label, seeds' range shaded).

    ``ymax`` (meV): the upper limit of both panels, so that a diverged run does not flatten the rest.
    """
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("train_quality.py report draws with matplotlib: pip install matplotlib") from None
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
    force, energy, kind = config_columns(runs) or ERROR_COLUMNS[0]
    panels = [(force, f"validation force {kind} (meV/Å)"), (energy, f"validation energy {kind} (meV/atom)")]

    def points(r: dict[str, Any], col: str) -> dict[int, float]:
        lc = r.get("lcurve") or {}
        if col not in lc:
            return {}
        return {s: v * 1e3 for s, v in zip(lc["step"], lc[col], strict=True) if v > 0 and math.isfinite(v)}

    for ax, (col, title) in zip(axes, panels, strict=True):
        if mean:
            for label in labels:
                curves = [points(r, col) for r in runs if r["label"] == label]
                steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
                if not steps:
                    continue
                values = [[c[s] for c in curves] for s in steps]
                ax.plot(
                    steps,
                    [statistics.fmean(v) for v in values],
                    color=colors[label],
                    marker=marker[label],
                    markersize=4,
                    label=f"{label} ({len(curves)} seeds)",
                )
                ax.fill_between(
                    steps, [min(v) for v in values], [max(v) for v in values], color=colors[label], alpha=0.15
                )
        for r in [] if mean else sorted(runs, key=lambda r: (labels.index(r["label"]), r["seed"])):
            pts = sorted(points(r, col).items())
            if not pts:
                continue
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                color=colors[r["label"]],
                linestyle=seed_style[r["seed"]],
                marker=marker[r["label"]],
                markersize=width[r["label"]] + 2,
                linewidth=width[r["label"]],
                alpha=0.85,
                label=f"{r['label']} seed {r['seed']}" + ("" if r.get("ok") else " (!)"),
            )
        ax.set_yscale("log")
        if ymax is not None:
            ax.set_ylim(top=ymax)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    steps = sorted({r["steps"] for r in runs})
    schedules = sorted({r.get("lr_schedule", "exp") for r in runs})
    lr = "exp lr decay to start/30" if schedules == ["exp"] else f"lr schedule {','.join(schedules)}"
    what = "mean over seeds, range shaded" if mean else "each run"
    fig.suptitle(f"{config}: validation {kind} vs step ({','.join(map(str, steps))} steps, {lr}; {what})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def cmd_report(args: argparse.Namespace) -> int:
    """Each config's learning curves as ``quality_<config>.png`` (BENCHMARKS.md's tables: benchmarks_doc.py)."""
    runs, _ = collect(args.results)
    if not runs:
        raise SystemExit("no runs in the results files")
    by_config: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_config.setdefault(r["config"], []).append(r)
    for config, rs in by_config.items():
        print(plot_config(config, rs, args.plots / f"quality_{config}.png", mean=args.mean, ymax=args.ymax))
    return 0


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
    p.add_argument("--mean", action="store_true", help="plot one curve per label (mean over seeds, range shaded)")
    p.add_argument("--ymax", type=float, default=None, help="upper limit of the plots' error axes (meV)")
    p.set_defaults(func=cmd_report)

    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
