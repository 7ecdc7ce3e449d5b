"""The input check: ``dp check input.json`` (also ``dp-hybridmuon check``, ``python -m deepmd_hybridmuon check``).

deepmd-kit's ``dp`` learns the ``check`` subcommand from :func:`deepmd_hybridmuon.plugin.add_dp_check`, which
builds it with :func:`add_check_arguments` and runs it with :func:`run_check`, as the ``dp-hybridmuon``
console script (:func:`main`) does.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = [
    "CHECK_DESCRIPTION",
    "CHECK_HELP",
    "CheckError",
    "add_check_arguments",
    "check_input",
    "main",
    "run_check",
    "triton_decision",
]

#: One line for the list of subcommands (``dp -h``, ``dp-hybridmuon -h``).
CHECK_HELP = "validate a dp train input with the HybridMuon schema and print its optimizer routing"
#: The description of ``check -h``.
CHECK_DESCRIPTION = (
    "Check a dp train input before a long run: deepmd-kit's conversion of older layouts and its schema, with "
    "deepmd-hybridmuon's HybridMuon options. Prints the resolved optimizer settings, the routing of the model's "
    "parameters (Muon, Adam, AdamW; the model is built from the input, no data needed) and what the run will "
    "do on this machine. Exit status: 0 valid, 1 invalid input, 2 usage error."
)
ROUTES: tuple[str, ...] = ("muon", "adam", "adamw")
#: Top-level sections that must be objects when present (deepmd's compat step assumes it).
SECTIONS: tuple[str, ...] = ("model", "learning_rate", "optimizer", "loss", "training")
#: Legacy optimizer keys of ``training`` (deepmd-kit < 3.2) and their key in the ``optimizer`` section.
LEGACY_OPTIMIZER_KEYS: dict[str, str] = {
    "opt_type": "type",
    **{
        key: key
        for key in (
            "weight_decay",
            "momentum",
            "muon_momentum",
            "adam_beta1",
            "adam_beta2",
            "lr_adjust",
            "lr_adjust_coeff",
            "muon_2d_only",
            "min_2d_dim",
        )
    },
}


class CheckError(Exception):
    """The input is invalid; the message says where and why (the caller names the file)."""


# ------------------------------------------------------------------------- reading


def _load(path: str) -> Any:
    from deepmd.common import j_loader

    try:
        data = j_loader(path)
    except FileNotFoundError as err:
        raise CheckError("no such file") from err
    except IsADirectoryError as err:
        raise CheckError("is a directory, not an input file") from err
    except OSError as err:
        raise CheckError(f"cannot be read: {err.strerror or err}") from err
    except TypeError as err:  # j_loader's answer to another suffix
        raise CheckError(f"unknown file type {os.path.splitext(path)[1]!r}: expected .json, .yaml or .yml") from err
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise CheckError(f"cannot be parsed as JSON: {err}") from err
    except Exception as err:  # yaml.YAMLError (yaml is deepmd's dependency, not ours)
        if type(err).__module__.startswith("yaml"):
            mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise CheckError(f"cannot be parsed as YAML{where}: {problem or err}") from err
        raise
    return data


def _describe(value: Any) -> str:
    if value is None:
        return "nothing (an empty file or null)"
    return f"{type(value).__name__} {value!r}"[:120]


def _check_layout(jdata: Any) -> None:
    """Fail on a top level deepmd's compat step would crash on (it assumes objects)."""
    if not isinstance(jdata, dict):
        raise CheckError(
            f"the top level must be an object of sections (model, learning_rate, loss, training, ...), "
            f"got {_describe(jdata)}"
        )
    for section in SECTIONS:
        if section in jdata and not isinstance(jdata[section], dict):
            got = _describe(jdata[section])
            raise CheckError(f"[at location `{section}`] `{section}` must be an object, got {got}")
    missing = [s for s in ("model", "training") if s not in jdata]
    if missing and "use_smooth" not in jdata:  # (a deepmd-kit v0 input has neither; its compat step converts it)
        raise CheckError(
            f"no {' and no '.join(f'`{s}`' for s in missing)} section: a dp train input needs `model` and "
            "`training` (see `dp doc-train-input`)"
        )


def _legacy_conflicts(jdata: dict[str, Any]) -> list[str]:
    """Keys set both in ``optimizer`` and, the legacy way, in ``training``, with different values.

    deepmd-kit's compat step merges the legacy keys over the ``optimizer`` section: the
    legacy value wins, silently.
    """
    section, training = jdata.get("optimizer", {}), jdata["training"]
    messages = []
    for legacy, key in LEGACY_OPTIMIZER_KEYS.items():
        if legacy in training and key in section and training[legacy] != section[key]:
            messages.append(
                f"training.{legacy}={training[legacy]!r} and optimizer.{key}={section[key]!r} are both set: "
                f"deepmd-kit's conversion of the legacy layout lets training.{legacy} win, so dp train uses "
                f"{training[legacy]!r}; remove one of them"
            )
    return messages


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


