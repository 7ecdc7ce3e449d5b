"""The documents' numbers come from benchmarks/results: BENCHMARKS.md's tables and the README's figures."""

from __future__ import annotations

import json
import re
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
    """A results file that neither document names is gone (git keeps it): one folder per question, nothing else."""
    text = (ROOT / "BENCHMARKS.md").read_text() + (ROOT / "README.md").read_text()
    named = set(re.findall(r"[\w.-]+\.(?:json|md|txt|png)", text))
    patterns = [re.escape(p).replace(r"\*", r"[\w.-]*") for p in re.findall(r"[\w.-]*\*[\w.-]*\.\w+", text)]
    results = ROOT / "benchmarks" / "results"
    loose = [p.name for p in results.iterdir() if p.is_file() and p.name != "provenance.json"]
    assert not loose, f"results files outside a question's folder: {loose}"
    for path in results.glob("*/*"):
        if path.name not in named and not any(re.fullmatch(p, path.name) for p in patterns):
            raise AssertionError(f"{path.relative_to(ROOT)} is cited by neither BENCHMARKS.md nor README.md")


def test_the_readme_figures_are_the_results():
    readme = " ".join((ROOT / "README.md").read_text().split())  # a claim may wrap across lines
    for claim in benchmarks_doc.readme_claims():
        assert claim in readme, claim


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
