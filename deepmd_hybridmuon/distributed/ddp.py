"""DDP (deepmd's ``zero_stage`` 0, the optimizer's ``ddp_split``): Newton–Schulz split across the replicas.

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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from ..dtensor import is_dtensor
from . import local
from .plan import Plan, _collective, _owned, build_plan

if TYPE_CHECKING:
    from ..optimizer import HybridMuonOptimizer

DDP_SPLIT_MODES: tuple[str, ...] = ("off", "auto", "always")

#: ``ddp_split="auto"`` splits a param_group when the Newton–Schulz work the split saves each
#: rank, ``sum(plan.load) - max(plan.load)`` in :func:`ns_cost` units, exceeds this. Source:
#: benchmarks/ddp_split.py on 2 × H200, 2026-11-23 (BENCHMARKS.md): the split lost at 3.4e10
#: saved per rank (8 × 2048², 8.3 vs 7.7 ms) and won at 2.8e11 (8 × 4096², 42.5 vs 55.7 ms).
#: Its cost is fixed overhead (eager torch kernels against the engine's Triton kernels in one
#: CUDA graph), so the crossover is high; DeePMD models save 2e7–8e7 and never split.
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

    def __init__(self, plan: Plan, rank: int, device: torch.device, flash_muon: bool) -> None:
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
        self.segments = local.Segments(sizes, list(range(len(sizes))), len(sizes), device)
        self.kernels = local.OwnedKernels(self.groups, device) if flash_muon else None

    def summary(self) -> dict[str, Any]:
        """The ``execution_table`` row of a group that ran the split."""
        return {
            "implementation": "ddp-split",
            "world": self.plan.world,
            "matrices": self.segments.count,
            "owned_matrices": sum(sg.count for sg in self.groups),
            "ns_cost_per_rank": max(self.plan.load),
            "ns_cost_total": sum(self.plan.load),
            **local.kernels_summary(self.kernels, self.groups),
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
    key = (tuple(id(p) for _, p in active), opt._names_version, group["muon_mode"], world, rank, mode, opt.flash_muon)
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
        split = DdpSplit(plan, rank, active[0][1].device, opt.flash_muon) if runs else None
        cache = caches[index] = _DdpCache(key, split)
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
    # 1-2. The gate (the gradients are the same on every rank, DDP all-reduced them: so is the
    # gate), Adam routes, momentum, decay and Magma: on the whole tensors, as one process.
    device = group["params"][plan.params[0].index].device
    settings, ok, muon = local.local_elementwise(opt, group, plan, device, shared, None, split.segments, None)
    assert muon is not None  # a split exists only for groups with Muon matrices
    locals_, flat_p, update, damp = muon

    # 3. Newton–Schulz of the owned matrices; one all-gather of every rank's deltas (padded
    # to the largest rank's size: a rank owning nothing sends padding).
    wire = local.wire_dtype(update.dtype)
    send = torch.zeros(split.pad, dtype=wire, device=update.device)
    local.orthogonalize_owned(settings, update[split.owned_index], split.groups, damp, send, split.kernels)
    gathered = torch.empty(split.pad * plan.world, dtype=wire, device=update.device)
    _collective("all_gather", (split.pad,), dist.all_gather_into_tensor, gathered, send)
    local.apply_delta(flat_p, locals_, gathered[split.perm], ok, settings.lr)
