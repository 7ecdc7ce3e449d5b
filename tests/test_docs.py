"""The documents' numbers come from benchmarks/results: BENCHMARKS.md's tables and the README's figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import benchmarks_doc  # noqa: E402


def test_benchmarks_md_is_what_the_generator_makes_of_the_results():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert benchmarks_doc.render(text) == text, "run python benchmarks/benchmarks_doc.py"


def test_the_generator_is_deterministic():
    text = (ROOT / "BENCHMARKS.md").read_text()
    assert benchmarks_doc.render(text) == benchmarks_doc.render(benchmarks_doc.render(text))


def test_every_source_names_machine_date_commit_and_command():
    text = (ROOT / "BENCHMARKS.md").read_text()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*/*.json")):
        if f"`{path.relative_to(path.parents[1]).as_posix()}`" not in text:
            continue
        s = benchmarks_doc.source(path.name)
        assert all(s.get(k) for k in ("machine", "date", "commit", "command")), path.name


def test_every_results_file_is_cited():
    """A results file that no document names is gone (git keeps it): one folder per question, nothing else."""
    text = "".join((ROOT / doc).read_text() for doc in ("BENCHMARKS.md", "README.md", "examples/README.md"))
    named = set(re.findall(r"[\w.-]+\.(?:json|md|txt|png)", text))
    patterns = [re.escape(p).replace(r"\*", r"[\w.-]*") for p in re.findall(r"[\w.-]*\*[\w.-]*\.\w+", text)]
    results = ROOT / "benchmarks" / "results"
    loose = [p.name for p in results.iterdir() if p.is_file() and p.name != "provenance.json"]
    assert not loose, f"results files outside a question's folder: {loose}"
    for path in results.glob("*/*"):
        if path.name not in named and not any(re.fullmatch(p, path.name) for p in patterns):
            raise AssertionError(f"{path.relative_to(ROOT)} is cited by no document")


def test_the_readme_figures_are_the_results():
    readme = " ".join((ROOT / "README.md").read_text().split())  # a claim may wrap across lines
    for claim in benchmarks_doc.readme_claims():
        assert claim in readme, claim


QUICKSTART = ROOT / "benchmarks" / "results" / "quickstart"


def quickstart_runs() -> list[dict]:
    """The recorded runs of the README's Quickstart: those transcribed, then benchmarks/quickstart.py's files.

    Each with ``seconds`` ("first command", "install", "training"), ``average_s_per_batch`` and ``rmse_f_val``
    (the validation force RMSE of lcurve.out's first and last rows). The earlier runs skipped the CPU-only torch
    line and installed PyPI's torch in the first command; where that line ran, its time counts in "install" and in
    "first command", so that each covers installing everything.
    """
    runs = json.loads((QUICKSTART / "quickstart_earlier_runs.json").read_text())["runs"]
    for path in sorted(QUICKSTART.glob("quickstart_cpu*.json")):
        run = json.loads(path.read_text())
        took = {c["command"].split(" &&")[0]: c["seconds"] for c in run["commands"]}
        torch_line = next((s for c, s in took.items() if c.startswith("pip install torch")), 0.0)
        seconds = {
            **run["seconds"],
            "install": torch_line + run["seconds"]["install"],
            "first command": torch_line + took["pip install ."],
        }
        rmse = run["lcurve"]["rmse_f_val"]
        runs.append({**run, "seconds": seconds, "rmse_f_val": [rmse[0], rmse[-1]]})
    return runs


def _span(values: list, form: str, unit: str = "") -> str:
    """The range of the known ``values`` as the documents write it: ``174–481 s``, or one value."""
    known = [v for v in values if v is not None]
    low, high = f"{min(known):{form}}", f"{max(known):{form}}"
    return f"{low}{unit}" if low == high else f"{low}{benchmarks_doc.DASH}{high}{unit}"


def _lcurve_table(run: dict) -> str:
    """The example's table of lcurve.out rows (steps 1, 500, 1000, 2000), two significant figures."""
    columns = ("rmse_e_val", "rmse_e_trn", "rmse_f_val", "rmse_f_trn", "lr")
    curve = run["lcurve"]
    rows = [curve["step"].index(s) for s in (1, 500, 1000, 2000) if s in curve["step"]]
    lines = ["| step | " + " | ".join(columns) + " |", "| --- " * (len(columns) + 1) + "|"]
    lines += [f"| {curve['step'][i]:.0f} | " + " | ".join(f"{curve[c][i]:.2g}" for c in columns) + " |" for i in rows]
    return "\n".join(lines)


def quickstart_claims() -> dict[str, list[str]]:
    """The Quickstart's figures in README.md and examples/README.md, as the texts must state them."""
    runs = quickstart_runs()
    seconds = {k: [r["seconds"].get(k) for r in runs] for k in ("first command", "install", "training")}
    rmse = [r["rmse_f_val"] for r in runs]
    recorded = [r for r in runs if "bytes" in r]
    loads = [x for r in recorded for x in r["load_1min"]["samples"]]
    size = {k: [r["bytes"][k] / 1e9 for r in recorded] for k in ("downloaded", "venv", "cuda")}
    tested = [r["tests"] for r in runs if "tests" in r][-1]
    common = [
        f"in {len(runs)} runs",
        f"it took {_span(seconds['first command'], '.0f', ' s')}",
        f"the install {_span(seconds['install'], '.0f', ' s')}, the training {_span(seconds['training'], '.0f', ' s')}",
        f"at {_span([r['average_s_per_batch'] for r in runs], '.3f')} s/batch",
        f"from {_span([f for f, _ in rmse], '.2f')} to {_span([last for _, last in rmse], '.2g')} eV/Å",
    ]
    readme = [
        *common,
        f"a load average of {_span(loads, '.1f')}",
        f"downloads {_span(size['downloaded'], '.1f')} GB and takes {_span(size['venv'], '.1f')} GB on disk, "
        f"{_span(size['cuda'], '.1f')} GB of it CUDA libraries",
        f"it leaves out the {_span(size['cuda'], '.1f')} GB of CUDA libraries",
        f"{tested['passed'] + tested['skipped']:,} tests ({tested['passed']:,} passed, {tested['skipped']:,} skipped "
        f"without a GPU) took {tested['seconds'] / 60:.0f} minutes",
    ]
    examples = [
        *common,
        f"{recorded[-1]['seconds']['data']:.0f} s on a busy 2-core machine",
        _lcurve_table(recorded[-1]),
    ]
    return {"README.md": readme, "examples/README.md": examples}


def test_the_quickstart_figures_are_the_recorded_runs():
    runs = quickstart_runs()
    slowest = max(runs, key=lambda r: r["seconds"]["first command"])
    assert "load_1min" in slowest  # the README: the run that recorded its load was the slowest
    for name, claims in quickstart_claims().items():
        text = (ROOT / name).read_text()
        flat = " ".join(text.split())  # a claim may wrap across lines
        for claim in claims:
            assert claim in (text if "\n" in claim else flat), (name, claim)


def test_the_water_readme_describes_its_data():
    import numpy as np

    data = ROOT / "examples" / "water" / "data"
    sets = sorted(data.glob("data_*/set.*"))
    frames = [len(np.load(s / "coord.npy")) for s in sets]
    boxes = np.concatenate([np.load(s / "box.npy") for s in sets])
    types = {(d / "type.raw").read_text() for d in data.glob("data_*")}
    [kinds] = [t.split() for t in types]  # every system the same atoms
    assert np.allclose(boxes, boxes[0]) and len(set(frames)) == 1  # one box, as many frames in every set
    text = " ".join((data.parent / "README.md").read_text().split())
    claim = (
        f"{kinds.count('0')} water molecules ({len(kinds)} atoms, types `O` and `H`) in a periodic box of "
        f"{boxes[0][0]:.2f} Å, {sum(frames)} frames in all ({frames[0]} per `set.*` folder)"
    )
    assert claim in text, claim


def test_the_benchmark_inputs_and_their_data_ship_with_the_repository():
    import common

    assert common.DEFAULT_CONFIG_DIR.is_relative_to(ROOT)
    for name in benchmarks_doc.MODEL:
        config = json.loads((common.DEFAULT_CONFIG_DIR / f"{name}.json").read_text())
        for key in ("training_data", "validation_data"):
            for system in config["training"][key]["systems"]:
                assert not Path(system).is_absolute(), (name, system)
                assert (common.DEFAULT_CONFIG_DIR / system / "type.raw").is_file(), (name, system)


def test_no_file_names_a_path_outside_the_repository():
    outside = re.compile(r"(?<![\w.$])/(work|root|home|opt|tmp)/|\.\./shared")
    beside = re.compile(r"parents\[2\]")  # from tests/ or benchmarks/: the folder above the repository
    files = [ROOT / n for n in ("README.md", "BENCHMARKS.md", "pyproject.toml")]
    for folder in ("benchmarks", "deepmd_hybridmuon", "examples", "tests", ".ci"):
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix not in (".npy", ".png", ".pyc")]
    for path in files:
        text = path.read_text(errors="replace")
        assert not outside.search(text), (path, outside.search(text).group(0))
        if path.parent.name in ("tests", "benchmarks"):
            assert not beside.search(text), path


