"""Matrices larger than one program (smaller side up to :data:`MAX_PHASED_ROWS`): :func:`orthogonalize_phased`.

A matrix whose smaller side exceeds ``MAX_ROWS`` (240 x 240 and 240 x 1600 in DeePMD's
fitting nets) does not fit one program. Its iteration is a sequence of phases, each a
product OUT = alpha C + beta L M over 64 x 64 output tiles, with the polynomial as its
epilogue and the result rounded to the iteration's dtype (as each cuBLAS call of the
reference rounds its output). The operands are slots of a zero-padded per-matrix
workspace: two m x n slots (0, 1), the rest m x m.

  phase 0, per m x n tile:  sum of squares (float64) and largest |G|  -> partial
  phase 1, per m x n tile:  X0 = G / ||G|| (partials added in order)  -> X0's slot
                            (as G 2^-e / ||G 2^-e||, functional.pow2_downscale's 2^-e)
  standard, per iteration:  A = X X^T;  B = b A + c A A;  X <- a X + B X
  Gram, per iteration:      Z = b R + c R R;  Q <- Q (a I + Z)  (Q = Z + a I at the start
                            and the restart);  P = a R + R Z;  R <- a P + Z P;
                            R = X X^T at the start, and with X = Q X at each restart
                          (``functional.gram_schedule``)
  last product:             factor * result, into the output in the parameter's layout

One launch runs all phases of all matrices of a group: each program takes tiles of a
phase in turn, then waits at a grid-wide barrier (an atomic counter) for the others.
This needs every program resident at once: the grid is at most the number of SMs
(shared between the groups that can run at the same time). Under Triton's interpreter,
which runs programs one after another, the host launches one phase at a time instead.

The phases are :func:`phased_schedule`, built from ``functional.standard_schedule`` and
``functional.gram_schedule`` and handed to the kernel as a compile-time tuple.
"""

from __future__ import annotations

import functools
from enum import IntEnum
from typing import Any

import torch
import triton.language as tl

from .. import functional as F
from .common import Launch, _load_chunk, _scaled_inverse_norm, _store_chunk, helper, kernel, work_dtype

#: Largest smaller side of the phased path; larger matrices stay on cuBLAS (the torch path).
#: Measured on the H100 (``benchmarks/phased_time.py --sweep``, BENCHMARKS.md): the whole
#: orthogonalisation of 4 x 240 x 240 takes 0.64-0.73x the time of the cuBLAS chain, of
#: 4 x 384 x 384 1.36-1.49x and of 4 x 512 x 512 1.59-1.78x (each program then computes
#: several tiles of a phase one after another). 256 pads to the same tiles as 240.
MAX_PHASED_ROWS: int = 256
#: Output tile and reduction chunk of the phased products.
TILE: int = 64


class PhasedColumn(IntEnum):
    """Columns of the phased metadata table, one row per matrix (wide orientation, m <= n).

    A group holds matrices of one padded shape (MP x NP, whole tiles), a compile-time
    constant of its kernel: every workspace address is then known to the compiler up to the
    matrix index, so the tile loads are contiguous and aligned.
    """

    SRC = 0
    M = 1
    N = 2
    ROW_STRIDE = 3
    COL_STRIDE = 4
    BLOCK = 5


#: Integers per matrix in the phased metadata table (:class:`PhasedColumn`).
PHASED_META_COLS: int = 6


class PhaseKind(IntEnum):
    """What a phase computes (column ``KIND`` of a :func:`phased_schedule` row)."""

    NORM = 0  # sums of squares of G, per m x n tile
    NORMALISE = 1  # X0 = G / ||G|| into slot OUT
    PRODUCT = 2  # OUT = ALPHA C + BETA L M


class PhaseColumn(IntEnum):
    """Columns of a :func:`phased_schedule` row.

    ``OUT``, ``LEFT``, ``RIGHT``, ``ADDEND`` (C) and ``Q`` are workspace slots (``OUT`` may be
    :data:`DST`, ``Q`` 0 for none); ``TRANSPOSED``: the right operand is slot ``RIGHT``
    transposed; ``ALPHA``, ``BETA``: 0 for none or 1.0, else the coefficient column + 1 of
    iteration ``ITERATION``.
    """

    KIND = 0
    OUT = 1
    LEFT = 2
    RIGHT = 3
    TRANSPOSED = 4
    ADDEND = 5
    ALPHA = 6
    BETA = 7
    ITERATION = 8
    Q = 9


