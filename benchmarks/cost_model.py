#!/usr/bin/env python
"""A cost model of the sharded optimizer step at N GPUs: the plan's exact traffic, measured and assumed constants.

For each ``zero_stage`` it predicts the slowest rank's step as host time + collectives + arithmetic:

* **traffic**, exact, from the plan the optimizer builds (:func:`deepmd_hybridmuon.distributed.build_plan`, the
  same on every rank) for the real parameter shapes: under FSDP2 (stages 2 and 3) each rank's shards of the Muon
  updates travel to the matrices' owners and back (two all-to-alls of the local elements, 4 bytes each), plus the
  finite gate's and Magma's all-reduces; under ZeRO-1 each rank receives the other ranks' parameters in one
  bucketed broadcast per rank (4 bytes a parameter); DDP's optimizer step has no collective of its own;
* **collectives**: ``latency`` per launch plus bytes over ``bandwidth`` (ASSUMED below: NVLink within a node of 8,
  InfiniBand between nodes);
* **arithmetic**: the Newton–Schulz of the slowest owner, in the plan's cost units (``ns_cost``: m n min(m, n))
  at FLOPS_PER_UNIT floating-point operations each, on ASSUMED tensor-core throughput, but never below the
  single-GPU step (MEASURED), whose kernels are bound by launches, not arithmetic, at DeePMD sizes;
* **host**: the Python of the step, MEASURED on 2 GPUs (multi_gpu.py, DPA-3 water): it does not shrink with N,
  since every rank replays its graphs and launches the same four collectives (FSDP2) or walks
  ZeroRedundancyOptimizer's bookkeeping (ZeRO-1).

Usage::

    python benchmarks/cost_model.py --json benchmarks/results/cost_model_2026-11-27.json
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_named_params, command_line, utc_now, write_json

#: MEASURED: the host's mean time in step() per stage, ms, what the step costs the host whatever the traffic. Stage 1:
#: 2 x H200, DPA-3 water, commit 1108e38 (multi_gpu_dpa3_h200x2_2026-11-27.json); stages 2 and 3 (graphs replayed
#: between the collectives): 2 x H100, DPA-3 water, commit b28709d (multi_gpu_dpa3_stage2/stage3_h100x4_2026-11-27.json,
#: every rank of every run of ours); stage 0: the replayed CUDA graph, DPA-2 small on one H100
#: (multi_gpu_dpa2_small_h100x1_stage0_between_2026-11-25).
HOST_MS = {0: 0.7, 1: 5.7, 2: 1.6, 3: 1.5}
#: MEASURED, 1 x H100 (step_time_h100_2026-11-27_families_without_r*.json): ours' whole step on one GPU, ms.
ONE_GPU_STEP_MS = 1.0
#: ASSUMED: (latency s per collective, bandwidth B/s per GPU) within one node of 8 (NVLink) and across nodes (IB).
LINKS = {"node": (15e-6, 150e9), "cluster": (50e-6, 40e9)}
#: ASSUMED: floating-point operations of one ns_cost unit (ten quintic iterations, three products each, 2 FLOPs a
#: multiply-add, on a wide matrix: about 4 m^2 n per iteration) and sustained bf16 tensor-core FLOP/s of one GPU.
FLOPS_PER_UNIT, FLOPS = 40, 200e12
WIRE_BYTES = 4


def shapes_of(config: Path, width: float = 1.0) -> list[tuple[tuple[int, ...], Any]]:
    """(global shape, route) of each parameter of a config's model; ``width`` scales both sides of every matrix."""
    from deepmd_hybridmuon import functional as F

    named, _ = build_named_params(config, torch.device("cpu"))
    out = []
    for name, p in named:
        shape = tuple(p.shape)
        if width != 1.0 and len(shape) >= 2:
            shape = (*shape[:-2], *(max(1, round(d * width)) for d in shape[-2:]))
        out.append((shape, F.route_parameter(name, shape, "slice")))
    return out


