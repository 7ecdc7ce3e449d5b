"""Several ranks: FSDP2 (deepmd's ``zero_stage`` 2 and 3) and DDP (``zero_stage`` 0) share the Newton–Schulz work.

FSDP2 (``fully_shard``): the owner computes
-------------------------------------------

Under FSDP2 every parameter, gradient and parameter-shaped state tensor is a DTensor
sharded on dim 0 with ``torch.chunk`` semantics (uneven; trailing ranks may hold empty
shards). This module runs the step of one param_group of such DTensors:

* **Elementwise work on the local shards**, batched over parameters: the Adam/AdamW
  routes, the Muon momentum and the decoupled weight decay are elementwise, so each
  rank applies the same :mod:`deepmd_hybridmuon.functional` rules to its shards,
  concatenated into one flat tensor per bucket (one kernel chain per bucket, not per
  parameter). Elementwise kernels give the same bits on a concatenation, so the Adam
  routes match one process bitwise.
* **Each Muon matrix is orthogonalised once, on its owner.** A :class:`Plan`, computed
  from metadata alone (parameter order, global shapes, routes and matrix views, mesh
  size), gives every matrix an owner rank, balancing Newton–Schulz cost; every rank
  computes the same plan. The local shards of the Nesterov update travel to the owners
  in one ``all_to_all_single`` with uneven splits; each owner reassembles its whole
  matrices, orthogonalises them stacked by shape (one ``functional.orthogonalize`` call
  per shape), scales them, and the update shards travel back in a second
  ``all_to_all_single``.
* **Magma** needs, per matrix, cos(m, g) over the whole matrix: each rank sums
  ``m·g``, ``m·m`` and ``g·g`` over its pieces of each matrix, and one ``all_reduce``
  (sum) gives every rank the whole-matrix sums. Every rank then updates every Magma
  score, so ``magma_score`` stays replicated: a plain float32 ``(batch,)`` tensor per
  Muon parameter, equal on every rank, as in one process (checkpoints are unchanged).
* **The finite gate** is one ``all_reduce`` (min) of the local flag per mesh dimension.

The collectives of one group's step are therefore a fixed sequence whatever the number
of parameters: gate all-reduce (one per mesh dimension), Magma all-reduce (when Magma is
on), all-to-all out, all-to-all back (when the group has Muon matrices: a property of
the plan, the same on every rank). None of them is skipped because of local data (no
owned matrix, an empty shard): such a rank sends and receives zero-length splits.

Supported layouts: a 1-D mesh with placements ``(Shard(0),)`` (``fully_shard``) and a
2-D HSDP mesh with ``(Replicate(), Shard(0))``; in the latter, gradients are equal
across replicas (FSDP2 all-reduces them), each replica group runs the exchange on the
shard dimension's process group and computes the same result, and the gate is reduced
over both dimensions. Anything else raises ``NotImplementedError``. Gradient presence
must be the same on every rank, as FSDP2's own reduce-scatter requires.

DDP (replicated parameters, the optimizer's ``ddp_split``)
---------------------------------------------------------
Every rank holds the same parameters and the same (all-reduced) gradients. With the split
(:func:`ddp_split_of` decides, :func:`ddp_step_group` steps): every rank does the elementwise
work on its whole tensors, as one process does (the inputs are identical, so no collective);
the same :class:`Plan` gives the owner of each Muon matrix; each rank orthogonalises the
matrices it owns (stacked by shape, as an FSDP2 owner), scales and damps them; one
``all_gather_into_tensor`` of the owned deltas (padded to the largest rank's owned size, in
the transport dtype) gives every rank every delta, and every rank applies them all. Each
delta is computed once and every rank applies the same bits: the replicas stay bitwise
identical. The finite gate is local (the gradients are the same on every rank). One
collective per group with Muon matrices and step, whatever the number of parameters. Under
``"auto"`` the split runs where it pays (:func:`split_pays`, a function of the plan).

The two steps share their elementwise work (:func:`_local_adam`, :func:`_local_muon`: local
tensors, which for a plain tensor are the tensor itself) and the owners' Newton–Schulz
(:func:`_orthogonalize_owned`).

Every collective goes through :func:`_collective`, which :func:`trace_collectives`
records (the tests compare the sequences of all ranks).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import functional as F

if TYPE_CHECKING:
    from .optimizer import HybridMuonOptimizer

__all__ = [
    "DDP_SPLIT_MIN_COST",
    "DDP_SPLIT_MODES",
    "DdpSplit",
    "ParamLayout",
    "Plan",
    "build_plan",
    "chunk_rows",
    "ddp_split_of",
    "ddp_step_group",
    "from_owners",
    "is_dtensor",
    "local_shard",
    "plan_of",
    "split_pays",
    "step_group",
    "to_owners",
    "trace_collectives",
]

# ----------------------------------------------------------------------------- collectives

_trace: list[tuple[str, tuple[int, ...]]] | None = None


@contextlib.contextmanager
def trace_collectives() -> Iterator[list[tuple[str, tuple[int, ...]]]]:
    """Record the collectives this module issues: ``(kind, sizes)`` per call, in order."""
    global _trace
    previous, _trace = _trace, []
    try:
        yield _trace
    finally:
        _trace = previous


def _collective(kind: str, sizes: tuple[int, ...], fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call the collective ``fn``; the single door every collective of this module goes through."""
    if _trace is not None:
        _trace.append((kind, sizes))
    return fn(*args, **kwargs)


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


