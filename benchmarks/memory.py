#!/usr/bin/env python
"""The memory an optimizer holds: deepmd-hybridmuon, the built-in HybridMuon, fused AdamW, torch's Muon.

Two measurements, both of torch's CUDA caching allocator (``torch.cuda.memory_allocated``:
the bytes of live tensors, CUDA-graph pools included; not the allocator's reserve, the CUDA
context or loaded kernel code):

1. **The optimizer alone** (always). Each variant runs in a fresh process
   (``memory.py --child``), so that the allocator's statistics hold nothing of another
   variant. The process builds the model of a deepmd input (``common.build_named_params``:
   the trainer's parameter names), initialises the device's libraries (``step_time.warm_device``:
   cuBLAS' workspace is no optimizer's), generates ``--grad-sets`` sets of random gradients on
   the device (``step_time.make_grad_pool``) and gives every parameter a gradient; then it
   takes ``base = memory_allocated()`` and resets the peak. It builds the optimizer
   (``step_time.make_optimizer``, as deepmd's trainer builds it), takes one step, waits for
   ours' Triton kernels (``deepmd_hybridmuon.kernels.wait_ready``, variant ``ours`` on CUDA:
   the steps after it run with the kernels and their state) and takes ``--steps`` more
   steps, each on fresh gradient tensors (as after ``zero_grad(set_to_none=True)`` and a
   backward pass). Reported, in MiB, above ``base``:

   * ``resident``: allocated after the last step: optimizer state, workspaces, CUDA-graph
     pools, anything the optimizer keeps (the gradients are in ``base``);
   * ``peak``: the most allocated at any time from the optimizer's construction to the last
     step (``steady_peak``: over the steps after the first step and the kernel wait);
   * in the JSON also ``reserved``: what the allocator's reserve grew by (it holds the private
     pools of CUDA graphs whole, where ``resident`` counts only their live blocks), and
     ``state``: the tensors in ``optimizer.state``, each storage once (measured on the CPU too).

   With them the parameter count and the MiB of one copy of the parameters, in their own
   dtype (float64 for se_e2_a water) and in float32: fused AdamW keeps two copies in the
   parameters' dtype (its two moments), its floor (``adamw_floor``).

2. **A whole training run** (``--train``): ``dp --pt train`` for ``--train-steps`` steps of
   each config per variant, through ``timed_dp.py`` with ``RECORD_MEMORY=1``, which records
   ``torch.cuda.max_memory_allocated()`` of the process at its end (model, activations,
   optimizer: everything). A 1-step run of ours first computes the data statistics file
   that the measured runs load and compiles our Triton kernels into Triton's cache; ours
   then waits for its kernels after its first step (``WAIT_FOR_KERNELS``).

Variants: ``ours`` (deepmd_hybridmuon.HybridMuonOptimizer at its defaults: the Triton
kernels when ready), ``ours-torch`` (ours with ``flash_muon=False``: the torch kernel path),
``adamw`` (``torch.optim.AdamW``, fused on CUDA), ``builtin`` (deepmd-kit's own
HybridMuon), ``torch-muon`` (``torch.optim.Muon`` on the 2-D parameters plus AdamW on the
others; recorded as unavailable where torch has no ``torch.optim.Muon``). On the CPU
everything runs (a functional check) and the memory is recorded as null.

Usage::

    python benchmarks/memory.py                                   # all four water models, all variants
    python benchmarks/memory.py dpa3_water dpa4_water --steps 20  # configs by name
    python benchmarks/memory.py --train                           # and dp --pt train's peak (30 steps)
    python benchmarks/memory.py se_e2_a_water --device cpu --steps 2 --json "$TMPDIR/m.json"  # a quick check
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    DEFAULT_CONFIG_DIR,
    KERNELS_FROM_STEP_RE,
    REPO_ROOT,
    TIMED_DP,
    command_line,
    first_line,
    last_line,
    parse_log,
    prepare_run,
    resolve_config,
    run_logged,
    shown,
    shown_command,
    timing_input,
    utc_now,
    write_json,
)

SCHEMA = "memory/1"
DEFAULT_CONFIGS = ("se_e2_a_water", "dpa2_small_water", "dpa3_water", "dpa4_water")
#: This script's variants -> step_time.make_optimizer's names.
VARIANTS = {
    "ours": "ours",
    "ours-torch": "ours-noflash",
    "adamw": "adamw",
    "builtin": "builtin",
    "torch-muon": "torch-muon",
    "ours-eager": "ours",
}
#: Ours in the design measurements: its constructor keywords.
OURS_SETTINGS: dict[str, dict[str, Any]] = {
    "ours": {},
    "ours-eager": {"implementation": "engine-eager"},  # no CUDA graph
}
#: The variants a ``dp --pt train`` run can have -> (timing_input's variant, extra HybridMuon keys).
TRAIN_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "ours": ("ours", {}),
    "ours-torch": ("ours", {"flash_muon": False}),
    "adamw": ("adamw", {}),
    "builtin": ("builtin", {}),
}
DEFAULT_TRAIN_VARIANTS = ("ours", "adamw", "builtin")
MIB = 2**20


# ----------------------------------------------------------------------------- the child


def _state_mib(opt: Any) -> float:
    """MiB of the tensors in ``opt.state``, each storage counted once (views of a flat buffer: the buffer).

    Parameters
    ----------
    opt
        An optimizer, or an object holding several in ``optimizers`` (``step_time.TorchMuonAdamW``).

    Returns
    -------
    float
        What the optimizer's ``state`` shows; workspaces kept elsewhere are not in it.
    """
    import torch

    storages: dict[tuple[str, int], int] = {}
    for o in getattr(opt, "optimizers", [opt]):
        for st in o.state.values():
            for value in st.values() if isinstance(st, dict) else ():
                if isinstance(value, torch.Tensor) and value.numel():
                    storage = value.untyped_storage()
                    storages[(str(value.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values()) / MIB


def measure(
    config_path: Path, variant: str, device_spec: str, steps: int, grad_sets: int, seed: int, kernel_wait: float
) -> dict[str, Any]:
    """One variant's memory on one config, in this process (which should have done nothing else).

    Parameters
    ----------
    config_path
        A deepmd input file; its model's parameters are optimised.
    variant
        A key of :data:`VARIANTS`.
    device_spec
        ``cuda``, ``cuda:1``, ``cpu``, ...
    steps
        Steps after the first step (and, for ``ours`` on CUDA, after the wait for the kernels).
    grad_sets
        Random gradient sets cycled through (``step_time.make_grad_pool``; held on the device, in the base).
    seed
        Seed of the gradients.
    kernel_wait
        Seconds ``ours`` waits at most for its Triton kernels.

    Returns
    -------
    dict
        ``variant``, ``ok``, the memory in MiB (None off CUDA), the model's sizes, the environment.
    """
    import torch
    from common import build_named_params
    from step_time import environment, make_grad_pool, make_optimizer, routing_counts, warm_device

    device = torch.device(device_spec)
    cuda = device.type == "cuda"
    if cuda and device.index is not None:
        torch.cuda.set_device(device)
    env = environment(device)
    machine = f"{torch.cuda.device_count()} x {env['device_name']}" if cuda else env["device_name"]
    out: dict[str, Any] = {"variant": variant, "ok": False, "environment": env, "machine": machine}
    if variant == "torch-muon" and not hasattr(torch.optim, "Muon"):
        out["unavailable"] = f"torch {torch.__version__} has no torch.optim.Muon"
        return out

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def allocated() -> float | None:
        return torch.cuda.memory_allocated(device) / MIB if cuda else None

    def peak() -> float | None:
        return torch.cuda.max_memory_allocated(device) / MIB if cuda else None

    def reserved() -> float | None:
        return torch.cuda.memory_reserved(device) / MIB if cuda else None

    warm_device(device)
    master, requires_grad = build_named_params(config_path, device)
    named = [(n, torch.nn.Parameter(t, requires_grad=rg)) for (n, t), rg in zip(master, requires_grad, strict=True)]
    del master
    params = [p for _, p in named]
    numel = sum(p.numel() for p in params)
    trained = [p for p, rg in zip(params, requires_grad, strict=True) if rg]
    out["model"] = {
        "n_tensors": len(params),
        "numel": numel,
        "trainable_numel": sum(p.numel() for p in trained),
        "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in params}),
        # one copy of the parameters in their own dtype (se_e2_a water's is float64), and in float32
        "params_mib": sum(p.numel() * p.element_size() for p in params) / MIB,
        "params_f32_mib": numel * 4 / MIB,
        # AdamW's two moments, in the parameters' dtype, of the trained parameters
        "adamw_floor_mib": 2 * sum(p.numel() * p.element_size() for p in trained) / MIB,
    }
    try:
        out["model"]["routing"] = routing_counts(named)
    except Exception as err:  # the routing is a description only
        out["model"]["routing"] = first_line(err)
    pool = make_grad_pool(named, grad_sets, seed, device, requires_grad)

    def set_grads(i: int) -> None:
        # Fresh tensors, as after zero_grad(set_to_none=True) + backward; the old one goes first.
        for p, g in zip(params, pool[i % len(pool)], strict=True):
            p.grad = None
            if g is not None:
                p.grad = g.clone()

    set_grads(0)
    gc.collect()
    sync()
    base, base_reserved = allocated(), reserved()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    opt = make_optimizer(VARIANTS[variant], named, device, OURS_SETTINGS.get(variant, {}))
    sync()
    built = allocated()
    t0 = time.perf_counter()
    opt.step()
    sync()
    out["first_step_s"] = time.perf_counter() - t0
    after_first = allocated()
    if variant in OURS_SETTINGS and cuda:
        from deepmd_hybridmuon import kernels

        t0 = time.perf_counter()
        out["kernels_ready"] = bool(kernels.wait_ready(kernel_wait))
        out["kernel_wait_s"] = time.perf_counter() - t0
    first_peak = peak()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(1, steps + 1):
        set_grads(i)
        opt.step()
    sync()
    resident, steady_peak, reserve = allocated(), peak(), reserved()

    def above(x: float | None) -> float | None:
        return None if x is None or base is None else x - base

    out.update(
        ok=True,
        steps=steps,
        base_mib=base,
        constructed_mib=above(built),
        after_first_step_mib=above(after_first),
        resident_mib=above(resident),
        peak_mib=above(None if first_peak is None or steady_peak is None else max(first_peak, steady_peak)),
        first_step_peak_mib=above(first_peak),
        steady_peak_mib=above(steady_peak),
        reserved_mib=None if reserve is None or base_reserved is None else reserve - base_reserved,
        state_mib=_state_mib(opt),
        params_finite=all(bool(torch.isfinite(p).all()) for p in params),
    )
    if hasattr(opt, "routing_table"):
        table = opt.routing_table()
        out["routes"] = {r: sum(row["route"] == r for row in table) for r in ("muon", "adam", "adamw")}
    return out


def child_main(args: argparse.Namespace) -> int:
    """``--child``: measure one variant on one config and write the result to ``--child-out``."""
    (config,) = args.configs
    try:
        result = measure(
            Path(config), args.variant, args.device, args.steps, args.grad_sets, args.seed, args.kernel_wait
        )
    except Exception as err:
        traceback.print_exc()
        result = {"variant": args.variant, "ok": False, "error": first_line(err)}
    write_json(args.child_out, result)
    return 0 if result["ok"] or "unavailable" in result else 1


# ----------------------------------------------------------------------------- the parent


def run_child(config_path: Path, variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """:func:`measure` in a fresh process: its result, or a failed one with the last line of its output.

    Parameters
    ----------
    config_path
        The deepmd input.
    variant
        A key of :data:`VARIANTS`.
    args
        This script's options (device, steps, gradient sets, seed, kernel wait, timeout, verbose).
    tmp
        A directory for the child's result file.
    """
    out = tmp / f"{config_path.stem}_{variant}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--variant", variant, str(config_path)]
    cmd += ["--child-out", str(out), "--device", args.device, "--steps", str(args.steps)]
    cmd += ["--grad-sets", str(args.grad_sets), "--seed", str(args.seed), "--kernel-wait", str(args.kernel_wait)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        rc = -9
        log = "".join(x.decode() if isinstance(x, bytes) else (x or "") for x in (err.stdout, err.stderr))
        log += f"\n(timed out after {args.timeout} s)"
    if args.verbose or rc != 0:
        print(log, file=sys.stderr)
    if out.is_file():
        result = json.loads(out.read_text())
        if rc != 0 and result.get("ok"):
            result.update(ok=False, error=f"exit {rc}: {last_line(log)}")
    else:
        result = {"variant": variant, "ok": False, "error": f"exit {rc}: {last_line(log)}"}
    result["returncode"] = rc
    return result


def train_run(
    config: dict[str, Any], config_path: Path, label: str, variant: str, steps: int, args: argparse.Namespace
) -> dict[str, Any]:
    """One ``timed_dp.py --pt train`` run in ``--workdir/<config>/<label>``: its peak allocated MiB and checks.

    Parameters
    ----------
    config
        The deepmd input as read.
    config_path
        Its path (data paths are made absolute against its folder).
    label
        The run's name (``warmup`` or the variant).
    variant
        A key of :data:`TRAIN_VARIANTS`.
    steps
        ``numb_steps``.
    args
        This script's options.
    """
    kind, opt_kw = TRAIN_VARIANTS[variant]
    cfg = timing_input(
        config,
        config_path,
        kind,
        steps=steps,
        disp_freq=min(args.disp_freq, steps),
        stat_file=args.workdir / f"{config_path.stem}.stat.hdf5",
        opt_kw=opt_kw,
    )
    rundir = args.workdir / config_path.stem / label
    env = prepare_run(rundir, cfg, variant == "builtin")
    env.update(STEP_TIMES_DIR="step_times", RECORD_MEMORY="1", TF_CPP_MIN_LOG_LEVEL="2")
    cuda = args.device.startswith("cuda")
    if variant in OURS_SETTINGS and cuda:
        env["WAIT_FOR_KERNELS"] = str(args.kernel_wait)
    if not cuda:
        env["DEVICE"] = "cpu"  # deepmd's switch to the CPU
    elif ":" in args.device:
        env["CUDA_VISIBLE_DEVICES"] = args.device.split(":", 1)[1]  # deepmd trains on its first visible GPU
    cmd = [sys.executable, str(TIMED_DP), "--pt", "train", "input.json"]
    rc, log, wall_s = run_logged(cmd, rundir, env, args.timeout)
    if args.verbose:
        print(log, file=sys.stderr)
    times_path = rundir / "step_times" / "rank0.json"
    times = json.loads(times_path.read_text()) if times_path.is_file() else {}
    parsed = parse_log(log)
    switch = KERNELS_FROM_STEP_RE.search(log)
    result: dict[str, Any] = {
        "variant": variant,
        "label": label,
        "steps": steps,
        "returncode": rc,
        "wall_s": wall_s,
        "max_memory_allocated_mib": times.get("_max_memory_allocated_mib") if cuda else None,
        "optimizer_steps": {k: len(v["host_ms"]) for k, v in times.items() if not k.startswith("_")},
        "ours_active": parsed["ours_active"],
        "kernels_from_step": int(switch.group(1)) if switch else None,
        "average_s_per_batch": parsed["average_s_per_batch"],
        "optimizer_section": cfg["optimizer"],
        "rundir": shown(rundir),
        "command": shown_command(cmd),
    }
    problems = []
    if rc != 0:
        problems.append(f"exit {rc}: {last_line(log, 200)}")
    if parsed["ours_active"] != (kind == "ours"):
        problems.append("the plugin's log line says the wrong optimizer ran")
    if rc == 0 and cuda and result["max_memory_allocated_mib"] is None:
        problems.append("no _max_memory_allocated_mib in timed_dp's record")
    result["problems"] = problems
    return result


def train_config(config_path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The 1-step warm-up run, then one measured ``dp --pt train`` run per variant of ``--train-variants``."""
    config = json.loads(config_path.read_text())
    plan = [("warmup", "ours", 1)] + [(v, v, args.train_steps) for v in args.train_variant_list]
    runs = []
    for label, variant, steps in plan:
        print(f"[{config_path.stem} train {label}] {utc_now()}", flush=True)
        run = train_run(config, config_path, label, variant, steps, args)
        peak = run["max_memory_allocated_mib"]
        status = "; ".join(run["problems"]) or (f"peak {peak:.1f} MiB" if peak is not None else "ok")
        print(f"[{config_path.stem} train {label}] {status}", flush=True)
        runs.append(run)
    return {"config": shown(config_path), "steps": args.train_steps, "disp_freq": args.disp_freq, "runs": runs}


