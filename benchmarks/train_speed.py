#!/usr/bin/env python
"""Training speed of ``dp --pt train`` with deepmd-hybridmuon, the built-in HybridMuon, or AdamW.

For each optimizer variant this writes a modified copy of a deepmd input file (``numb_steps``,
``disp_freq``, the ``optimizer`` section, data paths made absolute, the data statistics file
shared between the variants, no intermediate checkpoints), runs ``dp --pt train`` on it in
its own directory and reports what deepmd reports: the ``average training time: X s/batch``
line at the end of the run (deepmd leaves out the first ``disp_freq`` batches when the run
has more than ``2 * disp_freq`` of them) and the ``Batch N: total wall time = T s`` lines.

Variants:

* ``ours``: ``"optimizer": {"type": "HybridMuon", ...}`` with this package's plugin active
  (checked: its log line "optimizer: deepmd-hybridmuon ..." must appear);
* ``builtin``: the same section with ``DEEPMD_HYBRIDMUON_DISABLE=1``, i.e. deepmd-kit's own
  HybridMuon (checked: the plugin's log line must not appear);
* ``adamw``: ``{"type": "AdamW"}`` (the config's own section if it is AdamW).

Usage::

    python benchmarks/train_speed.py se_e2_a_water                      # ours,builtin,adamw; 300 steps
    python benchmarks/train_speed.py examples/water/dpa3_water.json --variants ours,builtin
    python benchmarks/train_speed.py dpa2_small_water --steps 500 --disp-freq 100 --opt-kw enable_gram=False
    python benchmarks/train_speed.py se_e2_a_water --steps 6 --disp-freq 2 --json out.json   # smoke test
    python benchmarks/train_speed.py dpa4_water    # DPA-4: needs vesin + vesin-torch (this package depends on them)
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    AVERAGE_RE,
    BATCH_RE,
    DEFAULT_CONFIG_DIR,
    OURS_LOG_MARK,
    command_line,
    find_dp,
    parse_kw,
    parse_log,
    prepare_run,
    resolve_config,
    shown,
    timing_input,
    utc_now,
    write_json,
)

VARIANTS = ("ours", "builtin", "adamw")


# ------------------------------------------------------------------------------- run


def run_variant(
    variant: str,
    config: dict[str, Any],
    config_path: Path,
    workdir: Path,
    dp: list[str],
    args: argparse.Namespace,
    opt_kw: dict[str, Any],
) -> dict[str, Any]:
    rundir = workdir / variant
    stat_file = workdir / f"{config_path.stem}.stat.hdf5"
    cfg = timing_input(
        config,
        config_path,
        variant,
        steps=args.steps,
        disp_freq=args.disp_freq,
        stat_file=stat_file,
        opt_kw=opt_kw,
    )
    env = prepare_run(rundir, cfg, variant == "builtin")
    cmd = [*dp, "--pt", "train", "input.json"]
    log_path = rundir / "train.log"
    print(f"[{variant}] {'DEEPMD_HYBRIDMUON_DISABLE=1 ' if variant == 'builtin' else ''}{shlex.join(cmd)}", flush=True)
    print(f"[{variant}]   in {rundir}", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd, cwd=rundir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            if BATCH_RE.search(line) or AVERAGE_RE.search(line) or OURS_LOG_MARK in line:
                print(f"[{variant}]   {line.rstrip()}", flush=True)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    text = log_path.read_text()
    result: dict[str, Any] = {"variant": variant, "returncode": rc, "process_wall_s": wall, "rundir": shown(rundir)}
    result.update(parse_log(text))
    result["optimizer_section"] = cfg["optimizer"]
    problems = []
    if rc != 0:
        tail = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [""]
        problems.append(f"dp exited with {rc}: {tail[0].strip()[:200]}")
    if variant == "ours" and not result["ours_active"]:
        problems.append("the plugin's log line is missing: ours was not used?")
    if variant != "ours" and result["ours_active"]:
        problems.append("the plugin's log line is present: the plugin was not disabled?")
    if rc == 0 and result["average_s_per_batch"] is None:
        problems.append("no 'average training time' line in the log")
    result["problems"] = problems
    return result


# ---------------------------------------------------------------------------- report


def summary_table(results: list[dict[str, Any]]) -> str:
    by = {r["variant"]: r for r in results}

    def avg(name: str) -> float | None:
        r = by.get(name)
        return r["average_s_per_batch"] if r and not r["problems"] else None

    lines = [
        "| variant | average (s/batch) | dp wall (s) | / AdamW | built-in / ours | notes |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in results:
        a = r["average_s_per_batch"]
        vs_adamw = a / avg("adamw") if a and avg("adamw") else None
        vs_ours = avg("builtin") / a if r["variant"] == "ours" and a and avg("builtin") else None
        cells = [
            r["variant"],
            "" if a is None else f"{a:.4f}",
            f"{r['process_wall_s']:.1f}",
            "" if vs_adamw is None else f"{vs_adamw:.2f}",
            "" if vs_ours is None else f"{vs_ours:.2f}",
            "; ".join(r["problems"]).replace("|", "/") or "ok",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("config", help="path of a deepmd input, or a name in --config-dir (e.g. se_e2_a_water)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=300, help="numb_steps (default 300)")
    ap.add_argument("--disp-freq", type=int, default=100, help="disp_freq (default 100)")
    ap.add_argument("--config-dir", type=Path, default=DEFAULT_CONFIG_DIR)
    ap.add_argument("--workdir", type=Path, help="where the runs go (default: a new temporary directory)")
    ap.add_argument(
        "--opt-kw",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra key of the HybridMuon section (ours, builtin; repeatable; true/false/numbers/strings)",
    )
    ap.add_argument("--dp", default=None, help="dp command (default: dp next to this Python, else on PATH)")
    ap.add_argument("--json", type=Path, help="write all numbers to this file")
    args = ap.parse_args(argv)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if bad := [v for v in variants if v not in VARIANTS]:
        ap.error(f"unknown variants {bad}; choose from {','.join(VARIANTS)}")
    if args.steps < 1 or args.disp_freq < 1:
        ap.error("--steps and --disp-freq must be >= 1")
    opt_kw = parse_kw(args.opt_kw)
    config_path = resolve_config(args.config, args.config_dir)
    with open(config_path) as f:
        config = json.load(f)
    dp = find_dp(args.dp)
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix=f"train_speed_{config_path.stem}_"))).resolve()
    workdir.mkdir(parents=True, exist_ok=True)

    date = utc_now()
    command = command_line(argv)
    print(f"# dp --pt train speed: {config_path.name}, {args.steps} steps, disp_freq {args.disp_freq}")
    print(f"- date: {date}\n- command: `{command}`\n- workdir: {workdir}")
    if opt_kw:
        print(f"- extra HybridMuon keys: {opt_kw}")
    print(flush=True)

    results = []
    for variant in variants:
        results.append(run_variant(variant, config, config_path, workdir, dp, args, opt_kw))
    print()
    print(summary_table(results))
    avg_line = ", ".join(
        f"{r['variant']} {r['average_s_per_batch']:.4f}" for r in results if r["average_s_per_batch"] is not None
    )
    print(f"\naverage s/batch (deepmd): {avg_line or 'none'}")
    if args.json:
        report = {
            "config": shown(config_path),
            "steps": args.steps,
            "disp_freq": args.disp_freq,
            "date_utc": date,
            "command": command,
            "workdir": shown(workdir),
            "opt_kw": {k: repr(v) for k, v in opt_kw.items()},
            "results": results,
        }
        write_json(args.json, report)
        print(f"wrote {args.json}")
    return 0 if all(not r["problems"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
