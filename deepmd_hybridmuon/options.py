"""The optimizer's options, written once: one :class:`Option` per row of :data:`OPTIONS`.

Everything else reads this table: the ``dp`` schema and the README's option table (:mod:`.schema`), the input checks
(:mod:`.validation`), the constructor's keys, the settings that are pickled and the key that rebuilds a group's engine
(:mod:`.optimizer`), and the keywords ``dp check`` builds the optimizer with (:mod:`.cli`). Its rows are in the schema's
order (the order ``dp check`` prints).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .functional import MUON_MODES


@dataclass(frozen=True)
class Option:
    """One option of the optimizer.

    Attributes
    ----------
    name
        Its constructor keyword and param_group key (scope ``"group"``), its optimizer
        attribute (scope ``"optimizer"``) or its input key (the other scopes, and the items).
    types
        The types an input may give (``type(None)``: null).
    default
        The constructor's and the schema's default (a removed option has none).
    doc
        What it does (the schema's and the README's text); for a removed option, what to do instead.
    scope
        ``"group"``: a param_group key; ``"optimizer"``: a setting of the whole optimizer;
        ``"legacy"``: an input key of deepmd-kit < 3.2, mapped by :func:`.validation.resolve_legacy_keys`;
        ``"removed"``: refused by name, with ``doc`` as the message.
    effect
        ``"build"``: fixed when a group's engine is built, a change rebuilds it; ``"step"``: read
        each step. ``None`` for the legacy and removed keys.
    low, high, high_open
        A number's range, ``[low, high]`` (``[low, high)`` if ``high_open``); no ``high``: no upper
        bound; ``low`` of ``-inf``: any finite number.
    choices
        The allowed strings (case-insensitive; stored lower-case).
    alias
        Other input keys for it.
    input_key
        Whether ``name`` is a key of the input's ``optimizer`` section.
    items
        For a tuple value: one row per item, each an input key of its own.
    least
        The smallest positive value allowed; a positive one below it is refused (0: no such bound).
    """

    name: str
    types: tuple[type, ...]
    default: Any
    doc: str
    scope: str = "group"
    effect: str | None = "step"
    low: float = -math.inf
    high: float | None = None
    high_open: bool = False
    choices: tuple[str, ...] = ()
    alias: tuple[str, ...] = ()
    input_key: bool = True
    items: tuple[Option, ...] = ()
    least: float = 0.0

    @property
    def allowed(self) -> str:
        """What a value must be, as the schema's errors say it."""
        if self.scope == "removed":
            return self.doc
        if self.choices:
            return "expected one of " + ", ".join(map(repr, self.choices))
        if self.least:
            return f"expected a finite number <= 0 or >= {self.least:g}"
        if self.low == -math.inf:
            return "expected a finite number"
        if self.high is None:
            return f"expected a number >= {self.low:g}"
        return f"expected a number in [{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


def _unit(name: str, default: float, doc: str, **more: Any) -> Option:
    return Option(name, (float,), default, doc, low=0.0, high=1.0, high_open=True, **more)


_NULL = type(None)
#: The bound of the settings that scale a step: ``lr``, ``weight_decay`` and ``lr_adjust_coeff`` are at most
#: ``RATE_LIMIT`` and a positive ``lr_adjust`` at least ``1 / RATE_LIMIT``. The step's factors (``lr * weight_decay``,
#: ``lr / lr_adjust * weight_decay``, ``lr * lr_adjust_coeff * sqrt(n)``) then stay below 1e25, far inside float32's
#: and bfloat16's range (3.4e38): a larger setting overflowed the first step into inf and NaN parameters.
RATE_LIMIT = 1e8
_BETAS = (
    _unit("adam_beta1", 0.9, "Adam beta1 of the Adam/AdamW routes (biases, 1-D tensors, adam_/adamw_ names)."),
    _unit("adam_beta2", 0.95, "Adam beta2 of the Adam/AdamW routes."),
)

