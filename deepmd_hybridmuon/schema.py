"""The ``optimizer`` section schema of type ``HybridMuon`` (dargs), and legacy-key mapping.

Its own imports are dargs, the routing modes of :mod:`.functional` and the input checks of
:mod:`.validation` (the optimizer's, so that ``dp check`` and the constructor say the same).
:mod:`deepmd_hybridmuon.plugin` registers :func:`hybrid_muon_arguments` into deepmd-kit's
``opt_args_plugin`` in place of the built-in entry.
"""

from __future__ import annotations

import json
import math
from typing import Any

from dargs import Argument

from .functional import MUON_MODES
from .validation import REMOVED_KEYS, check_number

__all__ = [
    "HYBRID_MUON_DOC",
    "LEGACY_KEYS",
    "hybrid_muon_arguments",
    "options_markdown",
    "resolve_legacy_keys",
]

HYBRID_MUON_DOC = (
    "HybridMuon optimizer (the deepmd-hybridmuon plugin; drop-in for deepmd-kit's built-in). "
    "Muon (Nesterov momentum, Newton-Schulz orthogonalisation, optional Magma-lite damping) for "
    "weight matrices; Adam for biases and 1-D tensors; AdamW for tensors without a matrix view. "
    "Routing on the last non-numeric segment of the parameter name (case-insensitive): 'b' or "
    "containing 'bias' -> Adam; 'adam_' prefix -> Adam; 'adamw_' prefix -> AdamW; otherwise by "
    "shape with size-1 dimensions dropped: rank < 2 -> Adam; no matrix view in `muon_mode` -> "
    "AdamW; else Muon."
)

#: Keys of deepmd-kit < 3.2 HybridMuon inputs that deepmd's compat step still moves into the
#: optimizer section; accepted with a DeprecationWarning and mapped by :func:`resolve_legacy_keys`.
LEGACY_KEYS: tuple[str, ...] = ("muon_2d_only", "min_2d_dim")


def _in_range(low: float, high: float | None = None, *, open_high: bool = False) -> Any:
    """A dargs ``extra_check``: the optimizer's own range check (one source of truth), as a predicate."""

    def check(value: Any) -> bool:
        try:
            check_number("value", value, low=low, high=high, high_open=open_high)
        except ValueError:
            return False
        return True

    return check


_finite = _in_range(-math.inf)
#: Every value a JSON or YAML input can hold (dargs needs types it can put in a JSON schema).
_ANY_JSON: list[Any] = [bool, int, float, str, list, dict, None]


