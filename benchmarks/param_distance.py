#!/usr/bin/env python
"""Parameter by parameter, how far two ``dp --pt train`` runs of one input ended apart.

Two runs that should be identical (the same input and seed) still differ by the rounding of parallel sums (another
GPU, another number of CPU threads). This reports, for every floating-point tensor of the two final checkpoints,
the relative distance ``|a - b| / |b|``, its norm, and its norm at initialisation (the model built from the input
with its seed: whether the tensor started at zero), worst first.

Usage (two CPU runs of DPA-4 water that differ only in the number of threads, then their distances)::

    OMP_NUM_THREADS=1 python benchmarks/train_speed.py dpa4_water --steps 40 --variants ours --workdir runs/t1
    OMP_NUM_THREADS=2 python benchmarks/train_speed.py dpa4_water --steps 40 --variants ours --workdir runs/t2
    python benchmarks/param_distance.py runs/t1/ours runs/t2/ours --steps 40 --config dpa4_water --json out.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_named_params, resolve_config, write_json


def final_params(rundir: Path, steps: int) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a run's checkpoint at ``steps`` (under the input's save_dir, if it has one)."""
    path = next(iter(sorted(rundir.rglob(f"model.ckpt-{steps}.pt"))))
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    return {k: v.double() for k, v in ckpt["model"].items() if isinstance(v, torch.Tensor) and v.is_floating_point()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a", type=Path)
    ap.add_argument("run_b", type=Path)
    ap.add_argument("--steps", type=int, required=True, help="the checkpoint's step (the runs' numb_steps)")
    ap.add_argument("--config", required=True, help="the runs' input, or its name in examples/water")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    a, b = final_params(args.run_a, args.steps), final_params(args.run_b, args.steps)
    named, _ = build_named_params(resolve_config(args.config, DEFAULT_CONFIG_DIR), torch.device("cpu"))
    start = {name: p.double().norm().item() for name, p in named}
    rows = [
        {
            "name": k,
            "shape": list(v.shape),
            "distance": ((v - b[k]).norm() / max(b[k].norm().item(), 1e-30)).item(),
            "norm": b[k].norm().item(),
            "initial_norm": next((n for name, n in start.items() if name.endswith(k.split(".", 1)[-1])), None),
        }
        for k, v in a.items()
        if k in b and v.numel()
    ]
    rows.sort(key=lambda r: -r["distance"])
    median = statistics.median(r["distance"] for r in rows)
    print(f"{len(rows)} tensors; worst {rows[0]['distance']:.3g}, median {median:.3g}")
    for r in rows[:12]:
        print(f"{r['distance']:.3e}  {r['name']}  {tuple(r['shape'])}  |θ| {r['norm']:.3g}  |θ0| {r['initial_norm']}")
    if args.json:
        write_json(args.json, {"command": " ".join(sys.argv), "median": median, "parameters": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
