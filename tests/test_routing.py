"""Routing parity with deepmd-kit 3.2.0's built-in HybridMuon on real deepmd models."""

from __future__ import annotations

import pytest
import torch
from conftest import MODEL_NAMES, model_named_parameters

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import functional as F

MODES = ("2d", "flat", "slice")
#: Built-in route list -> our route name.
_BUILTIN_ROUTES = {"muon_params": "muon", "adam_no_decay": "adam", "adam_decay": "adamw"}


def builtin_routing(named: list[tuple[str, torch.Tensor]], mode: str) -> dict[int, tuple[str, tuple | None]]:
    """``id(param) -> (route, (batch, rows, cols) or None)`` from the built-in's own routing."""
    from deepmd.pt.optimizer.hybrid_muon import HybridMuonOptimizer as Builtin

    params = [p for _, p in named]
    opt = Builtin(params, muon_mode=mode, named_parameters=named)
    opt._build_param_routing()
    table: dict[int, tuple[str, tuple | None]] = {}
    assert len(opt._routing) == 1
    for key, route in _BUILTIN_ROUTES.items():
        for entry in opt._routing[0][key]:
            view = (entry["batch_size"], entry["rows"], entry["cols"]) if route == "muon" else None
            assert id(entry["param"]) not in table
            table[id(entry["param"])] = (route, view)
    assert len(table) == len(params)
    return table


def our_routing(named: list[tuple[str, torch.Tensor]], mode: str) -> dict[int, tuple[str, tuple | None]]:
    """The same table from :meth:`HybridMuonOptimizer.routing_table`, checked against ``route_parameter``."""
    params = [p for _, p in named]
    opt = HybridMuonOptimizer(params, muon_mode=mode, named_parameters=named)
    rows = opt.routing_table()
    assert [r["name"] for r in rows] == [n for n, _ in named]
    table = {}
    for (name, p), row in zip(named, rows, strict=True):
        assert row["shape"] == tuple(p.shape)
        direct = F.route_parameter(name, p.shape, mode)
        assert (row["route"], row["view"]) == (direct.route, direct.view)
        table[id(p)] = (row["route"], row["view"])
    return table


def compare(named: list[tuple[str, torch.Tensor]], mode: str) -> dict[str, set[str]]:
    """Assert our routes and views equal the built-in's; return {route: names}."""
    ours = our_routing(named, mode)
    theirs = builtin_routing(named, mode)
    mismatches = [(n, tuple(p.shape), ours[id(p)], theirs[id(p)]) for n, p in named if ours[id(p)] != theirs[id(p)]]
    assert not mismatches, mismatches
    by_route: dict[str, set[str]] = {"muon": set(), "adam": set(), "adamw": set()}
    for n, p in named:
        by_route[ours[id(p)][0]].add(n)
    return by_route


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_routing_matches_builtin_on_real_models(model: str) -> None:
    named = model_named_parameters(model)
    seen: dict[str, set[str]] = {"muon": set(), "adam": set(), "adamw": set()}
    for mode in MODES:
        for route, names in compare(named, mode).items():
            seen[route] |= names
    # The comparison is only meaningful if the model exercises the routes. deepmd-kit's
    # se_e2_a / DPA-2 / DPA-3 create only rank <= 2 parameters without adam_/adamw_
    # names, so their AdamW route is empty in every mode (the full-size inputs in
    # examples/water likewise); test_routing_matches_builtin_on_synthetic_names
    # covers AdamW and rank >= 3 views.
    assert seen["muon"], "no Muon parameter"
    assert seen["adam"], "no Adam parameter"
    # The parameter kinds these models are known to contain, by route:
    assert any(n.endswith(".matrix") for n in seen["muon"])
    assert any(n.endswith(".bias") for n in seen["adam"])
    # ParameterList entries (compress_info.0, g1_residual.2, ...): the index is skipped.
    assert any(n.split(".")[-1].isdigit() for n in seen["adam"])
    sizes = {tuple(p.shape) for _, p in named}
    if model in ("se_e2_a", "dpa2"):
        assert (0,) in sizes  # deepmd's size-0 compression placeholders
    # (n, 1) / (1, n) matrices have effective rank 1 -> Adam, though named "matrix".
    assert any(n.endswith(".matrix") for n in seen["adam"])


