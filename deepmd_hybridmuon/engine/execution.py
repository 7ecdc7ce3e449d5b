"""Running a :class:`~.batched.BatchedStep`: host staging, CUDA-graph capture and replay, side streams.

Contract of :class:`Executor`:

* **Static inputs.** ``step.compute`` reads only tensors allocated once: the layout's
  buffers and the step's :class:`~.batched.StepInputs`. Everything that changes from step
  to step enters through :meth:`Executor.stage`, before the arithmetic runs: the
  step's scalars (learning rate, decays, momentum, betas, each Adam parameter's bias
  corrections: :meth:`~.batched.BatchedStep.scalars`) in ONE host-to-device copy from a
  pinned buffer, the gradients by a ``_foreach_copy_`` into the flat gradient buffer, the finite gate agreed
  across ranks by a device copy. Nothing in a step synchronises the host with the GPU.
* **Pinned ring.** The host buffers are a ring of four pinned tensors; one is reused
  once the copy that last read it has run (its event; at once, in practice).
* **Capture.** On CUDA with ``use_graph``, after :data:`GRAPH_WARMUP` eager steps (so
  cuBLAS and the caching allocator settle, as torch's CUDA-graph notes advise),
  ``step.compute`` is captured once, each independent chain (torch bucket, Adam routes)
  on a high-priority side stream of its own (they are the step's critical path). This
  holds on the torch path while the Triton kernels compile too: they compile in another
  process, and this one loads them only between steps, when the optimizer asks whether
  they are ready (and then builds a new engine), never inside a capture.
* **Replay.** Every later step replays that graph. The graph holds the addresses of the
  layout's buffers and of the parameters: anything that changes them (other parameters,
  a loaded state dict, ...) needs a new layout, hence a new executor; the optimizer
  rebuilds the engine then (its signature).
* Elsewhere (the CPU, ``use_graph`` off) every step runs ``step.compute`` eagerly.
"""

from __future__ import annotations

import contextlib

import torch

from .batched import BatchedStep, Lanes

#: Eager steps before a CUDA graph of the step is captured.
GRAPH_WARMUP = 2
#: Pinned host buffers in the staging ring.
RING = 4


class SideStreams(Lanes):
    """Lanes on streams of their own (while capturing), each starting after what the current stream queued."""

    def __init__(self, device: torch.device, count: int) -> None:
        self.device = device
        # High priority: these chains are the step's critical path. Run on the current stream
        # instead, the step was slower on every model measured (BENCHMARKS.md, "Why side streams").
        self.streams = [torch.cuda.Stream(device, priority=-1) for _ in range(count)]

    def lane(self, i: int) -> contextlib.AbstractContextManager:
        """Side stream ``i``, after everything the current stream has queued."""
        side = self.streams[i]
        side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(side)

    def join(self) -> None:
        """The current stream waits for every side stream."""
        main = torch.cuda.current_stream(self.device)
        for side in self.streams:
            main.wait_stream(side)


class Executor:
    """Stages the inputs of ``step`` and runs it: eagerly, or captured once and replayed (module docstring)."""

    def __init__(self, step: BatchedStep, use_graph: bool) -> None:
        layout = step.layout
        self.step = step
        self.device = layout.device
        self.use_graph = use_graph and self.device.type == "cuda"
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager_steps = 0
        self.grad_views = layout.grad_views
        # Host side of StepInputs.scalars: a ring of pinned buffers.
        pinned = self.device.type == "cuda"
        size = step.inputs.scalars.numel()
        self.host = [torch.zeros(size, dtype=torch.float64, device="cpu", pin_memory=pinned) for _ in range(RING)]
        self.host_scalars = [h.numpy() for h in self.host]  # writable views
        self.events = [torch.cuda.Event() if pinned else None for _ in self.host]
        self.turn = 0

    def stage(self, scalars: list[float], grads: list[torch.Tensor], shared: torch.Tensor | None) -> None:
        """Move this step's scalars, gradients and (if given) agreed finite gate into the static inputs."""
        inputs = self.step.inputs
        turn = self.turn = (self.turn + 1) % len(self.host)
        host, event = self.host[turn], self.events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run (at once, in practice)
        self.host_scalars[turn][:] = scalars
        torch._foreach_copy_(self.grad_views, grads)
        inputs.scalars.copy_(host, non_blocking=event is not None)
        if event is not None:
            event.record()
        if shared is not None:
            inputs.ok.copy_(shared, non_blocking=True)

    def run(self) -> None:
        """The arithmetic of the staged step: replayed, captured now, or eager."""
        if self.use_graph and self.graph is None and self.eager_steps >= GRAPH_WARMUP:
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step.compute()
            self.eager_steps += 1

    @property
    def captured(self) -> bool:
        """Whether steps replay a captured CUDA graph."""
        return self.graph is not None

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        lanes = SideStreams(self.device, self.step.layout.lanes)
        with torch.cuda.graph(graph):
            self.step.compute(lanes)
        self.graph = graph
