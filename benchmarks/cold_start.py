#!/usr/bin/env python
"""Start-up with an empty and with a filled Triton cache: does any optimizer step hold the training loop?

For each config, two ``dp --pt train`` runs of HybridMuon on one GPU through ``timed_dp.py``
(every optimizer step timed on the host): first with an empty ``TRITON_CACHE_DIR`` (cold: every
kernel compiles), then with the same folder again (warm). Each run reports its first step, its
slowest later step, the step from which the Triton kernels ran (the optimizer's log line),
deepmd's s/batch, and what the training process itself compiled: Triton kernels that missed
the disk cache and host launchers built with the C compiler (``WATCH_COMPILES=1``).

Usage::

    python benchmarks/cold_start.py dpa3_water dpa4_water --steps 500 --pairs 2 --json out.json

With ``--pairs N`` each config runs N cold-then-warm rounds, each with a new empty cache, and
the script prints each round's cold/warm s/batch ratio (deepmd's s/batch varies by 10-20 %
between runs of one machine, so one pair does not settle a few per cent).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DEFAULT_CONFIG_DIR,
    KERNELS_FROM_STEP_RE,
    TIMED_DP,
    command_line,
    parse_kw,
    parse_log,
    prepare_run,
    resolve_config,
    timing_input,
    utc_now,
    write_json,
)


def one_run(cfg: dict[str, Any], rundir: Path, cache: Path, timeout: float, profile: str) -> dict[str, Any]:
    """One timed ``dp --pt train`` run of ``cfg`` in ``rundir`` with Triton's cache at ``cache``."""
    env = prepare_run(rundir, cfg, builtin=False)
    env.update(TRITON_CACHE_DIR=str(cache), STEP_TIMES_DIR=str(rundir / "times"), WATCH_COMPILES="1")
    if profile:  # those steps then run under cProfile, which slows them
        env["PROFILE_STEPS"] = profile
    cmd = [sys.executable, str(TIMED_DP), "--pt", "train", "input.json"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=rundir, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    log = proc.stdout + proc.stderr
    (rundir / "train.log").write_text(log)
    times_path = rundir / "times" / "rank0.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    ours = times.get("HybridMuonOptimizer", {})
    host = ours.get("host_ms", [])
    compiles = times.get("_compiles", [])
    later = host[1:]
    slowest = max(range(len(later)), key=later.__getitem__) + 1 if later else None
    switch = KERNELS_FROM_STEP_RE.search(log)
    k = int(switch.group(1)) if switch else len(host)

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    gpu, between = ours.get("gpu_ms", []), ours.get("between_host_ms", [])
    missed = [c for c in compiles if c["what"] == "kernel" and not c["cache_hit"]]
    launchers = [c for c in compiles if c["what"] == "launcher"]
    return {
        "exit": proc.returncode,
        "wall_s": round(wall, 1),
        "first_step_ms": host[0] if host else None,
        "slowest_later_step_ms": host[slowest] if slowest is not None else None,
        "slowest_later_step": slowest,
        "steps_over_100ms_after_first": sum(t > 100 for t in later),
        "kernels_from_step": int(switch.group(1)) if switch else None,
        "s_per_batch": parse_log(log)["average_s_per_batch"],
        "compiled_in_training_process": [(c["kernel"], c["after_steps"], c["attrs"]) for c in missed],
        # what fixed each compiled or loaded binary, to compare a miss with the variant the compile process made
        "kernel_events": [
            {k: c.get(k) for k in ("kernel", "cache_hit", "after_steps", "signature", "attrs", "constants", "options")}
            for c in compiles
            if c["what"] == "kernel"
        ],
        "launchers_built_in_training_process": [(c["after_steps"], round(c["seconds"], 2)) for c in launchers],
        "kernel_loads": sum(c["what"] == "kernel" and c["cache_hit"] for c in compiles),
        "launcher_names": [c["name"] for c in launchers],
        # the optimizer step on the GPU and the rest of the training step, before and after the switch
        "step_gpu_ms_median_before_after": [median(gpu[1:k]), median(gpu[k + 3 :])],
        "between_host_ms_median_before_after": [median(between[1:k]), median(between[k + 3 :])],
        "step_profiles": times.get("_step_profiles"),
        "log_lines": [line for line in log.splitlines() if "Triton" in line][:6],
        "host_ms": host,
        "tail": log.strip().splitlines()[-5:] if proc.returncode else [],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="deepmd inputs, or names in --config-dir (e.g. dpa3_water)")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warm-runs", type=int, default=1, help="warm runs after the cold one")
    ap.add_argument(
        "--pairs", type=int, default=1, help="cold-then-warm rounds per config, each with a new empty cache"
    )
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--opt-kw", nargs="*", default=[], help="HybridMuon options key=value")
    ap.add_argument(
        "--model-kw", nargs="*", default=[], help="descriptor options key=value (e.g. a DPA-4 at schema defaults)"
    )
    ap.add_argument("--label", default=None, help="row label (default: the config's name)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", default="", help="steps to run under cProfile, e.g. 0,1 (slows them)")
    args = ap.parse_args()

    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="cold_start_"))).resolve()
    result: dict[str, Any] = {"date": utc_now(), "command": command_line(), "steps": args.steps, "runs": []}
    opt_kw, model_kw = parse_kw(args.opt_kw), parse_kw(args.model_kw, "--model-kw")
    try:
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    except ImportError:
        pass
    print(
        "| config | cache | first step (ms) | slowest later step (ms, step) | steps > 100 ms | kernels from step "
        "| s/batch | compiled here | launchers built here |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec in args.configs:
        path = resolve_config(spec, args.config_dir)
        config = json.loads(path.read_text())
        config["model"].setdefault("descriptor", {}).update(model_kw)
        label = args.label or path.stem
        for pair, i in itertools.product(range(args.pairs), range(1 + args.warm_runs)):
            cache = workdir / f"{label}_triton_cache{pair}"
            kind = "cold" if i == 0 else "warm"
            cfg = timing_input(
                config,
                path,
                "ours",
                steps=args.steps,
                disp_freq=100,
                stat_file=workdir / f"{label}.hdf5",
                opt_kw=opt_kw,
            )
            run = one_run(cfg, workdir / f"{label}_{pair}_{kind}{i}", cache, args.timeout, args.profile)
            run.update(config=label, cache=kind, pair=pair)
            result["runs"].append(run)
            first = run["first_step_ms"]
            slow = run["slowest_later_step_ms"]
            print(
                f"| {label} | {kind} | {first if first is None else round(first)} | "
                f"{slow if slow is None else round(slow)} ({run['slowest_later_step']}) | "
                f"{run['steps_over_100ms_after_first']} | {run['kernels_from_step']} | {run['s_per_batch']} | "
                f"{len(run['compiled_in_training_process'])} | {len(run['launchers_built_in_training_process'])} |",
                flush=True,
            )
            if run["exit"]:
                print("    exit", run["exit"], *run["tail"], sep="\n    ")
            if args.json:
                write_json(args.json, result)
    for label in dict.fromkeys(run["config"] for run in result["runs"]):
        ratios = cold_warm_ratios([run for run in result["runs"] if run["config"] == label])
        if ratios:
            print(f"{label}: cold/warm s/batch per pair {ratios}, median {statistics.median(ratios):.3f}")
    return 0


def cold_warm_ratios(runs: list[dict[str, Any]]) -> list[float]:
    """Each pair's cold s/batch over its first warm run's."""
    ratios = []
    for pair in sorted({run["pair"] for run in runs}):
        by_kind = {run["cache"]: run["s_per_batch"] for run in reversed(runs) if run["pair"] == pair}
        if by_kind.get("cold") and by_kind.get("warm"):
            ratios.append(round(by_kind["cold"] / by_kind["warm"], 3))
    return ratios


if __name__ == "__main__":
    sys.exit(main())
