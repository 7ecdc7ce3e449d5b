#!/usr/bin/env python
"""The tables of BENCHMARKS.md, generated from ``benchmarks/results/<question>/``.

Each table sits between ``<!-- generated:NAME -->`` and ``<!-- /generated:NAME -->`` in BENCHMARKS.md,
followed inside the block by the machine, date, commit and command of every results file it reads
(from the file itself or from ``results/provenance.json``). The prose around the blocks is written by
hand. Deterministic: the output depends on the results files only.

    python benchmarks/benchmarks_doc.py            # rewrite the blocks of BENCHMARKS.md
    python benchmarks/benchmarks_doc.py --check    # exit 1 if BENCHMARKS.md differs from what this generates

``readme_claims()`` lists the figures the README repeats, each as the exact text the README must
contain (tests/test_docs.py checks both).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
DOC = HERE.parent / "BENCHMARKS.md"
sys.path.insert(0, str(HERE))
import guard  # noqa: E402
import train_quality as quality  # noqa: E402

TIMES, DASH = "\N{MULTIPLICATION SIGN}", "\N{EN DASH}"
#: Column heads of the ratios, all of them ours' time as a multiple of the other's.
VS_ADAMW, VS_BUILTIN = f"ours: {TIMES} AdamW's time", f"ours: {TIMES} the built-in's time"

MODEL = {
    "se_e2_a_water": "se_e2_a water",
    "dpa2_small_water": "DPA-2 small water",
    "dpa3_water": "DPA-3 water",
    "dpa4_water": "DPA-4 water",
}
GUARD_MODELS = ("se_e2_a_water", "dpa2_small_water", "dpa3_water", "dpa4_water", "dpa3_large")


@functools.cache
def path(name: str) -> Path:
    """Where a results file lies: ``results/<question>/<name>``, its name unique across the folders."""
    found = list(RESULTS.glob(f"*/{name}"))
    if len(found) != 1:
        raise SystemExit(f"results file {name}: {len(found)} found under {RESULTS}, expected one")
    return found[0]


@functools.cache
def load(name: str) -> dict[str, Any]:
    """A results file, read once (the tables read some files for every model): not to be changed."""
    return json.loads(path(name).read_text())


@functools.cache
def provenance() -> dict[str, dict[str, str]]:
    """``results/provenance.json``: what a results file does not record itself, by file name."""
    return json.loads((RESULTS / "provenance.json").read_text())


def run_spb(name: str) -> float:
    """deepmd's average s/batch of a ``train_speed.py`` results file of one variant."""
    return next(r["average_s_per_batch"] for r in load(name)["results"])


def source(name: str) -> dict[str, str]:
    """Machine, date, commit and command of a results file: provenance.json's, else the file's own fields."""
    data = load(name) if name.endswith(".json") else {}  # a text file's provenance is all in provenance.json
    env = data.get("environment", {})  # step_time.py's files
    own = {"date": data.get("date_utc", env.get("date_utc")), "command": data.get("command", env.get("command"))}
    own = {k: v for k, v in own.items() if isinstance(v, str)}
    own.update({k: data[k] for k in ("machine", "date", "commit", "command") if isinstance(data.get(k), str)})
    extra = {k: data[k] for k in ("transcribed_from",) if k in data}
    return {**own, **extra, **provenance().get(name, {})}


def sources(names: list[str], above: list[str] | tuple[str, ...] = ()) -> str:
    """The list of results files under a table; those of ``above`` (an earlier table's) by their names only."""
    lines = []
    for name in (n for n in names if n not in above):
        s, where = source(name), path(name).relative_to(RESULTS)
        lines.append(
            f"- `{where}`: {s['machine']}, {s['date']}, commit {s['commit']}: `{s['command']}`"
            + (f" ({s['note']})" if s.get("note") else "")
            + (f" (transcribed from {data_from})" if (data_from := s.get("transcribed_from")) else "")
        )
    if again := [f"`{path(n).relative_to(RESULTS)}`" for n in names if n in above]:
        lines.append(f"- {', '.join(again)}: listed above")
    return "Sources:\n" + "\n".join(lines)


def table(head: list[str], rows: list[list[str]], right: int = 1) -> str:
    align = ["---"] * right + ["---:"] * (len(head) - right)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def commit(name: str) -> str:
    """The short commit of a results file, or what its provenance says instead (e.g. 'not recorded')."""
    c = source(name)["commit"]
    return c.split()[0] if re.fullmatch(r"[0-9a-f]{7,40}", c.split()[0]) else c


mean = statistics.fmean


def ratio(a: float | None, b: float | None) -> str:
    """``a``'s time as a multiple of ``b``'s: every ratio of these tables is ours' time over the other's."""
    return "" if not (a and b) else f"{a / b:.2f}{TIMES}" if a / b >= 0.1 else f"{a / b:.3f}{TIMES}"


# ------------------------------------------------------------------------------- end to end


