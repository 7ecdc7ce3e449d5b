#!/usr/bin/env python
"""Time one optimizer step of deepmd-hybridmuon, deepmd-kit's built-in HybridMuon and AdamW.

The parameter sets are those of real deepmd-kit models (the water inputs in ``examples/water``),
named as deepmd's trainer names them (``model.Default.<...>``). Every step gets fresh
gradient tensors, as deepmd's trainer does (``zero_grad(set_to_none=True)`` then backward):
before each step, and outside the timed region, each ``p.grad`` is set to a fresh copy of
one of ``--grad-sets`` pre-generated random gradient sets (seeded).

For each variant: the wall time of the first step (synchronised; includes any compilation,
e.g. the built-in's ``torch.compile`` of its Gram path), then ``--warmup`` steps, then
``--steps`` timed steps: on CUDA each step is bracketed by a pair of ``torch.cuda.Event``
(the device is synchronised before each step, never inside it), on CPU by
``time.perf_counter``; median and min are reported. Every variant gets a fresh copy of the
initial parameters. Before each variant ``torch._dynamo.reset()`` runs, and torch's compile
caches (inductor's on-disk FX graph cache etc.) are off (``force_disable_caches``), so
every compiling variant pays a cold compilation, as in a first training run. Pass
``--compile-cache`` to allow the caches (what a user sees on later runs) and
``--no-dynamo-reset`` to keep dynamo's in-process caches between variants.

Usage::

    python benchmarks/step_time.py                                   # all configs, all variants
    python benchmarks/step_time.py dpa4_water --variants ours,builtin,adamw   # configs by name
    python benchmarks/step_time.py --configs se_e2_a_water --steps 3 --warmup 1
    python benchmarks/step_time.py --variants ours,builtin,adamw --json out.json
    python benchmarks/step_time.py --variants ours --ours-kw implementation=loop
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DEFAULT_CONFIG_DIR,
    build_named_params,
    command_line,
    first_line,
    package_version,
    parse_kw,
    shown,
    utc_now,
    write_json,
)

# force_disable_caches makes dynamo warn that its profile-guided cache is off; that is the point.
warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")

DEFAULT_CONFIGS = ("se_e2_a_water", "dpa2_small_water", "dpa3_water", "dpa4_water")

#: Option sets shared by ours and the built-in: suffix -> constructor keywords.
OPTION_SETS: dict[str, dict[str, Any]] = {
    "": {},
    "-nogram": {"enable_gram": False},
    "-noflash": {"flash_muon": False},
    "-nomagma": {"magma_muon": False},
}
ALL_VARIANTS: tuple[str, ...] = (
    *(f"ours{s}" for s in OPTION_SETS),
    *(f"builtin{s}" for s in OPTION_SETS),
    "adamw",
)
#: Variants that --variants accepts but that do not run by default.
EXTRA_VARIANTS: tuple[str, ...] = ("torch-muon",)
ADAMW_LR = 1e-3


# ----------------------------------------------------------------------------- models


def make_grad_pool(
    named: list[tuple[str, torch.Tensor]], n_sets: int, seed: int, device: torch.device, requires_grad: list[bool]
) -> list[list[torch.Tensor | None]]:
    """``n_sets`` sets of random gradients (generated on the CPU from ``seed``, then moved)."""
    gen = torch.Generator().manual_seed(seed)
    pool = []
    for _ in range(n_sets):
        grads: list[torch.Tensor | None] = []
        for (_, p), rg in zip(named, requires_grad, strict=True):
            if not rg:
                grads.append(None)
                continue
            g = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 1e-2
            grads.append(g.to(device=device, dtype=p.dtype))
        pool.append(grads)
    return pool


def routing_counts(named: list[tuple[str, torch.Tensor]], muon_mode: str = "slice") -> dict[str, int]:
    """Counts per route (ours' routing = the built-in's), Muon matrices and elements."""
    from deepmd_hybridmuon.functional import route_parameter

    counts = {"muon": 0, "adam": 0, "adamw": 0, "muon_matrices": 0, "muon_numel": 0}
    for name, p in named:
        r = route_parameter(name, tuple(p.shape), muon_mode)
        counts[r.route] += 1
        if r.route == "muon":
            counts["muon_matrices"] += int(r.view[0])
            counts["muon_numel"] += p.numel()
    return counts


# ------------------------------------------------------------------------- optimizers


class TorchMuonAdamW:
    """torch's own ``torch.optim.Muon`` on the 2-D parameters and AdamW on the others, stepped together.

    Not a deepmd option (deepmd's trainer cannot build it): the plain-PyTorch Muon to compare with.
    ``torch.optim.Muon`` takes only 2-D parameters and has no routing of its own.
    """

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device) -> None:
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.optim.Muon")
        matrices = [p for p in params if p.ndim == 2]
        others = [p for p in params if p.ndim != 2]
        extra = {"fused": True} if device.type == "cuda" else {}
        self.optimizers: list[torch.optim.Optimizer] = []
        if matrices:
            self.optimizers.append(torch.optim.Muon(matrices, lr=ADAMW_LR))
        if others:
            self.optimizers.append(torch.optim.AdamW(others, lr=ADAMW_LR, **extra))

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()


def make_optimizer(
    variant: str, named: list[tuple[str, torch.nn.Parameter]], device: torch.device, ours_kw: dict[str, Any]
) -> torch.optim.Optimizer | TorchMuonAdamW:
    """Build ``variant`` the way deepmd's trainer does (params, then ``set_param_names``)."""
    params = [p for _, p in named]
    if variant == "adamw":
        extra = {"fused": True} if device.type == "cuda" else {}
        return torch.optim.AdamW(params, lr=ADAMW_LR, **extra)
    if variant == "torch-muon":
        return TorchMuonAdamW(params, device)
    family, _, suffix = variant.partition("-")
    options = dict(OPTION_SETS["-" + suffix if suffix else ""])
    implementation = None
    if family == "ours":
        from deepmd_hybridmuon import HybridMuonOptimizer

        options.update(ours_kw)
        # not a constructor keyword: the optimizer's private switch (optimizer.IMPLEMENTATIONS)
        implementation = options.pop("implementation", None)
    elif family == "builtin":
        from deepmd.pt.optimizer.hybrid_muon import HybridMuonOptimizer
    else:
        raise ValueError(f"unknown variant {variant!r}")
    opt = HybridMuonOptimizer(params, **options)
    if implementation is not None:
        opt._implementation = implementation
    opt.set_param_names(named)
    return opt


# ---------------------------------------------------------------------------- timing


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_device(device: torch.device) -> None:
    """Initialise the device's libraries (CUDA context, cuBLAS handles) before any timing.

    Otherwise the first variant's first step would carry these one-off costs.
    """
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        a = torch.randn(4, 64, 32, device=device).to(dtype)
        (a @ a.mT).sum().item()
        (a[0] @ a[0].mT).sum().item()
    p = torch.nn.Parameter(torch.zeros(8, device=device))
    p.grad = torch.ones_like(p)
    torch.optim.AdamW([p], fused=device.type == "cuda").step()
    sync(device)


def time_variant(
    variant: str,
    master: list[tuple[str, torch.Tensor]],
    requires_grad: list[bool],
    pool: list[list[torch.Tensor | None]],
    device: torch.device,
    args: argparse.Namespace,
    ours_kw: dict[str, Any],
) -> dict[str, Any]:
    """First-step time and per-step times of one variant on a fresh copy of the parameters."""
    if not args.no_dynamo_reset:
        torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base_mem = torch.cuda.memory_allocated(device)
    named = [
        (n, torch.nn.Parameter(t.clone(), requires_grad=rg)) for (n, t), rg in zip(master, requires_grad, strict=True)
    ]
    params = [p for _, p in named]
    opt = make_optimizer(variant, named, device, ours_kw)
    step_no = 0

    def set_grads(i: int) -> None:
        # Fresh tensors each step, as after zero_grad(set_to_none=True) + backward.
        for p, g in zip(params, pool[i % len(pool)], strict=True):
            p.grad = None if g is None else g.clone()

    # First step: wall time, synchronised, includes compilation / autotuning / lazy state.
    set_grads(step_no)
    sync(device)
    t0 = time.perf_counter()
    opt.step()
    sync(device)
    first_s = time.perf_counter() - t0
    step_no += 1
    if variant.startswith("ours") and device.type == "cuda":
        # Ours compiles its Triton kernels in the background and steps with the torch path
        # meanwhile (kernels.prepare): time the steady state, with the kernels.
        from deepmd_hybridmuon import kernels

        kernels.wait_ready(600)
        print(f"  {variant}: Triton kernels ready {time.perf_counter() - t0:.1f} s after the first step began")

    for _ in range(args.warmup):
        set_grads(step_no)
        opt.step()
        step_no += 1
    sync(device)

    times_ms: list[float] = []
    wall_ms: list[float] = []
    if device.type == "cuda":
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(args.steps)
        ]
        for start, end in events:
            set_grads(step_no)
            sync(device)
            t0 = time.perf_counter()
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            wall_ms.append((time.perf_counter() - t0) * 1e3)
            step_no += 1
        times_ms = [s.elapsed_time(e) for s, e in events]
    else:
        for _ in range(args.steps):
            set_grads(step_no)
            t0 = time.perf_counter()
            opt.step()
            times_ms.append((time.perf_counter() - t0) * 1e3)
            step_no += 1
        wall_ms = list(times_ms)

    finite = all(bool(torch.isfinite(p).all()) for p in params)
    result = {
        "variant": variant,
        "ok": True,
        "first_step_s": first_s,
        "median_ms": statistics.median(times_ms),
        "min_ms": min(times_ms),
        "mean_ms": statistics.fmean(times_ms),
        "wall_median_ms": statistics.median(wall_ms),
        "times_ms": times_ms,
        "params_finite": finite,
    }
    if device.type == "cuda":
        # parameters, gradients, optimizer state and workspace of this variant
        result["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base_mem) / 2**20
    if variant.startswith("ours") and hasattr(opt, "routing_table"):
        table = opt.routing_table()
        result["routes"] = {r: sum(row["route"] == r for row in table) for r in ("muon", "adam", "adamw")}
    return result


# ---------------------------------------------------------------------------- report


def fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def ratio(num: dict[str, Any] | None, den: dict[str, Any] | None) -> float | None:
    if not num or not den or not num.get("ok") or not den.get("ok") or den["median_ms"] <= 0:
        return None
    return num["median_ms"] / den["median_ms"]


def markdown_table(results: list[dict[str, Any]]) -> str:
    by_name = {r["variant"]: r for r in results}
    adamw = by_name.get("adamw")
    lines = [
        "| variant | first step (s) | median (ms) | min (ms) | median / AdamW | built-in median / ours median |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        name = r["variant"]
        if not r["ok"]:
            lines.append(f"| {name} | failed: {r['error'].replace('|', '/')} | | | | |")
            continue
        vs_builtin = None
        if name.startswith("ours"):
            vs_builtin = ratio(by_name.get("builtin" + name[len("ours") :]), r)
        flag = "" if r.get("params_finite", True) else " (non-finite params!)"
        lines.append(
            f"| {name}{flag} | {r['first_step_s']:.3f} | {r['median_ms']:.3f} | {r['min_ms']:.3f} "
            f"| {fmt(ratio(r, adamw), '.2f')} | {fmt(vs_builtin, '.2f')} |"
        )
    return "\n".join(lines)


def environment(device: torch.device) -> dict[str, Any]:
    deepmd_version = package_version("deepmd-kit") or "unknown"
    try:
        import deepmd_hybridmuon

        ours_version = deepmd_hybridmuon.__version__
    except Exception:
        ours_version = "unknown"
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"
    return {
        "device": str(device),
        "device_name": device_name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepmd_kit": deepmd_version,
        "deepmd_hybridmuon": ours_version,
        "python": platform.python_version(),
        "date_utc": utc_now(),
        "command": command_line(),
    }


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of config names (no .json)")
    ap.add_argument("config_names", nargs="*", metavar="CONFIG", help="config names; given, they replace --configs")
    ap.add_argument(
        "--variants",
        default=",".join(ALL_VARIANTS),
        help="comma list of: " + ",".join(ALL_VARIANTS + EXTRA_VARIANTS) + " (default: all but torch-muon)",
    )
    ap.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps after the first step")
    ap.add_argument("--grad-sets", type=int, default=4, help="number of random gradient sets cycled through")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ours-kw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra constructor keyword for the ours-* variants (repeatable; value is a Python literal); "
        "implementation=loop|engine-eager|engine picks optimizer.IMPLEMENTATIONS",
    )
    ap.add_argument("--no-dynamo-reset", action="store_true", help="do not call torch._dynamo.reset() per variant")
    ap.add_argument(
        "--compile-cache",
        action="store_true",
        help="allow torch's on-disk compile caches (default: force_disable_caches, cold compiles)",
    )
    ap.add_argument("--json", type=Path, help="write all numbers to this file")
    ap.add_argument("--traceback", action="store_true", help="print the traceback of failed variants")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.grad_sets < 1:
        ap.error("--steps must be >= 1, --warmup >= 0, --grad-sets >= 1")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if v not in ALL_VARIANTS + EXTRA_VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {','.join(ALL_VARIANTS + EXTRA_VARIANTS)}")
    names = ",".join(args.config_names) if args.config_names else args.configs
    args.config_list = [c.strip().removesuffix(".json") for c in names.split(",") if c.strip()]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    ours_kw = parse_kw(args.ours_kw, "--ours-kw")
    if not args.compile_cache:
        torch.compiler.config.force_disable_caches = True
    env = environment(device)
    print(f"# Optimizer step time on {env['device_name']}")
    print()
    print(f"- torch {env['torch']} (CUDA {env['cuda']}), deepmd-kit {env['deepmd_kit']}, ", end="")
    print(f"deepmd-hybridmuon {env['deepmd_hybridmuon']}, Python {env['python']}")
    print(f"- date: {env['date_utc']}")
    print(f"- command: `{env['command']}`")
    print(
        f"- steps: first + {args.warmup} warm-up + {args.steps} timed; {args.grad_sets} gradient sets, seed {args.seed}"
    )
    print(
        "- torch.compile caches: "
        + ("allowed" if args.compile_cache else "disabled (cold compilation)")
        + ("" if args.no_dynamo_reset else "; torch._dynamo.reset() before each variant")
    )
    if ours_kw:
        print(f"- extra keywords of ours-*: {ours_kw}")
    print(f"- HybridMuon variants at the constructor defaults (lr 5e-4 etc.); AdamW lr {ADAMW_LR}", end="")
    print(", fused" if device.type == "cuda" else " (not fused on CPU)")
    sys.stdout.flush()

    warm_device(device)
    report: dict[str, Any] = {"environment": env, "args": {**vars(args), "config_dir": shown(args.config_dir)}}
    report["args"].pop("json", None)
    report["args"]["ours_kw"] = {k: repr(v) for k, v in ours_kw.items()}
    report["configs"] = {}
    for config in args.config_list:
        path = args.config_dir / f"{config}.json"
        print(f"\n## {config}\n")
        try:
            t0 = time.perf_counter()
            master, requires_grad = build_named_params(path, device)
            build_s = time.perf_counter() - t0
        except Exception as err:
            print(f"failed to build the model: {first_line(err)}")
            report["configs"][config] = {"error": first_line(err)}
            if args.traceback:
                traceback.print_exc()
            continue
        pool = make_grad_pool(master, args.grad_sets, args.seed, device, requires_grad)
        counts = routing_counts(master)
        numel = sum(t.numel() for _, t in master)
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for _, t in master})
        print(
            f"{len(master)} parameter tensors, {numel:,} elements, dtype {'/'.join(dtypes)} "
            f"(model built in {build_s:.1f} s)"
        )
        print(
            f"routing (muon_mode slice): Muon {counts['muon']} tensors = {counts['muon_matrices']} matrices "
            f"({counts['muon_numel']:,} elements), Adam {counts['adam']}, AdamW {counts['adamw']}"
        )
        print()
        sys.stdout.flush()
        results: list[dict[str, Any]] = []
        for variant in args.variant_list:
            try:
                res = time_variant(variant, master, requires_grad, pool, device, args, ours_kw)
            except Exception as err:
                res = {"variant": variant, "ok": False, "error": first_line(err)}
                if args.traceback:
                    traceback.print_exc()
            results.append(res)
            status = (
                f"first {res['first_step_s']:.3f} s, median {res['median_ms']:.3f} ms"
                if res["ok"]
                else f"FAILED ({res['error']})"
            )
            print(f"  {variant}: {status}", file=sys.stderr, flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for r in results:
            routes = r.get("routes")
            if routes and any(routes[k] != counts[k] for k in routes):
                print(f"note: {r['variant']}'s routing_table() gives {routes}, route_parameter gave {counts}")
        print(markdown_table(results))
        sys.stdout.flush()
        report["configs"][config] = {
            "n_tensors": len(master),
            "numel": numel,
            "dtypes": dtypes,
            "routing": counts,
            "results": results,
        }
        del master, pool
    if args.json:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
