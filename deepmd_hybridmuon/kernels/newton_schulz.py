"""Newton–Schulz with one program per matrix (smaller side up to ``MAX_ROWS``): :func:`orthogonalize_blocks`.

Each program of a launch takes one matrix of the metadata table
(:class:`~deepmd_hybridmuon.kernels.common.MetaColumn`) and runs the whole iteration on it:

* it reads its block of the engine's flat Nesterov-update vector directly (row/column
  strides give the wide orientation: no padded stack, no index copies);
* the ``m x m`` products (``A = X X^T``, the polynomial, the Gram matrix and the
  accumulated transform) stay in registers; so does ``X`` (``m x n``) when it fits
  (:func:`~deepmd_hybridmuon.kernels.common.resident`), otherwise it lives in a per-matrix
  slice of the workspace and is streamed through in column chunks of ``CHUNK`` (the Gram
  iteration passes over it only to form its Gram matrix, at the restarts and at the end);
* the result, times the block's factor (Muon scale x Magma x -lr, computed on the device
  before), is written to the flat output vector in the parameter's own layout. A program
  reads its whole matrix before it writes any of it, and no two programs share an element,
  so the output may be the input (the engine's step writes the update over itself).

The coefficients are the rows of ``coefficient_table`` and the Gram schedule's restarts
compile-time constants of ``gram_constants``, both read from ``functional``.
"""

from __future__ import annotations

from typing import Any

import torch
import triton.language as tl

from .. import functional as F
from .common import (
    CHUNK,
    Launch,
    _block,
    _inverse_norm,
    _load_chunk,
    _matrix_meta,
    _polar_express_step,
    _pow2_downscale,
    _quintic_polynomial,
    _scaled_inverse_norm,
    _store_chunk,
    _warps,
    gram_constants,
    helper,
    kernel,
    resident,
    work_dtype,
)


@helper
def _gram(work, rows, cols, m, n, BM: tl.constexpr, BN: tl.constexpr):
    """X X^T of the workspace matrix, float32 accumulation."""
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    for c0 in range(0, n, BN):
        x = _load_chunk(work, rows, c0 + cols, m, n, n, 1)
        acc = tl.dot(x, tl.trans(x), acc)
    return acc


@helper
def _apply_left(work, T, rows, cols, m, n, alpha, BN: tl.constexpr):
    """X <- alpha X + T X in place, chunk by chunk (T is m x m, already in X's dtype)."""
    for c0 in range(0, n, BN):
        x = _load_chunk(work, rows, c0 + cols, m, n, n, 1)
        y = tl.dot(T, x, alpha * x.to(tl.float32))
        _store_chunk(work, y.to(x.dtype), rows, c0 + cols, m, n, n, 1)
    tl.debug_barrier()


