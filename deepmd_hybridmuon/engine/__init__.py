"""The flat engine: the per-parameter loop's step, in a fixed set of batched kernels.

DeePMD models have many small matrices, so a per-tensor step is bound by kernel
launches, not arithmetic. The engine runs the step of a whole param_group on a few flat
buffers, one job per module:

* :mod:`.layout` (data only): which parameter goes where. A flat buffer in which each step
  turns the gradients into the updates, and flat state buffers (the optimizer's per-parameter
  state entries are views of them, in the built-in layout); every Muon matrix assigned to a
  path: one Triton program per matrix, or a stack of the torch path (one per shape);
  their device tables.
* :mod:`.batched` (arithmetic only): one step on those buffers, reading nothing that
  changes between steps but a few static input tensors. The math itself comes from
  :mod:`deepmd_hybridmuon.functional` (torch path) and :mod:`deepmd_hybridmuon.kernels`
  (Triton path).
* :mod:`.execution`: stages each step's inputs (pinned host ring, one copy), runs the
  arithmetic eagerly or as a captured CUDA graph (the torch stacks on one side stream); its
  docstring is the contract of that capture.
* :mod:`.compilation`: the one place that asks whether the Triton kernels can run and
  requests their compilation.
* :mod:`.group`: :class:`GroupEngine`, the three above for one param_group, as the
  optimizer builds, checks (:meth:`GroupEngine.matches`) and steps it.

The optimizer (:mod:`deepmd_hybridmuon.optimizer`) keeps validation, state and dispatch,
and its per-parameter loop is the specification every engine path is tested against
(``tests/test_parity.py``).
"""

from __future__ import annotations

from .compilation import triton_runs_on
from .group import GroupEngine

__all__ = ["GroupEngine", "triton_runs_on"]
