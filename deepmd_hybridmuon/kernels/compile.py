"""Compilation of the kernel variants off the training thread: :func:`prepare`, :func:`wait_ready`.

(The section of the former ``kernels.py`` moved here unchanged, except that ``_compile``
warms up the panel kernels' launches of :func:`~deepmd_hybridmuon.kernels.panel.panel_launches`.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from .. import functional as F
from .common import MAX_ROWS, _warps, resident, work_dtype
from .magma import _MAGMA_OPTIONS, _magma_finish_kernel, _magma_partial_kernel
from .newton_schulz import _newton_schulz_kernel, _ns_options
from .panel import (
    PANEL,
    _panel_apply_kernel,
    _panel_gram_kernel,
    _panel_reduce_kernel,
    panel_block,
    panel_launches,
)
from .phased import _phased_kernel, _phased_options, padded, phase_count
from .spans import _SPAN_OPTIONS, _apply_kernel, _gather_kernel, _momentum_kernel

log = logging.getLogger("deepmd.hybridmuon")

# ---------------------------------------------------------------------------
# Compilation off the training thread
# ---------------------------------------------------------------------------
#
# Triton compiles a kernel variant the first time it is launched (about 2 s each) and
# caches it on disk. So that a first run does not wait ~10 s in its first step, the engine
# asks :func:`prepare` for the variants it needs; missing ones compile in a background
# thread while the engine steps with the torch path, and the engine switches to the
# kernels when they are ready (flat.py). Compiling with example tensors of the same dtypes
# gives the same variants as the real launches: integer arguments are not specialised on.

#: Compile in a background thread (tests switch this off to get the kernels at once).
BACKGROUND_COMPILE: bool = True
_ready: set[tuple[Any, ...]] = set()
_failed: set[tuple[Any, ...]] = set()
_pending: list[threading.Event] = []
_lock = threading.Lock()


def prepare(
    device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool
) -> threading.Event | None:
    """Compile the variants for ``paths`` ((use_gram, rows, cols) per launch), the address-table kernels and Magma.

    Returns an event that is set once they are compiled: at once when they already
    are, or when :data:`BACKGROUND_COMPILE` is off (they compile before returning);
    ``None`` when a variant failed to compile earlier in this process (the engine then
    keeps the torch path; the failure was logged once).
    """
    keys = {(*_launch_key(g, r, c), device.index, dtype) for g, r, c in paths}
    keys.add(("spans", device.index, dtype))
    if magma:
        keys.add(("magma", device.index, dtype))
    event = threading.Event()
    with _lock:
        if keys & _failed:
            return None
        missing = keys - _ready
    if not missing or device.type != "cuda":  # nothing to do; the interpreter does not compile
        event.set()
        return event

    def work() -> None:
        try:
            for key in sorted(missing, key=repr):
                try:
                    _compile(key, device)
                except Exception as err:  # a GPU or Triton without support for a kernel
                    with _lock:
                        _failed.add(key)
                    log.warning("Triton kernel %s did not compile (%s); torch kernels instead", key[:-2], err)
                    return
                with _lock:
                    _ready.add(key)
        finally:
            event.set()

    if BACKGROUND_COMPILE:
        with _lock:
            _pending[:] = [e for e in _pending if not e.is_set()] + [event]
        threading.Thread(target=work, name="hybridmuon-triton-compile", daemon=True).start()
        return event
    work()
    with _lock:
        return None if keys & _failed else event


def wait_ready(timeout: float | None = None) -> bool:
    """Wait for background compilations started by :func:`prepare`; ``False`` on timeout."""
    with _lock:
        pending = list(_pending)
    return all(event.wait(timeout) for event in pending)


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
        for reduce, apply in panel_launches():  # one (reduce, apply) pair per segment of the Gram schedule
            _panel_reduce_kernel.warmup(i64, f32, f16, f32, f32, F.NS_EPS, BM=bm, **reduce, num_warps=warps, grid=(1,))
            args = (vec, f16, vec, i64, i64, f16, f32, f32, f32)
            _panel_apply_kernel.warmup(*args, BM=bm, BN=PANEL, **apply, num_warps=warps, grid=(1,))
    else:
        options = dict(key[1])
        work = torch.zeros(16, dtype=work_dtype(options["GRAM"]), device=device)
        _newton_schulz_kernel.warmup(vec, vec, work, i64, f32, f32, 2, F.NS_EPS, **options, grid=(1,))
