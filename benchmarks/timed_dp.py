#!/usr/bin/env python
"""deepmd's ``dp`` command with every optimizer step timed (run by multi_gpu.py and guard.py).

torch calls its global optimizer step hooks around the ``step()`` of every
``torch.optim.Optimizer``: ours, deepmd's built-in HybridMuon, AdamW, and torch's
ZeroRedundancyOptimizer around the local optimizer (zero_stage 1). For each step this
records a CUDA event on the current stream before and after it (the GPU time of the step,
collectives included, and any gap while the GPU waits for the host to enqueue its work)
and the host's ``perf_counter`` before and after it (the time the training loop is held by
``step()``: one-time work such as loading kernels or building the engine shows here). At
the end this rank writes ``{optimizer class: {"gpu_ms": [...], "host_ms": [...],
"between_gpu_ms": [...], "between_host_ms": [...]}}`` to ``$STEP_TIMES_DIR/rank<RANK>.json``;
the ``between`` lists time the rest of each training step (from the end of one ``step()`` to
the start of the next: forward, backward, data, logging), on the GPU and on the host.

With ``RECORD_MEMORY=1`` on CUDA the JSON also holds, under ``"_max_memory_allocated_mib"``, the
peak of ``torch.cuda.max_memory_allocated()`` over the process (a training run's peak).

With ``WAIT_FOR_KERNELS=<seconds>``, after the first step of deepmd-hybridmuon's optimizer
the run waits (at most that long) for the Triton kernels to compile, so that they land in
Triton's cache for the timed runs after it (a run that ends first stops their compilation).

Usage (what multi_gpu.py runs)::

    STEP_TIMES_DIR=times torchrun --standalone --nproc_per_node=2 benchmarks/timed_dp.py --pt train input.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


class _Steps:
    """The timed steps of one optimizer."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.host_ms: list[float] = []
        self.open: tuple[torch.cuda.Event | None, float] | None = None
        self.closed: tuple[torch.cuda.Event | None, float] | None = None  # the end of the last step
        self.between: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.between_host_ms: list[float] = []


def main() -> int:
    out_dir = os.environ.get("STEP_TIMES_DIR")
    waiting = [float(os.environ["WAIT_FOR_KERNELS"])] if os.environ.get("WAIT_FOR_KERNELS") else []
    steps: dict[int, _Steps] = {}
    cuda = torch.cuda.is_available()

    def ours(opt: torch.optim.Optimizer) -> bool:
        return type(opt).__module__.startswith("deepmd_hybridmuon")

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        if start is not None:
            start.record()
        entry = steps.setdefault(id(opt), _Steps(type(opt).__name__))
        now = time.perf_counter()
        if entry.closed is not None:
            end, t_end = entry.closed
            entry.between_host_ms.append((now - t_end) * 1e3)
            if end is not None and start is not None:
                entry.between.append((end, start))
        entry.open = (start, now)

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        entry = steps.get(id(opt))
        if entry is not None and entry.open is not None:
            start, t0 = entry.open
            now = time.perf_counter()
            entry.host_ms.append((now - t0) * 1e3)
            end = None
            if start is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                entry.events.append((start, end))
            entry.open, entry.closed = None, (end, now)
        if waiting and ours(opt):
            from deepmd_hybridmuon import kernels

            print(f"timed_dp: Triton kernels ready: {kernels.wait_ready(waiting.pop())}", flush=True)

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    from deepmd.main import main as dp_main

    try:
        dp_main()
    finally:
        if out_dir and steps:
            if cuda:
                torch.cuda.synchronize()
            times: dict[str, Any] = {}
            for entry in steps.values():
                key = entry.name if entry.name not in times else f"{entry.name}#{len(times)}"
                gpu = [start.elapsed_time(end) for start, end in entry.events]
                between = [end.elapsed_time(start) for end, start in entry.between]
                times[key] = {
                    "gpu_ms": gpu,
                    "host_ms": entry.host_ms,
                    "between_gpu_ms": between,
                    "between_host_ms": entry.between_host_ms,
                }
            if cuda and os.environ.get("RECORD_MEMORY") == "1":
                times["_max_memory_allocated_mib"] = torch.cuda.max_memory_allocated() / 2**20
            path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
