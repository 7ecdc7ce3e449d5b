"""FSDP2 (``fully_shard``, deepmd's ``zero_stage`` 2 and 3): the owner computes.

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

Every collective goes through :func:`_collective`, which :func:`trace_collectives`
records (the tests compare the sequences of all ranks).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from . import functional as F

if TYPE_CHECKING:
    from .optimizer import HybridMuonOptimizer

__all__ = [
    "ParamLayout",
    "Plan",
    "build_plan",
    "chunk_rows",
    "from_owners",
    "is_dtensor",
    "local_shard",
    "plan_of",
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
        matrix_base = []
        base = 0
        for p in muon:
            matrix_base.append(base)
            assert p.view is not None
            base += p.view[0]
        self.num_matrices = base
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

        # Owned matrices, grouped by shape (first appearance), then plan order.
        owned = [(k, j) for k, p in enumerate(muon) for j in range(p.view[0]) if plan.owners[k][j] == rank]  # type: ignore[index]
        shapes: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for k, j in owned:
            _, rows, cols = muon[k].view  # type: ignore[misc]
            shapes.setdefault((rows, cols), []).append((k, j))
        start_of: dict[tuple[int, int], int] = {}
        self.groups: list[_ShapeGroup] = []
        cursor = 0
        for (rows, cols), mats in shapes.items():
            first = cursor
            for kj in mats:
                start_of[kj] = cursor
                cursor += rows * cols
            ids = torch.tensor([matrix_base[k] + j for k, j in mats], dtype=torch.long, device=device)
            self.groups.append(_ShapeGroup(rows, cols, first, len(mats), ids))
        self.owned_numel = cursor

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
        self.segment_lengths = torch.tensor([pc[3] for pc in mine], dtype=torch.long, device=device)
        self.segment_matrix = torch.tensor([matrix_base[pc[0]] + pc[1] for pc in mine], dtype=torch.long, device=device)


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


# ----------------------------------------------------------------------------- step


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

    settings = F.GroupSettings.of(group)

    # 2. Adam and AdamW: elementwise on the local shards, one flat chain per bucket.
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for layout, p in zip(plan.params, active, strict=True):
        if layout.route == "muon":
            continue
        state = opt._advance_adam_state(p, settings)
        decay = settings.adam_decay(layout.route)
        key = (p.dtype, grads[id(p)].dtype, state["beta1_pow"], state["beta2_pow"], decay)
        buckets.setdefault(key, []).append(p)
    for (_, _, beta1_pow, beta2_pow, decay), ps in buckets.items():
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

    muon = [group["params"][p.index] for p in plan.muon]
    if not muon:
        return
    _muon(opt, group, plan, ex, mesh.get_group(shard_dim), muon, grads, ok)


def _muon(
    opt: HybridMuonOptimizer,
    group: dict[str, Any],
    plan: Plan,
    ex: _Exchange,
    pg: Any,
    muon: list[torch.Tensor],
    grads: dict[int, torch.Tensor],
    ok: torch.Tensor,
) -> None:
    """Momentum and decay on the shards, Magma sums, the two all-to-alls and Newton–Schulz on the owners."""
    import torch.distributed as dist

    settings = F.GroupSettings.of(group)
    lr, wd = settings.lr, settings.weight_decay
    dtypes = {grads[id(p)].dtype for p in muon} | {p.dtype for p in muon}
    if len({grads[id(p)].dtype for p in muon}) > 1 or len({p.dtype for p in muon}) > 1:
        raise NotImplementedError(
            f"FSDP2: Muon parameters of one param_group in several dtypes {sorted(map(str, dtypes))}; "
            "HybridMuon needs one parameter dtype and one gradient dtype per group"
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

    damp = None
    if settings.magma:
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
        sums = torch.zeros(ex.num_matrices, 3, dtype=torch.float32, device=flat_p.device)
        if ex.segment_lengths.numel():
            pieces = torch.segment_reduce(products, "sum", lengths=ex.segment_lengths, axis=0)
            sums.index_copy_(0, ex.segment_matrix, pieces)
        _collective("all_reduce", (sums.numel(),), dist.all_reduce, sums, op=dist.ReduceOp.SUM, group=pg)
        flat_score = _flat(scores)
        damp = F.magma_scale_(flat_score, F.magma_score(sums[:, 0], sums[:, 1].sqrt(), sums[:, 2].sqrt()), ok)
        _write_back(scores, flat_score)

    # The transport dtype holds the update and every delta exactly (bfloat16/float16 ->
    # float32), so the owner sees the bits one process does.
    wire = torch.promote_types(work, torch.float32)
    owned = to_owners(ex, update.to(wire), pg).to(work)
    delta = torch.empty_like(owned, dtype=wire)
    for sg in ex.groups:
        n = sg.count * sg.rows * sg.cols
        orth = F.orthogonalize(owned[sg.start : sg.start + n].view(sg.count, sg.rows, sg.cols), settings.use_gram)
        d = orth * settings.scale(sg.rows, sg.cols)
        if damp is not None:
            d = d * damp[sg.matrix_ids].view(sg.count, 1, 1).to(d.dtype)
        delta[sg.start : sg.start + n].copy_(d.reshape(-1))
    local_delta = from_owners(ex, delta, pg)
    flat_p.addcmul_(local_delta, ok.to(flat_p.dtype) * -lr)
    _write_back(locals_, flat_p)
