"""What the kernel families share: sizes, workspace dtypes, the metadata table, Triton helpers.

Also the one place where the Newton–Schulz specification of :mod:`deepmd_hybridmuon.functional`
becomes kernel input: :func:`coefficient_table` (the (a, b, c) rows, a device tensor) and
:func:`gram_constants` (the Gram schedule's per-iteration flags, compile-time constants).
No kernel writes a schedule of its own.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import torch
import triton
import triton.language as tl

from .. import functional as F

#: Largest smaller side handled by one program (``functional.on_triton`` decides a matrix's path).
MAX_ROWS: int = F.TRITON_MAX_ROWS
#: Columns of ``X`` per chunk of the streamed products (a multiple of 16 for ``tl.dot``).
CHUNK: int = 64
#: Largest padded ``m x n`` kept whole in registers for the whole iteration (128 x 128:
#: 32 registers per thread for the bf16 tile and 64 for its float32 products at 8 warps).
#: Larger matrices stream ``X`` through the workspace in chunks of :data:`CHUNK` columns.
RESIDENT_ELEMENTS: int = 128 * 128
#: Workspace dtypes of the two iterations (those of the reference functions).
STANDARD_WORK_DTYPE: torch.dtype = torch.bfloat16
GRAM_WORK_DTYPE: torch.dtype = torch.float16


class MetaColumn(IntEnum):
    """Columns of the metadata table of the program-per-matrix kernel, one row per matrix.

    The matrix in its wide orientation (``M <= N``) is read at ``SRC + r * ROW_STRIDE + c *
    COL_STRIDE`` of the flat vectors; ``WORK`` is its offset in the workspace and ``BLOCK``
    its index in the per-block factors.
    """

    SRC = 0
    WORK = 1
    M = 2
    N = 3
    ROW_STRIDE = 4
    COL_STRIDE = 5
    BLOCK = 6


#: Integers per matrix in the metadata table: the :class:`MetaColumn` columns and one unused.
META_COLS: int = 8

# The same layout as compile-time constants of the kernels (Triton reads only constexpr globals).
_META_COLS = tl.constexpr(META_COLS)
_META_SRC = tl.constexpr(int(MetaColumn.SRC))
_META_WORK = tl.constexpr(int(MetaColumn.WORK))
_META_M = tl.constexpr(int(MetaColumn.M))
_META_N = tl.constexpr(int(MetaColumn.N))
_META_ROW_STRIDE = tl.constexpr(int(MetaColumn.ROW_STRIDE))
_META_COL_STRIDE = tl.constexpr(int(MetaColumn.COL_STRIDE))
_META_BLOCK = tl.constexpr(int(MetaColumn.BLOCK))

# IEEE 754 single precision: a float32's bits are sign, 8 exponent bits (bias 127), 23 of mantissa.
_F32_MANTISSA = tl.constexpr(23)
_F32_EXPONENT_MASK = tl.constexpr(0xFF)
_F32_BIAS = tl.constexpr(127)


#: The pointer arguments each host-launched kernel takes as 16-byte aligned (:func:`kernel`), by kernel name.
ALIGNED: dict[str, tuple[str, ...]] = {}
#: Every Triton function of the kernel modules (:func:`helper`, :func:`kernel`), in the order of definition.
JITTED: list[Any] = []


def helper(fn: Callable[..., Any]) -> Any:
    """``triton.jit`` for a function called from the kernels (inlined into them), noted in :data:`JITTED`."""
    jitted = triton.jit(fn)
    JITTED.append(jitted)
    return jitted


def settle_hashes() -> None:
    """Hash every Triton function of the package now, each after the helpers it calls.

    A kernel's Triton cache key includes the constant globals its helpers read, but Triton 3.6
    gathers a helper's globals only if that helper was hashed before, in that process; hashing
    is lazy, at a function's first launch. So the same kernel got two cache keys, depending on
    which kernels a process had launched before. Measured (``dp --pt train`` of DPA-3 water,
    cold cache): the compile process made a kernel without the ``_META_*`` constants of
    ``_matrix_meta``; the training process had launched another kernel that calls ``_matrix_meta``
    first, missed the cache, and compiled the kernel again in the training loop (a step of
    0.35 s). Importing :mod:`deepmd_hybridmuon.kernels` calls this, so every process hashes
    everything in the same way before its first launch.
    """
    done: set[int] = set()

    def settle(fn: Any) -> None:
        if id(fn) in done:
            return
        done.add(id(fn))
        for name in fn.fn.__code__.co_names:  # the globals (and attributes) the function names
            value = fn.fn.__globals__.get(name)
            if isinstance(value, triton.runtime.JITFunction):
                settle(value)
        fn.cache_key  # noqa: B018  (computed and kept by Triton)

    for fn in JITTED:
        if isinstance(fn, triton.runtime.JITFunction):  # not under the interpreter
            settle(fn)


def kernel(*aligned: str) -> Callable[[Callable[..., None]], Any]:
    """``triton.jit`` for a kernel launched from the host, compiled for its argument types only.

    Triton specialises a launch on the values of its arguments: a pointer 16-byte aligned or
    not, an integer equal to 1 or divisible by 16. The engine's pointers into its flat buffers
    are views at offsets and its integers are counts, so those properties differ from one model
    to the next and from the compile process's example arguments; every difference is a variant
    compiled again, seconds each, in the training process (measured: BENCHMARKS.md, cold
    start). So no argument is specialised on its value, except the pointers named in
    ``aligned``: workspaces and tables that every caller allocates as tensors of their own
    (never views at an offset), hence always 16-byte aligned, as the compile process's example
    tensors are. Their alignment is what lets Triton load the tiles of the tensor-core products
    as vectors (without it the phased kernel, since removed, took three times as long on one H100,
    BENCHMARKS.md). A variant is then fixed by the argument dtypes, the constexprs, these alignments
    and the compile options, all of which the compile process reproduces (:mod:`.compile`).
    """

    def jit(fn: Callable[..., None]) -> Any:
        values = [name for name, p in inspect.signature(fn).parameters.items() if "constexpr" not in str(p.annotation)]
        unknown = set(aligned) - set(values)
        if unknown:
            raise TypeError(f"{fn.__name__}: aligned names {sorted(unknown)} are not arguments of the kernel")
        # A pointer's value specialisation is its alignment: the aligned ones keep it.
        loose = [name for name in values if name not in aligned]
        ALIGNED[fn.__name__] = tuple(aligned)
        jitted = triton.jit(fn, do_not_specialize=loose, do_not_specialize_on_alignment=loose)
        JITTED.append(jitted)
        return jitted

    return jit


class Launch:
    """One kernel launch, declared once by argument types: what fixes its binary, and how it is made.

    ``args``: a ``torch.dtype`` for each pointer argument (a tensor), a Python ``int`` or
    ``float`` for each scalar (only its type counts: :func:`kernel`); ``options``: the
    constexprs and compile options. Each launcher makes its launches through these objects
    (:meth:`__call__`), and the compile process warms the same objects up
    (:meth:`warm_up`, ``compile._launches``), so what is compiled is what is launched.
    """

    __slots__ = ("args", "kernel", "kwargs", "options")

    def __init__(self, kernel: Any, *args: Any, **options: Any) -> None:
        self.kernel = kernel
        self.args = args
        self.options = tuple(sorted(options.items()))
        self.kwargs = dict(self.options)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Launch) and (self.kernel, self.args, self.options) == (
            other.kernel,
            other.args,
            other.options,
        )

    def __hash__(self) -> int:
        return hash((self.kernel.fn.__name__, self.args, self.options))

    def __repr__(self) -> str:
        return f"Launch({self.describe()})"

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        """Launch the kernel on ``grid`` with ``args`` (of the declared types)."""
        self.kernel[grid](*args, **self.kwargs)

    def describe(self) -> str:
        """Everything that fixes the compiled binary, as text (the compile ledger hashes it)."""
        args = [str(a) if isinstance(a, torch.dtype) else type(a).__name__ for a in self.args]
        return f"{self.kernel.fn.__name__}({', '.join(args)}; {list(self.options)!r})"

    def warm_up(self, device: torch.device) -> None:
        """Compile (or load from Triton's disk cache) this launch's binary and its host launcher."""
        args = [torch.zeros(16, dtype=a, device=device) if isinstance(a, torch.dtype) else a for a in self.args]
        compiled = self.kernel.warmup(*args, **self.kwargs, grid=(1,))
        if compiled is not None and device.type == "cuda":
            compiled.run  # noqa: B018  (loads the binary and builds or loads the launcher, as a first launch would)


def work_dtype(use_gram: bool) -> torch.dtype:
    """Workspace dtype of the Gram (:data:`GRAM_WORK_DTYPE`) or standard iteration."""
    return GRAM_WORK_DTYPE if use_gram else STANDARD_WORK_DTYPE


def coefficient_table(use_gram: bool, device: torch.device) -> torch.Tensor:
    """The (a, b, c) of every iteration, one row each, as a float32 device tensor.

    ``functional.gram_schedule().coeffs`` or ``functional.standard_schedule()``; the kernels
    take their iteration count from it too (its rows, or :func:`gram_constants`).
    """
    rows = F.gram_schedule().coeffs if use_gram else F.standard_schedule()
    return torch.tensor(rows, dtype=torch.float32, device=device)


def gram_constants() -> dict[str, tuple[int, ...]]:
    """The Gram schedule's per-iteration flags (0 or 1), as the kernels take them (compile-time tuples).

    ``RESTARTS``: X and R are re-formed before the iteration; ``FRESH_Q``: the transform
    starts afresh there; ``UPDATES_R``: R is carried forward after it. Their length is the
    number of iterations. All three from :func:`deepmd_hybridmuon.functional.gram_schedule`.
    """
    return dict(_gram_constants(F.gram_schedule()))


@functools.cache
def _gram_constants(schedule: F.GramSchedule) -> tuple[tuple[str, tuple[int, ...]], ...]:
    flags = {"RESTARTS": schedule.restarts, "FRESH_Q": schedule.fresh_q, "UPDATES_R": schedule.updates_r}
    return tuple((name, tuple(int(f) for f in values)) for name, values in flags.items())


def resident(rows: int, cols: int) -> bool:
    """Whether a matrix (smaller side ``rows``, larger ``cols``) stays in registers."""
    return _block(rows) * _block(cols) <= RESIDENT_ELEMENTS


def _block(size: int) -> int:
    return max(16, triton.next_power_of_2(size))


def _warps(bm: int) -> int:
    """Warps per program: 8 for 128 x 128 tiles (64 float32 registers per thread), else 4."""
    return 8 if bm >= 128 else 4


@helper
def _load_chunk(base, rows, cols, m, n, s_r, s_c):
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    return tl.load(base + rows[:, None] * s_r + cols[None, :] * s_c, mask=mask, other=0.0)


@helper
def _store_chunk(base, value, rows, cols, m, n, s_r, s_c):
    mask = (rows < m)[:, None] & (cols < n)[None, :]
    tl.store(base + rows[:, None] * s_r + cols[None, :] * s_c, value, mask=mask)


@helper
def _matrix_meta(meta_ptr, i):
    """Row ``i`` of the metadata table (:class:`MetaColumn`): src, work, m, n, row and column stride, block."""
    meta = meta_ptr + i * _META_COLS
    return (
        tl.load(meta + _META_SRC),
        tl.load(meta + _META_WORK),
        tl.load(meta + _META_M),
        tl.load(meta + _META_N),
        tl.load(meta + _META_ROW_STRIDE),
        tl.load(meta + _META_COL_STRIDE),
        tl.load(meta + _META_BLOCK),
    )


@helper
def _pow2_downscale(amax):
    """The power of two 2^-e (float32) that brings a block whose largest magnitude is ``amax`` below 2.

    The kernels' ``functional.pow2_downscale``: e = max(0, floor(log2(amax))), read from the
    exponent bits of the float32 ``amax`` (exact, no logarithm), so 1 for blocks below 2 (their
    products keep their bits) and for zero. ``e`` stops at 126, where 2^-e is float32's smallest
    normal power: a block at or above ``functional.GRAD_LIMIT`` = 2^127 (whose step is skipped)
    lands below 4, still far from overflowing its sums of squares.
    """
    biased = (amax.to(tl.int32, bitcast=True) >> _F32_MANTISSA) & _F32_EXPONENT_MASK
    e = tl.minimum(tl.maximum(biased - _F32_BIAS, 0), _F32_BIAS - 1)
    # 2^-e has the biased exponent 127 - e (written -e + 127: under the interpreter a constexpr
    # minus a tensor stays a constexpr)
    return ((-e + _F32_BIAS) << _F32_MANTISSA).to(tl.float32, bitcast=True)


@helper
def _inverse_norm(sum_sq, eps, GRAM: tl.constexpr):
    """1 / ||G|| in ``sum_sq``'s dtype: with ``eps`` added (Gram reference) or as a floor (standard reference)."""
    norm = tl.sqrt(sum_sq)
    if GRAM:
        return 1.0 / (norm + eps)
    return 1.0 / tl.maximum(norm, eps)


@helper
def _scaled_inverse_norm(sum_sq, amax, eps, GRAM: tl.constexpr):
    """2^-e and 1 / ||G 2^-e|| (both float32) from G's float64 sum of squares and its largest magnitude.

    2^-e is :func:`_pow2_downscale` of ``amax``, and ``eps`` is scaled alike (``functional``'s
    references), so X0 = (G 2^-e) times the second is G / ||G||, in float32 arithmetic that cannot
    overflow and whose inverse stays a normal number for norms up to ``functional.GRAD_LIMIT``
    (1 / ||G|| itself is subnormal above ~1e38). The float64 sum of squares cannot overflow there
    (each square below 2^254) and its scaling by 2^-2e is exact; the norm and its inverse are then
    float32, as in the resident kernel: in float64, ``eps`` would move 1 / ||G|| of a matrix
    below 2 by a rounding that the same matrix times 2^e (where ``eps 2^-e`` vanishes) lacks.
    """
    down = _pow2_downscale(amax)
    d = down.to(tl.float64)
    return down, _inverse_norm((sum_sq * d * d).to(tl.float32), eps * down, GRAM)


@helper
def _quintic_polynomial(A, coef_ptr, k):
    """b A + c A^2 of iteration ``k`` (the ``a X`` term is added by the caller), in A's dtype."""
    b = tl.load(coef_ptr + 3 * k + 1)
    c = tl.load(coef_ptr + 3 * k + 2)
    return (c * tl.dot(A, A) + b * A.to(tl.float32)).to(A.dtype)


@helper
def _polar_express_step(R, Q, eye, coef_ptr, k: tl.constexpr, FRESH_Q: tl.constexpr, UPDATE_R: tl.constexpr):
    """Iteration ``k`` of the Gram form: Z = b R + c R^2, Q <- Q (a I + Z), R <- (a I + Z) R (a I + Z).

    Q starts afresh (Q = a I + Z) with ``FRESH_Q``; R is updated only with ``UPDATE_R`` (the
    flags of :func:`gram_constants`, as in ``functional.gram_newton_schulz``).
    """
    a = tl.load(coef_ptr + 3 * k)
    Z = _quintic_polynomial(R, coef_ptr, k)
    if FRESH_Q:
        Q = (Z.to(tl.float32) + a * eye).to(R.dtype)
    else:
        Q = tl.dot(Q, Z, a * Q.to(tl.float32)).to(R.dtype)
    if UPDATE_R:
        RP = tl.dot(R, Z, a * R.to(tl.float32)).to(R.dtype)
        R = tl.dot(Z, RP, a * RP.to(tl.float32)).to(R.dtype)
    return R, Q
