"""``train_quality.py report``: markdown tables and learning-curve plots of train_quality results files."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ERROR_COLUMNS, load_results


def _mean_sd(values: list[float], scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    vals = [v * scale for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return ""
    m = statistics.fmean(vals)
    if len(vals) == 1:
        return fmt.format(m)
    return f"{fmt.format(m)} ± {fmt.format(statistics.stdev(vals))}"


def _complete(r: dict[str, Any]) -> bool:
    """Whether the run's lcurve reaches its last step (a crashed or timed-out run's may stop early)."""
    lc = r.get("lcurve") or {}
    return bool(lc.get("step")) and lc["step"][-1] >= r["steps"]


def _at_fraction(lc: dict[str, list[float]], col: str, steps: int, frac: float) -> float | None:
    """The lcurve value at the point nearest to ``frac * steps`` (None if the lcurve stops before)."""
    if not lc or col not in lc or not lc["step"] or lc["step"][-1] < frac * steps:
        return None
    target = frac * steps
    i = min(range(len(lc["step"])), key=lambda j: (abs(lc["step"][j] - target), -lc["step"][j]))
    return lc[col][i]


def _final(lc: dict[str, list[float]] | None, col: str) -> float | None:
    if not lc or col not in lc or not lc[col]:
        return None
    return lc[col][-1]


def _by_label(runs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    labels: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        labels.setdefault(r["label"], []).append(r)
    return {k: sorted(v, key=lambda r: r["seed"]) for k, v in labels.items()}


def config_columns(runs: list[dict[str, Any]]) -> tuple[str, str, str] | None:
    """(force, energy, ``RMSE``/``MAE``) validation columns of a config's lcurves: RMSE where any run has them."""
    for force, energy, kind in ERROR_COLUMNS:
        if any(force in (r.get("lcurve") or {}) for r in runs):
            return force, energy, kind
    return None


def adamw_target(runs: list[dict[str, Any]], force: str) -> tuple[str, float, int] | None:
    """(label, mean final validation force error, runs) of the best Adam(W) label with complete lcurves."""
    best = None
    for label, rs in _by_label(runs).items():
        if rs[0]["optimizer"] != "adam":
            continue
        finals = [_final(r["lcurve"], force) for r in rs if _complete(r)]
        finals = [v for v in finals if v is not None and math.isfinite(v)]
        if finals and (best is None or statistics.fmean(finals) < best[1]):
            best = (label, statistics.fmean(finals), len(finals))
    return best


def steps_to(lc: dict[str, list[float]] | None, col: str, target: float) -> int | None:
    """The first lcurve step whose ``col`` is at or below ``target``, or None."""
    if not lc or col not in lc:
        return None
    return next((s for s, v in zip(lc["step"], lc[col], strict=True) if v <= target), None)


def _reach_cell(rs: list[dict[str, Any]], force: str, target: float) -> str:
    """Mean steps (and training seconds, steps x s/batch) to ``target`` over the runs with an lcurve."""
    tried = [r for r in rs if force in (r.get("lcurve") or {})]
    if not tried:
        return ""
    hits = [(steps_to(r["lcurve"], force, target), r.get("s_per_batch")) for r in tried]
    hits = [(n, spb) for n, spb in hits if n is not None]
    count = "" if len(hits) == len(tried) else f" (reached in {len(hits)} of {len(tried)} runs)"
    if not hits:
        return f"not reached{count}"
    steps = statistics.fmean(n for n, _ in hits)
    secs = [n * spb for n, spb in hits if spb]
    time = f" ({statistics.fmean(secs):.0f} s)" if secs else ""
    return f"{steps:.0f}{time}{count}"


def _short(problem: str, width: int = 140) -> str:
    return problem if len(problem) <= width else problem[: width - 1] + "…"


