"""Several ranks: FSDP2 (deepmd's ``zero_stage`` 2 and 3) and DDP (``zero_stage`` 0) share the Newton–Schulz work.

* :mod:`.plan`: who orthogonalises what. A :class:`Plan` from metadata alone (parameter
  order, global shapes, routes, matrix views, world size) gives every Muon matrix an owner
  rank, balancing Newton–Schulz cost; every rank computes the same plan. Every collective
  goes through one door that :func:`trace_collectives` records.
* :mod:`.local`: the step's work on local tensors (an FSDP2 shard, or a replicated tensor
  itself): the Adam routes, Muon momentum, decay and Magma sums batched over a group, and
  the owners' Newton–Schulz: the engine's Triton launches where they apply
  (:class:`OwnedKernels`), else stacked by shape. Both steps below use it.
* :mod:`.fsdp`: FSDP2, the owner computes: shards travel to the owners and the updates
  back in two ``all_to_all_single`` per step, plus the gate and Magma all-reduces.
* :mod:`.ddp`: DDP, ``ddp_split``: each replica orthogonalises the matrices it owns and one
  ``all_gather_into_tensor`` shares the updates, where that pays (:func:`split_pays`).

Each step's collectives are a fixed sequence whatever the number of parameters, and none
is skipped because of local data (that would deadlock).
"""

from ..dtensor import is_dtensor, local_shard
from .ddp import DDP_SPLIT_MIN_COST, DDP_SPLIT_MODES, DdpSplit, ddp_split_of, ddp_step_group, split_pays
from .fsdp import from_owners, plan_of, step_group, to_owners
from .fsdp import summary_of as fsdp_summary
from .local import SEGMENT_BLOCK, OwnedKernels
from .plan import ParamLayout, Plan, build_plan, chunk_rows, ns_cost, trace_collectives

__all__ = [
    "DDP_SPLIT_MIN_COST",
    "DDP_SPLIT_MODES",
    "SEGMENT_BLOCK",
    "DdpSplit",
    "OwnedKernels",
    "ParamLayout",
    "Plan",
    "build_plan",
    "chunk_rows",
    "ddp_split_of",
    "ddp_step_group",
    "from_owners",
    "fsdp_summary",
    "is_dtensor",
    "local_shard",
    "ns_cost",
    "plan_of",
    "split_pays",
    "step_group",
    "to_owners",
    "trace_collectives",
]