def end_to_end_rows() -> list[dict[str, Any]]:
    """Mean s/batch per optimizer for each single-GPU end-to-end measurement."""
    rows = []
    d3 = load("train_speed_dpa3_h100_2026-11-22.json")
    runs = [r for c in d3["calls"] for r in c["results"]]
    rows.append({"model": "dpa3_water", "file": "train_speed_dpa3_h100_2026-11-22.json", "runs": runs})
    d4 = load("train_speed_dpa4_h100_2026-11-24.json")
    rows.append({"model": "dpa4_water", "file": "train_speed_dpa4_h100_2026-11-24.json", "runs": d4["results"]})
    d2 = load("multi_gpu_dpa2_small_h100x1_stage0_pairs_2026-11-25.json")
    runs = [
        {"variant": key.rsplit("-", 1)[1], "average_s_per_batch": r["average_s_per_batch"]}
        for key, r in d2["configs"]["dpa2_small_water"]["runs"].items()
        if key != "warmup"
    ]
    rows.append(
        {"model": "dpa2_small_water", "file": "multi_gpu_dpa2_small_h100x1_stage0_pairs_2026-11-25.json", "runs": runs}
    )
    for row in rows:
        for v in ("ours", "adamw", "builtin"):
            xs = [r["average_s_per_batch"] for r in row["runs"] if r["variant"] == v]
            row[v] = (mean(xs), len(xs)) if xs else (None, 0)
    return rows


def end_to_end() -> str:
    rows = []
    for r in end_to_end_rows():
        s = source(r["file"])

        def cell(v: str, r: dict[str, Any] = r) -> str:
            return f"{r[v][0]:.4f} ({r[v][1]})" if r[v][0] else "not run"

        rows.append(
            [
                MODEL[r["model"]],
                f"{s['date'][:10]}, {commit(r['file'])}",
                cell("ours"),
                cell("adamw"),
                cell("builtin"),
                ratio(r["ours"][0], r["adamw"][0]),
                ratio(r["ours"][0], r["builtin"][0]),
            ]
        )
    head = ["model", "date, commit", "ours s/batch (runs)", "AdamW", "built-in"]
    head += [VS_ADAMW, VS_BUILTIN]
    return table(head, rows, right=2) + "\n\n" + sources([r["file"] for r in end_to_end_rows()])


# --------------------------------------------------------------------------------- quality

QUALITY = ["quality_se_e2_a_water.json", "quality_dpa3_water.json", "quality_dpa4_water_h200x2_2026-11-24.json"]


def _quality(name: str) -> tuple[list[dict[str, Any]], str, str, tuple[str, float, int]]:
    runs, _ = quality.collect([path(name)])
    force, _energy, kind = quality.config_columns(runs)
    return runs, force, kind, quality.adamw_target(runs, force)


def optimizer_name(run: dict[str, Any]) -> str:
    """``ours``, ``built-in``, or the type of the Adam or AdamW section a quality run trained with."""
    return {"ours": "ours", "builtin": "built-in"}.get(run["optimizer"]) or run["optimizer_section"]["type"]


def _final_mean(rs: list[dict[str, Any]], force: str) -> float | None:
    finals = [quality._final(r["lcurve"], force) for r in rs if quality._complete(r)]
    return mean(finals) if finals else None


def _best(runs: list[dict[str, Any]], force: str, optimizer: str) -> tuple[str, list[dict[str, Any]]] | None:
    labels = [(lb, rs) for lb, rs in quality._by_label(runs).items() if rs[0]["optimizer"] == optimizer]
    labels = [(lb, rs) for lb, rs in labels if _final_mean(rs, force) is not None]
    return min(labels, key=lambda x: _final_mean(x[1], force)) if labels else None


def time_to_accuracy() -> str:
    rows = []
    for name in QUALITY:
        runs, force, kind, target = _quality(name)
        label, value, _n = target
        adam = quality._by_label(runs)[label][0]
        target_cell = f"{value * 1e3:.1f} meV/Å ({kind}; {optimizer_name(adam)} at {adam['start_lr']:g})"
        cells = [MODEL[runs[0]["config"]], str(runs[0]["steps"]), target_cell]
        for opt in ("ours", "builtin", "adam"):
            best = _best(runs, force, opt)
            cells.append(f"{quality._reach_cell(best[1], force, value)} at {best[1][0]['start_lr']:g}" if best else "")
        rows.append(cells)
    head = ["model", "steps run", "target: the best Adam or AdamW rate's final validation force error"]
    head += ["ours: steps to the target (s)", "built-in", "Adam or AdamW"]
    return table(head, rows, right=3) + "\n\n" + sources(QUALITY)


def learning_rate() -> str:
    """One row per model and optimizer: each start_lr's final validation force error (complete runs), test RMSE."""
    rows: dict[tuple[str, str], list[str]] = {}
    for name in QUALITY:
        runs, force, kind, _target = _quality(name)
        for _label, rs in sorted(
            quality._by_label(runs).items(), key=lambda x: (x[1][0]["optimizer"], x[1][0]["start_lr"])
        ):
            full = [r for r in rs if quality._complete(r)]
            if not full:
                continue
            value = quality._mean_sd([quality._final(r["lcurve"], force) for r in full], 1e3, "{:.1f}")
            tests = [r["test"]["rmse_f"] for r in full if (r.get("test") or {}).get("rmse_f") is not None]
            test = f", test {quality._mean_sd(tests, 1e3, '{:.1f}')}" if tests else ""
            cell = f"{rs[0]['start_lr']:g}: {value} {kind} ({len(full)}/{len(rs)}{test})"
            rows.setdefault((MODEL[rs[0]["config"]], optimizer_name(rs[0])), []).append(cell)
    head = ["model", "optimizer", "start_lr: final validation force error, meV/Å (complete runs, test force RMSE)"]
    return table([*head], [[*key, "; ".join(cells)] for key, cells in rows.items()], right=2)


# ------------------------------------------------------------------------------ several GPUs

STAGE = {0: "0 (DDP)", 1: "1 (ZeRO-1)", 2: "2 (FSDP2)", 3: "3 (FSDP2)"}