# ---------------------------------------------------------------------------- report


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _times(a: float | None, b: float | None) -> str:
    return "" if a is None or not b else f"{a / b:.2f}\N{MULTIPLICATION SIGN}"


def _params(model: dict[str, Any] | None) -> str:
    if not model:
        return ""
    return f"{model['numel'] / 1e6:.2f} M, {'/'.join(model['dtypes'])}: {model['params_mib']:.1f} MiB"


def alone_table(configs: dict[str, Any]) -> str:
    """model | params (count, dtype: MiB of one copy) | variant | resident MiB | peak MiB | both over fused AdamW's."""
    lines = [
        "| model | params | variant | resident MiB | peak MiB | resident \N{MULTIPLICATION SIGN} fused AdamW "
        "| peak \N{MULTIPLICATION SIGN} fused AdamW |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for config, entry in configs.items():
        by = {r["variant"]: r for r in entry["results"]}
        adamw = by.get("adamw") if by.get("adamw", {}).get("ok") else None
        for r in entry["results"]:
            late = " (Triton kernels not ready)" if r.get("kernels_ready") is False else ""
            head = f"| {config} | {_params(entry.get('model'))} | {r['variant']}{late} |"
            if not r.get("ok"):
                why = r.get("unavailable") or f"failed: {r.get('error', '')}"
                lines.append(f"{head} {why.replace('|', '/')} | | | |")
                continue
            res, pk = r["resident_mib"], r["peak_mib"]
            lines.append(
                f"{head} {_mib(res)} | {_mib(pk)} | {_times(res, adamw and adamw['resident_mib'])} "
                f"| {_times(pk, adamw and adamw['peak_mib'])} |"
            )
    return "\n".join(lines)


def train_table(train: dict[str, Any]) -> str:
    """model | variant | steps | peak MiB of the whole process | as a multiple of AdamW's | problems."""
    lines = [
        "| model | variant | steps | dp train peak MiB | \N{MULTIPLICATION SIGN} AdamW | notes |",
        "|---|---|---:|---:|---:|---|",
    ]
    for config, entry in train.items():
        runs = [r for r in entry["runs"] if r["label"] != "warmup"]
        ok = [r["max_memory_allocated_mib"] for r in runs if r["variant"] == "adamw" and not r["problems"]]
        adamw = ok[0] if ok else None
        for r in runs:
            peak = r["max_memory_allocated_mib"]
            notes = "; ".join(r["problems"]).replace("|", "/") or "ok"
            if r["kernels_from_step"] is not None:
                notes += f", Triton kernels from step {r['kernels_from_step']}"
            lines.append(
                f"| {config} | {r['variant']} | {r['steps']} | {_mib(peak)} | {_times(peak, adamw)} | {notes} |"
            )
    return "\n".join(lines)


# ------------------------------------------------------------------------------ provenance


def git_commit() -> str:
    """The checkout's short commit (``with uncommitted changes`` where tracked files differ), or why none."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30
        )
        if head.returncode != 0:
            return "not recorded (no git checkout)"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not recorded (no git)"
    return head.stdout.strip() + (" with uncommitted changes" if dirty else "")


def gpu_tag(device_name: str | None, device: str) -> str:
    """``h100``, ``a100``, ... from a device name; ``cpu`` off CUDA."""
    if not device.startswith("cuda"):
        return "cpu"
    match = re.search(r"\b([A-Z]{1,2}\d{2,4})\b", device_name or "")
    return match.group(1).lower() if match else re.sub(r"\W+", "-", (device_name or "gpu").lower()).strip("-")


def default_json(tag: str) -> Path:
    """``benchmarks/results/memory_<tag>_<date>.json``, with ``_2``, ``_3``, ... where that exists."""
    stem = f"memory_{tag}_{_dt.datetime.now(_dt.timezone.utc):%Y-%m-%d}"
    path = REPO_ROOT / "benchmarks" / "results" / f"{stem}.json"
    k = 2
    while path.exists():
        path, k = path.with_name(f"{stem}_{k}.json"), k + 1
    return path


# ------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """This script's options; configs by name or path, ``--variants`` and ``--train-variants`` as lists."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("configs", nargs="*", metavar="CONFIG", help=f"config names or paths (default: {DEFAULT_CONFIGS})")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a functional check: no memory)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=20, help="steps after the first step (default 20)")
    ap.add_argument("--grad-sets", type=int, default=2, help="random gradient sets cycled through (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernel-wait", type=float, default=600, help="s ours waits at most for its Triton kernels")
    ap.add_argument("--train", action="store_true", help="also the peak of whole dp --pt train runs")
    ap.add_argument(
        "--train-variants",
        default=",".join(DEFAULT_TRAIN_VARIANTS),
        help="comma list of: " + ",".join(TRAIN_VARIANTS) + " (default: ours,adamw,builtin)",
    )
    ap.add_argument("--train-steps", type=int, default=30, help="numb_steps of each dp run (default 30)")
    ap.add_argument("--disp-freq", type=int, default=10, help="disp_freq of each dp run (default 10)")
    ap.add_argument("--workdir", type=Path, help="where the dp runs go (default: a new temporary directory)")
    ap.add_argument("--timeout", type=float, default=1800, help="s a child process or dp run may take")
    ap.add_argument("--commit", help="the commit to record (default: git's, where the checkout has .git)")
    ap.add_argument("--json", type=Path, help="results file (default: benchmarks/results/memory_<gpu>_<date>.json)")
    ap.add_argument("--verbose", action="store_true", help="echo the output of the child processes")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if len(args.configs) != 1 or args.variant not in VARIANTS or args.child_out is None:
            ap.error("--child takes one config, --variant and --child-out")
        return args
    if args.steps < 1 or args.grad_sets < 1 or args.train_steps < 1 or args.disp_freq < 1:
        ap.error("--steps, --grad-sets, --train-steps and --disp-freq must be >= 1")
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in args.variant_list if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    args.train_variant_list = [v.strip() for v in args.train_variants.split(",") if v.strip()]
    if bad := [v for v in args.train_variant_list if v not in TRAIN_VARIANTS]:
        ap.error(f"unknown train variants {bad}; choose from {','.join(TRAIN_VARIANTS)}")
    args.config_paths = [resolve_config(c, args.config_dir) for c in args.configs or DEFAULT_CONFIGS]
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure every config and variant, print the tables, write the results file."""
    args = parse_args(argv)
    if args.child:
        return child_main(args)
    command = command_line(None if argv is None else [sys.executable, __file__, *argv])
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "machine": None,
        "date": utc_now(seconds=False),
        "commit": args.commit or git_commit(),
        "command": command,
        "environment": None,
        "args": {
            "configs": [shown(p) for p in args.config_paths],
            "device": args.device,
            "variants": args.variant_list,
            "steps": args.steps,
            "grad_sets": args.grad_sets,
            "seed": args.seed,
            "kernel_wait_s": args.kernel_wait,
        },
        "optimizer_alone": {},
    }
    print(f"# Optimizer memory ({args.device})\n\n- date: {report['date']}\n- commit: {report['commit']}")
    print(f"- command: `{command}`\n- first step, then {args.steps} steps; {args.grad_sets} gradient sets", flush=True)
    with tempfile.TemporaryDirectory(prefix="memory_") as tmp:
        for path in args.config_paths:
            entry: dict[str, Any] = {"config": shown(path), "model": None, "results": []}
            report["optimizer_alone"][path.stem] = entry
            for variant in args.variant_list:
                result = run_child(path, variant, args, Path(tmp))
                env = result.pop("environment", None)
                machine = result.pop("machine", None)
                if env and report["environment"] is None:
                    report["environment"] = {**env, "command": command}
                    report["machine"] = machine
                model = result.pop("model", None)
                entry["model"] = entry["model"] or model
                entry["results"].append(result)
                if args.json:  # as it goes: a run stopped early keeps what it measured
                    write_json(args.json, report)
                status = (
                    f"resident {_mib(result['resident_mib'])} MiB, peak {_mib(result['peak_mib'])} MiB"
                    if result.get("ok")
                    else result.get("unavailable") or f"FAILED ({result.get('error')})"
                )
                print(f"  {path.stem} {variant}: {status}", flush=True)
    if report["machine"] is None:
        report["machine"] = f"not recorded (no variant ran; --device {args.device})"
    print()
    print(alone_table(report["optimizer_alone"]))
    if args.train:
        args.workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="memory_train_"))).resolve()
        args.workdir.mkdir(parents=True, exist_ok=True)
        report["args"].update(
            train_variants=args.train_variant_list,
            train_steps=args.train_steps,
            disp_freq=args.disp_freq,
            workdir=shown(args.workdir),
        )
        print(f"\n## dp --pt train, {args.train_steps} steps (workdir {args.workdir})\n", flush=True)
        report["train"] = {p.stem: train_config(p, args) for p in args.config_paths}
        print()
        print(train_table(report["train"]))
    text = alone_table(report["optimizer_alone"])
    if args.train:
        text += "\n\n" + train_table(report["train"])
    report["report"] = text
    env = report["environment"] or {}
    out = args.json or default_json(gpu_tag(env.get("device_name"), args.device))
    write_json(out, report)
    print(f"\nwrote {shown(out)}")
    failed = [r for e in report["optimizer_alone"].values() for r in e["results"] if not r.get("ok")]
    failed = [r for r in failed if "unavailable" not in r]
    failed += [r for e in report.get("train", {}).values() for r in e["runs"] if r["problems"]]
    return 1 if failed else 0


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
