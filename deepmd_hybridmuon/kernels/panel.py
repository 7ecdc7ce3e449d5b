"""Gram Newton–Schulz of long matrices in column panels: :func:`orthogonalize_panels`.

A long matrix (smaller side <= ``MAX_ROWS``, not resident) in one program streams m x n
through one SM several times. Split into panels of :data:`PANEL` columns instead, every pass
over X is spread over many programs, and the m x m work between passes is one program per
matrix. The Gram schedule (``functional.gram_schedule``) is cut at its restarts into
segments; each segment is one reduce launch (per matrix) and one apply launch (per panel):

  1. per panel:  S_p = (G_p 2^-e_p)(G_p 2^-e_p)^T (float32)              -> partial[p], 2^-e_p
  per segment s (iterations start:stop, :func:`panel_launches`):
  2. per matrix: R = sum_p S_p (first segment: each S_p times 2^(2 (e_p - e)), with e the
                 largest e_p; ||G 2^-e||^2 = trace R, R /= ||G 2^-e||^2);
                 iterations start:stop of the Gram form                   -> Q
  3. per panel:  X_p = Q X_p (first segment: X_p = fp16(G_p 2^-e / ||G 2^-e||) first);
                 last segment: out_p = factor * X_p -> dst, else X_p -> work and
                 X_p X_p^T -> partial[p] (the next segment's R)

With the schedule's one restart, five launches. The reference forms R from the rounded X0;
here it comes from G in float32 products (TF32 on the tensor cores), a rounding of the
same size.

The powers of two are ``functional.pow2_downscale``'s, per panel (each panel's largest element
brought below 2, so that no product or sum overflows, whatever the matrix's magnitude below
``functional.GRAD_LIMIT``); 2^-e, the matrix's, is the reference's. All of them are exact,
and 1 for matrices below 2, whose arithmetic they leave unchanged.
"""

from __future__ import annotations

import functools
from enum import IntEnum
from typing import Any

import torch
import triton.language as tl

from .. import functional as F
from .common import (
    Launch,
    MetaColumn,
    _block,
    _load_chunk,
    _matrix_meta,
    _polar_express_step,
    _pow2_downscale,
    _store_chunk,
    _warps,
    gram_constants,
    kernel,
    resident,
)

#: Columns per panel of the long-matrix Gram path.
PANEL: int = 64


class PanelColumn(IntEnum):
    """Columns of the panel table: the matrix's row in the metadata table, the panel's first column."""

    MATRIX = 0
    FIRST_COL = 1


#: Integers per panel in the panel table (:class:`PanelColumn`).
PANEL_COLS: int = 2

_PANEL_COLS = tl.constexpr(PANEL_COLS)
_PANEL_MATRIX = tl.constexpr(int(PanelColumn.MATRIX))
_PANEL_FIRST_COL = tl.constexpr(int(PanelColumn.FIRST_COL))


@kernel("meta_ptr", "panel_ptr", "partial_ptr")
def _panel_gram_kernel(src_ptr, meta_ptr, panel_ptr, partial_ptr, down_ptr, BM: tl.constexpr, BN: tl.constexpr):
    """Per panel: its power of two 2^-e_p (largest element brought below 2) and (G_p 2^-e_p)(G_p 2^-e_p)^T."""
    p = tl.program_id(0)
    i = tl.load(panel_ptr + _PANEL_COLS * p + _PANEL_MATRIX)
    c0 = tl.load(panel_ptr + _PANEL_COLS * p + _PANEL_FIRST_COL)
    src_off, _, m, n, s_r, s_c, _ = _matrix_meta(meta_ptr, i)
    rows = tl.arange(0, BM)
    g = _load_chunk(src_ptr + src_off, rows, c0 + tl.arange(0, BN), m, n, s_r, s_c).to(tl.float32)
    down = _pow2_downscale(tl.max(tl.abs(g)))
    g = g * down
    S = tl.dot(g, tl.trans(g))
    tl.store(partial_ptr + p * BM * BM + rows[:, None] * BM + rows[None, :], S)
    tl.store(down_ptr + p, down)


