"""Checks of user input: numbers, and every option of the table (:mod:`.options`) in a param_group.

Each error names the key, the value and what is allowed. Used by the optimizer (constructor,
``add_param_group``) and by the schema (``dp check``), so both say the same thing.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
import numbers
import reprlib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .options import GROUP_KEYS, OPTIMIZER_KEYS, OPTION, OPTIONS, SETTINGS, Option

#: Input-file aliases of the options, with the option each stands for (``muon_momentum``: ``momentum``).
ALIASES: dict[str, str] = {alias: option.name for option in OPTIONS for alias in option.alias}
#: Keys of deepmd-kit < 3.2's HybridMuon (its inputs and checkpoints); deepmd's compat step still moves them
#: into the optimizer section. Accepted with a deprecation message and mapped by :func:`resolve_legacy_keys`.
LEGACY_KEYS: tuple[str, ...] = tuple(option.name for option in OPTIONS if option.scope == "legacy")
_LR = "lr (Muon's rate; lr_adjust > 0 sets Adam's to lr/lr_adjust)"
_DECAY = "weight_decay (one for the Muon and AdamW routes; Adam-routed parameters are never decayed)"
_ROUTE = "param_names (routing is by name and shape: a name's leaf prefixed adam_ or adamw_ takes Adam or AdamW)"
_NONE = "remove it: HybridMuon has no such setting"
#: Keys of a param_group that name a HybridMuon setting otherwise (its input-file alias, its deprecated form, the
#: name other Muon and Adam optimizers give it, their routing and per-route settings), with what to use instead.
#: A param_group holding one is refused with that text (:func:`misread_keys`): a setup ported from another
#: optimizer would otherwise train with settings other than those it wrote.
MISNAMED_KEYS: dict[str, str] = {
    **ALIASES,
    **dict.fromkeys(LEGACY_KEYS, "muon_mode"),
    "use_muon": _ROUTE,
    **dict.fromkeys(("learning_rate", "muon_lr", "adam_lr", "adamw_lr", "lr_scale"), _LR),
    **dict.fromkeys(("betas", "beta1", "beta2", "adam_beta1", "adam_beta2", "adamw_betas"), "adam_betas"),
    **dict.fromkeys(("eps", "epsilon", "adam_eps", "adamw_eps"), f"{_NONE} (Adam's epsilon is 1e-20)"),
    **dict.fromkeys(
        ("wd", "muon_weight_decay", "weight_decay_muon", "adam_weight_decay", "adamw_weight_decay"), _DECAY
    ),
    "nesterov_momentum": "momentum",
    "nesterov": f"{_NONE} (Muon always takes the Nesterov update)",
    **dict.fromkeys(("ns_steps", "ns_coefficients"), f"{_NONE} (Newton-Schulz runs fixed schedules; enable_gram)"),
    "adjust_lr_fn": "lr_adjust and lr_adjust_coeff",
}
#: Keys that torch writes into a param_group (its ``param_names``, its schedulers' and ``swa_utils``' keys), and the
#: constructor's keywords that ``ZeroRedundancyOptimizer`` copies into every group: kept, without a word.
TORCH_KEYS: frozenset[str] = (
    frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "swa_lr"})
    | OPTIMIZER_KEYS
)
_GROUP_KEY_SET = frozenset(GROUP_KEYS)
#: What :func:`revalidate` snapshots: the group's options and the optimizer-wide settings it may hold (ZeRO's copy).
_CHECKED_KEYS: tuple[str, ...] = GROUP_KEYS + SETTINGS
#: Options that were removed, and what to do instead. The constructor, ``add_param_group`` and
#: the schema (``dp check``, ``dp train``) refuse each by name with this text.
REMOVED_KEYS: dict[str, str] = {option.name: option.doc for option in OPTIONS if option.scope == "removed"}


def resolve_legacy_keys(section: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An optimizer section or saved param_group in this version's keys, and a message per legacy key set.

    ``muon_2d_only`` becomes ``muon_mode`` (true: ``"2d"``, false: ``"flat"``); ``min_2d_dim`` is dropped
    (matrices are routed by shape and ``muon_mode``). The result is a copy; ``section`` is not modified.
    """
    out = {k: v for k, v in section.items() if k not in LEGACY_KEYS}
    messages: list[str] = []
    only_2d = section.get("muon_2d_only")
    if only_2d is not None:
        mode = "2d" if only_2d else "flat"
        messages.append(
            f"optimizer.muon_2d_only={only_2d!r} is deprecated since deepmd-kit 3.2; "
            f'using muon_mode={mode!r}. Replace it with "muon_mode": "{mode}".'
        )
        out["muon_mode"] = mode
    if section.get("min_2d_dim") is not None:
        messages.append(
            f"optimizer.min_2d_dim={section['min_2d_dim']!r} is deprecated since deepmd-kit 3.2 and "
            "ignored: matrices are routed by shape and muon_mode. Remove it."
        )
    return out, messages


