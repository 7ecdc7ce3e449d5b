#!/usr/bin/env python
"""The optimizer step when branches of a model take turns, as in deepmd's multi-task training.

A multi-task model trains one branch per step: the other branches' parameters have no gradient
(``zero_grad(set_to_none=True)``, then a backward pass through one branch). This builds the
parameters of a deepmd input (``common.build_named_params``), splits its fitting net's parameters
in two halves (two "branches"; the descriptor and everything else are shared) and times ours'
step (median ms, synchronised, fresh gradient tensors every step) three ways, in rounds:

* every parameter has a gradient every step (a single-task run);
* the two halves take turns every step (a multi-task run with two equally likely branches);
* the halves take turns every 4 steps.

Usage::

    python benchmarks/multitask_step.py                       # dpa3_water on the GPU (the CPU without one)
    python benchmarks/multitask_step.py se_e2_a_water --device cpu --rounds 1 --json "$TMPDIR/m.json"
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_named_params, command_line, resolve_config, utc_now, write_json

from deepmd_hybridmuon import HybridMuonOptimizer, kernels

#: Which half of the fitting net has no gradient at step ``i`` of each way (None: every parameter has one).
WAYS = {
    "single-task": lambda i: None,
    "turns every step": lambda i: i % 2,
    "turns every 4 steps": lambda i: (i // 4) % 2,
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config", nargs="?", default="dpa3_water")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=32, help="timed steps per way and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    named, trainable = build_named_params(resolve_config(args.config, DEFAULT_CONFIG_DIR), device)
    params = [(n, torch.nn.Parameter(t.clone())) for (n, t), r in zip(named, trainable, strict=True) if r]
    fitting = [i for i, (n, _) in enumerate(params) if "fitting" in n]
    halves = (set(fitting[: len(fitting) // 2]), set(fitting[len(fitting) // 2 :]))
    gen = torch.Generator(device=device).manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen, device=device, dtype=p.dtype) * 1e-2 for _, p in params]
    opt = HybridMuonOptimizer([p for _, p in params], named_parameters=params)

    def step(off: int | None) -> float:
        for i, (_, p) in enumerate(params):
            p.grad = None if off is not None and i in halves[off] else grads[i].clone()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    for i in range(4):  # both halves stepped once, the kernels ready, then warm
        step(i % 2)
    kernels.wait_ready()
    for i in range(6):
        step(i % 2)
    rows = []
    for r in range(1, args.rounds + 1):
        for way, off in WAYS.items():
            times = [step(off(i)) for i in range(args.steps)]
            rows.append({"round": r, "way": way, "median_ms": statistics.median(times), "times_ms": times})
            print(f"round {r}: {way}: median {rows[-1]['median_ms']:.2f} ms", flush=True)
    if args.json:
        machine = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        write_json(
            args.json,
            {
                "machine": machine,
                "date": utc_now(),
                "command": command_line(),
                "config": args.config,
                "parameters": len(params),
                "fitting_parameters": len(fitting),
                "execution": opt.execution_table(),
                "rows": rows,
            },
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
