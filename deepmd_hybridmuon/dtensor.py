"""Telling FSDP2's DTensors from plain tensors, without importing ``torch.distributed`` at import time.

Below both execution layers: the flat engine reads and writes a DTensor through its local shard
(:mod:`deepmd_hybridmuon.distributed` runs it on FSDP2's shards).
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


def laid_out_like(value: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``value`` laid out like the DTensor ``p`` (redistributed if its mesh or placements differ), else ``value``.

    FSDP2's gradients and the state it made are laid out like their parameters already; a DTensor laid out
    otherwise (a gradient or a loaded state tensor) moves, alike on every rank.
    """
    if is_dtensor(p) and is_dtensor(value) and (value.device_mesh, value.placements) != (p.device_mesh, p.placements):
        return value.redistribute(p.device_mesh, p.placements)
    return value
