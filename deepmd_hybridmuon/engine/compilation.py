"""The engine's one contact with the Triton kernels' availability and compilation.

Everything the engine asks about the kernels module as a whole goes through here, so
that the way kernels are compiled (today :func:`deepmd_hybridmuon.kernels.prepare` and
:func:`~deepmd_hybridmuon.kernels.wait_ready`) can change in one place:

* :func:`triton_runs_on`: whether the kernels can run on a device at all;
* :func:`kernels`: the kernels module (imported on first use: it imports Triton);
* :func:`prepare_device`: when the optimizer is built, start Triton's set-up off the training thread;
* :func:`request`: ask for the variants a layout launches; returns an object with
  ``is_set()`` / ``wait(timeout)`` that is set once they are compiled, or ``None`` when
  one of them cannot be compiled (the engine then keeps the torch path).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

#: The kernels' bfloat16 tensor-core products need compute capability 8.0 (A100) or newer.
MIN_CAPABILITY = (8, 0)


#: Whether the Triton kernels may run on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``).
#: Off: a user who sets the variable to debug other kernels trains on the torch path, since the
#: interpreter needs workarounds that only the tests install (``tests/conftest.py``), which turn this on.
INTERPRETER_ON_CPU = False


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``.

    On CUDA (compute capability 8.0 or newer) when Triton is installed; on the CPU only under Triton's
    interpreter with :data:`INTERPRETER_ON_CPU` on (the tests' way to run the kernels without a GPU).
    """
    if device.type == "cpu" and not (INTERPRETER_ON_CPU and os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < MIN_CAPABILITY:
        return False
    try:
        kernels()
    except ImportError:
        return False
    return True


def kernels() -> ModuleType:
    """The Triton kernels module (imports Triton: call it only when the kernels may run)."""
    from .. import kernels as module

    return module


def request(device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]]) -> Any:
    """Ask for the kernel variants of ``paths`` ((use_gram, rows, cols) per launch group).

    Returns an object with ``is_set()`` and ``wait(timeout)``, set once every variant is
    compiled (at once when they already are), or ``None`` when one cannot be compiled.
    """
    return kernels().prepare(device, dtype, paths)


def prepare_device(device: torch.device, flash_muon: bool) -> None:
    """Start, off the training thread, the Triton set-up that a first step on ``device`` would otherwise wait for.

    The optimizer calls it when it is built: with ``flash_muon``, where the Triton kernels run, they are imported
    (and hashed) here, and Triton's one-time set-up of the process runs in a thread of its own
    (:meth:`~deepmd_hybridmuon.kernels.KernelRegistry.set_up`) while deepmd starts its first forward and backward
    pass. (cuBLAS's half-precision kernels load at the first step: 0.12 s per dtype on an H200, once per run. A
    thread that loaded them earlier kept a cuBLAS workspace of its own, 32 MiB for the whole run: BENCHMARKS.md.)
    """
    if device.type == "cuda" and flash_muon and triton_runs_on(device):
        kernels().set_up(device)