def _normalize(jdata: Any) -> tuple[dict[str, Any], list[str]]:
    """deepmd's compat conversion and normalisation, our schema registered; collect warnings."""
    from dargs.dargs import ArgumentError
    from deepmd.utils.argcheck import normalize
    from deepmd.utils.compat import update_deepmd_input

    from .plugin import register_schema
    from .schema import resolve_legacy_keys

    _check_layout(jdata)
    register_schema()
    messages = _legacy_conflicts(jdata)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            jdata = update_deepmd_input(jdata, warning=True)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckError(
                f"deepmd-kit's conversion of older input layouts failed ({type(err).__name__}: {err}); "
                "see `dp doc-train-input` for the current layout"
            ) from err
        multi_task = "model_dict" in jdata.get("model", {})
        training = jdata.get("training", {})
        stage = training.get("zero_stage", 0) if isinstance(training, dict) else 0
        if stage not in (0, 1, 2, 3):
            raise CheckError(f"[at location `training`] key `zero_stage` must be 0, 1, 2 or 3 (got {stage!r})")
        if stage >= 2 and training.get("enable_ema"):  # DPA-4's examples enable EMA
            raise CheckError(
                f"[at location `training`] key `enable_ema` is true with `zero_stage` {stage}; deepmd-kit trains "
                "with EMA only at zero_stage 0 or 1: use zero_stage 0 or 1, or set enable_ema to false"
            )
        try:
            jdata = normalize(copy.deepcopy(jdata), multi_task=multi_task)
        except ArgumentError as err:
            raise CheckError(_with_value(str(err), err.path, jdata)) from err
        except ValueError as err:  # deepmd's own cross-key checks
            raise CheckError(f"deepmd-kit rejects the input: {err}") from err
    messages += [str(w.message) for w in caught if issubclass(w.category, (DeprecationWarning, UserWarning))]
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


# ------------------------------------------------------------------------- routing

Row = tuple[str, tuple[int, ...], str, str, str, int]


def _models(model_section: dict[str, Any]) -> dict[str, Any]:
    from deepmd.pt.model.model import get_model

    if "model_dict" in model_section:
        return {key: get_model(sub) for key, sub in model_section["model_dict"].items()}
    return {"": get_model(model_section)}


def _routing_rows(models: dict[str, Any], muon_mode: str) -> list[Row]:
    from .functional import route_parameter

    rows = []
    for key, model in models.items():
        for name, p in model.named_parameters():
            full = f"{key}.{name}" if key else name
            r = route_parameter(full, tuple(p.shape), muon_mode)
            view = "x".join(str(d) for d in r.view) if r.view else "-"
            rows.append((full, tuple(p.shape), r.route, view, r.reason, p.numel()))
    return rows


def _print_summary(rows: list[Row], muon_mode: str, out: TextIO) -> None:
    """Count and elements per route, with the reasons behind each count."""
    print(f"\nrouting (muon_mode={muon_mode!r}): {len(rows)} parameters", file=out)
    for route in ROUTES:
        picked = [r for r in rows if r[2] == route]
        reasons = Counter(r[4] for r in picked)
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
        line = f"  {route:6s} {len(picked):4d} tensors {sum(r[5] for r in picked):12,d} elements"
        print(f"{line}  ({why})" if why else line, file=out)


def _print_table(rows: list[Row], out: TextIO) -> None:
    """One row per parameter: name, shape, route, matrix view, reason."""
    width = max([len(r[0]) for r in rows] + [9])
    print("\nrouting table:", file=out)
    print(f"  {'parameter':{width}s}  {'shape':18s} {'route':6s} {'matrices':12s} reason", file=out)
    for name, shape, route, view, reason, _ in rows:
        print(f"  {name:{width}s}  {shape!s:18s} {route:6s} {view:12s} {reason}", file=out)


# --------------------------------------------------------------------- this machine


def _training_device() -> Any:
    """The device ``dp --pt train`` puts the model on (deepmd's choice, with its environment variables)."""
    from deepmd.pt.utils.env import DEVICE

    return DEVICE


def triton_decision(flash_muon: bool, device: Any) -> tuple[bool, str]:
    """Whether the flat engine runs the Triton kernels on ``device``, and why (the engine's own condition)."""
    import torch

    from .engine.compilation import MIN_CAPABILITY, triton_runs_on

    need = ".".join(map(str, MIN_CAPABILITY))
    on = flash_muon and triton_runs_on(device)
    if on:
        if device.type == "cpu":
            return True, "on: Triton's interpreter (TRITON_INTERPRET=1) on the CPU"
        import triton

        major, minor = torch.cuda.get_device_capability(device)
        name = torch.cuda.get_device_name(device)
        return True, (
            f"on: flash_muon is true, Triton {triton.__version__} imports, {name} has compute capability "
            f"{major}.{minor} (>= {need}); compiled in the background on first use"
        )
    if not flash_muon:
        why = "flash_muon is false"
    elif device.type != "cuda":
        why = f"not a CUDA GPU (deepmd's device is {device})"
    elif torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability(device)
        why = f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; the kernels need {need}"
    else:
        why = "Triton cannot be imported"
    return False, f"off: {why}; batched torch kernels instead"


