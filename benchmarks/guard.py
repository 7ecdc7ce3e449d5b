#!/usr/bin/env python
"""Is HEAD slower, larger or less faithful than a base commit? One table of HEAD/base ratios, a verdict per row.

The working tree's ``deepmd_hybridmuon`` (HEAD) and the same package at ``--base`` (extracted with ``git archive``
into ``.guard/<ref>/``, which the device machine receives with ``carry``) run in alternation, ``--rounds`` times,
each in its own process that imports that version first on ``PYTHONPATH`` from a folder holding no source tree.

On a CUDA GPU each round measures, per version:

* ``step``: the optimizer step of the water models and a DPA-3 of 9.5 M parameters, with fresh gradient tensors
  before every step (as after ``backward()``), after the Triton kernels are ready: CUDA events around ``step()``,
  median of ``--steps`` steps; fused AdamW in the same process;
* ``memory``: the optimizer's memory alone (allocated after the steps, and the peak during them, less the
  parameters' and gradients'), against fused AdamW's;
* ``dp``: ``dp --pt train`` of DPA-3 water: the first optimizer step's host time with an empty Triton cache (cold),
  then with the filled one (warm), the warm run's peak allocated memory and deepmd's s/batch.

Without a GPU it measures the CPU step of se_e2_a and DPA-3 water at one thread for HEAD, base and deepmd-kit's
built-in, and the parity rows: the accumulated update after 6 steps against the built-in's (DPA-2 small).

A row is a regression when HEAD is worse than 1.1x beyond the spread of the rounds: the best HEAD round is more
than 1.1x the worst base round. Usage (``benchmarks/baseline`` names the commit BENCHMARKS.md's figures are of)::

    python benchmarks/guard.py --base $(cat benchmarks/baseline) --out benchmarks/results/guard/NAME
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WATER = ROOT / "examples" / "water"
MODELS = ("se_e2_a_water", "dpa2_small_water", "dpa3_water", "dpa4_water", "dpa3_large")
CPU_MODELS = ("se_e2_a_water", "dpa3_water")
#: DPA-3 water made larger (9.5 M parameters, 134 tensors): the step's cost at a size closer to production models.
LARGE = {"n_dim": 384, "e_dim": 128, "a_dim": 64, "nlayers": 6}
LIMIT = 1.1  # the verdict's ratio


# ------------------------------------------------------------------------------------------------ the children


def model_path(name: str, workdir: Path) -> Path:
    """The input of ``name``: a water config, or DPA-3 large written into ``workdir``."""
    if name != "dpa3_large":
        return WATER / f"{name}.json"
    cfg = json.loads((WATER / "dpa3_water.json").read_text())
    cfg["model"]["descriptor"]["repflow"].update(LARGE)
    cfg["model"]["fitting_net"]["neuron"] = [512, 512, 512]
    path = workdir / "dpa3_large.json"
    path.write_text(json.dumps(cfg))
    return path


def make_optimizer(kind: str, named: list[tuple[str, Any]]) -> Any:
    """``ours`` (the version on ``sys.path``), ``builtin`` (deepmd-kit's) or ``adamw`` (fused where CUDA)."""
    import torch

    params = [p for _, p in named]
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, fused=params[0].is_cuda)
    if kind == "ours":
        from deepmd_hybridmuon import HybridMuonOptimizer
    else:
        from deepmd.pt.optimizer.hybrid_muon import HybridMuonOptimizer
    opt = HybridMuonOptimizer(params, lr=1e-3)
    opt.set_param_names(named)  # as deepmd's trainer names them
    return opt


