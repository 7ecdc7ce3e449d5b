#!/usr/bin/env python
"""Where one optimizer step (ours) spends its time.

Per config: the kernels of one eager step (count and top GPU time), then, with the CUDA
graph on, the host time of ``step()`` (everything before the replay is host work the GPU
waits for) and the GPU time of one graph replay; with ``--timeline``, every kernel of one
replay with its start (µs after the first), duration and stream, to see the critical path.

Usage::

    python benchmarks/profile_step.py [--configs dpa3_water,se_e2_a_water] [--ours-kw magma_muon=False]
    python benchmarks/profile_step.py --configs se_e2_a_water --timeline
    OMP_NUM_THREADS=1 python benchmarks/profile_step.py --device cpu --configs se_e2_a_water,dpa3_water

On the CPU (``--device cpu``): the median time of a step and, from torch.profiler over 10 steps, its share in
the Newton–Schulz products (``bmm``/``baddbmm``), in the other operators, and in the Python between them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_named_params, parse_kw

from deepmd_hybridmuon import HybridMuonOptimizer, kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="dpa3_water,se_e2_a_water,dpa2_small_water")
    ap.add_argument("--ours-kw", action="append", default=[])
    ap.add_argument("--timeline", action="store_true", help="list the kernels of one graph replay")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    kw = parse_kw(args.ours_kw, "--ours-kw")
    if args.device == "cpu":
        for name in args.configs.split(","):
            print(cpu_split(name, kw))
        return
    device = torch.device("cuda")
    for name in args.configs.split(","):
        named, _ = build_named_params(DEFAULT_CONFIG_DIR / f"{name}.json", device)
        params = [p for _, p in named]
        opt = HybridMuonOptimizer(params, named_parameters=named, **kw)
        opt._implementation = "engine-eager"  # the kernels of an eager step (optimizer.IMPLEMENTATIONS)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        kernels.wait_ready(600)  # Triton compiles in the background; profile the steady state
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
        print(graph_split(named, kw, args.timeline))


def cpu_split(name: str, kw: dict, steps: int = 10) -> str:
    """One config's CPU step: median ms, and its time in Newton–Schulz's products, other operators and Python."""
    named, trainable = build_named_params(DEFAULT_CONFIG_DIR / f"{name}.json", torch.device("cpu"))
    named = [(n, p) for (n, p), t in zip(named, trainable, strict=True) if t]
    params = [p for _, p in named]
    opt = HybridMuonOptimizer(params, named_parameters=named, **kw)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen, dtype=p.dtype) * 1e-2 for p in params]

    def step(fresh: list[torch.Tensor]) -> float:
        for p, g in zip(params, fresh, strict=True):
            p.grad = g
        t0 = time.perf_counter()
        opt.step()
        return (time.perf_counter() - t0) * 1e3

    sets = [[g.clone() for g in grads] for _ in range(3 + 2 * steps)]  # made before: no copy in a profiled step
    for fresh in sets[:3]:
        step(fresh)
    median = statistics.median(step(fresh) for fresh in sets[3 : 3 + steps])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for fresh in sets[3 + steps :]:
            step(fresh)
    parts = {"Newton-Schulz products": 0.0, "other operators": 0.0, "Python between them": 0.0}
    for e in prof.key_averages():
        if e.key.startswith("Optimizer.step"):
            parts["Python between them"] += e.self_cpu_time_total
        elif e.key in ("aten::bmm", "aten::baddbmm"):
            parts["Newton-Schulz products"] += e.self_cpu_time_total
        elif e.key.startswith("aten::"):
            parts["other operators"] += e.self_cpu_time_total
    total = sum(parts.values())
    shares = ", ".join(f"{k} {v / total:.0%} ({v / steps / 1e3:.1f} ms)" for k, v in parts.items())
    threads = torch.get_num_threads()
    return f"## {name}, CPU, {threads} thread(s): step {median:.1f} ms (median of {steps}); profiled: {shares}"


def graph_split(named: list, kw: dict, timeline: bool = False) -> str:
    """Median host time of ``step()`` and GPU time of a graph replay, graph on (and its kernels)."""
    params = [p for _, p in named]
    opt = HybridMuonOptimizer(params, named_parameters=named, **kw)
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    opt.step()
    kernels.wait_ready(600)
    host, replay = [], []
    for i in range(40):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.step()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        engine = opt._runners.get(0)
        if i >= 10 and engine is not None and engine.executor.captured:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            engine.executor.capture.replay()
            end.record()
            end.synchronize()
            replay.append(start.elapsed_time(end))
    replay_ms = f"{statistics.median(replay):.3f}" if replay else "n/a (no graph)"
    line = f"graph on: host time of step() {statistics.median(host[10:]):.3f} ms, one replay {replay_ms} ms (GPU)"
    engine, group = opt._runners.get(0), opt.param_groups[0]
    if engine is None or not engine.executor.captured:
        return line + "\n"
    parts: dict[str, list[float]] = {"signature": [], "stage": [], "replay (host)": []}
    for _ in range(30):
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt._engine_signature(group)
        t1 = time.perf_counter()
        L = engine.layout
        engine.executor.stage(
            engine.batched.scalars(group, [True] * len(L.keys)), L.grad_views, [p.grad for p in L.staged], None
        )
        t2 = time.perf_counter()
        engine.executor.capture.replay()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[key].append(dt * 1e3)
    split = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in parts.items())
    return f"{line}\n  host parts (ms): {split}\n" + (replay_timeline(engine.executor.capture) if timeline else "")


def replay_timeline(capture: Any) -> str:
    """The kernels of one replay: start after the first kernel (µs), duration (µs), stream, name."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        capture.replay()
        torch.cuda.synchronize()
    rows = sorted(
        (e.start_ns(), e.duration_ns(), e.device_resource_id(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type().name == "CUDA"
    )
    if not rows:
        return "  (no kernels recorded)\n"
    t0 = rows[0][0]
    span = (max(s + d for s, d, _, _ in rows) - t0) / 1e3
    lines = [f"  replay: {len(rows)} kernels over {span:.1f} us", "  start_us   dur_us  stream  kernel"]
    lines += [f"  {(s - t0) / 1e3:8.1f} {d / 1e3:8.1f}  {st:>6}  {name[:90]}" for s, d, st, name in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