def _run(name: str, config: str, key: str) -> dict[str, Any] | None:
    r = load(name)["configs"][config]["runs"].get(key)
    return r if r and r.get("returncode") == 0 and r.get("average_s_per_batch") else None


#: Alternating pairs of ours and AdamW at each sharded stage, one call per file: (file, config, stages shown).
#: The first file's FSDP2 pair ran the FSDP2 step of before ShardedEngine: left out.
PAIRS = (
    ("multi_gpu_dpa3_h200x2_2026-11-27.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa4_h200x2_2026-11-27.json", "dpa4_water", (1,)),
    ("multi_gpu_dpa3_h200x4_2026-11-27.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa3_stage1_h100x4_2026-11-28.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa4_stage1_h100x4_2026-11-28.json", "dpa4_water", (1,)),
    ("multi_gpu_dpa3_stage2_h100x4_2026-11-27.json", "dpa3_water", (2,)),
    ("multi_gpu_dpa3_stage3_h100x4_2026-11-27.json", "dpa3_water", (3,)),
    ("multi_gpu_dpa4_stage2_h100x4_2026-11-27.json", "dpa4_water", (2,)),
    ("multi_gpu_dpa4_stage2_h100x2_2026-11-27.json", "dpa4_water", (2,)),
    ("multi_gpu_dpa3_stage2_g2_h200x4_2026-11-27.json", "dpa3_water", (2,)),
    ("multi_gpu_dpa4_stage3_g2_h200x4_2026-11-27.json", "dpa4_water", (3,)),
    ("multi_gpu_dpa3_stage2_g4_h200x4_2026-11-27.json", "dpa3_water", (2,)),
    ("multi_gpu_dpa3_stage3_g4_h200x4_2026-11-27.json", "dpa3_water", (3,)),
    ("multi_gpu_dpa4_stage3_g4_h200x4_2026-11-27.json", "dpa4_water", (3,)),
    ("multi_gpu_dpa4_stage2_g4_h100x4_2026-11-28.json", "dpa4_water", (2,)),
    ("multi_gpu_dpa3_stage3_g4_h100x4_2026-11-28.json", "dpa3_water", (3,)),
    ("multi_gpu_dpa4_stage3_g4_h100x4_2026-11-28.json", "dpa4_water", (3,)),
    ("multi_gpu_dpa3_stage1_g4_h100x4_2026-11-28.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa4_stage1_g4_h100x4_2026-11-28.json", "dpa4_water", (1,)),
    ("multi_gpu_dpa3_stage2_g2_three_h100x4_2026-11-28.json", "dpa3_water", (2,)),
    ("multi_gpu_dpa4_stage2_g2_three_h100x4_2026-11-28.json", "dpa4_water", (2,)),
    ("multi_gpu_dpa4_stage1_g4_three_h100x4_2026-11-28.json", "dpa4_water", (1,)),
    ("multi_gpu_dpa3_stage1_g4_three_h100x4_2026-11-28.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa4_stage2_g4_three_h100x4_2026-11-28.json", "dpa4_water", (2,)),
    ("multi_gpu_dpa3_stage3_g4_three_h200x4_2026-11-28.json", "dpa3_water", (3,)),
    ("multi_gpu_dpa4_stage3_g4_three_h200x4_2026-11-28.json", "dpa4_water", (3,)),
    ("multi_gpu_dpa3_stage1_g2_three_h200x4_2026-11-28.json", "dpa3_water", (1,)),
    ("multi_gpu_dpa4_stage1_g2_three_h200x4_2026-11-28.json", "dpa4_water", (1,)),
)


def step_clocks(run: dict[str, Any]) -> tuple[float, float, float]:
    """A run's step on its slowest rank: by CUDA events, by the host's time in ``step()``, and the longer of the two.

    The longer clock bounds what the step costs either side: a step the host spends milliseconds launching can
    show a tiny event time when the GPU was still busy with the backward pass as the launches went in (AdamW under
    FSDP2 on 4 GPUs), and a step whose collectives wait for the other ranks shows that wait in its events.
    """
    ranks = run["optimizer_step"]["per_rank"].values()
    longer = max(max(r["median_ms"], r["host_mean_ms"]) for r in ranks)
    return run["optimizer_step"]["slowest_rank_median_ms"], max(r["host_mean_ms"] for r in ranks), longer


def pair_rows() -> list[dict[str, Any]]:
    """One row per complete pair of :data:`PAIRS`: file, config, GPUs, stage, pair, s/batch and step clocks."""
    rows = []
    for name, config, stages in PAIRS:
        runs = load(name)["configs"][config]["runs"]
        for label in dict.fromkeys(k.rsplit("-", 1)[0] for k in runs if k != "warmup"):
            got = {v: _run(name, config, f"{label}-{v}") for v in ("ours", "adamw")}
            stage, _, pair = label.removeprefix("stage").partition("#")
            if not all(got.values()) or int(stage) not in stages:
                continue  # a pair the call's time limit cut, or a stage left out
            rows.append(
                {
                    "name": name,
                    "config": config,
                    "stage": int(stage),
                    "pair": pair or "1",
                    "spb": {v: r["average_s_per_batch"] for v, r in got.items()},
                    "clocks": {v: step_clocks(r) for v, r in got.items()},
                }
            )
    return rows