def time_steps(kind: str, master: list[tuple[str, Any]], steps: int, warmup: int) -> dict[str, float]:
    """Median step time (ms) of ``kind`` on a copy of ``master``, and on CUDA its memory alone (MiB)."""
    import torch

    device = master[0][1].device
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(0)
    pool = [[(torch.randn(p.shape, generator=gen) * 1e-2).to(device, p.dtype) for _, p in master] for _ in range(2)]
    named = [(n, torch.nn.Parameter(p.clone())) for n, p in master]
    for (_, p), g in zip(named, pool[0], strict=True):
        p.grad = g.clone()
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    opt = make_optimizer(kind, named)
    times = []
    for i in range(warmup + steps):
        for (_, p), g in zip(named, pool[i % 2], strict=True):
            p.grad = g.clone()  # a fresh tensor, as after zero_grad(set_to_none=True) and backward
        if i == 0 and kind == "ours" and cuda:
            opt.step()
            from deepmd_hybridmuon import kernels

            kernels.wait_ready(600)  # the steady state: with the Triton kernels
            continue
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            elapsed = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            opt.step()
            elapsed = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(elapsed)
    out = {"step_ms": statistics.median(times)}
    if cuda:  # the gradients are the same size before and after: what is left is the optimizer's
        torch.cuda.synchronize()
        out["resident_mib"] = (torch.cuda.memory_allocated() - base) / 2**20
        out["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    return out


def child_step(models: list[str], kinds: list[str], steps: int, threads: int) -> dict[str, Any]:
    """Step times (and memory on CUDA) of ``kinds`` on each of ``models``."""
    import torch

    sys.path.insert(0, str(HERE))
    from common import build_named_params

    cuda = torch.cuda.is_available()
    if not cuda:
        torch.set_num_threads(threads)
    device = torch.device("cuda" if cuda else "cpu")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in models:
            named, requires_grad = build_named_params(model_path(model, Path(tmp)), device)
            master = [(n, p) for (n, p), rg in zip(named, requires_grad, strict=True) if rg]
            for kind in kinds:
                out[f"{model}/{kind}"] = time_steps(kind, master, steps, warmup=5 if cuda else 2)
                torch.cuda.empty_cache() if cuda else None
    return out


def child_parity(steps: int = 6) -> dict[str, Any]:
    """Largest relative distance between ours' and the built-in's accumulated update after ``steps`` steps.

    DPA-2 small's parameters, float32, random gradients; per parameter ``|dθ_ours - dθ_builtin| / |dθ_builtin|``,
    for the defaults and for ``enable_gram`` off.
    """
    import torch

    sys.path.insert(0, str(HERE))
    from common import build_named_params

    torch.set_num_threads(1)
    named, requires_grad = build_named_params(WATER / "dpa2_small_water.json", torch.device("cpu"))
    named = [(n, p) for (n, p), rg in zip(named, requires_grad, strict=True) if rg]
    gen = torch.Generator().manual_seed(1)
    grads = [[(torch.randn(p.shape, generator=gen) * 1e-2).to(p.dtype) for _, p in named] for _ in range(steps)]
    out = {}
    for label, kw in (("defaults", {}), ("no gram", {"enable_gram": False})):
        moved = {}
        for kind in ("ours", "builtin"):
            params = [(n, torch.nn.Parameter(p.clone())) for n, p in named]
            opt = make_optimizer(kind, params)
            for group in opt.param_groups:
                group.update(kw)
            for step in grads:
                for (_, p), g in zip(params, step, strict=True):
                    p.grad = g.clone()
                opt.step()
            moved[kind] = [p.detach() - p0 for (_, p), (_, p0) in zip(params, named, strict=True)]
        dist = [
            float((a - b).norm() / b.norm().clamp(min=1e-30))
            for a, b in zip(moved["ours"], moved["builtin"], strict=True)
        ]
        out[f"parity {label}"] = {"distance_pct": 100 * max(dist)}
    return out


def child_dp(steps: int, workdir: Path) -> dict[str, Any]:
    """``dp --pt train`` of DPA-3 water, cold then warm Triton cache: first-step host ms, peak MiB, s/batch."""
    sys.path.insert(0, str(HERE))
    from common import TIMED_DP, parse_log, prepare_run, timing_input

    cfg_path = WATER / "dpa3_water.json"
    config = json.loads(cfg_path.read_text())
    out: dict[str, Any] = {}
    for label, n in (("cold", 20), ("warm", steps)):
        rundir = workdir / label
        cfg = timing_input(config, cfg_path, "ours", steps=n, disp_freq=max(n // 10, 1), stat_file=workdir / "stat.h5",
                           opt_kw={})  # fmt: skip
        env = prepare_run(rundir, cfg, builtin=False)
        env.update(TRITON_CACHE_DIR=str(workdir / "triton"), STEP_TIMES_DIR=str(rundir), RECORD_MEMORY="1")
        cmd = [sys.executable, str(TIMED_DP), "--pt", "train", "input.json"]
        proc = subprocess.run(cmd, cwd=rundir, env=env, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode:
            raise RuntimeError(f"dp --pt train ({label}) failed: {(proc.stdout + proc.stderr)[-2000:]}")
        times = json.loads((rundir / "rank0.json").read_text())
        out[f"dp first step {label}"] = {"host_ms": times["HybridMuonOptimizer"]["host_ms"][0]}
        if label == "warm":
            out["dp peak"] = {"peak_mib": times["_max_memory_allocated_mib"]}
            out["dp DPA-3 water"] = {"s_per_batch": parse_log(proc.stdout + proc.stderr)["average_s_per_batch"]}
    return out


# ------------------------------------------------------------------------------------------------ the parent


def prepare_base(ref: str) -> Path:
    """The package at ``ref``, extracted into ``.guard/<ref>`` (kept: the device machine has no git history)."""
    dest = ROOT / ".guard" / ref
    if not (dest / "deepmd_hybridmuon").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", ref, "deepmd_hybridmuon"], cwd=ROOT, capture_output=True,
                                 check=True).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def run_child(version: Path, args: list[str], env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run this script as a child with ``version`` first on ``PYTHONPATH``, in an empty folder; its JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(version), os.environ.get("PYTHONPATH", "")])}
        env.update(env_extra or {})
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", *args, "--workdir", tmp]
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode:
            raise RuntimeError(f"child {args} of {version} failed:\n{proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])


def rows_of(result: dict[str, Any]) -> dict[str, float]:
    """Flatten a child's JSON into ``{"row metric": value}`` (every metric lower-is-better), with ours' ratio to
    AdamW's or the built-in's step in the same process (``model/ours÷adamw step_ms``)."""
    rows = {f"{key} {metric}": value for key, metrics in result.items() for metric, value in metrics.items()}
    for key, metrics in result.items():
        model, _, kind = key.partition("/")
        if kind in ("adamw", "builtin") and f"{model}/ours" in result:
            ours = result[f"{model}/ours"]
            for metric, value in metrics.items():
                rows[f"{model}/ours÷{kind} {metric}"] = ours[metric] / value if value else float("nan")
    return rows


def verdict(head: list[float], base: list[float]) -> str:
    """``regression`` when the best HEAD round is over :data:`LIMIT` x the worst base round; else a plain word."""
    if min(head) > LIMIT * max(base):
        return "**regression**"
    if max(head) * LIMIT < min(base):
        return "better"
    return "same"


def table(results: dict[str, dict[str, list[float]]]) -> str:
    """Markdown: row | HEAD rounds | base rounds | median ratio | verdict."""
    lines = ["| row | HEAD | base | HEAD / base | verdict |", "|---|---|---|---:|---|"]
    for row, by in results.items():
        head, base = by.get("HEAD", []), by.get("base", [])
        if not head or not base:
            shown = ", ".join(f"{v:.4g}" for v in head or base)
            lines.append(f"| {row} | {shown if head else ''} | {shown if base else ''} | | one version only |")
            continue
        ratio = statistics.median(head) / statistics.median(base) if statistics.median(base) else float("nan")
        fmt = ", ".join
        lines.append(
            f"| {row} | {fmt(f'{v:.4g}' for v in head)} | {fmt(f'{v:.4g}' for v in base)} | {ratio:.2f} "
            f"| {verdict(head, base)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="the commit to compare HEAD with (default: benchmarks/baseline)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per model")
    parser.add_argument("--dp-steps", type=int, default=200, help="steps of the warm dp --pt train run")
    parser.add_argument("--only", default="step,dp", help="GPU parts: step (and memory), dp")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--parallel", action="store_true", help="a round's jobs side by side, one GPU each")
    parser.add_argument("--out", type=Path, help="a JSON file: every round of every row, machine, date, commits")
    parser.add_argument("--commit", help="HEAD's commit, where git does not know it (the device machine)")
    parser.add_argument("--child", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        what, *rest = args.child
        if what == "step":
            result = child_step(rest[0].split(","), rest[1].split(","), args.steps, threads=1)
        elif what == "parity":
            result = child_parity()
        else:
            result = child_dp(args.dp_steps, args.workdir)
        print(json.dumps(result))
        return 0

    import torch

    ref = args.base or (HERE / "baseline").read_text().split()[0]
    versions = {"HEAD": ROOT, "base": prepare_base(ref)}
    cuda = torch.cuda.is_available()
    results: dict[str, dict[str, list[float]]] = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    gpus = torch.cuda.device_count() if cuda else 0
    for rnd in range(args.rounds):
        order = list(versions) if rnd % 2 == 0 else list(reversed(versions))
        jobs: list[tuple[str, list[str]]] = []
        for label in order:
            if cuda:
                jobs += [(label, ["step", args.models, "ours,adamw"])] if "step" in args.only else []
                jobs += [(label, ["dp"])] if "dp" in args.only else []
            else:
                kinds = "ours,builtin" if label == "HEAD" else "ours"
                jobs += [(label, ["step", ",".join(CPU_MODELS), kinds]), (label, ["parity"])]
        # With a GPU per job (--parallel), a round's jobs run side by side, the GPUs swapped from round to round.
        side_by_side = args.parallel and gpus >= len(jobs)
        env = [{"CUDA_VISIBLE_DEVICES": str((k + rnd) % gpus)} if side_by_side else {} for k in range(len(jobs))]
        with ThreadPoolExecutor(len(jobs) if side_by_side else 1) as pool:
            t0 = time.perf_counter()
            outputs = list(pool.map(lambda j: run_child(versions[j[0][0]], j[0][1], j[1]), zip(jobs, env, strict=True)))
        print(f"round {rnd + 1}: {time.perf_counter() - t0:.0f} s", flush=True)
        for (label, _), result in zip(jobs, outputs, strict=True):
            for row, value in rows_of(result).items():
                # AdamW and the built-in run beside either version: shown as HEAD's and base's rounds alike
                results.setdefault(row, {}).setdefault(label, []).append(value)
    side = f", {len(jobs)} jobs side by side, one GPU each" if cuda and args.parallel and gpus >= len(jobs) else ""
    machine = f"{gpus} x {torch.cuda.get_device_name()}{side}" if cuda else f"CPU, {os.cpu_count()} cores, 1 thread"
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    head = args.commit or git.strip() or "not recorded"  # the device machine's copy has the session's first commit
    print(f"HEAD {head} against {ref}, {machine}, {started}, {args.rounds} rounds\n\n{table(results)}")
    if args.out:
        # the command as run from the repository (a path outside it, such as the device's $OUT, by its name)
        shown = [a if not a.startswith("/") or a.startswith(str(ROOT)) else Path(a).name for a in sys.argv[1:]]
        command = " ".join(["python benchmarks/guard.py", *(a.replace(f"{ROOT}/", "") for a in shown)])
        about = {"machine": machine, "date": started, "commit": head, "base": ref, "rounds": args.rounds}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({**about, "command": command, "rows": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
