#!/usr/bin/env python
"""The tables of BENCHMARKS.md, generated from ``benchmarks/results/*.json``.

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
import quality_report as quality  # noqa: E402

TIMES, DASH = "\N{MULTIPLICATION SIGN}", "\N{EN DASH}"
#: Column heads of the ratios, all of them ours' time as a multiple of the other's.
VS_ADAMW, VS_BUILTIN = f"ours: {TIMES} AdamW's time", f"ours: {TIMES} the built-in's time"

MODEL = {
    "se_e2_a_water": "se_e2_a water",
    "dpa2_small_water": "DPA-2 small water",
    "dpa3_water": "DPA-3 water",
    "dpa4_water": "DPA-4 water",
}


@functools.cache
def load(name: str) -> dict[str, Any]:
    """A results file, read once (the tables read some files for every model): not to be changed."""
    return json.loads((RESULTS / name).read_text())


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
    return {**own, **extra, **load("provenance.json").get(name, {})}


def sources(names: list[str]) -> str:
    lines = []
    for name in names:
        s = source(name)
        lines.append(
            f"- `{name}`: {s['machine']}, {s['date']}, commit {s['commit']}: `{s['command']}`"
            + (f" ({s['note']})" if s.get("note") else "")
            + (f" (transcribed from {data_from})" if (data_from := s.get("transcribed_from")) else "")
        )
    return "Sources:\n\n" + "\n".join(lines)


def table(head: list[str], rows: list[list[str]], right: int = 1) -> str:
    align = ["---"] * right + ["---:"] * (len(head) - right)
    out = ["| " + " | ".join(head) + " |", "|" + "|".join(align) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def commit(name: str) -> str:
    """The short commit of a results file, or what its provenance says instead (e.g. 'not recorded')."""
    c = source(name)["commit"]
    return c.split()[0] if re.fullmatch(r"[0-9a-f]{7,40}", c.split()[0]) else c


def mean(xs: list[float]) -> float:
    return statistics.fmean(xs)


def ratio(a: float | None, b: float | None) -> str:
    """``a``'s time as a multiple of ``b``'s: every ratio of these tables is ours' time over the other's."""
    return "" if not (a and b) else f"{a / b:.2f}{TIMES}" if a / b >= 0.1 else f"{a / b:.3f}{TIMES}"


def f4(x: float | None) -> str:
    return f"{x:.4f}" if x is not None else "not run"


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
    runs, _ = quality.collect([RESULTS / name])
    force, _energy, kind = quality.config_columns(runs)
    return runs, force, kind, quality.adamw_target(runs, force)


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
        cells = [MODEL[runs[0]["config"]], str(runs[0]["steps"]), f"{value * 1e3:.1f} meV/Å ({kind}, {label})"]
        for opt in ("ours", "builtin", "adam"):
            best = _best(runs, force, opt)
            cells.append(f"{quality._reach_cell(best[1], force, value)} at {best[1][0]['start_lr']:g}" if best else "")
        rows.append(cells)
    head = ["model", "steps", "AdamW's final val force error", "ours: steps (s)", "built-in: steps (s)", "AdamW"]
    return table(head, rows, right=3) + "\n\n" + sources(QUALITY)


def learning_rate() -> str:
    rows = []
    names = {"ours": "ours", "builtin": "built-in", "adam": "Adam(W)"}
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
            rows.append(
                [
                    MODEL[rs[0]["config"]],
                    names[rs[0]["optimizer"]],
                    f"{rs[0]['start_lr']:g}",
                    f"{len(full)}/{len(rs)}",
                    f"{value} ({kind})",
                    quality._mean_sd(tests, 1e3, "{:.1f}") if tests else "",
                ]
            )
    head = ["model", "optimizer", "start_lr", "complete runs", "final val force error (meV/Å)", "test force RMSE"]
    return table(head, rows, right=2) + "\n\n" + sources(QUALITY)


# ------------------------------------------------------------------------------ several GPUs

#: (results file, config, stage): the multi-GPU rows, newest code first per configuration.
MULTI = [
    ("multi_gpu_dpa2_small_h200x2_2026-11-24.json", "dpa2_small_water", 0),
    ("multi_gpu_dpa4_h200x2_2026-11-23.json", "dpa4_water", 0),
]
STAGE = {0: "0 (DDP)", 1: "1 (ZeRO-1)", 2: "2 (FSDP2)", 3: "3 (FSDP2)"}


def _run(name: str, config: str, key: str) -> dict[str, Any] | None:
    r = load(name)["configs"][config]["runs"].get(key)
    return r if r and r.get("returncode") == 0 and r.get("average_s_per_batch") else None


def several_gpus() -> str:
    rows = []
    for name, config, stage in MULTI:
        data, s = load(name), source(name)
        got = {v: _run(name, config, f"stage{stage}-{v}") for v in ("ours", "adamw", "builtin")}
        spb = {v: (r["average_s_per_batch"] if r else None) for v, r in got.items()}
        step = [f"{r['optimizer_step']['slowest_rank_median_ms']:.2f}" if r else DASH for r in got.values()]
        rows.append(
            [
                MODEL[config] + (", EMA off" if data.get("enable_ema_off") else ""),
                f"{data['gpus']} {TIMES} {data['device'].replace('NVIDIA ', '').replace(' 80GB HBM3', '')}",
                f"{s['date'][:10]}, {commit(name)}",
                STAGE[stage],
                *(f4(spb[v]) for v in ("ours", "adamw", "builtin")),
                ratio(spb["ours"], spb["adamw"]),
                " / ".join(step),
            ]
        )
    head = ["model", "GPUs", "date, commit", "zero_stage", "ours s/batch", "AdamW", "built-in", VS_ADAMW]
    head.append("step ms ours / AdamW / built-in")
    return table(head, rows, right=4) + "\n\n" + sources(list(dict.fromkeys(n for n, _, _ in MULTI)))


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
    head = ["model", "GPUs", "zero_stage", "pairs (per call)", f"ours {TIMES} AdamW's s/batch, geometric mean"]
    head += ["each pair", f"step, the longer clock: ours {TIMES} AdamW's"]
    return table(head, rows, right=4)


def several_gpus_pairs() -> str:
    rows = [
        [
            MODEL.get(r["config"], r["config"]),
            f"{load(r['name'])['gpus']} {TIMES} {gpu_model(r['name'])}",
            STAGE[r["stage"]],
            r["pair"],
            *(f4(r["spb"][v]) for v in ("ours", "adamw")),
            ratio(r["spb"]["ours"], r["spb"]["adamw"]),
            *(f"{r['clocks']['ours'][i]:.2f} / {r['clocks']['adamw'][i]:.2f}" for i in (0, 1)),
            ratio(r["clocks"]["ours"][0], r["clocks"]["adamw"][0]),
            ratio(r["clocks"]["ours"][2], r["clocks"]["adamw"][2]),
        ]
        for r in pair_rows()
    ]
    head = ["model", "GPUs", "zero_stage", "pair", "ours s/batch", "AdamW", VS_ADAMW, "step ms ours / AdamW"]
    head += ["host ms ours / AdamW", f"step: ours {TIMES} AdamW's", f"the longer clock: ours {TIMES} AdamW's"]
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
SCALING_NAMES = {"ours": "ours", "adamw": "AdamW", "builtin": "built-in"}


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
    def cells(r: dict[str, Any], key: str, fmt: str) -> list[str]:
        return [
            format(r[key][v], fmt) if r[key][v] else ("failed" if v in r["failed"] else DASH) for v in SCALING_VARIANTS
        ]

    rows, failures = [], {}
    for r in scaling_rows():
        rows.append(
            [
                r["model"],
                str(r["gpus"]),
                STAGE[r["stage"]] if r["gpus"] > 1 else "one process",
                r["round"],
                *cells(r, "spb", ".4f"),
                *cells(r, "rate", ".2f"),
                " / ".join(cells(r, "eff", ".2f")),
            ]
        )
        for v, problem in r["failed"].items():
            failures.setdefault((v, problem), []).append(f"{r['gpus']} GPUs at zero_stage {r['stage']}")
    head = ["GPU", "GPUs", "zero_stage", "round", "ours s/batch", "AdamW", "built-in", "ours frames/s", "AdamW"]
    head += ["built-in", "efficiency ours / AdamW / built-in"]
    notes = "".join(
        f"\n\nFailed: the {SCALING_NAMES[v]} on {', '.join(where)}: `{problem}`."
        for (v, problem), where in failures.items()
    )
    return table(head, rows, right=4) + notes + "\n\n" + sources([name for name, _ in SCALING])


#: The cost model's predictions (benchmarks/cost_model.py).
COST_MODEL = "cost_model_2026-11-27.json"


def cost_model() -> str:
    sys.path.insert(0, str(HERE))
    from cost_model import markdown

    return markdown(load(COST_MODEL)["rows"]) + "\n\n" + sources([COST_MODEL])


# ---------------------------------------------------------------------------- the step alone


#: The step table's run: ours, the built-in and AdamW in one process, at the code that made these documents.
STEP = "step_time_h100_2026-11-27.json"
#: Runs of the same step code (ours and AdamW) on other H100 machines that day: how much the numbers move.
STEP_RUNS = [STEP, *(f"step_time_h100_2026-11-27_{k}.json" for k in ("a1", "a2", "b1", "b2", "c1", "c2"))]
#: The torch stacks' design measurement, one call, alternating: (version, results file) in the order run.
STREAMS_VERSIONS = ["old", "one", "new", "new", "one", "old"]
STREAMS = [(v, f"step_time_h200_2026-11-28_streams_{i}_{v}.json") for i, v in enumerate(STREAMS_VERSIONS, 1)]
#: End to end, each model in one call: (model, [(version, file), ...]) alternating.
STREAMS_E2E = [
    (
        m,
        [
            (v, f"train_speed_{m}_h200_2026-11-28_streams_{i}_{v}.json")
            for i, v in enumerate(["old", "new", "new", "old"], 1)
        ],
    )
    for m in ("se_e2_a", "dpa3", "dpa4")
]
STREAMS_MEMORY = ("stacks_memory_09d614a_h200_2026-11-28.json", "memory_h200_2026-11-28.json")


def step_medians(name: str, config: str) -> dict[str, float]:
    """The median ms of each variant of one model in a step_time.py results file."""
    return {r["variant"]: r["median_ms"] for r in load(name)["configs"][config]["results"] if r.get("ok")}


def step_rows() -> list[list[Any]]:
    """(model, ours, adamw, builtin) median ms of the optimizer step alone."""
    rows = []
    for config in load(STEP)["configs"]:
        med = step_medians(STEP, config)
        rows.append([config, med["ours"], med["adamw"], med["builtin"]])
    return rows


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 1 else f"{x:.3g}" if x < 10 else f"{x:.1f}"


def step_alone() -> str:
    rows = []
    s = source(STEP)
    for config, ours, adamw, builtin in step_rows():
        rows.append(
            [
                MODEL[config],
                f"{s['date'][:10]}, {commit(STEP)}",
                _ms(ours),
                _ms(adamw),
                _ms(builtin),
                ratio(ours, adamw),
                ratio(ours, builtin),
            ]
        )
    head = ["model", "date, commit", "ours median ms", "fused AdamW", "built-in", VS_ADAMW, VS_BUILTIN]
    return table(head, rows, right=2) + "\n\n" + sources([STEP])


def step_spread() -> str:
    spread = []
    for config in load(STEP)["configs"]:
        meds = [step_medians(name, config) for name in STEP_RUNS]
        ours, adamw = [m["ours"] for m in meds], [m["adamw"] for m in meds]
        ratios = [m["ours"] / m["adamw"] for m in meds]
        spread.append(
            [
                MODEL[config],
                f"{statistics.median(ours):.2f} ({min(ours):.2f}{DASH}{max(ours):.2f})",
                f"{statistics.median(adamw):.2f} ({min(adamw):.2f}{DASH}{max(adamw):.2f})",
                f"{min(ratios):.2f}{DASH}{max(ratios):.2f}",
            ]
        )
    head = [
        "model",
        f"ours median ms, median of {len(STEP_RUNS)} runs (range)",
        "fused AdamW (range)",
        f"{VS_ADAMW}, each run",
    ]
    return table(head, spread) + "\n\n" + sources(STEP_RUNS)


# ------------------------------------------------------------------------------- CPU

#: The CPU runs: ``cpu_step_<inputs>_t<threads>_r<round>_<date>.json``, ``cpu_train_<model>_t<threads>_r<round>_...``.
CPU_NAME = re.compile(r"cpu_(step|train)_(.+)_t(\d+)_r(\d+)_[\d-]+\.json")
CPU_MODELS = {**MODEL, "input": "the bundled example", "example": "the bundled example"}


def _cpu_runs(kind: str) -> dict[tuple[str, int], list[tuple[str, dict[str, float]]]]:
    """(model, threads) -> [(file, variant -> median step ms or s/batch)] of every round, in file order."""
    runs: dict[tuple[str, int], list[tuple[str, dict[str, float]]]] = {}
    for path in sorted(RESULTS.glob(f"cpu_{kind}_*.json")):
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


def cpu_step() -> str:
    return _cpu_table("step", "median ms", 1)


def cpu_train() -> str:
    return _cpu_table("train", "s/batch", 3)


#: Learning curves of se_e2_a water (GPU runs: the steps to an accuracy do not depend on the device).
CPU_QUALITY = "quality_se_e2_a_water_adam3_h200_2026-11-27.json"


def cpu_time_to_accuracy_rows() -> list[tuple[str, float, float, float, float]]:
    """(label, start_lr, steps to AdamW's final val force error, CPU s/batch at 2 threads, CPU s) of ours and AdamW."""
    runs, force, _kind, (adam_label, target, _n) = _quality(CPU_QUALITY)
    speed = {v: mean([r[v] for _, r in _cpu_runs("train")[("se_e2_a_water", 2)]]) for v in ("ours", "adamw")}
    rows = []
    for optimizer, variant in (("ours", "ours"), ("adam", "adamw")):
        label, rs = _best(runs, force, optimizer)
        steps = [quality.steps_to(r["lcurve"], force, target) for r in rs]
        n = rs[0]["steps"] if label == adam_label else mean([k for k in steps if k is not None])
        rows.append((label, rs[0]["start_lr"], n, speed[variant], n * speed[variant]))
    return rows


def cpu_time_to_accuracy() -> str:
    _runs, _force, kind, (label, target, _n) = _quality(CPU_QUALITY)
    rows = [
        [lb, f"{lr:g}", f"{n:.0f}", f"{spb:.3f}", f"{secs:.0f}"] for lb, lr, n, spb, secs in cpu_time_to_accuracy_rows()
    ]
    (_, _, _, _, ours), (_, _, _, _, adamw) = cpu_time_to_accuracy_rows()
    head = [
        "optimizer",
        "start_lr",
        f"steps to {target * 1e3:.1f} meV/Å ({kind}, {label}'s final)",
        "CPU s/batch",
        "CPU s",
    ]
    names = [CPU_QUALITY, *sorted({n for n, _ in _cpu_runs("train")[("se_e2_a_water", 2)]})]
    note = f"ours: {ratio(ours, adamw)} AdamW's time to its final error"
    return table(head, rows, right=1) + "\n\n" + note + "\n\n" + sources(names)


#: The phased kernel's removal: (with it, without it) per round, alternating in one call.
PHASED = [
    (f"step_time_h200_2026-11-27_with_phased_r{r}.json", f"step_time_h200_2026-11-27_without_phased_r{r}.json")
    for r in (1, 2)
]
PHASED_E2E = [
    (
        f"train_speed_se_e2_a_h200_2026-11-27_with_phased_r{r}.json",
        f"train_speed_se_e2_a_h200_2026-11-27_without_phased_r{r}.json",
    )
    for r in (1, 2)
]


def design_phased() -> str:
    def step(name: str, config: str) -> str:
        med = step_medians(name, config)
        return f"{_ms(med['ours'])} ({ratio(med['ours'], med['adamw'])})"

    rows = [[MODEL[c], *(step(n, c) for pair in PHASED for n in pair)] for c in load(PHASED[0][0])["configs"]]
    spb = [run_spb(n) for pair in PHASED_E2E for n in pair]
    rows.append(["se_e2_a water, end to end (s/batch)", *(f"{x:.4f}" for x in spb)])
    head = ["model", *(f"round {r}, {k}" for r in (1, 2) for k in ("with", "without"))]
    return table(head, rows) + "\n\n" + sources([n for pairs in (PHASED, PHASED_E2E) for pair in pairs for n in pair])


#: The panel and address-table kernels' removal: (with them, without them) per round, alternating in one call;
#: the version between them (panels removed only) printed its tables to FAMILIES_TEXT.
FAMILIES = [
    (f"step_time_h100_2026-11-27_families_with_r{r}.json", f"step_time_h100_2026-11-27_families_without_r{r}.json")
    for r in (1, 2)
]
FAMILIES_TEXT = "step_time_h100_2026-11-27_families.txt"


def _printed_medians(name: str, version: str) -> dict[tuple[int, str], dict[str, float]]:
    """(round, model) -> {variant: median ms} of one version in a file of versions_ab.sh's printed tables."""
    out: dict[tuple[int, str], dict[str, float]] = {}
    rows: dict[str, dict[str, float]] = {}
    config = ""
    for line in (RESULTS / name).read_text().splitlines():
        if line.startswith("## "):
            config = line[3:].strip()
        elif line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.setdefault(config, {})[cells[0]] = float(cells[2])
        elif line.startswith("== "):
            _, label, round_, *_ = line.split()
            if label == version:
                out.update({(int(round_.lstrip("r")), c): v for c, v in rows.items()})
            rows = {}
    return out


def design_families() -> str:
    def cell(med: dict[str, float]) -> str:
        return f"{_ms(med['ours'])} ({ratio(med['ours'], med['adamw'])})"

    between = _printed_medians(FAMILIES_TEXT, "nopanel")
    rows = []
    for config in load(FAMILIES[0][0])["configs"]:
        cells = []
        for r, (with_, without) in enumerate(FAMILIES, start=1):
            cells += [cell(step_medians(with_, config)), cell(between[r, config]), cell(step_medians(without, config))]
        rows.append([MODEL[config], *cells])
    kinds = ("with both", "panels removed", "without both")
    head = ["model", *(f"round {r}, {k}" for r in (1, 2) for k in kinds)]
    names = [n for pair in FAMILIES for n in pair] + [FAMILIES_TEXT]
    return table(head, rows) + "\n\n" + sources(names)


#: The Triton Magma kernel's removal: the step (versions_ab.sh's printed tables; round 2 without it was not
#: recorded) and deepmd's s/batch of DPA-3 and DPA-4 water (with, without) per round, alternating in one call.
MAGMA_STEP = "step_time_h200_2026-11-27_magma_kernel.txt"
MAGMA_E2E = {
    c: [(f"train_speed_{c}_h200_2026-11-27_{k}_magma_kernel_r{r}.json") for r in (1, 2) for k in ("with", "without")]
    for c in ("dpa3", "dpa4")
}


def design_magma() -> str:
    cells = {k: _printed_medians(MAGMA_STEP, k) for k in ("with_kernel", "without_kernel")}

    def step(kind: str, r: int, config: str) -> str:
        med = cells[kind].get((r, config))
        return f"{_ms(med['ours'])} ({ratio(med['ours'], med['adamw'])})" if med else "not recorded"

    kinds = [(r, k) for r in (1, 2) for k in ("with_kernel", "without_kernel")]
    rows = [[MODEL[c], *(step(k, r, c) for r, k in kinds)] for c in MODEL if (1, c) in cells["with_kernel"]]
    for c, names in MAGMA_E2E.items():
        spb = [run_spb(n) for n in names]
        rows.append([f"{MODEL[c + '_water']}, end to end (s/batch)", *(f"{x:.4f}" for x in spb)])
    head = ["model", *(f"round {r}, {'with' if k == 'with_kernel' else 'without'}" for r, k in kinds)]
    return table(head, rows) + "\n\n" + sources([MAGMA_STEP, *(n for names in MAGMA_E2E.values() for n in names)])


#: The GPU step before and after the in-place flat buffer, alternating in one call: (205dfb2, then) pairs of rounds.
STEP_BEFORE_AFTER = [f"step_time_h100_2026-11-28_{k}_r{r}.json" for r in (1, 2) for k in ("before", "after")]


def step_before_after() -> str:
    rows = []
    for config in load(STEP_BEFORE_AFTER[0])["configs"]:
        cells = []
        for name in STEP_BEFORE_AFTER:
            med = step_medians(name, config)
            cells.append(f"{_ms(med['ours'])} ({ratio(med['ours'], med['adamw'])})")
        rows.append([MODEL[config], *cells])
    head = ["model", *(f"{commit(n)}, round {n[-6]}: ms (ours: {TIMES} AdamW's time)" for n in STEP_BEFORE_AFTER)]
    return table(head, rows) + "\n\n" + sources(STEP_BEFORE_AFTER)


# ------------------------------------------------------------------------------- cold start

COLD = ["cold_start_dpa3_dpa4_h200_2026-11-28.json"]


def cold_start() -> str:
    rows = []
    for name in COLD:
        for r in load(name)["runs"]:
            rows.append(
                [
                    r["config"].replace("_", " "),
                    f"{r['cache']} Triton cache",
                    f"{r['first_step_ms']:.0f}",
                    f"{r['slowest_later_step_ms']:,.0f} (step {r['slowest_later_step']})",
                    str(r["steps_over_100ms_after_first"]),
                    str(r["kernels_from_step"]),
                    f"{r['s_per_batch']:.4f}",
                    f"{sum(r['host_ms']):,.0f}",
                    str(len(r.get("compiled_in_training_process") or [])),
                ]
            )
    head = [
        "model",
        "run",
        "first step ms",
        "slowest later step ms",
        "later steps > 100 ms",
        "Triton kernels from step",
        "s/batch",
        "all optimizer steps, host ms",
        "kernels compiled in training process",
    ]
    return table(head, rows, right=2) + "\n\n" + sources(COLD)


# ---------------------------------------------------------------------------------- design


GRAPH = [
    ("multi_gpu_dpa2_small_h100x1_stage0_between_2026-11-25.json", "CUDA graph (default)"),
    ("multi_gpu_dpa2_small_h100x1_stage0_between_eager_2026-11-25.json", "`engine-eager` (no graph)"),
]


def design_graph() -> str:
    rows = []
    for name, how in GRAPH:
        for key, r in load(name)["configs"]["dpa2_small_water"]["runs"].items():
            if not key.endswith("-ours"):
                continue
            rank = r["optimizer_step"]["per_rank"]["rank0"]
            rows.append(
                [how, key, f"{rank['median_ms']:.2f}", f"{rank['host_mean_ms']:.2f}", f"{r['average_s_per_batch']:.4f}"]
            )
    head = ["ours", "run", "step ms (GPU median)", "step ms (host mean)", "s/batch"]
    return table(head, rows, right=2) + "\n\n" + sources([n for n, _ in GRAPH])


def design_stacks() -> str:
    """The torch stacks: padded with a side stream each (old), per shape on one stream (one), per shape on one side
    stream (new): step, end to end, memory."""
    label = {"old": "09d614a", "one": "f002671", "new": "f04f4c5"}
    rows = []
    for config in load(STREAMS[0][1])["configs"]:
        cells = [MODEL[config]]
        for version in ("old", "one", "new"):
            runs = [step_medians(name, config) for v, name in STREAMS if v == version]
            cells.append(" / ".join(f"{r['ours']:.3f} ({r['ours'] / r['adamw']:.2f}{TIMES})" for r in runs))
        rows.append(cells)
    head = ["model", *(f"step ms, {label[v]} (two runs; {TIMES} AdamW's)" for v in ("old", "one", "new"))]
    text = table(head, rows)
    rows = []
    for model, runs in STREAMS_E2E:
        by = {v: [run_spb(n) for u, n in runs if u == v] for v in ("old", "new")}
        new = commit(runs[1][1])
        rows.append(
            [
                MODEL[f"{model}_water"],
                " / ".join(f"{x:.4f}" for x in by["old"]),
                new,
                " / ".join(f"{x:.4f}" for x in by["new"]),
            ]
        )
    text += "\n\n" + table(["model", "s/batch, 09d614a (two runs)", "against", "s/batch (two runs)"], rows)
    before, after = (load(n)["optimizer_alone"] for n in STREAMS_MEMORY)
    rows = []
    for config in before:
        for variant in ("ours", "ours-torch"):
            a = next(r for r in before[config]["results"] if r["variant"] == variant)
            b = next(r for r in after[config]["results"] if r["variant"] == variant)
            rows.append(
                [
                    MODEL[config],
                    MEMORY_VARIANTS[variant],
                    f"{a['resident_mib']:.1f} / {a['peak_mib']:.1f}",
                    f"{b['resident_mib']:.1f} / {b['peak_mib']:.1f}",
                ]
            )
    text += "\n\n" + table(["model", "optimizer", "MiB resident / peak, 09d614a", "f04f4c5"], rows)
    names = [n for _, n in STREAMS] + [n for _, runs in STREAMS_E2E for _, n in runs] + list(STREAMS_MEMORY)
    return text + "\n\n" + sources(names)


#: The torch stacks captured on a side stream (old: bd35792) or eagerly between the step's graphs (new: d9cf34f).
EAGER_VERSIONS = ["old", "new", "new", "old"]
EAGER_STEP = [(v, f"step_time_h200_2026-11-28_eager_{i}_{v}.json") for i, v in enumerate(EAGER_VERSIONS, 1)]
EAGER_E2E = [(v, f"train_speed_dpa3_h200_2026-11-28_eager_{i}_{v}.json") for i, v in enumerate(EAGER_VERSIONS, 1)]
EAGER_MEMORY = ("eager_stacks_memory_bd35792_h200_2026-11-28.json", "eager_stacks_memory_h200_2026-11-28.json")


def design_eager() -> str:
    """The torch stacks captured (bd35792) or eagerly between the step's graphs (d9cf34f): step, end to end, memory."""
    rows = []
    for config in load(EAGER_STEP[0][1])["configs"]:
        cells = [MODEL[config]]
        for variant in ("ours", "ours-noflash"):
            for version in ("old", "new"):
                runs = [step_medians(n, config) for v, n in EAGER_STEP if v == version]
                cells.append(" / ".join(f"{r[variant]:.3f}" for r in runs))
        rows.append(cells)
    head = ["model", "step ms, captured (two runs)", "between graphs", "torch kernels only: captured", "between graphs"]
    text = table(head, rows)
    spb = {v: " / ".join(f"{run_spb(n):.4f}" for u, n in EAGER_E2E if u == v) for v in ("old", "new")}
    head = ["model", "s/batch, captured (two runs)", "between graphs (two runs)"]
    text += "\n\n" + table(head, [["DPA-3 water", spb["old"], spb["new"]]])
    before, after = (load(n)["optimizer_alone"] for n in EAGER_MEMORY)
    rows = []
    for config in before:
        adamw = next(r for r in after[config]["results"] if r["variant"] == "adamw")["resident_mib"]
        for variant in ("ours", "ours-torch"):
            cells = [MODEL[config], MEMORY_VARIANTS[variant]]
            for d in (before, after):
                r = next(r for r in d[config]["results"] if r["variant"] == variant)
                mib, ratio = (
                    (f"{r[k]:.1f}" for k in ("resident_mib", "peak_mib")),
                    (r[k] / adamw for k in ("resident_mib", "peak_mib")),
                )
                cells.append(" / ".join(mib) + " (" + " / ".join(f"{x:.2f}{TIMES}" for x in ratio) + ")")
            rows.append(cells)
    head = ["model", "optimizer", f"MiB resident / peak ({TIMES} fused AdamW), captured", "between graphs"]
    text += "\n\n" + table(head, rows, right=2)
    names = [n for _, n in EAGER_STEP + EAGER_E2E] + list(EAGER_MEMORY)
    return text + "\n\n" + sources(names)


#: Multi-task: the engine built again at each change of the parameters with a gradient (old: bd35792) or masked (new).
MULTITASK_VERSIONS = ["old", "new", "new", "old"]
MULTITASK_STEP = [(v, f"multitask_step_h200_2026-11-28_{i}_{v}.json") for i, v in enumerate(MULTITASK_VERSIONS, 1)]
MULTITASK_SINGLE = [
    (v, f"step_time_h200_2026-11-28_multitask_{i}_{v}.json") for i, v in enumerate(MULTITASK_VERSIONS, 1)
]
MULTITASK_E2E = [
    (v, f"train_speed_dpa3_multitask_h200_2026-11-28_{i}_{v}.json") for i, v in enumerate(MULTITASK_VERSIONS, 1)
]


def multitask() -> str:
    """Ours' step with branches taking turns, before (bd35792) and after; DPA-3 multi-task end to end; single-task."""
    label = {"old": "bd35792", "new": "220da46"}
    how = {"old": "bd35792 (built again at each change)", "new": "220da46 (the masked step)"}
    ways = [r["way"] for r in load(MULTITASK_STEP[0][1])["rows"] if r["round"] == 1]
    rows = []
    for version in ("old", "new"):
        runs = [load(n)["rows"] for v, n in MULTITASK_STEP if v == version]
        cells = [" / ".join(f"{r['median_ms']:.2f}" for run in runs for r in run if r["way"] == way) for way in ways]
        rows.append([how[version], *cells])
    text = table(["ours", *(f"step ms, {w} (4 rounds)" for w in ways)], rows)
    spb = {v: " / ".join(f"{run_spb(n):.4f}" for u, n in MULTITASK_E2E if u == v) for v in ("old", "new")}
    head = ["model", f"s/batch, {label['old']} (two runs)", f"{label['new']} (two runs)"]
    text += "\n\n" + table(head, [["DPA-3 water, two branches", spb["old"], spb["new"]]])
    rows = []
    for config in load(MULTITASK_SINGLE[0][1])["configs"]:
        runs = {v: [step_medians(n, config)["ours"] for u, n in MULTITASK_SINGLE if u == v] for v in ("old", "new")}
        rows.append([MODEL[config], *(" / ".join(f"{x:.3f}" for x in runs[v]) for v in ("old", "new"))])
    head = ["model (single-task)", f"step ms, {label['old']} (two runs)", f"{label['new']} (two runs)"]
    text += "\n\n" + table(head, rows)
    names = [n for _, n in MULTITASK_STEP + MULTITASK_E2E + MULTITASK_SINGLE]
    return text + "\n\n" + sources(names)


TRITON_STEP = [f"step_time_h200_2026-11-28_triton_r{r}.json" for r in (1, 2)]
TRITON_E2E = [
    f"train_speed_dpa3_h200_2026-11-28_triton_{i}_{v}.json"
    for i, v in enumerate(("with", "without", "without", "with"), 1)
]


def design_triton() -> str:
    """Ours with and without the Triton kernels (``flash_muon`` false): step (two rounds), DPA-3 end to end."""
    rows = []
    for config in load(TRITON_STEP[0])["configs"]:
        runs = [step_medians(name, config) for name in TRITON_STEP]
        rows.append(
            [MODEL[config], *(" / ".join(f"{r[v]:.3f}" for r in runs) for v in ("ours", "ours-noflash", "adamw"))]
        )
    text = table(["model", "step ms, Triton kernels (two rounds)", "torch kernels only", "AdamW"], rows)
    by = {v: [run_spb(n) for n in TRITON_E2E if n.endswith(f"_{v}.json")] for v in ("with", "without")}
    text += "\n\n" + table(
        ["model", "s/batch, Triton kernels (two runs)", "torch kernels only (two runs)"],
        [["DPA-3 water", *(" / ".join(f"{x:.4f}" for x in by[v]) for v in ("with", "without"))]],
    )
    return text + "\n\n" + sources(TRITON_STEP + TRITON_E2E)


def design_ddp_split() -> str:
    d = load("ddp_split_h200x2_2026-11-23.json")
    rows = [
        [
            r["case"],
            f"{r['ns_cost_saved']:.1e}",
            f"{r['off']['median_ms']:.3g}",
            f"{r['always']['median_ms']:.3g}",
            f"{r['ratio']:.2f}",
        ]
        for r in d["rows"]
        if r.get("off") and r.get("always")
    ]
    head = ["case", "NS cost saved per rank", '`"off"` ms (batched step)', '`"always"` ms (split)']
    head.append(f'`"always"`: {TIMES} the time of `"off"`')
    return table(head, rows) + "\n\n" + sources(["ddp_split_h200x2_2026-11-23.json"])


def design_alignment() -> str:
    name = "kernel_alignment_h100_2026-11-25.json"
    rows = [
        [
            r["config"].removesuffix("_water"),
            f"{r['commit']}: {r['specialised_on']}",
            " + ".join(f"{us:.0f}" for us in r["phased_us"]),
            f"{r['replay_gpu_ms'] * 1000:.0f}",
        ]
        for r in load(name)["rows"]
    ]
    head = ["model", "pointers specialised on", "phased kernel µs (each launch)", "whole step µs (GPU)"]
    return table(head, rows, right=2) + "\n\n" + sources([name])


# ---------------------------------------------------------------------------------- memory

#: memory.py's variants as the memory tables name them.
MEMORY_VARIANTS = {
    "ours": "ours",
    "ours-eager": "ours without the CUDA graph (`engine-eager`)",
    "ours-torch": "ours, torch kernels (`flash_muon: false`)",
    "adamw": "fused AdamW",
    "builtin": "built-in",
    "torch-muon": "torch.optim.Muon + AdamW",
}


def memory_files() -> list[str]:
    """The results files of ``benchmarks/memory.py`` measured on CUDA (a CPU run records no memory), oldest first."""
    names = [p.name for p in RESULTS.glob("memory_*.json")]
    cuda = [n for n in names if str((load(n).get("environment") or {}).get("device", "")).startswith("cuda")]
    return sorted(cuda, key=lambda n: source(n)["date"])


def _mib(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _times(a: float | None, b: float | None) -> str:
    """``a`` as a multiple of ``b`` (memory, not time), or nothing."""
    return "" if a is None or not b else f"{a / b:.2f}{TIMES}"


def memory() -> str:
    """The memory an optimizer holds (the optimizer alone), and the peak of whole ``dp --pt train`` runs."""
    names = memory_files()
    if not names:
        return (
            "No results yet: `python benchmarks/memory.py` on a GPU writes "
            "`benchmarks/results/memory_<gpu>_<date>.json`."
        )
    rows: dict[tuple[str, str], list[str]] = {}  # (model, variant): the latest measurement only
    train_rows: dict[tuple[str, str], list[str]] = {}  # likewise
    # fused AdamW per model, from the latest file that measured it
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
            for r in entry["results"]:
                cells = [MODEL.get(config, config), when, size, MEMORY_VARIANTS.get(r["variant"], r["variant"])]
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
                    MEMORY_VARIANTS.get(r["variant"], r["variant"]).replace("fused AdamW", "AdamW"),
                    str(r["steps"]),
                    _mib(peak) if not r["problems"] else "failed",
                    _times(peak, adamw_peak),
                ]
    head = ["model", "date, commit", "parameters", "optimizer", "resident MiB", "peak MiB"]
    head += [f"resident: {TIMES} fused AdamW's", f"peak: {TIMES} fused AdamW's"]
    order = {key: i for i, key in enumerate([*MODEL, *MEMORY_VARIANTS])}  # models, then variants, as their tables
    ordered = sorted(rows.items(), key=lambda item: tuple(order.get(key, len(order)) for key in item[0]))
    text = table(head, [cells for _, cells in ordered], right=4)
    if train_rows:
        head = ["model", "date, commit", "optimizer", "steps", "`dp --pt train` peak MiB", f"{TIMES} AdamW's"]
        text += "\n\n" + table(head, list(train_rows.values()), right=3)
    return text + "\n\n" + sources(names)


#: Blocks that BENCHMARKS.md need not have yet (their measurement has no results there): rendered where it has them.
OPTIONAL_BLOCKS = {"memory"}

BLOCKS = {
    "end-to-end": end_to_end,
    "time-to-accuracy": time_to_accuracy,
    "learning-rate": learning_rate,
    "several-gpus": several_gpus,
    "several-gpus-summary": several_gpus_summary,
    "several-gpus-pairs": several_gpus_pairs,
    "scaling": scaling,
    "cost-model": cost_model,
    "step-alone": step_alone,
    "step-spread": step_spread,
    "cold-start": cold_start,
    "design-phased": design_phased,
    "design-magma": design_magma,
    "design-families": design_families,
    "cpu-step": cpu_step,
    "cpu-train": cpu_train,
    "cpu-time-to-accuracy": cpu_time_to_accuracy,
    "step-before-after": step_before_after,
    "design-graph": design_graph,
    "design-stacks": design_stacks,
    "design-triton": design_triton,
    "design-eager": design_eager,
    "multitask": multitask,
    "design-ddp-split": design_ddp_split,
    "design-alignment": design_alignment,
    "memory": memory,
}


def render(text: str) -> str:
    """``text`` with every generated block replaced by what the results give now."""
    for name, make in BLOCKS.items():
        pattern = re.compile(rf"(<!-- generated:{name} -->\n)(?:.*?\n)?(<!-- /generated:{name} -->)", re.S)
        if not pattern.search(text):
            if name in OPTIONAL_BLOCKS:
                continue
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
    steps = {m: step_medians(STEP, m) for m in load(STEP)["configs"]}
    vs_fused = [s["ours"] / s["adamw"] for s in steps.values()]
    of_batch = [steps[r["model"]]["ours"] / 1000 / r["ours"][0] for r in e2e]  # the step's share of a batch
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
        f"{ours_s / adamw_s:.2f}{TIMES} AdamW's time",
        f"and a batch costs {min(cpu_batch):.2f}{DASH}{max(cpu_batch):.2f}{TIMES} AdamW's",
        f"{min(vs_adamw):.2f}{DASH}{max(vs_adamw):.2f}{TIMES} AdamW's s/batch",
        f"DPA-2 small, whose batch is three times shorter: {d2['ours'][0] / d2['adamw'][0]:.2f}{TIMES} AdamW's",
        f"{min(vs_builtin):.2f}{DASH}{max(vs_builtin):.2f}{TIMES} the time of deepmd-kit's built-in HybridMuon",
        f"{ours3:.2f} ms against the built-in's {builtin3:.0f} ms",
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
