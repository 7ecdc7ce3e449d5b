"""``dp-hybridmuon``: check a ``dp train`` input before a long run.

deepmd-kit's ``dp`` has no plugin hook for new subcommands, so the check ships as
this console script (also ``python -m deepmd_hybridmuon check input.json``).
"""

from __future__ import annotations

import argparse
import copy
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["check_input", "main"]


class CheckError(Exception):
    """The input is invalid; the message says where and why."""


def _load(path: str) -> dict[str, Any]:
    from deepmd.common import j_loader

    try:
        return j_loader(path)
    except FileNotFoundError as err:
        raise CheckError(f"{path}: no such file") from err
    except ValueError as err:
        raise CheckError(f"{path}: cannot be parsed: {err}") from err


def _with_value(message: str, path: str, jdata: dict[str, Any]) -> str:
    """Append the offending value to a dargs message (dargs names the key but not the value)."""
    match = re.search(r"key `([^`]+)`", message)
    if match is None:
        return message
    node: Any = jdata
    for part in [p for p in path.split("/") if p] + [match.group(1)]:
        if not isinstance(node, dict) or part not in node:
            return message
        node = node[part]
    return f"{message} (got {node!r})"


def _normalize(jdata: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """deepmd's compat conversion and normalisation, our schema registered; collect warnings."""
    from dargs.dargs import ArgumentError
    from deepmd.utils.argcheck import normalize
    from deepmd.utils.compat import update_deepmd_input

    from .plugin import register_schema
    from .schema import resolve_legacy_keys

    register_schema()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jdata = update_deepmd_input(jdata, warning=True)
        multi_task = "model_dict" in jdata.get("model", {})
        try:
            jdata = normalize(copy.deepcopy(jdata), multi_task=multi_task)
        except ArgumentError as err:
            raise CheckError(_with_value(str(err), err.path, jdata)) from err
    messages = [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, UserWarning))]
    section = jdata.get("optimizer", {})
    if section.get("type") == "HybridMuon":
        resolved, legacy = resolve_legacy_keys(section)
        messages += legacy
        jdata["optimizer"] = {"type": "HybridMuon", **{k: v for k, v in resolved.items() if k != "type"}}
    return jdata, messages


def _validate_optimizer(section: dict[str, Any]) -> None:
    """Build the optimizer's defaults through its own validation (no parameters needed)."""
    from .optimizer import HybridMuonOptimizer

    probe = [{"params": [], "lr": 0.0}]
    try:
        HybridMuonOptimizer(
            probe,
            momentum=section["momentum"],
            weight_decay=section["weight_decay"],
            adam_betas=(section["adam_beta1"], section["adam_beta2"]),
            lr_adjust=section["lr_adjust"],
            lr_adjust_coeff=section["lr_adjust_coeff"],
            muon_mode=section["muon_mode"],
            enable_gram=section["enable_gram"],
            flash_muon=section["flash_muon"],
            magma_muon=section["magma_muon"],
        )
    except ValueError as err:
        raise CheckError(f"[at location `optimizer`] {err}") from err


def _models(model_section: dict[str, Any]) -> dict[str, Any]:
    from deepmd.pt.model.model import get_model

    if "model_dict" in model_section:
        return {key: get_model(sub) for key, sub in model_section["model_dict"].items()}
    return {"": get_model(model_section)}


def _routing_rows(models: dict[str, Any], muon_mode: str) -> list[tuple[str, tuple[int, ...], str, str]]:
    from .functional import route_parameter

    rows = []
    for key, model in models.items():
        for name, p in model.named_parameters():
            full = f"{key}.{name}" if key else name
            r = route_parameter(full, tuple(p.shape), muon_mode)
            view = "x".join(str(d) for d in r.view) if r.view else "-"
            rows.append((full, tuple(p.shape), r.route, view, r.reason, p.numel()))
    return rows


def check_input(path: str, out: TextIO | None = None, *, routing: bool = True) -> dict[str, Any]:
    """Validate ``path`` as deepmd would, print the optimizer settings and routing table.

    Returns the normalised input. Raises :class:`CheckError` with the key path, the bad value
    and what is allowed.
    """
    out = sys.stdout if out is None else out
    jdata, messages = _normalize(_load(path))
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    section = jdata.get("optimizer", {})
    print(f"{path}: valid deepmd-kit input", file=out)
    if section.get("type") != "HybridMuon":
        print(f"optimizer: {section.get('type')} (not HybridMuon; nothing more to check)", file=out)
        return jdata
    _validate_optimizer(section)
    print("optimizer: HybridMuon (deepmd-hybridmuon)", file=out)
    for key, value in section.items():
        if key != "type" and value is not None:
            print(f"  {key:16s} {value!r}", file=out)
    if routing:
        _print_routing(jdata["model"], section["muon_mode"], out)
    return jdata


def _print_routing(model_section: dict[str, Any], muon_mode: str, out: TextIO) -> None:
    rows = _routing_rows(_models(model_section), muon_mode)
    width = max([len(r[0]) for r in rows] + [9])
    print(f"\nrouting (muon_mode={muon_mode!r}):", file=out)
    print(f"  {'parameter':{width}s}  {'shape':18s} {'route':6s} {'matrices':12s} reason", file=out)
    for name, shape, route, view, reason, _ in rows:
        print(f"  {name:{width}s}  {shape!s:18s} {route:6s} {view:12s} {reason}", file=out)
    print("totals:", file=out)
    for route in ("muon", "adam", "adamw"):
        picked = [r for r in rows if r[2] == route]
        print(f"  {route:6s} {len(picked):4d} tensors {sum(r[5] for r in picked):12,d} elements", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 valid, 1 invalid input, 2 usage)."""
    parser = argparse.ArgumentParser(prog="dp-hybridmuon", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate a dp train input (json/yaml) with the HybridMuon schema")
    check.add_argument("input", help="the input.json (or .yaml) given to `dp --pt train`")
    check.add_argument("--no-routing", action="store_true", help="do not build the model to print the routing")
    args = parser.parse_args(argv)
    try:
        check_input(args.input, routing=not args.no_routing)
    except CheckError as err:
        print(f"error: {args.input}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
