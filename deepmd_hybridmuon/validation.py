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
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .options import GROUP_KEYS, OPTION, OPTIONS, Option

#: Input-file aliases of the options, with the option each stands for (``muon_momentum``: ``momentum``).
ALIASES: dict[str, str] = {alias: option.name for option in OPTIONS for alias in option.alias}
#: Keys of deepmd-kit < 3.2's HybridMuon (its inputs and checkpoints); deepmd's compat step still moves them
#: into the optimizer section. Accepted with a deprecation message and mapped by :func:`resolve_legacy_keys`.
LEGACY_KEYS: tuple[str, ...] = tuple(option.name for option in OPTIONS if option.scope == "legacy")
#: Keys of a param_group that spell a HybridMuon option otherwise (its input-file alias, its deprecated
#: form), with the option that stands for them.
MISNAMED_KEYS: dict[str, str] = {**ALIASES, **dict.fromkeys(LEGACY_KEYS, "muon_mode")}
_GROUP_KEY_SET = frozenset(GROUP_KEYS)
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
        scalar = isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad
        if not scalar and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
            raise ValueError(f"Invalid {key}: {value!r}; expected a real number")
        number, low, high = float(value), option.low, option.high
        if not math.isfinite(number):
            raise ValueError(f"Invalid {key}: {value!r}; expected a finite number")
        if number < low or (high is not None and (number >= high if option.high_open else number > high)):
            upper = "inf)" if high is None else f"{high:g}{')' if option.high_open else ']'}"
            raise ValueError(f"Invalid {key}: {value!r}; expected a value in [{low:g}, {upper}")


def validate_group(group: dict[str, Any]) -> None:
    """Check every hyperparameter of one param_group; raise ``ValueError`` naming the bad one.

    A key the optimizer does not read is refused when it looks like a hyperparameter (:func:`misread_keys`)
    and kept otherwise, as torch's optimizers keep the keys their schedulers add (``initial_lr``,
    ``max_lr``, ``swa_lr``, ...). Choices are stored lower-case.
    """
    check_removed(group)
    if unknown := misread_keys(group):
        raise ValueError(f"Unknown param_group keys: {unknown}; expected a subset of {list(GROUP_KEYS)}")
    for key in GROUP_KEYS:
        if key not in group:
            raise ValueError(f"Invalid param_group: no {key}; expected every key of {list(GROUP_KEYS)}")
        check_option(OPTION[key], group[key])
        if OPTION[key].choices:
            group[key] = group[key].lower()


def revalidate(group: dict[str, Any], before: tuple | None) -> tuple:
    """Check what changed in ``group`` since the snapshot ``before`` (all of it when ``None``); the new snapshot.

    :meth:`HybridMuonOptimizer.step` calls it for every group and step: what a scheduler writes each step (the learning
    rate) costs one number's check. A tensor is checked every step: torch's schedulers change a tensor learning rate in
    place (``fill_``), and the step reads its value anyway. Another set of keys checks the whole group again. A list
    (``adam_betas``) is kept as a tuple: changed in place, it differs.
    """
    values = tuple(tuple(v) if isinstance(v, list) else v for v in map(group.get, GROUP_KEYS))
    others = group.keys() - _GROUP_KEY_SET
    if before is None or before[1] != others:
        validate_group(group)
        return values, others
    for key, old, new in zip(GROUP_KEYS, before[0], values, strict=True):
        # a checked value is never NaN, so a NaN always differs
        if isinstance(new, torch.Tensor) or (old is not new and (isinstance(old, torch.Tensor) or old != new)):
            if key not in group:
                validate_group(group)  # says which key is missing
            check_option(OPTION[key], new)
            if OPTION[key].choices:
                group[key] = new.lower()
    return values, others


def misread_keys(group: dict[str, Any]) -> list[str]:
    """The keys of ``group`` a user may mean as a hyperparameter that HybridMuon would not read, sorted.

    Those are another spelling of an option (:data:`MISNAMED_KEYS`, a different case, or a close
    misspelling) and the hyperparameters of torch's other optimizers (``betas``, ``nesterov``, ...).
    """
    return sorted(
        key
        for key in group
        if key not in _GROUP_KEY_SET
        and key != "params"
        and (
            key in MISNAMED_KEYS
            or key.lower() in _GROUP_KEY_SET  # the keys are lower case
            or key in _torch_hyperparameters()
            or difflib.get_close_matches(key, _GROUP_KEY_SET, n=1, cutoff=0.85)
        )
    )


@functools.cache
def _torch_hyperparameters() -> frozenset[str]:
    """The constructor keywords of torch's optimizers (``torch.optim``) that HybridMuon has not."""
    names = set()
    for value in vars(torch.optim).values():
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            names.update(inspect.signature(value).parameters)
    return frozenset(names - set(GROUP_KEYS) - {"params", "self", "defaults"})


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