def check_removed(keys: Any) -> None:
    """Raise ``ValueError`` with :data:`REMOVED_KEYS`' text for the first removed option among ``keys``."""
    for key in keys:
        if key in REMOVED_KEYS:
            raise ValueError(REMOVED_KEYS[key])


def check_option(option: Option, value: Any, key: str | None = None) -> None:
    """Raise ``ValueError`` unless ``value`` is allowed for ``option`` (named ``key`` in the message; its name)."""
    key = key or option.name
    if option.scope == "removed":
        raise ValueError(option.doc)
    if option.items:
        if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != len(option.items):
            names = ", ".join(item.name.rsplit("_", 1)[-1] for item in option.items)  # adam_beta1 -> beta1
            raise ValueError(f"Invalid {key}: {value!r}; expected a pair ({names})")
        for i, (item, part) in enumerate(zip(option.items, value, strict=True)):
            check_option(item, part, f"{key}[{i}]")
    elif option.choices:
        if not isinstance(value, str) or value.lower() not in option.choices:
            raise ValueError(f"Invalid {key}: {value!r}; {option.allowed}")
    elif option.types == (bool,):
        if not isinstance(value, bool):
            raise ValueError(f"Invalid {key}: {value!r}; expected true or false")
    else:  # a finite real in [low, high] (or [low, high)); a NumPy number or a one-element tensor without grad too
        tensor = isinstance(value, torch.Tensor)
        scalar = tensor and value.numel() == 1 and not (value.requires_grad or value.is_meta or value.is_complex())
        if not scalar and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
            raise ValueError(f"Invalid {key}: {_short(value)}; expected a real number")
        try:
            number = float(value)
        except OverflowError:  # 10**400, a Fraction beyond float's range: no float
            number = math.inf
        low, high = option.low, option.high
        if not math.isfinite(number):
            raise ValueError(f"Invalid {key}: {_short(value)}; expected a finite number")
        if 0 < number < option.least:
            raise ValueError(f"Invalid {key}: {_short(value)}; {option.allowed}")
        if number < low or (high is not None and (number >= high if option.high_open else number > high)):
            upper = "inf)" if high is None else f"{high:g}{')' if option.high_open else ']'}"
            raise ValueError(f"Invalid {key}: {value!r}; expected a value in [{low:g}, {upper}")


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 100


def _short(value: Any) -> str:
    """``repr(value)``, shortened (a key or value of megabytes is named by its first characters)."""
    return _REPR.repr(value)


def validate_group(group: dict[str, Any]) -> None:
    """Check every hyperparameter of one param_group; raise ``ValueError`` naming the bad one.

    A key that names a HybridMuon setting otherwise (:func:`misread_keys`) is refused with the key to use instead.
    The keys torch writes (:data:`TORCH_KEYS`) are kept silently; any other key (a label such as ``"name"``) is kept
    and ignored, with a ``UserWarning`` that names it, issued here: Python's default filter shows it once per key.
    Choices are stored lower-case.
    """
    check_removed(group)
    if misread := misread_keys(group):
        raise ValueError(
            "; ".join(f"Invalid param_group key {_short(k)}: {_short(group[k])}; {do}" for k, do in misread)
        )
    for key in group:
        if key not in _GROUP_KEY_SET and key not in TORCH_KEYS:
            warnings.warn(f"param_group key {_short(key)} is no HybridMuon setting: kept and ignored", stacklevel=1)
    for key in GROUP_KEYS:
        if key not in group:
            raise ValueError(f"Invalid param_group: no {key}; expected every key of {list(GROUP_KEYS)}")
        check_option(OPTION[key], group[key])
        if OPTION[key].choices:
            group[key] = group[key].lower()


