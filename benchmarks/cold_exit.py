#!/usr/bin/env python
"""Short `dp --pt train` runs, each with an empty Triton cache: do they all exit 0?

A run shorter than the background compilation of the Triton kernels (about 20 s on a cold
cache) ends while the compilation is still in flight. Each run gets its own empty
``TRITON_CACHE_DIR``; the report gives the exit status, whether the kernels were ready
before the end (the log line "Triton kernels ready"), and whether a compile process
outlived the run.

Usage::

    python benchmarks/cold_exit.py dpa2_small_water --runs 5 --steps 60 --gpus 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    COMPILING_MARK,
    DEFAULT_CONFIG_DIR,
    KERNELS_FROM_STEP_RE,
    NO_MULTICAST_ENV,
    command_line,
    find_dp,
    parse_log,
    prepare_run,
    resolve_config,
    shown_command,
    timing_input,
    torchrun_dp,
    utc_now,
)


def _compile_processes() -> list[str]:
    out = subprocess.run(["pgrep", "-af", "compile_worker"], capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", help="a deepmd input, or a name in --config-dir (e.g. dpa2_small_water)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--gpus", type=int, default=1, help="torchrun --nproc_per_node (1: torchrun with one rank)")
    ap.add_argument("--zero-stage", type=int, default=0)
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()

    config_path = resolve_config(args.config, args.config_dir)
    config = json.loads(config_path.read_text())
    config.setdefault("training", {})["zero_stage"] = args.zero_stage
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="cold_exit_"))).resolve()
    cmd = [*torchrun_dp(args.gpus, find_dp()), "--pt", "train", "input.json"]
    date = utc_now(seconds=False)
    title = f"{config_path.name}, {args.steps} steps, {args.gpus} rank(s), zero_stage {args.zero_stage}"
    print(f"# cold-cache exits: {title}")
    print(f"- date: {date}\n- command: `{command_line()}`\n- each run: `{shown_command(cmd)}`\n")
    print("| run | exit | wall (s) | kernels ready before the end | compile processes left |")
    print("|---:|---:|---:|---|---:|")
    failures = 0
    for i in range(args.runs):
        rundir = workdir / f"run{i}"
        cfg = timing_input(
            config, config_path, "ours", steps=args.steps, disp_freq=20, stat_file=workdir / "stat.hdf5", opt_kw={}
        )
        env = prepare_run(rundir, cfg, builtin=False)
        env["TRITON_CACHE_DIR"] = str(rundir / "triton_cache")  # empty: every kernel compiles
        env.update(NO_MULTICAST_ENV)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=rundir, env=env, capture_output=True, text=True, timeout=900, check=False)
        wall = time.perf_counter() - t0
        log = proc.stdout + proc.stderr
        (rundir / "train.log").write_text(log)
        time.sleep(1.0)
        left = len(_compile_processes())
        ready = KERNELS_FROM_STEP_RE.search(log) is not None
        started = COMPILING_MARK in log
        failures += proc.returncode != 0 or left > 0 or not started or not parse_log(log)["ours_active"]
        note = "yes" if ready else ("no (compiling at exit)" if started else "no compilation started?")
        print(f"| {i} | {proc.returncode} | {wall:.1f} | {note} | {left} |", flush=True)
        if proc.returncode != 0:
            print("\n".join("    " + line for line in log.strip().splitlines()[-8:]))
    print(f"\n{args.runs - failures} of {args.runs} runs clean")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
