"""Magma-lite per block in two launches: :func:`magma_factors`.

One program per chunk sums m*g, m*m and g*g over its range of the flat vectors (each scaled
by a power of two, so that nothing overflows), then one program per block adds its chunks in
order (deterministic), updates the block's score and writes the block's factor. The score
follows ``functional.magma_score`` and ``functional.magma_scale_``; every constant is the
kernel's compile-time copy of the one in ``functional`` (``_MAGMA_OPTIONS``), none is written here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from .. import functional as F
from .common import Launch, helper, kernel

#: Elements per partial sum of the Magma kernel (a block spans one or more of them).
MAGMA_CHUNK: int = 4096
#: Numbers per chunk in the Magma workspace: the scaled sums of m*g, m*m, g*g and the two exponents.
MAGMA_PARTIALS: int = 5


@helper
def _downscale_exponent(amax):
    """e = max(0, floor(log2(amax))) in float64 (0 for amax 0): amax 2^-e lies below 2 (functional.pow2_downscale)."""
    return tl.floor(tl.log2(tl.maximum(amax.to(tl.float64), 1.0)))


@kernel("bounds_ptr", "partial_ptr")
def _magma_partial_kernel(mom_ptr, grad_ptr, bounds_ptr, partial_ptr, n_chunks, BLOCK: tl.constexpr):
    """Sums of (m 2^-a)(g 2^-b), (m 2^-a)^2 and (g 2^-b)^2 over one chunk (``bounds[i]:bounds[i + 1]``), and a, b.

    a (b): the exponent that brings the chunk's largest |m| (|g|) below 2, found in a first pass
    over the chunk in the inputs' dtype; the scaling is exact (float64, a power of two), so no sum
    overflows whatever the inputs' magnitude (``functional.magma_sums``).
    """
    i = tl.program_id(0)
    start = tl.load(bounds_ptr + i)
    stop = tl.load(bounds_ptr + i + 1)
    am = tl.zeros((BLOCK,), dtype=tl.float64)
    ag = tl.zeros((BLOCK,), dtype=tl.float64)
    for j in range(start, stop, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < stop
        am = tl.maximum(am, tl.abs(tl.load(mom_ptr + idx, mask=mask, other=0.0).to(tl.float64)))
        ag = tl.maximum(ag, tl.abs(tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float64)))
    ea = _downscale_exponent(tl.max(am))
    eb = _downscale_exponent(tl.max(ag))
    sa = tl.exp2(-ea)
    sb = tl.exp2(-eb)
    mg = tl.zeros((BLOCK,), dtype=tl.float32)
    mm = tl.zeros((BLOCK,), dtype=tl.float32)
    gg = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(start, stop, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < stop
        m = (tl.load(mom_ptr + idx, mask=mask, other=0.0).to(tl.float64) * sa).to(tl.float32)
        g = (tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float64) * sb).to(tl.float32)
        mg += m * g
        mm += m * m
        gg += g * g
    tl.store(partial_ptr + i, tl.sum(mg))
    tl.store(partial_ptr + n_chunks + i, tl.sum(mm))
    tl.store(partial_ptr + 2 * n_chunks + i, tl.sum(gg))
    tl.store(partial_ptr + 3 * n_chunks + i, ea.to(tl.float32))
    tl.store(partial_ptr + 4 * n_chunks + i, eb.to(tl.float32))


@kernel("first_ptr", "partial_ptr")
def _magma_finish_kernel(
    first_ptr,
    partial_ptr,
    n_chunks,
    base_ptr,
    score_ptr,
    out_ptr,
    neg_lr_ptr,
    ok_ptr,
    BLOCK: tl.constexpr,
    TAU: tl.constexpr,
    LOW: tl.constexpr,
    HIGH: tl.constexpr,
    DECAY: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    EPS: tl.constexpr,
):
    """Per block: add its chunks' sums in order, update the score, write the factor.

    The chunks' sums are brought to the block's largest exponents A, B first (times 2^(a - A) etc.,
    at most 1), and the floor of the norms' product is EPS 2^-(A+B), as in ``functional.magma_score``.
    """
    blk = tl.program_id(0)
    first = tl.load(first_ptr + blk)
    last = tl.load(first_ptr + blk + 1)
    ea_max = tl.zeros((BLOCK,), dtype=tl.float32)
    eb_max = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(first, last, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < last
        ea_max = tl.maximum(ea_max, tl.load(partial_ptr + 3 * n_chunks + idx, mask=mask, other=0.0))
        eb_max = tl.maximum(eb_max, tl.load(partial_ptr + 4 * n_chunks + idx, mask=mask, other=0.0))
    A = tl.max(ea_max)
    B = tl.max(eb_max)
    mg = tl.zeros((BLOCK,), dtype=tl.float32)
    mm = tl.zeros((BLOCK,), dtype=tl.float32)
    gg = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(first, last, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < last
        wa = tl.exp2(tl.load(partial_ptr + 3 * n_chunks + idx, mask=mask, other=0.0) - A)
        wb = tl.exp2(tl.load(partial_ptr + 4 * n_chunks + idx, mask=mask, other=0.0) - B)
        mg += tl.load(partial_ptr + idx, mask=mask, other=0.0) * (wa * wb)
        mm += tl.load(partial_ptr + n_chunks + idx, mask=mask, other=0.0) * (wa * wa)
        gg += tl.load(partial_ptr + 2 * n_chunks + idx, mask=mask, other=0.0) * (wb * wb)
    eps = tl.maximum(EPS * tl.exp2(-(A + B)), 1.1754943508222875e-38)  # float32's smallest normal: never 0 / 0
    denom = tl.maximum(tl.sqrt(tl.sum(mm)) * tl.sqrt(tl.sum(gg)), eps)
    cos = tl.sum(mg) / denom
    cos = tl.where(cos == cos, cos, 0.0)  # not a number (overflowed sums): neutral, as functional.magma_score
    cos = tl.minimum(tl.maximum(cos, -1.0), 1.0)
    raw = 1.0 / (1.0 + tl.exp(-cos / TAU))
    raw = tl.minimum(tl.maximum((raw - LOW) / (HIGH - LOW), 0.0), 1.0)
    ok = tl.load(ok_ptr)
    score = tl.load(score_ptr + blk)
    score = tl.where(ok > 0, score * DECAY + (1.0 - DECAY) * raw, score)
    tl.store(score_ptr + blk, score)
    neg_lr = tl.load(neg_lr_ptr).to(tl.float32)
    tl.store(out_ptr + blk, tl.load(base_ptr + blk) * (MIN_SCALE + (1.0 - MIN_SCALE) * score) * neg_lr)


def magma_chunks(block_lengths: list[int]) -> tuple[list[int], list[int]]:
    """Chunk bounds over the flat vector (no chunk spans two blocks) and each block's first chunk.

    Returns ``bounds`` (chunks + 1 element offsets) and ``first`` (blocks + 1 chunk indices).
    """
    bounds, first, start = [0], [0], 0
    for length in block_lengths:
        stop = start + length
        bounds += [*range(start + MAGMA_CHUNK, stop, MAGMA_CHUNK), stop]
        first.append(len(bounds) - 1)
        start = stop
    return bounds, first


def magma_factors(
    momentum: torch.Tensor,
    grad: torch.Tensor,
    bounds: torch.Tensor,
    first: torch.Tensor,
    partial: torch.Tensor,
    base: torch.Tensor,
    scores: torch.Tensor,
    out: torch.Tensor,
    neg_lr: torch.Tensor,
    ok: torch.Tensor,
) -> None:
    """Magma-lite for every block in two launches: update ``scores``, write ``base * magma * neg_lr`` to ``out``.

    ``bounds`` and ``first`` (int64) are :func:`magma_chunks`; ``partial`` is a float32
    workspace of ``MAGMA_PARTIALS * chunks``; ``base`` holds the Muon scale of each block; ``neg_lr`` and
    ``ok`` are 0-dim device tensors (``ok`` 0 keeps the scores, see
    ``functional.finite_gate``). Each chunk is summed by one program, then each block adds
    its chunks in order: deterministic, and long blocks are spread over many programs.
    """
    n_chunks = bounds.numel() - 1
    sums, finish = magma_launches(momentum.dtype)
    sums((n_chunks,), momentum, grad, bounds, partial, n_chunks)
    finish((scores.numel(),), first, partial, n_chunks, base, scores, out, neg_lr, ok)


def magma_launches(dtype: torch.dtype) -> tuple[Launch, Launch]:
    """The two launches of :func:`magma_factors` for momentum and gradients of ``dtype``."""
    i64, f32 = torch.int64, torch.float32
    return (
        Launch(_magma_partial_kernel, dtype, dtype, i64, f32, 2, BLOCK=1024),
        Launch(_magma_finish_kernel, i64, f32, 2, f32, f32, f32, dtype, f32, **_MAGMA_OPTIONS),
    )


_MAGMA_OPTIONS: dict[str, Any] = {
    "BLOCK": 128,
    "TAU": F.MAGMA_TAU,
    "LOW": F.MAGMA_SIGMOID_LOW,
    "HIGH": F.MAGMA_SIGMOID_HIGH,
    "DECAY": F.MAGMA_EMA_DECAY,
    "MIN_SCALE": F.MAGMA_MIN_SCALE,
    "EPS": F.MAGMA_EPS,
}
