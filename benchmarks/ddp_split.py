#!/usr/bin/env python
"""DDP (``zero_stage`` 0): where splitting Newton–Schulz across the replicas beats computing it on every rank.

For each case, a set of Muon-routed parameters replicated on every rank, this times
``optimizer.step()`` of :class:`deepmd_hybridmuon.HybridMuonOptimizer` with ``ddp_split="off"``
(the flat engine: every rank computes every matrix) and ``ddp_split="always"`` (each rank
orthogonalises its share, one all-gather shares the updates). Cases: a ladder of synthetic
groups (``--count`` square n × n matrices per size of ``--sizes``, and ``--rect`` groups of
rectangular ones) and the Muon parameters of deepmd models (``--configs``, built from the
shared inputs, named as deepmd's trainer names them; a config that fails to build is skipped
with a line saying why).

Timing: the same gradients every step (the step does not depend on their values' history);
the first step, then on CUDA a bounded wait for the Triton kernels (``--kernel-wait``), then
``--warmup`` steps (the engine captures its CUDA graph there), then ``--steps`` timed steps,
each after a barrier and a device synchronisation, bracketed by CUDA events (``perf_counter``
on the CPU). A case's time is the slowest rank's median. The table gives the Newton–Schulz
cost (:func:`deepmd_hybridmuon.distributed.ns_cost` units) of the largest rank's share under
the split, of all matrices, and what the split saves each rank (the quantity
``ddp_split="auto"`` compares with ``DDP_SPLIT_MIN_COST``), and the crossover.

Every bound is explicit: a process-group timeout (``--pg-timeout``), a time budget after which
no new case starts (``--budget``, agreed by all ranks), a bounded kernel wait; the process
group is destroyed at the end. Rank 0 prints and writes ``--json``.

Usage::

    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_split.py --json out.json
    torchrun --standalone --nproc_per_node=2 benchmarks/ddp_split.py --device cpu --sizes 16,32 \\
        --rect 16x48 --configs '' --steps 5 --warmup 2          # a CPU check with gloo
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import DEFAULT_CONFIG_DIR, build_named_params, command_line, first_line, utc_now, write_json

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import distributed as D
from deepmd_hybridmuon.functional import route_parameter

DEFAULT_SIZES = "128,256,512,1024,2048,4096"
DEFAULT_RECT = "256x1024,1024x4096"
DEFAULT_CONFIGS = "dpa2_small_water,dpa3_water,dpa4_water"
MODES = ("off", "always")


# ----------------------------------------------------------------------------- cases


def synthetic(shape: tuple[int, int], count: int, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """``count`` matrices of ``shape`` (float32, seeded: the same on every rank)."""
    gen = torch.Generator().manual_seed(0)
    return [(f"layers.{i}.matrix", 0.02 * torch.randn(shape, generator=gen).to(device)) for i in range(count)]


def model_muon(path: Path, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The Muon-routed trainable parameters of one deepmd input's model."""
    named, requires_grad = build_named_params(path, device)
    return [
        (n, t)
        for (n, t), rg in zip(named, requires_grad, strict=True)
        if rg and route_parameter(n, tuple(t.shape), "slice").route == "muon"
    ]


def costs(named: list[tuple[str, torch.Tensor]], world: int) -> dict[str, int]:
    """Matrices and Newton–Schulz costs of the plan ``ddp_split`` uses (metadata only)."""
    entries = [(i, tuple(t.shape), route_parameter(n, tuple(t.shape), "slice")) for i, (n, t) in enumerate(named)]
    plan = D.build_plan(entries, world)
    total, per_rank = sum(plan.load), max(plan.load, default=0)
    return {
        "matrices": sum(len(o) for o in plan.owners),
        "ns_cost_per_rank": per_rank,
        "ns_cost_total": total,
        "ns_cost_saved": total - per_rank,
        "pays": D.split_pays(plan),
    }


# ----------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_mode(
    named: list[tuple[str, torch.Tensor]], mode: str, device: torch.device, args: argparse.Namespace
) -> dict[str, Any]:
    """Median and min step time (ms) of ``ddp_split=mode`` on this rank, and how the group ran."""
    params = [torch.nn.Parameter(t.clone()) for _, t in named]
    gen = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = (1e-2 * torch.randn(p.shape, generator=gen, dtype=torch.float32)).to(device=device, dtype=p.dtype)
    opt = HybridMuonOptimizer(params, ddp_split=mode)
    opt.set_param_names([(n, p) for (n, _), p in zip(named, params, strict=True)])
    opt.step()
    kernels_ready = None
    if device.type == "cuda":
        from deepmd_hybridmuon import kernels

        kernels_ready = kernels.wait_ready(args.kernel_wait)
    for _ in range(args.warmup):
        opt.step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        sync(device)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
    table = opt.execution_table()[0]
    return {
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "implementation": table["implementation"],
        "kernels": table.get("kernels"),
        "kernels_ready": kernels_ready,
    }