def collect(paths: list[Path]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """All runs of the files; a later file replaces a run of the same config/label/seed unless only the older is ok."""
    runs: dict[tuple, dict[str, Any]] = {}
    metas = []
    for p in paths:
        data = load_results(p)
        metas.append({"file": str(p), "machine": data.get("machine"), "invocations": data.get("invocations")})
        for r in data["runs"]:
            key = (r["config"], r["label"], r["seed"])
            if key not in runs or r.get("ok") or not runs[key].get("ok"):
                runs[key] = r
    return list(runs.values()), metas


def report_table(runs: list[dict[str, Any]]) -> str:
    """The markdown table of one config's runs, one row per optimizer label, and a line on its AdamW target."""
    cols = config_columns(runs)
    force, energy, kind = cols or ("rmse_f_val", "rmse_e_val", "RMSE")
    target = adamw_target(runs, force)
    has_test = any(r.get("test") and "rmse_f" in r["test"] for r in runs)
    head = [
        "optimizer",
        "seeds",
        "ok",
        "steps",
        "start_lr",
        f"val F {kind} final (meV/Å)",
        f"val E {kind} final (meV/atom)",
        f"val F {kind} @25% (meV/Å)",
        f"val F {kind} @50% (meV/Å)",
    ]
    if target:
        head.append(f"steps (train s) to AdamW's val F {kind}")
    if has_test:
        head += ["test F RMSE (meV/Å)", "test E RMSE (meV/atom)"]
    head += ["s/batch", "wall s", "notes"]
    lines = []
    if kind == "MAE":
        norms = {bool((r.get("loss") or {}).get("f_use_norm")) for r in runs if r.get("loss") is not None}
        how = {
            frozenset({True}): "these runs set it: val F MAE is the mean norm |ΔF| of the per-atom force error",
            frozenset({False}): "these runs do not set it: val F MAE is over force components",
        }.get(frozenset(norms), "the results files do not record whether they set it")
        lines.append(
            "The lcurves have deepmd's MAE columns (loss_func mae), no RMSE ones; with f_use_norm deepmd's"
            f" mae_f is the mean norm of the per-atom force error vector, not a per-component MAE ({how}).\n"
        )
    if target:
        label, value, n = target
        lines += [
            f"AdamW's val F {kind}: {value * 1e3:.2f} meV/Å, the final value of {label} (mean of {n} complete "
            f"run{'s' if n > 1 else ''}, the best Adam(W) label); steps to reach it = first lcurve point at or "
            f"below it (so in steps of disp_freq), train s = those steps times the run's s/batch (deepmd's average: "
            f"no start-up, no validation); [k/n runs] where not every run got there\n"
        ]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 2) + ["---"]) + "|"]
    for label, rs in _by_label(runs).items():
        full = [r for r in rs if _complete(r)]
        partial = [r for r in rs if (r.get("lcurve") or {}).get("step")]
        sec = rs[0].get("optimizer_section") or {}
        name = label if rs[0]["optimizer"] != "adam" else f"{label} ({sec.get('type', '?')})"
        steps = sorted({r["steps"] for r in rs})
        lrs = sorted({r["start_lr"] for r in rs})
        cells = [
            name,
            ",".join(str(r["seed"]) for r in rs),
            f"{sum(bool(r.get('ok')) for r in rs)}/{len(rs)}",
            ",".join(map(str, steps)),
            ",".join(f"{x:g}" for x in lrs),
            _mean_sd([_final(r["lcurve"], force) for r in full], 1e3),
            _mean_sd([_final(r["lcurve"], energy) for r in full], 1e3),
            _mean_sd([_at_fraction(r["lcurve"], force, r["steps"], 0.25) for r in partial], 1e3),
            _mean_sd([_at_fraction(r["lcurve"], force, r["steps"], 0.5) for r in partial], 1e3),
        ]
        if target:
            cells.append(_reach_cell(rs, force, target[1]))
        if has_test:
            tests = [r["test"] for r in rs if r.get("test")]
            cells += [
                _mean_sd([t.get("rmse_f") for t in tests], 1e3),
                _mean_sd([t.get("rmse_e_per_atom") for t in tests], 1e3),
            ]
        cells += [
            _mean_sd([r.get("s_per_batch") for r in rs], fmt="{:.4f}"),
            _mean_sd([r.get("wall_s") for r in rs], fmt="{:.0f}"),
        ]
        notes = []
        for r in rs:
            notes += [f"seed {r['seed']}: {_short(p)}" for p in r.get("problems", [])]
        if rs[0]["optimizer"] in ("ours", "builtin"):
            seen = sum(bool(r.get("plugin_log_line_seen")) for r in rs)
            notes.append(f"plugin line in {seen}/{len(rs)} logs")
        if any(r.get("hm_kw") for r in rs):
            notes.append("kw " + ", ".join(f"{k}={v}" for k, v in rs[0]["hm_kw"].items()))
        cells.append("; ".join(notes).replace("|", "/") or "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_config(
    config: str, runs: list[dict[str, Any]], out: Path, *, mean: bool = False, ymax: float | None = None
) -> Path:
    """Validation force and energy errors against step, one line per run (``mean``: per label, seeds' range shaded).

    ``ymax`` (meV): the upper limit of both panels, so that a diverged run does not flatten the rest.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["label"] for r in runs))
    colors = {lab: f"C{i % 10}" for i, lab in enumerate(labels)}
    # Identical curves (ours and builtin can coincide) stay visible: earlier labels are drawn
    # thicker and underneath, with their own marker.
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    marker = {lab: markers[i % len(markers)] for i, lab in enumerate(labels)}
    width = {lab: max(1.0, 3.2 - 0.9 * i) for i, lab in enumerate(labels)}
    seeds = sorted({r["seed"] for r in runs})
    styles = ["-", "--", ":", "-."]
    seed_style = {s: styles[i % len(styles)] for i, s in enumerate(seeds)}
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), constrained_layout=True)
    force, energy, kind = config_columns(runs) or ERROR_COLUMNS[0]
    panels = [(force, f"validation force {kind} (meV/Å)"), (energy, f"validation energy {kind} (meV/atom)")]

    def points(r: dict[str, Any], col: str) -> dict[int, float]:
        lc = r.get("lcurve") or {}
        if col not in lc:
            return {}
        return {s: v * 1e3 for s, v in zip(lc["step"], lc[col], strict=True) if v > 0 and math.isfinite(v)}

    for ax, (col, title) in zip(axes, panels, strict=True):
        if mean:
            for label in labels:
                curves = [points(r, col) for r in runs if r["label"] == label]
                steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
                if not steps:
                    continue
                values = [[c[s] for c in curves] for s in steps]
                ax.plot(
                    steps,
                    [statistics.fmean(v) for v in values],
                    color=colors[label],
                    marker=marker[label],
                    markersize=4,
                    label=f"{label} ({len(curves)} seeds)",
                )
                ax.fill_between(
                    steps, [min(v) for v in values], [max(v) for v in values], color=colors[label], alpha=0.15
                )
        for r in [] if mean else sorted(runs, key=lambda r: (labels.index(r["label"]), r["seed"])):
            pts = sorted(points(r, col).items())
            if not pts:
                continue
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                color=colors[r["label"]],
                linestyle=seed_style[r["seed"]],
                marker=marker[r["label"]],
                markersize=width[r["label"]] + 2,
                linewidth=width[r["label"]],
                alpha=0.85,
                label=f"{r['label']} seed {r['seed']}" + ("" if r.get("ok") else " (!)"),
            )
        ax.set_yscale("log")
        if ymax is not None:
            ax.set_ylim(top=ymax)
        ax.set_xlabel("step")
        ax.set_ylabel(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    steps = sorted({r["steps"] for r in runs})
    schedules = sorted({r.get("lr_schedule", "exp") for r in runs})
    lr = "exp lr decay to start/30" if schedules == ["exp"] else f"lr schedule {','.join(schedules)}"
    what = "mean over seeds, range shaded" if mean else "each run"
    fig.suptitle(f"{config}: validation {kind} vs step ({','.join(map(str, steps))} steps, {lr}; {what})")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def same_start_check(runs: list[dict[str, Any]]) -> str:
    """Whether the runs of each seed start alike: same step-1 training RMSE (same initial model, same batch)."""
    out = []
    for seed in sorted({r["seed"] for r in runs}):
        firsts = {}
        for r in runs:
            lc = r.get("lcurve") or {}
            if r["seed"] == seed and lc.get("step") and lc["step"][0] == 1 and "rmse_trn" in lc:
                firsts[r["label"]] = lc["rmse_trn"][0]
        if len(firsts) < 2:
            continue
        if len(set(firsts.values())) == 1:
            out.append(f"seed {seed}: same ({next(iter(firsts.values())):.3g})")
        else:
            out.append(f"seed {seed}: DIFFERENT (" + ", ".join(f"{k} {v:.3g}" for k, v in firsts.items()) + ")")
    if not out:
        return ""
    return "step-1 training rmse (initial model on the first batch) across optimizers: " + "; ".join(out)


def cmd_report(args: argparse.Namespace) -> int:
    runs, metas = collect(args.results)
    if not runs:
        raise SystemExit("no runs in the results files")
    by_config: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_config.setdefault(r["config"], []).append(r)
    print("# Training quality: deepmd-hybridmuon (ours) vs built-in HybridMuon vs Adam(W)\n")
    machines: dict[str, list[str]] = {}  # files of the same machine and versions on one line
    for m in metas:
        mach = m.get("machine") or {}
        gpu = mach.get("gpu") or "no GPU seen"
        where = f"{mach.get('hostname', '?')}, {gpu}, versions {mach.get('versions')}"
        machines.setdefault(where, []).append(m["file"])
    for mach, files in machines.items():
        names = ", ".join(files) if len(files) <= 3 else f"{len(files)} files, {files[0]} ... {files[-1]}"
        print(f"- {names}: {mach}")
    print(
        "- val = lcurve's rmse (mae for inputs trained with loss_func mae: the column headers say which) on"
        " validation batches; final = last point of the runs whose lcurve reaches the last step; @25%/@50% ="
        " lcurve point nearest to that fraction of the steps; test = `dp test` RMSE of the final checkpoint on"
        " the whole validation system; energy errors are per atom (deepmd lcurve convention); values are"
        " mean ± sample sd over seeds; ok = runs without problems (failed runs: see notes)\n"
    )
    for config, rs in by_config.items():
        print(f"## {config}\n")
        print(report_table(rs))
        print()
        if check := same_start_check(rs):
            print(f"{check}\n")
        if args.plots:
            png = plot_config(config, rs, args.plots / f"quality_{config}.png", mean=args.mean, ymax=args.ymax)
            print(f"![{config} learning curves]({png})\n")
    return 0