#: What each ``training.zero_stage`` makes of the optimizer under ``torchrun``: (strategy, what the optimizer does).
ZERO_STAGES: dict[int, tuple[str, str]] = {
    0: (
        "DDP",
        "every rank steps the whole parameters (flat engine); where a param_group's Newton-Schulz work is large "
        "enough to pay (ddp_split='auto'), each rank orthogonalises its share of the Muon matrices and one "
        "all-gather per step shares the updates",
    ),
    1: (
        "ZeRO-1",
        "ZeroRedundancyOptimizer: each rank steps its own share of whole parameters (flat engine); ranks agree on "
        "skipping a step with a non-finite gradient",
    ),
    2: (
        "FSDP2",
        "DTensor shards: elementwise work (Adam, momentum, decay) on the local shards; each Muon matrix "
        "orthogonalised once, on one owner rank (four collectives per step); no Triton kernels",
    ),
    3: (
        "FSDP2",
        "DTensor shards, parameters resharded after the forward: elementwise work on the local shards; each Muon "
        "matrix orthogonalised once, on one owner rank (four collectives per step); no Triton kernels",
    ),
}


def _print_machine(section: dict[str, Any], stage: int, device: Any, out: TextIO) -> None:
    _, triton_line = triton_decision(bool(section["flash_muon"]), device)
    print(f"\non this machine (deepmd trains on {device}):", file=out)
    print(f"  Triton kernels  {triton_line}", file=out)
    strategy, what = ZERO_STAGES[stage]
    print(f"  zero_stage {stage}    {strategy} under torchrun: {what}", file=out)
    if stage:
        print("                  (one process: zero_stage is ignored, nothing to shard)", file=out)


# ------------------------------------------------------------------------ the check


def check_input(path: str, out: TextIO | None = None, *, routing: bool = True, table: bool = False) -> dict[str, Any]:
    """Validate ``path`` as deepmd would; print the optimizer settings, the routing and the run's plan.

    Everything is computed before the first line is printed (building the model makes
    deepmd log its advice on threads). ``routing=False`` skips building the model;
    ``table=True`` adds one row per parameter to the per-route summary.

    Returns the normalised input. Raises :class:`CheckError` with the key path, the bad value
    and what is allowed.
    """
    out = sys.stdout if out is None else out
    jdata, messages = _normalize(_load(path))
    section = jdata.get("optimizer", {})
    hybrid = section.get("type") == "HybridMuon"
    rows: list[Row] = []
    if hybrid:
        _validate_optimizer(section)
        if routing:
            rows = _routing_rows(_models(jdata["model"]), section["muon_mode"])
        device = _training_device()
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    print(f"{path}: valid deepmd-kit input", file=out)
    if not hybrid:
        print(f"optimizer: {section.get('type')} (not HybridMuon; nothing more to check)", file=out)
        return jdata
    print("optimizer: HybridMuon (deepmd-hybridmuon)", file=out)
    for key, value in section.items():
        if key != "type" and value is not None:
            print(f"  {key:16s} {value!r}", file=out)
    if routing:
        _print_summary(rows, section["muon_mode"], out)
        if table:
            _print_table(rows, out)
        else:
            print("  (--table lists every parameter)", file=out)
    _print_machine(section, int(jdata["training"].get("zero_stage", 0)), device, out)
    return jdata


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``check`` (shared by ``dp check`` and ``dp-hybridmuon check``)."""
    parser.add_argument("input", help="the input.json (or .yaml) given to `dp --pt train`")
    parser.add_argument("--table", action="store_true", help="also print the routing of every parameter")
    parser.add_argument("--no-routing", action="store_true", help="do not build the model to print the routing")


def run_check(args: argparse.Namespace) -> int:
    """Run the check parsed by :func:`add_check_arguments`; the exit status (0 valid, 1 invalid)."""
    try:
        check_input(args.input, routing=not args.no_routing, table=args.table)
    except CheckError as err:
        print(f"error: {args.input}: {err}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point; returns the exit status (0 valid, 1 invalid input, 2 usage)."""
    parser = argparse.ArgumentParser(
        prog="dp-hybridmuon", description="deepmd-hybridmuon's tools (the check is also `dp check`)."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add_check_arguments(sub.add_parser("check", help=CHECK_HELP, description=CHECK_DESCRIPTION))
    return run_check(parser.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