#: Integers per phase of :func:`phased_schedule` (:class:`PhaseColumn`). The kernel gets the
#: schedule as a compile-time tuple and unrolls it.
PHASE_COLS: int = 10
#: The output vector, as the ``out`` of the last product.
DST: int = -2

# The layouts as compile-time constants of the kernels (Triton reads only constexpr globals).
_PM_COLS = tl.constexpr(PHASED_META_COLS)
_PM_SRC = tl.constexpr(int(PhasedColumn.SRC))
_PM_M = tl.constexpr(int(PhasedColumn.M))
_PM_N = tl.constexpr(int(PhasedColumn.N))
_PM_ROW_STRIDE = tl.constexpr(int(PhasedColumn.ROW_STRIDE))
_PM_COL_STRIDE = tl.constexpr(int(PhasedColumn.COL_STRIDE))
_PM_BLOCK = tl.constexpr(int(PhasedColumn.BLOCK))
_NORM = tl.constexpr(int(PhaseKind.NORM))
_NORMALISE = tl.constexpr(int(PhaseKind.NORMALISE))
_KIND = tl.constexpr(int(PhaseColumn.KIND))
_OUT = tl.constexpr(int(PhaseColumn.OUT))
_LEFT = tl.constexpr(int(PhaseColumn.LEFT))
_RIGHT = tl.constexpr(int(PhaseColumn.RIGHT))
_TRANSPOSED = tl.constexpr(int(PhaseColumn.TRANSPOSED))
_ADDEND = tl.constexpr(int(PhaseColumn.ADDEND))
_ALPHA = tl.constexpr(int(PhaseColumn.ALPHA))
_BETA = tl.constexpr(int(PhaseColumn.BETA))
_ITERATION = tl.constexpr(int(PhaseColumn.ITERATION))
_Q = tl.constexpr(int(PhaseColumn.Q))
_DST = tl.constexpr(DST)


@helper
def _slot_ptr(work_ptr, i, SLOT: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, SQUARES: tl.constexpr):
    """Start of workspace slot ``SLOT`` of matrix ``i`` (row stride NP for slots 0 and 1, else MP)."""
    slab: tl.constexpr = 2 * MP * NP + SQUARES * MP * MP
    offset: tl.constexpr = SLOT * MP * NP if SLOT < 2 else 2 * MP * NP + (SLOT - 2) * MP * MP
    return work_ptr + i * slab + offset


@helper
def _tile(base, r0, c0, STRIDE: tl.constexpr, BM: tl.constexpr):
    """A BM x BM tile of a padded slot (no mask: slots are padded to whole tiles)."""
    rows = r0 + tl.arange(0, BM)
    cols = c0 + tl.arange(0, BM)
    return tl.load(base + rows[:, None] * STRIDE + cols[None, :], cache_modifier=".cg")


@helper
def _source_meta(meta_ptr, i):
    """Source offset, m, n and strides of matrix ``i`` (its metadata row, :class:`PhasedColumn`)."""
    row = meta_ptr + i * _PM_COLS
    return (
        tl.load(row + _PM_SRC),
        tl.load(row + _PM_M),
        tl.load(row + _PM_N),
        tl.load(row + _PM_ROW_STRIDE),
        tl.load(row + _PM_COL_STRIDE),
    )


