"""Gradients in, updates out: :func:`gather`, :func:`momentum_update`, :func:`apply_updates`.

The engine keeps its state in flat buffers, while the gradients (fresh tensors every
step) and the parameters are separate tensors. A table of their addresses (int64) lets
one launch copy every gradient into the flat buffer, and one launch apply every update,
p <- p * decay + delta, in a single pass (a torch multiply and add over a list of tensors
take two). The gradient addresses change every step: the host writes them into the same
pinned buffer as the step's scalars, which one copy moves to the device; inside a captured
graph the gather then reads them from there. Each program takes one span of at most
SPAN elements of one tensor.

The momentum kernel is ``functional.nesterov_momentum_`` (and ``functional.sanitize``) in one
pass; its only numbers, beta and 1 - beta, come from the caller.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

import torch
import triton
import triton.language as tl

from .. import functional as F
from .common import Launch, helper, kernel

#: Elements per program of the address-table kernels.
SPAN: int = 8192


class SpanColumn(IntEnum):
    """Columns of the span table, one row per span of at most :data:`SPAN` elements of one tensor.

    ``TENSOR``: index in the address table; ``FIRST``, ``STOP``: the span's elements in that
    tensor; ``OFFSET``: where its first element lies in the flat buffer; ``DECAY``: index in
    the decay table (apply only: 0 none, 1 Muon, 2 AdamW); ``ADAM``: 1 for a tensor on an
    Adam route (gather only: its gradient limit is ``functional.ADAM_GRAD_LIMIT``).
    """

    TENSOR = 0
    FIRST = 1
    STOP = 2
    OFFSET = 3
    DECAY = 4
    ADAM = 5


#: Integers per span (:class:`SpanColumn`).
SPAN_COLS: int = 6

_SPAN_COLS = tl.constexpr(SPAN_COLS)
_SPAN_TENSOR = tl.constexpr(int(SpanColumn.TENSOR))
_SPAN_FIRST = tl.constexpr(int(SpanColumn.FIRST))
_SPAN_STOP = tl.constexpr(int(SpanColumn.STOP))
_SPAN_OFFSET = tl.constexpr(int(SpanColumn.OFFSET))
_SPAN_DECAY = tl.constexpr(int(SpanColumn.DECAY))
_SPAN_ADAM = tl.constexpr(int(SpanColumn.ADAM))
# x times these overflows float32 exactly from the gradient limits on (functional.finite_gate).
_GRAD_LIMIT_PROBE = tl.constexpr(F._GRAD_LIMIT_PROBE)
_ADAM_LIMIT_PROBE = tl.constexpr(F._ADAM_LIMIT_PROBE)


def span_table(numels: list[int], decays: list[int] | None = None, adam: list[bool] | None = None) -> list[list[int]]:
    """Spans of tensors laid end to end in a flat buffer (:class:`SpanColumn` rows).

    ``decays``: each tensor's index in the decay table (default 0); ``adam``: whether it is on
    an Adam route (default no).
    """
    spans, offset = [], 0
    for j, numel in enumerate(numels):
        for start in range(0, numel, SPAN):
            row = [0] * SPAN_COLS
            row[SpanColumn.TENSOR], row[SpanColumn.FIRST], row[SpanColumn.STOP] = j, start, min(start + SPAN, numel)
            row[SpanColumn.OFFSET] = offset + start
            row[SpanColumn.DECAY] = decays[j] if decays is not None else 0
            row[SpanColumn.ADAM] = int(adam[j]) if adam is not None else 0
            spans.append(row)
        offset += numel
    return spans


@helper
def _span(spans_ptr, i):
    """Row ``i`` of the span table: tensor, first, stop, offset, decay index, Adam flag."""
    row = spans_ptr + i * _SPAN_COLS
    return (
        tl.load(row + _SPAN_TENSOR),
        tl.load(row + _SPAN_FIRST),
        tl.load(row + _SPAN_STOP),
        tl.load(row + _SPAN_OFFSET),
        tl.load(row + _SPAN_DECAY),
        tl.load(row + _SPAN_ADAM),
    )


@kernel("spans_ptr", "flat_ptr", "finite_ptr")
def _gather_kernel(addr_ptr, spans_ptr, flat_ptr, finite_ptr, BLOCK: tl.constexpr):
    """flat[offset:...] = tensor[first:stop] for one span; finite[span] = 1.0 if the step can take it, else 0.0.

    It can when every element is finite and below ``functional.GRAD_LIMIT``, or below
    ``functional.ADAM_GRAD_LIMIT`` for an Adam span (``x`` times the limit's probe overflows
    float32 from there on, as in ``functional.finite_gate``).
    """
    s = tl.program_id(0)
    j, first, stop, offset, _, adam = _span(spans_ptr, s)
    probe = tl.where(adam != 0, _ADAM_LIMIT_PROBE, _GRAD_LIMIT_PROBE)
    src = tl.load(addr_ptr + j).to(tl.pointer_type(flat_ptr.dtype.element_ty))
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for e in range(first, stop, BLOCK):
        idx = e + tl.arange(0, BLOCK)
        mask = idx < stop
        x = tl.load(src + idx, mask=mask, other=0.0)
        y = x.to(tl.float32) * probe
        bad = tl.maximum(bad, ((y - y) != 0).to(tl.int32))  # y - y is NaN for an infinite or NaN y
        tl.store(flat_ptr + offset - first + idx, x, mask=mask)
    tl.store(finite_ptr + s, 1.0 - tl.max(bad, axis=0).to(tl.float32))


@helper
def _lerp(a, b, w):
    """torch.lerp(a, b, w): a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)."""
    return tl.where(tl.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@kernel("mom_ptr", "update_ptr")
def _momentum_kernel(grad_ptr, mom_ptr, update_ptr, ok_ptr, beta_ptr, n, BLOCK: tl.constexpr):
    """m <- lerp(m, g, ok (1 - beta)); update = lerp(g, m, beta); g is zeroed (in place) where ok is 0."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    ok = tl.load(ok_ptr)
    keep = ok > 0
    # In the betas' dtype (float32 for 16-bit parameters, as torch's lerp computes): in float16,
    # g - m overflows for gradients near its largest number
    compute = beta_ptr.dtype.element_ty
    g = tl.where(keep, tl.load(grad_ptr + idx, mask=mask, other=0.0).to(compute), 0.0)
    skipped = (tl.zeros((BLOCK,), dtype=tl.float32) + ok) <= 0
    tl.store(grad_ptr + idx, g, mask=mask & skipped)  # sanitised, as functional.sanitize (a skipped step only)
    beta = tl.load(beta_ptr)
    m = _lerp(tl.load(mom_ptr + idx, mask=mask).to(compute), g, tl.where(keep, tl.load(beta_ptr + 1), 0.0))
    m = m.to(mom_ptr.dtype.element_ty)  # the stored momentum, rounded, feeds the update (as in torch)
    tl.store(mom_ptr + idx, m, mask=mask)
    tl.store(update_ptr + idx, _lerp(g, m.to(compute), beta), mask=mask)


