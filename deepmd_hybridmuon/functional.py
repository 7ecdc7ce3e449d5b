"""Pure math of HybridMuon: routing, Newton–Schulz variants, Magma-lite, update rules.

Nothing here keeps state between calls or imports deepmd; every function takes tensors and numbers and returns
tensors (or mutates the tensors it is handed, when its name ends in ``_``). The optimizer in
:mod:`deepmd_hybridmuon.optimizer` is a thin stateful shell around these functions.

Constants carry the name of the work they come from. Numerical choices (dtypes, order of operations) follow
deepmd-kit 3.2.0's built-in HybridMuon so that both optimizers produce the same trajectories up to low-precision
rounding.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Literal

import torch

Route = Literal["muon", "adam", "adamw"]

#: The three ways a tensor of rank >= 2 can be seen as matrices (see :func:`matrix_view`).
MUON_MODES: tuple[str, ...] = ("2d", "flat", "slice")

# ---------------------------------------------------------------------------
# Newton–Schulz constants
# ---------------------------------------------------------------------------

#: Quintic Newton–Schulz coefficients (a, b, c) of Keller Jordan's Muon (2024): they push every singular value of a
#: normalised matrix into roughly [0.7, 1.2] within a handful of iterations.
NS_FAST_COEFFS: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
#: Iterations with :data:`NS_FAST_COEFFS` (DeepSeek-V4 technical report, §2.4).
NS_FAST_STEPS: int = 8
#: Classical cubic Newton–Schulz step for the polar factor written as a quintic with c = 0.5: x -> 2x - 1.5x^3 + 0.5x^5
#: has a fixed point of slope 0 at x = 1, so it pins the singular values left by the fast stage to 1.
NS_POLISH_COEFFS: tuple[float, float, float] = (2.0, -1.5, 0.5)
#: Iterations with :data:`NS_POLISH_COEFFS` (DeepSeek-V4, §2.4).
NS_POLISH_STEPS: int = 2
#: Floor of the Frobenius norm before normalisation, so that X0 = G/||G|| stays finite.
NS_EPS: float = 1e-7

#: Safety factor of the Gram Newton–Schulz reference (Dao-AILab/gram-newton-schulz): the Polar Express polynomials are
#: evaluated at x/1.05, which keeps them stable under half-precision rounding of singular values slightly above 1.
GRAM_SAFETY_FACTOR: float = 1.05
#: Polar Express coefficients (Amsel, Persson, Musco & Gower, 2025), five steps.
_POLAR_EXPRESS_RAW: tuple[tuple[float, float, float], ...] = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
)
#: p(x) = a x + b x^3 + c x^5 evaluated at x / s: (a / s, b / s^3, c / s^5).
POLAR_EXPRESS_COEFFS: tuple[tuple[float, float, float], ...] = tuple(
    (a / GRAM_SAFETY_FACTOR, b / GRAM_SAFETY_FACTOR**3, c / GRAM_SAFETY_FACTOR**5) for a, b, c in _POLAR_EXPRESS_RAW
)
#: Iteration indices before which the Gram iteration re-forms X and its Gram matrix from the accumulated transform,
#: bounding fp16 error growth (Dao-AILab/gram-newton-schulz uses a restart after the second step).
GRAM_RESTART_ITERATIONS: frozenset[int] = frozenset({2})

# ---------------------------------------------------------------------------
# Adam and Magma constants
# ---------------------------------------------------------------------------

#: Adam denominator epsilon of DeepSeek-V4 (§2.4): tiny, so that the second moment and not the floor sets the step, even
#: for parameters with very small gradients.
ADAM_EPS: float = 1e-20
#: Largest gradient magnitude (exclusive) an Adam-routed parameter can take a step with: the second moment is float32
#: (the built-in layout) and holds ~g^2 divided by the bias correction, so |g| must stay below sqrt(float32 max) = 2^64;
#: 2^63 leaves a factor 4 for the correction's rounding. Nothing can make Adam's step scale-invariant above it, so a
#: step with a larger Adam gradient is skipped like a non-finite one (:func:`finite_gate`).
ADAM_GRAD_LIMIT: float = 2.0**63
#: Largest gradient magnitude (exclusive) of any parameter, whatever its dtype: half float32's largest number. The
#: momentum's lerp subtracts two numbers of that size, and the flat engine orthogonalises float64 matrices in float32;
#: either would overflow above it. A larger element skips the step like a non-finite one (:func:`finite_gate`); ``2 g``
#: in float32 overflows exactly from this limit on.
GRAD_LIMIT: float = 2.0**127

#: Magma (arXiv:2602.15322) temperature of the sigmoid applied to cos(m, g).
MAGMA_TAU: float = 2.0
#: EMA decay of the per-block alignment score (deepmd-kit's Magma-lite).
MAGMA_EMA_DECAY: float = 0.9
#: Smallest multiplier of a Muon block update (Magma-lite never skips a block).
MAGMA_MIN_SCALE: float = 0.1
#: Score of a block before any gradient was seen: neutral alignment.
MAGMA_INITIAL_SCORE: float = 0.5
#: Floor of |m| * |g| in the cosine, for zero gradients or momenta.
MAGMA_EPS: float = 1e-12
#: sigmoid(-1/tau) and sigmoid(1/tau): the range of sigmoid(cos/tau), stretched to [0, 1].
MAGMA_SIGMOID_LOW: float = 1.0 / (1.0 + math.exp(1.0 / MAGMA_TAU))
MAGMA_SIGMOID_HIGH: float = 1.0 / (1.0 + math.exp(-1.0 / MAGMA_TAU))


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamRoute:
    """Where one parameter goes.

    Attributes
    ----------
    route
        ``"muon"``, ``"adam"`` (no weight decay) or ``"adamw"`` (decoupled decay).
    view
        ``(batch, rows, cols)``: the matrices Muon orthogonalises, for ``"muon"``; ``None`` otherwise.
    reason
        A short human-readable reason, for logs and ``dp-hybridmuon check``.
    """

    route: Route
    view: tuple[int, int, int] | None
    reason: str


def leaf_name(name: str) -> str:
    """Return the last dot-separated segment of ``name`` that is not all digits, lower-cased.

    ``"layers.0.weight"`` -> ``"weight"``; ``"adam_scales.3"`` -> ``"adam_scales"``
    (indices of a ``ParameterList`` are skipped).
    """
    segments = name.lower().split(".")
    idx = len(segments) - 1
    while idx > 0 and segments[idx].isdigit():
        idx -= 1
    return segments[idx]


def name_route(name: str | None) -> Route:
    """Route forced by a parameter's name, or ``"muon"`` when the name forces nothing.

    Rules on :func:`leaf_name`: ``b`` or containing ``bias`` -> Adam; prefix ``adam_``
    -> Adam; prefix ``adamw_`` -> AdamW. A parameter without a name forces nothing.
    """
    if name is None:
        return "muon"
    leaf = leaf_name(name)
    if leaf == "b" or "bias" in leaf or leaf.startswith("adam_"):
        return "adam"
    if leaf.startswith("adamw_"):
        return "adamw"
    return "muon"


def effective_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """Drop the size-1 dimensions of ``shape``; a shape of only ones becomes ``(1,)``."""
    return tuple(int(d) for d in shape if int(d) != 1) or (1,)


def matrix_view(eff_shape: tuple[int, ...], muon_mode: str) -> tuple[int, int, int] | None:
    """Matrices that Muon sees in a tensor of effective shape ``eff_shape``.

    Parameters
    ----------
    eff_shape
        Shape without size-1 dimensions (see :func:`effective_shape`).
    muon_mode
        ``"2d"``: rank 2 only. ``"flat"``: one ``(prod(leading), last)`` matrix.
        ``"slice"``: a batch of the trailing ``(rows, cols)`` matrices.

    Returns
    -------
    tuple[int, int, int] | None
        ``(batch, rows, cols)``, or ``None`` when the mode gives no matrix view.
    """
    if muon_mode not in MUON_MODES:
        raise ValueError(f"Invalid muon_mode: {muon_mode!r}; expected one of '2d', 'flat', 'slice'")
    if len(eff_shape) < 2:
        return None
    if len(eff_shape) == 2:
        return (1, eff_shape[0], eff_shape[1])
    if muon_mode == "2d":
        return None
    if muon_mode == "flat":
        return (1, math.prod(eff_shape[:-1]), eff_shape[-1])
    return (math.prod(eff_shape[:-2]), eff_shape[-2], eff_shape[-1])


def route_parameter(name: str | None, shape: tuple[int, ...] | torch.Size, muon_mode: str) -> ParamRoute:
    """Route of a parameter from its name and shape (the rules of deepmd-kit 3.2.0).

    1. The name forces Adam (``b``, ``*bias*``, ``adam_*``) or AdamW (``adamw_*``).
    2. Effective rank < 2 -> Adam.
    3. No matrix view in ``muon_mode`` -> AdamW.
    4. Otherwise Muon on the matrix view.
    """
    forced = name_route(name)
    if forced != "muon":
        return ParamRoute(forced, None, "name")
    eff = effective_shape(shape)
    if len(eff) < 2:
        return ParamRoute("adam", None, "rank<2")
    view = matrix_view(eff, muon_mode)
    if view is None:
        return ParamRoute("adamw", None, f"no matrix view in {muon_mode!r}")
    return ParamRoute("muon", view, "matrix")


# ---------------------------------------------------------------------------
# Newton–Schulz orthogonalisation
# ---------------------------------------------------------------------------


def standard_schedule() -> tuple[tuple[float, float, float], ...]:
    """The (a, b, c) of every iteration of the standard Newton–Schulz iteration, in order.

    :data:`NS_FAST_STEPS` rows of :data:`NS_FAST_COEFFS`, then :data:`NS_POLISH_STEPS` rows
    of :data:`NS_POLISH_COEFFS`. Every implementation (:func:`newton_schulz`, the Triton
    kernels) iterates over this table.
    """
    return (NS_FAST_COEFFS,) * NS_FAST_STEPS + (NS_POLISH_COEFFS,) * NS_POLISH_STEPS


@dataclass(frozen=True)
class GramSchedule:
    """The Gram Newton–Schulz iteration as data: its coefficients and where it restarts.

    Attributes
    ----------
    coeffs
        ``(a, b, c)`` of every iteration, in order.
    restarts
        Per iteration: whether X and its Gram matrix R are re-formed from the accumulated
        transform before it (X <- Q X, R <- X X^T), the transform then starting afresh.
        The first iteration never restarts (there is nothing to re-form yet).

    Every implementation reads the derived flags (:attr:`fresh_q`, :attr:`updates_r`, :attr:`segments`) from here.
    """

    coeffs: tuple[tuple[float, float, float], ...]
    restarts: tuple[bool, ...]

    def __post_init__(self) -> None:
        if not self.coeffs:
            raise ValueError("a Gram schedule needs at least one iteration; got an empty coefficient table")
        if len(self.restarts) != len(self.coeffs):
            raise ValueError(
                f"restarts has {len(self.restarts)} flags for {len(self.coeffs)} iterations; expected one per iteration"
            )
        if self.restarts[0]:
            raise ValueError("restarts[0] is True; the first iteration cannot restart (nothing to re-form yet)")

    @property
    def steps(self) -> int:
        """Number of iterations."""
        return len(self.coeffs)

    @functools.cached_property
    def fresh_q(self) -> tuple[bool, ...]:
        """Per iteration: whether Q starts afresh (Q = a I + Z): the first iteration and every restart."""
        return tuple(k == 0 or r for k, r in enumerate(self.restarts))

    @functools.cached_property
    def updates_r(self) -> tuple[bool, ...]:
        """Per iteration: whether R <- (a I + Z) R (a I + Z) follows it.

        Not before a restart (R is re-formed from X there) and not after the last
        iteration (R is not used any more).
        """
        n = self.steps
        return tuple(k + 1 < n and not self.restarts[k + 1] for k in range(n))

    @functools.cached_property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` of each run of iterations between restarts, in order."""
        starts = [k for k, fresh in enumerate(self.fresh_q) if fresh]
        return tuple(zip(starts, [*starts[1:], self.steps], strict=True))