def _synthetic_named() -> list[tuple[str, torch.Tensor]]:
    """Names and shapes deepmd's SeZM/DPA-4 style models use, beyond the three above."""
    shapes = {
        "blocks.0.so2.weight": (3, 4, 5),  # rank 3: 2d -> AdamW, flat -> (1, 12, 5), slice -> (3, 4, 5)
        "blocks.0.so2.weight_m0": (2, 1, 3, 6),  # a size-1 dim inside
        "blocks.0.grid.kernel": (2, 3, 4, 5),
        "blocks.0.square": (1, 6, 6),
        "blocks.0.attn.adamw_attn_logit_w": (4, 8),  # adamw_ by name, matrix by shape
        "blocks.0.attn.adamw_pseudo_query": (8,),
        "blocks.0.attn.ADAMW_gate.1": (3, 2, 2),
        "blocks.0.norm.adam_scale": (4, 8),
        "blocks.0.norm.Adam_Scale.0": (8,),
        "blocks.0.ffn.b": (4, 8),
        "blocks.0.ffn.bias0": (4,),
        "blocks.0.ffn.focus_compete_bias": (2, 3, 4),
        "blocks.0.ffn.b.3": (5, 5),
        "blocks.0.lora.A_by_l": (3, 1, 8, 2),
        "blocks.0.lora.B": (2, 8),  # the leaf is lower-cased first, so "B" is "b": Adam
        "blocks.0.scalar": (),
        "blocks.0.ones": (1, 1, 1),
        "blocks.0.empty": (0, 4),
        "blocks.0.empty3": (2, 0, 4),
    }
    gen = torch.Generator().manual_seed(0)
    return [(n, torch.nn.Parameter(torch.randn(s, generator=gen))) for n, s in shapes.items()]


@pytest.mark.parametrize("mode", MODES)
def test_routing_matches_builtin_on_synthetic_names(mode: str) -> None:
    named = _synthetic_named()
    by_route = compare(named, mode)
    assert by_route["muon"] and by_route["adam"] and by_route["adamw"]
    assert "blocks.0.attn.adamw_attn_logit_w" in by_route["adamw"]
    assert "blocks.0.lora.B" in by_route["adam"]  # the leaf is lower-cased before the "b" test
    assert ("blocks.0.so2.weight" in by_route["adamw"]) == (mode == "2d")


def test_unnamed_parameters_route_by_shape() -> None:
    # Without named_parameters both optimizers route by shape alone.
    named = _synthetic_named()
    unnamed = [(None, p) for _, p in named]
    for mode in MODES:
        from deepmd.pt.optimizer.hybrid_muon import HybridMuonOptimizer as Builtin

        params = [p for _, p in named]
        builtin = Builtin(params, muon_mode=mode)
        builtin._build_param_routing()
        theirs = {}
        for key, route in _BUILTIN_ROUTES.items():
            for e in builtin._routing[0][key]:
                theirs[id(e["param"])] = (route, (e["batch_size"], e["rows"], e["cols"]) if route == "muon" else None)
        rows = HybridMuonOptimizer(params, muon_mode=mode).routing_table()
        assert all(r["name"] is None for r in rows)
        ours = {id(p): (r["route"], r["view"]) for (_, p), r in zip(unnamed, rows, strict=True)}
        assert ours == theirs


def test_torch_named_parameters_route_by_their_names() -> None:
    """``HybridMuonOptimizer(model.named_parameters())``, torch's idiom: the names route, as with named_parameters=.

    (deepmd's built-in routes such parameters by shape alone; ``dp`` passes names by keyword to either.)
    """
    named = _synthetic_named()
    by_keyword = HybridMuonOptimizer([p for _, p in named], named_parameters=named).routing_table()
    groups = [{"params": [p for _, p in named[:5]], "param_names": [n for n, _ in named[:5]]}]
    opt = HybridMuonOptimizer(groups)
    opt.add_param_group({"params": [p for _, p in named[5:]], "param_names": [n for n, _ in named[5:]]})
    assert HybridMuonOptimizer(named).routing_table() == by_keyword
    assert opt.routing_table() == by_keyword
    assert any(r["route"] == "adamw" for r in by_keyword)  # a name decided a route here
