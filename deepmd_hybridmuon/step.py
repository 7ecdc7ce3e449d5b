"""The order of one param_group's step, written once: :func:`run` calls the phases of a :class:`Phases`.

Every implementation of the step supplies the same phases on its own storage and lets
:func:`run` call them:

* :mod:`.loop` (the reference): one parameter at a time, on the optimizer's state;
* the flat engine (:mod:`.engine.batched`): batched over the group's flat buffers, eager or
  captured in a CUDA graph;
* FSDP2 (:mod:`.distributed.fsdp`, with :mod:`.distributed.local`): the flat engine on each rank's
  shards, the Newton–Schulz on the matrices' owners, captured as CUDA graphs cut at its collectives.

The phases, in order:

1. ``gate``: the finite gate (1.0, or 0.0 when a gradient is not finite or beyond its limit:
   :func:`~.functional.finite_gate`), agreed across ranks where the implementation needs it. A
   step with gate 0.0 still runs every phase, with every change multiplied by the gate, so that
   no phase waits for the device to read it.
2. ``adam``: the Adam and AdamW routes. They read and write no element that phases 3-5 touch,
   so an implementation may run them beside those.
3. ``before_orthogonalize``: Muon's decoupled weight decay, the momentum, Magma's partial sums
   (of the momentum and the gradient), and the Nesterov update.
4. ``complete_sums``: Magma's sums over whole matrices; nothing to do in one process, one
   all-reduce of the shards' partial sums under FSDP2.
5. ``orthogonalize``: Magma's multiplier, then Newton–Schulz of each update, times the Muon scale,
   the multiplier and ``-lr``. An implementation may start the Newton–Schulz of its updates
   earlier, in ``before_orthogonalize`` (the engine's torch stacks do), since it reads
   only the update; the factors are applied here.
6. ``apply``: the parameters take their updates. An implementation may write a parameter
   earlier, once its update exists (the loop: each Muon matrix in ``orthogonalize``, one
   update alive at a time), or defer the weight decay and the Adam update here (the engine:
   each parameter written once).

Phases 3-5 run only when the group has Muon matrices in this step (:attr:`Phases.has_muon`).
"""

from __future__ import annotations

from typing import Protocol

import torch


class Phases(Protocol):
    """One step of one param_group, phase by phase, on one implementation's storage."""

    @property
    def has_muon(self) -> bool:
        """Whether phases 3-5 have work: the group has Muon matrices in this step."""
        ...

    @property
    def ungated(self) -> bool:
        """Whether the phases take ``ok`` as ``None`` for a step known to be taken (:func:`run`)."""
        ...

    def gate(self) -> torch.Tensor:
        """The step's finite gate: a float32 scalar on the device, 1.0 (take the step) or 0.0."""
        ...

    def adam(self, ok: torch.Tensor | None) -> None:
        """The Adam and AdamW routes, gated by ``ok``."""
        ...

    def before_orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Muon's weight decay, the momentum, Magma's partial sums, and the Nesterov update."""
        ...

    def complete_sums(self) -> None:
        """Magma's partial sums completed over whole matrices (across ranks)."""
        ...

    def orthogonalize(self, ok: torch.Tensor | None) -> None:
        """Magma's multiplier and each Muon matrix's scaled, orthogonalised update."""
        ...

    def apply(self, ok: torch.Tensor | None) -> None:
        """Every update written into its parameter."""
        ...


def run(phases: Phases) -> torch.Tensor:
    """One step: the phases of ``phases`` in the order of the module docstring; returns the finite gate."""
    ok = phases.gate()
    # On the CPU reading the gate costs nothing: a step known to be taken runs without the gating arithmetic
    # (``ok`` None: every change multiplied by 1), for the implementations that can (:attr:`Phases.ungated`).
    gated = None if phases.ungated and ok.device.type == "cpu" and bool(ok) else ok
    phases.adam(gated)
    if phases.has_muon:
        phases.before_orthogonalize(gated)
        phases.complete_sums()
        phases.orthogonalize(gated)
    phases.apply(gated)
    return ok