def check_settings(group: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` if ``group`` holds a setting of the whole optimizer (``settings``) at another value.

    ``ZeroRedundancyOptimizer`` copies every constructor keyword into its groups: the optimizer's own value is kept.
    Another one would not apply to the group.
    """
    for key, value in settings.items():
        if key in group and group[key] is not value:
            raise ValueError(
                f"Invalid param_group key {key}: {_short(group[key])}; it is a setting of the whole optimizer "
                f"({value!r} here), given to the constructor, not per param_group"
            )


def revalidate(group: dict[str, Any], before: tuple | None, settings: Mapping[str, Any]) -> tuple:
    """Check what changed in ``group`` since the snapshot ``before`` (all of it when ``None``); the new snapshot.

    :meth:`HybridMuonOptimizer.step` calls it for every group and step: what a scheduler writes each step (the learning
    rate) costs one number's check. A value that is or holds a tensor is checked every step: it may change in place
    (torch's schedulers ``fill_`` a tensor learning rate; betas given as tensors), and the step reads it anyway. Another
    set of keys checks the whole group again. A list (``adam_betas``) is kept as a tuple: changed in place, it differs.
    ``settings``: the optimizer's own (:func:`check_settings`).
    """
    values = tuple(tuple(v) if isinstance(v, list) else v for v in map(group.get, _CHECKED_KEYS))
    others = group.keys() - _GROUP_KEY_SET
    if before is None or before[1] != others:
        validate_group(group)
        check_settings(group, settings)
        return values, others
    for key, old, new in zip(_CHECKED_KEYS, before[0], values, strict=True):
        if old is new and type(new) in _PLAIN:
            continue
        # the same object is checked again if it holds a tensor; a checked value is never NaN, so a NaN always
        # differs; another type (a NumPy array) is checked
        if _tensors(new) if old is new else _tensors(old) or _tensors(new) or type(old) is not type(new) or old != new:
            if key not in group:
                validate_group(group)  # says which key is missing
            elif key in settings:
                check_settings(group, settings)
            else:
                check_option(OPTION[key], new)
                if OPTION[key].choices:
                    group[key] = new.lower()
    return values, others


#: Types whose objects never change: the same one is the same value.
_PLAIN = frozenset({float, int, bool, str, type(None)})


def _tensors(value: Any) -> bool:
    """Whether ``value`` is a tensor or a tuple holding one."""
    if isinstance(value, tuple):
        return any([isinstance(item, torch.Tensor) for item in value])
    return isinstance(value, torch.Tensor)


def misread_keys(group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """The keys of ``group`` that name a setting HybridMuon has under another name, each with what to do instead.

    Those are :data:`MISNAMED_KEYS`, a group key or one of those written in another case or with spaces, a close
    misspelling of a group key, and the hyperparameters of torch's other optimizers (``dampening``, ...), sorted.
    """
    found = []
    for key in group:
        if not isinstance(key, str) or key in _GROUP_KEY_SET or key in TORCH_KEYS:
            continue
        plain = key.strip().lower().replace("-", "_")
        use = MISNAMED_KEYS.get(key) or MISNAMED_KEYS.get(plain) or (plain if plain in _GROUP_KEY_SET else None)
        if use is None and key in _torch_hyperparameters():
            use = _NONE
        if use is None and (close := difflib.get_close_matches(plain, _GROUP_KEY_SET, n=1, cutoff=0.85)):
            use = close[0]
        if use is not None:
            found.append((key, use if use.startswith("remove") else f"use {use}"))
    return sorted(found)


@functools.cache
def _torch_hyperparameters() -> frozenset[str]:
    """The constructor keywords of torch's optimizers (``torch.optim``) that HybridMuon has not."""
    names = set()
    for value in vars(torch.optim).values():
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            names.update(inspect.signature(value).parameters)
    return frozenset(names - set(GROUP_KEYS) - {"params", "self", "defaults"})


def check_names(names: Any, count: int, where: str) -> None:
    """Raise ``ValueError`` unless ``names`` (the ``param_names`` of ``where``, if any) name ``count`` parameters."""
    if names is not None and (not isinstance(names, Sequence) or isinstance(names, str) or len(names) != count):
        raise ValueError(f"Invalid param_names of {where}: {_short(names)}; expected one name per parameter ({count})")


def check_parameters(params: Sequence[torch.Tensor], group_index: int) -> None:
    """Raise ``ValueError`` unless the parameters of param_group ``group_index`` are real floating point, each once.

    Complex parameters would lose their imaginary part in the Adam moments (float32) and Newton–Schulz (real matrices);
    integer ones cannot take a gradient step. A parameter listed twice would take two steps with one state.
    """
    first: dict[int, int] = {}
    for i, p in enumerate(params):
        if not p.is_floating_point():
            raise ValueError(
                f"Invalid parameter {i} of param_group {group_index}: dtype {p.dtype}; "
                "expected a real floating-point parameter (float16, bfloat16, float32 or float64)"
            )
        j = first.setdefault(id(p), i)
        if j != i:
            raise ValueError(
                f"Invalid parameter {i} of param_group {group_index}: the same tensor as parameter {j}; "
                "expected each parameter once"
            )


def check_gradients(groups: Sequence[dict[str, Any]]) -> None:
    """Raise ``ValueError`` if a gradient is not a dense (strided) tensor, before a step changes anything.

    Sparse gradients (``nn.Embedding(sparse=True)``) have no matrix form for Newton–Schulz and no
    dense moments for Adam.
    """
    for g, group in enumerate(groups):
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is not None and grad.layout != torch.strided:
                raise ValueError(
                    f"Invalid gradient of parameter {i} of param_group {g}: layout {grad.layout}; expected a dense "
                    "(torch.strided) gradient (HybridMuon has no sparse update; e.g. use nn.Embedding(sparse=False))"
                )
