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
  ``step.compute`` is captured once per executor (an engine has one for its step, and one for its masked step
  once a step leaves a parameter out), the torch stacks on a high-priority side stream beside
  the Triton launches (they are the step's critical path). cuBLAS keeps a workspace (32 MiB
  on Hopper) for each (handle, stream) it runs on, so every capture of a thread uses the same
  two streams (:func:`stream`), and the engine's products run on the side one. This holds on
  the torch path while the Triton kernels compile too: they compile in another process, and
  this one loads them only between steps, when the optimizer asks whether they are ready (and
  then builds a new engine, which captures anew), never inside a capture.
* **Collectives.** A collective of the step (FSDP2's exchanges) runs through
  :func:`between_graphs`. Captured, the step is cut there: it replays as its graphs with the
  collectives run eagerly between them, in the captured order (a collective inside a graph would
  replay without the process group's host bookkeeping). The graphs share one memory pool, and the
  tensors a collective reads and writes live as long as the capture.
* **Replay.** Every later step replays that capture. Its graphs hold the addresses of the
  layout's buffers and of the parameters: anything that changes them (other parameters,
  a loaded state dict, ...) needs a new layout, hence a new executor; the optimizer
  rebuilds the engine then (its signature).
* Elsewhere (the CPU, ``use_graph`` off) every step runs ``step.compute`` eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
import warnings
from collections.abc import Callable

import torch

from .batched import BatchedStep, Lane

#: Eager steps before a CUDA graph of the step is captured.
GRAPH_WARMUP = 2
#: Pinned host buffers in the staging ring.
RING = 4


#: The capture in progress (:meth:`Executor._capture`), or ``None``.
_CAPTURING: contextvars.ContextVar[_Capture | None] = contextvars.ContextVar(
    "deepmd_hybridmuon_capturing", default=None
)


def between_graphs(call: Callable[[], None]) -> None:
    """Run ``call``, a collective of the step: now, or, while the step is captured, between two of its graphs."""
    capture = _CAPTURING.get()
    if capture is None:
        call()
    else:
        capture.cut(call)


class _Capture:
    """A step captured as CUDA graphs cut at its collectives; :meth:`replay` runs them and the collectives in order.

    The capture runs in "thread_local" mode: the process group's watchdog thread queries its own
    events meanwhile.
    """

    def __init__(self, join: Callable[[], None]) -> None:
        self.join = join  # a graph ends only once the side stream has joined the capture stream
        self.pool = torch.cuda.graph_pool_handle()
        self.parts: list[Callable[[], None]] = []
        self._begin()

    def _begin(self) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def end(self) -> None:
        """End the graph being captured."""
        self.join()
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
        """The step: its graphs and collectives, in order."""
        for part in self.parts:
            part()


@functools.cache
def stream(device: torch.device, priority: int, thread: int) -> torch.cuda.Stream:
    """The stream of ``priority`` on ``device`` for ``thread``: a capture's (0) or its side stream (-1, high).

    One per thread: two threads capturing at once must not share a stream.
    """
    return torch.cuda.Stream(device, priority=priority)


class SideLane(Lane):
    """The torch stacks on the side stream (while capturing), each part after what the current stream queued."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = stream(device, -1, threading.get_ident())
        self.forked = False

    def __call__(self) -> contextlib.AbstractContextManager:
        """The side stream, after everything the current stream has queued."""
        self.side.wait_stream(torch.cuda.current_stream(self.device))
        self.forked = True
        return torch.cuda.stream(self.side)

    def join(self) -> None:
        """The current stream waits for the side stream, if used since the last join (it then takes part)."""
        if self.forked:
            torch.cuda.current_stream(self.device).wait_stream(self.side)
            self.forked = False


class Executor:
    """Stages the inputs of ``step`` and runs it: eagerly, or captured once and replayed (module docstring)."""

    def __init__(self, step: BatchedStep, use_graph: bool) -> None:
        layout = step.layout
        self.step = step
        self.device = layout.device
        self.use_graph = use_graph and self.device.type == "cuda"
        self.capture: _Capture | None = None
        self.eager_steps = 0
        # Host side of StepInputs.scalars: a ring of pinned buffers.
        pinned = self.device.type == "cuda"
        size = step.inputs.scalars.numel()
        self.host = [torch.zeros(size, dtype=torch.float64, device="cpu", pin_memory=pinned) for _ in range(RING)]
        self.host_scalars = [h.numpy() for h in self.host]  # writable views
        self.events = [torch.cuda.Event() if pinned else None for _ in self.host]
        self.turn = 0

    def stage(
        self, scalars: list[float], views: list[torch.Tensor], grads: list[torch.Tensor], shared: torch.Tensor | None
    ) -> None:
        """Move this step's scalars, gradients (into their ``views`` of the flat buffer) and agreed gate into place."""
        inputs = self.step.inputs
        turn = self.turn = (self.turn + 1) % len(self.host)
        host, event = self.host[turn], self.events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run (at once, in practice)
        self.host_scalars[turn][:] = scalars
        torch._foreach_copy_(views, grads)
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
        lane = SideLane(self.device)
        torch.cuda.synchronize(self.device)  # the staged inputs are in place before the capture stream reads them
        with torch.cuda.stream(stream(self.device, 0, threading.get_ident())):
            capture = _Capture(lane.join)
            token = _CAPTURING.set(capture)
            try:
                self.step.compute(lane)
            except BaseException:
                with contextlib.suppress(RuntimeError):  # end the failed capture; the first error is the one to see
                    capture.end()
                raise
            finally:
                _CAPTURING.reset(token)
            capture.end()
        self.capture = capture
