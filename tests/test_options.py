"""The table of options (deepmd_hybridmuon/options.py) is the one source: what lists options agrees with it."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from conftest import make_optimizer
from test_parity import TORCH_MUON_TOL

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon.options import GROUP_KEYS, OPTION, OPTIONS
from deepmd_hybridmuon.schema import hybrid_muon_arguments, options_markdown
from deepmd_hybridmuon.validation import LEGACY_KEYS, REMOVED_KEYS

#: The input keys, each with its row (the items of a tuple option are input keys of their own).
INPUT_ROWS = {row.name: row for option in OPTIONS for row in option.items or (option,) if row.input_key}
#: The constructor's options: param_group keys and settings of the whole optimizer.
CONSTRUCTOR_ROWS = [option for option in OPTIONS if option.scope in ("group", "optimizer")]


def test_every_row_is_well_formed():
    assert len(OPTION) == len(OPTIONS)  # names are unique
    for option in OPTIONS:
        assert option.scope in ("group", "optimizer", "legacy", "removed"), option.name
        live = option.scope in ("group", "optimizer")
        assert (option.effect in ("build", "step")) if live else option.effect is None, option.name
        assert option.doc, option.name


def test_the_schema_is_the_table():
    arguments = {a.name: a for a in hybrid_muon_arguments()}
    assert list(arguments) == list(INPUT_ROWS)  # the order dp check prints
    for name, row in INPUT_ROWS.items():
        argument = arguments[name]
        assert set(argument.dtype) == set(row.types), name
        assert list(argument.alias) == list(row.alias), name
        if row.scope != "removed":
            assert argument.default == row.default, name
    assert set(LEGACY_KEYS) == {o.name for o in OPTIONS if o.scope == "legacy"}
    assert set(REMOVED_KEYS) == {o.name for o in OPTIONS if o.scope == "removed"}


def test_the_constructor_defaults_are_the_table():
    signature = inspect.signature(HybridMuonOptimizer).parameters
    assert {o.name: signature[o.name].default for o in CONSTRUCTOR_ROWS} == {
        o.name: o.default for o in CONSTRUCTOR_ROWS
    }
    opt = HybridMuonOptimizer([torch.nn.Parameter(torch.ones(4, 3))])
    assert {key: opt.param_groups[0][key] for key in GROUP_KEYS} == {key: OPTION[key].default for key in GROUP_KEYS}
    assert {o.name: getattr(opt, o.name) for o in OPTIONS if o.scope == "optimizer"} == {
        o.name: o.default for o in OPTIONS if o.scope == "optimizer"
    }


def test_the_constructor_docstring_documents_every_parameter_in_order_with_the_tables_text():
    parameters = inspect.getdoc(HybridMuonOptimizer).split("Parameters\n----------\n", 1)[1]
    assert re.findall(r"^\**(\w+)$", parameters, re.M) == list(inspect.signature(HybridMuonOptimizer).parameters)
    flowing = " ".join(parameters.split())
    for option in CONSTRUCTOR_ROWS:
        assert " ".join(option.doc.split()) in flowing, option.name


def test_the_constructor_docstring_survives_python_313s_dedent():
    # Python 3.13 compiles docstrings with their common indentation removed: the entries follow the heading.
    from deepmd_hybridmuon.optimizer import _parameters_doc

    doc = _parameters_doc("Summary.\n\nParameters\n----------\nparams\n    Parameters or param_group dicts.\n")
    entries = doc.split("----------\n", 1)[1]
    assert re.findall(r"^\**(\w+)$", entries, re.M) == list(inspect.signature(HybridMuonOptimizer).parameters)
    assert "\nlr\n    Learning rate" in entries


def test_the_group_keys_are_the_rows_of_scope_group():
    assert all(OPTION[key].scope == "group" for key in GROUP_KEYS)
    assert set(GROUP_KEYS) == {o.name for o in OPTIONS if o.scope == "group"}


def test_the_readme_block_is_generated_from_the_table():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- options:start -->\n", 1)[1].split("\n<!-- options:end -->", 1)[0]
    assert block == options_markdown()
    cells = [line.strip("| ").split(" | ") for line in block.splitlines()[2:]]
    listed = [c[0].split("`")[1] for c in cells if c[0] != "\N{EM DASH}"]
    assert listed == [name for name, row in INPUT_ROWS.items() if row.scope != "removed"]
    # every keyword of the constructor that sets an option, beside the input key it comes from
    keywords = inspect.signature(HybridMuonOptimizer).parameters
    named: dict[str, list[str]] = {}  # keyword: its first row
    for c in cells:
        if c[1] != "\N{EM DASH}":
            named.setdefault(c[1].strip("`").split("[")[0], c)
    assert set(named) == {k for k in keywords if k in OPTION}
    assert named["adam_betas"][0] == "`adam_beta1`" and named["lr"][0] == "\N{EM DASH}"  # dp takes lr elsewhere
    assert named["lr"][3] == f"`{keywords['lr'].default}`" == "`0.0005`"  # the constructor's default lr


#: A valid value other than the default, for every option of the constructor.
CHANGED = {
    "lr": 1e-3,
    "momentum": 0.9,
    "adam_betas": (0.8, 0.9),
    "weight_decay": 0.002,
    "lr_adjust": 2.0,
    "lr_adjust_coeff": 0.2,
    "muon_mode": "flat",
    "enable_gram": False,
    "flash_muon": False,
    "magma_muon": False,
    "nonfinite_across_ranks": True,
}


def _moved(implementation: str, key: str) -> tuple[list[torch.Tensor], bool]:
    """Two steps with ``key`` changed in between: what the parameters moved, and whether the change stales the engine.

    ``execution_table()`` describes the engine of the last step only while that engine fits the options.
    """
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((2, 4, 3), (4, 3), (3,))]
    start = [p.detach().clone() for p in params]
    opt = make_optimizer(params, implementation, lr=1e-2)
    stale = False
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        assert opt.execution_table()[0]["implementation"] == ("loop" if implementation == "loop" else "engine")
        if step == 0:
            if OPTION[key].scope == "group":
                opt.param_groups[0][key] = CHANGED[key]
            else:
                setattr(opt, key, CHANGED[key])
            stale = opt.execution_table()[0]["implementation"] != "engine"
    return [p.detach() - s for p, s in zip(params, start, strict=True)], stale


def test_every_option_of_the_constructor_has_a_changed_value():
    assert set(CHANGED) == {o.name for o in CONSTRUCTOR_ROWS}


@pytest.mark.parametrize("key", CHANGED)
def test_a_build_option_rebuilds_the_engine_and_a_step_option_does_not(key):
    """Either way the change takes effect at the next step, as in the loop (read each step)."""
    moved, stale = _moved("engine", key)
    assert stale == (OPTION[key].effect == "build"), key
    reference, _ = _moved("loop", key)
    for engine, loop in zip(moved, reference, strict=True):
        assert ((engine - loop).norm() / loop.norm()).item() < TORCH_MUON_TOL, key


def test_weight_decay_is_read_each_step_but_its_passes_exist_or_not():
    opt = make_optimizer([torch.nn.Parameter(torch.ones(4, 3))], "engine")
    opt.param_groups[0]["params"][0].grad = torch.ones(4, 3)
    opt.step()
    opt.param_groups[0]["weight_decay"] = 0.0  # the engine was built with decay passes
    assert opt.execution_table()[0]["implementation"] == "loop"
