"""The FSDP2 step's work on local tensors: a rank's shards (:func:`local_shard`).

:func:`local_shard` of a plain tensor is the tensor itself. The elementwise work (Adam routes,
Muon momentum, decay, Magma's per-matrix sums) is batched over a param_group's tensors in
one flat concatenation; the owners' Newton–Schulz runs stacked by shape.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .. import functional as F
from .. import loop
from ..dtensor import local_shard
from ..engine import compilation
from ..engine.layout import assign, build_fused, run_fused
from ..state import advance_adam_state, local_state, muon_state
from .plan import Plan, _ShapeGroup


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The tensors flattened and concatenated (no copy for a single contiguous tensor).

    torch's C++ flatten (as DDP's buckets use it): the per-tensor views cost no Python each step.
    """
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return _flatten_dense_tensors(tensors)


def _write_back(targets: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``targets`` (the inverse of :func:`_flat`), one batched copy."""
    if len(targets) == 1 and targets[0].is_contiguous() and flat.data_ptr() == targets[0].data_ptr():
        return  # _flat returned a view: already written
    torch._foreach_copy_(targets, _unflatten_dense_tensors(flat, targets))


#: Elements per block of the first pass of :meth:`Segments.sums`. torch's CUDA
#: ``segment_reduce`` gives each output one thread that walks its whole segment, so one
#: 1024 x 1024 matrix as one segment is a million serial additions (1.7 s per step for
#: eight 4096 x 4096 matrices on an H200, 2026-11-23); cut into blocks of this size the first
#: pass runs one thread per block, and the second pass adds one partial sum per block.
SEGMENT_BLOCK = 1024


class Segments:
    """Where the matrices lie in a rank's flat Muon buffer, for Magma's per-matrix sums.

    The buffer is cut into consecutive segments of ``lengths`` elements (a list); segment
    ``i`` is (part of) matrix ``matrix[i]`` of the ``count`` matrices of the plan (numbered
    in plan order).
    """

    def __init__(self, lengths: list[int], matrix: list[int], count: int, device: torch.device) -> None:
        self.count = count
        self.matrix = torch.tensor(matrix, dtype=torch.long, device=device)
        blocks = [-(-n // SEGMENT_BLOCK) if n else 0 for n in lengths]
        fine = [min(SEGMENT_BLOCK, n - b * SEGMENT_BLOCK) for n in lengths for b in range(-(-n // SEGMENT_BLOCK))]
        self.fine = torch.tensor(fine, dtype=torch.long, device=device)
        self.coarse = torch.tensor(blocks, dtype=torch.long, device=device)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Per-matrix sums ``(count, k)`` of ``values`` ``(buffer elements, k)``, in two passes of blocks."""
        out = torch.zeros(self.count, values.shape[1], dtype=values.dtype, device=values.device)
        if self.fine.numel():
            # unsafe: the lengths add up by construction; torch's checks of them (a minimum and a
            # sum, read on the host) made the host wait for the GPU twice per call.
            partial = torch.segment_reduce(values, "sum", lengths=self.fine, axis=0, unsafe=True)
            pieces = torch.segment_reduce(partial, "sum", lengths=self.coarse, axis=0, unsafe=True)
            out.index_copy_(0, self.matrix, pieces)
        return out


class _AdamBucket:
    """Adam-routed parameters that share one flat chain: their dtype, bias corrections and decay."""

    def __init__(self, params: list[torch.Tensor], beta1_pow: float, beta2_pow: float, decay: Any) -> None:
        self.params, self.beta1_pow, self.beta2_pow, self.decay = params, beta1_pow, beta2_pow, decay
        self.grad: torch.Tensor | None = None  # the local gradients, flat (set by shard_inputs)


class ShardInputs:
    """What the elementwise work of one step reads on this rank: settings, Adam buckets, Muon parameters, gradients.

    Built by :func:`shard_inputs`; ``muon_grad`` is the Muon parameters' local gradients, flat
    (``None`` without Muon matrices).
    """

    def __init__(
        self,
        settings: F.GroupSettings,
        buckets: list[_AdamBucket],
        muon: list[torch.Tensor],
        grads: dict[int, torch.Tensor],
        muon_grad: torch.Tensor | None,
    ) -> None:
        self.settings, self.buckets, self.muon, self.grads, self.muon_grad = settings, buckets, muon, grads, muon_grad


def shard_inputs(states: dict, group: dict[str, Any], plan: Plan) -> ShardInputs:
    """The step's inputs on this rank's local tensors (``plan.params`` are the group's active parameters).

    Advances the Adam step of the Adam-routed parameters and buckets them (dtype, bias
    corrections, decay); flattens each bucket's and the Muon parameters' local gradients, from
    which :func:`local_gate` reads the finite gate (not from every gradient: three launches each).
    """
    settings = F.GroupSettings.of(group)
    grads = {id(p): loop.grad_of(p) for p in (group["params"][layout.index] for layout in plan.params)}
    by_key: dict[tuple, _AdamBucket] = {}
    for layout in plan.params:
        if layout.route == "muon":
            continue
        p = group["params"][layout.index]
        state = advance_adam_state(states, p, settings)
        decay = settings.adam_decay(layout.route)
        key = (p.dtype, p.device, grads[id(p)].dtype, state["beta1_pow"], state["beta2_pow"], decay)
        if key not in by_key:
            by_key[key] = _AdamBucket([], state["beta1_pow"], state["beta2_pow"], decay)
        by_key[key].params.append(p)
    buckets = list(by_key.values())
    for b in buckets:
        b.grad = _flat([local_shard(grads[id(p)]) for p in b.params])
    muon = [group["params"][layout.index] for layout in plan.muon]
    muon_grad = _flat([local_shard(grads[id(p)]) for p in muon]) if muon else None
    return ShardInputs(settings, buckets, muon, grads, muon_grad)


def local_gate(inputs: ShardInputs, device: torch.device) -> torch.Tensor:
    """The finite gate of this rank, from the flat gradients of :func:`shard_inputs` (Adam's also below its limit)."""
    adam = [b.grad for b in inputs.buckets if b.grad is not None]
    flats = [inputs.muon_grad] if inputs.muon_grad is not None else []
    if not (flats or adam):
        return torch.ones((), dtype=torch.float32, device=device)
    return F.finite_gate(flats, adam).to(device)


def local_adam(states: dict, inputs: ShardInputs, ok: torch.Tensor) -> None:
    """The Adam and AdamW routes in their buckets (:func:`shard_inputs`): one flat chain per bucket.

    Elementwise kernels give the same bits on a concatenation, so this matches the loop bitwise.
    """
    settings = inputs.settings
    for b in inputs.buckets:
        assert b.grad is not None  # shard_inputs flattened it
        locals_ = [local_shard(p) for p in b.params]
        moments = (
            [local_state(states, p, "exp_avg") for p in b.params],
            [local_state(states, p, "exp_avg_sq") for p in b.params],
        )
        flat_p, flat_m, flat_v = _flat(locals_), _flat(moments[0]), _flat(moments[1])
        F.adam_update_(
            flat_p,
            b.grad,
            flat_m,
            flat_v,
            beta1=settings.beta1,
            beta2=settings.beta2,
            beta1_pow=b.beta1_pow,
            beta2_pow=b.beta2_pow,
            lr=settings.adam_lr,
            decay_factor=b.decay,
            ok=ok,
        )
        _write_back(locals_, flat_p)
        _write_back(moments[0], flat_m)
        _write_back(moments[1], flat_v)


class LocalMuon:
    """The Muon parameters' local tensors after :func:`local_momentum`: flat parameters (decayed), the update."""

    def __init__(self, locals_: list[torch.Tensor], flat_p: torch.Tensor, update: torch.Tensor | None) -> None:
        self.locals, self.flat_p, self.update = locals_, flat_p, update


def local_momentum(
    states: dict, inputs: ShardInputs, plan: Plan, ok: torch.Tensor, segments: Segments | None
) -> tuple[LocalMuon, torch.Tensor | None]:
    """Decay, momentum and Nesterov update of the Muon parameters (plan order), on local tensors.

    The update is in the momentum's dtype. Creates the Muon state (with Magma, each parameter's
    replicated ``magma_score`` too: :func:`deepmd_hybridmuon.state.muon_state`). With Magma
    (``segments``), also returns this rank's part of Magma's sums (:func:`magma_partial_sums`).
    """
    settings, muon, grads = inputs.settings, inputs.muon, inputs.grads
    assert inputs.muon_grad is not None  # the group has Muon parameters
    grad_dtypes, param_dtypes = {grads[id(p)].dtype for p in muon}, {p.dtype for p in muon}
    if len(grad_dtypes) > 1 or len(param_dtypes) > 1:
        dtypes = grad_dtypes | param_dtypes
        raise NotImplementedError(
            f"Muon parameters of one param_group in several dtypes {sorted(map(str, dtypes))} under FSDP2; "
            "HybridMuon needs one parameter dtype and one gradient dtype per group there"
        )
    for layout, p in zip(plan.muon, muon, strict=True):
        muon_state(states, p, grads[id(p)], layout.view[0] if settings.magma else None)  # type: ignore[index]
    bufs = [local_state(states, p, "momentum_buffer") for p in muon]
    locals_ = [local_shard(p) for p in muon]
    flat_p = _flat(locals_)
    flat_buf = _flat(bufs)
    g = F.sanitize(inputs.muon_grad.to(bufs[0].dtype), ok)
    if settings.weight_decay > 0:
        flat_p.mul_(F.gate_factor(settings.muon_decay, ok, flat_p.dtype))
    update = F.nesterov_momentum_(flat_buf, g, settings.momentum, ok)
    _write_back(bufs, flat_buf)
    sums = None if segments is None else magma_partial_sums(flat_buf, g, segments)
    return LocalMuon(locals_, flat_p, update), sums


def magma_partial_sums(momentum: torch.Tensor, grad: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Magma's sums per matrix over this rank's pieces: ``(matrices, 3)`` float64, ``m·g``, ``m·m``, ``g·g``.

    The shards' partial sums are added across ranks, so they cannot be scaled per matrix
    (functional.magma_sums) without a scale agreed first. Instead they are float64 for inputs
    of at most 32 bits: no product of two finite float32 numbers, nor a sum of 2^700 of them,
    overflows float64, and float32's smallest numbers square to normal float64 ones.
    (float64 inputs are below functional.GRAD_LIMIT too, so their sums cannot overflow either.)
    """
    m64, g64 = momentum.to(torch.float64), grad.to(torch.float64)
    return segments.sums(torch.stack([m64 * g64, m64 * m64, g64 * g64], dim=1))  # (local elements, 3) summed


def magma_damp(states: dict, muon: list[torch.Tensor], sums: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """Magma's multiplier per matrix from the whole-matrix ``sums``; advances every ``magma_score`` (gated)."""
    scores = [states[p]["magma_score"] for p in muon]
    flat_score = _flat(scores)
    raw = F.magma_score(sums[:, 0], sums[:, 1].sqrt(), sums[:, 2].sqrt()).to(torch.float32)
    damp = F.magma_scale_(flat_score, raw, ok)
    _write_back(scores, flat_score)
    return damp


class OwnedKernels:
    """The engine's Triton kernels for a rank's owned matrices, on the engine's paths.

    An owned buffer (:func:`.plan._owned`'s layout) is a flat vector of whole matrices grouped
    by shape, which is what the kernels read: the engine's own grouping
    (``engine.layout.assign``) gives each matrix its row of a path's metadata table (offset,
    sides, orientation, block), ``engine.layout.build_fused`` builds the tables, and each launch
    writes ``factor * O`` of its matrices straight into the output buffer: one program per matrix
    (``orthogonalize_blocks``) up to ``kernels.MAX_ROWS``. Larger matrices keep the torch path, as do all of them until
    Triton has compiled the variants in the background (``engine.compilation``), for good if one
    fails to compile, and for buffers of other dtypes than the ones asked for. Built lazily,
    for the dtype and ``use_gram`` of the first call.
    """

    def __init__(self, groups: list[_ShapeGroup], device: torch.device) -> None:
        self.groups, self.device = groups, device
        self.key: tuple[torch.dtype, bool] | None = None
        self.fused: list[Any] = []  # engine.layout.Fused, with their device tables
        self.covered: set[int] = set()  # indices of the groups the launches orthogonalise
        self.pending: Any = None  # the compilation asked for (None: none, or one failed)
        self.ready = False
        self.K: Any = None
        self._scaling: tuple[float, float] | None = None
        self._scale: torch.Tensor | None = None
        self.ids = torch.cat([g.matrix_ids for g in groups]) if groups else None

    def _build(self, dtype: torch.dtype, use_gram: bool) -> None:
        self.key, self.fused, self.covered = (dtype, use_gram), [], set()
        self.pending, self.ready = None, False
        if not self.groups or not compilation.triton_runs_on(self.device):
            return
        K = self.K = compilation.kernels()
        self.fused, _ = assign([(g.count, g.rows, g.cols) for g in self.groups], K, use_gram, self.device)
        for f in self.fused:
            build_fused(K, f, self.device)
        # A group (one shape) lies on one path: it is covered when its first block is.
        taken = {row[int(K.MetaColumn.BLOCK)] for f in self.fused for row in f.meta}
        first = [sum(g.count for g in self.groups[:i]) for i in range(len(self.groups))]
        self.covered = {i for i, block in enumerate(first) if block in taken}
        if self.covered:
            self.pending = compilation.request(self.device, dtype, self._paths(), False)

    def _paths(self) -> list[tuple[bool, int, int]]:
        return [(f.use_gram, f.rows, f.cols) for f in self.fused]

    def _poll(self) -> None:
        """Switch to the launches once their compilation is over and none of them failed."""
        if self.ready or self.pending is None or not self.pending.is_set():
            return
        # Set also when a variant failed: asking again answers None then.
        self.pending = compilation.request(self.device, self.key[0], self._paths(), False)  # type: ignore[index]
        self.ready = self.pending is not None

    @property
    def state(self) -> str:
        """``"triton"`` (the launches run), ``"compiling"`` or ``"torch"`` (none apply), as of now."""
        self._poll()
        return "triton" if self.ready else ("compiling" if self.pending is not None else "torch")

    def torch_shapes(self) -> list[tuple[int, int]]:
        """``(rows, cols)`` of the owned shapes the torch path orthogonalises, as of now."""
        done = self.covered if self.state == "triton" else set()
        return [(g.rows, g.cols) for i, g in enumerate(self.groups) if i not in done]

    def run(
        self,
        settings: F.GroupSettings,
        owned: torch.Tensor,
        damp: torch.Tensor | None,
        neg_lr: torch.Tensor,
        out: torch.Tensor,
    ) -> set[int]:
        """Orthogonalise the matrices the launches take, into ``out``; the indices of the groups done."""
        if owned.dtype != out.dtype:
            return set()
        if self.key != (owned.dtype, settings.use_gram):
            self._build(owned.dtype, settings.use_gram)
        self._poll()
        if not self.ready:
            return set()
        scaling = (settings.lr_adjust, settings.lr_adjust_coeff)  # all functional.muon_scale reads
        if scaling != self._scaling or self._scale is None:  # the first step, or lr_adjust changed
            # filled on the device (no copy from the host, which would make it wait for the GPU)
            fills = [
                torch.full((g.count,), settings.scale(g.rows, g.cols), dtype=torch.float32, device=owned.device)
                for g in self.groups
            ]
            self._scaling, self._scale = scaling, torch.cat(fills)
        factor = F.muon_factor(self._scale, None if damp is None else damp[self.ids], neg_lr)
        for f in self.fused:
            run_fused(self.K, f, owned, out, factor)
        return self.covered


def kernels_summary(kernels: OwnedKernels | None, groups: list[_ShapeGroup]) -> dict[str, Any]:
    """The owners' part of an ``execution_table`` row: ``kernels`` and ``torch_matrices``.

    ``torch_matrices``: ``(rows, cols)`` of each owned shape the torch path orthogonalises on this rank.
    """
    if kernels is None:
        return {"kernels": "torch", "torch_matrices": [(g.rows, g.cols) for g in groups]}
    return {"kernels": kernels.state, "torch_matrices": kernels.torch_shapes()}


def orthogonalize_owned(
    settings: F.GroupSettings,
    owned: torch.Tensor,
    groups: list[_ShapeGroup],
    damp: torch.Tensor | None,
    neg_lr: torch.Tensor,
    out: torch.Tensor,
    kernels: OwnedKernels | None = None,
) -> None:
    """The owned matrices' updates (``functional.post_orthogonalize``, ``neg_lr`` gated) into ``out``.

    ``owned`` and ``out`` are owned buffers (:func:`_owned`'s layout); ``out`` may be of a wider
    dtype. The matrices ``kernels`` takes go through the Triton launches (:class:`OwnedKernels`);
    the others are stacked by shape (``groups``) and orthogonalised by :func:`functional.orthogonalize`.
    """
    done = kernels.run(settings, owned, damp, neg_lr, out) if kernels is not None else set()
    for i, sg in enumerate(groups):
        if i in done:
            continue
        n, shape = sg.count * sg.rows * sg.cols, (sg.count, sg.rows, sg.cols)
        orth = F.orthogonalize(owned[sg.start : sg.start + n].view(shape), settings.use_gram)
        scale = torch.full((sg.count,), settings.scale(sg.rows, sg.cols), dtype=torch.float32, device=out.device)
        factor = F.muon_factor(scale, None if damp is None else damp[sg.matrix_ids], neg_lr)
        F.post_orthogonalize(orth, factor, out[sg.start : sg.start + n].view(shape))


def apply_delta(flat_p: torch.Tensor, locals_: list[torch.Tensor], delta: torch.Tensor) -> None:
    """``p += delta`` (the updates, already gated), then the parameters written back."""
    flat_p.add_(delta)
    _write_back(locals_, flat_p)


def wire_dtype(work: torch.dtype) -> torch.dtype:
    """The dtype matrices travel in: it holds the update and every delta exactly (bfloat16/float16 -> float32)."""
    return torch.promote_types(work, torch.float32)
