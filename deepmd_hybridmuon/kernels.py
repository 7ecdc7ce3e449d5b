"""Triton kernels of the flat engine: Newton–Schulz and Magma in a few launches per step.

The flat engine (``flat.py``) uses this module when ``flash_muon`` is on and Triton can run
(CUDA, or Triton's CPU interpreter under ``TRITON_INTERPRET=1``). The per-tensor loop in
``optimizer.py`` stays the specification; these kernels compute the same functions
(``functional.newton_schulz``, ``functional.gram_newton_schulz``,
``functional.magma_raw_score`` and ``functional.magma_scale_``) in fewer launches.

Newton–Schulz (:func:`orthogonalize_blocks`): each program of a launch takes one matrix whose
smaller side is at most :data:`MAX_ROWS` and runs the whole iteration on it:

* it reads its block of the engine's flat Nesterov-update vector directly (row/column
  strides give the wide orientation: no padded stack, no index copies);
* the ``m x m`` products (``A = X X^T``, the polynomial, the Gram matrix and the
  accumulated transform) stay in registers; so does ``X`` (``m x n``) when it fits
  (:func:`resident`), otherwise it lives in a per-matrix slice of a bf16 workspace and is
  streamed through in column chunks of :data:`CHUNK` (standard iteration only: the Gram
  iteration of such matrices takes the panel path below);
* the result, times the block's factor (Muon scale x Magma x -lr, computed on the device
  before), is written to the flat output vector in the parameter's own layout.

Precision follows the reference functions: bfloat16 operands with float32 accumulation
for the standard iteration, float16 for the Gram iteration, normalisation in float32.
The summation order of the products differs from cuBLAS, so results agree with the
torch path to rounding. Programs of one launch share no memory and never synchronise,
so a launch takes as long as its largest matrix, not the sum over matrices. Long matrices
of the Gram path, which one program would stream through one SM several times, are split
into column panels instead (:func:`orthogonalize_panels`, five launches).

Larger matrices, smaller side up to :data:`MAX_PHASED_ROWS` (240 x 240 and 240 x 1600 in
DeePMD's fitting nets, 136 x 240 in DPA-2), take :func:`orthogonalize_phased`: the
iteration becomes a sequence of tiled products ("phases"), all run by one persistent,
cooperatively launched kernel per group of one padded shape, with a grid-wide barrier
between phases (see the section comment there).

Magma (:func:`magma_factors`): one program per chunk sums m*g, m*m and g*g over its range
of the flat vectors, then one program per block adds its chunks in order (deterministic),
updates the block's score and writes the block's factor.

Around them (:func:`gather`, :func:`momentum_update`, :func:`apply_updates`): the gradients
are read into the flat buffer through a table of their addresses (flagging non-finite
spans), the momentum and Nesterov update take one pass, and ``p <- p * decay + update``
is written into every parameter through a table of their addresses.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from . import functional as F

log = logging.getLogger("deepmd.hybridmuon")

__all__ = [
    "CHUNK",
    "GRAM_WORK_DTYPE",
    "MAX_ROWS",
    "META_COLS",
    "PANEL",
    "SPAN",
    "STANDARD_WORK_DTYPE",
    "KernelRegistry",
    "apply_updates",
    "coefficient_table",
    "compile_worker",
    "gather",
    "magma_chunks",
    "magma_factors",
    "momentum_update",
    "orthogonalize_blocks",
    "orthogonalize_panels",
    "orthogonalize_phased",
    "padded",
    "panel_block",
    "panel_table",
    "panelled",
    "phase_count",
    "phased_schedule",
    "phased_tiles",
    "phased_workspace",
    "prepare",
    "registry",
    "resident",
    "span_table",
    "wait_ready",
    "work_dtype",
]

#: Largest smaller side handled by one program: the ``m x m`` float32 accumulators of a
#: 128 x 128 matrix take 64 registers per thread at 8 warps; larger matrices need several
#: programs per matrix and stay on the batched torch path.
MAX_ROWS: int = 128
#: Columns of ``X`` per chunk of the streamed products (a multiple of 16 for ``tl.dot``).
CHUNK: int = 64
#: Largest padded ``m x n`` kept whole in registers for the whole iteration (128 x 128:
#: 32 registers per thread for the bf16 tile and 64 for its float32 products at 8 warps).
#: Larger matrices stream ``X`` through the workspace in chunks of :data:`CHUNK` columns.
RESIDENT_ELEMENTS: int = 128 * 128
#: Elements per partial sum of the Magma kernel (a block spans one or more of them).
MAGMA_CHUNK: int = 4096
#: Integers per matrix in the metadata table: source offset, workspace offset, m, n,
#: row stride, column stride, block index, unused.
META_COLS: int = 8
#: Workspace dtypes of the two iterations (those of the reference functions).
STANDARD_WORK_DTYPE: torch.dtype = torch.bfloat16
GRAM_WORK_DTYPE: torch.dtype = torch.float16


def work_dtype(use_gram: bool) -> torch.dtype:
    """Workspace dtype of the Gram (:data:`GRAM_WORK_DTYPE`) or standard iteration."""
    return GRAM_WORK_DTYPE if use_gram else STANDARD_WORK_DTYPE


def coefficient_table(use_gram: bool, device: torch.device) -> torch.Tensor:
    """The (a, b, c) of every iteration, one row each, as a float32 device tensor."""
    if use_gram:
        rows = list(F.POLAR_EXPRESS_COEFFS)
    else:
        rows = [F.NS_FAST_COEFFS] * F.NS_FAST_STEPS + [F.NS_POLISH_COEFFS] * F.NS_POLISH_STEPS
    return torch.tensor(rows, dtype=torch.float32, device=device)


@triton.jit
def _load_chunk(base, rows, cols, m, n, s_r, s_c):
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    return tl.load(base + rows[:, None] * s_r + cols[None, :] * s_c, mask=mask, other=0.0)


@triton.jit
def _store_chunk(base, value, rows, cols, m, n, s_r, s_c):
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    tl.store(base + rows[:, None] * s_r + cols[None, :] * s_c, value, mask=mask)


@triton.jit
def _gram(work, rows, cols, m, n, BM: tl.constexpr, BN: tl.constexpr):
    """X X^T of the workspace matrix, float32 accumulation."""
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for c0 in range(0, n, BN):
        x = _load_chunk(work, rows, c0 + cols, m, n, n, 1)
        acc = tl.dot(x, tl.trans(x), acc)
    return acc


@triton.jit
def _apply_left(work, T, rows, cols, m, n, alpha, BN: tl.constexpr):
    """X <- alpha X + T X in place, chunk by chunk (T is m x m, already in X's dtype)."""
    for c0 in range(0, n, BN):
        x = _load_chunk(work, rows, c0 + cols, m, n, n, 1)
        y = tl.dot(T, x, alpha * x.to(tl.float32))
        _store_chunk(work, y.to(x.dtype), rows, c0 + cols, m, n, n, 1)
    tl.debug_barrier()


@triton.jit
def _matrix_meta(meta_ptr, i):
    """Row ``i`` of the metadata table (see :data:`META_COLS`)."""
    meta = meta_ptr + i * 8
    return (
        tl.load(meta),
        tl.load(meta + 1),
        tl.load(meta + 2),
        tl.load(meta + 3),
        tl.load(meta + 4),
        tl.load(meta + 5),
        tl.load(meta + 6),
    )


@triton.jit
def _inverse_norm(sum_sq, eps, GRAM: tl.constexpr):
    """1 / ||G||: with ``eps`` added (Gram reference) or as a floor (standard reference)."""
    norm = tl.sqrt(sum_sq)
    if GRAM:
        return 1.0 / (norm + eps)
    return 1.0 / tl.maximum(norm, eps)


@triton.jit
def _quintic_polynomial(A, coef_ptr, k):
    """b A + c A^2 of iteration ``k`` (the ``a X`` term is added by the caller), in A's dtype."""
    b = tl.load(coef_ptr + 3 * k + 1)
    c = tl.load(coef_ptr + 3 * k + 2)
    return (c * tl.dot(A, A) + b * A.to(tl.float32)).to(A.dtype)


@triton.jit
def _polar_express_step(R, Q, eye, coef_ptr, k: tl.constexpr):
    """Iteration ``k`` of the Gram form: Z = b R + c R^2, Q <- Q (a I + Z), R <- (a I + Z) R (a I + Z).

    Q starts afresh at iterations 0 and 2 (the restart); R is not updated before the restart
    or after the last iteration, where it is not used (functional.gram_newton_schulz).
    """
    a = tl.load(coef_ptr + 3 * k)
    Z = _quintic_polynomial(R, coef_ptr, k)
    if k == 0 or k == 2:
        Q = (Z.to(tl.float32) + a * eye).to(R.dtype)
    else:
        Q = tl.dot(Q, Z, a * Q.to(tl.float32)).to(R.dtype)
    if k != 1 and k != 4:
        RP = tl.dot(R, Z, a * R.to(tl.float32)).to(R.dtype)
        R = tl.dot(Z, RP, a * RP.to(tl.float32)).to(R.dtype)
    return R, Q


@triton.jit(do_not_specialize=["n_steps", "eps"])
def _newton_schulz_kernel(
    src_ptr,
    dst_ptr,
    work_ptr,
    meta_ptr,
    coef_ptr,
    scale_ptr,
    n_steps,
    eps,
    BM: tl.constexpr,
    BN: tl.constexpr,
    GRAM: tl.constexpr,
    RESIDENT: tl.constexpr,
):
    src_off, work_off, m, n, s_r, s_c, block = _matrix_meta(meta_ptr, tl.program_id(0))
    rows = tl.arange(0, BM)
    cols = tl.arange(0, BN)
    src = src_ptr + src_off
    work = work_ptr + work_off
    wdtype = work_ptr.dtype.element_ty

    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    scale = tl.load(scale_ptr + block)
    dst = dst_ptr + src_off
    if RESIDENT:
        # The whole matrix in registers (BN >= n): no memory traffic between iterations.
        g = _load_chunk(src, rows, cols, m, n, s_r, s_c).to(tl.float32)
        X = (g * _inverse_norm(tl.sum(g * g), eps, GRAM)).to(wdtype)
        if GRAM:
            R = tl.dot(X, tl.trans(X)).to(wdtype)
            Q = eye.to(wdtype)
            for k in tl.static_range(5):
                if k == 2:  # restart: re-form X and its Gram matrix
                    X = tl.dot(Q, X).to(wdtype)
                    R = tl.dot(X, tl.trans(X)).to(wdtype)
                R, Q = _polar_express_step(R, Q, eye, coef_ptr, k)
            Y = tl.dot(Q, X)
        else:
            for k in range(n_steps):
                a = tl.load(coef_ptr + 3 * k)
                A = tl.dot(X, tl.trans(X)).to(wdtype)
                B = _quintic_polynomial(A, coef_ptr, k)
                X = tl.dot(B, X, a * X.to(tl.float32)).to(wdtype)
            Y = X.to(tl.float32)
        _store_chunk(dst, (Y * scale).to(dst_ptr.dtype.element_ty), rows, cols, m, n, s_r, s_c)
    else:
        # X0 = G / ||G||_F in the workspace (wide orientation, row-major, row stride n).
        sq = tl.zeros((BM, BN), dtype=tl.float32)
        for c0 in range(0, n, BN):
            g = _load_chunk(src, rows, c0 + cols, m, n, s_r, s_c).to(tl.float32)
            sq += g * g
        inv = _inverse_norm(tl.sum(sq), eps, GRAM)
        for c0 in range(0, n, BN):
            g = _load_chunk(src, rows, c0 + cols, m, n, s_r, s_c).to(tl.float32)
            _store_chunk(work, (g * inv).to(wdtype), rows, c0 + cols, m, n, n, 1)
        tl.debug_barrier()
        # (The Gram iteration of long matrices takes the panel path, orthogonalize_panels.)
        for k in range(n_steps):
            a = tl.load(coef_ptr + 3 * k)
            B = _quintic_polynomial(_gram(work, rows, cols, m, n, BM, BN).to(wdtype), coef_ptr, k)
            tl.debug_barrier()
            _apply_left(work, B, rows, cols, m, n, a, BN)
        # out = scale * X in the source layout and the output's dtype.
        for c0 in range(0, n, BN):
            x = _load_chunk(work, rows, c0 + cols, m, n, n, 1).to(tl.float32)
            _store_chunk(dst, (x * scale).to(dst_ptr.dtype.element_ty), rows, c0 + cols, m, n, s_r, s_c)


def resident(rows: int, cols: int) -> bool:
    """Whether a matrix (smaller side ``rows``, larger ``cols``) stays in registers."""
    return _block(rows) * _block(cols) <= RESIDENT_ELEMENTS


def _block(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def _warps(bm: int) -> int:
    """Warps per program: 8 for 128 x 128 tiles (64 float32 registers per thread), else 4."""
    return 8 if bm >= 128 else 4


def orthogonalize_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    work: torch.Tensor,
    meta: torch.Tensor,
    coefs: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
    cols: int,
    use_gram: bool,
) -> None:
    """Orthogonalise every matrix listed in ``meta`` (one launch) and write ``scale * O`` to ``dst``.

    Parameters
    ----------
    src, dst
        Flat vectors (same length and layout): the Nesterov updates, and the output.
    work
        Workspace, :data:`GRAM_WORK_DTYPE` or :data:`STANDARD_WORK_DTYPE`, with room for
        ``m * n`` elements per matrix at the offsets given in ``meta`` (unused, but still
        giving the dtype, when every matrix is :func:`resident`).
    meta
        ``(count, META_COLS)`` int64 table, see :data:`META_COLS`.
    coefs
        :func:`coefficient_table` of the path.
    scale
        Per-block multipliers (float32), indexed by the block column of ``meta``.
    rows, cols
        Largest smaller and larger side among the matrices (``rows <= MAX_ROWS``).
    use_gram
        Gram Newton–Schulz (rectangular matrices) instead of the standard iteration; only
        for :func:`resident` matrices (long ones: :func:`orthogonalize_panels`).
    """
    if panelled(use_gram, rows, cols):
        raise ValueError(f"a {rows} x {cols} matrix takes the Gram iteration in panels: orthogonalize_panels")
    _newton_schulz_kernel[(meta.size(0),)](
        src, dst, work, meta, coefs, scale, coefs.size(0), F.NS_EPS, **_ns_options(rows, cols, use_gram)
    )


def _ns_options(rows: int, cols: int, use_gram: bool) -> dict[str, Any]:
    """The compile-time options of a Newton–Schulz launch."""
    bm, keep = _block(rows), resident(rows, cols)
    return {
        "BM": bm,
        "BN": _block(cols) if keep else CHUNK,
        "GRAM": use_gram,
        "RESIDENT": keep,
        "num_warps": _warps(bm),
    }


# ---------------------------------------------------------------------------
# Gram Newton–Schulz of long matrices, in column panels
# ---------------------------------------------------------------------------
#
# A long matrix (smaller side <= MAX_ROWS, not resident) in one program streams m x n
# through one SM several times. Split into panels of PANEL columns instead, every pass
# over X is spread over many programs, and the m x m work between passes is one program
# per matrix: five launches in all.
#
#   1. per panel:  S_p = G_p G_p^T (float32)                      -> partial[p]
#   2. per matrix: ||G||^2 = trace(sum_p S_p), R = S / ||G||^2; iterations 0-1 -> Q
#   3. per panel:  X0_p = fp16(G_p / ||G||), X1_p = Q X0_p -> work; X1_p X1_p^T -> partial[p]
#   4. per matrix: R = sum_p; iterations 2-4 (the restart)      -> Q
#   5. per panel:  out_p = factor * Q X1_p                       -> dst
#
# The reference forms R from the rounded X0; here it comes from G in float32 products
# (TF32 on the tensor cores), a rounding of the same size.

#: Columns per panel of the long-matrix Gram path.
PANEL: int = 64
#: Integers per panel in the panel table: the matrix's row in the metadata table, first column.
PANEL_COLS: int = 2


@triton.jit
def _panel_gram_kernel(src_ptr, meta_ptr, panel_ptr, partial_ptr, BM: tl.constexpr, BN: tl.constexpr):
    p = tl.program_id(0)
    i = tl.load(panel_ptr + 2 * p)
    c0 = tl.load(panel_ptr + 2 * p + 1)
    src_off, _, m, n, s_r, s_c, _ = _matrix_meta(meta_ptr, i)
    rows = tl.arange(0, BM)
    g = _load_chunk(src_ptr + src_off, rows, c0 + tl.arange(0, BN), m, n, s_r, s_c).to(tl.float32)
    S = tl.dot(g, tl.trans(g))
    tl.store(partial_ptr + p * BM * BM + rows[:, None] * BM + rows[None, :], S)


@triton.jit
def _panel_reduce_kernel(
    first_ptr, partial_ptr, q_ptr, inv_ptr, coef_ptr, eps, BM: tl.constexpr, RESTART: tl.constexpr
):
    i = tl.program_id(0)
    rows = tl.arange(0, BM)
    tile = rows[:, None] * BM + rows[None, :]
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for p in range(tl.load(first_ptr + i), tl.load(first_ptr + i + 1)):
        acc += tl.load(partial_ptr + p * BM * BM + tile)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    Q = eye.to(tl.float16)
    if RESTART:
        R = acc.to(tl.float16)
        for k in tl.static_range(2, 5):
            R, Q = _polar_express_step(R, Q, eye, coef_ptr, k)
    else:
        inv = 1.0 / (tl.sqrt(tl.sum(acc * eye)) + eps)  # ||G|| = sqrt(trace(G G^T))
        tl.store(inv_ptr + i, inv)
        R = (acc * inv * inv).to(tl.float16)
        for k in tl.static_range(2):
            R, Q = _polar_express_step(R, Q, eye, coef_ptr, k)
    tl.store(q_ptr + i * BM * BM + tile, Q)


@triton.jit
def _panel_apply_kernel(
    src_ptr,
    work_ptr,
    dst_ptr,
    meta_ptr,
    panel_ptr,
    q_ptr,
    inv_ptr,
    partial_ptr,
    scale_ptr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    FINAL: tl.constexpr,
):
    p = tl.program_id(0)
    i = tl.load(panel_ptr + 2 * p)
    c0 = tl.load(panel_ptr + 2 * p + 1)
    src_off, work_off, m, n, s_r, s_c, block = _matrix_meta(meta_ptr, i)
    rows = tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    Q = tl.load(q_ptr + i * BM * BM + rows[:, None] * BM + rows[None, :])
    work = work_ptr + work_off
    if FINAL:
        x = _load_chunk(work, rows, cols, m, n, n, 1)
        y = tl.dot(Q, x).to(tl.float16).to(tl.float32) * tl.load(scale_ptr + block)
        _store_chunk(dst_ptr + src_off, y.to(dst_ptr.dtype.element_ty), rows, cols, m, n, s_r, s_c)
    else:
        g = _load_chunk(src_ptr + src_off, rows, cols, m, n, s_r, s_c).to(tl.float32)
        x = (g * tl.load(inv_ptr + i)).to(tl.float16)
        y = tl.dot(Q, x).to(tl.float16)
        _store_chunk(work, y, rows, cols, m, n, n, 1)
        S = tl.dot(y, tl.trans(y))
        tl.store(partial_ptr + p * BM * BM + rows[:, None] * BM + rows[None, :], S)


def panel_table(meta: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Panels of the matrices of a metadata table, and each matrix's first panel.

    Returns ``panels`` (``[matrix row, first column]`` each) and ``first`` (matrices + 1).
    """
    panels, first = [], [0]
    for i, row in enumerate(meta):
        panels += [[i, c0] for c0 in range(0, row[3], PANEL)]
        first.append(len(panels))
    return panels, first


def orthogonalize_panels(
    src: torch.Tensor,
    dst: torch.Tensor,
    work: torch.Tensor,
    meta: torch.Tensor,
    panels: torch.Tensor,
    first: torch.Tensor,
    partial: torch.Tensor,
    q: torch.Tensor,
    inv: torch.Tensor,
    coefs: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
) -> None:
    """Gram Newton–Schulz of long matrices in five launches (see the section comment).

    ``meta`` as for :func:`orthogonalize_blocks`; ``panels`` and ``first`` from
    :func:`panel_table`; workspaces: ``partial`` float32 ``(panels, BM, BM)``, ``q``
    float16 ``(matrices, BM, BM)``, ``inv`` float32 ``(matrices,)``, ``work`` float16 with
    room for every matrix; ``BM = panel_block(rows)``.
    """
    bm = panel_block(rows)
    n_panels, n_matrices = panels.size(0), meta.size(0)
    warps = _warps(bm)
    _panel_gram_kernel[(n_panels,)](src, meta, panels, partial, BM=bm, BN=PANEL, num_warps=warps)
    for restart in (False, True):
        _panel_reduce_kernel[(n_matrices,)](
            first, partial, q, inv, coefs, F.NS_EPS, BM=bm, RESTART=restart, num_warps=warps
        )
        _panel_apply_kernel[(n_panels,)](
            src, work, dst, meta, panels, q, inv, partial, scale, BM=bm, BN=PANEL, FINAL=restart, num_warps=warps
        )


def panel_block(rows: int) -> int:
    """The padded ``m x m`` size of the panel kernels."""
    return _block(rows)


@triton.jit(do_not_specialize=["n_chunks"])
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


@triton.jit(do_not_specialize=["n_chunks"])
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

# ---------------------------------------------------------------------------
# Matrices larger than one program: tiled phases in one persistent launch
# ---------------------------------------------------------------------------
#
# A matrix whose smaller side exceeds MAX_ROWS (240 x 240 and 240 x 1600 in DeePMD's
# fitting nets) does not fit one program. Its iteration is a sequence of phases, each a
# product OUT = alpha C + beta L M over 64 x 64 output tiles, with the polynomial as its
# epilogue and the result rounded to the iteration's dtype (as each cuBLAS call of the
# reference rounds its output). The operands are slots of a zero-padded per-matrix
# workspace: two m x n slots (0, 1), the rest m x m.
#
#   phase 0, per m x n tile:  sum of squares of G over the tile         -> partial
#   phase 1, per m x n tile:  X0 = G / ||G|| (partials added in order)  -> X0's slot
#   standard, per iteration:  A = X X^T;  B = b A + c A A;  X <- a X + B X
#   Gram, per iteration:      Z = b R + c R R;  Q <- Q (a I + Z)  (Q = Z + a I at the start
#                             and the restart);  P = a R + R Z;  R <- a P + Z P;
#                             R = X X^T at the start, and with X = Q X0 at the restart
#   last product:             factor * result, into the output in the parameter's layout
#
# One launch runs all phases of all matrices of a group: each program takes tiles of a
# phase in turn, then waits at a grid-wide barrier (an atomic counter) for the others.
# This needs every program resident at once: the grid is at most the number of SMs
# (shared between the groups that can run at the same time). Under Triton's interpreter,
# which runs programs one after another, the host launches one phase at a time instead.

#: Largest smaller side of the phased path; larger matrices stay on cuBLAS (the torch path).
#: Measured on the H100 (``benchmarks/phased_time.py --sweep``, BENCHMARKS.md): the whole
#: orthogonalisation of 4 x 240 x 240 takes 0.64-0.73x the time of the cuBLAS chain, of
#: 4 x 384 x 384 1.36-1.49x and of 4 x 512 x 512 1.59-1.78x (each program then computes
#: several tiles of a phase one after another). 256 pads to the same tiles as 240.
MAX_PHASED_ROWS: int = 256
#: Output tile and reduction chunk of the phased products.
TILE: int = 64
#: Integers per matrix in the phased metadata table: source offset, m, n, row stride,
#: column stride, block index. A group holds matrices of one padded shape (MP x NP, whole
#: tiles), a compile-time constant of its kernel: every workspace address is then known to
#: the compiler up to the matrix index, so the tile loads are contiguous and aligned.
PHASED_META_COLS: int = 6
#: m x m workspace slots per matrix, after the two m x n slots.
PHASED_SQUARE_SLOTS: dict[bool, int] = {False: 2, True: 5}
#: Integers per phase of :func:`phased_schedule`: kind (0 norm, 1 normalise, 2 product),
#: out, L, M, M transposed, C, alpha, beta (0: none or 1.0, else the coefficient column + 1),
#: iteration, Q slot (0: none). The kernel gets the schedule as a compile-time tuple and
#: unrolls it.
PHASE_COLS: int = 10
#: The output vector, as the ``out`` of the last product.
DST: int = -2


@triton.jit
def _slot_ptr(work_ptr, i, SLOT: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, SQUARES: tl.constexpr):
    """Start of workspace slot ``SLOT`` of matrix ``i`` (row stride NP for slots 0 and 1, else MP)."""
    slab: tl.constexpr = 2 * MP * NP + SQUARES * MP * MP
    offset: tl.constexpr = SLOT * MP * NP if SLOT < 2 else 2 * MP * NP + (SLOT - 2) * MP * MP
    return work_ptr + i * slab + offset


@triton.jit
def _tile(base, r0, c0, STRIDE: tl.constexpr, BM: tl.constexpr):
    """A BM x BM tile of a padded slot (no mask: slots are padded to whole tiles)."""
    rows = r0 + tl.arange(0, BM)
    cols = c0 + tl.arange(0, BM)
    return tl.load(base + rows[:, None] * STRIDE + cols[None, :], cache_modifier=".cg")


@triton.jit
def _source_meta(meta_ptr, i):
    """Source offset, m, n and strides of matrix ``i`` (its metadata row: PHASED_META_COLS = 6 integers)."""
    row = meta_ptr + i * 6
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _wide_tile(t, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    """Matrix, first row and first column of m x n tile ``t``."""
    per: tl.constexpr = (MP // BM) * (NP // BM)
    rem = t % per
    return t // per, (rem // (NP // BM)) * BM, (rem % (NP // BM)) * BM


@triton.jit
def _norm_tiles(src_ptr, meta_ptr, count, partial_ptr, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    """Phase 0: the sum of squares of G over each m x n tile."""
    for t in range(tl.program_id(0), count * (MP // BM) * (NP // BM), tl.num_programs(0)):
        i, r0, c0 = _wide_tile(t, MP, NP, BM)
        src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
        g = _load_chunk(src_ptr + src_off, r0 + tl.arange(0, BM), c0 + tl.arange(0, BM), m, n, s_r, s_c)
        g = g.to(tl.float32)
        tl.store(partial_ptr + t, tl.sum(g * g))


@triton.jit
def _normalise_tiles(
    src_ptr, work_ptr, meta_ptr, count, partial_ptr, eps, X0: tl.constexpr, GRAM: tl.constexpr,
    MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Phase 1: X0 = G / ||G|| into slot ``X0`` (the matrix's partial sums added in order)."""
    per: tl.constexpr = (MP // BM) * (NP // BM)
    for t in range(tl.program_id(0), count * per, tl.num_programs(0)):
        i, r0, c0 = _wide_tile(t, MP, NP, BM)
        src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
        total = tl.load(partial_ptr + i * per, cache_modifier=".cg")
        for j in tl.static_range(1, per):
            total += tl.load(partial_ptr + i * per + j, cache_modifier=".cg")
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BM)
        g = _load_chunk(src_ptr + src_off, rows, cols, m, n, s_r, s_c).to(tl.float32)
        base = _slot_ptr(work_ptr, i, X0, MP, NP, GRAM * 3 + 2)
        x = (g * _inverse_norm(total, eps, GRAM)).to(work_ptr.dtype.element_ty)
        tl.store(base + rows[:, None] * NP + cols[None, :], x)


@triton.jit
def _products(
    dst_ptr, work_ptr, meta_ptr, count, coef_ptr, scale_ptr,
    K: tl.constexpr, OUT: tl.constexpr, L: tl.constexpr, M: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
    ALPHA: tl.constexpr, BETA: tl.constexpr, Q: tl.constexpr, GRAM: tl.constexpr,
    MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """One product phase, OUT = ALPHA C + BETA L M (M = slot M transposed when ``T``), over its tiles.

    Slots are workspace slots, ``OUT`` may be :data:`DST`; ``ALPHA``/``BETA`` 0 for none/1.0,
    else the coefficient column + 1 of iteration ``K``; ``Q``: also write OUT + a I there.
    """
    sq: tl.constexpr = GRAM * 3 + 2  # m x m slots per matrix
    cols_out: tl.constexpr = MP if (OUT >= 2 or T) else NP  # the output's padded width
    per: tl.constexpr = (MP // BM) * (cols_out // BM)
    reduce: tl.constexpr = NP if T else MP
    l_stride: tl.constexpr = NP if L < 2 else MP
    m_stride: tl.constexpr = NP if M < 2 else MP
    wdtype = work_ptr.dtype.element_ty
    for t in range(tl.program_id(0), count * per, tl.num_programs(0)):
        i = t // per
        r0 = ((t % per) // (cols_out // BM)) * BM
        c0 = ((t % per) % (cols_out // BM)) * BM
        l_base = _slot_ptr(work_ptr, i, L, MP, NP, sq)
        m_base = _slot_ptr(work_ptr, i, M, MP, NP, sq)
        if ALPHA != 0:  # the addend's tile, loaded ahead so its latency hides behind the products
            c_stride: tl.constexpr = NP if C < 2 else MP
            c_tile = _tile(_slot_ptr(work_ptr, i, C, MP, NP, sq), r0, c0, c_stride, BM)
        acc = tl.zeros((BM, BM), dtype=tl.float32)
        for k0 in range(0, reduce, BM):
            if T:  # M = X^T: rows c0... of X, transposed
                right = tl.trans(_tile(m_base, c0, k0, m_stride, BM))
            else:
                right = _tile(m_base, k0, c0, m_stride, BM)
            acc = tl.dot(_tile(l_base, r0, k0, l_stride, BM), right, acc)
        if BETA != 0:
            acc = acc * tl.load(coef_ptr + 3 * K + BETA - 1)
        if ALPHA != 0:
            acc += tl.load(coef_ptr + 3 * K + ALPHA - 1) * c_tile.to(tl.float32)
        y = acc.to(wdtype)
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BM)
        if OUT == -2:  # DST: factor * result in the parameter's layout
            src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
            value = y.to(tl.float32) * tl.load(scale_ptr + tl.load(meta_ptr + i * 6 + 5))
            _store_chunk(dst_ptr + src_off, value.to(dst_ptr.dtype.element_ty), rows, cols, m, n, s_r, s_c)
        else:
            o_base = _slot_ptr(work_ptr, i, OUT, MP, NP, sq)
            tl.store(o_base + rows[:, None] * cols_out + cols[None, :], y)
        if Q != 0:  # Q = Z + a I on the real diagonal (the padding stays zero)
            m = tl.load(meta_ptr + i * 6 + 1)
            eye = ((rows[:, None] == cols[None, :]) & (rows[:, None] < m)).to(tl.float32)
            q_tile = y.to(tl.float32) + tl.load(coef_ptr + 3 * K) * eye
            q_base = _slot_ptr(work_ptr, i, Q, MP, NP, sq)
            tl.store(q_base + rows[:, None] * MP + cols[None, :], q_tile.to(wdtype))


@triton.jit
def _grid_barrier(counter_ptr, target):
    """Wait until ``target`` arrivals were counted (every program of the launch, this phase)."""
    tl.debug_barrier()  # this program's stores are done
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    # Each poll is an acquiring read-modify-write, so the last one orders this program's later
    # loads after the other programs' stores (1.2 us a barrier on the H100, BENCHMARKS.md).
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@triton.jit(do_not_specialize=["count", "eps"])
def _phased_kernel(
    src_ptr, dst_ptr, work_ptr, meta_ptr, count, partial_ptr, coef_ptr, scale_ptr, counter_ptr, eps,
    SCHEDULE: tl.constexpr, FIRST: tl.constexpr, STOP: tl.constexpr, SYNC: tl.constexpr, GRAM: tl.constexpr,
    MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Phases FIRST:STOP of ``SCHEDULE``, unrolled at compile time; grid barriers between them with SYNC.

    ``SCHEDULE``: :func:`phased_schedule` as a tuple of tuples.
    """
    for P in tl.static_range(FIRST, STOP):
        if SCHEDULE[P][0] == 0:
            _norm_tiles(src_ptr, meta_ptr, count, partial_ptr, MP, NP, BM)
        elif SCHEDULE[P][0] == 1:
            _normalise_tiles(src_ptr, work_ptr, meta_ptr, count, partial_ptr, eps, SCHEDULE[P][1], GRAM, MP, NP, BM)
        else:
            _products(  # the columns of a schedule row: see phased_schedule
                dst_ptr, work_ptr, meta_ptr, count, coef_ptr, scale_ptr, SCHEDULE[P][8], SCHEDULE[P][1],
                SCHEDULE[P][2], SCHEDULE[P][3], SCHEDULE[P][4] != 0, SCHEDULE[P][5], SCHEDULE[P][6],
                SCHEDULE[P][7], SCHEDULE[P][9], GRAM, MP, NP, BM,
            )  # fmt: skip
        if SYNC and P < STOP - 1:
            _grid_barrier(counter_ptr, (P - FIRST + 1) * tl.num_programs(0))


@functools.cache
def phased_schedule(use_gram: bool) -> tuple[tuple[int, ...], ...]:
    """The phases of one orthogonalisation (rows of :data:`PHASE_COLS` integers), in order.

    A tuple of tuples, as the kernel takes it (a compile-time constant); built once per iteration.
    """
    phases: list[list[int]] = []

    def product(k, out, left, right, *, t=False, c=0, alpha=0, beta=0, q=0):
        phases.append([2, out, left, right, int(t), c, alpha, beta, k, q])

    a, b, c = 1, 2, 3  # coefficient columns, + 1
    x0 = 1 if use_gram else 0
    phases.append([0] * PHASE_COLS)  # sums of squares, per m x n tile
    phases.append([1, x0] + [0] * (PHASE_COLS - 2))  # X0 = G / ||G||
    if not use_gram:
        A, B = 2, 3
        x = x0
        steps = F.NS_FAST_STEPS + F.NS_POLISH_STEPS
        for k in range(steps):
            product(k, A, x, x, t=True)
            product(k, B, A, A, c=A, alpha=b, beta=c)
            nxt = DST if k == steps - 1 else 1 - x
            product(k, nxt, B, x, c=x, alpha=a)
            x = nxt
        return tuple(map(tuple, phases))
    X1, R, Z, P = 0, 2, 3, 6
    q = spare = 4  # Q alternates between slots 4 and 5 (a product never writes what it reads)
    product(0, R, x0, x0, t=True)
    last = len(F.POLAR_EXPRESS_COEFFS) - 1
    for k in range(last + 1):
        restart = k in F.GRAM_RESTART_ITERATIONS
        if restart:
            product(k, X1, q, x0)
            product(k, R, X1, X1, t=True)
        if k == 0 or restart:
            q, spare = 4, 5
            product(k, Z, R, R, c=R, alpha=b, beta=c, q=q)
        else:
            product(k, Z, R, R, c=R, alpha=b, beta=c)
            product(k, spare, q, Z, c=q, alpha=a)
            q, spare = spare, q
        if k < last and (k + 1) not in F.GRAM_RESTART_ITERATIONS:
            product(k, P, R, Z, c=R, alpha=a)
            product(k, R, Z, P, c=P, alpha=a)
    product(last, DST, q, X1)
    return tuple(map(tuple, phases))


def padded(size: int) -> int:
    """``size`` rounded up to whole tiles (:data:`TILE`)."""
    return -(-size // TILE) * TILE


def phased_workspace(matrices: list[tuple[int, int, int, int, int, int]], use_gram: bool) -> int:
    """Workspace size (elements) of a phased group, whose metadata table is ``matrices``.

    ``matrices``: (source offset, m, n, row stride, column stride, block) per matrix
    (:data:`PHASED_META_COLS`), in the wide orientation (m <= n), all of one padded shape
    (:func:`padded`).
    """
    shapes = {(padded(m), padded(n)) for _, m, n, _, _, _ in matrices}
    if len(shapes) != 1:
        raise ValueError(f"a phased group holds matrices of one padded shape, not {sorted(shapes)}")
    mp, np_ = shapes.pop()
    return (2 * mp * np_ + PHASED_SQUARE_SLOTS[use_gram] * mp * mp) * len(matrices)


def phased_tiles(m: int, n: int) -> int:
    """Output tiles of the largest phase of one matrix (its m x n phases)."""
    return (padded(m) // TILE) * (padded(n) // TILE)


def phase_count(use_gram: bool) -> int:
    """Number of phases of one orthogonalisation (:func:`phased_schedule`)."""
    return len(phased_schedule(use_gram))


def orthogonalize_phased(
    src: torch.Tensor,
    dst: torch.Tensor,
    work: torch.Tensor,
    meta: torch.Tensor,
    shape: tuple[int, int],
    partial: torch.Tensor,
    coefs: torch.Tensor,
    scale: torch.Tensor,
    counter: torch.Tensor,
    programs: int,
    use_gram: bool,
    first: int = 0,
    stop: int | None = None,
) -> None:
    """Phases ``first:stop`` of the orthogonalisation of a phased group (see the section comment).

    The last phase writes ``scale * O`` to ``dst``; the engine runs it apart, once ``scale``
    is known, and the others as soon as ``src`` is. ``meta``: the group's table (int64), and
    ``work``: zeros of :func:`work_dtype`, sized by :func:`phased_workspace`;
    ``shape``: the group's padded (m, n); ``partial``: float32, one per m x n tile;
    ``counter``: one int32; ``programs``: the grid (at most the SMs this launch may hold
    while others run).
    """
    stop = phase_count(use_gram) if stop is None else stop
    args = (src, dst, work, meta, meta.size(0), partial, coefs, scale, counter, F.NS_EPS)
    if src.device.type != "cuda":  # the interpreter runs programs one after another: no barriers
        for ph in range(first, stop):
            _phased_kernel[(programs,)](*args, FIRST=ph, STOP=ph + 1, **_phased_options(use_gram, shape, False))
        return
    sync = stop - first > 1
    if sync:
        counter.zero_()
    _phased_kernel[(programs,)](*args, FIRST=first, STOP=stop, **_phased_options(use_gram, shape, sync))


def _phased_options(use_gram: bool, shape: tuple[int, int], sync: bool) -> dict[str, Any]:
    options = {"SCHEDULE": phased_schedule(use_gram), "GRAM": use_gram, "SYNC": sync}
    options |= {"MP": shape[0], "NP": shape[1], "BM": TILE}
    if sync:  # grid barriers: a cooperative launch makes the driver place every program at once
        options["launch_cooperative_grid"] = True
    return options | {"num_warps": 4}


# ---------------------------------------------------------------------------
# Gradients in, updates out: kernels over a table of tensor addresses
# ---------------------------------------------------------------------------
#
# The engine keeps its state in flat buffers, while the gradients (fresh tensors every
# step) and the parameters are separate tensors. A table of their addresses (int64) lets
# one launch copy every gradient into the flat buffer, and one launch apply every update,
# p <- p * decay + delta, in a single pass (a torch multiply and add over a list of tensors
# take two). The gradient addresses change every step: the host writes them into the same
# pinned buffer as the step's scalars, which one copy moves to the device; inside a captured
# graph the gather then reads them from there. Each program takes one span of at most
# SPAN elements of one tensor.

#: Elements per program of the address-table kernels.
SPAN: int = 8192
#: Integers per span: tensor index in the address table, first element, stop, offset in
#: the flat buffer of the first element, decay index (apply only: 0 none, 1 Muon, 2 AdamW).
SPAN_COLS: int = 5


def span_table(numels: list[int], decays: list[int] | None = None) -> list[list[int]]:
    """Spans of tensors laid end to end in a flat buffer (see :data:`SPAN_COLS`)."""
    spans, offset = [], 0
    for j, numel in enumerate(numels):
        decay = decays[j] if decays is not None else 0
        spans += [[j, start, min(start + SPAN, numel), offset + start, decay] for start in range(0, numel, SPAN)]
        offset += numel
    return spans


@triton.jit
def _span(spans_ptr, i):
    row = spans_ptr + i * 5
    return tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)


@triton.jit
def _gather_kernel(addr_ptr, spans_ptr, flat_ptr, finite_ptr, BLOCK: tl.constexpr):
    """flat[offset:...] = tensor[first:stop] for one span; finite[span] = 1.0 if all of it is finite, else 0.0."""
    s = tl.program_id(0)
    j, first, stop, offset, _ = _span(spans_ptr, s)
    src = tl.load(addr_ptr + j).to(tl.pointer_type(flat_ptr.dtype.element_ty))
    bad = tl.zeros((BLOCK,), dtype=tl.int32)
    for e in range(first, stop, BLOCK):
        idx = e + tl.arange(0, BLOCK)
        mask = idx < stop
        x = tl.load(src + idx, mask=mask, other=0.0)
        bad = tl.maximum(bad, ((x - x) != 0).to(tl.int32))  # x - x is NaN for an infinite or NaN x
        tl.store(flat_ptr + offset - first + idx, x, mask=mask)
    tl.store(finite_ptr + s, 1.0 - tl.max(bad, axis=0).to(tl.float32))


@triton.jit
def _lerp(a, b, w):
    """torch.lerp(a, b, w): a + w (b - a) for |w| < 0.5, else b - (b - a)(1 - w)."""
    return tl.where(tl.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1.0 - w))


@triton.jit
def _momentum_kernel(grad_ptr, mom_ptr, update_ptr, ok_ptr, beta_ptr, n, BLOCK: tl.constexpr):
    """m <- lerp(m, g, ok (1 - beta)); update = lerp(g, m, beta); g is zeroed (in place) where ok is 0."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    ok = tl.load(ok_ptr)
    keep = ok > 0
    g = tl.where(keep, tl.load(grad_ptr + idx, mask=mask, other=0.0), 0.0)
    skipped = (tl.zeros((BLOCK,), dtype=tl.float32) + ok) <= 0
    tl.store(grad_ptr + idx, g, mask=mask & skipped)  # sanitised, as functional.sanitize (a skipped step only)
    beta = tl.load(beta_ptr)
    m = _lerp(tl.load(mom_ptr + idx, mask=mask), g, tl.where(keep, tl.load(beta_ptr + 1), 0.0))
    tl.store(mom_ptr + idx, m, mask=mask)
    tl.store(update_ptr + idx, _lerp(g, m, beta), mask=mask)


@triton.jit
def _apply_kernel(addr_ptr, spans_ptr, delta_ptr, decay_ptr, BLOCK: tl.constexpr):
    """p[first:stop] = p * decay + delta[offset:...] for one span (two roundings, as in torch)."""
    j, first, stop, offset, d = _span(spans_ptr, tl.program_id(0))
    dst = tl.load(addr_ptr + j).to(tl.pointer_type(delta_ptr.dtype.element_ty))
    decay = tl.load(decay_ptr + d)
    for e in range(first, stop, BLOCK):
        idx = e + tl.arange(0, BLOCK)
        mask = idx < stop
        p = tl.load(dst + idx, mask=mask) * decay
        tl.store(dst + idx, p + tl.load(delta_ptr + offset - first + idx, mask=mask), mask=mask)


_SPAN_OPTIONS: dict[str, Any] = {"BLOCK": 1024, "num_warps": 4}


def gather(addresses: torch.Tensor, spans: torch.Tensor, flat: torch.Tensor, finite: torch.Tensor) -> None:
    """Copy the tensors at ``addresses`` (int64, contiguous, ``flat``'s dtype) into ``flat`` (:func:`span_table`).

    ``finite`` (float32, one per span) gets 1.0 for a span without infinite or NaN elements, else 0.0.
    """
    _gather_kernel[(spans.size(0),)](addresses, spans, flat, finite, **_SPAN_OPTIONS)


def momentum_update(
    grad: torch.Tensor, momentum: torch.Tensor, update: torch.Tensor, ok: torch.Tensor, betas: torch.Tensor
) -> None:
    """The Muon momentum and Nesterov update in one pass (``functional.nesterov_momentum_``).

    ``betas``: ``[beta, 1 - beta]`` in the vectors' dtype; ``ok``: the 0-dim float32 finite
    gate (0: the momentum stays, ``grad`` is zeroed in place as ``functional.sanitize`` would).
    """
    n = grad.numel()
    block = _SPAN_OPTIONS["BLOCK"]
    _momentum_kernel[(triton.cdiv(n, block),)](grad, momentum, update, ok, betas, n, BLOCK=block, num_warps=4)


def apply_updates(addresses: torch.Tensor, spans: torch.Tensor, delta: torch.Tensor, decays: torch.Tensor) -> None:
    """``p <- p * decays[d] + delta`` for every tensor at ``addresses`` (:func:`span_table` with decay indices).

    The product is rounded before the sum (no fused multiply-add), as in torch's
    ``_foreach_mul_`` followed by ``_foreach_add_``.
    """
    _apply_kernel[(spans.size(0),)](addresses, spans, delta, decays, **_SPAN_OPTIONS, enable_fp_fusion=False)


# ---------------------------------------------------------------------------
# Compilation off the training process
# ---------------------------------------------------------------------------
#
# Triton compiles a kernel variant the first time it is launched (about 2 s each, 7-8 s for
# the phased kernels) and caches it on disk. So that a first run does not wait ~20 s in its
# first step, the engine asks :func:`prepare` for the variants it needs; missing ones
# compile in a child process (:func:`compile_worker`) while the engine steps with the
# torch path. Once the child has exited, the training process loads the variants from
# Triton's disk cache (milliseconds) and the engine switches to the kernels (flat.py).
#
# Why a process and not a thread: Triton compiles in native code (LLVM, ptxas). A
# daemon thread still inside it when the interpreter shuts down is ended by
# ``pthread_exit``, whose forced unwinding through C++ frames aborts the process
# ("FATAL: exception not rethrown") after a run that trained and saved. A child process
# can simply be terminated at exit (:meth:`KernelRegistry.close`, registered with
# ``atexit``); Triton writes its cache files atomically, so a killed compilation leaves
# nothing half-written. The child also dies with its parent (``PR_SET_PDEATHSIG``).
#
# Compiling with example tensors of the same dtypes gives the same variants as the real
# launches: integer arguments are not specialised on.


class _Pending:
    """The variants one :func:`prepare` asked for: ``is_set()`` once all are compiled or failed.

    Checking is cheap (a non-blocking ``waitpid`` per running worker) and, once a worker has
    exited, loads its variants into this process (see :meth:`KernelRegistry.poll`).
    """

    def __init__(self, registry: KernelRegistry, keys: frozenset[tuple[Any, ...]]) -> None:
        self.registry, self.keys = registry, keys

    def is_set(self) -> bool:
        """Whether every variant asked for is compiled (or failed); never blocks."""
        self.registry.poll()
        return self.keys <= (self.registry.ready | self.registry.failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`is_set` or ``timeout`` seconds; return :meth:`is_set`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self.registry.workers_for(self.keys):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(left)
        return self.is_set()


@dataclass
class _Worker:
    process: subprocess.Popen
    keys: list[tuple[Any, ...]]
    device: torch.device


class KernelRegistry:
    """Which Triton variants this process has compiled, and the compilations under way.

    One object, used from the training thread only (no locks, no threads). A variant is
    identified by a key (:func:`_launch_key` plus device index and dtype).

    Parameters
    ----------
    background
        Compile missing variants in a child process (default) rather than at once in this
        one (the tests' way of getting the kernels from the first step on).
    worker
        The child's command line; it reads ``(keys, device index)`` pickled on its standard
        input and writes one line per key on its standard output (see :func:`compile_worker`).
        Default: this package's :func:`compile_worker` under the current interpreter.
    """

    def __init__(self, *, background: bool = True, worker: list[str] | None = None) -> None:
        self.background = background
        self.worker = worker
        self.ready: set[tuple[Any, ...]] = set()
        self.failed: set[tuple[Any, ...]] = set()
        self.workers: list[_Worker] = []
        self._closing_registered = False

    # ----------------------------------------------------------------- asking

    def prepare(
        self, device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool
    ) -> _Pending | None:
        """Start compiling the variants for ``paths`` ((use_gram, rows, cols) per launch), spans and Magma.

        Returns an object whose ``is_set()`` becomes true once they are compiled: at once
        when they already are, or when ``background`` is off (they compile before
        returning); ``None`` when a variant failed to compile earlier in this process (the
        engine then keeps the torch path; the failure was logged once).
        """
        keys = {(*_launch_key(g, r, c), device.index, dtype) for g, r, c in paths}
        keys.add(("spans", device.index, dtype))
        if magma:
            keys.add(("magma", device.index, dtype))
        pending = _Pending(self, frozenset(keys))
        self.poll()
        if keys & self.failed:
            return None
        in_flight = {key for w in self.workers for key in w.keys}
        missing = sorted(keys - self.ready - in_flight, key=repr)
        if device.type != "cuda":  # the interpreter does not compile
            self.ready |= keys
            return pending
        if missing and self.background and self._start(missing, device):
            return pending
        for key in missing:  # at once, in this process
            self._load(key, device)
        return None if keys & self.failed else pending

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the compilations under way; ``False`` if some still run after ``timeout`` seconds."""
        return _Pending(self, frozenset(k for w in self.workers for k in w.keys)).wait(timeout)

    def workers_for(self, keys: frozenset[tuple[Any, ...]]) -> list[_Worker]:
        """The running workers compiling any of ``keys``."""
        return [w for w in self.workers if keys.intersection(w.keys)]

    # ---------------------------------------------------------------- workers

    def _start(self, keys: list[tuple[Any, ...]], device: torch.device) -> bool:
        """Start a worker for ``keys``; ``False`` if no child process can be started here."""
        if self.worker is None and not sys.executable:
            return False  # an embedded interpreter: compile in this process instead
        command = self.worker or [sys.executable, "-c", f"from {__name__} import compile_worker; compile_worker()"]
        env = dict(os.environ)
        # The child imports this very package, wherever this process found it.
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as err:
            log.info("Triton kernels: no compile process (%s); compiling in this process", err)
            return False
        assert process.stdin is not None  # stdin=PIPE
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(pickle.dumps((keys, device.index or 0)))
            process.stdin.close()
        self.workers.append(_Worker(process, keys, device))
        if not self._closing_registered:
            atexit.register(self.close)
            self._closing_registered = True
        return True

    def poll(self) -> None:
        """Load the variants of every worker that has exited (from Triton's disk cache)."""
        for worker in [w for w in self.workers if w.process.poll() is not None]:
            self.workers.remove(worker)
            assert worker.process.stdout is not None  # stdout=PIPE
            lines = worker.process.stdout.read().decode(errors="replace").splitlines()
            worker.process.stdout.close()
            errors = dict(line.split("\t", 1) for line in lines if "\t" in line)
            for index, key in enumerate(worker.keys):
                error = errors.get(str(index))
                if error is None and len(lines) < len(worker.keys):
                    error = f"compile process exited with status {worker.process.returncode}"
                if error is not None and error != "ok":
                    self._fail(key, error)
                else:
                    self._load(key, worker.device)

    def _load(self, key: tuple[Any, ...], device: torch.device) -> None:
        """Compile ``key`` in this process (a disk-cache hit after a worker has compiled it)."""
        try:
            _compile(key, device)
        except Exception as err:  # a GPU or Triton without support for a kernel
            self._fail(key, str(err))
        else:
            self.ready.add(key)

    def _fail(self, key: tuple[Any, ...], error: str) -> None:
        self.failed.add(key)
        log.warning("Triton kernel %s did not compile (%s); torch kernels instead", key[:-2], error)

    def close(self) -> None:
        """Stop the workers still compiling (at interpreter exit; their variants are dropped)."""
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.terminate()
        for worker in self.workers:
            try:
                worker.process.wait(5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.workers.clear()


def compile_worker() -> None:
    """Entry of the compile process: compile the keys read from stdin, one result line per key.

    Each line is ``index<TAB>ok`` or ``index<TAB>error text``. Anything the compilers print
    goes to stderr. The process ends with its parent (Linux ``PR_SET_PDEATHSIG``; elsewhere it
    checks the parent between keys).
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the compilers must not mix with the result lines
    keys, index = pickle.load(sys.stdin.buffer)
    device = torch.device("cuda", index)
    for i, key in enumerate(keys):
        if os.getppid() != parent:
            return  # orphaned: nobody will load the variants
        try:
            if i == 0:
                torch.cuda.set_device(device)
            _compile(key, device)
            status = "ok"
        except Exception as err:
            status = " ".join(f"{type(err).__name__}: {err}".split()) or "error"
        out.write(f"{i}\t{status}\n")
        out.flush()


#: The process-wide registry used by the engine.
registry = KernelRegistry()


def prepare(
    device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool
) -> _Pending | None:
    """:meth:`KernelRegistry.prepare` of the process-wide :data:`registry`."""
    return registry.prepare(device, dtype, paths, magma)


def wait_ready(timeout: float | None = None) -> bool:
    """:meth:`KernelRegistry.wait_ready` of the process-wide :data:`registry`."""
    return registry.wait_ready(timeout)


def panelled(use_gram: bool, rows: int, cols: int) -> bool:
    """Whether a launch group takes the panel path (:func:`orthogonalize_panels`)."""
    return use_gram and not resident(rows, cols)


def _launch_key(use_gram: bool, rows: int, cols: int) -> tuple[Any, ...]:
    if rows > MAX_ROWS:
        return ("phased", use_gram, (padded(rows), padded(cols)))
    if panelled(use_gram, rows, cols):
        return ("panel", panel_block(rows))
    return ("ns", tuple(sorted(_ns_options(rows, cols, use_gram).items())))


def _compile(key: tuple[Any, ...], device: torch.device) -> None:
    kind, dtype = key[0], key[-1]
    vec = torch.zeros(16, dtype=dtype, device=device)
    f32 = torch.zeros(16, dtype=torch.float32, device=device)
    f16 = torch.zeros(16, dtype=torch.float16, device=device)
    i64 = torch.zeros(16, dtype=torch.int64, device=device)
    if kind == "magma":
        _magma_partial_kernel.warmup(vec, vec, i64, f32, 2, BLOCK=1024, grid=(1,))
        _magma_finish_kernel.warmup(i64, f32, 2, f32, f32, f32, vec[0], f32[0], **_MAGMA_OPTIONS, grid=(1,))
    elif kind == "phased":  # the engine's two launches: all phases but the last, and the last
        use_gram, shape = key[1], key[2]
        work = torch.zeros(16, dtype=work_dtype(use_gram), device=device)
        args = (vec, vec, work, i64, 1, f32, f32, f32, torch.zeros(1, dtype=torch.int32, device=device), F.NS_EPS)
        n = phase_count(use_gram)
        for first, stop in ((0, n - 1), (n - 1, n)):
            options = _phased_options(use_gram, shape, stop - first > 1)
            _phased_kernel.warmup(*args, FIRST=first, STOP=stop, **options, grid=(1,))
    elif kind == "spans":
        _gather_kernel.warmup(i64, i64, vec, f32, **_SPAN_OPTIONS, grid=(1,))
        _momentum_kernel.warmup(vec, vec, vec, f32, vec, 16, BLOCK=_SPAN_OPTIONS["BLOCK"], num_warps=4, grid=(1,))
        _apply_kernel.warmup(i64, i64, vec, vec, **_SPAN_OPTIONS, enable_fp_fusion=False, grid=(1,))
    elif kind == "panel":
        bm = key[1]
        warps = _warps(bm)
        _panel_gram_kernel.warmup(vec, i64, i64, f32, BM=bm, BN=PANEL, num_warps=warps, grid=(1,))
        for restart in (False, True):
            _panel_reduce_kernel.warmup(
                i64, f32, f16, f32, f32, F.NS_EPS, BM=bm, RESTART=restart, num_warps=warps, grid=(1,)
            )
            args = (vec, f16, vec, i64, i64, f16, f32, f32, f32)
            _panel_apply_kernel.warmup(*args, BM=bm, BN=PANEL, FINAL=restart, num_warps=warps, grid=(1,))
    else:
        options = dict(key[1])
        work = torch.zeros(16, dtype=work_dtype(options["GRAM"]), device=device)
        _newton_schulz_kernel.warmup(vec, vec, work, i64, f32, f32, 2, F.NS_EPS, **options, grid=(1,))