def ns_cost(rows: int, cols: int) -> int:
    """Newton–Schulz cost of one matrix: ``rows * cols * min(rows, cols)`` (the products' flops, up to a constant)."""
    return rows * cols * min(rows, cols)


def build_plan(entries: Sequence[tuple[int, tuple[int, ...], F.ParamRoute]], world: int) -> Plan:
    """The plan of a group from ``(index, global shape, route)`` of its active parameters.

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
        matrices.extend((-ns_cost(rows, cols), k, j) for j in range(bs))
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


# ----------------------------------------------------------------------------- exchange


@dataclass(frozen=True)
class _ShapeGroup:
    """Owned matrices of one shape: a contiguous slab of the owner's buffer."""

    rows: int
    cols: int
    start: int  # first element in the owned buffer
    count: int  # matrices
    matrix_ids: torch.Tensor  # global matrix indices (for the Magma factors)


#: Elements per block of the first pass of :meth:`_Segments.sums`. torch's CUDA
#: ``segment_reduce`` gives each output one thread that walks its whole segment, so one
#: 1024 x 1024 matrix as one segment is a million serial additions (1.7 s per step for
#: eight 4096 x 4096 matrices on an H200, 2026-11-23); cut into blocks of this size the first
#: pass runs one thread per block, and the second pass adds one partial sum per block.
SEGMENT_BLOCK = 1024


