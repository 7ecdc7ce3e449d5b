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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import step
from . import local
from .plan import Plan, _cat_index, _collective, _matrix_base, _owned, build_plan


class _Exchange:
    """One rank's side of a plan: index tensors of the two all-to-alls and the Magma sums.

    Local buffer: the local shards of the Muon parameters, flattened and concatenated in
    plan order (``lengths``). A rank's shard of a parameter covers a contiguous range of
    its flattened global tensor, hence a contiguous *piece* of each matrix it touches.
    The send buffer holds the pieces grouped by owner (ascending), in plan order within an
    owner; the owner receives them grouped by source rank, in the same order, and
    ``gather`` reassembles its matrices, grouped by shape.
    """

    def __init__(self, plan: Plan, rank: int, device: torch.device, flash_muon: bool) -> None:
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
        self.kernels = local.OwnedKernels(self.groups, device) if flash_muon else None  # the owners' Triton launches

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
        self.segments = local.Segments(
            [pc[3] for pc in mine], [matrix_base[pc[0]] + pc[1] for pc in mine], self.num_matrices, device
        )


# ----------------------------------------------------------------------------- transport


def _all_to_all(out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], pg: Any) -> None:
    """One ``all_to_all_single`` with uneven splits (element counts per rank), through the collectives' door."""
    import torch.distributed as dist

    _collective(
        "all_to_all",
        (len(in_splits),),
        dist.all_to_all_single,
        out,
        inp,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        group=pg,
    )


def to_owners(ex: _Exchange, flat: torch.Tensor, pg: Any) -> torch.Tensor:
    """Send this rank's flat Muon buffer (plan order) to the owners; return the owned matrices.

    One ``all_to_all_single`` with uneven splits, called by every rank (zero-length splits
    for a rank without pieces or owned matrices). The result is the owned buffer: owned
    matrices grouped by shape (``ex.groups``), each whole, in row-major order.
    """
    recv = torch.empty(ex.owned_numel, dtype=flat.dtype, device=flat.device)
    _all_to_all(recv, flat[ex.send_index], ex.recv_splits, ex.send_splits, pg)
    return recv[ex.gather]


def from_owners(ex: _Exchange, owned: torch.Tensor, pg: Any) -> torch.Tensor:
    """The inverse of :func:`to_owners`: each rank gets back its pieces of the owned buffers."""
    back = torch.empty(ex.local_numel, dtype=owned.dtype, device=owned.device)
    _all_to_all(back, owned[ex.place], ex.send_splits, ex.recv_splits, pg)
    pieces = torch.empty_like(back)
    pieces[ex.send_index] = back
    return pieces


# ----------------------------------------------------------------------------- step


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


@dataclass(frozen=True)
class Context:
    """What an FSDP2 step reads of the optimizer, handed to it each step (never the optimizer itself).

    ``state``: the optimizer's per-parameter state; ``route_of(p, group)`` and ``param_name(p)``:
    its routing and naming; ``names_version``: changes when the names (hence routes) change;
    ``flash_muon``: whether the owners may run the Triton kernels.
    """

    state: dict
    route_of: Callable[[torch.Tensor, dict[str, Any]], Any]
    param_name: Callable[[torch.Tensor], str | None]
    names_version: int
    flash_muon: bool


class FsdpGroup:
    """The runner of one param_group of FSDP2 DTensors: its plan and this rank's exchange.

    Rebuilt by one rule: when the key of :meth:`prepare` changes (the active parameters, the
    names' version, ``muon_mode``, the shard mesh's size and this rank's place in it, the kernel
    flag). ``plan`` and ``exchange`` are those of the last step (``None`` before it).
    """

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.plan: Plan | None = None
        self.exchange: _Exchange | None = None

    def prepare(self, ctx: Context, group: dict[str, Any]) -> tuple[Any, int]:
        """Bring ``plan`` and ``exchange`` up to date for ``group``; return the mesh and its sharded dimension."""
        params = [p for p in group["params"] if p.numel() > 0]
        mesh, dim = _mesh_of(params) if params else (None, 0)
        active = [(i, p) for i, p in enumerate(group["params"]) if p.grad is not None and p.numel() > 0]
        world = mesh.size(dim) if mesh is not None else 1
        rank = mesh.get_local_rank(dim) if mesh is not None else 0
        key = (tuple(id(p) for _, p in active), ctx.names_version, group["muon_mode"], world, rank, ctx.flash_muon)
        if key != self.key:
            plan = build_plan([(i, tuple(p.shape), ctx.route_of(p, group)) for i, p in active], world)
            for layout, (_, p) in zip(plan.params, active, strict=True):
                lo, hi = layout.ranges[rank]
                shard = p.to_local()
                if p.dim() == 0 or tuple(shard.shape) != (hi - lo, *layout.shape[1:]):
                    raise NotImplementedError(
                        f"FSDP2 shard of parameter {ctx.param_name(p) or layout.index} (shape {layout.shape}) has "
                        f"local shape {tuple(shard.shape)} on shard rank {rank}; HybridMuon expects torch.chunk's "
                        f"rows {lo}..{hi} of dim 0"
                    )
            device = torch.device(mesh.device_type) if mesh is not None else torch.device("cpu")
            self.key, self.plan, self.exchange = key, plan, _Exchange(plan, rank, device, ctx.flash_muon)
        return mesh, dim

    def summary(self) -> dict[str, Any]:
        """The ``execution_table`` row: its owners' Newton–Schulz on this rank."""
        if self.exchange is None:
            return {"implementation": "fsdp2", "kernels": "torch", "torch_matrices": []}
        return {"implementation": "fsdp2", **local.kernels_summary(self.exchange.kernels, self.exchange.groups)}

    def step(self, ctx: Context, group: dict[str, Any], shared: torch.Tensor | None = None) -> torch.Tensor | None:
        """One step of the group (see the module docstring); returns its finite gate (``None``: nothing to step).

        ``shared``: the finite flag already agreed across ranks (``nonfinite_across_ranks``),
        combined with this group's gate.
        """
        mesh, shard_dim = self.prepare(ctx, group)
        if mesh is None:
            return None  # only size-0 parameters: nothing to shard, nothing to step
        assert self.plan is not None and self.exchange is not None  # prepare built them
        return step.run(_Phases(ctx.state, group, self.plan, self.exchange, mesh, shard_dim, shared))


