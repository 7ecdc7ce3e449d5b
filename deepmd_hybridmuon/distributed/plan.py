"""Who orthogonalises what: the plan (metadata only, the same on every rank), owned layouts, collectives.

Every collective of the FSDP2 step (:mod:`.fsdp`) goes through
:func:`_collective`, which :func:`trace_collectives` records (the tests compare the sequences
of all ranks). Outside it: the optimizer's all-reduce of the finite gate
(``nonfinite_across_ranks``, once per ``step()``), and DTensor's own redistributions of a
gradient or a loaded state tensor laid out otherwise than its parameter (``dtensor.laid_out_like``),
which happen alike on every rank.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import functional as F
from ..engine.execution import between_graphs

# ----------------------------------------------------------------------------- collectives

#: The record of the innermost :func:`trace_collectives` (per thread and task), or ``None``.
_TRACE: contextvars.ContextVar[list[tuple[str, tuple[int, ...]]] | None] = contextvars.ContextVar(
    "deepmd_hybridmuon_collective_trace", default=None
)


@contextlib.contextmanager
def trace_collectives() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Record the collectives this module issues: ``(kind, sizes)`` per call, in order."""
    record: list[tuple[str, tuple[int, ...]]] = []
    token = _TRACE.set(record)
    try:
        yield record
    finally:
        _TRACE.reset(token)


def _collective(kind: str, sizes: tuple[int, ...], fn: Any, *args: Any, **kwargs: Any) -> None:
    """Call the collective ``fn``; the single door every collective of the distributed steps goes through.

    Captured in a step's CUDA graphs, it runs between them at every replay (``engine.execution.between_graphs``).
    """

    def call() -> None:
        record = _TRACE.get()
        if record is not None:
            record.append((kind, sizes))
        fn(*args, **kwargs)

    between_graphs(call)


# ----------------------------------------------------------------------------- plan


