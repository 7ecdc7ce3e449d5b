"""Magma-lite per block in two launches: :func:`magma_factors`.

One program per chunk sums m*g, m*m and g*g over its range of the flat vectors, then one
program per block adds its chunks in order (deterministic), updates the block's score and
writes the block's factor. The score follows ``functional.magma_score`` and
``functional.magma_scale_``; every constant is the kernel's compile-time copy of the one in
``functional`` (``_MAGMA_OPTIONS``), none is written here.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from .. import functional as F
from .common import kernel

#: Elements per partial sum of the Magma kernel (a block spans one or more of them).
MAGMA_CHUNK: int = 4096


@kernel
def _magma_partial_kernel(mom_ptr, grad_ptr, bounds_ptr, partial_ptr, n_chunks, BLOCK: tl.constexpr):
    """Sums of m*g, m*m and g*g over one chunk (``bounds[i]:bounds[i + 1]``)."""
    i = tl.program_id(0)
    start = tl.load(bounds_ptr + i)
    stop = tl.load(bounds_ptr + i + 1)
    mg = tl.zeros((BLOCK,), dtype=tl.float32)
    mm = tl.zeros((BLOCK,), dtype=tl.float32)
    gg = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(start, stop, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < stop
        m = tl.load(mom_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(grad_ptr + idx, mask=mask, other=0.0).to(tl.float32)
        mg += m * g
        mm += m * m
        gg += g * g
    tl.store(partial_ptr + i, tl.sum(mg))
    tl.store(partial_ptr + n_chunks + i, tl.sum(mm))
    tl.store(partial_ptr + 2 * n_chunks + i, tl.sum(gg))


@kernel
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
    """Per block: add its chunks' sums in order, update the score, write the factor."""
    blk = tl.program_id(0)
    first = tl.load(first_ptr + blk)
    last = tl.load(first_ptr + blk + 1)
    mg = tl.zeros((BLOCK,), dtype=tl.float32)
    mm = tl.zeros((BLOCK,), dtype=tl.float32)
    gg = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in range(first, last, BLOCK):
        idx = j + tl.arange(0, BLOCK)
        mask = idx < last
        mg += tl.load(partial_ptr + idx, mask=mask, other=0.0)
        mm += tl.load(partial_ptr + n_chunks + idx, mask=mask, other=0.0)
        gg += tl.load(partial_ptr + 2 * n_chunks + idx, mask=mask, other=0.0)
    denom = tl.maximum(tl.sqrt(tl.sum(mm)) * tl.sqrt(tl.sum(gg)), EPS)
    cos = tl.minimum(tl.maximum(tl.sum(mg) / denom, -1.0), 1.0)
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
    workspace of ``3 * chunks``; ``base`` holds the Muon scale of each block; ``neg_lr`` and
    ``ok`` are 0-dim device tensors (``ok`` 0 keeps the scores, see
    ``functional.finite_gate``). Each chunk is summed by one program, then each block adds
    its chunks in order: deterministic, and long blocks are spread over many programs.
    """
    n_chunks = bounds.numel() - 1
    _magma_partial_kernel[(n_chunks,)](momentum, grad, bounds, partial, n_chunks, BLOCK=1024)
    _magma_finish_kernel[(scores.numel(),)](first, partial, n_chunks, base, scores, out, neg_lr, ok, **_MAGMA_OPTIONS)


_MAGMA_OPTIONS: dict[str, Any] = {
    "BLOCK": 128,
    "TAU": F.MAGMA_TAU,
    "LOW": F.MAGMA_SIGMOID_LOW,
    "HIGH": F.MAGMA_SIGMOID_HIGH,
    "DECAY": F.MAGMA_EMA_DECAY,
    "MIN_SCALE": F.MAGMA_MIN_SCALE,
    "EPS": F.MAGMA_EPS,
}
