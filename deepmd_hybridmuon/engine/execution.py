"""Running a :class:`~.batched.BatchedStep`: host staging, CUDA-graph capture and replay.

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
  ``step.compute`` is captured once, on a stream of the capturing thread's own. This holds on
  the torch path while the Triton kernels compile too: they compile in another process, and
  this one loads them only between steps, when the optimizer asks whether they are ready (and
  then builds a new engine, which captures anew), never inside a capture.
* **Cuts.** What the step runs through :func:`~.batched.between_graphs` (FSDP2's collectives, the
  torch stacks' products) is not captured: the step is cut there and replays as its graphs with
  those calls run eagerly between them, in the captured order (a collective inside a graph would
  replay without the process group's host bookkeeping; a cuBLAS product would keep a workspace
  for the capture's stream). The graphs share one memory pool, and the tensors a cut call reads
  and writes live as long as the capture.
* **Replay.** Every later step replays that capture. Its graphs hold the addresses of the
  layout's buffers and of the parameters: anything that changes them (other parameters,
  a loaded state dict, ...) needs a new layout, hence a new executor; the optimizer
  rebuilds the engine then (its signature).
* Elsewhere (the CPU, ``use_graph`` off) every step runs ``step.compute`` eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable

import torch

from .batched import CAPTURING, BatchedStep

#: Eager steps before a CUDA graph of the step is captured.
GRAPH_WARMUP = 2
#: Pinned host buffers in the staging ring.
RING = 4


class _Capture:
    """A step captured as CUDA graphs cut at its eager calls; :meth:`replay` runs graphs and calls in order.

    The capture runs in "thread_local" mode: the process group's watchdog thread queries its own
    events meanwhile.
    """

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.parts: list[Callable[[], None]] = []
        self._begin()

    def _begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        """End the graph being captured."""
        with warnings.catch_warnings():  # a rank that owns no matrix launches nothing between the exchanges
            warnings.filterwarnings("ignore", "The CUDA Graph is empty")
            self.graph.capture_end()
        self.parts.append(self.graph.replay)

    def cut(self, call: Callable[[], None]) -> None:
        """End the graph being captured, then ``call`` at each replay, then capture the next graph."""
        self.end()
        self.parts.append(call)
        self._begin()

    def replay(self) -> None:
        """The step: its graphs and eager calls, in order."""
        for part in self.parts:
            part()


@functools.cache
def capture_stream(device: torch.device, thread: int) -> torch.cuda.Stream:
    """The stream ``thread`` captures on, on ``device``: two threads capturing at once must not share one."""
    return torch.cuda.Stream(device)


class Executor:
    """Stages the inputs of ``step`` and runs it: eagerly, or captured once and replayed (module docstring)."""

    def __init__(self, step: BatchedStep, use_graph: bool) -> None:
        layout = step.layout
        self.step = step
        self.device = layout.device
        self.use_graph = use_graph and self.device.type == "cuda"
        self.capture: _Capture | None = None
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
        if self.use_graph and self.capture is None and self.eager_steps >= GRAPH_WARMUP:
            self._capture()
        if self.capture is not None:
            self.capture.replay()
        else:
            self.step.compute()
            self.eager_steps += 1

    @property
    def captured(self) -> bool:
        """Whether steps replay a captured CUDA graph."""
        return self.capture is not None

    def _capture(self) -> None:
        torch.cuda.synchronize(self.device)  # the staged inputs are in place before the capture stream reads them
        with torch.cuda.stream(capture_stream(self.device, threading.get_ident())):
            capture = _Capture()
            token = CAPTURING.set(capture)
            try:
                self.step.compute()
            except BaseException:
                with contextlib.suppress(RuntimeError):  # end the failed capture; the first error is the one to see
                    capture.end()
                raise
            finally:
                CAPTURING.reset(token)
            capture.end()
        self.capture = capture
