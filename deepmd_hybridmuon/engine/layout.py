"""Layout of one param_group in the flat engine: which parameter goes where. Data only, no step.

A :class:`Layout` is built once per engine (and again whenever what it was built from
changes). It holds

* the flat buffers: one buffer holding the Adam parameters first, then the Muon ones, into which each step
  copies the gradients and in which it turns them into the updates; the float32 Adam moments; the Muon
  momentum; the Magma scores. The optimizer's per-parameter state entries (``state[p]["exp_avg"]``...)
  become views of them (:func:`deepmd_hybridmuon.state.adopt`), so the state keeps the built-in layout;
* the assignment of every Muon matrix to a path (:func:`assign`): one Triton program per
  matrix (:class:`Fused`) or a stack of the torch path (:class:`Bucket`: one per shape, no padding);
* the device tables and workspaces of those paths (offsets, sides, strides).

Nothing here runs the step: :mod:`.batched` does the arithmetic on these buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from .. import functional as F
from ..dtensor import local_shard
from ..state import adopt

#: One Muon parameter as the layout sees it: (parameter, (batch, rows, cols) of its matrix view).
MuonEntry = tuple[torch.Tensor, tuple[int, int, int]]


def split_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive parts of ``flat``, shaped like ``params``."""
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params, strict=True)]


@dataclass
class Bucket:
    """Matrices of one shape and schedule, orthogonalised by ``functional.orthogonalize`` in one stack."""

    use_gram: bool
    rows: int
    cols: int
    batch: int = 0
    members: list[tuple[int, int]] = field(default_factory=list)  # (flat offset, batch) per parameter
    blocks: list[int] = field(default_factory=list)  # global block index of each stack row
    views: list[torch.Tensor] = field(default_factory=list)  # each member's part of muon_grad, (batch, rows, cols)
    dtype: torch.dtype = torch.bfloat16  # the iteration's input dtype
    block_ids: torch.Tensor | None = None


@dataclass
class Fused:
    """Matrices of one path orthogonalised by one Triton launch (``kernels.orthogonalize_blocks``)."""

    use_gram: bool
    rows: int = 0  # largest smaller side
    cols: int = 0  # largest larger side
    meta: list[list[int]] = field(default_factory=list)  # kernels.META_COLS integers per matrix
    size: int = 0  # workspace elements
    table: torch.Tensor | None = None
    work: torch.Tensor | None = None
    coefs: torch.Tensor | None = None


def assign(views: list[tuple[int, int, int]], K: ModuleType | None, use_gram: bool) -> tuple[list[Fused], list[Bucket]]:
    """Group the Muon matrices (``(batch, rows, cols)`` per parameter, in flat order) into paths.

    With the kernels module ``K``: one program per matrix where ``functional.on_triton`` says so; the rest
    (everything without ``K``) into torch buckets.
    """
    fused: dict[tuple[bool, bool], Fused] = {}
    buckets: dict[tuple[bool, int, int], Bucket] = {}
    offset = block = 0
    for bs, rows, cols in views:
        gram = F.takes_gram(rows, cols, use_gram)
        small, large = min(rows, cols), max(rows, cols)
        if K is not None and F.on_triton(small):  # one launch per iteration and residency
            f = fused.setdefault((gram, K.resident(small, large)), Fused(gram))
            f.rows, f.cols = max(f.rows, small), max(f.cols, large)
            # wide orientation: (r, c) of the m x n view is element (c, r) of a tall matrix
            strides = (1, small) if rows > cols else (large, 1)
            for i in range(bs):
                f.meta.append([offset + i * rows * cols, f.size, small, large, *strides, block + i, 0])
                f.size += rows * cols
        else:  # one stack per shape, as the matrix is: no padding, no transposed copy
            b = buckets.setdefault((gram, rows, cols), Bucket(gram, rows, cols))
            b.members.append((offset, bs))
            b.blocks.extend(range(block, block + bs))
            b.batch += bs
        block += bs
        offset += bs * rows * cols
    return list(fused.values()), list(buckets.values())