def several_gpus_summary() -> str:
    """The pairs of :data:`PAIRS` per model, number of GPUs and stage: how many, and ours against AdamW."""
    cells: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in pair_rows():
        cells.setdefault((r["config"], load(r["name"])["gpus"], r["stage"]), []).append(r)
    rows = []
    for (config, gpus, stage), pairs in sorted(cells.items(), key=lambda item: (item[0][1], item[0][2], item[0][0])):
        spb = [r["spb"]["ours"] / r["spb"]["adamw"] for r in pairs]
        longer = [r["clocks"]["ours"][2] / r["clocks"]["adamw"][2] for r in pairs]
        rows.append(
            [
                MODEL.get(config, config),
                str(gpus),
                STAGE[stage],
                " + ".join(
                    f"{len([r for r in pairs if r['name'] == n])} ({gpu_model(n)})"
                    for n in dict.fromkeys(r["name"] for r in pairs)
                ),
                f"{statistics.geometric_mean(spb):.2f}{TIMES}",
                f"{min(spb):.2f}{DASH}{max(spb):.2f}{TIMES}",
                f"{min(longer):.2f}{DASH}{max(longer):.2f}{TIMES}",
            ]
        )
    head = ["model", "GPUs", "zero_stage", "pairs per call (GPU)", f"ours {TIMES} AdamW's s/batch, geometric mean"]
    head += ["each pair", f"step: ours {TIMES} AdamW's, the longer timing"]
    return table(head, rows, right=4) + "\n\n" + sources([name for name, _, _ in PAIRS])


#: The scaling runs, one file per number of GPUs and set, each set on one 4-GPU machine: (file, config). Efficiency
#: is against the one-GPU rate of the same GPU model; a set without a one-GPU run has none.
SCALING = (
    ("scaling_dpa3_g1_h200x4_2026-11-27.json", "dpa3_water"),
    ("scaling_dpa3_g2_h200x4_2026-11-27.json", "dpa3_water"),
    ("scaling_dpa3_g4_h200x4_2026-11-27.json", "dpa3_water"),
    ("scaling_dpa3_g2_fsdp_h100x4_2026-11-27.json", "dpa3_water"),
    ("scaling_dpa3_g4_fsdp_h100x4_2026-11-27.json", "dpa3_water"),
    ("scaling_dpa3_g1_fsdp_h200x4_2026-11-27.json", "dpa3_water"),
    ("multi_gpu_dpa3_stage2_g2_h200x4_2026-11-27.json", "dpa3_water"),
    ("multi_gpu_dpa3_stage2_g4_h200x4_2026-11-27.json", "dpa3_water"),
    ("multi_gpu_dpa3_stage3_g4_h200x4_2026-11-27.json", "dpa3_water"),
)
SCALING_VARIANTS = ("ours", "adamw", "builtin")


def gpu_model(name: str) -> str:
    """The GPU model of a results file, short: ``H100``, ``H200``."""
    return load(name)["device"].replace("NVIDIA ", "").split()[0]


def scaling_rows() -> list[dict[str, Any]]:
    """One row per (GPU model, GPUs, stage, round): each variant's s/batch, frames/s, efficiency and failure.

    Frames per second: the GPUs times the batch size (frames) over the s/batch, every rank taking its own batch.
    Efficiency: the frames/s over the GPUs times the same optimizer's one-GPU frames/s on the same GPU model (the
    mean of its rounds); None without one. ``failed``: the variants whose run failed (the file's ``problem``).
    """
    rows = []
    for name, config in SCALING:
        data = load(name)
        per = data["configs"][config]
        batch = json.loads((HERE.parent / per["config"]).read_text())["training"]["training_data"]["batch_size"]
        for label in dict.fromkeys(k.rsplit("-", 1)[0] for k in per["runs"] if k != "warmup"):
            spb, failed = {}, {}
            for v in SCALING_VARIANTS:
                run = _run(name, config, f"{label}-{v}")
                spb[v] = run["average_s_per_batch"] if run else None
                problem = per["runs"].get(f"{label}-{v}", {}).get("problem")
                if problem:
                    failed[v] = problem
            stage, _, round_ = label.removeprefix("stage").partition("#")
            rate = {v: data["gpus"] * batch / s if s else None for v, s in spb.items()}
            rows.append(
                {
                    "model": gpu_model(name),
                    "gpus": data["gpus"],
                    "stage": int(stage),
                    "round": round_ or "1",
                    "spb": spb,
                    "rate": rate,
                    "failed": failed,
                }
            )
    for v in SCALING_VARIANTS:
        for r in rows:
            single = [o["rate"][v] for o in rows if o["gpus"] == 1 and o["model"] == r["model"] and o["rate"][v]]
            r.setdefault("eff", {})[v] = r["rate"][v] / (r["gpus"] * mean(single)) if single and r["rate"][v] else None
    return rows


