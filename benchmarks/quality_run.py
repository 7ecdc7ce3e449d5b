"""``train_quality.py run``: train each config x optimizer x seed and record the results.

The command line and what a run does are in ``train_quality.py``'s docstring; the tables and
plots are made by ``quality_report.py``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    AVERAGE_RE,
    DISABLE_ENV,
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
    lc = r.get("lcurve") or {}
    parts = [f"wall {r['wall_s']:.1f} s"]
    if r.get("s_per_batch") is not None:
        parts.append(f"{r['s_per_batch']:.4f} s/batch")
    if cols := error_columns(lc):
        force, energy, kind = cols
        if lc[force]:
            parts.append(f"val F {kind} {lc[force][-1]:.3e} eV/Å")
        if lc.get(energy):
            parts.append(f"val E {kind} {lc[energy][-1]:.3e} eV/atom")
    t = r.get("test") or {}
    if "rmse_f" in t:
        parts.append(f"test F {t['rmse_f']:.3e} E/atom {t.get('rmse_e_per_atom', float('nan')):.3e}")
    parts.append("plugin line " + ("seen" if r["plugin_log_line_seen"] else "absent"))
    parts.append("OK" if r["ok"] else "PROBLEMS: " + "; ".join(r["problems"]))
    return ", ".join(parts)


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