class _Segments:
    """Where the matrices lie in a rank's flat Muon buffer, for Magma's per-matrix sums.

    The buffer is cut into consecutive segments of ``lengths`` elements (a list); segment
    ``i`` is (part of) matrix ``matrix[i]`` of the ``count`` matrices of the plan (numbered
    in plan order).
    """

    def __init__(self, lengths: list[int], matrix: list[int], count: int, device: torch.device) -> None:
        self.count = count
        self.matrix = torch.tensor(matrix, dtype=torch.long, device=device)
        blocks = [-(-n // SEGMENT_BLOCK) if n else 0 for n in lengths]
        fine = [min(SEGMENT_BLOCK, n - b * SEGMENT_BLOCK) for n in lengths for b in range(-(-n // SEGMENT_BLOCK))]
        self.fine = torch.tensor(fine, dtype=torch.long, device=device)
        self.coarse = torch.tensor(blocks, dtype=torch.long, device=device)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-matrix sums ``(count, k)`` of ``values`` ``(buffer elements, k)``, in two passes of blocks."""
        out = torch.zeros(self.count, values.shape[1], dtype=values.dtype, device=values.device)
        if self.fine.numel():
            partial = torch.segment_reduce(values, "sum", lengths=self.fine, axis=0)
            pieces = torch.segment_reduce(partial, "sum", lengths=self.coarse, axis=0)
            out.index_copy_(0, self.matrix, pieces)
        return out


class _Exchange:
    """One rank's side of a plan: index tensors of the two all-to-alls and the Magma sums.

    Local buffer: the local shards of the Muon parameters, flattened and concatenated in
    plan order (``lengths``). A rank's shard of a parameter covers a contiguous range of
    its flattened global tensor, hence a contiguous *piece* of each matrix it touches.
    The send buffer holds the pieces grouped by owner (ascending), in plan order within an
    owner; the owner receives them grouped by source rank, in the same order, and
    ``gather`` reassembles its matrices, grouped by shape.
    """

    def __init__(self, plan: Plan, rank: int, device: torch.device) -> None:
        world = plan.world
        muon = plan.muon
        # Pieces of every rank: (src, k, j, start in the matrix, length, offset in src's local buffer).
        pieces: list[list[tuple[int, int, int, int, int]]] = [[] for _ in range(world)]
        lengths: list[int] = []
        matrix_base = _matrix_base(plan)
        self.num_matrices = sum(p.view[0] for p in muon)  # type: ignore[index]
        for src in range(world):
            offset = 0
            for k, p in enumerate(muon):
                assert p.view is not None
                size = p.view[1] * p.view[2]
                lo, hi = (r * p.inner for r in p.ranges[src])
                if src == rank:
                    lengths.append(hi - lo)
                pos = lo
                while pos < hi:
                    j = pos // size
                    stop = min(hi, (j + 1) * size)
                    pieces[src].append((k, j, pos - j * size, stop - pos, offset + pos - lo))
                    pos = stop
                offset += hi - lo
        self.lengths = lengths
        self.local_numel = sum(lengths)

        # Send side: my pieces grouped by owner.
        mine = pieces[rank]
        by_owner = sorted(range(len(mine)), key=lambda i: (plan.owners[mine[i][0]][mine[i][1]], i))
        self.send_splits = [0] * world
        send_index = []
        for i in by_owner:
            k, j, _, n, off = mine[i]
            self.send_splits[plan.owners[k][j]] += n
            send_index.append(torch.arange(off, off + n))
        self.send_index = _cat_index(send_index, device)

        self.groups, start_of, self.owned_numel = _owned(plan, rank, device)

        # Receive side: pieces of every source owned here, in the senders' order.
        self.recv_splits = [0] * world
        place = []  # owned-buffer position of each received element
        for src in range(world):
            theirs = sorted(
                (i for i, pc in enumerate(pieces[src]) if plan.owners[pc[0]][pc[1]] == rank),
            )
            for i in theirs:
                k, j, at, n, _ = pieces[src][i]
                self.recv_splits[src] += n
                place.append(torch.arange(start_of[(k, j)] + at, start_of[(k, j)] + at + n))
        self.place = _cat_index(place, device)
        assert self.place.numel() == self.owned_numel
        self.gather = torch.empty_like(self.place)
        self.gather[self.place] = torch.arange(self.place.numel(), device=device)

        # Magma: my pieces as segments of the local buffer (in local order), and their matrices.
        self.segments = _Segments(
            [pc[3] for pc in mine], [matrix_base[pc[0]] + pc[1] for pc in mine], self.num_matrices, device
        )


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


# ----------------------------------------------------------------------------- transport


def to_owners(ex: _Exchange, local: torch.Tensor, pg: Any) -> torch.Tensor:
    """Send this rank's flat Muon buffer (plan order) to the owners; return the owned matrices.

    One ``all_to_all_single`` with uneven splits, called by every rank (zero-length splits
    for a rank without pieces or owned matrices). The result is the owned buffer: owned
    matrices grouped by shape (``ex.groups``), each whole, in row-major order.
    """
    import torch.distributed as dist

    send = local[ex.send_index]
    recv = torch.empty(ex.owned_numel, dtype=local.dtype, device=local.device)
    _collective(
        "all_to_all",
        (len(ex.send_splits),),
        dist.all_to_all_single,
        recv,
        send,
        output_split_sizes=ex.recv_splits,
        input_split_sizes=ex.send_splits,
        group=pg,
    )
    return recv[ex.gather]


def from_owners(ex: _Exchange, owned: torch.Tensor, pg: Any) -> torch.Tensor:
    """The inverse of :func:`to_owners`: each rank gets back its pieces of the owned buffers."""
    import torch.distributed as dist

    back = torch.empty(ex.local_numel, dtype=owned.dtype, device=owned.device)
    _collective(
        "all_to_all",
        (len(ex.send_splits),),
        dist.all_to_all_single,
        back,
        owned[ex.place],
        output_split_sizes=ex.send_splits,
        input_split_sizes=ex.recv_splits,
        group=pg,
    )
    local = torch.empty_like(back)
    local[ex.send_index] = back
    return local


# ----------------------------------------------------------------------------- mesh


def _mesh_of(params: list[torch.Tensor]) -> tuple[Any, int]:
    """The device mesh of a group's DTensor parameters and its sharded dimension.

    Raises ``NotImplementedError`` for layouts other than ``(Shard(0),)`` on a 1-D mesh
    and ``(Replicate(), Shard(0))`` on a 2-D one, and for groups mixing meshes or plain tensors.
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = None
    for i, p in enumerate(params):
        if not isinstance(p, DTensor):
            raise NotImplementedError(
                f"param_group mixes DTensor (FSDP2) and plain parameters (parameter {i}, shape "
                f"{tuple(p.shape)}); shard the whole model with fully_shard or put them in separate groups"
            )
        placements = tuple(p.placements)
        if placements == (Shard(0),):
            shard_dim = 0
        elif placements == (Replicate(), Shard(0)):
            shard_dim = 1
        else:
            raise NotImplementedError(
                f"FSDP2 placements {placements} of parameter {i} (shape {tuple(p.shape)}): HybridMuon supports "
                "(Shard(dim=0),) on a 1-D mesh and (Replicate(), Shard(dim=0)) on a 2-D HSDP mesh"
            )
        if mesh is None:
            mesh, dim = p.device_mesh, shard_dim
        elif p.device_mesh != mesh or shard_dim != dim:
            raise NotImplementedError(
                f"param_group spans several device meshes or placements (parameter {i}); "
                "HybridMuon needs one mesh per param_group under FSDP2"
            )
    assert mesh is not None
    return mesh, dim


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2-sharded tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage under ``no_grad``), else ``t``."""
    return t.to_local() if is_dtensor(t) else t


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated (no copy for a single contiguous tensor)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


def _write_back(targets: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``targets`` (the inverse of :func:`_flat`), one batched copy."""
    if len(targets) == 1 and targets[0].is_contiguous() and flat.data_ptr() == targets[0].data_ptr():
        return  # _flat returned a view: already written
    chunks = flat.split([t.numel() for t in targets])
    torch._foreach_copy_(targets, [c.view(t.shape) for c, t in zip(chunks, targets, strict=True)])


# ----------------------------------------------------------------------------- shared by FSDP2 and DDP
#
# These helpers work on local tensors: the shards of DTensor parameters (FSDP2), or the whole
# tensors of replicated parameters (DDP), for which ``local_shard(t)`` is ``t`` and
# ``opt._local_state`` the state tensor itself.


def _local_adam(
    opt: HybridMuonOptimizer,
    settings: F.GroupSettings,
    params: list[tuple[torch.Tensor, str]],
    grads: dict[int, torch.Tensor],
    ok: torch.Tensor,
) -> None:
    """The Adam and AdamW routes of ``params`` (``(parameter, route)``): elementwise, one flat chain per bucket.

    Elementwise kernels give the same bits on a concatenation, so this matches the loop bitwise.
    """
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for p, route in params:
        state = opt._advance_adam_state(p, settings)
        decay = settings.adam_decay(route)
        key = (p.dtype, p.device, grads[id(p)].dtype, state["beta1_pow"], state["beta2_pow"], decay)
        buckets.setdefault(key, []).append(p)
    for (_, _, _, beta1_pow, beta2_pow, decay), ps in buckets.items():
        locals_ = [local_shard(p) for p in ps]
        moments = [opt._local_state(p, "exp_avg") for p in ps], [opt._local_state(p, "exp_avg_sq") for p in ps]
        flat_p, flat_m, flat_v = _flat(locals_), _flat(moments[0]), _flat(moments[1])
        F.adam_update_(
            flat_p,
            _flat([local_shard(grads[id(p)]) for p in ps]),
            flat_m,
            flat_v,
            beta1=settings.beta1,
            beta2=settings.beta2,
            beta1_pow=beta1_pow,
            beta2_pow=beta2_pow,
            lr=settings.adam_lr,
            decay_factor=decay,
            ok=ok,
        )
        _write_back(locals_, flat_p)
        _write_back(moments[0], flat_m)
        _write_back(moments[1], flat_v)


def _local_muon(
    opt: HybridMuonOptimizer,
    settings: F.GroupSettings,
    plan: Plan,
    muon: list[torch.Tensor],
    grads: dict[int, torch.Tensor],
    ok: torch.Tensor,
    segments: _Segments,
    reduce: Callable[[torch.Tensor], Any] | None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Decay, momentum and Magma of the Muon parameters ``muon`` (plan order), on local tensors.

    ``reduce`` completes Magma's per-matrix sums in place (FSDP2: an all-reduce of the shards'
    partial sums); ``None`` when the local tensors hold whole matrices. Returns the local
    parameter tensors, their flat concatenation (decayed), the flat Nesterov update (in the
    momentum's dtype) and Magma's multiplier per matrix (``None`` without Magma).
    """
    lr, wd = settings.lr, settings.weight_decay
    dtypes = {grads[id(p)].dtype for p in muon} | {p.dtype for p in muon}
    if len({grads[id(p)].dtype for p in muon}) > 1 or len({p.dtype for p in muon}) > 1:
        raise NotImplementedError(
            f"Muon parameters of one param_group in several dtypes {sorted(map(str, dtypes))} under FSDP2 or "
            "ddp_split; HybridMuon needs one parameter dtype and one gradient dtype per group there"
        )
    for p in muon:
        state = opt.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(grads[id(p)])  # a DTensor for a DTensor p
    bufs = [opt._local_state(p, "momentum_buffer") for p in muon]
    work = bufs[0].dtype
    locals_ = [local_shard(p) for p in muon]
    flat_p = _flat(locals_)
    flat_buf = _flat(bufs)
    g = F.sanitize(_flat([local_shard(grads[id(p)]) for p in muon]).to(work), ok)
    if wd > 0:
        flat_p.mul_(F.gate_factor(1.0 - lr * wd, ok, flat_p.dtype))
    update = F.nesterov_momentum_(flat_buf, g, settings.momentum, ok)
    _write_back(bufs, flat_buf)
    if not settings.magma:
        return locals_, flat_p, update, None

    scores = []
    for layout, p in zip(plan.muon, muon, strict=True):
        state = opt.state[p]
        score = state.get("magma_score")
        if is_dtensor(score):
            score = state["magma_score"] = score.full_tensor()
        bs = layout.view[0]  # type: ignore[index]
        if score is None or tuple(score.shape) != (bs,) or score.device != flat_p.device:
            score = state["magma_score"] = torch.full(
                (bs,), F.MAGMA_INITIAL_SCORE, dtype=torch.float32, device=flat_p.device
            )
        scores.append(score)
    m32, g32 = flat_buf.to(torch.float32), g.to(torch.float32)
    products = torch.stack([m32 * g32, m32 * m32, g32 * g32], dim=1)  # (local elements, 3)
    sums = segments.sums(products)
    if reduce is not None:
        reduce(sums)
    flat_score = _flat(scores)
    damp = F.magma_scale_(flat_score, F.magma_score(sums[:, 0], sums[:, 1].sqrt(), sums[:, 2].sqrt()), ok)
    _write_back(scores, flat_score)
    return locals_, flat_p, update, damp


def _orthogonalize_owned(
    settings: F.GroupSettings,
    owned: torch.Tensor,
    groups: list[_ShapeGroup],
    damp: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """Newton–Schulz of the owned matrices, stacked by shape (``groups``), scaled and damped, into ``out``.

    ``owned`` and ``out`` are owned buffers (:func:`_owned`'s layout); ``out`` may be longer
    (padding, left as it is) and of a wider dtype.
    """
    for sg in groups:
        n = sg.count * sg.rows * sg.cols
        orth = F.orthogonalize(owned[sg.start : sg.start + n].view(sg.count, sg.rows, sg.cols), settings.use_gram)
        d = orth * settings.scale(sg.rows, sg.cols)
        if damp is not None:
            d = d * damp[sg.matrix_ids].view(sg.count, 1, 1).to(d.dtype)
        out[sg.start : sg.start + n].copy_(d.reshape(-1))


def _apply_delta(
    flat_p: torch.Tensor, locals_: list[torch.Tensor], delta: torch.Tensor, ok: torch.Tensor, lr: float
) -> None:
    """``p -= lr * delta`` (not when the gate ``ok`` is 0), then the parameters written back."""
    flat_p.addcmul_(delta, ok.to(flat_p.dtype) * -lr)
    _write_back(locals_, flat_p)


def _wire_dtype(work: torch.dtype) -> torch.dtype:
    """The dtype matrices travel in: it holds the update and every delta exactly (bfloat16/float16 -> float32)."""
    return torch.promote_types(work, torch.float32)


# ----------------------------------------------------------------------------- FSDP2 step


class _Cache:
    """A group's plan and exchange, rebuilt when the active parameters or routing change."""

    def __init__(self, key: tuple, plan: Plan, exchange: _Exchange) -> None:
        self.key, self.plan, self.exchange = key, plan, exchange


def plan_of(opt: HybridMuonOptimizer, index: int, group: dict[str, Any]) -> tuple[Plan, _Exchange, Any, int]:
    """The (cached) plan of param_group ``index``, this rank's exchange, the mesh and its sharded dimension."""
    params = [p for p in group["params"] if p.numel() > 0]
    mesh, dim = _mesh_of(params) if params else (None, 0)
    active = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None and p.numel() > 0]
    world = mesh.size(dim) if mesh is not None else 1
    rank = mesh.get_local_rank(dim) if mesh is not None else 0
    key = (tuple(id(p) for _, p in active), opt._names_version, group["muon_mode"], world, rank)
    caches: dict[int, _Cache] = opt.__dict__.setdefault("_fsdp_plans", {})
    cache = caches.get(index)
    if cache is None or cache.key != key:
        plan = build_plan([(i, tuple(p.shape), opt.route_of(p, group)) for i, p in active], world)
        for layout, (_, p) in zip(plan.params, active, strict=True):
            lo, hi = layout.ranges[rank]
            local = p.to_local()
            if p.dim() == 0 or tuple(local.shape) != (hi - lo, *layout.shape[1:]):
                raise NotImplementedError(
                    f"FSDP2 shard of parameter {opt.param_name(p) or layout.index} (shape {layout.shape}) has local "
                    f"shape {tuple(local.shape)} on shard rank {rank}; HybridMuon expects torch.chunk's rows "
                    f"{lo}..{hi} of dim 0"
                )
        device = torch.device(mesh.device_type) if mesh is not None else torch.device("cpu")
        cache = caches[index] = _Cache(key, plan, _Exchange(plan, rank, device))
    return cache.plan, cache.exchange, mesh, dim


def step_group(opt: HybridMuonOptimizer, index: int, group: dict[str, Any], shared: torch.Tensor | None = None) -> None:
    """One step of a param_group of FSDP2 DTensor parameters (see the module docstring).

    ``shared``: the finite flag already agreed across ranks (``nonfinite_across_ranks``),
    combined with this group's gate.
    """
    import torch.distributed as dist

    plan, ex, mesh, shard_dim = plan_of(opt, index, group)
    if mesh is None:
        return  # only size-0 parameters: nothing to shard, nothing to step
    device = torch.device(mesh.device_type)
    active = [group["params"][p.index] for p in plan.params]
    grads = {id(p): opt._grad_of(p) for p in active}

    # 1. The finite gate: one all-reduce (min) per mesh dimension, called on every rank.
    local_grads = [local_shard(g) for g in grads.values()]
    ok = F.finite_gate(local_grads).to(device) if local_grads else torch.ones((), dtype=torch.float32, device=device)
    if shared is not None:
        ok = torch.minimum(ok, shared.to(device))
    for d in range(mesh.ndim):
        _collective("all_reduce", (1,), dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=mesh.get_group(d))

    # 2. Adam and AdamW: elementwise on the local shards.
    settings = F.GroupSettings.of(group)
    routed = list(zip(active, (layout.route for layout in plan.params), strict=True))
    _local_adam(opt, settings, [(p, route) for p, route in routed if route != "muon"], grads, ok)

    # 3. Muon: momentum, decay and Magma on the shards; Newton–Schulz on the owners.
    muon = [group["params"][p.index] for p in plan.muon]
    if not muon:
        return
    pg = mesh.get_group(shard_dim)

    def reduce(sums: torch.Tensor) -> None:  # Magma: whole-matrix sums from the shards' partial sums
        _collective("all_reduce", (sums.numel(),), dist.all_reduce, sums, op=dist.ReduceOp.SUM, group=pg)

    locals_, flat_p, update, damp = _local_muon(opt, settings, plan, muon, grads, ok, ex.segments, reduce)
    work = update.dtype
    wire = _wire_dtype(work)
    owned = to_owners(ex, update.to(wire), pg).to(work)
    delta = torch.empty_like(owned, dtype=wire)
    _orthogonalize_owned(settings, owned, ex.groups, damp, delta)
    _apply_delta(flat_p, locals_, from_owners(ex, delta, pg), ok, settings.lr)


# ----------------------------------------------------------------------------- DDP step

#: Values of the optimizer's ``ddp_split`` keyword (see :func:`ddp_split_of`).
DDP_SPLIT_MODES: tuple[str, ...] = ("off", "auto", "always")

#: ``ddp_split="auto"`` splits a param_group when the Newton–Schulz work the split saves each
#: rank, ``sum(plan.load) - max(plan.load)`` in :func:`ns_cost` units, exceeds this. Source:
#: measured on 2×H200 by benchmarks/ddp_split.py; see BENCHMARKS.md. Until that measurement,
#: a first estimate: the split trades the flat engine (Triton kernels, one CUDA graph) for
#: eager torch kernels and an all-gather, about 1 ms more per step; Newton–Schulz runs
#: about 60 flops per cost unit (10 iterations) at some 100 TFLOP/s in bfloat16, so it must
#: save some 2e9 units (e.g. 8 matrices of 1024 × 1024 on 2 ranks save 4.3e9).
DDP_SPLIT_MIN_COST: int = 10**11


def split_pays(plan: Plan) -> bool:
    """Whether splitting Newton–Schulz over ``plan.world`` replicas beats computing it on every rank.

    A pure function of the plan (metadata, the same on every rank): the cost each rank saves,
    all the group's Newton–Schulz work less the largest rank's share, exceeds
    :data:`DDP_SPLIT_MIN_COST`.
    """
    saved = sum(plan.load) - max(plan.load, default=0)
    return plan.world > 1 and saved > DDP_SPLIT_MIN_COST


class DdpSplit:
    """One rank's side of the DDP split of a param_group: the plan, and where the deltas go.

    The Muon buffer is the flat concatenation of the group's whole Muon parameters in plan
    order (the same on every rank). This rank takes its owned matrices out of it
    (``owned_index``, laid out by :func:`_owned`), orthogonalises them into a buffer of
    ``pad`` elements (the largest rank's owned size; zeros after its own), and the
    all-gather puts every rank's buffer side by side: ``perm`` gives, for each element of
    the Muon buffer, its position in the gathered one.
    """

    def __init__(self, plan: Plan, rank: int, device: torch.device) -> None:
        self.plan, self.rank = plan, rank
        muon = plan.muon
        starts, total = [], 0
        for p in muon:
            starts.append(total)
            total += math.prod(p.view)  # type: ignore[arg-type]
        layouts = [_owned(plan, r, device) for r in range(plan.world)]
        self.groups, mine, self.owned_numel = layouts[rank]
        self.pad = max(numel for _, _, numel in layouts)
        perm = torch.empty(total, dtype=torch.long)
        for r, (_, start_of, _) in enumerate(layouts):
            for (k, j), at in start_of.items():
                size = muon[k].view[1] * muon[k].view[2]  # type: ignore[index]
                pos = starts[k] + j * size
                perm[pos : pos + size] = torch.arange(r * self.pad + at, r * self.pad + at + size)
        self.perm = perm.to(device)
        owned_index = torch.empty(self.owned_numel, dtype=torch.long)
        for (k, j), at in mine.items():
            size = muon[k].view[1] * muon[k].view[2]  # type: ignore[index]
            owned_index[at : at + size] = torch.arange(starts[k] + j * size, starts[k] + (j + 1) * size)
        self.owned_index = owned_index.to(device)
        sizes = [p.view[1] * p.view[2] for p in muon for _ in range(p.view[0])]  # type: ignore[index]
        self.segments = _Segments(sizes, list(range(len(sizes))), len(sizes), device)

    def summary(self) -> dict[str, Any]:
        """The ``execution_table`` row of a group that ran the split."""
        return {
            "implementation": "ddp-split",
            "world": self.plan.world,
            "matrices": self.segments.count,
            "owned_matrices": sum(sg.count for sg in self.groups),
            "ns_cost_per_rank": max(self.plan.load),
            "ns_cost_total": sum(self.plan.load),
        }


class _DdpCache:
    """A group's split decision (and split, when it runs), rebuilt when the active parameters or routing change."""

    def __init__(self, key: tuple, split: DdpSplit | None) -> None:
        self.key, self.split = key, split


def ddp_split_of(opt: HybridMuonOptimizer, index: int, group: dict[str, Any]) -> DdpSplit | None:
    """The DDP split of param_group ``index`` when it runs this step, else ``None`` (the flat engine runs).

    ``None`` unless ``opt.ddp_split`` is ``"always"``, or ``"auto"`` and :func:`split_pays`;
    torch.distributed is initialised with more than one rank; and the group has Muon
    matrices, its active parameters are plain tensors on one device, and its Muon
    parameters have one dtype. Every condition is metadata, the same on every rank of DDP
    (parameters and gradient presence are replicated), so all ranks decide alike.
    """
    mode = opt.ddp_split
    if mode == "off":
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    active = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None and p.numel() > 0]
    key = (tuple(id(p) for _, p in active), opt._names_version, group["muon_mode"], world, rank, mode)
    caches: dict[int, _DdpCache] = opt.__dict__.setdefault("_ddp_splits", {})
    cache = caches.get(index)
    if cache is None or cache.key != key:
        plan = build_plan([(i, tuple(p.shape), opt.route_of(p, group)) for i, p in active], world)
        muon = [group["params"][layout.index] for layout in plan.muon]
        fits = (
            bool(muon)
            and not any(is_dtensor(p) for _, p in active)
            and len({p.device for _, p in active}) == 1
            and len({p.dtype for p in muon}) == 1
            and len({p.grad.dtype for p in muon}) == 1  # type: ignore[union-attr]
        )
        runs = fits and (mode == "always" or split_pays(plan))
        cache = caches[index] = _DdpCache(key, DdpSplit(plan, rank, active[0][1].device) if runs else None)
    return cache.split


def ddp_step_group(
    opt: HybridMuonOptimizer, group: dict[str, Any], split: DdpSplit, shared: torch.Tensor | None = None
) -> None:
    """One step of a param_group of replicated parameters (DDP), Newton–Schulz split across the ranks.

    Every rank does the elementwise work (Adam routes, momentum, decay, Magma) on its whole
    tensors, as one process does; it orthogonalises only the matrices it owns; one
    ``all_gather_into_tensor`` gives every rank every delta, which every rank applies. Each
    delta is computed once, so the replicas stay bitwise identical. ``shared``: the finite
    flag already agreed across ranks (``nonfinite_across_ranks``), combined with the gate.
    """
    import torch.distributed as dist

    plan = split.plan
    active = [group["params"][p.index] for p in plan.params]
    grads = {id(p): opt._grad_of(p) for p in active}

    # 1. The finite gate: the gradients are the same on every rank (DDP all-reduced them), so is the gate.
    ok = F.finite_gate(list(grads.values()))
    if shared is not None:
        ok = torch.minimum(ok, shared.to(ok.device))

    # 2. Adam and AdamW, momentum, decay and Magma: on the whole tensors, as one process.
    settings = F.GroupSettings.of(group)
    routed = list(zip(active, (layout.route for layout in plan.params), strict=True))
    _local_adam(opt, settings, [(p, route) for p, route in routed if route != "muon"], grads, ok)
    muon = [group["params"][p.index] for p in plan.muon]
    locals_, flat_p, update, damp = _local_muon(opt, settings, plan, muon, grads, ok, split.segments, None)

    # 3. Newton–Schulz of the owned matrices; one all-gather of every rank's deltas (padded
    # to the largest rank's size: a rank owning nothing sends padding).
    wire = _wire_dtype(update.dtype)
    send = torch.zeros(split.pad, dtype=wire, device=update.device)
    _orthogonalize_owned(settings, update[split.owned_index], split.groups, damp, send)
    gathered = torch.empty(split.pad * plan.world, dtype=wire, device=update.device)
    _collective("all_gather", (split.pad,), dist.all_gather_into_tensor, gathered, send)
    _apply_delta(flat_p, locals_, gathered[split.perm], ok, settings.lr)