def scaling() -> str:
    """One row per GPU model, GPUs and stage; each cell lists its rounds."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in scaling_rows():
        groups.setdefault((r["model"], r["gpus"], r["stage"]), []).append(r)
    rows = []
    for (model, gpus, stage), rs in groups.items():
        cells = []
        for key, fmt in (("spb", ".4f"), ("eff", ".2f")):
            for v in SCALING_VARIANTS:
                xs = [format(r[key][v], fmt) for r in rs if r[key][v]]
                cells.append(" / ".join(xs) or ("failed" if any(v in r["failed"] for r in rs) else DASH))
        rows.append([model, str(gpus), STAGE[stage] if gpus > 1 else "one process", *cells])
    head = ["GPU", "GPUs", "zero_stage", "ours s/batch (each round)", "AdamW", "built-in"]
    head += ["efficiency: ours", "AdamW", "built-in"]
    pairs = [name for name, _, _ in PAIRS]
    return table(head, rows, right=3) + "\n\n" + sources([name for name, _ in SCALING], above=pairs)


# ---------------------------------------------------------------------------- the step alone


#: The step table's run: ours, the built-in and AdamW in one process, at the code that made these documents.
STEP = "step_time_h100_2026-11-27.json"


def step_medians(name: str, config: str) -> dict[str, float]:
    """The median ms of each variant of one model in a step_time.py results file."""
    return {r["variant"]: r["median_ms"] for r in load(name)["configs"][config]["results"] if r.get("ok")}


def _guard_files(kind: str) -> list[str]:
    """The guard's results of ``kind`` (``gpu`` or ``cpu``), oldest first: the newest is the one shown."""
    return sorted((p.name for p in RESULTS.glob(f"guard/guard_{kind}_*.json")), key=lambda name: load(name)["date"])


def _rounds(values: list[float] | None, digits: int) -> str:
    return "" if not values else ", ".join(f"{v:.{digits}f}" for v in values)


def guard_cell(data: dict[str, Any], key: str, digits: int) -> str:
    """One row of a guard file: HEAD's rounds vs base's, the ratio of their medians and, if not the same, the verdict
    of :func:`guard.verdict` (a regression: the best HEAD round over 1.1x the worst base round)."""
    by = data["rows"].get(key, {})
    head, base = by.get("HEAD"), by.get("base")
    if not (head and base):
        return _rounds(head or base, digits)
    word = guard.verdict(head, base).strip("*")
    ratio = f"{statistics.median(head) / statistics.median(base):.2f}{TIMES}"
    return f"{_rounds(head, digits)} vs {_rounds(base, digits)}: {ratio}" + ("" if word == "same" else f", {word}")


def guard_table(kind: str, head: list[str], rows: list[tuple[str, list[tuple[str, int]]]]) -> str:
    """The newest guard file of ``kind`` as a table: per row a label and a :func:`guard_cell` per column."""
    if not _guard_files(kind):
        return f"(no `guard/guard_{kind}_*.json` yet)"
    name = _guard_files(kind)[-1]
    data = load(name)
    body = [[label, *(guard_cell(data, key, digits) for key, digits in cells)] for label, cells in rows]
    body = [row + [""] * (len(head) - len(row)) for row in body]
    return table(head, body, right=len(head)) + "\n\n" + sources([name])


def step_alone() -> str:
    """The guard's step and memory on a GPU per model, then ``dp --pt train``'s figures: HEAD's rounds vs base's."""
    cells = [("ours step_ms", 3), ("ours\N{DIVISION SIGN}adamw step_ms", 2), ("ours resident_mib", 1)]
    rows = [(MODEL.get(m, "DPA-3 large (9.5 M)"), [(f"{m}/{key}", d) for key, d in cells]) for m in GUARD_MODELS]
    dp = [("dp first step cold host_ms", 0), ("dp first step warm host_ms", 0), ("dp peak peak_mib", 0)]
    rows.append(("DPA-3 water `dp --pt train`", [*dp, ("dp DPA-3 water s_per_batch", 4)]))
    head = ["HEAD vs base (rounds)", "step ms", f"{TIMES} AdamW's step", "memory alone, MiB"]
    text = guard_table("gpu", head, rows[:-1])
    dp_head = ["HEAD vs base (rounds)", "first step ms, cold", "warm", "peak MiB", "s/batch"]
    return text.split("\n\nSources")[0] + "\n\n" + guard_table("gpu", dp_head, rows[-1:])


def guard_cpu() -> str:
    """The guard's CPU rows: the step at one thread, against the built-in's, and the parity rows."""
    rows = [(MODEL[m], [(f"{m}/ours step_ms", 1), (f"{m}/ours\N{DIVISION SIGN}builtin step_ms", 2)])
            for m in ("se_e2_a_water", "dpa3_water")]  # fmt: skip
    rows.append(
        ("DPA-2 small: % of the update apart from the built-in's, 6 steps", [("parity defaults distance_pct", 2)])
    )
    rows.append(("the same, `enable_gram` off", [("parity no gram distance_pct", 2)]))
    return guard_table("cpu", ["HEAD vs base (rounds)", "CPU step ms", f"{TIMES} the built-in's step"], rows)


# ------------------------------------------------------------------------------- CPU

#: The CPU runs: ``cpu_step_<inputs>_t<threads>_r<round>_<date>.json``, ``cpu_train_<model>_t<threads>_r<round>_...``.
CPU_NAME = re.compile(r"cpu_(step|train)_(.+)_t(\d+)_r(\d+)_[\d-]+\.json")
CPU_MODELS = {**MODEL, "input": "the bundled example", "example": "the bundled example"}


def _cpu_runs(kind: str) -> dict[tuple[str, int], list[tuple[str, dict[str, float]]]]:
    """(model, threads) -> [(file, variant -> median step ms or s/batch)] of every round, in file order."""
    runs: dict[tuple[str, int], list[tuple[str, dict[str, float]]]] = {}
    for path in sorted(RESULTS.glob(f"cpu/cpu_{kind}_*.json")):
        match = CPU_NAME.fullmatch(path.name)
        if not match:
            continue
        threads, data = int(match.group(3)), load(path.name)
        if kind == "step":
            for config in data["configs"]:
                runs.setdefault((config, threads), []).append((path.name, step_medians(path.name, config)))
        else:
            values = {r["variant"]: r["average_s_per_batch"] for r in data["results"] if r.get("average_s_per_batch")}
            runs.setdefault((match.group(2), threads), []).append((path.name, values))
    return runs


