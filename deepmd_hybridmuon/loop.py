"""The per-parameter loop: the reference implementation of one param_group's step.

One parameter at a time, in the order of the algorithm written out in
:class:`~deepmd_hybridmuon.HybridMuonOptimizer`'s docstring, with the rules of
:mod:`.functional`. The flat engine (:mod:`.engine`) and the distributed steps
(:mod:`.distributed`) compute the same step and are tested against this one. The state
helpers (:func:`grad_of`, :func:`local_state`, :func:`advance_adam_state`) are shared with
:mod:`.distributed`, whose shards keep the same state layout.

``state`` is the optimizer's ``state`` (parameter -> dict, created on first use), in
deepmd-kit 3.2.0's layout: ``exp_avg``, ``exp_avg_sq`` (float32), ``beta1_pow``,
``beta2_pow`` (floats) for the Adam routes; ``momentum_buffer`` and, with Magma,
``magma_score`` (float32, one per matrix of the view) for Muon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import functional as F
from .dtensor import is_dtensor, local_shard

__all__ = ["advance_adam_state", "advance_powers", "follow_shape", "grad_of", "local_state", "step_group"]

#: (parameter, gradient, (batch, rows, cols) view, finite gate on the parameter's device)
MuonEntry = tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], torch.Tensor]


def step_group(
    state: dict,
    group: dict[str, Any],
    route_of: Callable[[torch.Tensor, dict[str, Any]], F.ParamRoute],
    shared: torch.Tensor | None = None,
) -> None:
    """One step of ``group``; ``shared``: the finite gate already agreed across ranks, else ``None``."""
    settings = F.GroupSettings.of(group)
    muon: list[MuonEntry] = []
    active = [p for p in group["params"] if p.grad is not None and p.numel() > 0]
    if not active:
        return
    grads = [grad_of(p) for p in active]
    routes = [route_of(p, group) for p in active]
    if shared is not None:
        ok = shared
    else:  # Adam gradients also below ADAM_GRAD_LIMIT (functional.finite_gate)
        adam = [g for g, r in zip(grads, routes, strict=True) if r.route != "muon"]
        ok = F.finite_gate([g for g, r in zip(grads, routes, strict=True) if r.route == "muon"], adam)
    gates = {ok.device: ok}  # the one gate, copied to each device the group's parameters live on
    for p, grad, route in zip(active, grads, routes, strict=True):
        if grad.device not in gates:
            gates[grad.device] = ok.to(grad.device)
        if route.route == "muon":
            assert route.view is not None  # route_parameter gives a view for every Muon route
            muon.append((p, grad, route.view, gates[grad.device]))
            continue
        _adam(state, p, grad, settings, settings.adam_decay(route.route), gates[grad.device])
    if muon:
        _muon(state, settings, muon)


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``; a DTensor gradient laid out like its DTensor parameter (FSDP2's already is)."""
    grad = p.grad
    assert grad is not None
    if is_dtensor(p) and is_dtensor(grad):
        if grad.device_mesh != p.device_mesh or grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


def local_state(state: dict, p: torch.Tensor, key: str) -> torch.Tensor:
    """The local shard of the parameter-shaped state ``key`` of ``p`` (the tensor itself if not sharded).

    A full tensor under a DTensor parameter (a single-process checkpoint loaded with
    ``load_state_dict`` under FSDP2) is sharded like the parameter first.
    """
    entry = state[p]
    value = entry[key]
    if is_dtensor(p) and not is_dtensor(value) and value.shape == p.shape:
        from torch.distributed.tensor import distribute_tensor

        value = entry[key] = distribute_tensor(value, p.device_mesh, p.placements, src_data_rank=None)
    return local_shard(value)


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


def advance_adam_state(state: dict, p: torch.Tensor, settings: F.GroupSettings) -> dict[str, Any]:
    """The Adam state of ``p`` (created at the first step: float32 moments) with this step's powers beta^t."""
    entry = state[p]
    follow_shape(entry, ("exp_avg", "exp_avg_sq"), p)
    if "exp_avg" not in entry:
        entry["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)  # a DTensor for a DTensor p
        entry["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
        entry["beta1_pow"] = 1.0
        entry["beta2_pow"] = 1.0
    advance_powers(entry, settings)
    return entry


def advance_powers(entry: dict[str, Any], settings: F.GroupSettings) -> None:
    """One more Adam step in the state ``entry``: ``beta1_pow`` and ``beta2_pow`` (beta^t) times beta."""
    entry["beta1_pow"] *= settings.beta1
    entry["beta2_pow"] *= settings.beta2


def _adam(
    state: dict, p: torch.Tensor, grad: torch.Tensor, settings: F.GroupSettings, decay: float | None, ok: torch.Tensor
) -> None:
    entry = advance_adam_state(state, p, settings)
    F.adam_update_(
        p,
        grad,
        entry["exp_avg"],
        entry["exp_avg_sq"],
        beta1=settings.beta1,
        beta2=settings.beta2,
        beta1_pow=entry["beta1_pow"],
        beta2_pow=entry["beta2_pow"],
        lr=settings.adam_lr,
        decay_factor=decay,
        ok=ok,
    )


def _muon(state: dict, settings: F.GroupSettings, entries: list[MuonEntry]) -> None:
    """Muon, one parameter at a time (parameters are independent; one full matrix alive at a time)."""
    for p, grad, (bs, rows, cols), ok in entries:
        entry = state[p]
        follow_shape(entry, ("momentum_buffer",), p)
        if "momentum_buffer" not in entry:
            entry["momentum_buffer"] = torch.zeros_like(grad)
        buf = entry["momentum_buffer"]
        g = F.sanitize(grad.to(buf.dtype), ok)
        if settings.weight_decay > 0:
            p.mul_(F.gate_factor(settings.muon_decay, ok, p.dtype))
        update = F.nesterov_momentum_(buf, g, settings.momentum, ok)

        damp = None
        if settings.magma:
            score = entry.get("magma_score")
            if score is None or score.shape != (bs,) or score.device != p.device:
                score = torch.full((bs,), F.MAGMA_INITIAL_SCORE, dtype=torch.float32, device=p.device)
                entry["magma_score"] = score
            raw = F.magma_raw_score(buf.reshape(bs, -1), g.reshape(bs, -1))
            damp = F.magma_scale_(score, raw, ok)

        orth = F.orthogonalize(update.reshape(bs, rows, cols), settings.use_gram)
        delta = orth * settings.scale(rows, cols)
        if damp is not None:
            delta = delta * damp.view(bs, 1, 1).to(delta.dtype)
        p.addcmul_(delta.reshape(p.shape), ok.to(p.dtype) * -settings.lr)
