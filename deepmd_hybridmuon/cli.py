"""The input check: ``dp check input.json`` (also ``dp-hybridmuon check``, ``python -m deepmd_hybridmuon check``).

deepmd-kit's ``dp`` learns the ``check`` subcommand from :func:`deepmd_hybridmuon.plugin.add_dp_check`, which
builds it with :func:`add_check_arguments` and runs it with :func:`run_check`, as the ``dp-hybridmuon``
console script (:func:`main`) does.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import re
import reprlib
import stat
import sys
import warnings
from collections import Counter
from collections.abc import Sequence
from typing import Any, TextIO

#: One line for the list of subcommands (``dp -h``, ``dp-hybridmuon -h``).
CHECK_HELP = "validate a dp train input with the HybridMuon schema and print its optimizer routing"
#: The description of ``check -h``.
CHECK_DESCRIPTION = (
    "Check a dp train input before a long run: deepmd-kit's conversion of older layouts, multi-task shared_dict "
    "and its schema, with deepmd-hybridmuon's HybridMuon options. Prints the learning-rate schedule, the resolved "
    "optimizer settings, the routing of the model's parameters (Muon, Adam, AdamW; per branch for a multi-task "
    "input; the model is built from the input, no data needed) and what the run will do on this machine. Exit "
    "status: 0 valid, 1 invalid input, 2 usage error."
)
ROUTES: tuple[str, ...] = ("muon", "adam", "adamw")
#: Top-level sections that must be objects when present (deepmd's compat step assumes it).
SECTIONS: tuple[str, ...] = ("model", "learning_rate", "optimizer", "loss", "training")
#: Legacy optimizer keys of ``training`` (deepmd-kit < 3.2) and their key in the ``optimizer`` section.
LEGACY_OPTIMIZER_KEYS: dict[str, str] = {
    "opt_type": "type",
    "weight_decay": "weight_decay",
    "momentum": "momentum",
    "muon_momentum": "muon_momentum",
    "adam_beta1": "adam_beta1",
    "adam_beta2": "adam_beta2",
    "lr_adjust": "lr_adjust",
    "lr_adjust_coeff": "lr_adjust_coeff",
    "muon_2d_only": "muon_2d_only",
    "min_2d_dim": "min_2d_dim",
}


class CheckError(Exception):
    """The input is invalid; the message says where and why (the caller names the file)."""


# ------------------------------------------------------------------------- reading


#: The largest input file read (bytes); dp train inputs are kilobytes, a long list of systems a few megabytes.
MAX_INPUT_BYTES = 32 * 1024 * 1024
#: The deepest nesting of objects and lists accepted (the shared DPA-4 input nests 5 levels).
MAX_DEPTH = 64
#: The most values (objects, lists, scalars) an input may hold, a value repeated by a YAML alias once per use.
MAX_VALUES = 1_000_000
#: How many characters of an offending value an error message echoes.
ECHO_CHARS = 80
#: The longest key accepted: keys are names. (dargs' "Did you mean" indexes an unknown key, some 40 bytes a character.)
MAX_KEY_CHARS = 1000

_FILE_KINDS: tuple[tuple[Any, str], ...] = (
    (stat.S_ISFIFO, "a named pipe (FIFO)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _short(value: Any) -> str:
    """``repr(value)`` cut to about :data:`ECHO_CHARS` characters, without building the whole of it."""
    if isinstance(value, str) and len(value) > ECHO_CHARS:
        return f"{value[:ECHO_CHARS]!r}... ({len(value):,} characters)"
    brief = reprlib.Repr()
    brief.maxstring = brief.maxother = ECHO_CHARS
    brief.maxlist = brief.maxtuple = brief.maxdict = brief.maxset = 8
    brief.maxlevel = 4
    text = brief.repr(value)
    return text if len(text) <= ECHO_CHARS else text[:ECHO_CHARS] + "..."


def _check_file(path: str) -> None:
    """Refuse what is not a regular file of at most :data:`MAX_INPUT_BYTES` (before opening it: a FIFO blocks)."""
    try:
        info = os.stat(path)  # follows symbolic links: a link to /dev/zero is a character device
    except FileNotFoundError as err:
        raise CheckError("no such file") from err
    except OSError as err:
        raise CheckError(f"cannot be read: {err.strerror or err}") from err
    if stat.S_ISDIR(info.st_mode):
        raise CheckError("is a directory, not an input file")
    if not stat.S_ISREG(info.st_mode):
        kind = next((name for test, name in _FILE_KINDS if test(info.st_mode)), "not a regular file")
        raise CheckError(f"is {kind}, not a regular file: give dp check the input file itself")
    if info.st_size > MAX_INPUT_BYTES:
        raise CheckError(
            f"is {info.st_size:,} bytes, more than the {MAX_INPUT_BYTES:,} bytes dp check reads; "
            "dp train inputs are far smaller"
        )


def _check_extent(data: Any) -> None:
    """Refuse nesting deeper than :data:`MAX_DEPTH`, more than :data:`MAX_VALUES` values (a YAML alias bomb).

    And keys longer than :data:`MAX_KEY_CHARS`: dargs' suggestion for an unknown key would index all of it.
    """
    stack = [(data, 1)]
    count = 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_VALUES:
            raise CheckError(
                f"holds more than {MAX_VALUES:,} values (a value repeated through YAML aliases counts once per "
                "use); dp train inputs hold far fewer"
            )
        if depth > MAX_DEPTH:
            raise CheckError(f"nests objects and lists more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            others = [key for key in node if not isinstance(key, str)]  # YAML: on/off/yes/no, digits, ~
            if others:
                kind = type(others[0]).__name__
                raise CheckError(f"has a key {_short(others[0])} ({kind}): keys are names; in YAML, quote it")
            long = next((key for key in node if len(key) > MAX_KEY_CHARS), None)
            if long is not None:
                raise CheckError(f"has a key {_short(long)}: keys are names of at most {MAX_KEY_CHARS:,} characters")
            stack.extend((value, depth + 1) for value in node.values())
        elif isinstance(node, list):
            stack.extend((value, depth + 1) for value in node)


def _load(path: str) -> Any:
    from deepmd.common import j_loader

    _check_file(path)
    try:
        data = j_loader(path)
    except OSError as err:  # _check_file said what it could: this one changed since
        raise CheckError(f"cannot be read: {err.strerror or err}") from err
    except TypeError as err:  # j_loader's answer to another suffix
        raise CheckError(f"unknown file type {os.path.splitext(path)[1]!r}: expected .json, .yaml or .yml") from err
    except RecursionError as err:  # json's and yaml's parsers recurse once per level of nesting
        raise CheckError(
            f"nests objects and lists too deeply to be parsed (dp check takes up to {MAX_DEPTH} levels)"
        ) from err
    except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
        raise CheckError(f"cannot be parsed as JSON: {_cut(str(err))}") from err
    except Exception as err:  # yaml.YAMLError (yaml is deepmd's dependency, not ours)
        if type(err).__module__.startswith("yaml"):
            mark, problem = getattr(err, "problem_mark", None), getattr(err, "problem", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            raise CheckError(f"cannot be parsed as YAML{where}: {_cut(str(problem or err))}") from err
        raise
    _check_extent(data)
    return data


def _cut(text: str, limit: int = 4 * ECHO_CHARS) -> str:
    """A message cut to ``limit`` characters (a parser or deepmd may quote the input at length)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters in all)"


