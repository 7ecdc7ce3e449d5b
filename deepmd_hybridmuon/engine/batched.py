"""The arithmetic of one flat-engine step, on the buffers of a :class:`~.layout.Layout`.

The step is the per-parameter loop's (:func:`deepmd_hybridmuon.loop.step_group`), batched:

* in: the gradients sit in the layout's flat buffer (copied there by :mod:`.execution`) and
  are checked for non-finite values; every phase then turns its part of that buffer into the update,
  in place;
* Adam/AdamW: a few flat moment/denominator kernels;
* Muon: the momentum, Magma's sums (they read m and g), the Nesterov update over the gradients, then
  per matrix a factor (Muon scale x Magma x -lr) and the orthogonalised update times that factor,
  back into the same place (each program and stack reads its matrix whole before it writes): the
  layout's Triton launches and torch stacks (one per shape);
* out: ``p <- p * decay + update`` (a ``_foreach_mul_`` and a ``_foreach_add_``).

:meth:`BatchedStep.compute` reads only static tensors (the layout's buffers and a
:class:`StepInputs`), so it can be captured in a CUDA graph; the host part of a step is
:meth:`BatchedStep.scalars`. The torch stacks' chains of kernels run inside ``lane``: eagerly on the
current stream; captured, on one side stream beside the Triton launches (:mod:`.execution`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from .. import functional as F
from .. import step
from ..state import advance_powers
from . import compilation
from .layout import Layout, run_fused

#: The step's scalars, read from the group every step (a scheduler may change any of them), each in the
#: dtype the loop uses it in. First, in the parameters' dtype, at least float32 (as torch computes with a Python
#: number): Muon decay, -lr, AdamW decay.
PARAM_DTYPE_SCALARS = 3
#: Then the momentum (float64, as ``functional.momentum_`` takes it); then, in float32: 1 - beta1,
#: 1 - beta2. After them, every Adam parameter's -step size, then every Adam parameter's second bias
#: correction (each parameter keeps its own step count, as in the loop); in a masked step then 1.0 or 0.0 for each
#: parameter of the layout, in its order: whether it has a gradient in this step.
SCALARS = PARAM_DTYPE_SCALARS + 3


class StepInputs:
    """The device tensors through which a step's changing inputs reach :meth:`BatchedStep.compute`.

    Allocated once per step of an engine (a captured graph reads them at fixed addresses): ``scalars``
    holds the float64 scalars of :meth:`BatchedStep.scalars`; ``ok`` is the finite gate agreed
    across ranks (used with ``nonfinite_across_ranks`` only).
    """

    def __init__(self, layout: Layout, masked: bool = False) -> None:
        size = SCALARS + 2 * len(layout.adam) + (len(layout.keys) if masked else 0)
        self.scalars = torch.zeros(size, dtype=torch.float64, device=layout.device)
        self.ok = torch.ones((), dtype=torch.float32, device=layout.device)


class Lane:
    """Where the torch stacks run: here, in order on the current stream."""

    def __call__(self) -> contextlib.AbstractContextManager:
        """Context of a part of the torch stacks' chain, after everything queued so far."""
        return contextlib.nullcontext()

    def join(self) -> None:
        """Make the current stream wait for the lane."""


