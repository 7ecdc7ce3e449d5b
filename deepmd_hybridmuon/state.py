"""Per-parameter state: its checks, its creation, its adoption by the flat engine, its shards.

Checks of a state dict before :meth:`HybridMuonOptimizer.load_state_dict` changes anything.

A state dict is accepted when it has deepmd-kit 3.2.0's built-in HybridMuon layout (which this package writes too): the
same number of param_groups and parameters, every group carrying HybridMuon's hyperparameters with values the
constructor would accept (:func:`~deepmd_hybridmuon.validation.validate_group`; an option the writer did not have takes
its default, :func:`with_defaults`; keys of torch's schedulers are kept), and per parameter only the state keys of its
rule, each of the parameter's shape, real, and in the range a real run can reach (:data:`STATE_RANGES`). Anything else
(a ``torch.optim.AdamW`` or ``torch.optim.Muon`` state dict, AdamW state under HybridMuon groups, edited or corrupted
values) raises a ``ValueError`` naming the group or parameter and the key, so that the optimizer and every
implementation of its step (loop, flat engine, FSDP2) only ever see state they can step with.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch

from . import functional as F
from .dtensor import is_dtensor, laid_out_like, local_shard
from .options import OPTIMIZER_KEYS, OPTION
from .validation import ALIASES, GROUP_KEYS, LEGACY_KEYS, check_names, resolve_legacy_keys, validate_group

#: State of an Adam-routed parameter: all four keys, or none.
ADAM_STATE: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "beta1_pow", "beta2_pow")
#: State of a Muon-routed parameter (``magma_score`` only with Magma).
MUON_STATE: tuple[str, ...] = ("momentum_buffer", "magma_score")
#: Parameter-shaped tensors among them.
_PARAM_SHAPED: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "momentum_buffer")
#: The param_group keys of every HybridMuon state dict, deepmd-kit's built-in's and this package's, of
#: every version: groups without one were written by another optimizer. Any other option a group lacks
#: takes its default (:func:`with_defaults`): the writer had no such option.
SIGNATURE_KEYS: tuple[str, ...] = ("lr", "momentum", "adam_betas")
#: And each names its routing: ``muon_mode`` (deepmd-kit 3.2, this package) or ``muon_2d_only`` (3.1). deepmd's
#: AdaMuon has the three keys above, and no routing key.
ROUTING_KEYS: tuple[str, ...] = ("muon_mode", "muon_2d_only")
#: What a real run can write into each state tensor: ``[low, high]``. Adam's gradients stay below
#: ``ADAM_GRAD_LIMIT`` (larger ones skip the step), so do its first moment and the square root of its
#: second; every Muon gradient stays below ``GRAD_LIMIT``, and so does the momentum, a blend of them.
STATE_RANGES: dict[str, tuple[float, float]] = {
    "exp_avg": (-F.ADAM_GRAD_LIMIT, F.ADAM_GRAD_LIMIT),
    "exp_avg_sq": (0.0, F.ADAM_GRAD_LIMIT**2),
    "momentum_buffer": (-F.GRAD_LIMIT, F.GRAD_LIMIT),
    "magma_score": (0.0, 1.0),
}
#: And jointly, element by element: ``|exp_avg| <= ADAM_RATIO_LIMIT * (sqrt(exp_avg_sq) + ADAM_EPS)``. A run's
#: first moment is a blend of the gradients whose squares blend into the second: ``|exp_avg| <= 1.2 sqrt(exp_avg_sq)``
#: at the default betas (a bounded multiple whenever beta1^2 < beta2), and where ``exp_avg_sq`` is 0 so is every
#: gradient (up to float32's underflow). Only beta1^2 > beta2 and hundreds of zero gradients after a huge one come
#: near the limit. A larger ratio overflows the increment ``lr * exp_avg / (sqrt(exp_avg_sq) + eps)``: ``exp_avg``
#: 9e18 where ``exp_avg_sq`` is 0 gave -inf parameters at a zero gradient.
ADAM_RATIO_LIMIT: float = 1e30


def check_state_dict(
    state_dict: Any,
    groups: Sequence[Mapping[str, Any]],
    describe: Callable[[torch.Tensor], str],
) -> Any:
    """Raise ``ValueError`` unless ``state_dict`` can be loaded; return it as it loads (:func:`with_defaults`).

    Parameters
    ----------
    state_dict
        What was handed to ``load_state_dict``.
    groups
        The optimizer's current ``param_groups`` (their ``params`` in order: torch numbers the
        parameters of a state dict across the groups in that order).
    describe
        A parameter's description for messages (its name where known).

    Nothing is modified, neither ``state_dict`` nor ``groups`` (what lacks an option is completed in a copy).
    """
    if not isinstance(state_dict, Mapping) or "state" not in state_dict or "param_groups" not in state_dict:
        keys = sorted(state_dict) if isinstance(state_dict, Mapping) else type(state_dict).__name__
        raise ValueError(f"Invalid optimizer state dict: {keys}; expected a mapping with 'state' and 'param_groups'")
    completed = with_defaults(state_dict)
    saved_groups = completed["param_groups"]
    if not isinstance(saved_groups, Sequence) or len(saved_groups) != len(groups):
        count = len(saved_groups) if isinstance(saved_groups, Sequence) else repr(saved_groups)
        raise ValueError(f"Invalid param_groups in the state dict: {count} groups; this optimizer has {len(groups)}")
    # The saved groups' "params" name the parameters the state is keyed by, in the order of the
    # current groups' parameters: indices (torch's state_dict) or names (torch.distributed's
    # get_optimizer_state_dict, which deepmd's FSDP2 checkpoints use). torch pairs them by position.
    for index, (saved, group) in enumerate(zip(saved_groups, groups, strict=True)):
        _check_group(index, saved, len(group["params"]))
    by_saved_id = saved_params(saved_groups, groups)
    state = state_dict["state"]
    if not isinstance(state, Mapping):
        raise ValueError(f"Invalid state in the state dict: {type(state).__name__}; expected a mapping")
    for key, entry in state.items():
        p = by_saved_id.get(key) if isinstance(key, Hashable) else None
        if p is None:
            known = list(by_saved_id)
            shown = known if len(known) <= 6 else [*known[:3], "...", *known[-2:]]
            raise ValueError(f"Invalid state key {key!r}; expected one of the saved param_groups' params {shown}")
        _check_entry(f"parameter {key!r} ({describe(p)})", entry, p)
    return completed


def saved_params(saved_groups: Sequence[Mapping[str, Any]], groups: Sequence[Mapping[str, Any]]) -> dict[Any, Any]:
    """Each id of the saved groups' ``params`` (an index or a name) and the current parameter it stands for.

    Paired by position, group by group, as torch's ``load_state_dict`` pairs them.
    """
    return {
        i: p
        for saved, group in zip(saved_groups, groups, strict=True)
        for i, p in zip(saved["params"], group["params"], strict=True)
    }


def written_by_hybridmuon(state_dict: Any) -> bool | None:
    """Whether a state dict has HybridMuon's param_groups (this package's or deepmd's built-in's).

    ``None`` when it cannot tell (no list of param_groups). :func:`check_state_dict` refuses a
    ``False`` one; the plugin starts the optimizer afresh on a restart across optimizer types.
    """
    groups = state_dict.get("param_groups") if isinstance(state_dict, Mapping) else None
    if not isinstance(groups, Sequence) or not groups or not all(isinstance(g, Mapping) for g in groups):
        return None
    return all(not _lacks(g) for g in groups)


def _lacks(group: Mapping[str, Any]) -> list[str]:
    """The keys every HybridMuon param_group has (:data:`SIGNATURE_KEYS`, a routing key) that ``group`` lacks."""
    missing = [k for k in SIGNATURE_KEYS if k not in group]
    return missing if any(k in group for k in ROUTING_KEYS) else [*missing, ROUTING_KEYS[0]]


def with_defaults(state_dict: Any) -> Any:
    """``state_dict`` as this version reads it (a copy where it differs): what it lacks at the defaults.

    Each option its HybridMuon param_groups lack takes its default; deepmd-kit 3.1's ``muon_2d_only`` is read as
    ``muon_mode`` (:func:`~.validation.resolve_legacy_keys`) and the input-file aliases (:data:`~.validation.ALIASES`)
    are dropped: a checkpoint written before an option existed, or by deepmd's built-in, resumes instead of being taken
    for another optimizer's. Anything else is returned as it is.
    """
    if not written_by_hybridmuon(state_dict):
        return state_dict
    groups = state_dict["param_groups"]
    if all(set(GROUP_KEYS) <= set(g) and not {*ALIASES, *LEGACY_KEYS} & set(g) for g in groups):
        return state_dict
    defaults = {key: OPTION[key].default for key in GROUP_KEYS}
    groups = [{**defaults, **{k: v for k, v in resolve_legacy_keys(g)[0].items() if k not in ALIASES}} for g in groups]
    return {**state_dict, "param_groups": groups}


def _check_group(index: int, saved: Any, count: int) -> None:
    where = f"param_groups[{index}]"
    if not isinstance(saved, Mapping):
        raise ValueError(f"Invalid {where}: {type(saved).__name__}; expected a mapping")
    if missing := _lacks(saved):
        raise ValueError(
            f"Invalid {where}: lacks the HybridMuon keys {missing}; not a HybridMuon state dict "
            f"(expected the keys {list(GROUP_KEYS)})"
        )
    if not isinstance(saved.get("params"), Sequence) or len(saved["params"]) != count:
        got = len(saved["params"]) if isinstance(saved.get("params"), Sequence) else "no list of"
        raise ValueError(f"Invalid {where}: {got} parameters; this optimizer's group {index} has {count}")
    check_names(saved.get("param_names"), count, f"{where} of the state dict")
    try:
        # a copy (validate_group normalises muon_mode in place), without the constructor's other
        # keywords, which ZeroRedundancyOptimizer writes into its param_groups
        validate_group({k: v for k, v in saved.items() if k not in OPTIMIZER_KEYS})
    except ValueError as err:
        raise ValueError(f"{err} (in {where} of the state dict)") from None


def _check_entry(where: str, entry: Any, p: torch.Tensor) -> None:
    if not isinstance(entry, Mapping):
        raise ValueError(f"Invalid state of {where}: {type(entry).__name__}; expected a mapping")
    if unknown := sorted(str(k) for k in entry if k not in ADAM_STATE + MUON_STATE):
        raise ValueError(
            f"Invalid state of {where}: unknown keys {unknown}; expected keys of {list(ADAM_STATE)} (Adam) "
            f"or {list(MUON_STATE)} (Muon)"
        )
    adam = [k for k in ADAM_STATE if k in entry]
    if adam and len(adam) != len(ADAM_STATE):
        missing = [k for k in ADAM_STATE if k not in entry]
        raise ValueError(f"Invalid state of {where}: Adam state without {missing}; expected all of {list(ADAM_STATE)}")
    if adam and any(k in entry for k in MUON_STATE):
        raise ValueError(f"Invalid state of {where}: both Adam and Muon state; a parameter follows one rule")
    for key in ("beta1_pow", "beta2_pow"):
        if key in entry:
            value = entry[key]
            number = float(value) if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if not isinstance(number, (int, float)) or isinstance(number, bool) or not 0.0 <= number <= 1.0:
                raise ValueError(f"Invalid state {key} of {where}: {value!r}; expected a number in [0, 1] (beta^t)")
    for key in (*_PARAM_SHAPED, "magma_score"):
        if key not in entry:
            continue
        value = entry[key]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"Invalid state {key} of {where}: {kind}; expected a real floating-point tensor")
        if key in _PARAM_SHAPED and tuple(value.shape) != tuple(p.shape):
            raise ValueError(
                f"Invalid state {key} of {where}: shape {tuple(value.shape)}; expected the parameter's {tuple(p.shape)}"
            )
        if key == "magma_score":  # one score per matrix of p's view, in any muon_mode that has one
            shape = F.effective_shape(p.shape)
            counts = {view[0] for mode in F.MUON_MODES if (view := F.matrix_view(shape, mode)) is not None}
            if value.dim() != 1 or value.numel() not in counts:
                raise ValueError(
                    f"Invalid state {key} of {where}: shape {tuple(value.shape)}; expected one score per matrix "
                    f"of the parameter's view, shape ({' or '.join(map(str, sorted(counts))) or 'none'},)"
                )
        # A sharded (DTensor) value is checked by its shape only: reading its elements would take collectives.
        if is_dtensor(value) or not value.numel():
            continue
        if not bool(torch.isfinite(value).all()):
            raise ValueError(f"Invalid state {key} of {where}: holds NaN or infinity; expected finite values")
        low, high = STATE_RANGES[key]
        least, most = float(value.amin()), float(value.amax())
        if least < low or most > high:
            raise ValueError(
                f"Invalid state {key} of {where}: values in [{least:.3g}, {most:.3g}]; expected values in "
                f"[{low:.3g}, {high:.3g}], the range a run can reach"
            )
    first, second = entry.get("exp_avg"), entry.get("exp_avg_sq")
    if first is not None and first.numel() and not is_dtensor(first) and not is_dtensor(second):
        # float32, two temporaries (inf where the ratio passes float32's range, which refuses it too)
        denom = second.to(device=first.device, dtype=torch.float32).sqrt().add_(F.ADAM_EPS)
        ratio = float(first.to(torch.float32).abs().div_(denom).amax())
        if ratio > ADAM_RATIO_LIMIT:  # refused: the figure for the message in float64
            ratio = float((first.double().abs() / denom.double()).amax())
            raise ValueError(
                f"Invalid state exp_avg of {where}: |exp_avg| / (sqrt(exp_avg_sq) + {F.ADAM_EPS:g}) reaches "
                f"{ratio:.3g}; expected at most {ADAM_RATIO_LIMIT:.3g}, what a run can reach (exp_avg is a blend of "
                "the gradients whose squares blend into exp_avg_sq)"
            )


def own_memory(state: Mapping[Any, dict[str, Any]], params: Sequence[torch.Tensor]) -> None:
    """Give each state tensor memory of its own (a copy where it shares memory or is not contiguous).

    A state tensor that shares memory with a parameter or another state tensor, or that is not contiguous (an
    expanded, stride-0 one), is copied. torch's ``load_state_dict`` keeps a saved tensor whose dtype and device fit:
    a state dict that aliases itself would have the loop's in-place step write one moment into another.
    """
    seen = {p.untyped_storage().data_ptr() for p in params if p.numel() and not is_dtensor(p)}
    for entry in state.values():
        for key, value in entry.items():
            if not isinstance(value, torch.Tensor) or not value.numel() or is_dtensor(value):
                continue
            if value.untyped_storage().data_ptr() in seen or not value.is_contiguous():
                value = entry[key] = value.clone(memory_format=torch.contiguous_format)
            seen.add(value.untyped_storage().data_ptr())


def check_sizes(state: dict, params: Sequence[torch.Tensor], describe: Callable[[torch.Tensor], str]) -> None:
    """Raise ``ValueError`` if a parameter now has another number of elements than its state (``p.data`` replaced).

    A view of another shape keeps its state, element by element (:func:`follow_shape`); a tensor of
    another size has no element-wise correspondence with it.
    """
    for p in params:
        entry = state.get(p)
        if not entry or is_dtensor(p):
            continue
        for key in _PARAM_SHAPED:
            value = entry.get(key)
            if isinstance(value, torch.Tensor) and value.numel() != p.numel():
                raise ValueError(
                    f"Invalid parameter {describe(p)}: {p.numel()} elements, but its state {key} has {value.numel()} "
                    "(the tensor was replaced by one of another size after steps); expected the same number of "
                    "elements. To start it afresh: del optimizer.state[parameter]"
                )


# ------------------------------------------------------------------------------------------
# Per-parameter state: created, adopted, sharded (every implementation of the step uses these)
# ------------------------------------------------------------------------------------------


def follow_shape(entry: dict[str, Any], keys: tuple[str, ...], p: torch.Tensor) -> None:
    """Give the parameter-shaped state ``keys`` of ``entry`` the shape of ``p`` if it changed in place.

    ``p.data = p.data.view(...)`` keeps the storage and the order of the elements: each element
    keeps its momentum and moments. (Not for sharded parameters, whose state FSDP2 lays out.)
    """
    if is_dtensor(p):
        return
    for key in keys:
        value = entry.get(key)
        if isinstance(value, torch.Tensor) and value.shape != p.shape and value.numel() == p.numel():
            entry[key] = value.reshape(p.shape)


def _follow_rule(entry: dict[str, Any], key: str) -> None:
    """Drop from ``entry`` the state of the other rule than ``key``'s: the route changed (another muon_mode)."""
    for other in MUON_STATE if key in ADAM_STATE else ADAM_STATE:
        entry.pop(other, None)


