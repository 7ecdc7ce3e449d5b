#!/usr/bin/env python
"""The scaling figure of BENCHMARKS.md: frames per second against GPUs, from ``benchmarks_doc.SCALING``'s files.

One panel per GPU model, in it one line per optimizer and ``zero_stage`` (the mean of a point's rounds), and each
optimizer's ideal (N times its one-GPU rate) dashed where the set has a one-GPU run. Needs matplotlib::

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
    models = list(dict.fromkeys(r["model"] for r in rows))  # one panel per GPU model: timings compare within one
    fig, axes = plt.subplots(1, len(models), figsize=(6.4 * len(models), 4.4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        gpus = sorted({r["gpus"] for r in mine})
        for v in doc.SCALING_VARIANTS:
            single = [r["rate"][v] for r in mine if r["gpus"] == 1 and r["rate"][v]]
            base = statistics.mean(single) if single else None
            if base:
                ax.plot(gpus, [n * base for n in gpus], ls="--", lw=0.8, color=COLOURS[v])
            for stage in sorted({r["stage"] for r in mine if r["gpus"] > 1}):
                points = [(1, base)] if base else []
                for n in gpus:
                    got = [r["rate"][v] for r in mine if r["gpus"] == n > 1 and r["stage"] == stage and r["rate"][v]]
                    if got:
                        points.append((n, statistics.mean(got)))
                if len(points) > 1 or (points and not base):
                    xs, ys = zip(*points, strict=True)
                    ax.plot(xs, ys, marker=MARKERS[stage], color=COLOURS[v], label=f"{NAMES[v]}, {doc.STAGE[stage]}")
        ax.set_xticks(gpus)
        ax.set_xlabel(f"{model} GPUs (one host)")
        ax.set_ylabel("frames per second (batch size 1 per GPU)")
        ax.set_title(f"DPA-3 water on {model}" + (" (dashed: N x the 1-GPU rate)" if 1 in gpus else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