@kernel("first_ptr", "partial_ptr", "q_ptr", "inv_ptr", "coef_ptr")
def _panel_reduce_kernel(
    first_ptr, partial_ptr, down_ptr, q_ptr, inv_ptr, coef_ptr, eps, BM: tl.constexpr,
    START: tl.constexpr, STOP: tl.constexpr, FRESH_Q: tl.constexpr, UPDATES_R: tl.constexpr,
):  # fmt: skip
    """Per matrix: R from the panels' partial sums, then iterations START:STOP of the Gram form -> Q.

    The first segment also writes the matrix's power of two 2^-e and 1 / (||G 2^-e|| + eps 2^-e)
    to ``inv`` (two per matrix), which the apply launch normalises G with.
    """
    i = tl.program_id(0)
    rows = tl.arange(0, BM)
    tile = rows[:, None] * BM + rows[None, :]
    lo = tl.load(first_ptr + i)
    hi = tl.load(first_ptr + i + 1)
    acc = tl.zeros((BM, BM), dtype=tl.float32)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    Q = eye.to(tl.float16)
    if START == 0:
        down = tl.load(down_ptr + lo)  # the matrix's 2^-e: the smallest of its panels' 2^-e_p
        for p in range(lo + 1, hi):
            down = tl.minimum(down, tl.load(down_ptr + p))
        for p in range(lo, hi):
            # S_p 2^(2 (e_p - e)): exact (a panel far below the largest may underflow, negligibly)
            w = down / tl.load(down_ptr + p)
            acc += tl.load(partial_ptr + p * BM * BM + tile) * (w * w)
        # ||G 2^-e|| = sqrt(trace(G G^T) 2^-2e); eps scaled alike (as in functional.gram_newton_schulz)
        inv = 1.0 / (tl.sqrt(tl.sum(tl.where(eye > 0, acc, 0.0))) + eps * down)
        tl.store(inv_ptr + 2 * i, down)
        tl.store(inv_ptr + 2 * i + 1, inv)
        R = (acc * inv * inv).to(tl.float16)
    else:  # a restart: the partial sums are those of X X^T
        for p in range(lo, hi):
            acc += tl.load(partial_ptr + p * BM * BM + tile)
        R = acc.to(tl.float16)
    for k in tl.static_range(START, STOP):
        R, Q = _polar_express_step(R, Q, eye, coef_ptr, k, FRESH_Q[k], UPDATES_R[k])
    tl.store(q_ptr + i * BM * BM + tile, Q)


@kernel("work_ptr", "meta_ptr", "panel_ptr", "q_ptr", "inv_ptr", "partial_ptr")
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
    FROM_SOURCE: tl.constexpr,
    FINAL: tl.constexpr,
):
    """Per panel: X_p <- Q X_p (X_p = G_p 2^-e / ||G 2^-e|| with FROM_SOURCE); FINAL: factor * X_p into ``dst``."""
    p = tl.program_id(0)
    i = tl.load(panel_ptr + _PANEL_COLS * p + _PANEL_MATRIX)
    c0 = tl.load(panel_ptr + _PANEL_COLS * p + _PANEL_FIRST_COL)
    src_off, work_off, m, n, s_r, s_c, block = _matrix_meta(meta_ptr, i)
    rows = tl.arange(0, BM)
    cols = c0 + tl.arange(0, BN)
    Q = tl.load(q_ptr + i * BM * BM + rows[:, None] * BM + rows[None, :])
    work = work_ptr + work_off
    if FROM_SOURCE:
        g = _load_chunk(src_ptr + src_off, rows, cols, m, n, s_r, s_c).to(tl.float32)
        # the power of two first: 1 / ||G|| itself could be subnormal in float32 (a norm above ~1e38)
        x = (g * tl.load(inv_ptr + 2 * i) * tl.load(inv_ptr + 2 * i + 1)).to(tl.float16)
    else:
        x = _load_chunk(work, rows, cols, m, n, n, 1)
    y = tl.dot(Q, x).to(tl.float16)
    if FINAL:
        y = y.to(tl.float32) * tl.load(scale_ptr + block)
        _store_chunk(dst_ptr + src_off, y.to(dst_ptr.dtype.element_ty), rows, cols, m, n, s_r, s_c)
    else:
        _store_chunk(work, y, rows, cols, m, n, n, 1)
        S = tl.dot(y, tl.trans(y))
        tl.store(partial_ptr + p * BM * BM + rows[:, None] * BM + rows[None, :], S)


