#!/usr/bin/env python
"""deepmd's ``dp`` command with every optimizer step timed by CUDA events (run by multi_gpu.py).

torch calls its global optimizer step hooks around the ``step()`` of every
``torch.optim.Optimizer``: ours, deepmd's built-in HybridMuon, AdamW, and torch's
ZeroRedundancyOptimizer around the local optimizer (zero_stage 1). A CUDA event is recorded
on the current stream before and after each step, so the time between them is what the GPU
spends on the step, collectives included (and any gap while it waits for the host to
enqueue the step's work). At the end this rank writes ``{optimizer class: [ms per step]}``
to ``$STEP_TIMES_DIR/rank<RANK>.json``.

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
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook


def main() -> int:
    out_dir = os.environ.get("STEP_TIMES_DIR")
    waiting = [float(os.environ["WAIT_FOR_KERNELS"])] if os.environ.get("WAIT_FOR_KERNELS") else []
    opened: dict[int, torch.cuda.Event] = {}
    pairs: dict[int, tuple[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]]] = {}

    def before(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if torch.cuda.is_available():
            opened[id(opt)] = torch.cuda.Event(enable_timing=True)
            opened[id(opt)].record()

    def after(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        start = opened.pop(id(opt), None)
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            pairs.setdefault(id(opt), (type(opt).__name__, []))[1].append((start, end))
        if waiting and type(opt).__module__.startswith("deepmd_hybridmuon"):
            from deepmd_hybridmuon import kernels

            print(f"timed_dp: Triton kernels ready: {kernels.wait_ready(waiting.pop())}", flush=True)

    register_optimizer_step_pre_hook(before)
    register_optimizer_step_post_hook(after)
    from deepmd.main import main as dp_main

    try:
        dp_main()
    finally:
        if out_dir and pairs:
            torch.cuda.synchronize()
            times: dict[str, list[float]] = {}
            for name, steps in pairs.values():
                key = name if name not in times else f"{name}#{len(times)}"
                times[key] = [start.elapsed_time(end) for start, end in steps]
            path = Path(out_dir) / f"rank{os.environ.get('RANK', '0')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