class BatchedStep:
    """One step of a whole param_group on the flat buffers of ``layout``.

    ``shared_gate``: the finite gate comes in through ``inputs.ok`` (agreed across ranks)
    instead of being computed from this step's gradients. ``masked``: some parameters of the layout may have no
    gradient in a step (multi-task models train one branch at a time); they take no part in the step, as in the
    loop, through masks read from ``inputs`` (:meth:`scalars`'s ``present``): their slots of the flat buffer hold
    zeros (``GroupEngine.step`` writes them), which is all the finite gate reads of them; their Adam powers are
    not read; their moments and momentum blend with a zero weight; what their state could make of a ratio
    (Adam's update) is selected away, never multiplied by 0. Their update is a zero, which turns an element of
    -0.0 into +0.0 (the same number).
    """

    def __init__(self, layout: Layout, inputs: StepInputs, shared_gate: bool, masked: bool = False) -> None:
        self.layout = layout
        self.inputs = inputs
        self.shared_gate = shared_gate
        self.masked = masked
        self.K = compilation.kernels() if layout.triton else None
        self.factor_dtype = F.compute_dtype(layout.dtype)  # the decays' and -lr's dtype
        self.ok = inputs.ok  # the last step's finite gate (compute)
        self.settings: F.GroupSettings | None = None  # the last step's (scalars)
        self.sums: Any = None  # Magma's sums of this step (before_orthogonalize), or None
        self.stacks: list[torch.Tensor] = []  # the torch buckets' orthogonalised stacks of this step
        if masked:  # the elements of each Muon parameter, to spread its mask over them
            self.muon_numels = torch.tensor([n for _, n, _ in layout.muon_rows], device=layout.device)

    #: step.run: a taken step on the CPU runs without the gating arithmetic.
    ungated = True

    # ------------------------------------------------------------------ host

    def scalars(self, group: dict[str, Any], present: list[bool]) -> list[float]:
        """The step's :data:`SCALARS`, then each Adam parameter's -step size and bias correction 2 (then the masks).

        Advances the bias-correction powers (``beta1_pow``, ``beta2_pow``) of every Adam parameter with a gradient
        (``present``: per parameter of the layout, in its order), as the loop does: parameters that missed steps keep
        their shorter step count.
        """
        s = self.settings = F.GroupSettings.of(group)  # read again by subclasses' phases (FSDP2's owners)
        neg_steps, bc2, lr = [], [], s.adam_lr
        for st, stepped in zip(self.layout.adam_states, present, strict=False):  # the Adam parameters come first
            neg_step, divisor = 0.0, 1.0  # a parameter without a gradient: its powers are not read
            if stepped:
                advance_powers(st, s)
                neg_step, divisor = F.adam_bias_corrected(lr, st["beta1_pow"], st["beta2_pow"])
            neg_steps.append(neg_step)
            bc2.append(divisor)
        param_dtype = [s.muon_decay, -s.lr, s.adamw_decay]  # PARAM_DTYPE_SCALARS
        masks = [float(m) for m in present] if self.masked else []
        return [*param_dtype, s.momentum, 1.0 - s.beta1, 1.0 - s.beta2, *neg_steps, *bc2, *masks]

    # ---------------------------------------------------------------- device

    def compute(self, lane: Lane | None = None) -> None:
        """All the arithmetic of the step, by :func:`deepmd_hybridmuon.step.run`.

        Reads only the layout's buffers and :attr:`inputs`.
        """
        self.lane = lane or Lane()
        scalars, L = self.inputs.scalars, self.layout
        self.muon_decay, self.neg_lr, self.adamw_decay = scalars[:PARAM_DTYPE_SCALARS].to(self.factor_dtype).unbind(0)
        if self.masked:  # 1.0 or 0.0 per parameter: of the Adam ones first, as in the flat buffer; then per block
            present = scalars[SCALARS + 2 * len(L.adam) :].to(torch.float32)
            self.adam_present, muon_present = present[: len(L.adam)], present[len(L.adam) :]
            self.block_present = muon_present.index_select(0, L.block_owner)
            self.muon_present = muon_present
        self.ok = step.run(self)  # captured: the graph's tensor, which each replay rewrites

    # The phases of step.run, on the layout's buffers.

    @property
    def has_muon(self) -> bool:
        """Whether the layout has Muon matrices (phases 3-5 have work)."""
        return bool(self.layout.muon)

    def gate(self) -> torch.Tensor:
        """1.0, or 0.0 when a gradient is not finite or beyond its limit (functional.finite_gate)."""
        L = self.layout
        return self.inputs.ok if self.shared_gate else F.finite_gate([L.muon_grad], [L.adam_grad])

    def adam(self, ok: torch.Tensor | None) -> None:
        """Adam and AdamW: their gradients become their increments, in place; the decay waits for :meth:`apply`."""
        L = self.layout
        if not L.adam:
            return
        adam = self.inputs.scalars[PARAM_DTYPE_SCALARS + 1 :].to(torch.float32)  # 1 - beta1, 1 - beta2, per param
        per_param = adam[2 : 2 + 2 * len(L.adam)].view(2, -1)
        if self.masked:
            per_param = torch.cat([per_param, self.adam_present.view(1, -1)])
        neg_step, bc2, *present = per_param.index_select(1, L.adam_owner)  # each parameter's numbers, one gather
        weights, grads = adam[:2] if ok is None else ok * adam[:2], F.sanitize(L.adam_grad.to(torch.float32), ok)
        step_size = neg_step if ok is None else neg_step * ok
        if present:  # a parameter without a gradient: its moments keep their values (a zero weight), its update is 0
            weights = weights.view(2, 1) * present[0]
        increment = F.adam_increment_(L.exp_avg, L.exp_avg_sq, grads, weights, bc2, step_size)
        L.adam_grad.copy_(torch.where(present[0] > 0, increment, 0) if present else increment)

    def before_orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Momentum, Magma's sums, and the Nesterov update in place of the gradients; the torch buckets start.

        Magma's sums read m and g, so they come before the update overwrites g: over segments of the flat
        buffer where :attr:`segments` exist (a GPU; FSDP2's shards), per parameter elsewhere (the CPU).
        The torch buckets' Newton-Schulz (the longest chains of kernels) starts as soon as the update exists;
        captured, it runs on a side stream while this one computes Magma's factors and runs the Triton
        launches. The decay waits for :meth:`apply`.
        """
        L = self.layout
        grads = F.sanitize(L.muon_grad, ok, out=L.muon_grad)  # the engine's own copy: zeroed in place
        momentum = self.inputs.scalars[PARAM_DTYPE_SCALARS]
        stepped = None  # masked: per element, 1.0 for a matrix with a gradient, 0.0 without (its momentum is kept)
        if self.masked:  # a few kernels whatever the number of matrices (output_size: no wait for the device)
            stepped = self.muon_present.to(L.dtype).repeat_interleave(self.muon_numels, output_size=L.momentum.numel())
        F.momentum_(L.momentum, grads, momentum, self._with_mask(ok, stepped))
        if self.segments is not None:
            self.sums = F.magma_segment_sums(L.momentum, grads, self.segments)
        elif L.magma:  # each block summed on its own, whatever the others' scale (as the loop takes them)
            parts = [
                F.magma_sums(L.momentum[o : o + n].view(bs, -1), grads[o : o + n].view(bs, -1))
                for o, n, bs in L.muon_rows
            ]
            self.sums = [torch.cat(sums) for sums in zip(*parts, strict=True)]
        F.nesterov(L.momentum, grads, momentum, out=grads)  # the update, in place of the gradients
        self.stacks = []
        with self.lane():
            for b in L.buckets:  # each bucket's matrices in one stack of the iteration's dtype (one alone: not copied)
                parts = [view.to(b.dtype) for view in b.views]
                self.stacks.append(F.orthogonalize(parts[0] if len(parts) == 1 else torch.cat(parts), b.use_gram))

    @property
    def segments(self) -> F.Segments | None:
        """Where Magma's sums are taken over segments of the flat buffer (:func:`functional.magma_segment_sums`)."""
        return self.layout.segments

    def complete_sums(self) -> None:
        """Nothing: each matrix's sums are whole in one process."""

    def orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Magma's factors, then every Muon matrix's orthogonalised update times its factor, in place of the update."""
        L, K = self.layout, self.K
        neg_lr = self.neg_lr if ok is None else self.neg_lr * ok.to(self.factor_dtype)
        damp = self._damp(ok)
        factor, value = L.block_factor, F.muon_factor(L.block_scale, damp, neg_lr)  # per block: scale x Magma x -lr
        # a matrix without a gradient: no update (its factor selected away, whatever its number)
        factor.copy_(torch.where(self.block_present > 0, value, 0) if self.masked else value)
        with self.lane():  # each stack, scaled by its blocks' factors, back into its matrices
            for b, out in zip(L.buckets, self.stacks, strict=True):
                factors, start = factor.index_select(0, b.block_ids), 0
                for view in b.views:
                    end = start + view.size(0)
                    F.post_orthogonalize(out[start:end], factors[start:end], view)
                    start = end
        self.stacks = []
        for f in L.fused_paths:
            run_fused(K, f, L.muon_grad, L.muon_grad, factor)

    def _damp(self, ok: torch.Tensor | None) -> torch.Tensor | None:
        """Magma's multiplier per block from this step's :attr:`sums`, which it uses up (advancing the scores).

        None without Magma.
        """
        sums, self.sums = self.sums, None
        if sums is None:
            return None
        ok = self._with_mask(ok, self.block_present if self.masked else None)  # a matrix without a gradient: kept
        if isinstance(sums, torch.Tensor):  # over segments
            return F.magma_damp(self.layout.scores, sums, ok)
        return F.magma_scale_(self.layout.scores, F.magma_score(*sums), ok)

    def apply(self, ok: torch.Tensor | None) -> None:
        """``p <- p * decay + update``, the decays gated, once the torch stacks have written their updates."""
        L = self.layout
        self.lane.join()
        if L.weight_decay:  # decay: Muon's, AdamW's, or none for Adam; 1 for a parameter without a gradient
            adamw, muon = (
                (self.adam_present.index_select(0, L.adamw_ids), self.muon_present) if self.masked else [None] * 2
            )
            for params, decay, mask in (
                (L.adamw, self.adamw_decay, adamw),
                ([p for p, _ in L.muon], self.muon_decay, muon),
            ):
                if params:
                    factor = F.gate_factor(decay, self._with_mask(ok, mask), L.dtype)  # one per parameter with a mask
                    torch._foreach_mul_(params, factor if mask is None else list(factor.unbind(0)))
        torch._foreach_add_(L.staged, L.grad_views)  # a parameter without a gradient adds a zero update

    @staticmethod
    def _with_mask(ok: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The finite gate ``ok`` (``None``: the step is taken) combined with a masked step's 0/1 ``mask``."""
        return ok if mask is None else (mask if ok is None else ok * mask)
