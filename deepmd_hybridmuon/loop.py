"""The per-parameter loop: the reference implementation of one param_group's step.

One parameter at a time, in the order of the algorithm written out in
:class:`~deepmd_hybridmuon.HybridMuonOptimizer`'s docstring, with the rules of
:mod:`.functional`. The flat engine (:mod:`.engine`) and the distributed steps
(:mod:`.distributed`) compute the same step and are tested against this one. The state is
created by :mod:`.state` (the same functions for every implementation); :func:`grad_of` is
shared with :mod:`.distributed`.

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
from .dtensor import is_dtensor
from .state import advance_adam_state, follow_shape

__all__ = ["grad_of", "step_group"]

#: (parameter, gradient, (batch, rows, cols) view, finite gate on the parameter's device)
MuonEntry = tuple[torch.Tensor, torch.Tensor, tuple[int, int, int], torch.Tensor]


def step_group(
    state: dict,
    group: dict[str, Any],
    route_of: Callable[[torch.Tensor, dict[str, Any]], F.ParamRoute],
    shared: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One step of ``group``; ``shared``: the finite gate already agreed across ranks, else ``None``.

    Returns the step's finite gate (1.0: taken, 0.0: skipped), or ``None`` when no parameter had a gradient.
    """
    settings = F.GroupSettings.of(group)
    muon: list[MuonEntry] = []
    active = [p for p in group["params"] if p.grad is not None and p.numel() > 0]
    if not active:
        return None
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
    return ok


def grad_of(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``; a DTensor gradient laid out like its DTensor parameter (FSDP2's already is)."""
    grad = p.grad
    assert grad is not None
    if is_dtensor(p) and is_dtensor(grad):
        if grad.device_mesh != p.device_mesh or grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
    return grad


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
