"""Triton kernels of the flat engine: Newton–Schulz and Magma in a few launches per step.

The batched engine (:mod:`deepmd_hybridmuon.engine`) uses this package when ``flash_muon`` is on and Triton can run
(CUDA, or Triton's CPU interpreter under ``TRITON_INTERPRET=1``). The per-tensor loop in
``optimizer.py`` and the functions of :mod:`deepmd_hybridmuon.functional` stay the
specification; these kernels compute the same functions (``newton_schulz``,
``gram_newton_schulz``, ``magma_score``/``magma_scale_``, ``nesterov_momentum_``) in fewer
launches, and read every schedule and constant from ``functional``: the coefficient rows
as a device table (:func:`coefficient_table`), the Gram restarts as compile-time flags
(:func:`gram_constants`, :func:`panel_launches`, :func:`phased_schedule`).

Architecture, one module per kernel family:

* :mod:`.common`: sizes, workspace dtypes, the per-matrix metadata table
  (:class:`MetaColumn`), the schedule as kernel input, Triton helpers shared by the
  Newton–Schulz families (loads, the polynomial, one Gram iteration).
* :mod:`.newton_schulz`: one program per matrix, smaller side up to :data:`MAX_ROWS`
  (:func:`orthogonalize_blocks`); ``X`` in registers or streamed through a workspace.
* :mod:`.panel`: the Gram iteration of long matrices in column panels
  (:func:`orthogonalize_panels`, one reduce and one apply launch per schedule segment).
* :mod:`.phased`: smaller side up to :data:`MAX_PHASED_ROWS`: the iteration as a
  schedule of tiled products run by one persistent launch with grid barriers
  (:func:`orthogonalize_phased`).
* :mod:`.magma`: per-block Magma factors in two launches (:func:`magma_factors`).
* :mod:`.spans`: gradients into the flat buffer, the momentum pass and the parameter
  update over tables of tensor addresses (:func:`gather`, :func:`momentum_update`,
  :func:`apply_updates`).
* :mod:`.compile`: compilation of the variants in a child process, tracked by one
  :class:`KernelRegistry` (:data:`registry`; :func:`prepare`, :func:`wait_ready`), whose
  :class:`~.compile.Ledger` lists the variants already in Triton's disk cache (they load at once).

Precision follows the reference functions: bfloat16 operands with float32 accumulation
for the standard iteration, float16 for the Gram iteration, normalisation in float32. The
summation order of the products differs from cuBLAS, so results agree with the torch path
to rounding.

Settings that tests and callers assign on this package (``STANDARD_WORK_DTYPE``,
``GRAM_WORK_DTYPE``, the process-wide ``registry`` and ``_compile``) live in the module that
reads them; reading or assigning them here reads or assigns them there.
"""

from __future__ import annotations

import sys
import types

from . import common, compile  # the modules of the settings below; every module is an attribute
from .common import (
    CHUNK,
    MAX_ROWS,
    META_COLS,
    RESIDENT_ELEMENTS,
    MetaColumn,
    coefficient_table,
    gram_constants,
    resident,
    work_dtype,
)
from .compile import KernelRegistry, compile_worker, prepare, wait_ready
from .magma import MAGMA_CHUNK, magma_chunks, magma_factors
from .newton_schulz import orthogonalize_blocks
from .panel import (
    PANEL,
    PANEL_COLS,
    PanelColumn,
    orthogonalize_panels,
    panel_block,
    panel_launches,
    panel_table,
    panelled,
)
from .phased import (
    DST,
    MAX_PHASED_ROWS,
    PHASE_COLS,
    PHASED_META_COLS,
    TILE,
    PhaseColumn,
    PhasedColumn,
    PhaseKind,
    orthogonalize_phased,
    padded,
    phase_count,
    phased_schedule,
    phased_square_slots,
    phased_tiles,
    phased_workspace,
)
from .spans import SPAN, SPAN_COLS, SpanColumn, apply_updates, gather, momentum_update, span_table

__all__ = [
    "CHUNK",
    "DST",
    "GRAM_WORK_DTYPE",
    "MAGMA_CHUNK",
    "MAX_PHASED_ROWS",
    "MAX_ROWS",
    "META_COLS",
    "PANEL",
    "PANEL_COLS",
    "PHASED_META_COLS",
    "PHASE_COLS",
    "RESIDENT_ELEMENTS",
    "SPAN",
    "SPAN_COLS",
    "STANDARD_WORK_DTYPE",
    "TILE",
    "KernelRegistry",
    "MetaColumn",
    "PanelColumn",
    "PhaseColumn",
    "PhaseKind",
    "PhasedColumn",
    "SpanColumn",
    "apply_updates",
    "coefficient_table",
    "compile_worker",
    "gather",
    "gram_constants",
    "magma_chunks",
    "magma_factors",
    "momentum_update",
    "orthogonalize_blocks",
    "orthogonalize_panels",
    "orthogonalize_phased",
    "padded",
    "panel_block",
    "panel_launches",
    "panel_table",
    "panelled",
    "phase_count",
    "phased_schedule",
    "phased_square_slots",
    "phased_tiles",
    "phased_workspace",
    "prepare",
    "registry",
    "resident",
    "span_table",
    "wait_ready",
    "work_dtype",
]

# Module-level settings, by the module that reads them (see the module docstring).
_SETTINGS: dict[str, types.ModuleType] = {
    "STANDARD_WORK_DTYPE": common,
    "GRAM_WORK_DTYPE": common,
    "registry": compile,
    "_compile": compile,
}


def _setting(owner: types.ModuleType, name: str) -> property:
    """``name`` of this package read from and assigned to ``owner`` (a data descriptor of the module type)."""
    return property(lambda _: getattr(owner, name), lambda _, value: setattr(owner, name, value))


def __dir__() -> list[str]:
    return sorted({*globals(), *_SETTINGS})


# The settings as properties of this module's type: they take precedence over the module's
# own namespace, for reads and assignments alike (monkeypatch restores them as any attribute).
sys.modules[__name__].__class__ = types.new_class(
    "_Package", (types.ModuleType,), {}, lambda ns: ns.update({k: _setting(m, k) for k, m in _SETTINGS.items()})
)
