#!/usr/bin/env python
"""`dp --pt train` on N GPUs for each training.zero_stage: ours, AdamW and the built-in.

For each config, stage (0: DDP, 1: ZeRO-1, 2 and 3: FSDP2) and optimizer variant this runs
``torchrun --nproc_per_node=N benchmarks/timed_dp.py --pt train input.json`` (``dp`` with
every optimizer step timed by CUDA events) on a short schedule of a shared config. The
order of the variants alternates from one stage to the next (ours, adamw, builtin, then
builtin, adamw, ours, ...) and is recorded; a stage given again in ``--stages`` runs again
(labelled ``stage0#2`` etc.: pairs repeated in alternating order resolve a small
difference). A 1-step run before them computes the data statistics file they all load and
compiles the Triton kernels into Triton's cache. It reports:

* deepmd's average s/batch (the first ``disp_freq`` batches left out);
* the optimizer step's own time: median over the steps after ``--skip`` of the CUDA-event
  time of ``step()`` on each rank, the slowest rank's (the ZeroRedundancyOptimizer's step at
  stage 1, which includes its parameter broadcast); the JSON also has the mean, the host's
  time in ``step()`` (mean, worst) and how long slow steps held the host in all;
* the final validation errors.

Usage::

    python benchmarks/multi_gpu.py dpa2_small_water dpa3_water dpa4_water --gpus 2 --steps 80 --json out.json
    python benchmarks/multi_gpu.py dpa3_water --gpus 1 --stages 0,0 --variants ours,adamw,builtin   # one GPU
    python benchmarks/multi_gpu.py dpa4_water --stages 0,2,3,1 --no-ema   # DPA-4 at every stage (EMA off)
    python benchmarks/multi_gpu.py dpa2_small_water --stages 0,0,0,0 --variants ours,adamw   # stage 0, 4 pairs
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    COMPILING_MARK,
    DEFAULT_CONFIG_DIR,
    NO_MULTICAST_ENV,
    TIMED_DP,
    command_line,
    error_columns,
    last_line,
    parse_lcurve,
    parse_log,
    prepare_run,
    resolve_config,
    run_logged,
    shown,
    shown_command,
    timing_input,
    utc_now,
    write_json,
)

VARIANTS = ("ours", "adamw", "builtin")
#: The optimizer whose step() is the whole step when several are timed (ZeRO-1 wraps the local one).
OUTER = "ZeroRedundancyOptimizer"


def _step_ms(times_dir: Path, skip: int) -> dict[str, Any]:
    """The outer optimizer's step() per rank, after ``skip`` steps: GPU median and mean, host mean and worst.

    ``held_s``: how long the host was held by the steps beyond the median one, summed (one-time
    work inside the timed window, which deepmd's mean s/batch carries and a median hides).
    """
    per_rank = {}
    for path in sorted(times_dir.glob("rank*.json")):
        times = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}  # not the extras
        name = OUTER if OUTER in times else max(times, key=lambda k: len(times[k]["host_ms"]))
        gpu = times[name]["gpu_ms"][skip:] or times[name]["gpu_ms"] or [float("nan")]
        host = times[name]["host_ms"][skip:] or times[name]["host_ms"] or [float("nan")]
        typical = statistics.median(host)
        per_rank[path.stem] = {
            "optimizer": name,
            "steps": len(times[name]["host_ms"]),
            "median_ms": statistics.median(gpu),
            "mean_ms": statistics.fmean(gpu),
            "host_mean_ms": statistics.fmean(host),
            "host_max_ms": max(host),
            "held_s": sum(t - typical for t in host if t > typical) / 1e3,
        }
        # the rest of each training step (forward, backward, data), from one step's end to the next's start
        for kind in ("gpu", "host"):
            rest = times[name].get(f"between_{kind}_ms", [])[skip:]
            if rest:
                per_rank[path.stem][f"between_{kind}_median_ms"] = statistics.median(rest)
    worst = max((r["median_ms"] for r in per_rank.values()), default=None)
    return {"per_rank": per_rank, "slowest_rank_median_ms": worst}


def _run(rundir: Path, cfg: dict[str, Any], variant: str, gpus: int, args: argparse.Namespace) -> dict[str, Any]:
    env = {**prepare_run(rundir, cfg, variant == "builtin"), **NO_MULTICAST_ENV, "STEP_TIMES_DIR": "step_times"}
    if rundir.name == "warmup":
        env["WAIT_FOR_KERNELS"] = "180"
    # torchrun also for one GPU at stages 1-3 (deepmd shards only in a process group)
    sharded = gpus > 1 or cfg["training"].get("zero_stage", 0) > 0
    launch = ["torchrun", "--standalone", f"--nproc_per_node={gpus}"] if sharded else [sys.executable]
    # No neighbour statistics: the shipped inputs set `sel` or need none, and they only add start-up seconds
    # (18 s of a 30 s DPA-4 start on the CPU), which no s/batch contains.
    cmd = [*launch, str(TIMED_DP), "--pt", "train", "input.json", "--skip-neighbor-stat"]
    rc, log, wall_s = run_logged(cmd, rundir, env, args.timeout)
    out: dict[str, Any] = {"command": shown_command(cmd), "returncode": rc, "wall_s": wall_s}
    out.update(parse_log(log))
    # A compile child ran in this run (Triton's cache lacked a variant, or the ledger did not list it).
    out["compile_child"] = COMPILING_MARK in log
    if out["ours_active"] != (variant == "ours"):
        out["problem"] = "the plugin's log line says the wrong optimizer ran"
    if rc != 0:
        errors = [ln.strip() for ln in log.splitlines() if re.search(r"\w(Error|Exception)\b", ln)]
        out["problem"] = f"exit {rc}: {errors[-1][:300] if errors else last_line(log)}"
        return out
    curve = parse_lcurve(rundir / "lcurve.out")
    cols = error_columns(curve)
    if curve and cols:
        out["final"] = {"force": curve[cols[0]][-1], "energy": curve[cols[1]][-1], "kind": cols[2]}
    if (rundir / "step_times").is_dir():
        out["optimizer_step"] = _step_ms(rundir / "step_times", args.skip)
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def _held(run: dict[str, Any]) -> float | None:
    """The slowest rank's ``held_s`` of one run (None without step times)."""
    ranks = (run.get("optimizer_step") or {}).get("per_rank", {}).values()
    values = [r["held_s"] for r in ranks if "held_s" in r]
    return max(values) if values else None


def stage_keys(stages: list[int]) -> list[str]:
    """One key per entry of ``--stages``: the stage, and ``#k`` for its k-th run (``[0, 2, 0]`` -> ``0, 2, 0#2``)."""
    keys = []
    for i, stage in enumerate(stages):
        k = stages[: i + 1].count(stage)
        keys.append(f"{stage}" if k == 1 else f"{stage}#{k}")
    return keys


def report(results: dict[str, Any]) -> str:
    """Markdown tables of one results dict (per config: s/batch, optimizer step, errors)."""
    lines = []
    for config, per in results["configs"].items():
        runs = per["runs"]
        lines += [
            f"\n### {config}: {results['gpus']} GPUs, {results['steps']} steps\n",
            "| stage | s/batch ours | AdamW | built-in | ours / AdamW | step ms ours | AdamW | built-in "
            "| host held s ours / AdamW | final force error ours / AdamW / built-in |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
        ]
        for stage in stage_keys(results["stages"]):
            r = {v: runs.get(f"stage{stage}-{v}", {}) for v in VARIANTS}
            sb = {v: r[v].get("average_s_per_batch") if "problem" not in r[v] else None for v in VARIANTS}
            ms = {v: (r[v].get("optimizer_step") or {}).get("slowest_rank_median_ms") for v in VARIANTS}
            held = " / ".join(_fmt(_held(r[v]), ".2f") or "-" for v in ("ours", "adamw"))
            err = " / ".join(_fmt((r[v].get("final") or {}).get("force"), ".4g") or "-" for v in VARIANTS)
            ratio = sb["ours"] / sb["adamw"] if sb["ours"] and sb["adamw"] else None
            cells = [_fmt(sb[v], ".4f") or ("failed" if "problem" in r[v] else "") for v in VARIANTS]
            cells += [_fmt(ratio, ".2f")] + [_fmt(ms[v], ".2f") for v in VARIANTS] + [held, err]
            lines.append(f"| {stage} | " + " | ".join(cells) + " |")
        problems = [f"- {label}: {r['problem']}" for label, r in runs.items() if "problem" in r]
        if problems:
            lines += ["", *problems]
        lines += ["", "run order: " + ", ".join(per["order"])]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("configs", nargs="+", help="deepmd inputs, or names in --config-dir")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--disp-freq", type=int, default=None, help="default: steps // 4")
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--builtin-stages", default=None, help="stages of the built-in (default: --stages)")
    ap.add_argument("--skip", type=int, default=10, help="optimizer steps left out of the step time (warm-up)")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per run")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "multi_gpu")
    ap.add_argument("--json", type=Path)
    ap.add_argument(
        "--no-ema",
        action="store_true",
        help="training.enable_ema false in every run (deepmd refuses EMA at zero_stage 2 and 3; DPA-4's input has it)",
    )
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    stages = [int(s) for s in args.stages.split(",")]
    builtin_stages = [int(s) for s in (args.builtin_stages or args.stages).split(",") if s]
    disp = args.disp_freq or max(1, args.steps // 4)
    results: dict[str, Any] = {
        "date_utc": utc_now(seconds=False),
        "command": command_line(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": args.gpus,
        "steps": args.steps,
        "disp_freq": disp,
        "stages": stages,
        "enable_ema_off": args.no_ema,
        "configs": {},
    }
    flip = False
    for spec in args.configs:
        path = resolve_config(spec, args.config_dir)
        base = json.loads(path.read_text())
        per: dict[str, Any] = {"config": shown(path), "runs": {}, "order": []}
        results["configs"][path.stem] = per
        stat = args.workdir / f"{path.stem}.stat.hdf5"
        # A 1-step run first computes the data statistics file that every timed run then loads
        # (a run that computes it ends on slightly different parameters) and waits for the
        # Triton kernels, which the timed runs then find in Triton's cache.
        plan = [("warmup", 1, 0, "ours")]
        for stage, key in zip(stages, stage_keys(stages), strict=True):
            for variant in reversed(variants) if flip else variants:
                if variant == "builtin" and stage not in builtin_stages:
                    continue
                plan.append((f"stage{key}-{variant}", args.gpus, stage, variant))
            flip = not flip
        for label, gpus, stage, variant in plan:
            steps = 1 if label == "warmup" else args.steps
            cfg = timing_input(base, path, variant, steps=steps, disp_freq=disp, stat_file=stat, opt_kw={})
            cfg["training"]["zero_stage"] = stage
            if args.no_ema:
                cfg["training"]["enable_ema"] = False
            print(f"[{path.stem} {label}] {utc_now()}", flush=True)
            per["order"].append(label)
            run = per["runs"][label] = _run(args.workdir / path.stem / label, cfg, variant, gpus, args)
            print(f"[{path.stem} {label}] {json.dumps(run)}", flush=True)
            if args.json:
                write_json(args.json, results)
    text = report(results)
    print(text)
    if args.json:
        results["report"] = text
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