def _describe(value: Any) -> str:
    return "nothing (an empty file or null)" if value is None else f"{type(value).__name__} {_short(value)}"


def _legacy_conflicts(jdata: dict[str, Any]) -> tuple[str | None, list[str]]:
    """Keys set both in ``optimizer`` and, the legacy way, in ``training``, with different values.

    deepmd-kit's compat step lets the legacy value win, silently. Returns the error for a contradicting ``opt_type``
    (the run would train another optimizer than the section names) and a warning for each other key.
    """
    from .plugin import _plugin_registry

    section, training = jdata.get("optimizer", {}), jdata.get("training", {})
    error, messages = None, []
    for legacy, key in LEGACY_OPTIMIZER_KEYS.items():
        if legacy not in training or key not in section or training[legacy] == section[key]:
            continue
        theirs, ours = _short(training[legacy]), _short(section[key])
        if legacy == "opt_type":
            known = [name for name, *_ in _plugin_registry()]  # a fix offers no misspelled name
            fixes = [f"remove training.opt_type to train with {ours}"] if section[key] in known else []
            if training[legacy] in known:
                fixes.append(f"set optimizer.type to {theirs} and remove training.opt_type")
            names = ", ".join(map(repr, known))
            fixes = fixes or [f"remove training.opt_type and set optimizer.type to one of {names}"]
            error = (
                f"training.opt_type={theirs} contradicts optimizer.type={ours}: deepmd-kit's conversion of the "
                f"legacy layout lets training.opt_type win, so dp train would use the {theirs} optimizer, not "
                f"{ours}. Fix: {fixes[0]}" + (f" (or {fixes[1]})" if fixes[1:] else "")
            )
        else:
            messages.append(
                f"training.{legacy}={theirs} and optimizer.{key}={ours} are both set: deepmd-kit's conversion "
                f"of the legacy layout lets training.{legacy} win, so dp train uses {theirs}; remove one of them"
            )
    return error, messages


