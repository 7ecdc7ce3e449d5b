#!/usr/bin/env python
"""`dp --pt train` with HybridMuon on 1 GPU and on N GPUs for each training.zero_stage.

For each zero_stage (0: DDP, 1: ZeRO-1, 2: FSDP2) it runs ``torchrun --nproc_per_node=N
dp --pt train input.json`` on a short schedule of a shared config, plus one single-GPU run,
then compares the final parameters (model state of the last checkpoint): every stage against
stage 0 (same data order and gradients, so the stages should agree up to the rounding of the
sharded arithmetic) and against the 1-GPU run (different effective batch: a reference, not a
target). It reports deepmd's s/batch and the final validation RMSE of each run.

Usage::

    python benchmarks/multi_gpu.py dpa2_small_water --gpus 2 --steps 200 --stages 0,1,2
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DEFAULT_CONFIG_DIR,
    NO_MULTICAST_ENV,
    command_line,
    find_dp,
    parse_lcurve,
    parse_log,
    resolve_config,
    timing_input,
    torchrun_dp,
    utc_now,
    write_json,
)


def _run(workdir: Path, config: dict[str, Any], gpus: int) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "input.json").write_text(json.dumps(config, indent=1))
    dp = find_dp()
    cmd = [*(dp if gpus == 1 else torchrun_dp(gpus, dp)), "--pt", "train", "input.json"]
    env = {**os.environ, **NO_MULTICAST_ENV}
    proc = subprocess.run(cmd, cwd=workdir, capture_output=True, text=True, env=env, timeout=1200)
    log = proc.stdout + proc.stderr
    (workdir / "train.log").write_text(log)
    out = {"command": shlex.join(cmd), "returncode": proc.returncode, **parse_log(log)}
    if proc.returncode != 0:
        out["error"] = [line for line in log.splitlines() if line.strip()][-5:]
        return out
    curve = parse_lcurve(workdir / "lcurve.out") or {}
    out["final"] = {name: values[-1] for name, values in curve.items() if values}
    return out


def _params(workdir: Path, steps: int) -> dict[str, torch.Tensor]:
    ckpt = torch.load(workdir / f"model.ckpt-{steps}.pt", map_location="cpu", weights_only=False)
    state = ckpt["model"]
    return {k: v.double() for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--stages", default="0,1,2")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/multi_gpu"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    path = resolve_config(args.config, args.config_dir)
    base = json.loads(path.read_text())
    disp = max(1, args.steps // 4)
    results: dict[str, Any] = {
        "config": str(path),
        "date_utc": utc_now(seconds=False),
        "command": command_line(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "gpus": args.gpus,
        "runs": {},
    }
    stat = args.workdir / "stat.hdf5"
    runs = [("1gpu", 1, 0)] + [(f"{args.gpus}gpu-stage{s}", args.gpus, int(s)) for s in args.stages.split(",")]
    for label, gpus, stage in runs:
        cfg = timing_input(base, path, "ours", steps=args.steps, disp_freq=disp, stat_file=stat, opt_kw={})
        cfg["training"]["zero_stage"] = stage
        cfg["training"]["save_freq"] = args.steps
        print(f"[{label}] running", flush=True)
        results["runs"][label] = _run(args.workdir / label, cfg, gpus)
        print(f"[{label}] {json.dumps({k: v for k, v in results['runs'][label].items() if k != 'intervals'})}")
    ok = {k for k, r in results["runs"].items() if r["returncode"] == 0}
    comparisons = {}
    ref_label = f"{args.gpus}gpu-stage0"
    if ref_label in ok:
        ref = _params(args.workdir / ref_label, args.steps)
        for label in sorted(ok - {ref_label}):
            other = _params(args.workdir / label, args.steps)
            diffs = [
                float((v - ref[k]).norm() / max(float(ref[k].norm()), 1e-30))
                for k, v in other.items()
                if k in ref and v.numel()
            ]
            comparisons[f"{label} vs {ref_label}"] = {
                "worst_rel_param_diff": max(diffs),
                "median_rel_param_diff": float(np.median(diffs)),
            }
    results["comparisons"] = comparisons
    print("\n| run | s/batch (deepmd) | final rmse_f_val | final rmse_e_val | notes |\n|---|---:|---:|---:|---|")
    for label, r in results["runs"].items():
        fin = r.get("final", {})
        note = "ok" if r["returncode"] == 0 else "failed: " + " / ".join(r.get("error", []))[-300:]
        print(
            f"| {label} | {r.get('average_s_per_batch')} | {fin.get('rmse_f_val', float('nan')):.4g} | "
            f"{fin.get('rmse_e_val', float('nan')):.4g} | {note} |"
        )
    print("\n| comparison | worst ‖Δθ‖/‖θ‖ over tensors | median |\n|---|---:|---:|")
    for label, c in comparisons.items():
        print(f"| {label} | {c['worst_rel_param_diff']:.3g} | {c['median_rel_param_diff']:.3g} |")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