def test_the_measurements_stay_as_small_as_their_questions():
    # A reader finds an answer within a short page, and the scripts stay few enough to keep working: the limits the
    # team set when BENCHMARKS.md had grown to 1,079 lines and benchmarks/ to 25 scripts.
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400
    scripts = [p for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh")]
    assert len(scripts) <= 10
    assert sum(len(p.read_text().splitlines()) for p in scripts) <= 3000


def test_the_examples_learning_rate_table_is_its_results_file():
    # The sweep of examples/README.md, row by row as recorded (transcribed where it was first reported).
    data = json.loads((ROOT / "benchmarks/results/quality/example_lr_sweep_2026-11-22.json").read_text())
    readme = (ROOT / "examples" / "README.md").read_text()
    rows = [f"| {r['optimizer']} | {r['schedule']} | {r['final_rmse_f_val']} |" for r in data["rows"]]
    assert len(rows) == 12 and all(row in readme for row in rows)
    assert "`benchmarks/results/quality/example_lr_sweep_2026-11-22.json`" in readme


def test_the_examples_data_table_is_what_make_data_writes(tmp_path):
    # examples/README.md's table of the bundled data, from make_data.py's defaults (seeded): it writes the same data
    # everywhere. About 10 s on 2 cores.
    script = ROOT / "examples" / "make_data.py"
    out = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = (ROOT / "examples" / "README.md").read_text().splitlines()
    for name in ("train", "valid"):
        stats = rf"{name}: (\d+) frames .*\n  E/atom (\S+) \.\. (\S+) eV .*force std (\S+) eV/A, max \|F\| (\S+) eV/A"
        frames, low, high, std, peak = re.search(stats, out.stdout).groups()
        [row] = [line for line in lines if line.startswith(f"| `data/{name}` | {frames}")]
        assert row.endswith(f"| {float(low):.2f} … {float(high):.2f} | {float(std):.2f} | {float(peak):.1f} |"), row