def legacy_conflicts(input_file: str | None) -> list[str]:
    """What ``dp check`` says of ``input_file``'s legacy optimizer keys that contradict its optimizer section.

    For ``dp train``'s log, which deepmd-kit leaves silent (its conversion lets the legacy key win); nothing
    for a file that does not read as an input.
    """
    with contextlib.suppress(CheckError):
        jdata = _load(input_file) if input_file else None
        if isinstance(jdata, dict) and all(isinstance(jdata.get(s), dict) for s in ("optimizer", "training")):
            error, messages = _legacy_conflicts(jdata)
            return [error, *messages] if error else messages
    return []


def _with_value(message: str, path: str, jdata: dict[str, Any], training: set[str]) -> str:
    """Append the offending value to a dargs message (dargs names the key but not the value).

    An ``optimizer`` key that the conversion took from a legacy key of the input's ``training`` (whose keys
    ``training`` holds) is named as the input has it, e.g. ``training``/``opt_type``.
    """
    from .validation import ALIASES

    message = message.replace(".Did you mean", ". Did you mean")
    match = re.search(r"key `([^`]+)`", message)
    legacy = [old for old, new in LEGACY_OPTIMIZER_KEYS.items() if match and new == match.group(1) and old in training]
    if legacy and path.strip("/") == "optimizer":
        message = message.replace("[at location `optimizer`]", "[at location `training`]", 1)
        message = message.replace(match.group(0), f"key `{legacy[0]}`", 1)
    shown = re.sub(rf"`([^`]{{{ECHO_CHARS + 1},}})`", lambda m: f"`{m.group(1)[:ECHO_CHARS]}...`", message)
    if match is None:
        return _cut(shown)
    section = jdata.get("optimizer")
    alias_of = ALIASES.get(match.group(1))
    if path.strip("/") == "optimizer" and isinstance(section, dict) and alias_of in section:
        shown += f" ({match.group(1)} is another name for {alias_of}, which is set too: keep one of them)"
    node: Any = jdata
    for part in [p for p in path.split("/") if p] + [match.group(1)]:
        if not isinstance(node, dict) or part not in node:
            return _cut(shown)
        node = node[part]
    return f"{_cut(shown)} (got {_short(node)})"


