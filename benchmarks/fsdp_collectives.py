#!/usr/bin/env python
"""Collectives and time of one HybridMuon step under FSDP2, on CPU gloo ranks.

Builds the model of a deepmd input (default: ``examples/water/dpa2_small_water.json``), shards
it with ``fully_shard`` on ``--world`` gloo ranks, gives it seeded gradients and reports,
for one ``step()`` after ``--warmup`` steps: the process-group collectives it issued
(counted with the torch profiler: every ``c10d::`` op, whoever calls it), the operators the
step calls itself (each at least one kernel launch on a GPU) and the mean step time over
``--steps`` steps, next to the same figures of the same model in one process.

With ``--cuda`` the same runs on GPUs (one per rank, NCCL): the step's host time, its time
to a synchronised end, and how many times it makes the host wait for the GPU (torch's sync
debug mode: each wait is a warning) are printed too. The warm-up waits (up to 300 s) until
the owners' Triton kernels are compiled, so the timed steps run them; the ranks then time
torch's AdamW (foreach) on the same sharded model, the reference the sharded step is compared with.
``FSDP_PROFILE=1`` prints rank 0's cProfile of the timed steps (the host's Python time).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/fsdp_collectives.py --world 2
    PYTHONPATH=<other checkout> python benchmarks/fsdp_collectives.py   # another version
    python benchmarks/fsdp_collectives.py --cuda --world 2               # on 2 GPUs
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import socket
import sys
import tempfile
import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_model

DEFAULT_CONFIG = DEFAULT_CONFIG_DIR / "dpa2_small_water.json"


def _model(config: str) -> torch.nn.Module:
    model = build_model(Path(config)).to(torch.float32)
    for p in model.parameters():
        if p.numel() == 0:
            p.requires_grad_(False)
    return model


def _grads(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=gen).to(p.device) for p in params]


def _optimizer(named: list[tuple[str, torch.Tensor]]) -> torch.optim.Optimizer:
    from deepmd_hybridmuon import HybridMuonOptimizer

    return HybridMuonOptimizer([p for _, p in named], named_parameters=named, lr=1e-3)


def _under_op(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::")):
            return True
        parent = parent.cpu_parent
    return False


def _time_steps(named, opt, args, shard) -> tuple[dict[str, float], collections.Counter]:
    from torch.profiler import ProfilerActivity, profile

    params = [p for _, p in named]
    cuda = params[0].device.type == "cuda"
    for k in range(args.warmup):
        shard(params, _grads(params, k))
        opt.step()
    _wait_for_kernels(opt, shard, params)
    shard(params, _grads(params, args.warmup))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        opt.step()
    events = prof.events()
    calls = collections.Counter(e.name for e in events if e.name.startswith("c10d::"))
    # Operators called by the step itself (not from inside another operator): each is at
    # least one kernel launch on a GPU, so their count bounds a host-bound step from below.
    top = collections.Counter(e.name for e in events if e.name.startswith("aten::") and not _under_op(e))
    calls["top-level aten ops"] = sum(top.values())
    if os.environ.get("FSDP_OPS"):  # which operators: FSDP_OPS=1 prints the commonest of each process
        print(top.most_common(25), flush=True)
    caught: list = []
    if cuda:  # how often one step makes the host wait for the GPU
        shard(params, _grads(params, 0))
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        # each wait is a warning; the mode's own notice ("... is a prototype feature") is not one
        caught = [w for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
        calls["host waits for the GPU"] = len(caught)
    host = total = 0.0
    for k in range(args.steps):
        shard(params, _grads(params, k))
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        host += time.perf_counter() - start
        if cuda:
            torch.cuda.synchronize()
        total += time.perf_counter() - start
    if os.environ.get("FSDP_PROFILE"):  # after the timing (cProfile slows the host), on every rank
        profiler = cProfile.Profile()
        for k in range(args.steps):
            shard(params, _grads(params, k))
            profiler.enable()
            opt.step()
            profiler.disable()
    if os.environ.get("FSDP_PROFILE") and _rank() == 0:  # rank 0 prints
        print(f"cProfile of {type(opt).__name__}, {args.steps} steps", flush=True)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
        for w in caught if cuda else []:  # where the host waited
            print(f"host wait: {w.filename}:{w.lineno}: {w.message}", flush=True)
    return {"host": host / args.steps, "total": total / args.steps}, calls


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _wait_for_kernels(opt: torch.optim.Optimizer, shard, params: list[torch.Tensor]) -> None:
    """Step until no row of ``opt.execution_table()`` is compiling (300 s at most); torch optimizers have none."""
    table = getattr(opt, "execution_table", None)
    deadline = time.monotonic() + 300
    while table is not None and any(r.get("kernels") == "compiling" for r in table()):
        if time.monotonic() > deadline:
            print("kernels still compiling after 300 s: timing the torch path", flush=True)
            return
        time.sleep(1.0)
        shard(params, _grads(params, 0))
        opt.step()


def _worker(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor

    torch.set_num_threads(1)
    kind = "cuda" if args.cuda else "cpu"
    if args.cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl" if args.cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world,
        timeout=timedelta(seconds=300),
    )
    try:
        model = _model(args.config).to(torch.device(kind, rank) if args.cuda else "cpu")
        fully_shard(model, mesh=init_device_mesh(kind, (args.world,)))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

        def shard(params, grads):
            for p, g in zip(params, grads, strict=True):
                p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None)

        opt = _optimizer(named)
        seconds, calls = _time_steps(named, opt, args, shard)
        kernels = [r.get("kernels") for r in opt.execution_table()]
        adamw, adamw_calls = _time_steps(named, torch.optim.AdamW([p for _, p in named], lr=1e-3), args, shard)
        if rank == 0:
            result = {"seconds": seconds, "calls": dict(calls), "kernels": kernels}
            result["adamw"] = {"seconds": adamw, "calls": dict(adamw_calls)}
            Path(out).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(DEFAULT_CONFIG))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cuda", action="store_true", help="GPUs and NCCL instead of CPU gloo ranks")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import torch.multiprocessing as mp

    model = _model(args.config).to("cuda" if args.cuda else "cpu")
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    muon = sum(1 for r in _optimizer(named).routing_table() if r["route"] == "muon" for _ in range(r["view"][0]))

    def plain(params, grads):
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    single, single_calls = _time_steps(named, _optimizer(named), args, plain)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(Path(tempfile.gettempdir()) / f"fsdp_collectives.{os.getpid()}.json")
    mp.start_processes(_worker, args=(port, args, out), nprocs=args.world, start_method="spawn")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    where = f"{args.world} {'GPUs (NCCL)' if args.cuda else 'gloo ranks'}"
    print(f"model {Path(args.config).stem}: {len(named)} trainable parameters, {muon} Muon matrices")
    print(
        f"one process: {single['total'] * 1e3:.2f} ms/step (host {single['host'] * 1e3:.2f}), "
        f"{single_calls['top-level aten ops']} top-level aten ops, "
        f"{single_calls.get('host waits for the GPU', 0)} host waits"
    )
    fsdp = result["seconds"]
    print(
        f"FSDP2 on {where}: {fsdp['total'] * 1e3:.2f} ms/step (host {fsdp['host'] * 1e3:.2f}; "
        f"{fsdp['total'] / single['total']:.2f}x one process)"
    )
    print(f"collectives in one step (rank 0): {result['calls']}; owners' kernels: {result['kernels']}")
    adamw = result["adamw"]["seconds"]
    print(
        f"torch AdamW (foreach) under FSDP2 on {where}: {adamw['total'] * 1e3:.2f} ms/step (host "
        f"{adamw['host'] * 1e3:.2f}); HybridMuon / AdamW {fsdp['total'] / adamw['total']:.2f}x; "
        f"AdamW's step: {result['adamw']['calls']}"
    )


if __name__ == "__main__":
    sys.exit(main())
