"""Several ranks under FSDP2 (deepmd's ``zero_stage`` 2 and 3): each Muon matrix orthogonalised once, by its owner.

* :mod:`.plan`: who orthogonalises what. A :class:`Plan` from metadata alone (parameter
  order, global shapes, routes, matrix views, world size) gives every Muon matrix an owner
  rank, balancing Newton–Schulz cost; every rank computes the same plan. Every collective
  goes through one door that :func:`trace_collectives` records.
* :mod:`.fsdp`: the step (:class:`ShardedEngine`): the flat engine on a rank's shards, whose
  Muon updates travel to the owners and back in two ``all_to_all_single`` per step, plus the
  gate and Magma all-reduces.
* :mod:`.local`: what the engine does not: the owners' scales and Newton–Schulz: the engine's
  Triton launches where they apply (:class:`OwnedKernels`), else stacked by shape. (Magma's sums
  over a rank's pieces of the matrices are the engine's own: ``functional.magma_segment_sums``.)

DDP (``zero_stage`` 0) needs nothing here: every replica steps the whole group with the flat
engine, as one process does, and the replicas stay bitwise identical. (Splitting the
Newton–Schulz work across the replicas was measured slower for DeePMD models and removed:
BENCHMARKS.md, "Design measurements".) ZeRO-1 (``zero_stage`` 1) needs only the optimizer's
finite-gate all-reduce (``nonfinite_across_ranks``).

Each step's collectives are a fixed sequence whatever the number of parameters, and none
is skipped because of local data (that would deadlock).
"""

from ..dtensor import is_dtensor, local_shard
from .fsdp import ShardedEngine, from_owners, to_owners
from .local import OwnedKernels
from .plan import ParamLayout, Plan, build_plan, chunk_rows, ns_cost, trace_collectives

__all__ = [
    "OwnedKernels",
    "ParamLayout",
    "Plan",
    "ShardedEngine",
    "build_plan",
    "chunk_rows",
    "from_owners",
    "is_dtensor",
    "local_shard",
    "ns_cost",
    "to_owners",
    "trace_collectives",
]