def _share(model: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A multi-task ``model`` with its ``shared_dict`` items put in place, as dp train does first; and the links."""
    from deepmd.pt.utils.multi_task import preprocess_shared_params

    branches = model["model_dict"]
    if not isinstance(branches, dict) or not all(isinstance(b, dict) for b in branches.values()):
        raise CheckError(
            f"[at location `model`] `model_dict` must be an object of branches (objects), got {_describe(branches)}"
        )
    if not isinstance(model.get("shared_dict", {}), dict):
        raise CheckError(
            f"[at location `model`] `shared_dict` must be an object, got {_describe(model['shared_dict'])}"
        )
    if "RANDOM" in branches:  # dp train asserts it
        raise CheckError("[at location `model/model_dict`] a branch cannot be named 'RANDOM' in multi-task mode")
    try:
        return preprocess_shared_params(copy.deepcopy(model))
    except (KeyError, TypeError, AttributeError, ValueError, AssertionError, IndexError) as err:
        raise CheckError(
            f"[at location `model`] deepmd-kit cannot apply `shared_dict` to `model_dict` ({type(err).__name__}: "
            f"{_cut(str(err))}): each string value naming a shared item must be a key of shared_dict"
        ) from err


def _normalize(jdata: Any) -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
    """The input as dp train normalises it (our schema registered), the warnings, the ``shared_dict`` links or None."""
    from .plugin import register_schema

    # first refuse a top level that deepmd's compat step would crash on (it assumes objects)
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
    register_schema()
    conflict, messages = _legacy_conflicts(jdata)
    try:
        jdata, more, shared_links = _convert(jdata)
    except CheckError as err:
        if conflict is None:
            raise
        raise CheckError(
            f"{conflict}\n  besides, deepmd-kit's checks of the input with training.opt_type applied (as dp train "
            f"applies it) fail: {err}"
        ) from err
    if conflict is not None:
        raise CheckError(conflict)
    return jdata, messages + more, shared_links


def _convert(jdata: dict[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, Any] | None]:
    """dp train's steps before it builds the model: shared_dict, the compat conversion, the schema."""
    from dargs.dargs import ArgumentError
    from deepmd.utils.argcheck import normalize
    from deepmd.utils.compat import update_deepmd_input

    from .validation import resolve_legacy_keys

    shared_links = None
    written = set(jdata.get("training", {}))  # the keys of the input's training (the conversion moves some)
    if "model_dict" in jdata.get("model", {}):
        jdata = {**jdata}
        jdata["model"], shared_links = _share(jdata["model"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            jdata = update_deepmd_input(jdata, warning=True)
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise CheckError(
                f"deepmd-kit's conversion of older input layouts failed ({type(err).__name__}: {_cut(str(err))}); "
                "see `dp doc-train-input` for the current layout"
            ) from err
        multi_task = "model_dict" in jdata.get("model", {})
        training = jdata.get("training", {})
        stage = training.get("zero_stage", 0) if isinstance(training, dict) else 0
        if stage not in (0, 1, 2, 3):
            raise CheckError(f"[at location `training`] key `zero_stage` must be 0, 1, 2 or 3 (got {_short(stage)})")
        if stage and multi_task:  # deepmd's trainer refuses it after loading the data
            raise CheckError(
                f"[at location `training`] key `zero_stage` is {stage} in a multi-task input; deepmd-kit shards "
                "only single-task training: use zero_stage 0"
            )
        if stage >= 2 and training.get("enable_ema"):  # DPA-4's examples enable EMA
            raise CheckError(
                f"[at location `training`] key `enable_ema` is true with `zero_stage` {stage}; deepmd-kit trains "
                "with EMA only at zero_stage 0 or 1: use zero_stage 0 or 1, or set enable_ema to false"
            )
        try:
            jdata = normalize(copy.deepcopy(jdata), multi_task=multi_task)
        except ArgumentError as err:
            raise CheckError(_with_value(str(err), err.path, jdata, written)) from err
        except ValueError as err:  # deepmd's own cross-key checks
            raise CheckError(f"deepmd-kit rejects the input: {_cut(str(err))}") from err
    messages = [_cut(str(w.message)) for w in caught if issubclass(w.category, (DeprecationWarning, UserWarning))]
    section = jdata.get("optimizer", {})
    if section.get("type") == "HybridMuon":
        resolved, legacy = resolve_legacy_keys(section)
        messages += legacy
        jdata["optimizer"] = {"type": "HybridMuon", **{k: v for k, v in resolved.items() if k != "type"}}
    return jdata, messages, shared_links


# ------------------------------------------------------------------------- routing

#: One parameter: (branch, name, shape, route, matrix view, reason, elements, branch it is shared with or "").
Row = tuple[str, str, tuple[int, ...], str, tuple[int, int, int] | None, str, int, str]


def _routing_rows(model_section: dict[str, Any], shared_links: dict[str, Any] | None, muon_mode: str) -> list[Row]:
    """The route of each parameter of the model, or of each branch (``model_dict`` key) as dp train shares them."""
    from deepmd.pt.model.model import get_model

    from .functional import route_parameter

    if "model_dict" not in model_section:
        models = {"": get_model(model_section)}
    else:
        from deepmd.pt.train.wrapper import ModelWrapper

        branches = {key: get_model(sub) for key, sub in model_section["model_dict"].items()}
        wrapper = ModelWrapper(branches)
        if shared_links:
            # resume=True: link the modules, leave the statistics (they need data) alone
            wrapper.share_params(shared_links, model_key_prob_map=dict.fromkeys(branches, 1.0), resume=True)
        models = dict(wrapper.model.items())
    rows = []
    first_branch: dict[int, str] = {}  # id of a parameter -> the first branch holding it
    for key, model in models.items():
        for name, p in model.named_parameters():
            full = f"{key}.{name}" if key else name
            shape = tuple(p.shape)
            r = route_parameter(full, shape, muon_mode)
            shared = first_branch.setdefault(id(p), key)
            rows.append((key, full, shape, r.route, r.view, r.reason, p.numel(), "" if shared == key else shared))
    return rows


def _print_routes(rows: list[Row], out: TextIO, indent: str = "  ") -> None:
    """Count and elements per route, with the reasons behind each count."""
    for route in ROUTES:
        picked = [r for r in rows if r[3] == route]
        reasons = Counter(r[5] for r in picked)
        why = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
        line = f"{indent}{route:6s} {len(picked):4d} tensors {sum(r[6] for r in picked):12,d} elements"
        print(f"{line}  ({why})" if why else line, file=out)


def _print_routing(rows: list[Row], muon_mode: str, table: bool, out: TextIO) -> None:
    """The routes of the model, or of each branch and of the parameters dp train steps (shared ones once).

    With ``table``, one row per parameter: name, shape, route, matrix view, reason.
    """
    branches = list(dict.fromkeys(r[0] for r in rows))
    if branches in ([], [""]):
        print(f"\nrouting (muon_mode={muon_mode!r}): {len(rows)} parameters", file=out)
        _print_routes(rows, out)
    else:
        print(f"\nrouting (muon_mode={muon_mode!r}) of each branch (model_dict key):", file=out)
        for branch in branches:
            mine = [r for r in rows if r[0] == branch]
            shared = Counter(r[7] for r in mine if r[7])
            note = "; ".join(f"{n} shared with {other} through shared_dict" for other, n in shared.items())
            print(f"  {branch}: {len(mine)} parameters" + (f" ({note})" if note else ""), file=out)
            _print_routes(mine, out, indent="    ")
        distinct = [r for r in rows if not r[7]]
        print(f"  dp train steps {len(distinct)} parameters (each shared one once):", file=out)
        _print_routes(distinct, out, indent="    ")
    if not table:
        print("  (--table lists every parameter)", file=out)
        return
    width = max([len(r[1]) for r in rows] + [9])
    print("\nrouting table:", file=out)
    print(f"  {'parameter':{width}s}  {'shape':18s} {'route':6s} {'matrices':12s} reason", file=out)
    for _, name, shape, route, matrices, reason, _, shared in rows:
        view = "x".join(map(str, matrices)) if matrices else "-"
        also = f" (shared with {shared}: stepped there)" if shared else ""
        print(f"  {name:{width}s}  {shape!s:18s} {route:6s} {view:12s} {reason}{also}", file=out)


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
    if flash_muon and triton_runs_on(device):
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
    return False, f"off: {why}"


#: What each ``training.zero_stage`` makes of the run under ``torchrun``: (strategy, in a user's words, how the
#: optimizer does it; the last shown with ``--table`` or ``-v``).
ZERO_STAGES: dict[int, tuple[str, str, str]] = {
    0: (
        "DDP",
        "every GPU holds the whole model and optimizer state and steps every parameter",
        "the batched step on every rank: each rank takes the whole step, as one process does, and the replicas stay "
        "bitwise identical",
    ),
    1: (
        "ZeRO-1",
        "the optimizer state is split across the GPUs: each GPU steps its own share of the parameters",
        "ZeroRedundancyOptimizer: each rank steps its own share of whole parameters (batched); ranks agree on "
        "skipping a step with a non-finite gradient",
    ),
    2: (
        "FSDP2",
        "parameters, gradients and optimizer state are split across the GPUs; each weight matrix's Muon update is "
        "computed on one GPU",
        "DTensor shards: elementwise work (Adam, momentum, decay) on the local shards; each Muon matrix "
        "orthogonalised once, on one owner rank (four collectives per step)",
    ),
    3: (
        "FSDP2",
        "as zero_stage 2, and each GPU frees the other GPUs' parameters again after the forward pass (less memory, "
        "more communication)",
        "DTensor shards, parameters resharded after the forward: elementwise work on the local shards; each Muon "
        "matrix orthogonalised once, on one owner rank (four collectives per step)",
    ),
}


def _print_machine(
    section: dict[str, Any], stage: int, device: Any, rows: list[Row] | None, out: TextIO, *, verbose: bool
) -> None:
    """Triton, what orthogonalises the Muon matrices (``rows``: the routing, or None) and what zero_stage does."""
    from .functional import TRITON_MAX_ROWS, on_triton

    on, triton_line = triton_decision(bool(section["flash_muon"]), device)
    views = [r[4] for r in rows or () if r[4] is not None and not r[7]]  # a shared matrix once
    total, fast = sum(v[0] for v in views), sum(bs for bs, m, n in views if on_triton(min(m, n)))
    print(f"\non this machine (deepmd trains on {device}):", file=out)
    if not on:  # one line: nothing runs in Triton
        what = f"all {total}" if rows else "the"
        print(
            f"  Triton kernels  {triton_line}; Newton-Schulz runs batched torch kernels for {what} Muon matrices",
            file=out,
        )
    else:
        print(f"  Triton kernels  {triton_line}", file=out)
        if rows:
            print(
                f"  Newton-Schulz   {fast} of {total} Muon matrices one Triton program each (smaller side <= "
                f"{TRITON_MAX_ROWS}), {total - fast} batched torch (cuBLAS)",
                file=out,
            )
    strategy, words, mechanism = ZERO_STAGES[stage]
    plan = f"{strategy} under torchrun: {words}"
    gpu = device.type == "cuda"  # deepmd-kit's torchrun training puts each rank on a GPU
    here = plan if gpu else "not used here: on the CPU, dp --pt train trains in one process"
    print(f"  zero_stage {stage}    {here}", file=out)
    if verbose:
        if not gpu:
            print(f"                  with GPUs, {plan}", file=out)
        print(f"                  how: {mechanism}", file=out)
        if stage in (2, 3):  # FSDP2: each Muon matrix orthogonalised by its owner rank (distributed/fsdp.py)
            kernels = "the Triton kernels" if on else "batched torch kernels (Triton off, as above)"
            print(f"                  the owner ranks orthogonalise with {kernels}", file=out)
    else:
        more = "how the optimizer does it" if gpu else "what it does under torchrun with GPUs"
        print(f"                  (-v or --table: {more})", file=out)
    if stage and gpu:
        print("                  (one process: zero_stage is ignored, nothing to shard)", file=out)


# ---------------------------------------------------------------- learning rate

#: BENCHMARKS.md ("What learning rate should I use?"; README: "Choosing the learning rate when you switch from Adam"):
#: at the start_lr that suits Adam (1e-3) HybridMuon learned slowly or not at all, 5e-3 was at the edge on DPA-3,
#: and about 10x Adam's rate (8e-3 to 2e-2) trained best, on runs of 1000 to 1500 steps.
ADAM_LR_BELOW = 5e-3
MUON_LR_FACTOR = 10


def _lr_schedule(jdata: dict[str, Any]) -> tuple[str, float, list[tuple[str, float]]]:
    """One line on the learning rate (deepmd's own schedule, as its trainer builds it), ``start_lr``, and the rates.

    The rates: ``(when, lr)`` of the first and last step where the steps are known; with ``num_epoch``
    dp train counts them from the data, which the check does not load.
    """
    from deepmd.dpmodel.utils.learning_rate import make_learning_rate_schedule

    if not isinstance(jdata.get("learning_rate"), dict):
        raise CheckError("no `learning_rate` section: dp train needs one (see `dp doc-train-input`)")
    section, training = jdata["learning_rate"], jdata["training"]
    if "numb_steps" not in training:
        epochs = training.get("numb_epoch", training.get("num_epoch_dict"))
        ends = {key: float(section[key]) for key in ("start_lr", "stop_lr") if key in section}
        start = ends.get("start_lr", 0.0)
        line = (
            f"learning rate: {section.get('type', 'exp')}, start_lr {start:g}, over training.num_epoch(_dict) "
            f"{epochs!r} (dp train counts the steps from the data)"
        )
        return line, start, [(f"{key} {value:g}", value) for key, value in ends.items()]
    steps = int(training["numb_steps"])
    last_step = max(steps - 1, 0)
    try:
        schedule = make_learning_rate_schedule(section, steps)
        first, last = float(schedule.value(0)), float(schedule.value(last_step))
    except (ValueError, TypeError, KeyError, ZeroDivisionError) as err:
        raise CheckError(
            f"[at location `learning_rate`] deepmd-kit rejects the schedule with training.numb_steps {steps}: "
            f"{_cut(str(err))}"
        ) from err
    line = (
        f"learning rate: {section.get('type', 'exp')}, start_lr {schedule.start_lr:g} to stop_lr {schedule.stop_lr:g} "
        f"over {steps:,} steps (training.numb_steps): {first:.3g} at step 0, {last:.3g} at step {last_step:,}"
    )
    stairs = 0 if getattr(schedule, "smooth", True) else schedule.decay_steps  # deepmd may shorten decay_steps
    if stairs:
        line += f"; decays every {stairs:,} steps"
    if schedule.warmup_steps:
        line += f"; warm-up over the first {schedule.warmup_steps:,} steps"
    if f"{last:.3g}" != f"{schedule.stop_lr:.3g}":  # above stop_lr by more than the line shows: why
        if not math.isclose(float(schedule.value(steps)), schedule.stop_lr, rel_tol=1e-6):
            line += "\n  it ends above stop_lr, which this schedule does not reach within training.numb_steps"
        else:
            line += f"\n  it ends above stop_lr, which is the rate at step {steps:,}, one past the last"
            if stairs:
                held = last_step - (last_step - schedule.warmup_steps) % stairs
                line += f": the rate falls every {stairs:,} steps, so steps {held:,}-{last_step:,} all run at "
                line += f"{last:.3g}"
    rates = [(f"lr {first:g} at step 0", first), (f"lr {last:g} at step {last_step:,}", last)]
    return line, float(schedule.start_lr), rates


def lr_hint(start_lr: float) -> str | None:
    """A hint for a HybridMuon ``start_lr`` in the range of Adam's rates (see :data:`ADAM_LR_BELOW`)."""
    if start_lr >= ADAM_LR_BELOW:
        return None
    return (
        f"hint: start_lr {start_lr:g} is an Adam-sized rate; in BENCHMARKS.md HybridMuon trained best at about "
        f"{MUON_LR_FACTOR}x Adam's rate (here {start_lr * MUON_LR_FACTOR:g}) on runs of 1000-1500 steps; longer "
        "runs were not measured (README: Choosing the learning rate)"
    )


# ------------------------------------------------------------------------ the check


def check_input(
    path: str, out: TextIO | None = None, *, routing: bool = True, table: bool = False, verbose: bool = False
) -> dict[str, Any]:
    """Validate ``path`` as deepmd would; print the learning rate, optimizer settings, routing and the run's plan.

    Everything is computed before the first line is printed (building the model makes deepmd log its advice on threads).
    ``routing=False`` skips building the model; ``table=True`` adds one row per parameter to the per-route summary and,
    as ``verbose=True`` does, how the optimizer runs under each ``zero_stage``.

    Returns the normalised input. Raises :class:`CheckError` with the key path, the bad value and what is allowed.
    """
    from .options import OPTION
    from .validation import check_option

    out = sys.stdout if out is None else out
    jdata, messages, shared_links = _normalize(_load(path))
    lr_line, start_lr, lrs = _lr_schedule(jdata)
    section = jdata.get("optimizer", {})
    hybrid = section.get("type") == "HybridMuon"
    rows: list[Row] | None = None
    if hybrid:
        section["muon_mode"] = section["muon_mode"].lower()  # as dp train reads it (the schema checked it)
        for when, lr in lrs:
            try:
                check_option(OPTION["lr"], lr)
            except ValueError as err:
                given = ", ".join(
                    f"{k} {jdata['learning_rate'][k]!r}" for k in ("start_lr", "stop_lr") if k in jdata["learning_rate"]
                )
                raise CheckError(f"[at location `learning_rate`] the schedule ({given}) gives {when}: {err}") from None
        if routing:
            rows = _routing_rows(jdata["model"], shared_links, section["muon_mode"])
        device = _training_device()
    for message in messages:
        print(f"warning: {message}", file=sys.stderr)
    print(f"{path}: valid deepmd-kit input", file=out)
    print(lr_line, file=out)
    if not hybrid:
        print(f"optimizer: {section.get('type')} (not HybridMuon; nothing more to check)", file=out)
        return jdata
    if hint := lr_hint(start_lr):
        print(f"  {hint}", file=out)
    print("optimizer: HybridMuon (deepmd-hybridmuon)", file=out)
    for key, value in section.items():
        if key != "type" and value is not None:
            print(f"  {key:16s} {value!r}", file=out)
    if rows is not None:
        _print_routing(rows, section["muon_mode"], table, out)
    _print_machine(section, int(jdata["training"].get("zero_stage", 0)), device, rows, out, verbose=verbose or table)
    return jdata


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``check`` (shared by ``dp check`` and ``dp-hybridmuon check``)."""
    parser.add_argument("input", help="the input.json (or .yaml) given to `dp --pt train`")
    parser.add_argument("--table", action="store_true", help="also print the routing of every parameter")
    parser.add_argument("--no-routing", action="store_true", help="do not build the model to print the routing")
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="also say how the optimizer runs under training.zero_stage"
    )


def optimizer_error(err: Any, input_file: str | None) -> str | None:
    """dargs' error ``err`` in ``dp train`` of ``input_file``, worded as ``dp check`` words it.

    ``None`` unless the error is about the optimizer section (this package's schema).
    """
    from deepmd.utils.compat import update_deepmd_input

    if err.path.strip("/") != "optimizer":
        return None
    jdata, written = {}, set()
    if input_file:
        with contextlib.suppress(CheckError):  # dp train has read it: it is an input file
            raw = _load(input_file)
            written = set(raw.get("training", {}))
            jdata = update_deepmd_input(raw, warning=False)
    message = _with_value(str(err), err.path, jdata, written)
    return f"{input_file}: {message}" if input_file else message


def run_check(args: argparse.Namespace) -> int:
    """Run the check parsed by :func:`add_check_arguments`; the exit status (0 valid, 1 invalid)."""
    try:
        try:
            check_input(args.input, routing=not args.no_routing, table=args.table, verbose=args.verbose)
        except RecursionError as err:
            raise CheckError("nests too deeply for deepmd-kit's checks (Python's recursion limit)") from err
        except MemoryError as err:
            raise CheckError("needs more memory to check than this machine has") from err
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
