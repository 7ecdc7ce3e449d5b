"""The documents' numbers come from benchmarks/results: BENCHMARKS.md's tables and the README's figures."""

from __future__ import annotations

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
    for name in sorted(p.name for p in (ROOT / "benchmarks" / "results").glob("*.json")):
        if name == "provenance.json" or f"`{name}`" not in (ROOT / "BENCHMARKS.md").read_text():
            continue
        s = benchmarks_doc.source(name)
        assert all(s.get(k) for k in ("machine", "date", "commit", "command")), name


def test_the_readme_figures_are_the_results():
    readme = " ".join((ROOT / "README.md").read_text().split())  # a claim may wrap across lines
    for claim in benchmarks_doc.readme_claims():
        assert claim in readme, claim
