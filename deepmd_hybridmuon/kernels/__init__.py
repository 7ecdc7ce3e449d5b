"""Triton kernels of the flat engine: Newton–Schulz, one program per matrix.

The batched engine (:mod:`deepmd_hybridmuon.engine`) uses this package when ``flash_muon`` is on and Triton can run
(CUDA, or Triton's CPU interpreter under ``TRITON_INTERPRET=1``). The per-tensor loop
(:mod:`deepmd_hybridmuon.loop`) and the functions of :mod:`deepmd_hybridmuon.functional` stay the
specification; these kernels compute the same functions (``newton_schulz``,
``gram_newton_schulz``) in one
launch per shape group, and read every schedule and constant from ``functional``: the coefficient rows
as a device table (:func:`coefficient_table`), the Gram restarts as compile-time flags
(:func:`gram_constants`).

Architecture, one module per kernel family:

* :mod:`.common`: sizes, workspace dtypes, the per-matrix metadata table
  (:class:`MetaColumn`), the schedule as kernel input, Triton helpers (loads, the
  polynomial, one Gram iteration); ``functional.on_triton`` decides which matrices take them.
* :mod:`.newton_schulz`: one program per matrix, smaller side up to :data:`MAX_ROWS`
  (:func:`orthogonalize_blocks`); ``X`` in registers or streamed through a workspace.
* :mod:`.compile`: compilation of the variants in a child process, tracked by one
  :class:`KernelRegistry` (:data:`registry`; :func:`prepare`, :func:`wait_ready`), whose
  :class:`~.compile.Ledger` lists the variants already in Triton's disk cache (they load at once).

Precision follows the reference functions: bfloat16 operands with float32 accumulation
for the standard iteration, float16 for the Gram iteration, normalisation in float32 after an
exact power-of-two scaling (``functional.pow2_downscale``; sums of squares in float64 where
they are taken over global memory), so that it is scale-invariant up to
``functional.GRAD_LIMIT``. The summation order of the products differs from cuBLAS, so
results agree with the torch path to rounding.

Settings live in the module that reads them, and are changed there: the workspace dtypes
``common.STANDARD_WORK_DTYPE`` / ``common.GRAM_WORK_DTYPE`` (the tests use float16 under
Triton's interpreter) and the process-wide ``compile.registry``.
"""

from __future__ import annotations

from . import common, compile  # the modules holding the settings (module docstring)
from .common import (
    MAX_ROWS,
    META_COLS,
    MetaColumn,
    coefficient_table,
    gram_constants,
    resident,
    work_dtype,
)
from .compile import KernelRegistry, prepare, set_up, wait_ready
from .newton_schulz import orthogonalize_blocks

common.settle_hashes()  # the same cache keys in every process (common.settle_hashes)

__all__ = [
    "MAX_ROWS",
    "META_COLS",
    "KernelRegistry",
    "MetaColumn",
    "coefficient_table",
    "common",
    "compile",
    "gram_constants",
    "orthogonalize_blocks",
    "prepare",
    "resident",
    "set_up",
    "wait_ready",
    "work_dtype",
]