def gram_schedule() -> GramSchedule:
    """The Gram schedule of HybridMuon: :data:`POLAR_EXPRESS_COEFFS`, restarting at :data:`GRAM_RESTART_ITERATIONS`.

    Read from the two constants at each call (built once per pair of values).
    """
    return _gram_schedule(tuple(POLAR_EXPRESS_COEFFS), frozenset(GRAM_RESTART_ITERATIONS))


@functools.cache
def _gram_schedule(coeffs: tuple[tuple[float, float, float], ...], restarts: frozenset[int]) -> GramSchedule:
    steps = len(coeffs)
    outside = sorted(k for k in restarts if not 0 < k < steps)
    if outside:
        raise ValueError(f"GRAM_RESTART_ITERATIONS holds {outside}; restarts lie in 1..{steps - 1}")
    return GramSchedule(coeffs, tuple(k in restarts for k in range(steps)))


def peak(x: torch.Tensor, dim: int | tuple[int, ...] | None = None, keepdim: bool = False) -> torch.Tensor:
    """The largest magnitude of ``x`` (over ``dim``; all of it by default); NaN where a NaN is.

    ``max(-min, max)``: two plain reductions, several times faster on the CPU than the infinity norm.
    """
    kwargs = {} if dim is None else {"dim": dim, "keepdim": keepdim}
    return torch.maximum(-x.amin(**kwargs), x.amax(**kwargs))


