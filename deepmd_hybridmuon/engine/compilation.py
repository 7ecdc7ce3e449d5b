"""The engine's one contact with the Triton kernels' availability and compilation.

Everything the engine asks about the kernels module as a whole goes through here, so
that the way kernels are compiled (today :func:`deepmd_hybridmuon.kernels.prepare` and
:func:`~deepmd_hybridmuon.kernels.wait_ready`) can change in one place:

* :func:`triton_runs_on`: whether the kernels can run on a device at all;
* :func:`kernels`: the kernels module (imported on first use: it imports Triton);
* :func:`request`: ask for the variants a layout launches; returns an object with
  ``is_set()`` / ``wait(timeout)`` that is set once they are compiled, or ``None`` when
  one of them cannot be compiled (the engine then keeps the torch path).
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

__all__ = ["kernels", "request", "triton_runs_on"]

#: The kernels' bfloat16 tensor-core products need compute capability 8.0 (A100) or newer.
MIN_CAPABILITY = (8, 0)


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``.

    On CUDA (compute capability 8.0 or newer) when Triton is installed; on the CPU only under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the tests to run the kernels without a GPU).
    """
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
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


def request(device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool) -> Any:
    """Ask for the kernel variants of ``paths`` ((use_gram, rows, cols) per launch group).

    Returns an object with ``is_set()`` and ``wait(timeout)``, set once every variant is
    compiled (at once when they already are), or ``None`` when one cannot be compiled.
    """
    return kernels().prepare(device, dtype, paths, magma)