class _Phases:
    """The phases of :func:`deepmd_hybridmuon.step.run` on this rank's shards (see the module docstring).

    ``states``: the optimizer's per-parameter state; ``shared``: the finite flag already agreed
    across ranks (``nonfinite_across_ranks``), combined with this group's gate.
    """

    def __init__(
        self, states: dict, group: dict[str, Any], plan: Plan, ex: _Exchange, mesh: Any, shard_dim: int, shared: Any
    ) -> None:
        self.states, self.plan, self.ex, self.mesh, self.shared = states, plan, ex, mesh, shared
        self.device = torch.device(mesh.device_type)
        self.pg = mesh.get_group(shard_dim)
        self.inputs = local.shard_inputs(states, group, plan)
        #: Whether the group has Muon matrices with gradients (phases 3-5 have work); fixed here, as
        #: before_orthogonalize releases the gradient copy it is read from.
        self.has_muon = self.inputs.muon_grad is not None
        self.ungated = False  # the shard code always takes the gate (step.run)
        self.muon: local.LocalMuon | None = None
        self.sums: torch.Tensor | None = None
        self.delta: torch.Tensor | None = None

    def gate(self) -> torch.Tensor:
        """The gate of this rank, made the same on every rank: one all-reduce (min) per mesh dimension."""
        import torch.distributed as dist

        ok = local.local_gate(self.inputs, self.device)
        if self.shared is not None:
            ok = torch.minimum(ok, self.shared.to(self.device))
        for d in range(self.mesh.ndim):
            _collective("all_reduce", (1,), dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=self.mesh.get_group(d))
        return ok

    def adam(self, ok: torch.Tensor) -> None:
        local.local_adam(self.states, self.inputs, ok)
        for b in self.inputs.buckets:
            b.grad = None  # the flat copies of the gradients: not needed any more

    def before_orthogonalize(self, ok: torch.Tensor) -> None:
        segments = self.ex.segments if self.inputs.settings.magma else None
        self.muon, self.sums = local.local_momentum(self.states, self.inputs, self.plan, ok, segments)
        self.inputs.muon_grad = None  # copied into the sanitised gradient

    def complete_sums(self) -> None:
        """Magma: the whole-matrix sums from the shards' partial sums, one all-reduce (sum)."""
        import torch.distributed as dist

        if self.sums is not None:
            _collective(
                "all_reduce", (self.sums.numel(),), dist.all_reduce, self.sums, op=dist.ReduceOp.SUM, group=self.pg
            )

    def orthogonalize(self, ok: torch.Tensor) -> None:
        """Newton–Schulz on the owners: the shards of the update travel there, the scaled updates back."""
        assert self.muon is not None  # before_orthogonalize ran
        settings, ex = self.inputs.settings, self.ex
        damp = None if self.sums is None else local.magma_damp(self.states, self.inputs.muon, self.sums, ok)
        work = self.muon.update.dtype
        wire = local.wire_dtype(work)
        owned = to_owners(ex, self.muon.update.to(wire), self.pg).to(work)
        self.muon.update = None
        delta = torch.empty_like(owned, dtype=wire)
        local.orthogonalize_owned(settings, owned, ex.groups, damp, ok * -settings.lr, delta, ex.kernels)
        self.delta = from_owners(ex, delta, self.pg)

    def apply(self, ok: torch.Tensor) -> None:
        if self.muon is not None and self.delta is not None:
            local.apply_delta(self.muon.flat_p, self.muon.locals, self.delta)
