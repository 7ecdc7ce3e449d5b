"""The FSDP2 step's work on a rank's shards beyond the engine's: the owners' scales and Newton–Schulz.

The elementwise work (Adam routes, Muon momentum, decay) is the flat engine's, on a layout of
the local shards (:class:`.fsdp.ShardedEngine`); Magma's per-matrix sums are taken over each
rank's pieces of the matrices (``functional.magma_segment_sums``) and completed across ranks; the
owners' Newton–Schulz runs the engine's Triton launches where they apply, else stacked by shape.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import functional as F
from ..engine import compilation
from ..engine.layout import assign, build_fused, run_fused
from .plan import _ShapeGroup


class OwnedScales:
    """Each owned matrix's Muon scale and Magma index, in owned-buffer order; made once per engine.

    :meth:`factors` gives every owned matrix's factor in one product (:func:`functional.muon_factor`), read by
    the owners' Triton launches and, group by group, by their torch path.
    """

    def __init__(self, groups: list[_ShapeGroup], settings: F.GroupSettings, device: torch.device) -> None:
        self.first = [sum(g.count for g in groups[:i]) for i in range(len(groups))]  # each group's first matrix
        none = torch.zeros(0, dtype=torch.float32, device=device)  # a rank may own no matrix
        scales = [none.new_full((g.count,), settings.scale(g.rows, g.cols)) for g in groups]
        self.scale = torch.cat([none, *scales])  # filled on the device: no copy from the host
        self.ids = torch.cat([none.long(), *(g.matrix_ids for g in groups)])

    def factors(self, damp: torch.Tensor | None, neg_lr: torch.Tensor) -> torch.Tensor:
        """Muon scale x Magma multiplier (``damp``, per plan matrix, or ``None``) x -lr, per owned matrix."""
        return F.muon_factor(self.scale, None if damp is None else damp[self.ids], neg_lr)


class OwnedKernels:
    """The engine's Triton launches for a rank's owned matrices, on the engine's paths.

    An owned buffer (:func:`.plan._owned`'s layout) is a flat vector of whole matrices grouped
    by shape, which is what the kernels read: the engine's own grouping
    (``engine.layout.assign``) gives each matrix its row of a path's metadata table (offset,
    sides, orientation, block), ``engine.layout.build_fused`` builds the tables, and each launch
    writes ``factor * O`` of its matrices straight into the output buffer: one program per matrix
    (``orthogonalize_blocks``) up to ``kernels.MAX_ROWS``. Larger matrices keep the torch path.
    Built by :func:`owned_kernels` once the launches are compiled.
    """

    def __init__(self, K: Any, first: list[int], fused: list[Any], device: torch.device) -> None:
        self.K, self.fused = K, fused
        for f in fused:
            build_fused(K, f, device)
        # A group (one shape) lies on one path: it is covered when its first block (matrix) is.
        taken = {row[int(K.MetaColumn.BLOCK)] for f in fused for row in f.meta}
        self.covered = {i for i, block in enumerate(first) if block in taken}  # indices of the groups done here

    def run(self, owned: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> set[int]:
        """The matrices the launches take, times ``factor`` (per owned matrix), into ``out``; the groups done."""
        for f in self.fused:
            run_fused(self.K, f, owned, out, factor)
        return self.covered


def owned_kernels(
    groups: list[_ShapeGroup],
    first: list[int],
    device: torch.device,
    dtype: torch.dtype,
    use_gram: bool,
    flash_muon: bool,
) -> tuple[OwnedKernels | None, Any]:
    """The owners' launches if compiled, and the compilation pending if not (``engine.compilation.request``).

    ``None, None`` where none apply: ``flash_muon`` off, no Triton on ``device``, no owned matrix the launches
    take, parameters whose matrices travel in a wider dtype (:func:`wire_dtype`), or a variant failed to compile.
    """
    if not (flash_muon and groups and wire_dtype(dtype) == dtype and compilation.triton_runs_on(device)):
        return None, None
    K = compilation.kernels()
    fused, _ = assign([(g.count, g.rows, g.cols) for g in groups], K, use_gram)
    ready = compilation.request(device, dtype, [(f.use_gram, f.rows, f.cols) for f in fused]) if fused else None
    if ready is None or not ready.is_set():
        return None, ready
    return OwnedKernels(K, first, fused, device), None


def kernels_summary(kernels: OwnedKernels | None, groups: list[_ShapeGroup], compiling: Any) -> dict[str, Any]:
    """The owners' part of an ``execution_table`` row: ``kernels`` and ``torch_matrices``.

    ``torch_matrices``: ``(rows, cols)`` of each owned shape the torch path orthogonalises on this rank.
    """
    state = "triton" if kernels is not None else ("compiling" if compiling is not None else "torch")
    done = kernels.covered if kernels is not None else set()
    return {"kernels": state, "torch_matrices": [(g.rows, g.cols) for i, g in enumerate(groups) if i not in done]}


def orthogonalize_owned(
    use_gram: bool,
    owned: torch.Tensor,
    groups: list[_ShapeGroup],
    factor: torch.Tensor,
    first: list[int],
    out: torch.Tensor,
    kernels: OwnedKernels | None = None,
) -> None:
    """The owned matrices' updates (``functional.post_orthogonalize`` by ``factor``, per owned matrix) into ``out``.

    ``owned`` and ``out`` are owned buffers (:func:`_owned`'s layout); ``out`` may be of a wider
    dtype; ``first``: each group's first matrix. The matrices ``kernels`` takes go through the Triton
    launches (:class:`OwnedKernels`); the others are stacked by shape (``groups``) and orthogonalised by
    :func:`functional.orthogonalize`.
    """
    done = kernels.run(owned, factor, out) if kernels is not None else set()
    for i, sg in enumerate(groups):
        if i in done:
            continue
        n, shape = sg.count * sg.rows * sg.cols, (sg.count, sg.rows, sg.cols)
        orth = F.orthogonalize(owned[sg.start : sg.start + n].view(shape), use_gram)
        F.post_orthogonalize(orth, factor[first[i] : first[i] + sg.count], out[sg.start : sg.start + n].view(shape))


def wire_dtype(work: torch.dtype) -> torch.dtype:
    """The dtype matrices travel in: it holds the update and every delta exactly (bfloat16/float16 -> float32)."""
    return F.compute_dtype(work)