def advance_adam_state(state: dict, p: torch.Tensor, settings: F.GroupSettings) -> dict[str, Any]:
    """The Adam state of ``p`` (created at the first step: float32 moments) with this step's powers beta^t."""
    entry = state[p]
    _follow_rule(entry, "exp_avg")
    follow_shape(entry, ("exp_avg", "exp_avg_sq"), p)
    if "exp_avg" not in entry:
        entry["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
        entry["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        entry["beta1_pow"] = entry["beta2_pow"] = 1.0
    advance_powers(entry, settings)
    return entry


def muon_state(state: dict, p: torch.Tensor, grad: torch.Tensor, batch: int | None) -> dict[str, Any]:
    """The Muon state of ``p``, created at its first step: ``momentum_buffer``, and with Magma ``magma_score``.

    The momentum is laid out like ``grad``. ``batch``: the number of matrices of ``p``'s view with
    Magma, else ``None``; the score is a float32 ``(batch,)`` tensor on ``p``'s device, and starts
    afresh at :data:`~.functional.MAGMA_INITIAL_SCORE` when the view changed.
    """
    entry = state[p]
    _follow_rule(entry, "momentum_buffer")
    follow_shape(entry, ("momentum_buffer",), p)
    if "momentum_buffer" not in entry:
        entry["momentum_buffer"] = torch.zeros_like(grad)
    if batch is not None:
        score = entry.get("magma_score")
        if score is None or tuple(score.shape) != (batch,) or score.device != p.device:
            entry["magma_score"] = torch.full((batch,), F.MAGMA_INITIAL_SCORE, dtype=torch.float32, device=p.device)
    return entry


def advance_powers(entry: dict[str, Any], settings: F.GroupSettings) -> None:
    """One more Adam step in the state ``entry``: ``beta1_pow`` and ``beta2_pow`` (beta^t) times beta."""
    entry["beta1_pow"] *= settings.beta1
    entry["beta2_pow"] *= settings.beta2


def adopt(
    state: dict, params: Sequence[torch.Tensor], key: str, views: Sequence[torch.Tensor], reshape: bool = True
) -> None:
    """Make ``state[p][key]`` the view in ``views`` for each of ``params``, keeping an existing value.

    The flat engine keeps each state tensor as a view of one flat buffer: an entry of the view's
    shape is copied in first (state loaded, or written by the loop or an earlier engine), any
    other starts from the view's contents. With ``reshape`` (parameter-shaped state), a
    parameter reshaped in place keeps its state, as in the loop (:func:`follow_shape`), and the
    state of an FSDP2 parameter stays a DTensor laid out like it, ``views`` holding its local shards.
    """
    for p, view in zip(params, views, strict=True):
        _follow_rule(state[p], key)
        if reshape:
            follow_shape(state[p], (key,), p)
        old = state[p].get(key)
        sharded = reshape and is_dtensor(p)  # ``view`` is the local shard of a DTensor state
        if isinstance(old, torch.Tensor):
            if not sharded:
                old = old.full_tensor() if is_dtensor(old) else old
            elif not is_dtensor(old) and old.shape == p.shape:
                # a full tensor under a DTensor parameter (a single-process checkpoint loaded under FSDP2)
                from torch.distributed.tensor import distribute_tensor

                old = local_shard(distribute_tensor(old, p.device_mesh, p.placements, src_data_rank=None))
            else:  # a DTensor laid out otherwise is redistributed like p
                old = local_shard(laid_out_like(old, p))
            if old.shape == view.shape:
                view.copy_(old)
        if sharded:  # the DTensor laid out like p whose local shard is ``view`` (sharing its storage)
            from torch.distributed.tensor import DTensor

            view = DTensor.from_local(
                view, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        state[p][key] = view
