#!/usr/bin/env python
"""How evenly ZeRO-1 (deepmd's ``zero_stage`` 1) spreads HybridMuon's Newton–Schulz work over the ranks.

deepmd wraps the optimizer in torch's ``ZeroRedundancyOptimizer``, which gives each rank whole
parameters, balanced by element count (largest first, onto the rank with the fewest elements
so far). HybridMuon's cost is not the element count: Newton–Schulz costs about
``rows * cols * min(rows, cols)`` per matrix (``distributed.ns_cost``), and Adam-routed
parameters cost almost nothing. This script runs torch's own partition rule on the parameters
of real models (built from the inputs in examples/water, no data needed) and reports, per world size, the
largest rank's share of the elements and of the Newton–Schulz cost, against a perfect split.

Runs on the CPU in seconds::

    python benchmarks/zero1_balance.py dpa2_small_water dpa3_water dpa4_water --world 2,4,8
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_model, resolve_config

from deepmd_hybridmuon.distributed import ns_cost
from deepmd_hybridmuon.functional import route_parameter


def zero_partition(params: list[torch.Tensor], world: int) -> list[list[torch.Tensor]]:
    """The parameters each rank of ``ZeroRedundancyOptimizer`` owns: torch's own rule, run on a stand-in.

    ``_partition_parameters`` reads only ``world_size``, ``param_groups`` and its cache from
    the optimizer, so it runs without a process group.
    """
    standin = types.SimpleNamespace(world_size=world, param_groups=[{"params": params}], _partition_parameters_cache=[])
    for method in ("_get_min_index", "_partition_param_group"):
        setattr(standin, method, types.MethodType(getattr(ZeroRedundancyOptimizer, method), standin))
    per_rank = ZeroRedundancyOptimizer._partition_parameters(standin)
    return [[p for group in groups for p in group["params"]] for groups in per_rank]


def balance(named: list[tuple[str, torch.Tensor]], world: int, muon_mode: str = "slice") -> dict[str, float]:
    """Max-over-mean of the elements and of the Newton–Schulz cost per rank under ZeRO-1's partition."""
    cost = {}
    for name, p in named:
        route = route_parameter(name, tuple(p.shape), muon_mode)
        cost[id(p)] = route.view[0] * ns_cost(route.view[1], route.view[2]) if route.view else 0
    ranks = zero_partition([p for _, p in named], world)
    elements = [sum(p.numel() for p in r) for r in ranks]
    work = [sum(cost[id(p)] for p in r) for r in ranks]
    total_work = sum(work)
    return {
        "elements_max_over_mean": max(elements) / (sum(elements) / world),
        "ns_max_over_mean": max(work) / (total_work / world) if total_work else 1.0,
        "ns_largest_matrix_share": max(cost.values()) / total_work if total_work else 0.0,
        "ns_per_rank_share": [w / total_work for w in work] if total_work else [],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="+", help="deepmd inputs, or names in --config-dir")
    ap.add_argument("--world", default="2,4,8", help="comma list of world sizes")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    args = ap.parse_args()
    worlds = [int(w) for w in args.world.split(",")]
    print("| model | ranks | elements: max / mean | Newton-Schulz: max / mean | NS share per rank | best possible |")
    print("|---|---:|---:|---:|---|---:|")
    for spec in args.configs:
        path = resolve_config(spec, args.config_dir)
        named = list(build_model(path).named_parameters())
        for world in worlds:
            b = balance(named, world)
            # no split can do better than the largest single matrix on one rank
            best = max(1.0, b["ns_largest_matrix_share"] * world)
            shares = " / ".join(f"{s:.2f}" for s in b["ns_per_rank_share"])
            print(
                f"| {path.stem} | {world} | {b['elements_max_over_mean']:.2f} | {b['ns_max_over_mean']:.2f} "
                f"| {shares} | {best:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