def _cpu_table(kind: str, unit: str, digits: int) -> str:
    rows, names = [], []
    for (model, threads), rounds in _cpu_runs(kind).items():
        names += [name for name, _ in rounds]
        cells = {v: [r[v] for _, r in rounds if v in r] for v in ("ours", "builtin", "adamw")}
        avg = {v: mean(xs) if xs else None for v, xs in cells.items()}
        rows.append(
            [
                CPU_MODELS[model],
                str(threads),
                *(" / ".join(f"{x:.{digits}f}" for x in cells[v]) or "not run" for v in ("ours", "builtin", "adamw")),
                ratio(avg["ours"], avg["builtin"]),
                ratio(avg["ours"], avg["adamw"]),
            ]
        )
    head = ["model", "threads", f"ours {unit} (each round)", "built-in", "AdamW", VS_BUILTIN, VS_ADAMW]
    return table(head, rows, right=2) + "\n\n" + sources(sorted(set(names)))


def cpu() -> str:
    """The CPU step alone, then ``dp --pt train``'s s/batch."""
    return _cpu_table("step", "median ms", 1) + "\n\n" + _cpu_table("train", "s/batch", 3)


#: Learning curves of se_e2_a water (GPU runs: the steps to an accuracy do not depend on the device).
CPU_QUALITY = "quality_se_e2_a_water_adam3_h200_2026-11-27.json"


def cpu_time_to_accuracy_rows() -> list[tuple[str, float, float, float, float]]:
    """(optimizer, start_lr, steps to Adam's final validation force error, CPU s/batch at 2 threads, CPU s)."""
    runs, force, _kind, (adam_label, target, _n) = _quality(CPU_QUALITY)
    speed = {v: mean([r[v] for _, r in _cpu_runs("train")[("se_e2_a_water", 2)]]) for v in ("ours", "adamw")}
    rows = []
    for optimizer, variant in (("ours", "ours"), ("adam", "adamw")):
        label, rs = _best(runs, force, optimizer)
        steps = [quality.steps_to(r["lcurve"], force, target) for r in rs]
        n = rs[0]["steps"] if label == adam_label else mean([k for k in steps if k is not None])
        rows.append((optimizer_name(rs[0]), rs[0]["start_lr"], n, speed[variant], n * speed[variant]))
    return rows


def cpu_time_to_accuracy() -> str:
    runs, _force, kind, (label, target, _n) = _quality(CPU_QUALITY)
    adam = quality._by_label(runs)[label][0]
    rows = [
        [lb, f"{lr:g}", f"{n:.0f}", f"{spb:.3f}", f"{secs:.0f}"] for lb, lr, n, spb, secs in cpu_time_to_accuracy_rows()
    ]
    (_, _, _, _, ours), (_, _, _, _, adamw) = cpu_time_to_accuracy_rows()
    head = [
        "optimizer",
        "start_lr",
        f"steps to {target * 1e3:.1f} meV/Å ({kind}: {optimizer_name(adam)} at {adam['start_lr']:g}, its final)",
        "CPU s/batch (AdamW's for Adam)",
        "CPU s",
    ]
    cpu_runs = sorted({n for n, _ in _cpu_runs("train")[("se_e2_a_water", 2)]})
    note = f"ours: {ratio(ours, adamw)} Adam's time to Adam's final error (steps from learning curves of GPU runs)"
    return table(head, rows, right=1) + "\n\n" + note + "\n\n" + sources([CPU_QUALITY, *cpu_runs], above=cpu_runs)


# ------------------------------------------------------------------------------- cold start


#: Multi-task: the engine built again at each change of the parameters with a gradient (old: bd35792) or masked (new).
MULTITASK_VERSIONS = ["old", "new", "new", "old"]
MULTITASK_STEP = [(v, f"multitask_step_h200_2026-11-28_{i}_{v}.json") for i, v in enumerate(MULTITASK_VERSIONS, 1)]
MULTITASK_E2E = [
    (v, f"train_speed_dpa3_multitask_h200_2026-11-28_{i}_{v}.json") for i, v in enumerate(MULTITASK_VERSIONS, 1)
]


def multitask() -> str:
    """Ours' step with branches taking turns, before (bd35792) and after, and a DPA-3 multi-task run's s/batch."""
    how = {"old": "bd35792 (built again at each change)", "new": "220da46 (the masked step)"}
    ways = [r["way"] for r in load(MULTITASK_STEP[0][1])["rows"] if r["round"] == 1]
    rows = []
    for version in ("old", "new"):
        runs = [load(n)["rows"] for v, n in MULTITASK_STEP if v == version]
        cells = [" / ".join(f"{r['median_ms']:.2f}" for run in runs for r in run if r["way"] == way) for way in ways]
        spb = " / ".join(f"{run_spb(n):.4f}" for v, n in MULTITASK_E2E if v == version)
        rows.append([how[version], *cells, spb])
    head = ["ours", *(f"step ms, {w} (4 rounds)" for w in ways), "s/batch, DPA-3 water in two branches (two runs)"]
    return table(head, rows) + "\n\n" + sources([n for _, n in MULTITASK_STEP + MULTITASK_E2E])


# ---------------------------------------------------------------------------------- memory