def build_fused(K: ModuleType, f: Fused, device: torch.device) -> None:
    """The device tables and workspaces of one Triton launch group (``f``'s fields), on ``device``.

    Also used for the owners' matrices under FSDP2 (``distributed.OwnedKernels``).
    """
    kw = {"device": device}
    f.table = torch.tensor(f.meta, dtype=torch.int64, **kw)
    size = 1 if K.resident(f.rows, f.cols) else f.size  # resident matrices need no workspace
    f.work = torch.zeros(size, dtype=K.work_dtype(f.use_gram), **kw)
    f.coefs = K.coefficient_table(f.use_gram, device)


def run_fused(K: ModuleType, f: Fused, src: torch.Tensor, dst: torch.Tensor, factor: torch.Tensor) -> None:
    """The launch of ``f``, which writes ``factor * O`` of its matrices, one program each."""
    K.orthogonalize_blocks(src, dst, f.work, f.table, f.coefs, factor, f.rows, f.cols, f.use_gram)


class Layout:
    """Flat buffers, state views and path tables of one param_group.

    Parameters
    ----------
    params
        The group's parameters that take part in the step (non-empty, with a gradient or their route's
        state), in group order; one dtype and device. FSDP2's DTensors are laid out by their local shards
        (``paths`` off: their matrices are orthogonalised whole elsewhere).
    routes
        Their routes (:func:`deepmd_hybridmuon.functional.route_parameter`).
    state
        The optimizer's state; existing entries are copied into the flat buffers and every
        entry becomes a view of them.
    group
        The param_group (its hyperparameters baked into the tables: ``muon_mode``'s views via
        ``routes``, ``enable_gram``, ``magma_muon``, ``lr_adjust``, ``lr_adjust_coeff``, whether
        ``weight_decay`` > 0; the learning rate, momentum and betas come in with each step).
    kernels
        The Triton kernels module, or ``None`` for the torch path only (always without ``paths``).
    paths
        Assign every Muon matrix to a Triton launch or a torch stack; off for shards, whose
        matrices this layout does not hold whole.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        routes: list[F.ParamRoute],
        state: dict,
        group: dict[str, Any],
        kernels: ModuleType | None,
        paths: bool = True,
    ) -> None:
        local = {id(p): local_shard(p) for p in params}  # the tensors the step writes (a DTensor's shard)
        self.device, self.dtype = local[id(params[0])].device, params[0].dtype
        adam_keys = [p for p, r in zip(params, routes, strict=True) if r.route != "muon"]
        muon_keys = [(p, r.view) for p, r in zip(params, routes, strict=True) if r.route == "muon"]
        #: The parameters as the optimizer's state knows them, in the order of the flat buffers.
        self.keys = adam_keys + [p for p, _ in muon_keys]
        self.adam = [local[id(p)] for p in adam_keys]
        self.adamw = [local[id(p)] for p, r in zip(params, routes, strict=True) if r.route == "adamw"]
        adamw = {id(p) for p in self.adamw}
        self.adamw_ids = torch.tensor(
            [i for i, p in enumerate(self.adam) if id(p) in adamw], dtype=torch.int64, device=self.device
        )
        self.muon: list[MuonEntry] = [(local[id(p)], view) for p, view in muon_keys]
        self.weight_decay = float(group["weight_decay"]) > 0
        self.magma = bool(group["magma_muon"])
        # One flat buffer, Adam parameters first: the gradients are copied in, checked, and turned into the
        # updates in place (the step's one copy of the parameters' size beside the momentum), written out at once.
        self.staged = self.adam + [p for p, _ in self.muon]
        # where the parameters live: a captured graph writes through these addresses
        self.storage = [p.data_ptr() for p in self.staged]
        self.shapes = [p.shape for p in self.staged]  # a new shape in the same storage rebuilds too
        self.numels = [p.numel() for p in self.staged]
        self.grad = torch.zeros(sum(self.numels), dtype=self.dtype, device=self.device)
        self.grad_views = split_views(self.grad, self.staged)
        self._build_adam(state, adam_keys)
        self._build_muon(state, group, kernels, [p for p, _ in muon_keys], paths)

    # ------------------------------------------------------------------ state

    def _build_adam(self, state: dict, keys: list[torch.Tensor]) -> None:
        n = sum(p.numel() for p in self.adam)
        kw = {"device": self.device, "dtype": torch.float32}
        self.exp_avg = torch.zeros(n, **kw)
        self.exp_avg_sq = torch.zeros(n, **kw)
        self.adam_grad = self.grad[:n]
        fresh = [p for p in keys if "exp_avg" not in state[p]]
        adopt(state, keys, "exp_avg", split_views(self.exp_avg, self.adam))
        adopt(state, keys, "exp_avg_sq", split_views(self.exp_avg_sq, self.adam))
        for p in fresh:
            state[p]["beta1_pow"] = 1.0
            state[p]["beta2_pow"] = 1.0
        self.adam_states = [state[p] for p in keys]  # a loaded state dict rebuilds the engine
        # the index of its parameter in self.adam, per element: spreads per-parameter scalars over the elements
        numels = torch.tensor([p.numel() for p in self.adam], dtype=torch.int64)
        self.adam_owner = torch.repeat_interleave(torch.arange(len(self.adam)), numels).to(self.device)

    def _build_muon(
        self, state: dict, group: dict[str, Any], K: ModuleType | None, keys: list[torch.Tensor], paths: bool
    ) -> None:
        params = [p for p, _ in self.muon]
        views = [view for _, view in self.muon]
        n = sum(p.numel() for p in params)
        kw = {"device": self.device}
        self.momentum = torch.zeros(n, dtype=self.dtype, **kw)
        adopt(state, keys, "momentum_buffer", split_views(self.momentum, params))
        self.muon_grad = self.grad[self.grad.numel() - n :]

        # Blocks (one per matrix of each view) and their per-block Muon scale.
        settings = F.GroupSettings.of(group)
        lengths, scales = [], []
        self.muon_rows: list[tuple[int, int, int]] = []  # (flat offset, elements, matrices) per parameter
        for bs, rows, cols in views:
            self.muon_rows.append((sum(lengths), bs * rows * cols, bs))
            lengths += [rows * cols] * bs
            scales += [settings.scale(rows, cols)] * bs
        self.block_scale = torch.tensor(scales, dtype=torch.float32, **kw)
        counts = torch.tensor([bs for bs, _, _ in views], dtype=torch.int64)
        self.block_owner = torch.repeat_interleave(torch.arange(len(views)), counts).to(self.device)  # per block
        self.block_factor = torch.zeros_like(self.block_scale)  # scale x Magma x -lr, per step
        if self.magma:
            self.scores = torch.full((len(lengths),), F.MAGMA_INITIAL_SCORE, dtype=torch.float32, **kw)
            adopt(state, keys, "magma_score", self.scores.split([bs for bs, _, _ in views]), reshape=False)

        # Each matrix goes to a Triton launch (with the kernels) or to a stack of the torch path.
        fused, buckets = assign(views, K, bool(group["enable_gram"])) if paths else ([], [])
        for f in fused:
            build_fused(K, f, self.device)
        self.fused_paths = fused
        self.triton = K is not None
        # Magma's sums over segments, a few kernels for every block at once, where F.SEGMENT_SUM_DEVICES says so
        segmented = self.magma and paths and self.device.type in F.SEGMENT_SUM_DEVICES
        self.segments = F.Segments(lengths, list(range(len(lengths))), len(lengths), self.device) if segmented else None
        for b in buckets:
            self._build_bucket(b)
        self.buckets = buckets

    # ------------------------------------------------------------------ tables

    def _build_bucket(self, b: Bucket) -> None:
        """A torch bucket's views of the flat buffer, its input dtype and its blocks' indices."""
        # float32 for the Gram schedule (either form), bfloat16 for the standard one: the stack converts
        # as it is made, as the reference's first ``.to`` would
        b.dtype = torch.float32 if b.use_gram else torch.bfloat16
        b.views = [self.muon_grad[off : off + bs * b.rows * b.cols].view(bs, b.rows, b.cols) for off, bs in b.members]
        b.block_ids = torch.tensor(b.blocks, dtype=torch.int64, device=self.device)