def hybrid_muon_arguments() -> list[Argument]:
    """Keys of ``"optimizer": {"type": "HybridMuon", ...}``.

    Every key and default of deepmd-kit 3.2.0, plus stricter value checks, the accepted
    legacy keys, and the removed options (:data:`.validation.REMOVED_KEYS`): any value of
    one fails with the text that says what to do, and they have no default (nothing is
    filled in for an input without them).
    """
    unit = "expected a number in [0, 1)"
    return [
        Argument(
            "momentum",
            float,
            optional=True,
            default=0.95,
            alias=["muon_momentum"],
            extra_check=_in_range(0.0, 1.0, open_high=True),
            extra_check_errmsg=unit,
            doc="Muon momentum beta in [0, 1): m <- beta*m + (1-beta)*g, Nesterov update beta*m + (1-beta)*g.",
        ),
        Argument(
            "adam_beta1",
            float,
            optional=True,
            default=0.9,
            extra_check=_in_range(0.0, 1.0, open_high=True),
            extra_check_errmsg=unit,
            doc="Adam beta1 of the Adam/AdamW routes (biases, 1-D tensors, adam_/adamw_ names).",
        ),
        Argument(
            "adam_beta2",
            float,
            optional=True,
            default=0.95,
            extra_check=_in_range(0.0, 1.0, open_high=True),
            extra_check_errmsg=unit,
            doc="Adam beta2 of the Adam/AdamW routes.",
        ),
        Argument(
            "weight_decay",
            float,
            optional=True,
            default=0.001,
            extra_check=_in_range(0.0),
            extra_check_errmsg="expected a number >= 0",
            doc="Decoupled weight decay p <- p*(1 - lr*weight_decay) of the Muon and AdamW routes "
            "(AdamW uses the Adam learning rate). Adam-routed parameters are never decayed.",
        ),
        Argument(
            "lr_adjust",
            float,
            optional=True,
            default=0.0,
            extra_check=_finite,
            extra_check_errmsg="expected a finite number",
            doc="<= 0: Muon update scale lr_adjust_coeff*sqrt(max(m, n)) (matches Adam's update RMS, "
            "so Adam learning rates carry over) and Adam at lr. > 0: Muon scale sqrt(max(1, m/n)) "
            "and Adam at lr/lr_adjust.",
        ),
        Argument(
            "lr_adjust_coeff",
            float,
            optional=True,
            default=0.18,
            extra_check=_in_range(0.0),
            extra_check_errmsg="expected a number >= 0",
            doc="Coefficient of the match-RMS Muon scale when lr_adjust <= 0 (0.18: DeepSeek-V4; Moonlight uses 0.2).",
        ),
        Argument(
            "muon_mode",
            str,
            optional=True,
            default="slice",
            extra_check=lambda v: isinstance(v, str) and v.lower() in MUON_MODES,
            extra_check_errmsg="expected one of '2d', 'flat', 'slice'",
            doc="How a tensor is seen as matrices (shape with size-1 dims dropped). "
            "'2d': rank-2 tensors only; higher ranks go to AdamW. "
            "'flat': one (prod(shape[:-1]), shape[-1]) matrix. "
            "'slice' (default): rank >= 3 is a batch of trailing (m, n) matrices, each orthogonalised alone. "
            "Choices: '2d' | 'flat' | 'slice'.",
        ),
        Argument(
            "enable_gram",
            bool,
            optional=True,
            default=True,
            doc="Gram Newton-Schulz (Polar Express coefficients, fp16) for rectangular matrices; "
            "square ones keep the bf16 standard iteration.",
        ),
        Argument(
            "flash_muon",
            bool,
            optional=True,
            default=True,
            doc="Triton kernels on CUDA: one launch orthogonalises every Muon matrix whose smaller side is at "
            "most 128 (in registers, or streamed for long matrices), one persistent launch per shape those with "
            "a smaller side up to 256 (tiled products with grid-wide barriers), one more computes Magma for all "
            "blocks; "
            "three more copy the gradients in (checking them for NaN/inf), update the momentum, and write "
            "every parameter's update. "
            "They compile in the background on first use (the torch path runs meanwhile) and are cached by "
            "Triton. Off, or without Triton or a GPU: batched torch kernels for every matrix. (In deepmd-kit "
            "3.2.0 the flag selects a Triton kernel for matrices with a side of 1024 or more.)",
        ),
        Argument(
            "magma_muon",
            bool,
            optional=True,
            default=True,
            doc="Magma-lite: damp each Muon matrix update by 0.1 + 0.9*score, score an EMA (0.9, "
            "from 0.5) of the stretched sigmoid of cos(momentum, gradient). Adam routes untouched.",
        ),
        Argument(
            "muon_2d_only",
            [bool, None],
            optional=True,
            default=None,
            doc="Deprecated (deepmd-kit < 3.2). true -> muon_mode '2d', false -> muon_mode 'flat'; "
            "overrides muon_mode, with a DeprecationWarning.",
        ),
        Argument(
            "min_2d_dim",
            [int, None],
            optional=True,
            default=None,
            doc="Deprecated (deepmd-kit < 3.2) and ignored: every matrix is routed by its shape "
            "and muon_mode. Accepted with a DeprecationWarning.",
        ),
        *(
            Argument(
                key, _ANY_JSON, optional=True, extra_check=lambda _: False, extra_check_errmsg=text, doc=text + "."
            )
            for key, text in REMOVED_KEYS.items()
        ),
    ]


def resolve_legacy_keys(optimizer: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Map the legacy keys of an optimizer section onto ``muon_mode``.

    Parameters
    ----------
    optimizer
        The optimizer section (normalised or not).

    Returns
    -------
    tuple[dict[str, Any], list[str]]
        A copy without the legacy keys (and ``muon_mode`` set where they ask it), and one
        deprecation message per legacy key that was set.
    """
    out = {k: v for k, v in optimizer.items() if k not in LEGACY_KEYS}
    messages: list[str] = []
    only_2d = optimizer.get("muon_2d_only")
    if only_2d is not None:
        mode = "2d" if only_2d else "flat"
        messages.append(
            f"optimizer.muon_2d_only={only_2d!r} is deprecated since deepmd-kit 3.2; "
            f'using muon_mode={mode!r}. Replace it with "muon_mode": "{mode}".'
        )
        out["muon_mode"] = mode
    if optimizer.get("min_2d_dim") is not None:
        messages.append(
            f"optimizer.min_2d_dim={optimizer['min_2d_dim']!r} is deprecated since deepmd-kit 3.2 and "
            "ignored: matrices are routed by shape and muon_mode. Remove it."
        )
    return out, messages


def options_markdown() -> str:
    """The option table of the README, generated from :func:`hybrid_muon_arguments`."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for arg in hybrid_muon_arguments():
        if arg.name in REMOVED_KEYS:
            continue
        types = " \\| ".join(sorted("null" if t is type(None) else t.__name__ for t in arg.dtype))
        alias = f" (alias `{'`, `'.join(arg.alias)}`)" if arg.alias else ""
        doc = arg.doc.replace("|", "\\|")
        lines.append(f"| `{arg.name}`{alias} | {types} | `{json.dumps(arg.default)}` | {doc} |")
    return "\n".join(lines)
