"""Telling FSDP2's DTensors from plain tensors, without importing ``torch.distributed`` at import time.

Below both execution layers: the flat engine declines DTensor groups, and
:mod:`deepmd_hybridmuon.distributed` steps them on their local shards.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def _dtensor_class() -> type | None:
    """``torch.distributed.tensor.DTensor``, imported on first use; ``None`` for a torch built without distributed."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None
    return DTensor


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2-sharded tensor)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage under ``no_grad``), else ``t``."""
    return t.to_local() if is_dtensor(t) else t