def panel_table(meta: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Panels of the matrices of a metadata table, and each matrix's first panel.

    Returns ``panels`` (:class:`PanelColumn` rows) and ``first`` (matrices + 1).
    """
    panels, first = [], [0]
    for i, row in enumerate(meta):
        for c0 in range(0, row[MetaColumn.N], PANEL):
            panel = [0] * PANEL_COLS
            panel[PanelColumn.MATRIX], panel[PanelColumn.FIRST_COL] = i, c0
            panels.append(panel)
        first.append(len(panels))
    return panels, first


def panel_launches() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Compile-time options of the (reduce, apply) launches, one pair per segment of the Gram schedule.

    Derived from ``functional.gram_schedule()``: a segment runs from the first iteration or
    a restart to the next restart or the end.
    """
    return [(dict(reduce), dict(apply)) for reduce, apply in _panel_launches(F.gram_schedule())]


@functools.cache
def _panel_launches(schedule: F.GramSchedule) -> tuple[tuple[tuple[tuple[str, Any], ...], ...], ...]:
    flags = gram_constants()
    last = len(schedule.segments) - 1
    return tuple(
        (
            (("START", start), ("STOP", stop), ("FRESH_Q", flags["FRESH_Q"]), ("UPDATES_R", flags["UPDATES_R"])),
            (("FROM_SOURCE", s == 0), ("FINAL", s == last)),
        )
        for s, (start, stop) in enumerate(schedule.segments)
    )


def orthogonalize_panels(
    src: torch.Tensor,
    dst: torch.Tensor,
    work: torch.Tensor,
    meta: torch.Tensor,
    panels: torch.Tensor,
    first: torch.Tensor,
    partial: torch.Tensor,
    down: torch.Tensor,
    q: torch.Tensor,
    inv: torch.Tensor,
    coefs: torch.Tensor,
    scale: torch.Tensor,
    rows: int,
) -> None:
    """Gram Newton–Schulz of long matrices in ``1 + 2 * segments`` launches (see the module docstring).

    ``meta`` as for ``orthogonalize_blocks``; ``panels`` and ``first`` from
    :func:`panel_table`; workspaces: ``partial`` float32 ``(panels, BM, BM)``, ``down``
    float32 ``(panels,)``, ``q`` float16 ``(matrices, BM, BM)``, ``inv`` float32
    ``(matrices, 2)``, ``work`` float16 with room for every matrix; ``BM = panel_block(rows)``.
    """
    gram, segments = panel_variant(src.dtype, panel_block(rows))
    n_panels, n_matrices = panels.size(0), meta.size(0)
    gram((n_panels,), src, meta, panels, partial, down)
    for reduce, apply in segments:
        reduce((n_matrices,), first, partial, down, q, inv, coefs, F.NS_EPS)
        apply((n_panels,), src, work, dst, meta, panels, q, inv, partial, scale)


def panel_variant(dtype: torch.dtype, bm: int) -> tuple[Launch, tuple[tuple[Launch, Launch], ...]]:
    """The launches of :func:`orthogonalize_panels` on vectors of ``dtype`` with blocks of ``bm``.

    The Gram launch, then one (reduce, apply) pair per segment of the Gram schedule (:func:`panel_launches`).
    """
    i64, f32, f16 = torch.int64, torch.float32, torch.float16
    warps = _warps(bm)
    gram = Launch(_panel_gram_kernel, dtype, i64, i64, f32, f32, BM=bm, BN=PANEL, num_warps=warps)
    segments = tuple(
        (
            Launch(_panel_reduce_kernel, i64, f32, f32, f16, f32, f32, F.NS_EPS, BM=bm, **reduce, num_warps=warps),
            Launch(
                _panel_apply_kernel,
                dtype,
                f16,
                dtype,
                i64,
                i64,
                f16,
                f32,
                f32,
                f32,
                BM=bm,
                BN=PANEL,
                **apply,
                num_warps=warps,
            ),
        )
        for reduce, apply in panel_launches()
    )
    return gram, segments


def panel_block(rows: int) -> int:
    """The padded ``m x m`` size of the panel kernels."""
    return _block(rows)


def panelled(use_gram: bool, rows: int, cols: int) -> bool:
    """Whether a launch group takes the panel path (:func:`orthogonalize_panels`)."""
    return use_gram and not resident(rows, cols)
