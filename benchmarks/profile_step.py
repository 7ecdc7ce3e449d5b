#!/usr/bin/env python
"""Kernels of one eager optimizer step (ours, no CUDA graph): count and top GPU time.

Usage::

    python benchmarks/profile_step.py [--configs dpa3_water,se_e2_a_water] [--ours-kw magma_muon=False]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import DEFAULT_CONFIG_DIR, build_named_params
from train_speed import parse_kw

from deepmd_hybridmuon import HybridMuonOptimizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dpa3_water,se_e2_a_water,dpa2_small_water")
    ap.add_argument("--ours-kw", action="append", default=[])
    args = ap.parse_args()
    kw = {"cuda_graph": False, **parse_kw(args.ours_kw, "--ours-kw")}
    device = torch.device("cuda")
    for name in args.configs.split(","):
        named, _ = build_named_params(DEFAULT_CONFIG_DIR / f"{name}.json", device)
        params = [p for _, p in named]
        opt = HybridMuonOptimizer(params, named_parameters=named, **kw)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            opt.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            opt.step()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type.name == "CUDA"]
        total = sum(e.device_time for e in events)
        print(f"## {name} ({kw}): {len(events)} kernels, {total / 1000:.3f} ms of GPU time")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