@kernel("addr_ptr", "spans_ptr", "delta_ptr")
def _apply_kernel(addr_ptr, spans_ptr, delta_ptr, decay_ptr, BLOCK: tl.constexpr):
    """p[first:stop] = p * decay + delta[offset:...] for one span (two roundings, as in torch)."""
    j, first, stop, offset, d, _ = _span(spans_ptr, tl.program_id(0))
    dst = tl.load(addr_ptr + j).to(tl.pointer_type(delta_ptr.dtype.element_ty))
    decay = tl.load(decay_ptr + d)
    for e in range(first, stop, BLOCK):
        idx = e + tl.arange(0, BLOCK)
        mask = idx < stop
        p = tl.load(dst + idx, mask=mask) * decay
        tl.store(dst + idx, p + tl.load(delta_ptr + offset - first + idx, mask=mask), mask=mask)


_SPAN_OPTIONS: dict[str, Any] = {"BLOCK": 1024, "num_warps": 4}


def span_launches(dtype: torch.dtype) -> tuple[Launch, Launch, Launch]:
    """The launches of :func:`gather`, :func:`momentum_update` and :func:`apply_updates` for vectors of ``dtype``."""
    i64, f32 = torch.int64, torch.float32
    betas = torch.promote_types(dtype, f32)  # the momentum's compute dtype
    return (
        Launch(_gather_kernel, i64, i64, dtype, f32, **_SPAN_OPTIONS),
        Launch(_momentum_kernel, dtype, dtype, dtype, f32, betas, 16, **_SPAN_OPTIONS),
        Launch(_apply_kernel, i64, i64, dtype, dtype, **_SPAN_OPTIONS, enable_fp_fusion=False),
    )


def gather(addresses: torch.Tensor, spans: torch.Tensor, flat: torch.Tensor, finite: torch.Tensor) -> None:
    """Copy the tensors at ``addresses`` (int64, contiguous, ``flat``'s dtype) into ``flat`` (:func:`span_table`).

    ``finite`` (float32, one per span) gets 1.0 for a span whose elements are all finite and below
    ``functional.GRAD_LIMIT`` in magnitude (``ADAM_GRAD_LIMIT`` for an Adam span), else 0.0.
    ``spans``, ``flat`` and ``finite`` are tensors of their own, never views at an offset (the
    kernel is compiled for their alignment).
    """
    span_launches(flat.dtype)[0]((spans.size(0),), addresses, spans, flat, finite)


def momentum_update(
    grad: torch.Tensor, momentum: torch.Tensor, update: torch.Tensor, ok: torch.Tensor, betas: torch.Tensor
) -> None:
    """The Muon momentum and Nesterov update in one pass (``functional.nesterov_momentum_``, which it mirrors).

    ``betas``: ``[beta, 1 - beta]`` in the vectors' compute dtype (float32; float64 for float64 vectors);
    ``ok``: the 0-dim float32 finite
    gate (0: the momentum stays, ``grad`` is zeroed in place as ``functional.sanitize`` would).
    """
    n = grad.numel()
    span_launches(grad.dtype)[1]((triton.cdiv(n, _SPAN_OPTIONS["BLOCK"]),), grad, momentum, update, ok, betas, n)


def apply_updates(addresses: torch.Tensor, spans: torch.Tensor, delta: torch.Tensor, decays: torch.Tensor) -> None:
    """``p <- p * decays[d] + delta`` for every tensor at ``addresses`` (:func:`span_table` with decay indices).

    The product is rounded before the sum (no fused multiply-add), as in torch's
    ``_foreach_mul_`` followed by ``_foreach_add_``.
    """
    span_launches(delta.dtype)[2]((spans.size(0),), addresses, spans, delta, decays)