@helper
def _wide_tile(t, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    """Matrix, first row and first column of m x n tile ``t``."""
    per: tl.constexpr = (MP // BM) * (NP // BM)
    rem = t % per
    return t // per, (rem // (NP // BM)) * BM, (rem % (NP // BM)) * BM


@helper
def _norm_tiles(src_ptr, meta_ptr, count, partial_ptr, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr):
    """Phase 0: over each m x n tile, the sum of squares of G (float64: no overflow) and its largest |G|."""
    for t in range(tl.program_id(0), count * (MP // BM) * (NP // BM), tl.num_programs(0)):
        i, r0, c0 = _wide_tile(t, MP, NP, BM)
        src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
        g = _load_chunk(src_ptr + src_off, r0 + tl.arange(0, BM), c0 + tl.arange(0, BM), m, n, s_r, s_c)
        g = g.to(tl.float32)
        tl.store(partial_ptr + 2 * t, tl.sum(g.to(tl.float64) * g))
        tl.store(partial_ptr + 2 * t + 1, tl.max(tl.abs(g)).to(tl.float64))


@helper
def _normalise_tiles(
    src_ptr, work_ptr, meta_ptr, count, partial_ptr, eps, X0: tl.constexpr, GRAM: tl.constexpr,
    SQUARES: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Phase 1: X0 = G / ||G|| into slot ``X0`` (the matrix's partial sums added in order).

    Computed as (G 2^-e) / ||G 2^-e||, with 2^-e from the matrix's largest |G|
    (``common._scaled_inverse_norm``): scale-invariant up to ``functional.GRAD_LIMIT``.
    """
    per: tl.constexpr = (MP // BM) * (NP // BM)
    for t in range(tl.program_id(0), count * per, tl.num_programs(0)):
        i, r0, c0 = _wide_tile(t, MP, NP, BM)
        src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
        total = tl.load(partial_ptr + 2 * i * per, cache_modifier=".cg")
        amax = tl.load(partial_ptr + 2 * i * per + 1, cache_modifier=".cg")
        for j in tl.static_range(1, per):
            total += tl.load(partial_ptr + 2 * (i * per + j), cache_modifier=".cg")
            amax = tl.maximum(amax, tl.load(partial_ptr + 2 * (i * per + j) + 1, cache_modifier=".cg"))
        down, inv = _scaled_inverse_norm(total, amax.to(tl.float32), eps, GRAM)
        rows = r0 + tl.arange(0, BM)
        cols = c0 + tl.arange(0, BM)
        g = _load_chunk(src_ptr + src_off, rows, cols, m, n, s_r, s_c).to(tl.float32)
        base = _slot_ptr(work_ptr, i, X0, MP, NP, SQUARES)
        x = (g * down * inv).to(work_ptr.dtype.element_ty)
        tl.store(base + rows[:, None] * NP + cols[None, :], x)


@helper
def _products(
    dst_ptr, work_ptr, meta_ptr, count, coef_ptr, scale_ptr,
    K: tl.constexpr, OUT: tl.constexpr, L: tl.constexpr, M: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
    ALPHA: tl.constexpr, BETA: tl.constexpr, Q: tl.constexpr, SQUARES: tl.constexpr,
    MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """One product phase, OUT = ALPHA C + BETA L M (M = slot M transposed when ``T``), over its tiles.

    Slots are workspace slots, ``OUT`` may be :data:`DST`; ``ALPHA``/``BETA`` 0 for none/1.0,
    else the coefficient column + 1 of iteration ``K``; ``Q``: also write OUT + a I there.
    """
    sq: tl.constexpr = SQUARES  # m x m slots per matrix
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
        if OUT == _DST:  # factor * result in the parameter's layout
            src_off, m, n, s_r, s_c = _source_meta(meta_ptr, i)
            value = y.to(tl.float32) * tl.load(scale_ptr + tl.load(meta_ptr + i * _PM_COLS + _PM_BLOCK))
            _store_chunk(dst_ptr + src_off, value.to(dst_ptr.dtype.element_ty), rows, cols, m, n, s_r, s_c)
        else:
            o_base = _slot_ptr(work_ptr, i, OUT, MP, NP, sq)
            tl.store(o_base + rows[:, None] * cols_out + cols[None, :], y)
        if Q != 0:  # Q = Z + a I on the real diagonal (the padding stays zero)
            m = tl.load(meta_ptr + i * _PM_COLS + _PM_M)
            eye = ((rows[:, None] == cols[None, :]) & (rows[:, None] < m)).to(tl.float32)
            q_tile = y.to(tl.float32) + tl.load(coef_ptr + 3 * K) * eye
            q_base = _slot_ptr(work_ptr, i, Q, MP, NP, sq)
            tl.store(q_base + rows[:, None] * MP + cols[None, :], q_tile.to(wdtype))


@helper
def _grid_barrier(counter_ptr, target):
    """Wait until ``target`` arrivals were counted (every program of the launch, this phase)."""
    tl.debug_barrier()  # this program's stores are done
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    # Each poll is an acquiring read-modify-write, so the last one orders this program's later
    # loads after the other programs' stores (1.2 us a barrier on the H100, BENCHMARKS.md).
    while tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu") < target:
        pass
    tl.debug_barrier()


@kernel("work_ptr", "meta_ptr", "partial_ptr", "coef_ptr", "counter_ptr")
def _phased_kernel(
    src_ptr, dst_ptr, work_ptr, meta_ptr, count, partial_ptr, coef_ptr, scale_ptr, counter_ptr, eps,
    SCHEDULE: tl.constexpr, FIRST: tl.constexpr, STOP: tl.constexpr, SYNC: tl.constexpr, GRAM: tl.constexpr,
    SQUARES: tl.constexpr, MP: tl.constexpr, NP: tl.constexpr, BM: tl.constexpr,
):  # fmt: skip
    """Phases FIRST:STOP of ``SCHEDULE``, unrolled at compile time; grid barriers between them with SYNC.

    ``SCHEDULE``: :func:`phased_schedule` as a tuple of tuples (:class:`PhaseColumn` rows);
    ``SQUARES``: :func:`phased_square_slots`.
    """
    for P in tl.static_range(FIRST, STOP):  # (a row in a local variable would not stay a compile-time constant)
        if SCHEDULE[P][_KIND] == _NORM:
            _norm_tiles(src_ptr, meta_ptr, count, partial_ptr, MP, NP, BM)
        elif SCHEDULE[P][_KIND] == _NORMALISE:
            _normalise_tiles(
                src_ptr, work_ptr, meta_ptr, count, partial_ptr, eps, SCHEDULE[P][_OUT], GRAM, SQUARES, MP, NP, BM
            )
        else:
            _products(
                dst_ptr, work_ptr, meta_ptr, count, coef_ptr, scale_ptr, SCHEDULE[P][_ITERATION], SCHEDULE[P][_OUT],
                SCHEDULE[P][_LEFT], SCHEDULE[P][_RIGHT], SCHEDULE[P][_TRANSPOSED] != 0, SCHEDULE[P][_ADDEND],
                SCHEDULE[P][_ALPHA], SCHEDULE[P][_BETA], SCHEDULE[P][_Q], SQUARES, MP, NP, BM,
            )  # fmt: skip
        if SYNC and P < STOP - 1:
            _grid_barrier(counter_ptr, (P - FIRST + 1) * tl.num_programs(0))


def phased_schedule(use_gram: bool) -> tuple[tuple[int, ...], ...]:
    """The phases of one orthogonalisation (:class:`PhaseColumn` rows), in order.

    Built from ``functional.standard_schedule()`` (its length) or ``functional.gram_schedule()``
    (its length, restarts and the flags derived from them), once per schedule. A tuple of
    tuples, as the kernel takes it (a compile-time constant).
    """
    return _gram_phases(F.gram_schedule()) if use_gram else _standard_phases(len(F.standard_schedule()))


def _phase(kind: PhaseKind, **columns: int) -> tuple[int, ...]:
    row = [0] * PHASE_COLS
    row[PhaseColumn.KIND] = kind
    for name, value in columns.items():
        row[PhaseColumn[name.upper()]] = int(value)
    return tuple(row)


def _product(k: int, out: int, left: int, right: int, **columns: int) -> tuple[int, ...]:
    return _phase(PhaseKind.PRODUCT, iteration=k, out=out, left=left, right=right, **columns)


# Coefficient columns + 1, for ALPHA and BETA (0 there: none, or 1.0).
_A, _B, _C = 1, 2, 3


@functools.cache
def _standard_phases(steps: int) -> tuple[tuple[int, ...], ...]:
    A, B = 2, 3  # square slots of A = X X^T and of the polynomial
    x = 0  # X alternates between the m x n slots 0 and 1 (a product never writes what it reads)
    phases = [_phase(PhaseKind.NORM), _phase(PhaseKind.NORMALISE, out=x)]
    for k in range(steps):
        phases.append(_product(k, A, x, x, transposed=1))
        phases.append(_product(k, B, A, A, addend=A, alpha=_B, beta=_C))
        nxt = DST if k == steps - 1 else 1 - x
        phases.append(_product(k, nxt, B, x, addend=x, alpha=_A))
        x = nxt
    return tuple(phases)


@functools.cache
def _gram_phases(schedule: F.GramSchedule) -> tuple[tuple[int, ...], ...]:
    R, Z, P = 2, 3, 6  # square slots of R, Z = b R + c R^2 and R (a I + Z)
    x = 1  # X0, then X alternates between the m x n slots 1 and 0 at each restart
    q = spare = 4  # Q alternates between the square slots 4 and 5
    phases = [_phase(PhaseKind.NORM), _phase(PhaseKind.NORMALISE, out=x)]
    phases.append(_product(0, R, x, x, transposed=1))
    for k in range(schedule.steps):
        if schedule.restarts[k]:  # X <- Q X, R = X X^T
            phases.append(_product(k, 1 - x, q, x))
            x = 1 - x
            phases.append(_product(k, R, x, x, transposed=1))
        if schedule.fresh_q[k]:  # Q = Z + a I, written with Z
            q, spare = 4, 5
            phases.append(_product(k, Z, R, R, addend=R, alpha=_B, beta=_C, q=q))
        else:  # Q <- a Q + Q Z
            phases.append(_product(k, Z, R, R, addend=R, alpha=_B, beta=_C))
            phases.append(_product(k, spare, q, Z, addend=q, alpha=_A))
            q, spare = spare, q
        if schedule.updates_r[k]:  # P = a R + R Z; R <- a P + Z P
            phases.append(_product(k, P, R, Z, addend=R, alpha=_A))
            phases.append(_product(k, R, Z, P, addend=P, alpha=_A))
    phases.append(_product(schedule.steps - 1, DST, q, x))
    return tuple(phases)


def phased_square_slots(use_gram: bool) -> int:
    """m x m workspace slots per matrix (after the two m x n slots) that :func:`phased_schedule` uses."""
    if use_gram:
        return _square_slots(_gram_phases, F.gram_schedule())
    return _square_slots(_standard_phases, len(F.standard_schedule()))


@functools.cache
def _square_slots(phases: Any, key: Any) -> int:  # (cached on the schedule, as the phases are)
    slots = (PhaseColumn.OUT, PhaseColumn.LEFT, PhaseColumn.RIGHT, PhaseColumn.ADDEND, PhaseColumn.Q)
    return max(row[c] for row in phases(key) for c in slots) - 1


def padded(size: int) -> int:
    """``size`` rounded up to whole tiles (:data:`TILE`)."""
    return -(-size // TILE) * TILE


def phased_workspace(matrices: list[tuple[int, int, int, int, int, int]], use_gram: bool) -> int:
    """Workspace size (elements) of a phased group, whose metadata table is ``matrices``.

    ``matrices``: (source offset, m, n, row stride, column stride, block) per matrix
    (:class:`PhasedColumn`), in the wide orientation (m <= n), all of one padded shape
    (:func:`padded`).
    """
    shapes = {(padded(m), padded(n)) for _, m, n, _, _, _ in matrices}
    if len(shapes) != 1:
        raise ValueError(f"a phased group holds matrices of one padded shape, not {sorted(shapes)}")
    mp, np_ = shapes.pop()
    return (2 * mp * np_ + phased_square_slots(use_gram) * mp * mp) * len(matrices)


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
    ``shape``: the group's padded (m, n); ``partial``: float64, two per m x n tile;
    ``counter``: one int32; ``programs``: the grid (at most the SMs this launch may hold
    while others run).
    """
    stop = phase_count(use_gram) if stop is None else stop
    args = (src, dst, work, meta, meta.size(0), partial, coefs, scale, counter, F.NS_EPS)
    if src.device.type != "cuda":  # the interpreter runs programs one after another: no barriers
        for ph in range(first, stop):
            phased_launch(src.dtype, use_gram, shape, ph, ph + 1)((programs,), *args)
        return
    launch = phased_launch(src.dtype, use_gram, shape, first, stop)
    if launch.kwargs["SYNC"]:  # the grid barriers count on it from zero
        counter.zero_()
    launch((programs,), *args)


def phased_launches(dtype: torch.dtype, use_gram: bool, shape: tuple[int, int]) -> tuple[Launch, Launch]:
    """The engine's two launches of a phased group on a GPU: every phase but the last, then the last."""
    n = phase_count(use_gram)
    return phased_launch(dtype, use_gram, shape, 0, n - 1), phased_launch(dtype, use_gram, shape, n - 1, n)


def phased_launch(
    dtype: torch.dtype, use_gram: bool, shape: tuple[int, int], first: int, stop: int, sync: bool | None = None
) -> Launch:
    """The launch of :func:`orthogonalize_phased` for phases ``first:stop``.

    ``sync``: with grid barriers between the phases; by default when it runs more than one
    phase (``benchmarks/phased_time.py`` also times a launch without them).
    """
    sync = stop - first > 1 if sync is None else sync
    i64, f64, f32, i32 = torch.int64, torch.float64, torch.float32, torch.int32
    options = {"SCHEDULE": phased_schedule(use_gram), "GRAM": use_gram, "SQUARES": phased_square_slots(use_gram)}
    options |= {"SYNC": sync, "MP": shape[0], "NP": shape[1], "BM": TILE, "FIRST": first, "STOP": stop}
    if sync:  # grid barriers: a cooperative launch makes the driver place every program at once
        options["launch_cooperative_grid"] = True
    args = (dtype, dtype, work_dtype(use_gram), i64, 1, f64, f32, f32, i32, F.NS_EPS)
    return Launch(_phased_kernel, *args, **options, num_warps=4)
