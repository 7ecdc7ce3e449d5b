#!/usr/bin/env python
"""Time the phased Newton–Schulz kernel alone, with and without its grid barriers (CUDA).

Builds the two phased groups of se_e2_a water (4 x 240 x 240, standard iteration; 2 x 240 x 1600,
Gram iteration; float64 parameters, as in DeePMD), launches ``kernels.phased._phased_kernel`` the way
the engine does (all phases but the last in one launch, then the last) inside a CUDA graph, and
prints the median time per launch:

* with the grid barriers (the engine's launch), once cooperative and once as a plain launch;
* without them (``SYNC`` off: the programs race through the phases, so the result is wrong,
  but the difference is the cost of the barriers);
* the last phase alone (the final product, scaled, written in the parameter's layout).

With ``--sweep``, for each group shape (count x m x n, both iterations) it also prints the
engine's whole phased orthogonalisation (both launches) against the torch path the engine uses
without the kernel (``functional.newton_schulz`` / ``gram_newton_schulz`` on the stack, cuBLAS),
each alone in a CUDA graph: the evidence for :data:`deepmd_hybridmuon.kernels.MAX_PHASED_ROWS`.

Usage::

    python benchmarks/phased_time.py
    python benchmarks/phased_time.py --sweep 4x240x240,4x384x384,4x512x512,2x512x2048
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from deepmd_hybridmuon import functional as F
from deepmd_hybridmuon import kernels as K

GROUPS = [("standard 4 x 240 x 240", False, 4, 240, 240), ("Gram 2 x 240 x 1600", True, 2, 240, 1600)]
REPEATS = 30  # launches per graph replay
REPLAYS = 7  # replays timed; the median is printed


def build(device: torch.device, use_gram: bool, count: int, m: int, n: int) -> dict:
    """Inputs and workspaces of one phased group, as ``engine.layout.Layout._build_phased`` makes them."""
    src = torch.randn(count * m * n, dtype=torch.float64, device=device)
    meta = [(i * m * n, m, n, n, 1, i) for i in range(count)]
    size = K.phased_workspace(meta, use_gram)
    tiles = count * K.phased_tiles(m, n)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    work_dtype = K.work_dtype(use_gram)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    args = (
        src, torch.zeros_like(src), torch.zeros(size, dtype=work_dtype, device=device),
        torch.tensor(meta, dtype=torch.int64, device=device), count,
        torch.zeros(tiles, 2, dtype=torch.float64, device=device), K.coefficient_table(use_gram, device),
        torch.ones(count, dtype=torch.float32, device=device), counter, F.NS_EPS,
    )  # fmt: skip
    # two groups run at once in the engine: each gets half of the SMs
    return {"args": args, "shape": (K.padded(m), K.padded(n)), "programs": min(tiles, sms // 2), "counter": counter}


def time_launch(group: dict, use_gram: bool, first: int, stop: int, sync: bool, cooperative: bool = True) -> float:
    """Median microseconds of one launch of phases ``first:stop``, replayed in a CUDA graph."""
    declared = K.phased.phased_launch(group["args"][0].dtype, use_gram, group["shape"], first, stop, sync)
    options = {**declared.kwargs, **({} if cooperative else {"launch_cooperative_grid": False})}
    kernel = declared.kernel[(group["programs"],)]

    def launch() -> None:
        if sync:
            group["counter"].zero_()
        kernel(*group["args"], **options)

    return time_graph(launch)


def time_graph(launch: Callable[[], object]) -> float:
    """Median microseconds of ``launch()``, captured :data:`REPEATS` times in a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):  # compile, then settle
            launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(REPEATS):
            launch()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPEATS)
    return sorted(times)[len(times) // 2]


def sweep(device: torch.device, shapes: list[tuple[int, int, int]]) -> None:
    """The whole phased orthogonalisation against the torch path, per group shape and iteration."""
    print("\n| group | iteration | phased kernel (us) | torch path, cuBLAS (us) | phased / torch |")
    print("|---|---|---:|---:|---:|")
    for count, m, n in shapes:
        for use_gram in (False, True):
            group = build(device, use_gram, count, m, n)
            phases = K.phase_count(use_gram)
            phased = time_launch(group, use_gram, 0, phases - 1, True) + time_launch(
                group, use_gram, phases - 1, phases, False
            )
            # the engine's torch buckets keep their stack in the iteration's input dtype
            stack = torch.randn(count, m, n, dtype=torch.float32 if use_gram else torch.bfloat16, device=device)
            reference = F.gram_newton_schulz if use_gram else F.newton_schulz
            torch_us = time_graph(lambda stack=stack, reference=reference: reference(stack))
            name = "Gram" if use_gram else "standard"
            print(f"| {count} x {m} x {n} | {name} | {phased:.1f} | {torch_us:.1f} | {phased / torch_us:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sweep", help="comma list of group shapes COUNTxMxN to compare with the torch path")
    args = ap.parse_args()
    device = torch.device("cuda")
    print(f"# phased kernel, {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n")
    print(
        "| group | phases | programs | launch | all but the last (us) | per phase | without barriers "
        "| per barrier | last phase |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for name, use_gram, count, m, n in GROUPS:
        group = build(device, use_gram, count, m, n)
        phases = K.phase_count(use_gram)
        free = time_launch(group, use_gram, 0, phases - 1, False)
        last = time_launch(group, use_gram, phases - 1, phases, False)
        for cooperative in (True, False):
            full = time_launch(group, use_gram, 0, phases - 1, True, cooperative)
            print(
                f"| {name} | {phases} | {group['programs']} | {'cooperative' if cooperative else 'plain'} "
                f"| {full:.1f} | {full / (phases - 1):.2f} | {free:.1f} | {(full - free) / (phases - 2):.2f} "
                f"| {last:.1f} |"
            )
    if args.sweep:
        sweep(device, [tuple(int(v) for v in shape.split("x")) for shape in args.sweep.split(",")])


if __name__ == "__main__":
    main()
