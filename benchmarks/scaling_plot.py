#!/usr/bin/env python
"""The scaling figure of BENCHMARKS.md: frames per second against GPUs, from ``benchmarks_doc.SCALING``'s files.

One line per optimizer and ``zero_stage`` (the mean of a point's rounds), and each optimizer's ideal (N times its
one-GPU rate) dashed. Needs matplotlib::

    python benchmarks/scaling_plot.py            # writes benchmarks/results/scaling_dpa3_water.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmarks_doc as doc

NAMES = {"ours": "ours", "adamw": "AdamW", "builtin": "built-in"}
COLOURS = {"ours": "tab:blue", "adamw": "tab:orange", "builtin": "tab:green"}
MARKERS = {0: "o", 1: "s", 2: "^", 3: "v"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=doc.RESULTS / "scaling_dpa3_water.png")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc.scaling_rows()
    gpus = sorted({r["gpus"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for v in doc.SCALING_VARIANTS:
        single = [r["rate"][v] for r in rows if r["gpus"] == 1 and r["rate"][v]]
        if not single:
            continue
        base = statistics.mean(single)
        ax.plot(gpus, [n * base for n in gpus], ls="--", lw=0.8, color=COLOURS[v])
        for stage in sorted({r["stage"] for r in rows if r["gpus"] > 1}):
            points = [(1, base)]
            for n in gpus[1:]:
                got = [r["rate"][v] for r in rows if r["gpus"] == n and r["stage"] == stage and r["rate"][v]]
                if got:
                    points.append((n, statistics.mean(got)))
            if len(points) > 1:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker=MARKERS[stage], color=COLOURS[v], label=f"{NAMES[v]}, {doc.STAGE[stage]}")
    ax.set_xticks(gpus)
    ax.set_xlabel("GPUs (one host)")
    ax.set_ylabel("frames per second (batch size 1 per GPU)")
    ax.set_title("DPA-3 water, dp --pt train (dashed: N x the 1-GPU rate)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
