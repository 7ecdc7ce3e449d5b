"""The per-parameter loop: the reference implementation of one param_group's step.

The phases of :func:`deepmd_hybridmuon.step.run`, each one parameter at a time, with the rules of :mod:`.functional`
(the algorithm is written out in :class:`~deepmd_hybridmuon.HybridMuonOptimizer`'s docstring). The flat engine
(:mod:`.engine`) and the distributed steps (:mod:`.distributed`) compute the same step and are tested against this one.
The state is created by :mod:`.state` (the same functions for every implementation).

``state`` is the optimizer's ``state`` (parameter -> dict, created on first use), in deepmd-kit 3.2.0's layout:
``exp_avg``, ``exp_avg_sq`` (float32), ``beta1_pow``, ``beta2_pow`` (floats) for the Adam routes; ``momentum_buffer``
and, with Magma, ``magma_score`` (float32, one per matrix of the view) for Muon.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import functional as F
from . import step
from .state import advance_adam_state, muon_state


def step_group(
    state: dict,
    group: dict[str, Any],
    route_of: Callable[[torch.Tensor, dict[str, Any]], F.ParamRoute],
    shared: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """One step of ``group``; ``shared``: the finite gate already agreed across ranks, else ``None``.

    Returns the step's finite gate (1.0: taken, 0.0: skipped), or ``None`` when no parameter had a gradient.
    """
    active = [p for p in group["params"] if p.grad is not None and p.numel() > 0]
    if not active:
        return None
    return step.run(_Phases(state, group, route_of, active, shared))


class _Matrix:
    """A Muon parameter through the step: its gradient and view, then its update and Magma sums."""

    def __init__(self, p: torch.Tensor, grad: torch.Tensor, view: tuple[int, int, int]) -> None:
        self.p, self.grad, self.view = p, grad, view
        self.update: torch.Tensor | None = None
        self.sums: tuple[torch.Tensor, ...] | None = None


class _Phases:
    """The phases of :func:`deepmd_hybridmuon.step.run`, one parameter at a time, on the optimizer's state.

    Each Muon parameter takes its update as soon as its orthogonalised delta exists (in
    :meth:`orthogonalize`): one delta alive at a time.
    """

    def __init__(
        self,
        state: dict,
        group: dict[str, Any],
        route_of: Callable[[torch.Tensor, dict[str, Any]], F.ParamRoute],
        active: list[torch.Tensor],
        shared: torch.Tensor | None,
    ) -> None:
        self.state, self.shared = state, shared
        self.settings = F.GroupSettings.of(group)
        self.adam_params: list[tuple[torch.Tensor, torch.Tensor, str]] = []
        self.matrices: list[_Matrix] = []
        for p in active:
            route = route_of(p, group)
            if route.route == "muon":
                assert route.view is not None  # route_parameter gives a view for every Muon route
                self.matrices.append(_Matrix(p, p.grad, route.view))
            else:
                self.adam_params.append((p, p.grad, route.route))
        self.gates: dict[torch.device, torch.Tensor] = {}
        self.has_muon = bool(self.matrices)  # step.run: phases 3-5 have work (the matrices are fixed from here)
        self.ungated = True  # step.run: a taken step on the CPU runs without the gating arithmetic

    def _ok(self, ok: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """The one gate ``ok``, copied once to each device the group's parameters live on (``None`` stays)."""
        if ok is None:
            return None
        if device not in self.gates:
            self.gates[device] = ok.to(device)
        return self.gates[device]

    def gate(self) -> torch.Tensor:
        ok = self.shared
        if ok is None:  # Adam gradients also below ADAM_GRAD_LIMIT (functional.finite_gate)
            ok = F.finite_gate([m.grad for m in self.matrices], [g for _, g, _ in self.adam_params])
        self.gates = {ok.device: ok}
        return ok

    def adam(self, ok: torch.Tensor | None) -> None:
        s = self.settings
        for p, grad, route in self.adam_params:
            entry = advance_adam_state(self.state, p, s)
            F.adam_update_(
                p,
                grad,
                entry["exp_avg"],
                entry["exp_avg_sq"],
                beta1=s.beta1,
                beta2=s.beta2,
                beta1_pow=entry["beta1_pow"],
                beta2_pow=entry["beta2_pow"],
                lr=s.adam_lr,
                decay_factor=s.adam_decay(route),
                ok=self._ok(ok, grad.device),
            )

    def before_orthogonalize(self, ok: torch.Tensor | None) -> None:
        s = self.settings
        for m in self.matrices:
            p, (bs, _, _), ok_here = m.p, m.view, self._ok(ok, m.grad.device)
            buf = muon_state(self.state, p, m.grad, bs if s.magma else None)["momentum_buffer"]
            g = F.sanitize(m.grad.to(buf.dtype), ok_here)
            if s.weight_decay > 0:
                p.mul_(F.gate_factor(s.muon_decay, ok_here, p.dtype))
            F.momentum_(buf, g, s.momentum, ok_here)
            if s.magma:
                m.sums = F.magma_sums(buf.reshape(bs, -1), g.reshape(bs, -1))
            m.update = F.nesterov(buf, g, s.momentum)

    def complete_sums(self) -> None:
        """Nothing: each matrix's sums are whole in one process."""

    def orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Each matrix's orthogonalised update (functional.post_orthogonalize), written into its parameter at once."""
        s = self.settings
        for m in self.matrices:
            assert m.update is not None  # before_orthogonalize ran
            bs, rows, cols = m.view
            ok_here = self._ok(ok, m.grad.device)
            ortho = F.orthogonalize(m.update.reshape(bs, rows, cols), s.use_gram)
            m.update = None
            damp = None
            if m.sums is not None:
                damp = F.magma_scale_(self.state[m.p]["magma_score"], F.magma_score(*m.sums), ok_here)
            scale = torch.full((bs,), s.scale(rows, cols), dtype=torch.float32, device=ortho.device)
            factor = F.muon_factor(scale, damp, -s.lr if ok_here is None else ok_here * -s.lr)
            delta = F.post_orthogonalize(ortho, factor, torch.empty(ortho.shape, dtype=m.p.dtype, device=ortho.device))
            m.p.add_(delta.reshape(m.p.shape))

    def apply(self, ok: torch.Tensor | None) -> None:
        """Nothing left: the Adam routes wrote their parameters in :meth:`adam`, Muon's in :meth:`orthogonalize`."""