#: Every option, in the schema's order.
OPTIONS: tuple[Option, ...] = (
    Option(
        "lr",
        (float,),
        5e-4,
        "Learning rate (from deepmd's learning_rate section).",
        low=0.0,
        high=RATE_LIMIT,
        input_key=False,
    ),
    _unit(
        "momentum",
        0.95,
        "Muon momentum beta in [0, 1): m <- beta*m + (1-beta)*g, Nesterov update beta*m + (1-beta)*g.",
        alias=("muon_momentum",),
    ),
    Option(
        "adam_betas",
        (float,),
        tuple(item.default for item in _BETAS),
        "(beta1, beta2) of the Adam/AdamW routes.",
        input_key=False,
        items=_BETAS,
    ),
    Option(
        "weight_decay",
        (float,),
        0.001,
        "Decoupled weight decay p <- p*(1 - lr*weight_decay) of the Muon and AdamW routes "
        "(AdamW uses the Adam learning rate). Adam-routed parameters are never decayed.",
        low=0.0,
        high=RATE_LIMIT,
    ),
    Option(
        "lr_adjust",
        (float,),
        0.0,
        "<= 0: Muon update scale lr_adjust_coeff*sqrt(max(m, n)) (matches Adam's update RMS, so Adam learning rates "
        "carry over) and Adam at lr. > 0: Muon scale sqrt(max(1, m/n)) and Adam at lr/lr_adjust.",
        effect="build",
        least=1 / RATE_LIMIT,
    ),
    Option(
        "lr_adjust_coeff",
        (float,),
        0.18,
        "Coefficient of the match-RMS Muon scale when lr_adjust <= 0 (0.18: DeepSeek-V4; Moonlight uses 0.2).",
        effect="build",
        low=0.0,
        high=RATE_LIMIT,
    ),
    Option(
        "muon_mode",
        (str,),
        "slice",
        "How a tensor is seen as matrices (shape with size-1 dims dropped). "
        "'2d': rank-2 tensors only; higher ranks go to AdamW. "
        "'flat': one (prod(shape[:-1]), shape[-1]) matrix. "
        "'slice' (default): rank >= 3 is a batch of trailing (m, n) matrices, each orthogonalised alone. "
        "Choices: '2d' | 'flat' | 'slice'.",
        effect="build",
        choices=MUON_MODES,
    ),
    Option(
        "enable_gram",
        (bool,),
        True,
        "Gram Newton-Schulz (Polar Express coefficients, fp16) for rectangular matrices; "
        "square ones keep the bf16 standard iteration, on every device. On the CPU (no fast fp16 products) the same "
        "five polynomials run in the fp32 standard form.",
        effect="build",
    ),
    Option(
        "flash_muon",
        (bool,),
        True,
        "Triton kernels on CUDA: one program per matrix orthogonalises every Muon matrix whose smaller side is at most "
        "128 (in registers, or streamed for long matrices; larger ones take batched cuBLAS), in a few launches per "
        "step. They compile in the background on first use (the torch path runs meanwhile) and are cached by Triton. "
        "Off, or without Triton or a GPU: batched torch kernels for every matrix. (In deepmd-kit 3.2.0 the flag "
        "selects a Triton kernel for matrices with a side of 1024 or more.)",
        scope="optimizer",
        effect="build",
    ),
    Option(
        "magma_muon",
        (bool,),
        True,
        "Magma-lite (deepmd-kit's name): scale each Muon matrix update by 0.1 + 0.9*score, the score a running "
        "average (EMA 0.9, from 0.5) of how far momentum and gradient point the same way (a stretched sigmoid of "
        "their cosine); about 0.55 while gradients are noisy. Adam routes untouched.",
        effect="build",
    ),
    Option(
        "nonfinite_across_ranks",
        (bool,),
        False,
        "All-reduce the finite flag of each param_group's step over the default process group, so that a "
        "non-finite gradient on any rank skips its group's step on every rank (the plugin turns it on for "
        "zero_stage 1). Every rank must then call step() the same number of times.",
        scope="optimizer",
        effect="build",
        input_key=False,
    ),
    Option(
        "muon_2d_only",
        (bool, _NULL),
        None,
        "Deprecated (deepmd-kit < 3.2). true -> muon_mode '2d', false -> muon_mode 'flat'; "
        "overrides muon_mode, with a DeprecationWarning.",
        scope="legacy",
        effect=None,
    ),
    Option(
        "min_2d_dim",
        (int, _NULL),
        None,
        "Deprecated (deepmd-kit < 3.2) and ignored: every matrix is routed by its shape "
        "and muon_mode. Accepted with a DeprecationWarning.",
        scope="legacy",
        effect=None,
    ),
    Option(
        "ddp_split",
        (bool, int, float, str, list, dict, _NULL),  # any JSON value
        None,
        "ddp_split was removed; remove the key: under DDP every replica orthogonalises all the Muon matrices, "
        "which measured cheaper for DeePMD models than splitting them across the replicas (BENCHMARKS.md)",
        scope="removed",
        effect=None,
    ),
)
#: The rows by name.
OPTION: dict[str, Option] = {option.name: option for option in OPTIONS}
#: The settings of the whole optimizer (the rows of scope "optimizer"): constructor keywords kept as attributes.
SETTINGS: tuple[str, ...] = tuple(option.name for option in OPTIONS if option.scope == "optimizer")
#: Constructor keywords that are no param_group keys: the settings, and two that set nothing per
#: group. (torch's ZeroRedundancyOptimizer keeps them in its param_groups all the same.)
OPTIMIZER_KEYS: frozenset[str] = frozenset({*SETTINGS, "use_foreach", "named_parameters"})
#: The keys of a param_group (the rows of scope ``"group"``) in deepmd-kit 3.2.0's order, so that
#: checkpoints move both ways and messages list them as they always did.
GROUP_KEYS: tuple[str, ...] = (
    "lr",
    "momentum",
    "weight_decay",
    "adam_betas",
    "lr_adjust",
    "lr_adjust_coeff",
    "muon_mode",
    "enable_gram",
    "magma_muon",
)


def option_doc(option: Option) -> str:
    """What the constructor's docstring says of ``option``: its text, default and allowed values (the table's)."""
    text = f"{option.doc} Default {option.default!r}"
    if option.items:
        return text + f"; each item {option.items[0].allowed}."
    return text + ("." if option.choices or option.types == (bool,) else f"; {option.allowed}.")