def slowest(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_agree(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` holds on every rank (so that all ranks take the same branch)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


# ----------------------------------------------------------------------------- report


def crossover(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Saved Newton–Schulz cost where the split starts to win.

    ``smallest_win``: the smallest saved cost of a case where the split is faster;
    ``wins_from``: the smallest saved cost from which it wins in every larger case;
    ``largest_loss_below``: the largest saved cost below that where it loses (the threshold
    lies between the two).
    """
    timed = sorted((r for r in rows if r.get("ratio") is not None), key=lambda r: r["ns_cost_saved"])
    wins = [r["ns_cost_saved"] for r in timed if r["ratio"] < 1.0]
    wins_from = None
    for i, r in enumerate(timed):
        if all(q["ratio"] < 1.0 for q in timed[i:]):
            wins_from = r["ns_cost_saved"]
            break
    losses = [
        r["ns_cost_saved"] for r in timed if r["ratio"] >= 1.0 and (wins_from is None or r["ns_cost_saved"] < wins_from)
    ]
    return {
        "smallest_win": min(wins) if wins else None,
        "wins_from": wins_from,
        "largest_loss_below": max(losses) if losses else None,
    }


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| case | matrices | NS cost per rank (split) | NS cost total | saved per rank | ms off | ms always | "
        "always / off | auto splits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | failed: {r['error'].replace('|', '/')} | | | | | | | |")
            continue
        note = "" if r["off"]["kernels"] in (None, "triton", "torch") else f" ({r['off']['kernels']})"
        lines.append(
            f"| {r['case']} | {r['matrices']} | {r['ns_cost_per_rank']:.3g} | {r['ns_cost_total']:.3g} "
            f"| {r['ns_cost_saved']:.3g} | {r['off']['median_ms']:.3f}{note} | {r['always']['median_ms']:.3f} "
            f"| {r['ratio']:.2f} | {'yes' if r['pays'] else 'no'} |"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (NCCL) or cpu (gloo)"
    )
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of n: square n x n groups ('' for none)")
    ap.add_argument("--rect", default=DEFAULT_RECT, help="comma list of RxC: rectangular groups ('' for none)")
    ap.add_argument("--count", type=int, default=8, help="matrices per synthetic group")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of deepmd inputs ('' for none)")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--steps", type=int, default=30, help="timed steps per mode")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps after the first (and the kernel wait)")
    ap.add_argument("--kernel-wait", type=float, default=40.0, help="seconds to wait for the Triton kernels")
    ap.add_argument("--budget", type=float, default=80.0, help="seconds after which no new case starts")
    ap.add_argument("--pg-timeout", type=float, default=120.0, help="process-group timeout, seconds")
    ap.add_argument("--json", type=Path, help="write the numbers here (rank 0)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.count < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --count >= 1")
    return args


def cases(args: argparse.Namespace) -> list[tuple[str, Any]]:
    """(name, what to build) in order: square ladder, rectangular, models."""
    out: list[tuple[str, Any]] = []
    for n in (int(x) for x in args.sizes.split(",") if x.strip()):
        out.append((f"{args.count} x {n}x{n}", (n, n)))
    for spec in (x.strip() for x in args.rect.split(",") if x.strip()):
        rows, _, cols = spec.partition("x")
        out.append((f"{args.count} x {int(rows)}x{int(cols)}", (int(rows), int(cols))))
    for name in (x.strip().removesuffix(".json") for x in args.configs.split(",") if x.strip()):
        out.append((name, args.config_dir / f"{name}.json"))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.pg_timeout))
    try:
        return run(args, device)
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    lead = rank == 0
    start = time.perf_counter()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.machine()}"
    env = {"command": command_line(), "device": f"{world} x {name}", "date_utc": utc_now(), "torch": torch.__version__}
    if lead:
        print(f"# ddp_split: Newton-Schulz split across {world} replicas vs every rank computing it\n")
        print(f"- device: {env['device']}; torch {env['torch']}; {env['date_utc']}")
        print(f"- command: `{env['command']}`")
        print(f"- {args.steps} timed steps after {args.warmup} warm-up; slowest rank's median")
        print(f'- DDP_SPLIT_MIN_COST = {D.DDP_SPLIT_MIN_COST:.3g} ("auto splits": saved per rank > this)\n')
        sys.stdout.flush()
    rows: list[dict[str, Any]] = []
    for case, spec in cases(args):
        if not all_agree(time.perf_counter() - start < args.budget, device):
            if lead:
                print(f"skipped {case}: the {args.budget:.0f} s budget is spent")
            rows.append({"case": case, "error": "skipped: budget spent"})
            continue
        error = None
        try:
            named = synthetic(spec, args.count, device) if isinstance(spec, tuple) else model_muon(spec, device)
            if not named:
                error = "no Muon-routed parameters"
        except Exception as err:  # a config that does not build: say why, go on
            named, error = [], f"could not build: {first_line(err)}"
        if not all_agree(error is None, device):
            if lead:
                print(f"skipped {case}: {error or 'failed on another rank'}")
            rows.append({"case": case, "error": error or "failed on another rank"})
            continue
        row: dict[str, Any] = {"case": case, **costs(named, world)}
        for mode in MODES:
            result = time_mode(named, mode, device, args)
            result["median_ms"] = slowest(result["median_ms"], device)
            result["min_ms"] = slowest(result["min_ms"], device)
            row[mode] = result
        row["ratio"] = row["always"]["median_ms"] / row["off"]["median_ms"]
        rows.append(row)
        if lead:
            print(
                f"  {case}: off {row['off']['median_ms']:.3f} ms ({row['off']['implementation']}), "
                f"always {row['always']['median_ms']:.3f} ms ({row['always']['implementation']})",
                file=sys.stderr,
                flush=True,
            )
        del named
        if device.type == "cuda":
            torch.cuda.empty_cache()
    cross = crossover(rows)
    if lead:
        print(markdown(rows))
        fmt = {k: "none" if v is None else f"{v:.3g}" for k, v in cross.items()}
        print(
            f"\ncrossover (NS cost saved per rank): the split wins in every case from {fmt['wins_from']} on; "
            f"largest loss below that: {fmt['largest_loss_below']}; smallest winning case: {fmt['smallest_win']}"
        )
        print(f"total {time.perf_counter() - start:.1f} s")
        if args.json:
            write_json(args.json, {"environment": env, "args": vars(args), "rows": rows, "crossover": cross})
            print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