#: memory.py's variants that the memory tables show, as they name them.
MEMORY_VARIANTS = {
    "ours": "ours",
    "ours-eager": "ours without the CUDA graph (`engine-eager`)",
    "adamw": "AdamW",
    "builtin": "built-in",
    "torch-muon": "torch.optim.Muon + AdamW",
}


def memory_files() -> list[str]:
    """The results files of ``memory.py`` (GPU runs), oldest first: a later file's row replaces an earlier one's."""
    return sorted((p.name for p in RESULTS.glob("memory/*.json")), key=lambda n: source(n)["date"])


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _times(a: float | None, b: float | None) -> str:
    """``a`` as a multiple of ``b`` (memory, not time), or nothing."""
    return "" if a is None or not b else f"{a / b:.2f}{TIMES}"


def memory() -> str:
    """The memory an optimizer holds (the optimizer alone), and the peak of whole ``dp --pt train`` runs."""
    names = memory_files()
    rows: dict[tuple[str, str], list[str]] = {}  # (model, variant): the latest measurement only
    train_rows: dict[tuple[str, str], list[str]] = {}  # likewise
    # AdamW per model, from the latest file that measured it
    adamw_of = {
        config: r
        for name in names
        for config, entry in load(name)["optimizer_alone"].items()
        for r in entry["results"]
        if r["variant"] == "adamw" and r.get("ok")
    }
    for name in names:
        data, s = load(name), source(name)
        when = f"{s['date'][:10]}, {commit(name)}"
        for config, entry in data["optimizer_alone"].items():
            model = entry.get("model") or {}
            size = (
                f"{model['numel'] / 1e6:.2f} M, {'/'.join(model['dtypes'])}: {model['params_mib']:.1f} MiB"
                if model
                else ""
            )
            adamw = adamw_of.get(config, {})
            for r in (r for r in entry["results"] if r["variant"] in MEMORY_VARIANTS):  # the variants shown
                cells = [MODEL.get(config, config), when, size, MEMORY_VARIANTS[r["variant"]]]
                if r.get("ok"):
                    res, peak = r["resident_mib"], r["peak_mib"]
                    cells += [
                        _mib(res),
                        _mib(peak),
                        _times(res, adamw.get("resident_mib")),
                        _times(peak, adamw.get("peak_mib")),
                    ]
                else:
                    cells += ["unavailable" if r.get("unavailable") else "failed", "", "", ""]
                rows[config, r["variant"]] = cells
        for config, entry in (data.get("train") or {}).items():
            runs = [r for r in entry["runs"] if r["label"] != "warmup"]
            adamw_peak = next(
                (r["max_memory_allocated_mib"] for r in runs if r["variant"] == "adamw" and not r["problems"]), None
            )
            for r in runs:
                peak = r["max_memory_allocated_mib"]
                train_rows[config, r["variant"]] = [
                    MODEL.get(config, config),
                    when,
                    MEMORY_VARIANTS.get(r["variant"], r["variant"]),
                    str(r["steps"]),
                    _mib(peak) if not r["problems"] else "failed",
                    _times(peak, adamw_peak),
                ]
    head = ["model", "date, commit", "parameters", "optimizer", "resident MiB", "peak MiB"]
    head += [f"resident: {TIMES} AdamW's", f"peak: {TIMES} AdamW's"]
    order = {key: i for i, key in enumerate([*MODEL, *MEMORY_VARIANTS])}  # models, then variants, as their tables
    ordered = sorted(rows.items(), key=lambda item: tuple(order.get(key, len(order)) for key in item[0]))
    text = table(head, [cells for _, cells in ordered], right=4)
    if train_rows:
        head = ["model", "date, commit", "optimizer", "steps", "`dp --pt train` peak MiB", f"{TIMES} AdamW's"]
        text += "\n\n" + table(head, list(train_rows.values()), right=3)
    return text + "\n\n" + sources(names)