def predict(params: list[tuple[tuple[int, ...], Any]], world: int, stage: int) -> dict[str, float]:
    """The slowest rank's traffic and predicted step of one stage at ``world`` GPUs."""
    from deepmd_hybridmuon.distributed import build_plan, chunk_rows

    total = sum(math.prod(s) for s, _ in params)
    latency, bandwidth = LINKS["node" if world <= 8 else "cluster"]
    plan = build_plan([(i, s, r) for i, (s, r) in enumerate(params)], world)
    units = max(plan.load) if stage >= 2 else sum(plan.load)  # the owners' share, or every matrix on every rank
    if stage == 1:
        units = sum(plan.load) / world  # ZeRO-1: each rank steps about 1/N of the parameters
    arithmetic = max(units * FLOPS_PER_UNIT / FLOPS, ONE_GPU_STEP_MS / 1e3 / (world if stage == 1 else 1))
    if stage >= 2:
        muon = [(s, r) for s, r in params if r.route == "muon"]
        # the largest local share of the Muon elements: rank 0's torch.chunk rows of every parameter
        local = sum(math.prod(s[1:]) * (hi - lo) for s, _ in muon for lo, hi in chunk_rows(s[0], world)[:1])
        traffic = 2 * local * WIRE_BYTES * (world - 1) / world
        matrices = sum(r.view[0] for _, r in muon)
        traffic += matrices * 3 * 8 + 4  # Magma's sums (float64) and the gate
        launches = 4
    elif stage == 1:
        traffic, launches = total * WIRE_BYTES * (world - 1) / world, world + 1
    else:
        traffic, launches = 0.0, 0
    comm = launches * latency + traffic / bandwidth
    return {
        "traffic_mb": traffic / 1e6,
        "launches": launches,
        "comm_ms": comm * 1e3,
        "arithmetic_ms": arithmetic * 1e3,
        "host_ms": HOST_MS[stage],
        "step_ms": HOST_MS[stage] + (comm + arithmetic) * 1e3,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    """The predictions as a markdown table (BENCHMARKS.md renders the same from the JSON)."""
    head = ["model", "parameters", "zero_stage", "GPUs", "traffic MB", "launches", "collectives ms"]
    head += ["arithmetic ms", "host ms", "step ms"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * 3 + "---:|" * 7]
    for r in rows:
        cells = [r["model"], f"{r['parameters'] / 1e6:.1f} M", str(r["stage"]), str(r["gpus"])]
        cells += [f"{r['traffic_mb']:.1f}", str(r["launches"]), f"{r['comm_ms']:.2f}", f"{r['arithmetic_ms']:.2f}"]
        cells += [f"{r['host_ms']:.1f}", f"{r['step_ms']:.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG_DIR / "dpa3_water.json")
    ap.add_argument("--worlds", default="2,4,8,64")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    base = shapes_of(args.config)
    params_now = sum(math.prod(s) for s, _ in base)
    # a model of about 100 M parameters: the same layers, every matrix side scaled alike
    width = math.sqrt(100e6 / params_now)
    models = {f"{args.config.stem}": base, f"{args.config.stem} x{width:.1f} wide": shapes_of(args.config, width)}
    rows = []
    for label, params in models.items():
        count = sum(math.prod(s) for s, _ in params)
        for stage in (0, 1, 2):
            for world in (int(w) for w in args.worlds.split(",")):
                rows.append({"model": label, "parameters": count, "stage": stage, "gpus": world,
                             **predict(params, world, stage)})  # fmt: skip
    print(markdown(rows))
    if args.json:
        assumptions = {"links": LINKS, "flops_per_unit": FLOPS_PER_UNIT, "flops": FLOPS, "wire_bytes": WIRE_BYTES}
        measured = {"host_ms": HOST_MS, "one_gpu_step_ms": ONE_GPU_STEP_MS}
        write_json(
            args.json,
            {
                "date_utc": utc_now(seconds=False),
                "command": command_line(argv),
                "assumed": assumptions,
                "measured": measured,
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
