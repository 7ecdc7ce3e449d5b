"""The flat engine: the same step as the per-parameter loop, in a fixed set of batched kernels.

DeePMD models have many small matrices, so a per-tensor step is bound by kernel
launches, not arithmetic. The engine keeps the per-parameter state as views of a few
flat buffers (so ``state[p]["momentum_buffer"]`` etc. stay ordinary tensors in the
built-in layout) and runs every elementwise rule once over a whole route. One flat
gradient buffer and one flat update buffer hold the Adam parameters first, then the Muon
ones:

* in: the gradients are copied into the flat buffer and checked for non-finite values
  (one ``_foreach_copy_`` and a two-pass check; with the Triton kernels, one launch that
  reads every gradient through a table of addresses and flags each span);
* Adam/AdamW: a few flat moment/denominator kernels into the update buffer;
* Muon: momentum and Nesterov update (one kernel with Triton), then per matrix a factor
  (Muon scale x Magma x -lr) and the orthogonalised update times that factor:
  - with ``flash_muon`` on CUDA, matrices whose smaller side is at most
    ``kernels.MAX_ROWS`` go to the Triton kernels of ``kernels.py`` (one launch per
    path, five for long matrices; Magma in two launches), and those with a smaller side up
    to ``kernels.MAX_PHASED_ROWS`` to one persistent Triton launch per padded shape
    (``kernels.orthogonalize_phased``), on a stream of its own like a torch bucket;
  - the others (all of them without the kernels) are copied (one strided copy per
    parameter) into zero-padded ``(batch, M, N)`` stacks in wide orientation and
    orthogonalised by the torch functions of ``functional.py``, one call per bucket.
    Zero padding commutes with both Newton–Schulz variants in exact arithmetic (zero rows
    and columns stay zero; the Gram matrix of the real rows is unchanged), so only
    rounding differs from the loop;
* out: ``p <- p * decay + update`` (a ``_foreach_mul_`` and a ``_foreach_add_``; with
  the Triton kernels, one launch over a table of the parameters' addresses).

On CUDA the arithmetic is captured once as a CUDA graph and replayed (see ``step``). Each
torch bucket runs on a stream of its own and starts as soon as the Nesterov update exists,
alongside Adam, Magma and the Triton launches; the learning-rate dependent scalars (and the
gradients' addresses) reach the device in one copy from pinned memory. No host
synchronisation happens inside a step. The engine is rebuilt whenever what it was built
from changes (parameters with gradients, names, routing options, a loaded state dict, the
Triton kernels becoming ready).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from . import functional as F

__all__ = ["GroupEngine", "bucket_key", "is_dtensor", "triton_runs_on"]


def triton_runs_on(device: torch.device) -> bool:
    """Whether the Triton kernels of ``kernels.py`` can run on ``device``.

    On CUDA (compute capability 8.0 or newer) when Triton is installed; on the CPU only under Triton's interpreter
    (``TRITON_INTERPRET=1``, used by the tests to run the kernels without a GPU).
    """
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if device.type not in ("cuda", "cpu"):
        return False
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False  # bfloat16 tensor-core products need compute capability 8.0 (A100) or newer
    try:
        from . import kernels  # noqa: F401  (imports triton)
    except ImportError:
        return False
    return True


def bucket_key(min_dim: int, device: torch.device) -> int:
    """Bucket of a matrix by its smaller side.

    On CUDA one bucket per path: padding costs idle FLOPs but saves launches, which
    dominate at DeePMD sizes. On the CPU, FLOPs cost: bucket by the next power of two.
    """
    if device.type == "cuda":
        return 0
    return 1 << max(0, (min_dim - 1).bit_length())


@dataclass
class _Bucket:
    use_gram: bool
    batch: int = 0
    rows: int = 0  # M: the padded smaller side
    cols: int = 0  # N: the padded larger side
    members: list[tuple[int, int, int, int, int, bool]] = field(default_factory=list)
    # (flat offset, batch, rows, cols, batch offset in bucket, transposed)
    src: torch.Tensor | None = None  # positions in the flat Muon vector
    dst: torch.Tensor | None = None  # positions in the padded stack
    stack: torch.Tensor | None = None  # persistent zero-padded input
    blocks: list[int] = field(default_factory=list)  # global block index of each stack row
    # per member: (flat offset, batch, rows, cols, transposed, its part of the stack)
    inputs: list[tuple[int, int, int, int, bool, torch.Tensor]] = field(default_factory=list)
    # per member: (batch offset in bucket, batch, its muon_delta in wide orientation)
    outputs: list[tuple[int, int, torch.Tensor]] = field(default_factory=list)
    block_ids: torch.Tensor | None = None


@dataclass
class _Fused:
    """Matrices of one path orthogonalised by one Triton launch (``kernels.orthogonalize_blocks``)."""

    use_gram: bool
    rows: int = 0  # largest smaller side
    cols: int = 0  # largest larger side
    meta: list[list[int]] = field(default_factory=list)  # kernels.META_COLS integers per matrix
    size: int = 0  # workspace elements
    table: torch.Tensor | None = None
    work: torch.Tensor | None = None
    coefs: torch.Tensor | None = None
    # the panel path of long matrices (kernels.orthogonalize_panels) and its workspaces
    panelled: bool = False
    panels: torch.Tensor | None = None
    first: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    q: torch.Tensor | None = None
    inv: torch.Tensor | None = None


@dataclass
class _Phased:
    """Matrices of one path too large for one program: phased tiles (``kernels.orthogonalize_phased``)."""

    use_gram: bool
    shape: tuple[int, int]  # the padded (m, n) of every matrix of the group (kernels.padded)
    matrices: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    # (flat offset, m, n, row stride, column stride, block) in the wide orientation
    meta: torch.Tensor | None = None
    partial: torch.Tensor | None = None
    work: torch.Tensor | None = None
    coefs: torch.Tensor | None = None
    counter: torch.Tensor | None = None
    programs: int = 1


#: Eager steps before a CUDA graph of the step is captured (lets cuBLAS and the caching
#: allocator settle, as torch's CUDA-graph notes advise).
GRAPH_WARMUP = 2


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (an FSDP2-sharded tensor)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(t, DTensor)


def _compiling() -> bool:
    """Whether Triton kernels are compiling in the background (kernels.prepare).

    A graph is not captured meanwhile: loading the compiled kernels loads modules and allocates,
    which CUDA forbids during a capture. The eager step runs instead.
    """
    kernels = sys.modules.get(f"{__package__}.kernels")
    return kernels is not None and not kernels.wait_ready(0)


def _split_views(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [v.view_as(p) for v, p in zip(flat.split([p.numel() for p in params]), params, strict=True)]


class GroupEngine:
    """Flat buffers and index maps of one param_group; built by the optimizer."""

    def __init__(self, optimizer: Any, group: dict[str, Any]) -> None:
        self.group_params = list(group["params"])
        params = [p for p in self.group_params if p.numel() > 0 and p.grad is not None]
        self.gradless = [p for p in self.group_params if p.numel() > 0 and p.grad is None]
        self.signature = self.signature_of(optimizer, group)
        dev, dtype = params[0].device, params[0].dtype
        self.device, self.dtype = dev, dtype
        routes = [optimizer.route_of(p, group) for p in params]
        self.adam = [p for p, r in zip(params, routes, strict=True) if r.route != "muon"]
        self.adamw = [p for p, r in zip(params, routes, strict=True) if r.route == "adamw"]
        self.muon = [(p, r.view) for p, r in zip(params, routes, strict=True) if r.route == "muon"]
        self.betas = tuple(float(b) for b in group["adam_betas"])
        self.beta = float(group["momentum"])
        self.weight_decay = float(group["weight_decay"]) > 0
        self.fused = bool(optimizer.flash_muon) and triton_runs_on(dev)
        # The finite gate agreed across ranks comes in through a static buffer (the step's
        # own gate is computed inside the captured graph otherwise).
        self.shared_gate = bool(optimizer.nonfinite_across_ranks)
        self.ok_in = torch.ones((), dtype=torch.float32, device=dev)
        # One flat gradient buffer and one flat update buffer, Adam parameters first: one
        # copy in, one finite check and one update pass per step.
        self.staged = self.adam + [p for p, _ in self.muon]
        numels = [p.numel() for p in self.staged]
        self.grad = torch.zeros(sum(numels), dtype=dtype, device=dev)
        self.delta = torch.zeros_like(self.grad)
        self.grad_views = _split_views(self.grad, self.staged)
        self.delta_views = _split_views(self.delta, self.staged)
        self.step_grads = [p.grad for p in self.staged]
        self._build_adam(optimizer.state)
        self._build_muon(optimizer.state, group)
        # The step's scalars (5 float64) and, with the Triton kernels, the gradients' addresses,
        # in one int64 buffer moved to the device by one copy. Host side: a ring of pinned
        # buffers, each reused once the copy that last read it has run (its event).
        size = 5 + (len(self.staged) if self.triton else 0)
        pinned = dev.type == "cuda"
        self.host_staged = [torch.zeros(size, dtype=torch.int64, device="cpu", pin_memory=pinned) for _ in range(4)]
        self.host_scalars = [h[:5].view(torch.float64).numpy() for h in self.host_staged]  # writable views
        self.host_addresses = [h[5:].numpy() for h in self.host_staged]
        self.host_events = [torch.cuda.Event() if pinned else None for _ in self.host_staged]
        self.host_turn = 0
        self.staged_in = torch.zeros(size, dtype=torch.int64, device=dev)
        self.scalars = self.staged_in[:5].view(torch.float64)
        if self.triton:
            self.grad_addresses = self.staged_in[5:]
            adamw = {id(p) for p in self.adamw} if self.weight_decay else set()
            decays = [2 if id(p) in adamw else 0 for p in self.adam]
            decays += [1 if self.weight_decay else 0] * len(self.muon)
            self.spans = torch.tensor(self._kernels().span_table(numels, decays), dtype=torch.int64, device=dev)
            self.span_finite = torch.ones(self.spans.size(0), dtype=torch.float32, device=dev)
            self.betas_t = torch.tensor([self.beta, 1.0 - self.beta], dtype=dtype, device=dev)
            self.update = torch.zeros_like(self.momentum)
            self.param_addresses = torch.tensor([p.data_ptr() for p in self.staged], dtype=torch.int64, device=dev)
        self.use_graph = dev.type == "cuda" and optimizer.cuda_graph
        self.graph: torch.cuda.CUDAGraph | None = None
        self.side_streams: list[torch.cuda.Stream] = []  # only while capturing
        self.eager_steps = 0

    @staticmethod
    def signature_of(optimizer: Any, group: dict[str, Any]) -> tuple[Any, ...]:
        """What the engine depends on; a change forces a rebuild."""
        return (
            optimizer._names_version,
            optimizer._state_version,
            optimizer.flash_muon,
            optimizer.nonfinite_across_ranks,
            group["muon_mode"],
            group["enable_gram"],
            group["magma_muon"],
            float(group["lr_adjust"]) <= 0,
            float(group["lr_adjust"]) if float(group["lr_adjust"]) > 0 else float(group["lr_adjust_coeff"]),
            # constants baked into the (possibly captured) computation
            tuple(float(b) for b in group["adam_betas"]),
            float(group["momentum"]),
            float(group["weight_decay"]) > 0,
        )

    def matches(self, group: dict[str, Any]) -> bool:
        """The same parameters as at build, with gradients on exactly the same ones.

        Also takes this step's gradient tensors (fresh ones each step) for the copies.
        """
        params = group["params"]
        if len(params) != len(self.group_params) or any(
            a is not b for a, b in zip(params, self.group_params, strict=True)
        ):
            return False
        self.step_grads = [p.grad for p in self.staged]
        if any(g is None for g in self.step_grads):
            return False
        return all(p.grad is None for p in self.gradless)

    @property
    def outdated(self) -> bool:
        """Built with the torch path while Triton compiled, and the kernels are ready now."""
        return self.compiling is not None and self.compiling.is_set()

    @staticmethod
    def supports(group: dict[str, Any]) -> bool:
        """Whether the flat engine can run this group (one dtype and device, floating point)."""
        params = [p for p in group["params"] if p.numel() > 0 and p.grad is not None]
        if not params:
            return False
        first = params[0]
        if any(is_dtensor(p) for p in params):
            return False  # FSDP2 shards: the loop handles them
        return first.is_floating_point() and all(p.dtype == first.dtype and p.device == first.device for p in params)

    # ------------------------------------------------------------------ build

    def _adopt(self, state: dict, params: list[torch.Tensor], key: str, flat: torch.Tensor) -> None:
        """Copy existing state into ``flat`` and make the state entries views of it."""
        views = _split_views(flat, params)
        for p, view in zip(params, views, strict=True):
            old = state[p].get(key)
            if isinstance(old, torch.Tensor) and old.shape == view.shape:
                view.copy_(old)
            state[p][key] = view

    def _build_adam(self, state: dict) -> None:
        n = sum(p.numel() for p in self.adam)
        kw = {"device": self.device, "dtype": torch.float32}
        self.exp_avg = torch.zeros(n, **kw)
        self.exp_avg_sq = torch.zeros(n, **kw)
        self.adam_delta = self.delta[:n]
        self.adam_grad = self.grad[:n]
        fresh = [p for p in self.adam if "exp_avg" not in state[p]]
        self._adopt(state, self.adam, "exp_avg", self.exp_avg)
        self._adopt(state, self.adam, "exp_avg_sq", self.exp_avg_sq)
        for p in fresh:
            state[p]["beta1_pow"] = 1.0
            state[p]["beta2_pow"] = 1.0
        self.adam_states = [state[p] for p in self.adam]  # a new state dict bumps _state_version
        # One pair of bias corrections serves all: the engine needs the Adam parameters at
        # one step count, and keeps them there (it steps them all together).
        pows = {(st["beta1_pow"], st["beta2_pow"]) for st in self.adam_states}
        self.adam_uniform = len(pows) <= 1

    def _build_muon(self, state: dict, group: dict[str, Any]) -> None:
        params = [p for p, _ in self.muon]
        n = sum(p.numel() for p in params)
        kw = {"device": self.device}
        self.momentum = torch.zeros(n, dtype=self.dtype, **kw)
        self._adopt(state, params, "momentum_buffer", self.momentum)
        self.muon_delta = self.delta[self.delta.numel() - n :]
        self.muon_grad = self.grad[self.grad.numel() - n :]

        # Blocks (one per matrix of each view) and their per-block Muon scale.
        lr_adjust, coeff = float(group["lr_adjust"]), float(group["lr_adjust_coeff"])
        lengths, scales = [], []
        for _, (bs, rows, cols) in self.muon:
            lengths += [rows * cols] * bs
            scales += [F.muon_scale(rows, cols, lr_adjust, coeff)] * bs
        self.block_scale = torch.tensor(scales, dtype=torch.float32, **kw)
        self.block_factor = torch.zeros_like(self.block_scale)  # scale x Magma x -lr, per step
        self.magma = bool(group["magma_muon"])
        if self.magma:
            self.scores = torch.full((len(lengths),), F.MAGMA_INITIAL_SCORE, dtype=torch.float32, **kw)
            split = [bs for _, (bs, _, _) in self.muon]
            for p, view in zip(params, self.scores.split(split), strict=True):
                old = state[p].get("magma_score")
                if isinstance(old, torch.Tensor) and old.shape == view.shape:
                    view.copy_(old)
                state[p]["magma_score"] = view

        # Each matrix goes to a Triton launch (small enough, ``flash_muon`` on) or to a
        # zero-padded stack of the torch path. Until Triton has compiled the launches of the
        # layout (in the background, kernels.prepare) every matrix takes the torch path.
        use_gram = bool(group["enable_gram"])
        K = self._kernels() if self.fused else None
        fused, phased, buckets = self._assign(K, use_gram)
        self.compiling: Any = None  # kernels.prepare's pending compilation, until ready
        if K is not None:
            paths = [(f.use_gram, f.rows, f.cols) for f in fused]
            paths += [(g.use_gram, *g.shape) for g in phased]
            ready = K.prepare(self.device, self.dtype, paths, self.magma)
            if ready is None or not ready.is_set():  # compiling, or a kernel failed to compile
                self.compiling, K = ready, None
                fused, phased, buckets = self._assign(None, use_gram)
        for f in fused:
            self._build_fused(K, f)
        self.fused_paths = fused
        for g in phased:
            self._build_phased(K, g, len(phased))
        self.phased_paths = phased
        self.triton = K is not None  # also copies the gradients in and applies the updates
        self.magma_kernel = self.triton and self.magma
        if self.magma_kernel:
            bounds, first = K.magma_chunks(lengths)
            self.magma_bounds = torch.tensor(bounds, dtype=torch.int64, **kw)
            self.magma_first = torch.tensor(first, dtype=torch.int64, **kw)
            self.magma_partial = torch.zeros(3 * (len(bounds) - 1), dtype=torch.float32, **kw)
        for b in buckets:
            self._build_bucket(b)
        self.buckets = buckets

    def _assign(self, K: Any, use_gram: bool) -> tuple[list[_Fused], list[_Phased], list[_Bucket]]:
        """Group the matrices into Triton launches (``K`` given) and torch buckets.

        With ``K``: one program per matrix up to ``K.MAX_ROWS``, phased tiles up to
        ``K.MAX_PHASED_ROWS``; the rest (everything without ``K``) into torch buckets.
        """
        fused: dict[tuple[bool, bool], _Fused] = {}
        phased: dict[tuple[bool, int, int], _Phased] = {}
        buckets: dict[tuple[bool, int], _Bucket] = {}
        offset = block = 0
        for _, (bs, rows, cols) in self.muon:
            gram = use_gram and rows != cols
            small, large = min(rows, cols), max(rows, cols)
            if K is not None and small <= K.MAX_ROWS:
                f = fused.setdefault((gram, K.resident(small, large)), _Fused(gram))
                f.rows, f.cols = max(f.rows, small), max(f.cols, large)
                # wide orientation: (r, c) of the m x n view is element (c, r) of a tall matrix
                strides = (1, small) if rows > cols else (large, 1)
                for i in range(bs):
                    f.meta.append([offset + i * rows * cols, f.size, small, large, *strides, block + i, 0])
                    f.size += rows * cols
            elif K is not None and small <= K.MAX_PHASED_ROWS:
                shape = (K.padded(small), K.padded(large))
                g = phased.setdefault((gram, *shape), _Phased(gram, shape))
                strides = (1, small) if rows > cols else (large, 1)
                g.matrices += [(offset + i * rows * cols, small, large, *strides, block + i) for i in range(bs)]
            else:
                b = buckets.setdefault((gram, bucket_key(small, self.device)), _Bucket(gram))
                b.members.append((offset, bs, rows, cols, b.batch, rows > cols))
                b.blocks.extend(range(block, block + bs))
                b.batch += bs
                b.rows, b.cols = max(b.rows, small), max(b.cols, large)
            block += bs
            offset += bs * rows * cols
        return list(fused.values()), list(phased.values()), list(buckets.values())

    def _build_fused(self, K: Any, f: _Fused) -> None:
        """Device tables and workspaces of one Triton launch group."""
        kw = {"device": self.device}
        f.table = torch.tensor(f.meta, dtype=torch.int64, **kw)
        size = 1 if K.resident(f.rows, f.cols) else f.size  # resident matrices need no workspace
        f.work = torch.zeros(size, dtype=K.work_dtype(f.use_gram), **kw)
        f.coefs = K.coefficient_table(f.use_gram, self.device)
        f.panelled = K.panelled(f.use_gram, f.rows, f.cols)
        if f.panelled:
            panels, first = K.panel_table(f.meta)
            bm = K.panel_block(f.rows)
            f.panels = torch.tensor(panels, dtype=torch.int64, **kw)
            f.first = torch.tensor(first, dtype=torch.int64, **kw)
            f.partial = torch.zeros(len(panels), bm, bm, dtype=torch.float32, **kw)
            f.q = torch.zeros(len(f.meta), bm, bm, dtype=torch.float16, **kw)
            f.inv = torch.zeros(len(f.meta), dtype=torch.float32, **kw)

    def _build_phased(self, K: Any, g: _Phased, groups: int) -> None:
        """Tables, workspaces and grid of one phased group (``groups`` of them may run at once)."""
        kw = {"device": self.device}
        g.meta = torch.tensor(g.matrices, dtype=torch.int64, **kw)
        tiles = len(g.matrices) * K.phased_tiles(*g.shape)  # the largest phase: one m x n tile each
        g.partial = torch.zeros(tiles, dtype=torch.float32, **kw)
        g.work = torch.zeros(K.phased_workspace(g.matrices, g.use_gram), dtype=K.work_dtype(g.use_gram), **kw)
        g.coefs = K.coefficient_table(g.use_gram, self.device)
        g.counter = torch.zeros(1, dtype=torch.int32, **kw)
        g.programs = tiles
        if self.device.type == "cuda":  # every program resident at once, with the other groups'
            sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            g.programs = max(1, min(g.programs, sms // groups))

    def _phased(self, g: _Phased, update: torch.Tensor, factor: torch.Tensor, last: bool) -> None:
        """All phases of ``g`` but the last (``last`` False), or the last one (the output)."""
        K = self._kernels()
        n = K.phase_count(g.use_gram)
        K.orthogonalize_phased(
            update, self.muon_delta, g.work, g.meta, g.shape, g.partial, g.coefs, factor,
            g.counter, g.programs, g.use_gram, first=n - 1 if last else 0, stop=n if last else n - 1,
        )  # fmt: skip

    def _build_bucket(self, b: _Bucket) -> None:
        """Index maps into and out of a torch bucket's zero-padded stack, and the stack."""
        kw = {"device": self.device}
        src, dst = [], []
        for off, bs, rows, cols, boff, tall in b.members:
            k = torch.arange(bs * rows * cols, **kw)
            i, r, c = k // (rows * cols), (k // cols) % rows, k % cols
            if tall:  # wide orientation: element (r, c) goes to (c, r)
                r, c = c, r
            src.append(k + off)
            dst.append(((boff + i) * b.rows + r) * b.cols + c)
        b.src, b.dst = torch.cat(src), torch.cat(dst)
        # The stack holds the iteration's input dtype (float32 for the Gram path, bfloat16 for the
        # standard one), so the copy in converts, as the reference's first ``.to`` would.
        dtype = torch.float32 if b.use_gram else torch.bfloat16
        b.stack = torch.zeros(b.batch, b.rows, b.cols, dtype=dtype, **kw)
        b.inputs, b.outputs = [], []
        for off, bs, rows, cols, boff, tall in b.members:
            flat = self.muon_delta[off : off + bs * rows * cols].view(bs, rows, cols)
            b.outputs.append((boff, bs, flat.mT if tall else flat))
            small, large = min(rows, cols), max(rows, cols)
            b.inputs.append((off, bs, rows, cols, tall, b.stack[boff : boff + bs, :small, :large]))
        b.block_ids = torch.tensor(b.blocks, dtype=torch.int64, **kw)

    @staticmethod
    def _kernels() -> Any:
        from . import kernels  # imports triton: only when the fused path is on

        return kernels

    # ------------------------------------------------------------------- step
    #
    # A step is split in two: ``_stage`` (host bookkeeping, gradient copies into static
    # buffers, the learning-rate dependent scalars into one device tensor) and
    # ``_compute`` (all the arithmetic, reading only static buffers). On CUDA,
    # ``_compute`` is captured once in a CUDA graph after :data:`GRAPH_WARMUP` eager
    # steps and replayed afterwards; everywhere else it runs eagerly.

    def step(self, optimizer: Any, group: dict[str, Any], shared: torch.Tensor | None = None) -> bool:
        """One step of the whole group; ``False`` (nothing done) to let the loop take it.

        The engine shares one pair of Adam bias corrections; when Adam parameters are at
        different step counts (some once had no gradient) the loop runs instead. ``shared``
        is the finite gate agreed across ranks (``nonfinite_across_ranks``), else ``None``.
        """
        if not self.adam_uniform:
            return False
        self._stage(group)
        if self.shared_gate:
            assert shared is not None  # the optimizer passes it whenever nonfinite_across_ranks is on
            self.ok_in.copy_(shared, non_blocking=True)
        if self.use_graph and self.graph is None and self.eager_steps >= GRAPH_WARMUP and not _compiling():
            self._capture()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()
            self.eager_steps += 1
        return True

    def _stage(self, group: dict[str, Any]) -> None:
        lr = float(group["lr"])
        wd = float(group["weight_decay"])
        lr_adjust = float(group["lr_adjust"])
        adam_lr = lr if lr_adjust <= 0 else lr / lr_adjust
        step_size = bc2 = 1.0
        if self.adam:
            beta1, beta2 = self.betas
            s0 = self.adam_states[0]
            pow1, pow2 = s0["beta1_pow"] * beta1, s0["beta2_pow"] * beta2
            for st in self.adam_states:
                st["beta1_pow"], st["beta2_pow"] = pow1, pow2
            step_size = adam_lr / (1.0 - pow1)
            bc2 = 1.0 - pow2
        turn = self.host_turn = (self.host_turn + 1) % len(self.host_staged)
        host, event = self.host_staged[turn], self.host_events[turn]
        if event is not None:
            event.synchronize()  # the copy that last read this buffer has run (at once, in practice)
        self.host_scalars[turn][:] = (1.0 - lr * wd, -lr, 1.0 - adam_lr * wd, -step_size, bc2)
        if self.triton:
            # The gather kernel reads the gradients where they are (contiguous ones; a copy
            # of any other, kept alive in step_grads until the step has run).
            grads = [g if g.is_contiguous() else g.contiguous() for g in self.step_grads]
            self.step_grads = grads
            self.host_addresses[turn][:] = [g.data_ptr() for g in grads]
        else:
            torch._foreach_copy_(self.grad_views, self.step_grads)
        self.staged_in.copy_(host, non_blocking=event is not None)
        if event is not None:
            event.record()

    def _capture(self) -> None:
        graph = torch.cuda.CUDAGraph()
        # Captured, each torch bucket and phased group runs on a stream of its own (see
        # _muon_update), at high priority: these chains are the step's critical path (3 % faster
        # steps on the H100 for the buckets, BENCHMARKS.md).
        sides = len(self.buckets) + len(self.phased_paths)
        self.side_streams = [torch.cuda.Stream(self.device, priority=-1) for _ in range(sides)]
        try:
            with torch.cuda.graph(graph):
                self._compute()
        finally:
            self.side_streams = []
        self.graph = graph

    def _compute(self) -> None:
        # ok: 1.0, or 0.0 when a gradient is not finite: the step is then skipped (functional.py).
        if self.triton:  # the copy in also flags non-finite spans
            self._kernels().gather(self.grad_addresses, self.spans, self.grad, self.span_finite)
            ok = self.ok_in if self.shared_gate else self.span_finite.amin()
        else:
            ok = self.ok_in if self.shared_gate else F.finite_gate([self.grad])
        muon_decay, neg_lr, adamw_decay, neg_step, bc2 = self.scalars.to(self.dtype).unbind(0)
        # The torch buckets' Newton-Schulz (the longest chains of kernels) starts as soon as the
        # Nesterov update exists; captured, it runs on side streams while the main stream does
        # Adam, the weight decay, Magma and the Triton launches (see _muon_update).
        pending = self._muon_update(ok) if self.muon else None
        muon_decay = F.gate_factor(muon_decay, ok, self.dtype)
        adamw_decay = F.gate_factor(adamw_decay, ok, self.dtype)
        if self.adam:
            self._adam(neg_step.float() * ok, bc2.float(), ok)
        if pending is not None:
            self._muon(neg_lr * ok.to(self.dtype), ok, *pending)
        self._apply(muon_decay, adamw_decay)

    def _apply(self, muon_decay: torch.Tensor, adamw_decay: torch.Tensor) -> None:
        """p <- p * decay + delta for every parameter (decay: Muon's, AdamW's, or none for Adam)."""
        if self.triton:  # one pass
            decays = torch.stack([torch.ones_like(muon_decay), muon_decay, adamw_decay])
            self._kernels().apply_updates(self.param_addresses, self.spans, self.delta, decays)
            return
        if self.weight_decay:
            if self.adamw:
                torch._foreach_mul_(self.adamw, adamw_decay)
            if self.muon:
                torch._foreach_mul_([p for p, _ in self.muon], muon_decay)
        torch._foreach_add_(self.staged, self.delta_views)

    def _adam(self, neg_step: torch.Tensor, bc2: torch.Tensor, ok: torch.Tensor) -> None:
        beta1, beta2 = self.betas
        grads = F.sanitize(self.adam_grad.to(torch.float32), ok)
        self.exp_avg.lerp_(grads, ok * (1.0 - beta1))
        self.exp_avg_sq.lerp_(grads * grads, ok * (1.0 - beta2))
        denom = (self.exp_avg_sq / bc2).sqrt_().add_(F.ADAM_EPS)
        torch.div(self.exp_avg, denom, out=denom)
        self.adam_delta.copy_(denom.mul_(neg_step))

    def _muon_update(self, ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """Momentum and Nesterov update of every Muon matrix; starts the torch buckets on it.

        Returns the sanitised gradients, the update and the buckets' orthogonalised stacks
        (unscaled; still being computed on the side streams when captured).
        """
        if self.triton:  # one pass; muon_grad is sanitised in place
            grads, update = self.muon_grad, self.update
            self._kernels().momentum_update(grads, self.momentum, update, ok, self.betas_t)
        else:
            grads = F.sanitize(self.muon_grad, ok)
            self.momentum.lerp_(grads, ok.to(self.dtype) * (1.0 - self.beta))
            update = torch.lerp(grads, self.momentum, self.beta)
        stacks = []
        for i, b in enumerate(self.buckets):
            with self._side(i):
                for off, bs, rows, cols, tall, part in b.inputs:
                    view = update[off : off + bs * rows * cols].view(bs, rows, cols)
                    part.copy_(view.mT if tall else view)
                stacks.append(F.gram_newton_schulz(b.stack) if b.use_gram else F.newton_schulz(b.stack))
        for j, g in enumerate(self.phased_paths):
            with self._side(len(self.buckets) + j):
                self._phased(g, update, self.block_factor, last=False)
        return grads, update, stacks

    def _side(self, i: int) -> contextlib.AbstractContextManager:
        """Side stream ``i`` while capturing (after everything the main stream has queued), else nothing."""
        if not self.side_streams:
            return contextlib.nullcontext()
        side = self.side_streams[i]
        side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(side)

    def _muon(
        self,
        neg_lr: torch.Tensor,
        ok: torch.Tensor,
        grads: torch.Tensor,
        update: torch.Tensor,
        stacks: list[torch.Tensor],
    ) -> None:
        factor = self.block_factor  # per block: Muon scale x Magma multiplier x -lr
        if self.magma_kernel:
            self._kernels().magma_factors(
                self.momentum,
                grads,
                self.magma_bounds,
                self.magma_first,
                self.magma_partial,
                self.block_scale,
                self.scores,
                factor,
                neg_lr,
                ok,
            )
        elif self.magma:
            # Per-block sums of m*g, m*m, g*g: scattered into the zero-padded layout of the
            # Newton-Schulz stacks (one row per block) and summed per row: deterministic, and
            # each block is summed on its own, whatever the scale of the other blocks.
            m, g = self.momentum.to(torch.float32), grads.to(torch.float32)
            products = torch.stack([m * g, m * m, g * g])
            sums = torch.empty(3, self.block_scale.numel(), dtype=torch.float32, device=self.device)
            for b in self.buckets:
                padded = torch.zeros(3, b.stack.numel(), dtype=torch.float32, device=self.device)
                padded.index_copy_(1, b.dst, products.index_select(1, b.src))
                sums.index_copy_(1, b.block_ids, padded.view(3, b.batch, -1).sum(-1))
            dot, mm, gg = sums
            raw = F.magma_score(dot, mm.sqrt(), gg.sqrt())
            torch.mul(self.block_scale * F.magma_scale_(self.scores, raw, ok), neg_lr.float(), out=factor)
        else:
            torch.mul(self.block_scale, neg_lr.float(), out=factor)

        # Each bucket's stack, scaled by its blocks' factors, goes back into muon_delta on its
        # side stream once the factors exist; the Triton launches (main stream) read `update`
        # and `factor` and write the other parts of muon_delta.
        for i, (b, out) in enumerate(zip(self.buckets, stacks, strict=True)):
            with self._side(i):
                scale = factor.index_select(0, b.block_ids).to(self.dtype).view(-1, 1, 1)
                for boff, bs, delta in b.outputs:
                    part = out[boff : boff + bs, : delta.size(1), : delta.size(2)]
                    torch.mul(part, scale[boff : boff + bs], out=delta)
        for j, g in enumerate(self.phased_paths):
            with self._side(len(self.buckets) + j):
                self._phased(g, update, factor, last=True)
        K = self._kernels() if self.fused_paths else None
        for f in self.fused_paths:
            if f.panelled:
                K.orthogonalize_panels(
                    update, self.muon_delta, f.work, f.table, f.panels, f.first, f.partial, f.q, f.inv, f.coefs,
                    factor, f.rows,
                )  # fmt: skip
            else:
                K.orthogonalize_blocks(
                    update, self.muon_delta, f.work, f.table, f.coefs, factor, f.rows, f.cols, f.use_gram
                )
        if self.side_streams:
            main = torch.cuda.current_stream(self.device)
            for side in self.side_streams:
                main.wait_stream(side)