def chunk_rows(rows: int, world: int) -> tuple[tuple[int, int], ...]:
    """Row range ``[start, stop)`` of dim 0 held by each of ``world`` ranks (``torch.chunk`` semantics).

    ``torch.chunk`` cuts ``ceil(rows / world)`` rows per chunk, so trailing ranks may hold
    fewer rows or none (FSDP2 pads them; the local tensor is the unpadded part).
    """
    size = -(-rows // world) if rows > 0 else 0
    return tuple((min(r * size, rows), min((r + 1) * size, rows)) for r in range(world))


@dataclass(frozen=True)
class ParamLayout:
    """One parameter of a group as the plan sees it: metadata only, the same on every rank.

    Attributes
    ----------
    index
        Position in ``group["params"]``.
    shape
        Global shape.
    route
        ``"muon"``, ``"adam"`` or ``"adamw"`` (:func:`deepmd_hybridmuon.functional.route_parameter`).
    view
        ``(batch, rows, cols)`` for Muon, else ``None``.
    ranges
        Dim-0 row range of every rank's shard (:func:`chunk_rows`).
    """

    index: int
    shape: tuple[int, ...]
    route: str
    view: tuple[int, int, int] | None
    ranges: tuple[tuple[int, int], ...]

    @property
    def inner(self) -> int:
        """Elements per row of dim 0."""
        return math.prod(self.shape[1:])


@dataclass(frozen=True)
class Plan:
    """Who orthogonalises what: a pure function of metadata, identical on every rank.

    Attributes
    ----------
    world
        Ranks along the sharded mesh dimension.
    params
        The active parameters of the group (a gradient, at least one element), in group order.
    owners
        For each Muon parameter of ``params`` (in order), the owner rank of each of its matrices.
    load
        Newton–Schulz cost assigned to each rank (see :func:`ns_cost`).
    """

    world: int
    params: tuple[ParamLayout, ...]
    owners: tuple[tuple[int, ...], ...]
    load: tuple[int, ...]

    @property
    def muon(self) -> tuple[ParamLayout, ...]:
        """The Muon-routed parameters, in group order."""
        return tuple(p for p in self.params if p.route == "muon")


def ns_cost(rows: int, cols: int, use_gram: bool = False) -> int:
    """Newton–Schulz cost of one matrix: its schedule's iterations x ``rows * cols * min(rows, cols)``.

    The products' flops, up to a constant: the standard schedule has ten iterations, the Gram schedule
    (:func:`functional.takes_gram`, with ``use_gram``) five.
    """
    gram = F.takes_gram(rows, cols, use_gram)
    return len(F.gram_schedule().coeffs if gram else F.standard_schedule()) * rows * cols * min(rows, cols)


def build_plan(
    entries: Sequence[tuple[int, tuple[int, ...], F.ParamRoute]], world: int, use_gram: bool = False
) -> Plan:
    """The plan of a group from ``(index, global shape, route)`` of its active parameters, and ``enable_gram``.

    Owners: matrices sorted by decreasing :func:`ns_cost` (ties: parameter order, then
    matrix index), each given to the least loaded rank (ties: the lowest rank). Greedy
    longest-first is within 4/3 of the best balance, and deterministic.
    """
    if world < 1:
        raise ValueError(f"Invalid world size: {world!r}; expected >= 1")
    params = tuple(
        ParamLayout(index, tuple(shape), route.route, route.view, chunk_rows(shape[0] if shape else 1, world))
        for index, shape, route in entries
    )
    matrices = []
    for k, p in enumerate(q for q in params if q.route == "muon"):
        assert p.view is not None
        bs, rows, cols = p.view
        matrices.extend((-ns_cost(rows, cols, use_gram), k, j) for j in range(bs))
    matrices.sort()
    load = [0] * world
    owner: dict[tuple[int, int], int] = {}
    for neg_cost, k, j in matrices:
        rank = min(range(world), key=lambda r: (load[r], r))
        load[rank] -= neg_cost
        owner[(k, j)] = rank
    owners = tuple(
        tuple(owner[(k, j)] for j in range(p.view[0]))  # type: ignore[index]
        for k, p in enumerate(q for q in params if q.route == "muon")
    )
    return Plan(world, params, owners, tuple(load))


# ----------------------------------------------------------------------------- owned matrices


@dataclass(frozen=True)
class _ShapeGroup:
    """Owned matrices of one shape: a contiguous slab of the owner's buffer."""

    rows: int
    cols: int
    start: int  # first element in the owned buffer
    count: int  # matrices
    matrix_ids: torch.Tensor  # global matrix indices (for the Magma factors)


def _matrix_base(plan: Plan) -> list[int]:
    """Global index of the first matrix of each Muon parameter of ``plan`` (matrices numbered in plan order)."""
    base, out = 0, []
    for p in plan.muon:
        out.append(base)
        base += p.view[0]  # type: ignore[index]
    return out


def _owned(plan: Plan, rank: int, device: torch.device) -> tuple[list[_ShapeGroup], dict[tuple[int, int], int], int]:
    """The matrices ``rank`` owns as laid out in its owned buffer: by shape (first appearance), then plan order.

    Returns the shape groups, the buffer offset of each owned matrix ``(k, j)`` (``k``: Muon
    parameter of the plan, ``j``: matrix of its view) and the buffer's length.
    """
    muon, matrix_base = plan.muon, _matrix_base(plan)
    shapes: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for k, p in enumerate(muon):
        _, rows, cols = p.view  # type: ignore[misc]
        for j in range(p.view[0]):  # type: ignore[index]
            if plan.owners[k][j] == rank:
                shapes.setdefault((rows, cols), []).append((k, j))
    start_of: dict[tuple[int, int], int] = {}
    groups: list[_ShapeGroup] = []
    cursor = 0
    for (rows, cols), mats in shapes.items():
        first = cursor
        for kj in mats:
            start_of[kj] = cursor
            cursor += rows * cols
        ids = torch.tensor([matrix_base[k] + j for k, j in mats], dtype=torch.long, device=device)
        groups.append(_ShapeGroup(rows, cols, first, len(mats), ids))
    return groups, start_of, cursor


def _cat_index(parts: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)).to(device)