def pow2_downscale(x: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """The power of two ``2^-e`` per block of ``x`` (reduced over ``dim``) that brings it below 2 in magnitude.

    ``e = max(0, floor(log2(amax)))`` with ``amax`` the block's largest magnitude. Multiplying a
    block by the result is exact (a power of two), keeps its largest element in [1, 2), so that
    sums of squares of the block cannot overflow, and is the identity (1) for blocks already
    below 2, and for zero or non-finite blocks. ``x``'s dtype, with ``dim`` kept as size 1.
    """
    amax = peak(x, dim, keepdim=True)
    mantissa, _ = torch.frexp(amax)  # amax = mantissa * 2^k, mantissa in [0.5, 1)
    # amax / (2 mantissa) = 2^(k-1) exactly (a correctly rounded division with a representable result)
    big = (amax >= 2) & (amax <= torch.finfo(amax.dtype).max)
    return torch.where(big, amax / (2 * mantissa), 1).reciprocal()


def newton_schulz(
    G: torch.Tensor,
    schedule: tuple[tuple[float, float, float], ...] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate polar factor of each matrix of ``G`` (shape ``(batch, m, n)``), in ``dtype`` (bfloat16).

    X0 = G / ||G||_F (per matrix, wide orientation), then X <- a X + (b A + c A^2) X with A = X X^T for every row
    (a, b, c) of ``schedule`` (default :func:`standard_schedule`). Zero rows or columns stay zero, so zero padding
    commutes with this function. Each matrix is first divided by a power of two (:func:`pow2_downscale`) so that its
    norm cannot overflow: exact, and the identity for matrices whose entries are all below 2 in magnitude.
    """
    X = (G * pow2_downscale(G, (-2, -1))).to(dtype)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    X = X / X.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for a, b, c in standard_schedule() if schedule is None else schedule:
        A = torch.bmm(X, X.mT)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)
        X = torch.baddbmm(X, B, X, beta=a, alpha=1.0)
    return X.mT if tall else X


def gram_newton_schulz(G: torch.Tensor, schedule: GramSchedule | None = None) -> torch.Tensor:
    """Polar factor of each matrix of ``G`` (``(batch, m, n)``) by Gram Newton–Schulz.

    The iteration X <- p_k(X X^T) X with p_k(R) = a_k I + b_k R + c_k R^2 is carried out on the small Gram matrix
    R = X X^T (wide orientation, m <= n): with Z = b R + c R^2, the transform Q accumulates Q <- Q (Z + a I) and
    R <- (Z + a I) R (Z + a I), so X itself is touched only when the iteration restarts and at the end, X_out = Q X.
    ``schedule`` (default :func:`gram_schedule`) gives the coefficients and the restarts. Normalisation in float32,
    iteration in float16. Returns the dtype of ``G``.
    """
    sched = gram_schedule() if schedule is None else schedule
    down = pow2_downscale(G, (-2, -1))  # see newton_schulz
    X = (G * down).to(torch.float32)
    tall = X.size(-2) > X.size(-1)
    if tall:
        X = X.mT
    # eps scaled like X: (||X|| + eps) 2^-e, so matrices below 2 keep their bits
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + NS_EPS * down.to(torch.float32))).to(torch.float16)

    R = torch.bmm(X, X.mT)
    eye = torch.eye(R.size(-1), dtype=R.dtype, device=R.device).expand_as(R)
    Q = eye
    for (a, b, c), restart, fresh, update in zip(
        sched.coeffs, sched.restarts, sched.fresh_q, sched.updates_r, strict=True
    ):
        if restart:
            X = torch.bmm(Q, X)
            R = torch.bmm(X, X.mT)
        Z = torch.baddbmm(R, R, R, beta=b, alpha=c)
        Q = Z + a * eye if fresh else torch.baddbmm(Q, Q, Z, beta=a, alpha=1.0)
        if update:
            RP = torch.baddbmm(R, R, Z, beta=a, alpha=1.0)  # R (a I + Z)
            R = torch.baddbmm(RP, Z, RP, beta=a, alpha=1.0)  # (a I + Z) R (a I + Z)
    X = torch.bmm(Q, X)
    return (X.mT if tall else X).to(G.dtype)


#: Largest smaller side of a matrix that one Triton program orthogonalises (the flat engine's kernel, where Triton
#: runs): its ``m x m`` float32 accumulators take 64 registers per thread at 128 and 8 warps. Larger matrices
#: take the torch path (batched cuBLAS).
TRITON_MAX_ROWS: int = 128


def on_triton(rows: int) -> bool:
    """Whether one Triton program orthogonalises a matrix whose smaller side is ``rows``; else the torch path.

    The one decision of a matrix's path: the engine's layout (and through it the FSDP2 owners), the compile
    registry's variants and ``dp check`` all ask it.
    """
    return rows <= TRITON_MAX_ROWS


#: Device types where the Gram schedule's matrices run its polynomials in the standard form, in float32
#: (:func:`gram_form`), where a GPU runs the Gram form in float16. The CPU has no fast float16 products, and bfloat16
#: products (the fast ones there) round the steep Polar Express polynomials too coarsely: 4 % from deepmd-kit's
#: built-in after six steps on DPA-2 small, where float32 stays within 0.7 % of it (float16's Gram form: 0.6 %). The
#: tests that compare the GPU's kernels under Triton's interpreter empty it.
STANDARD_FORM_DEVICES: frozenset[str] = frozenset({"cpu"})


def gram_form(device: torch.device) -> bool:
    """Whether the Gram schedule's matrices take :func:`gram_newton_schulz` on ``device`` (float16).

    Not on :data:`STANDARD_FORM_DEVICES` (the CPU): there they run the same polynomials (the same map in exact
    arithmetic) by :func:`newton_schulz` in float32.
    """
    return device.type not in STANDARD_FORM_DEVICES


def takes_gram(rows: int, cols: int, use_gram: bool) -> bool:
    """Whether a ``rows x cols`` matrix takes the Gram schedule (rectangular, with ``use_gram``), else the standard.

    The one rule, the same on every device (a square matrix's result never depends on ``use_gram``, as in
    deepmd-kit's built-in), read by :func:`orthogonalize` and the engine's layout.
    """
    return use_gram and rows != cols


def orthogonalize(G: torch.Tensor, use_gram: bool) -> torch.Tensor:
    """Orthogonalise a ``(batch, m, n)`` stack into a new tensor, leaving ``G`` as it was (it may be a live buffer).

    The matrices :func:`takes_gram` names take the Gram schedule: by :func:`gram_newton_schulz` where
    :func:`gram_form` says so, else its polynomials by :func:`newton_schulz` in float32; the others the bfloat16
    standard path.
    """
    if not takes_gram(G.size(-2), G.size(-1), use_gram):
        return newton_schulz(G)
    return gram_newton_schulz(G) if gram_form(G.device) else newton_schulz(G, gram_schedule().coeffs, torch.float32)


# ---------------------------------------------------------------------------
# Update rules
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupSettings:
    """The numbers of one (validated) param_group that the update rules read, read once per step.

    Every implementation (the loop, the engine, the FSDP2 step) takes its hyperparameters from here, so the derived
    rules (Adam's rate, AdamW's decay factor, the Muon scale) are written once.
    """

    lr: float
    weight_decay: float
    momentum: float
    beta1: float
    beta2: float
    lr_adjust: float
    lr_adjust_coeff: float
    magma: bool
    use_gram: bool

    @classmethod
    def of(cls, group: dict) -> GroupSettings:
        """The settings of ``group`` (a param_group of :class:`~deepmd_hybridmuon.HybridMuonOptimizer`)."""
        beta1, beta2 = (float(b) for b in group["adam_betas"])
        return cls(
            lr=float(group["lr"]),
            weight_decay=float(group["weight_decay"]),
            momentum=float(group["momentum"]),
            beta1=beta1,
            beta2=beta2,
            lr_adjust=float(group["lr_adjust"]),
            lr_adjust_coeff=float(group["lr_adjust_coeff"]),
            magma=bool(group["magma_muon"]),
            use_gram=bool(group["enable_gram"]),
        )

    @property
    def adam_lr(self) -> float:
        """Learning rate of the Adam routes (:func:`adam_learning_rate`)."""
        return adam_learning_rate(self.lr, self.lr_adjust)

    @property
    def muon_decay(self) -> float:
        """The Muon route's decoupled decay factor ``1 - lr * weight_decay``."""
        return 1.0 - self.lr * self.weight_decay

    @property
    def adamw_decay(self) -> float:
        """The AdamW route's decoupled decay factor ``1 - adam_lr * weight_decay``."""
        return 1.0 - self.adam_lr * self.weight_decay

    def adam_decay(self, route: str) -> float | None:
        """The decay factor of an Adam-family ``route``: :attr:`adamw_decay`; ``None`` for Adam or no decay."""
        return self.adamw_decay if (route == "adamw" and self.weight_decay > 0) else None

    def scale(self, rows: int, cols: int) -> float:
        """The Muon update scale of a ``rows x cols`` matrix (:func:`muon_scale`)."""
        return muon_scale(rows, cols, self.lr_adjust, self.lr_adjust_coeff)


def adam_learning_rate(lr: float, lr_adjust: float) -> float:
    """Learning rate of the Adam/AdamW routes: ``lr`` when ``lr_adjust <= 0``, else ``lr / lr_adjust``."""
    return lr if lr_adjust <= 0 else lr / lr_adjust


def muon_scale(rows: int, cols: int, lr_adjust: float, lr_adjust_coeff: float) -> float:
    """Multiplier of the orthogonalised update.

    ``lr_adjust <= 0``: ``lr_adjust_coeff * sqrt(max(rows, cols))`` (match the RMS of an
    Adam update, Moonlight/DeepSeek-V4); ``lr_adjust > 0``: ``sqrt(max(1, rows / cols))``.
    """
    if lr_adjust <= 0:
        return lr_adjust_coeff * math.sqrt(float(max(rows, cols)))
    return max(1.0, rows / cols) ** 0.5


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where values of ``dtype`` meet a scalar: ``dtype``, at least float32 (as torch computes with a Python number)."""
    return torch.promote_types(dtype, torch.float32)


def momentum_(buf: torch.Tensor, grad: torch.Tensor, momentum: float | torch.Tensor, ok: torch.Tensor | None) -> None:
    """m <- beta m + (1 - beta) g in place (not where ``ok`` is 0: the gate, or one per element of ``buf``).

    The blend weight ``1 - beta`` is rounded to ``buf``'s dtype first, gated or not. ``momentum`` is a number, or a
    float64 0-dim tensor on ``buf``'s device (the flat engine's captured step reads it from the device).
    """
    tensor = isinstance(momentum, torch.Tensor)
    weight = (1.0 - momentum).to(buf.dtype) if tensor else torch.tensor(1.0 - momentum, dtype=buf.dtype).item()
    buf.lerp_(grad, weight if ok is None else ok.to(buf.dtype) * weight)


def nesterov(
    buf: torch.Tensor, grad: torch.Tensor, momentum: float | torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Nesterov's update beta m + (1 - beta) g (after :func:`momentum_`), in ``buf``'s compute dtype; into ``out``."""
    compute = compute_dtype(buf.dtype)  # where lerp with a number computes
    beta = momentum.to(compute) if isinstance(momentum, torch.Tensor) else momentum
    if compute == buf.dtype:
        return torch.lerp(grad, buf, beta, out=out)
    blend = torch.lerp(grad.to(compute), buf.to(compute), beta).to(buf.dtype)
    return blend if out is None else out.copy_(blend)


def magma_score(
    dot: torch.Tensor, norm_m: torch.Tensor, norm_g: torch.Tensor, eps: torch.Tensor | float = MAGMA_EPS
) -> torch.Tensor:
    """Magma-lite's raw alignment score in [0, 1] from per-block sums (float32 tensors).

    ``dot`` = sum(m * g), ``norm_m`` = |m| and ``norm_g`` = |g| per block: cos(m, g) (the
    product of the norms floored at ``eps``, by default :data:`MAGMA_EPS`, clamped to [-1, 1])
    is mapped through sigmoid(cos / :data:`MAGMA_TAU`) and stretched from
    [:data:`MAGMA_SIGMOID_LOW`, :data:`MAGMA_SIGMOID_HIGH`] to [0, 1]. Every implementation
    (the loop, the flat engine, FSDP2's ranks) follows this function.

    The sums may be those of m 2^-a and g 2^-b (:func:`magma_sums`), with ``eps`` =
    ``MAGMA_EPS 2^-(a+b)`` per block: the cosine is then the same, and no sum overflows. A
    cosine that still is not a number (sums that overflowed) counts as 0, a neutral alignment.
    """
    if isinstance(eps, torch.Tensor):
        eps = eps.clamp(min=torch.finfo(eps.dtype).tiny)  # an underflowed 2^-(a+b): never 0 / 0
    cos = torch.nan_to_num(dot / (norm_m * norm_g).clamp(min=eps), nan=0.0).clamp(-1.0, 1.0)
    s = torch.sigmoid(cos / MAGMA_TAU)
    return ((s - MAGMA_SIGMOID_LOW) / (MAGMA_SIGMOID_HIGH - MAGMA_SIGMOID_LOW)).clamp(0.0, 1.0)


def magma_sums(momentum: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Scale-safe per-row sums for :func:`magma_score`: ``(dot, |m|, |g|, eps)``, float32.

    ``momentum`` and ``grad`` have shape ``(blocks, k)`` (any floating dtype; zero padding
    changes nothing). On the CPU, where reading the sums costs nothing, float32 and float64 rows are
    summed as they are (in their dtype, the sums rounded to float32) unless a sum overflowed. Other
    rows are each multiplied by their :func:`pow2_downscale` in their own dtype first, then summed in
    float32 (float64 rows in float64, the sums rounded to float32): the sums cannot overflow whatever
    the magnitude of the inputs, and the cosine is that of the unscaled rows (bit for bit where no
    row reaches 2).
    """
    wide = momentum.dtype == grad.dtype == torch.float64
    if momentum.device.type == "cpu" and (wide or momentum.dtype == grad.dtype == torch.float32):
        sums = tuple(x.to(torch.float32) for x in ((momentum * grad).sum(-1), momentum.norm(dim=-1), grad.norm(dim=-1)))
        if bool(torch.stack(sums).isfinite().all()):
            return (*sums, torch.full_like(sums[0], MAGMA_EPS))
    work = torch.float64 if wide else torch.float32
    down_m, down_g = pow2_downscale(momentum, -1), pow2_downscale(grad, -1)
    m = (momentum * down_m).to(work)
    g = (grad * down_g).to(work)
    eps = (MAGMA_EPS * down_m.to(torch.float64) * down_g.to(torch.float64)).to(torch.float32).squeeze(-1)
    return *(x.to(torch.float32) for x in ((m * g).sum(dim=-1), m.norm(dim=-1), g.norm(dim=-1))), eps


#: Elements per block of the first pass of :class:`Segments`. torch's CUDA ``segment_reduce`` gives each output one
#: thread that walks its whole segment (one 1024 x 1024 matrix as one segment: a million serial additions, 1.7 s per
#: step for eight 4096 x 4096 matrices on an H200); cut into blocks of this size, the first pass runs a thread per
#: block and the second adds one partial sum per block.
SEGMENT_BLOCK = 1024
#: Elements of the buffer per part of :class:`Segments`' first pass (each part: the blocks that start in it):
#: :func:`magma_segment_sums` keeps one float64 copy of a part alive (about 32 MiB), where a copy of the whole buffer
#: would grow with the model; each part costs about ten kernels, so models of up to 4 M Muon elements take one.
SEGMENT_PART = 1 << 22
#: Device types where the flat engine takes Magma's sums over segments (:func:`magma_segment_sums`: a few kernels for
#: every matrix at once); elsewhere per parameter (:func:`magma_sums`; on the CPU torch's ``segment_reduce`` is slower
#: than that). The tests add the CPU to run the segments there.
SEGMENT_SUM_DEVICES: frozenset[str] = frozenset({"cuda"})


class Segments:
    """Per-matrix sums over a flat buffer cut into consecutive segments, in two passes of ``segment_reduce``.

    Segment ``i`` holds ``lengths[i]`` elements of matrix ``matrix[i]`` (of ``count``); several segments may belong
    to one matrix (FSDP2's shards) and a matrix may have none. The device's way to Magma's sums: a few kernels for
    the whole buffer, where one set per matrix would be hundreds (on the CPU, torch's ``segment_reduce`` is slower
    than summing each segment alone: :attr:`bounds`). The first pass sums blocks of at most :data:`SEGMENT_BLOCK`
    elements, part by part of the buffer (:data:`SEGMENT_PART`); the second adds each segment's blocks.
    """

    def __init__(self, lengths: list[int], matrix: list[int], count: int, device: torch.device) -> None:
        self.count = count
        # (start, length) of each segment
        self.bounds = list(zip(itertools.accumulate(lengths, initial=0), lengths, strict=False))
        self.matrix = torch.tensor(matrix, dtype=torch.long, device=device)
        cut = [-(-n // SEGMENT_BLOCK) for n in lengths]
        fine = [min(SEGMENT_BLOCK, n - b * SEGMENT_BLOCK) for n, k in zip(lengths, cut, strict=True) for b in range(k)]
        self.coarse = torch.tensor(cut, dtype=torch.long, device=device)
        self.identity = matrix == list(range(count))  # one segment per matrix, in order: the one-process engine
        # (part of the buffer, the lengths of its blocks): the blocks that start in each SEGMENT_PART elements
        starts = [0, *itertools.accumulate(fine)]
        parts = [list(run) for _, run in itertools.groupby(range(len(fine)), lambda b: starts[b] // SEGMENT_PART)]
        self.parts = [
            (slice(starts[run[0]], starts[run[-1] + 1]), torch.tensor(fine[run[0] : run[-1] + 1], device=device))
            for run in parts
        ]

    def sums(self, columns: Callable[[slice], Iterable[torch.Tensor]], width: int) -> torch.Tensor:
        """Per-matrix sums ``(count, width)`` of the ``width`` columns that ``columns(part)`` yields for each part.

        Each column is reduced before the next is asked for, so ``columns`` may rewrite one buffer for all of them.
        """
        if not self.parts:  # every segment empty (a rank that holds no piece)
            pieces = torch.zeros((self.coarse.numel(), width), dtype=torch.float64, device=self.coarse.device)
        else:
            # unsafe: the lengths add up by construction; the checks read two results on the host, each a wait.
            first = [
                torch.stack([torch.segment_reduce(c, "sum", lengths=n, axis=0, unsafe=True) for c in columns(part)], 1)
                for part, n in self.parts
            ]
            pieces = torch.segment_reduce(torch.cat(first), "sum", lengths=self.coarse, axis=0, unsafe=True)
        return self.per_matrix(pieces)

    def per_matrix(self, pieces: torch.Tensor) -> torch.Tensor:
        """Each segment's row of ``pieces`` ``(segments, width)`` added into its matrix's: ``(count, width)``."""
        if self.identity:
            return pieces
        return pieces.new_zeros((self.count, pieces.size(1))).index_copy_(0, self.matrix, pieces)


def magma_segment_sums(momentum: torch.Tensor, grad: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Magma's sums per matrix, ``(matrices, 3)`` float64: ``m·g``, ``m·m``, ``g·g`` over ``segments``.

    Unscaled, so that the sums of several pieces of a matrix (FSDP2's shards) add up: float64 for inputs of at most
    32 bits cannot overflow (a product of two finite float32 numbers, or a sum of 2^700 of them, is finite, and
    float32's smallest numbers square to normal float64 ones); float64 inputs are below :data:`GRAD_LIMIT`. One
    float64 buffer per part of :class:`Segments`, rewritten for each sum; off :data:`SEGMENT_SUM_DEVICES` (the CPU:
    FSDP2's owners) three float64 dot products per segment, several times faster there.
    """
    if momentum.device.type not in SEGMENT_SUM_DEVICES:
        rows = [
            torch.stack([torch.dot(m, g), torch.dot(m, m), torch.dot(g, g)])
            for m, g in ((momentum[i : i + n].double(), grad[i : i + n].double()) for i, n in segments.bounds)
        ]
        return segments.per_matrix(torch.stack(rows) if rows else momentum.new_zeros((0, 3), dtype=torch.float64))

    def columns(part: slice) -> Iterator[torch.Tensor]:
        m, g = momentum[part], grad[part]
        wide = g.to(torch.float64, copy=True)
        yield wide.mul_(m)
        yield wide.copy_(m).square_()
        yield wide.copy_(g).square_()

    return segments.sums(columns, 3)


def magma_damp(scores: torch.Tensor, sums: torch.Tensor, ok: torch.Tensor | None) -> torch.Tensor:
    """Magma's multiplier per matrix from :func:`magma_segment_sums`'s ``sums``; advances ``scores`` (gated)."""
    raw = magma_score(sums[:, 0], sums[:, 1].sqrt(), sums[:, 2].sqrt()).to(torch.float32)
    return magma_scale_(scores, raw, ok)


def magma_scale_(score: torch.Tensor, raw: torch.Tensor, ok: torch.Tensor | None = None) -> torch.Tensor:
    """EMA ``score`` towards ``raw`` in place (kept when ``ok`` is 0); return the multipliers in [0.1, 1]."""
    if ok is None:
        score.mul_(MAGMA_EMA_DECAY).add_(raw, alpha=1.0 - MAGMA_EMA_DECAY)
    else:
        new = (score * MAGMA_EMA_DECAY).add_(raw, alpha=1.0 - MAGMA_EMA_DECAY)
        score.copy_(torch.where(ok > 0, new, score))
    return MAGMA_MIN_SCALE + (1.0 - MAGMA_MIN_SCALE) * score


def muon_factor(scale: torch.Tensor, multiplier: torch.Tensor | None, neg_lr: torch.Tensor | float) -> torch.Tensor:
    """Each matrix's factor, float32: Muon scale (:func:`muon_scale`) x Magma multiplier (or ``None``) x -lr (gated)."""
    factor = scale if multiplier is None else scale * multiplier
    return factor * (neg_lr.to(torch.float32) if isinstance(neg_lr, torch.Tensor) else neg_lr)


def post_orthogonalize(ortho: torch.Tensor, factor: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The rule after orthogonalisation: each matrix of a ``(batch, m, n)`` stack times its factor, into ``out``.

    Multiplied in float32 (float64 for a float64 ``out``) and rounded once to ``out``'s dtype, as the Triton kernel
    does as it stores; the parameter then takes ``p * decay + update``. The loop, the engine's torch path and the
    FSDP2 owners call it.
    """
    return torch.mul(ortho, factor.view(-1, 1, 1).to(compute_dtype(out.dtype)), out=out)


def adam_bias_corrected(lr: float, beta1_pow: float, beta2_pow: float) -> tuple[float, float]:
    """Adam's bias corrections at step t (``beta*_pow`` = beta^t): ``(-lr / (1 - beta1^t), 1 - beta2^t)``."""
    return -lr / (1.0 - beta1_pow), 1.0 - beta2_pow


def adam_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    beta1: float,
    beta2: float,
    beta1_pow: float,
    beta2_pow: float,
    lr: float,
    decay_factor: float | None,
    ok: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step on ``param`` with float32 moments.

    ``beta*_pow`` are beta^t for the current step t (already multiplied in). ``decay_factor``
    (``1 - lr * weight_decay``) multiplies the parameter first (decoupled decay); ``None`` for no decay. ``ok`` (see
    :func:`finite_gate`): a 0-dim float tensor, 1 to step, 0 to leave parameter and moments unchanged.
    """
    neg_step, bc2 = adam_bias_corrected(lr, beta1_pow, beta2_pow)
    if decay_factor is not None:
        param.mul_(gate_factor(decay_factor, ok, param.dtype))
    weights = (1.0 - beta1, 1.0 - beta2) if ok is None else (ok * (1.0 - beta1), ok * (1.0 - beta2))
    step = neg_step if ok is None else ok * neg_step
    increment = adam_increment_(exp_avg, exp_avg_sq, sanitize(grad.to(torch.float32), ok), weights, bc2, step)
    param.add_(increment.to(param.dtype))


def adam_increment_(
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    grad: torch.Tensor,
    weights: tuple[float | torch.Tensor, float | torch.Tensor],
    bc2: float | torch.Tensor,
    neg_step: float | torch.Tensor,
) -> torch.Tensor:
    """Adam's moments blended towards ``grad`` (``weights``: 1 - beta1, 1 - beta2); ``-step m / (sqrt(v / bc2) + eps)``.

    Float32; the numbers may be tensors that broadcast over the elements (the engine's per-parameter steps).
    """
    exp_avg.lerp_(grad, weights[0])
    exp_avg_sq.lerp_(grad * grad, weights[1])
    denom = (exp_avg_sq / bc2).sqrt_().add_(ADAM_EPS)
    return torch.div(exp_avg, denom, out=denom).mul_(neg_step)


# ---------------------------------------------------------------------------
# Non-finite gradients
# ---------------------------------------------------------------------------
#
# A step whose gradients contain a NaN or an infinity is skipped, on the device and without a host synchronisation:
# ``ok`` is 1.0 or 0.0, every state blend weight and every parameter increment is multiplied by it, and gradients
# are zeroed where they are not finite so that 0 * NaN never happens. Parameters, momenta, Adam moments and Magma
# scores then keep their values. (deepmd-kit's built-in writes NaN into the parameters.)


def finite_gate(grads: list[torch.Tensor], adam_grads: list[torch.Tensor] = ()) -> torch.Tensor:
    """0-dim float32 tensor: 1.0 if the step can be taken, else 0.0.

    It can when every element of every gradient is finite and below :data:`GRAD_LIMIT` in
    magnitude, and every element of the Adam-routed ``adam_grads`` (which need not be repeated in
    ``grads``) is below :data:`ADAM_GRAD_LIMIT`: one :func:`peak` per non-empty gradient (a NaN
    makes its peak NaN, which no comparison lets through).
    """
    device = (grads or adam_grads)[0].device
    ok = torch.ones((), dtype=torch.bool, device=device)
    for group, limit in ((grads, GRAD_LIMIT), (adam_grads, ADAM_GRAD_LIMIT)):
        peaks = [peak(g).to(device=device, dtype=torch.float32) for g in group if g.numel()]
        if peaks:
            ok = ok & ((peaks[0] if len(peaks) == 1 else torch.stack(peaks).amax()) < limit)
    return ok.to(torch.float32)


def sanitize(grad: torch.Tensor, ok: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``grad`` if the step is taken, else zeros (so NaN never meets a zero weight), into ``out``.

    ``ok`` None: ``grad`` itself (``out`` is not written).
    """
    if ok is None:
        return grad
    return torch.where(ok > 0, grad, torch.zeros((), dtype=grad.dtype, device=grad.device), out=out)


def gate_factor(factor: float | torch.Tensor, ok: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | float:
    """A multiplicative factor (weight decay) that becomes 1 when the step is skipped; ``ok`` None: it.

    In ``dtype``, at least float32: a half-precision parameter is multiplied by the factor itself, as by a Python
    number, not by its rounding (bfloat16 holds 1 - 0.01 as 0.98828).
    """
    if ok is None:
        return factor
    dtype = compute_dtype(dtype)
    if not isinstance(factor, torch.Tensor):
        # A fill on the device: torch.tensor(factor, device=...) copies from the host and makes
        # the host wait for the GPU's queue (the same value, rounded to dtype alike).
        factor = torch.full((), factor, dtype=dtype, device=ok.device)
    return torch.where(ok > 0, factor.to(dtype), 1.0)
