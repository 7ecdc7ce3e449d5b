"""The ``optimizer`` section schema of type ``HybridMuon`` (dargs).

Its arguments are the rows of :data:`.options.OPTIONS` that are input keys, checked by the
optimizer's own input checks (:func:`.validation.check_option`, so that ``dp check`` and the
constructor say the same). :mod:`deepmd_hybridmuon.plugin` registers :func:`hybrid_muon_arguments`
into deepmd-kit's ``opt_args_plugin`` in place of the built-in entry.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from dargs import Argument

from .options import OPTIONS, Option
from .validation import check_option

HYBRID_MUON_DOC = (
    "HybridMuon optimizer (the deepmd-hybridmuon plugin; drop-in for deepmd-kit's built-in). Muon (Nesterov momentum, "
    "Newton-Schulz orthogonalisation, optional Magma-lite damping) for weight matrices; Adam for biases and 1-D "
    "tensors; AdamW for tensors without a matrix view. Routing on the last non-numeric segment of the parameter name "
    "(case-insensitive): 'b' or containing 'bias' -> Adam; 'adam_' prefix -> Adam; 'adamw_' prefix -> AdamW; otherwise "
    "by shape with size-1 dimensions dropped: rank < 2 -> Adam; no matrix view in `muon_mode` -> AdamW; else Muon."
)


def _passes(option: Option, value: Any) -> bool:
    """A dargs ``extra_check``: the optimizer's own check of ``option`` (one source of truth), as a predicate."""
    try:
        check_option(option, value)
    except ValueError:
        return False
    return True


def _argument(option: Option) -> Argument:
    more: dict[str, Any] = {} if option.scope == "removed" else {"default": option.default}
    if option.scope != "legacy" and option.types != (bool,):  # dargs checks the types itself
        more |= {"extra_check": functools.partial(_passes, option), "extra_check_errmsg": option.allowed}
    doc = option.doc + "." if option.scope == "removed" else option.doc
    return Argument(option.name, list(option.types), optional=True, alias=list(option.alias), doc=doc, **more)


def hybrid_muon_arguments() -> list[Argument]:
    """Keys of ``"optimizer": {"type": "HybridMuon", ...}``.

    Every key and default of deepmd-kit 3.2.0, plus stricter value checks, the accepted legacy keys, and the removed
    options (:data:`.validation.REMOVED_KEYS`): any value of one fails with the text that says what to do, and they have
    no default (nothing is filled in for an input without them).
    """
    return [_argument(row) for option in OPTIONS for row in option.items or (option,) if row.input_key]


def options_markdown() -> str:
    """The option table of the README, generated from :data:`.options.OPTIONS`.

    One row per input key, with the constructor keyword it sets (``adam_beta1`` sets ``adam_betas[0]``), and one per
    keyword without an input key (``lr``: dp takes it from the ``learning_rate`` section); no removed keys.
    """
    lines = ["| key | Python keyword | type | default | meaning |", "|---|---|---|---|---|"]
    for option in OPTIONS:
        if option.scope == "removed":
            continue
        for i, row in enumerate(option.items or (option,)):
            alias = f" (alias `{'`, `'.join(row.alias)}`)" if row.alias else ""
            key = f"`{row.name}`{alias}" if row.input_key else "—"
            keyword = "—" if option.scope == "legacy" else f"`{option.name}{f'[{i}]' if option.items else ''}`"
            types = " \\| ".join(sorted("null" if t is type(None) else t.__name__ for t in row.types))
            doc = row.doc.replace("|", "\\|")
            lines.append(f"| {key} | {keyword} | {types} | `{json.dumps(row.default)}` | {doc} |")
    return "\n".join(lines)