BLOCKS = {
    "end-to-end": end_to_end,
    "time-to-accuracy": time_to_accuracy,
    "learning-rate": learning_rate,
    "several-gpus-summary": several_gpus_summary,
    "scaling": scaling,
    "step-alone": step_alone,
    "guard-cpu": guard_cpu,
    "cpu": cpu,
    "cpu-time-to-accuracy": cpu_time_to_accuracy,
    "multitask": multitask,
    "memory": memory,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the results give now."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"BENCHMARKS.md has no block {name}")
        text = pattern.sub(lambda m, make=make: m.group(1) + make() + "\n" + m.group(2), text)
    return text


# ---------------------------------------------------------------------------------- README


def _cpu_ours_vs(kind: str, other: str) -> list[float]:
    """Per (model, threads) of the CPU runs of ``kind``: ours' mean over the rounds over ``other``'s."""
    return [
        mean([r["ours"] for _, r in rounds]) / mean([r[other] for _, r in rounds])
        for rounds in _cpu_runs(kind).values()
    ]


def _cpu_guard_vs_builtin() -> tuple[float, str, float, str]:
    """The range of ours' CPU step over the built-in's in the newest CPU guard file, every model and round."""
    rows = load(_guard_files("cpu")[-1])["rows"]
    ratios = [v for key, by in rows.items() if key.endswith("\N{DIVISION SIGN}builtin step_ms") for v in by["HEAD"]]
    return min(ratios), DASH, max(ratios), TIMES


def readme_claims() -> list[str]:
    """The README's figures, each as the exact text it must contain, computed from the results."""
    e2e = end_to_end_rows()
    d3 = next(r for r in e2e if r["model"] == "dpa3_water")
    d4 = [r for r in e2e if r["model"] == "dpa4_water"]
    d2 = next(r for r in e2e if r["model"] == "dpa2_small_water")
    vs_adamw = [r["ours"][0] / r["adamw"][0] for r in (d3, *d4)]
    vs_builtin = [r["ours"][0] / r["builtin"][0] for r in (d3, *d4)]
    dpa3 = step_medians(STEP, "dpa3_water")
    ours3, builtin3 = dpa3["ours"], dpa3["builtin"]
    cpu, cpu_batch = _cpu_ours_vs("step", "builtin"), _cpu_ours_vs("train", "adamw")
    (*_, ours_s), (*_, adamw_s) = cpu_time_to_accuracy_rows()
    four = [r["eff"] for r in scaling_rows() if r["gpus"] == 4 and r["eff"]["ours"]]  # the sets with a one-GPU run
    eff = {v: [e[v] for e in four if e[v]] for v in ("ours", "adamw")}
    pairs = pair_rows()
    zero1 = [r for r in pairs if r["stage"] == 1]
    z_step = [r["clocks"]["ours"][2] / r["clocks"]["adamw"][2] for r in zero1]  # the longer clock
    z_spb = [r["spb"]["ours"] / r["spb"]["adamw"] for r in zero1]
    fsdp = [r for r in pairs if r["stage"] >= 2]
    spb = [r["spb"]["ours"] / r["spb"]["adamw"] for r in fsdp]
    host = {v: [r["clocks"][v][1] for r in fsdp] for v in ("ours", "adamw")}
    multi = {v: [run_spb(n) for u, n in MULTITASK_E2E if u == v] for v in ("old", "new")}
    guarded = load(_guard_files("gpu")[-1])["rows"]  # the step at HEAD: the newest guard run, every round
    vs_fused = [v for m in GUARD_MODELS for v in guarded[f"{m}/ours\N{DIVISION SIGN}adamw step_ms"]["HEAD"]]
    step_ms = {m: max(guarded[f"{m}/ours step_ms"]["HEAD"]) for m in GUARD_MODELS}
    of_batch = [step_ms[r["model"]] / 1000 / r["ours"][0] for r in e2e]  # the step's share of a batch
    peaks = {  # a whole dp --pt train run's peak memory, by optimizer
        r["variant"]: r["max_memory_allocated_mib"]
        for name in memory_files()
        for entry in (load(name).get("train") or {}).values()
        for r in entry["runs"]
        if r["label"] != "warmup" and not r["problems"]
    }
    saved = (1 - max(multi["new"]) / min(multi["old"]), 1 - min(multi["new"]) / max(multi["old"]))
    return [
        f"a two-branch DPA-3 water run takes {saved[0] * 100:.0f}{DASH}{saved[1] * 100:.0f} % less time a batch",
        f"our step took {min(z_step):.2f}{DASH}{max(z_step):.2f}{TIMES} AdamW's, and the runs "
        f"{min(z_spb):.2f}{DASH}{max(z_spb):.2f}{TIMES} its s/batch",
        f"under FSDP2 ours trains at {min(spb):.2f}{DASH}{max(spb):.2f}{TIMES} AdamW's s/batch, and its step keeps the "
        f"host busy {min(host['ours']):.1f}{DASH}{max(host['ours']):.1f} ms against AdamW's "
        f"{min(host['adamw']):.1f}{DASH}{max(host['adamw']):.1f} ms",
        f"{min(eff['ours']):.2f}{DASH}{max(eff['ours']):.2f} of 4 times the one-GPU rate with ours, as with AdamW "
        f"({min(eff['adamw']):.2f}{DASH}{max(eff['adamw']):.2f})",
        f"{min(cpu):.2f}{DASH}{max(cpu):.2f}{TIMES} the built-in's time",
        "on a CPU without AMX {:.2f}{}{:.2f}{}".format(*_cpu_guard_vs_builtin()),
        f"{ours_s / adamw_s:.2f}{TIMES} AdamW's time",
        f"and a batch costs {min(cpu_batch):.2f}{DASH}{max(cpu_batch):.2f}{TIMES} AdamW's",
        f"{min(vs_adamw):.2f}{DASH}{max(vs_adamw):.2f}{TIMES} AdamW's s/batch",
        f"DPA-2 small, whose batch is three times shorter: {d2['ours'][0] / d2['adamw'][0]:.2f}{TIMES} AdamW's",
        f"{min(vs_builtin):.2f}{DASH}{max(vs_builtin):.2f}{TIMES} the time of deepmd-kit's built-in HybridMuon",
        f"{ours3:.2f} ms against the built-in's {builtin3:.0f} ms",
        "at this release {:.2f}{}{:.2f} ms on an H200".format(
            min(guarded["dpa3_water/ours step_ms"]["HEAD"]), DASH, max(guarded["dpa3_water/ours step_ms"]["HEAD"])
        ),
        f"about {max(of_batch) * 100:.0f} % of a batch, is slower than PyTorch's AdamW step (`fused=True`): "
        f"{min(vs_fused):.2f}{DASH}{max(vs_fused):.2f}{TIMES} its time",
        f"peak memory is {peaks['ours'] / peaks['adamw']:.2f}{TIMES} that of the same run with AdamW",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if BENCHMARKS.md differs")
    args = parser.parse_args(argv)
    text = DOC.read_text()
    new = render(text)
    if args.check:
        if new != text:
            print("BENCHMARKS.md differs from benchmarks/benchmarks_doc.py's output; run it to update", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