@kernel("work_ptr", "meta_ptr", "coef_ptr")
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
    RESTARTS: tl.constexpr,
    FRESH_Q: tl.constexpr,
    UPDATES_R: tl.constexpr,
):
    """Program ``i``: Newton–Schulz of row ``i`` of the metadata table; ``scale * O`` into ``dst``.

    The standard iteration runs ``n_steps`` rows of the coefficient table; the Gram one
    (``GRAM``) the iterations of ``RESTARTS``, ``FRESH_Q`` and ``UPDATES_R``
    (:func:`~deepmd_hybridmuon.kernels.common.gram_constants`), unrolled.
    """
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
        # G 2^-e / (||G 2^-e|| + eps 2^-e) (functional.pow2_downscale): the power of two is exact,
        # and the sum of squares of G 2^-e (largest element below 2) cannot overflow
        g = _load_chunk(src, rows, cols, m, n, s_r, s_c).to(tl.float32)
        down = _pow2_downscale(tl.max(tl.abs(g)))
        g = g * down
        X = (g * _inverse_norm(tl.sum(g * g), eps * down, GRAM)).to(wdtype)
        if GRAM:
            R = tl.dot(X, tl.trans(X)).to(wdtype)
            Q = eye.to(wdtype)
            for k in tl.static_range(len(RESTARTS)):
                if RESTARTS[k]:  # re-form X and its Gram matrix
                    X = tl.dot(Q, X).to(wdtype)
                    R = tl.dot(X, tl.trans(X)).to(wdtype)
                R, Q = _polar_express_step(R, Q, eye, coef_ptr, k, FRESH_Q[k], UPDATES_R[k])
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
        # X0 = G 2^-e / (||G 2^-e||_F + eps 2^-e) in the workspace (wide orientation, row-major,
        # row stride n), as above. One pass finds the largest element and sums the squares of G
        # unscaled, in float64, where they cannot overflow: no extra pass over G.
        sq = tl.zeros((BM,), dtype=tl.float64)
        amax = tl.zeros((BM,), dtype=tl.float32)
        for c0 in range(0, n, BN):
            g = _load_chunk(src, rows, c0 + cols, m, n, s_r, s_c).to(tl.float32)
            sq += tl.sum(g.to(tl.float64) * g, axis=1)
            amax = tl.maximum(amax, tl.max(tl.abs(g), axis=1))
        down, inv = _scaled_inverse_norm(tl.sum(sq), tl.max(amax), eps, GRAM)
        for c0 in range(0, n, BN):
            g = _load_chunk(src, rows, c0 + cols, m, n, s_r, s_c).to(tl.float32)
            _store_chunk(work, (g * down * inv).to(wdtype), rows, c0 + cols, m, n, n, 1)
        tl.debug_barrier()
        if GRAM:  # X is read to form R, written at the restarts and at the end: X <- Q X
            R = _gram(work, rows, cols, m, n, BM, BN).to(wdtype)
            Q = eye.to(wdtype)
            for k in tl.static_range(len(RESTARTS)):
                if RESTARTS[k]:
                    tl.debug_barrier()
                    _apply_left(work, Q, rows, cols, m, n, 0.0, BN)
                    R = _gram(work, rows, cols, m, n, BM, BN).to(wdtype)
                R, Q = _polar_express_step(R, Q, eye, coef_ptr, k, FRESH_Q[k], UPDATES_R[k])
            tl.debug_barrier()
            _apply_left(work, Q, rows, cols, m, n, 0.0, BN)
        else:
            for k in range(n_steps):
                a = tl.load(coef_ptr + 3 * k)
                B = _quintic_polynomial(_gram(work, rows, cols, m, n, BM, BN).to(wdtype), coef_ptr, k)
                tl.debug_barrier()
                _apply_left(work, B, rows, cols, m, n, a, BN)
        # out = scale * X in the source layout and the output's dtype.
        for c0 in range(0, n, BN):
            x = _load_chunk(work, rows, c0 + cols, m, n, n, 1).to(tl.float32)
            _store_chunk(dst, (x * scale).to(dst_ptr.dtype.element_ty), rows, c0 + cols, m, n, s_r, s_c)


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
        Flat vectors (same length and layout): the Nesterov updates, and the output (which may be ``src``).
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
        Gram Newton–Schulz (rectangular matrices) instead of the standard iteration.
    """
    launch = blocks_launch(src.dtype, blocks_options(rows, cols, use_gram))
    launch((meta.size(0),), src, dst, work, meta, coefs, scale, coefs.size(0), F.NS_EPS)


def blocks_options(rows: int, cols: int, use_gram: bool) -> tuple[tuple[str, Any], ...]:
    """The compile-time options of the launch of :func:`orthogonalize_blocks` (sorted pairs): what fixes its variant."""
    bm, keep = _block(rows), resident(rows, cols)
    options = {
        "BM": bm,
        "BN": _block(cols) if keep else CHUNK,
        "GRAM": use_gram,
        "RESIDENT": keep,
        **gram_constants(),
        "num_warps": _warps(bm),
    }
    return tuple(sorted(options.items()))


def blocks_launch(dtype: torch.dtype, options: tuple[tuple[str, Any], ...]) -> Launch:
    """The launch of :func:`orthogonalize_blocks` on vectors of ``dtype`` with ``options`` (:func:`blocks_options`)."""
    kw = dict(options)
    args = (dtype, dtype, work_dtype(kw["GRAM"]), torch.int64, torch.float32, torch.float32, 2, F.NS_EPS)
    return Launch(_newton_schulz_kernel, *args, **kw)
