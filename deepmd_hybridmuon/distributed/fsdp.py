"""FSDP2 (``fully_shard``, deepmd's ``zero_stage`` 2 and 3): the owner computes.

Under FSDP2 every parameter, gradient and parameter-shaped state tensor is a DTensor
sharded on dim 0 with ``torch.chunk`` semantics (uneven; trailing ranks may hold empty
shards). This module runs the step of one param_group of such DTensors:

* **Elementwise work on the local shards, by the flat engine**: the Adam/AdamW routes,
  the Muon momentum and the decoupled weight decay are elementwise, so each rank runs the
  engine's phases (:class:`ShardedEngine`) on a layout of its shards: flat buffers made
  once, the state as views of them (DTensors laid out like the parameters), the gradients
  copied in by one ``_foreach_copy_`` and the parameters written by one ``_foreach_add_``.
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
* **The finite gate** is one ``all_reduce`` (min) of the local flag per mesh dimension
  (none with ``nonfinite_across_ranks``: the optimizer's gate is agreed over all ranks).

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

from typing import Any

import torch

from .. import functional as F
from ..engine.batched import BatchedStep, StepInputs
from ..engine.group import GroupEngine
from ..engine.layout import Layout
from . import local
from .plan import Plan, _cat_index, _collective, _matrix_base, _owned, build_plan, chunk_rows


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
        self.segments = F.Segments(
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


def mesh_of(params: list[torch.Tensor]) -> tuple[Any, int]:
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


class ShardedEngine(GroupEngine):
    """The flat engine on this rank's FSDP2 shards (module docstring); the owners orthogonalise the matrices.

    The layout holds the local shards (no Newton–Schulz paths: no matrix is whole here); the state
    stays DTensors laid out like the parameters, as views of the layout's flat buffers. Rebuilt by the
    engine's rules (the optimizer's signature, :meth:`GroupEngine.matches`, :attr:`GroupEngine.outdated` once the
    owners' Triton launches are compiled). On CUDA the step is captured as the engine's is, as graphs cut at its
    collectives (``engine.execution``).
    """

    PATHS = False

    @staticmethod
    def supports(group: dict[str, Any], state: dict) -> bool:
        """Whether a group of DTensors has anything to step; ``NotImplementedError`` for layouts it cannot.

        Checked before the layout adopts any state: one mesh and placement, one dtype, and each rank's shard
        the rows ``torch.chunk`` gives it. ``state`` is not read: no loop steps shards, so a momentum in another
        dtype than the parameters' takes theirs here.
        """
        params = [p for p in group["params"] if p.numel() > 0]
        if not params:
            return False
        mesh, dim = mesh_of(params)
        world, rank = mesh.size(dim), mesh.get_local_rank(dim)
        active = [p for p in params if p.grad is not None]
        for p in active:
            lo, hi = chunk_rows(p.shape[0] if p.dim() else 1, world)[rank]
            shard = p.to_local()
            if p.dim() == 0 or tuple(shard.shape) != (hi - lo, *p.shape[1:]):
                raise NotImplementedError(
                    f"FSDP2 shard of the parameter of shape {tuple(p.shape)} has local shape {tuple(shard.shape)} "
                    f"on shard rank {rank}; HybridMuon expects torch.chunk's rows {lo}..{hi} of dim 0"
                )
        dtypes = {p.dtype for p in active}
        if len(dtypes) > 1:
            raise NotImplementedError(
                f"parameters of one param_group in several dtypes {sorted(map(str, dtypes))} under FSDP2; "
                "HybridMuon needs one parameter dtype per group there"
            )
        return bool(dtypes)

    def _batched(self, group: dict[str, Any], inputs: StepInputs, shared_gate: bool, flash_muon: bool) -> BatchedStep:
        index = {id(p): i for i, p in enumerate(self.group_params)}
        mesh, dim = mesh_of([p for p, _ in self.active])
        settings = F.GroupSettings.of(group)
        entries = [(index[id(p)], tuple(p.shape), r) for p, r in self.active]
        self.plan = build_plan(entries, mesh.size(dim), settings.use_gram)
        device = self.layout.device
        self.exchange = ex = _Exchange(self.plan, mesh.get_local_rank(dim), device)
        # The exchange's local buffer is the layout's flat Muon buffers: the same parameters, in the same order.
        assert ex.lengths == [t.numel() for t, _ in self.layout.muon]
        # The owners' Triton launches, once compiled; until then the torch path, and the engine is rebuilt then
        # (outdated), as the one-process engine is.
        scales = local.OwnedScales(ex.groups, settings, device)
        self.kernels, self.compiling = local.owned_kernels(
            ex.groups, scales.first, device, self.layout.dtype, settings.use_gram, flash_muon
        )
        return ShardedStep(self.layout, inputs, shared_gate, ex, scales, self.kernels, mesh, dim)

    def summary(self) -> dict[str, Any]:
        """The ``execution_table`` row: the owners' Newton–Schulz on this rank."""
        kernels = local.kernels_summary(self.kernels, self.exchange.groups, self.compiling)
        return {"implementation": "fsdp2", **kernels, "cuda_graph": self.ran.captured}


class ShardedStep(BatchedStep):
    """The engine's phases on this rank's shards, with the collectives of the module docstring between them."""

    def __init__(
        self,
        layout: Layout,
        inputs: StepInputs,
        shared_gate: bool,
        exchange: _Exchange,
        scales: local.OwnedScales,
        kernels: local.OwnedKernels | None,
        mesh: Any,
        shard_dim: int,
    ) -> None:
        super().__init__(layout, inputs, shared_gate)
        self.exchange, self.scales, self.owned_kernels, self.mesh = exchange, scales, kernels, mesh
        self.pg = mesh.get_group(shard_dim)

    def gate(self) -> torch.Tensor:
        """The gate of this rank, made the same on every rank: one all-reduce (min) per mesh dimension.

        With ``nonfinite_across_ranks`` the gate comes agreed over all ranks already.
        """
        import torch.distributed as dist

        ok = super().gate()
        if not self.shared_gate:
            for d in range(self.mesh.ndim):
                _collective("all_reduce", (1,), dist.all_reduce, ok, op=dist.ReduceOp.MIN, group=self.mesh.get_group(d))
        return ok

    @property
    def segments(self) -> F.Segments | None:
        """Magma's sums over this rank's pieces of each matrix."""
        return self.exchange.segments if self.layout.magma else None

    def complete_sums(self) -> None:
        """Magma: the whole-matrix sums from the shards' partial sums, one all-reduce (sum)."""
        import torch.distributed as dist

        if self.sums is not None:
            _collective(
                "all_reduce", (self.sums.numel(),), dist.all_reduce, self.sums, op=dist.ReduceOp.SUM, group=self.pg
            )

    def orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Newton–Schulz on the owners: the shards of the update travel there, the scaled updates back."""
        L, ex = self.layout, self.exchange
        update = L.muon_grad  # this rank's shards of the Nesterov update (before_orthogonalize)
        neg_lr = self.neg_lr if ok is None else self.neg_lr * ok.to(self.factor_dtype)
        damp = self._damp(ok)
        wire = local.wire_dtype(update.dtype)
        owned = to_owners(ex, update.to(wire), self.pg).to(update.dtype)
        delta = torch.empty_like(owned, dtype=wire)
        factor = self.scales.factors(damp, neg_lr)  # every owned matrix's, in one product
        use_gram = self.settings.use_gram
        local.orthogonalize_owned(use_gram, owned, ex.groups, factor, self.scales.first, delta, self.owned_kernels)
        update.copy_(from_owners(ex, delta, self.pg))
