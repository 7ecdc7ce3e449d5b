"""The flat engine of one param_group: a layout, its batched step, and the executor that runs it."""

from __future__ import annotations

import operator
from itertools import starmap
from typing import Any

import torch

from .. import functional as F
from ..dtensor import is_dtensor, laid_out_like, local_shard
from . import compilation
from .batched import BatchedStep, StepInputs
from .execution import Executor
from .layout import Layout, assign


class GroupEngine:
    """The flat engine of one param_group, built by the optimizer.

    Subclasses change what the layout holds and how the step runs through :attr:`PATHS`
    and :meth:`_batched` (``distributed.ShardedEngine``: FSDP2's shards).

    Parameters
    ----------
    group
        The param_group. Empty parameters are left out, and so are those without a gradient, unless holding them
        changes nothing (:meth:`_holds`: a multi-task model's other branches); a step leaves those without a gradient
        as they are. The engine holds as long as :meth:`matches` says so.
    routes
        The route of every parameter of ``group["params"]``, in order.
    state
        The optimizer's state (its entries become views of the engine's flat buffers); the engine
        holds as long as :meth:`matches` finds them there.
    signature
        What the optimizer built this engine from (its own versions and options); kept as
        :attr:`signature`, for the optimizer to compare.
    flash_muon
        Use the Triton kernels where they run (:func:`.compilation.triton_runs_on`).
    shared_gate
        The finite gate comes in through :meth:`step`'s ``shared`` (``nonfinite_across_ranks``).
    cuda_graph
        On CUDA, capture the arithmetic in a CUDA graph and replay it (:mod:`.execution`).
    """

    #: Whether the layout assigns the Muon matrices to Triton launches and torch stacks (:class:`.layout.Layout`).
    PATHS = True

    def __init__(
        self,
        group: dict[str, Any],
        routes: list[F.ParamRoute],
        state: dict,
        *,
        signature: Any,
        flash_muon: bool,
        shared_gate: bool,
        cuda_graph: bool,
    ) -> None:
        self.signature = signature
        self.group_params = list(group["params"])
        self.sharded = any(map(is_dtensor, self.group_params))  # FSDP2's DTensors: the step writes their local shards
        self.magma = bool(group["magma_muon"])
        nonempty = [(p, r) for p, r in zip(self.group_params, routes, strict=True) if p.numel() > 0]
        active = [(p, r) for p, r in nonempty if self._holds(p, r, state)]
        self.gradless = [p for p, r in nonempty if not self._holds(p, r, state)]
        self.active = active  # (parameter, route) of those it steps, in group order
        params, active_routes = [p for p, _ in active], [r for _, r in active]
        kernels, self.compiling = self._kernels(group, params, active_routes, flash_muon and self.PATHS)
        self.layout = Layout(params, active_routes, state, group, kernels, self.PATHS)
        # What the step reads and writes of the optimizer's state: each parameter's entry, and the tensors in it
        # (views of the layout's buffers), checked by matches
        self.entries = [state[p] for p in self.layout.keys]
        self.held = [(entry, key) for entry in self.entries for key, value in entry.items() if torch.is_tensor(value)]
        self.held_tensors = [entry[key] for entry, key in self.held]
        self.shared_gate = shared_gate
        self.batched = self._batched(group, StepInputs(self.layout), shared_gate, flash_muon)
        self.executor = Executor(self.batched, cuda_graph)
        self.masked: tuple[BatchedStep, Executor] | None = None  # the step of some parameters without a gradient
        self.ran = self.executor  # the executor of the last step

    def _holds(self, p: torch.Tensor, route: F.ParamRoute, state: dict) -> bool:
        """Whether the engine holds ``p``: it has a gradient, or holding it leaves it as the loop does.

        A parameter without a gradient takes no part in the step (the loop does not see it): the engine holds it,
        masked, only when it is trainable, no shard, and its state is the layout's as it stands: its route's, of its
        shape, and with Magma one score per matrix of its view (after a change of ``muon_mode`` the loop lays the
        scores out again at its next step, not before). A frozen parameter (``requires_grad`` off) is left out: it
        would cost a masked step, and its Newton-Schulz, at every step.
        """
        if p.grad is not None:
            return True
        entry = state.get(p, {})
        value, score = entry.get("momentum_buffer" if route.route == "muon" else "exp_avg"), entry.get("magma_score")
        return (
            p.requires_grad
            and not self.sharded
            and getattr(value, "shape", None) == p.shape
            and (route.route != "muon" or not self.magma or getattr(score, "shape", None) == (route.view[0],))
        )

    def _batched(self, group: dict[str, Any], inputs: StepInputs, shared_gate: bool, flash_muon: bool) -> BatchedStep:
        """The step on :attr:`layout`'s buffers."""
        return BatchedStep(self.layout, inputs, shared_gate)

    @staticmethod
    def _kernels(
        group: dict[str, Any], params: list[torch.Tensor], routes: list[F.ParamRoute], flash_muon: bool
    ) -> tuple[Any, Any]:
        """The kernels module if every launch of the layout is compiled, and the pending compilation if not.

        Until Triton has compiled the launches of the layout (in the background) every
        matrix takes the torch path; the engine is then :attr:`outdated` once they are ready.
        """
        device, dtype = params[0].device, params[0].dtype
        if not (flash_muon and compilation.triton_runs_on(device)):
            return None, None
        K = compilation.kernels()
        views = [r.view for r in routes if r.route == "muon"]
        paths = [(f.use_gram, f.rows, f.cols) for f in assign(views, K, bool(group["enable_gram"]))[0]]
        ready = compilation.request(device, dtype, paths)
        if ready is None or not ready.is_set():  # compiling, or a kernel failed to compile
            return None, ready
        return K, None

    @staticmethod
    def supports(group: dict[str, Any], state: dict) -> bool:
        """Whether the flat engine can run this group (one dtype and device, floating point, every momentum in it).

        ``state`` is the optimizer's. A momentum keeps its dtype in the loop when its parameter's data takes
        another (``p.data = p.data.double()`` after steps); the engine's flat momentum has the parameters' dtype.
        """
        params = [
            p for p in group["params"] if p.numel() > 0 and (p.grad is not None or (p.requires_grad and state.get(p)))
        ]
        if not params:
            return False
        first = params[0]
        momenta = [state[p]["momentum_buffer"] for p in params if "momentum_buffer" in state.get(p, ())]
        return (
            first.is_floating_point()
            and all(p.dtype == first.dtype and p.device == first.device for p in params)
            and all(m.dtype == first.dtype for m in momenta)
        )

    def matches(self, group: dict[str, Any], state: dict) -> bool:
        """The same parameters, storage and shapes as at build, no new one with a gradient, none frozen; the same state.

        A parameter's storage changes with ``p.data = ...`` (e.g. ``module.half()`` after the
        optimizer was built); the engine would otherwise go on writing to the old memory. Its
        shape alone changes with ``p.data = p.data.view(...)``: the routes and views change.
        ``state`` is the optimizer's: each parameter's entry must be the one built with, holding the
        same tensors. After ``state.clear()``, ``del state[p]`` or a tensor put into an entry the loop
        starts that state afresh or steps the new tensor; so does a new engine.
        """
        params = group["params"]
        if len(params) != len(self.group_params) or any(
            a is not b for a, b in zip(params, self.group_params, strict=True)
        ):
            return False
        L = self.layout
        local = [local_shard(p) for p in L.keys] if self.sharded else L.keys  # the tensors the step writes, as now
        # Every step: list comparisons and C-level maps, a few microseconds for a hundred parameters.
        return (
            list(map(torch.Tensor.data_ptr, local)) == L.storage
            and [t.shape for t in local] == L.shapes
            and all(p.grad is not None or self._holds(p, route, state) for p, route in self.active)  # none frozen
            and all(p.grad is None for p in self.gradless)
            and all(map(operator.is_, map(state.get, L.keys), self.entries))
            and all(map(operator.is_, starmap(dict.get, self.held), self.held_tensors))
        )

    def release(self) -> None:
        """As the engine goes: each state tensor it put into the optimizer's state, still there, gets its own storage.

        They are views of the flat buffers: one of a parameter the next engine leaves out (frozen, say) would keep
        this engine's buffers alive, whole, as long as the state lives.
        """
        for (entry, key), tensor in zip(self.held, self.held_tensors, strict=True):
            if entry.get(key) is tensor:
                entry[key] = tensor.clone()

    @property
    def outdated(self) -> bool:
        """Built with the torch path while Triton compiled, and the kernels are ready now."""
        return self.compiling is not None and self.compiling.is_set()

    def step(self, group: dict[str, Any], shared: torch.Tensor | None = None) -> torch.Tensor | None:
        """One step of the whole group, as the loop's :func:`~deepmd_hybridmuon.loop.step_group`.

        ``shared`` is the finite gate agreed across ranks (``nonfinite_across_ranks``), else ``None``.
        Returns the step's finite gate (a device scalar, 1.0 when the step was taken); ``None`` when no parameter
        has a gradient.
        """
        if self.shared_gate and shared is None:
            raise RuntimeError("the flat engine was built with a shared finite gate; step() got none")
        L, shared = self.layout, shared if self.shared_gate else None
        # The gradients first: a failure there leaves the Adam powers (advanced by scalars) as they were.
        grads = [p.grad for p in L.keys]
        present = [g is not None for g in grads]
        if not any(present):  # nothing to step: as in the loop, no step and no gate
            return None
        if all(present):
            step, executor, views = self.batched, self.executor, L.grad_views
            if self.sharded:
                grads = [local_shard(laid_out_like(g, p)) for g, p in zip(grads, L.keys, strict=True)]
        else:
            if self.masked is None:
                masked = BatchedStep(L, StepInputs(L, masked=True), self.shared_gate, masked=True)
                self.masked = (masked, Executor(masked, self.executor.use_graph))
            step, executor = self.masked
            # each gradient in its place; a parameter without one: zeros (BatchedStep's masked step)
            pairs = [(v, p.grad) for p, v in zip(L.keys, L.grad_views, strict=True) if p.grad is not None]
            views, grads = [v for v, _ in pairs], [g for _, g in pairs]
            torch._foreach_zero_([v for p, v in zip(L.keys, L.grad_views, strict=True) if p.grad is None])
        executor.stage(step.scalars(group, present), views, grads, shared)
        self.ran = executor
        executor.run()
        return step.ok

    def summary(self) -> dict[str, Any]:
        """How this engine runs its group (see ``HybridMuonOptimizer.execution_table``)."""
        L = self.layout
        kernels = "triton" if L.triton else ("compiling" if self.compiling is not None else "torch")
        return {
            "implementation": "engine",
            "kernels": kernels,
            "cuda_graph": self.ran.captured,
            "program_matrices": sum(len(f.meta) for f in L.fused_paths),
            "torch_matrices": [(b.rows, b.cols) for b in L.buckets for _ in b.members],
        }
