"""The pure math of :mod:`deepmd_hybridmuon.functional`: Newton–Schulz paths and small tables.

Precision facts used by the tolerances below (unit roundoff u = half the gap at 1):

* bfloat16 (standard Newton–Schulz path): 8 significant bits, u = 2^-8 ≈ 3.9e-3.
* float16 (Gram path iteration): 11 significant bits, u = 2^-11 ≈ 4.9e-4.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepmd_hybridmuon import functional as F

#: bfloat16 unit roundoff.
BF16_U = 2.0**-8
#: Singular values of the standard path's output: the polish step
#: ``X <- 2X - 1.5 A X + 0.5 A^2 X`` has slope 0 at sigma = 1, so it removes the error of
#: earlier steps from the singular values; what is left is the last step's own
#: rounding, three terms of size ~1 summed and rounded in bfloat16, i.e. a few units of
#: 2^-8. Four units, 2^-6 ≈ 0.0156, bound |sigma - 1|. Measured: sigma in [0.9969, 1.0040].
NS_TOL = 4 * BF16_U
#: Distance to the polar factor U V^T: the polish step does not undo rotations of the
#: singular vectors, so each of the 10 bfloat16 iterations leaves a rounding of relative
#: size ~2^-8 in them; they add up like a random walk, sqrt(10) * 2^-8 ≈ 0.012, and at
#: worst linearly, 10 * 2^-8 ≈ 0.039. 2^-5 ≈ 0.031 lies in between. Measured: <= 0.0102
#: (64 x 16), 0.0059 for the square 24 x 24.
POLAR_TOL = 8 * BF16_U
#: Gram path vs the exact (float64) result of its own polynomial schedule: float16
#: roundings (u = 4.9e-4) are amplified by the steep Polar Express polynomials (the
#: first has slope a/1.05 ≈ 7.9 near 0). Measured <= 9.0e-3 (about 18 fp16 units) on
#: the matrices below; 0.03 leaves a factor of three.
GRAM_TOL = 0.03

SHAPES = [(1, 8, 32), (1, 32, 8), (1, 24, 24), (1, 64, 16), (3, 16, 40)]
RECT_SHAPES = [s for s in SHAPES if s[1] != s[2]]
NS_SCHEDULE = [F.NS_FAST_COEFFS] * F.NS_FAST_STEPS + [F.NS_POLISH_COEFFS] * F.NS_POLISH_STEPS


def random_matrices(shape: tuple[int, int, int], seed: int, cond: float = 20.0) -> torch.Tensor:
    """Float32 ``(batch, m, n)`` matrices U diag(s) V^T, random orthogonal U and V, s log-uniform in [1/cond, 1].

    A bounded condition number keeps every normalised singular value above
    1 / (cond * sqrt(min(m, n))) >= 1e-2, where both iterations have converged (the
    standard schedule needs >= 1e-4, the Gram schedule >= 3e-3); an unbounded Gaussian
    square matrix can have singular values of 1e-6, whose polar directions are not
    determined to bfloat16 precision at all.
    """
    batch, m, n = shape
    k = min(m, n)
    gen = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(batch, m, k, generator=gen, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(batch, n, k, generator=gen, dtype=torch.float64))
    s = cond ** -torch.rand(batch, k, generator=gen, dtype=torch.float64)
    return (u @ torch.diag_embed(s) @ v.mT).to(torch.float32)


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """U V^T of the thin SVD, in float64."""
    u, _, vh = torch.linalg.svd(G.double(), full_matrices=False)
    return u @ vh


def spectral_prediction(G: torch.Tensor, coeffs: list[tuple[float, float, float]]) -> torch.Tensor:
    """U p(S / ||G||_F) V^T in float64, p the composition of the quintics ``coeffs``."""
    g = G.double()
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    s = s / g.norm(dim=(-2, -1)).unsqueeze(-1)
    for a, b, c in coeffs:
        s = a * s + b * s**3 + c * s**5
    return u @ torch.diag_embed(s) @ vh


def composed_range(coeffs: list[tuple[float, float, float]], low: float) -> tuple[float, float]:
    """Min and max of the composed scalar polynomial over [low, 1] (dense float64 grid)."""
    x = torch.logspace(math.log10(low), 0.0, 200_001, dtype=torch.float64)
    for a, b, c in coeffs:
        x = a * x + b * x**3 + c * x**5
    return float(x.min()), float(x.max())


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest relative Frobenius distance ||a - b|| / ||b|| over the batch."""
    a, b = a.double(), b.double()
    return float(((a - b).norm(dim=(-2, -1)) / b.norm(dim=(-2, -1))).max())


# ----------------------------------------------------------------------------- standard path


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_newton_schulz_singular_values_and_polar_factor(shape: tuple[int, int, int], seed: int) -> None:
    G = random_matrices(shape, seed)
    X = F.newton_schulz(G)
    assert X.dtype == torch.bfloat16
    assert X.shape == G.shape
    sv = torch.linalg.svdvals(X.double())
    # The exact schedule maps every normalised singular value >= 1e-4 into
    # [1, 1.0021] (see test_ns_schedule_pins_singular_values); the rest is bf16 rounding.
    assert float(sv.min()) >= 1 - NS_TOL
    assert float(sv.max()) <= 1 + NS_TOL
    assert rel_fro(X, polar_factor(G)) <= POLAR_TOL


def test_ns_schedule_pins_singular_values() -> None:
    # The coefficients' promise, in exact arithmetic: 8 fast + 2 polish steps send every
    # normalised singular value in [1e-4, 1] into [1, 1.0021] (measured 1.000000, 1.002017).
    # The polish step x -> 2x - 1.5x^3 + 0.5x^5 has slope 0 at its fixed point 1.
    low, high = composed_range(NS_SCHEDULE, 1e-4)
    assert 1.0 - 1e-9 <= low and high <= 1.0025
    assert F.NS_POLISH_COEFFS == (2.0, -1.5, 0.5)
    a, b, c = F.NS_POLISH_COEFFS
    assert a + b + c == 1.0  # fixed point at 1
    assert a + 3 * b + 5 * c == 0.0  # slope 0 there


def test_newton_schulz_iterates_over_its_schedule() -> None:
    """The standard iteration is its table: the default is the table, and another table gives another result."""
    assert F.standard_schedule() == tuple(NS_SCHEDULE)
    G = random_matrices((1, 16, 40), seed=3)
    assert torch.equal(F.newton_schulz(G), F.newton_schulz(G, F.standard_schedule()))
    # Three fast steps, no polish: the singular values are not pinned to 1 yet (the
    # composed polynomial leaves them in roughly [0.7, 1.2]), far beyond bf16 rounding.
    short = F.newton_schulz(G, (F.NS_FAST_COEFFS,) * 3)
    assert rel_fro(short, F.newton_schulz(G)) > 10 * NS_TOL
    assert rel_fro(short, spectral_prediction(G, [F.NS_FAST_COEFFS] * 3)) <= POLAR_TOL


# ----------------------------------------------------------------------------- Gram path


@pytest.mark.parametrize("shape", RECT_SHAPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gram_newton_schulz_matches_its_polynomial(shape: tuple[int, int, int], seed: int) -> None:
    G = random_matrices(shape, seed)
    Y = F.gram_newton_schulz(G)
    assert Y.dtype == G.dtype and Y.shape == G.shape
    # The Gram iteration applies p(X X^T) X, so its output has G's singular vectors and
    # singular values p(sigma), p the composition of the five Polar Express quintics.
    assert rel_fro(Y, spectral_prediction(G, list(F.POLAR_EXPRESS_COEFFS))) <= GRAM_TOL
    # Five Polar Express steps with the 1.05 safety factor do not reach 1 exactly: over the
    # normalised singular values of these inputs (>= 1e-2, and in fact anything >= 3e-3)
    # the composed polynomial stays in [0.8461, 1.1236]. That band, widened by the fp16
    # rounding above, is what the coefficients promise. Measured: [0.8456, 1.1233].
    low, high = composed_range(list(F.POLAR_EXPRESS_COEFFS), 3e-3)
    assert 0.84 < low < 0.85 and 1.12 < high < 1.13
    sv = torch.linalg.svdvals(Y.double())
    assert float(sv.min()) >= low - GRAM_TOL
    assert float(sv.max()) <= high + GRAM_TOL
    # Hence the distance to the polar factor is set by the band, not by rounding.
    assert rel_fro(Y, polar_factor(G)) <= max(1 - low, high - 1) + GRAM_TOL


@pytest.mark.parametrize("shape", RECT_SHAPES, ids=str)
def test_gram_and_standard_paths_agree(shape: tuple[int, int, int]) -> None:
    G = random_matrices(shape, seed=7)
    X = F.newton_schulz(G)
    Y = F.gram_newton_schulz(G)
    # Both outputs share G's singular vectors; singular value by singular value they
    # differ by |p_gram(s) - p_ns(s)| <= max(1 - 0.8461, 1.1236 - 1) = 0.154 (the Gram band)
    # plus each path's rounding (GRAM_TOL, POLAR_TOL). Measured: 0.089 to 0.109.
    low, high = composed_range(list(F.POLAR_EXPRESS_COEFFS), 3e-3)
    tol = max(1 - low, high - 1) + GRAM_TOL + POLAR_TOL
    assert rel_fro(Y, X) <= tol
    # ... and they are not the same computation: the Gram output is visibly off 1.
    assert rel_fro(Y, X) > 4 * NS_TOL


def test_gram_schedule_flags_follow_the_restarts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Q starts afresh at 0 and at each restart; R is not updated before a restart nor after the last step."""
    sched = F.gram_schedule()
    assert sched.coeffs == F.POLAR_EXPRESS_COEFFS
    assert sched.restarts == (False, False, True, False, False)
    assert sched.fresh_q == (True, False, True, False, False)
    assert sched.updates_r == (True, False, True, True, False)
    assert sched.segments == ((0, 2), (2, 5))
    monkeypatch.setattr(F, "GRAM_RESTART_ITERATIONS", frozenset({1, 3}))
    monkeypatch.setattr(F, "POLAR_EXPRESS_COEFFS", F.POLAR_EXPRESS_COEFFS[:4])
    sched = F.gram_schedule()
    assert sched.restarts == (False, True, False, True)
    assert sched.fresh_q == (True, True, False, True)
    assert sched.updates_r == (False, True, False, False)
    assert sched.segments == ((0, 1), (1, 3), (3, 4))
    monkeypatch.setattr(F, "GRAM_RESTART_ITERATIONS", frozenset({4}))
    with pytest.raises(ValueError, match=r"GRAM_RESTART_ITERATIONS holds \[4\]; restarts lie in 1..3"):
        F.gram_schedule()
    with pytest.raises(ValueError, match="the first iteration cannot restart"):
        F.GramSchedule(F.POLAR_EXPRESS_COEFFS[:2], (True, False))
    with pytest.raises(ValueError, match="restarts has 1 flags for 2 iterations"):
        F.GramSchedule(F.POLAR_EXPRESS_COEFFS[:2], (False,))


@pytest.mark.parametrize("restarts", [(), (1, 3), (1, 2, 3)], ids=["none", "1-3", "1-2-3"])
def test_gram_newton_schulz_iterates_over_its_schedule(restarts: tuple[int, ...]) -> None:
    """Any coefficient table with any restarts computes its own composed polynomial."""
    G = random_matrices((2, 16, 48), seed=4)
    coeffs = F.POLAR_EXPRESS_COEFFS[:4]
    sched = F.GramSchedule(coeffs, tuple(k in restarts for k in range(len(coeffs))))
    Y = F.gram_newton_schulz(G, sched)
    # Same bound and reason as test_gram_newton_schulz_matches_its_polynomial (one step fewer).
    assert rel_fro(Y, spectral_prediction(G, list(coeffs))) <= GRAM_TOL
    # Without the fifth Polar Express step the singular values stay far from the band of
    # the full schedule: a table of four rows is not the default one.
    assert rel_fro(Y, F.gram_newton_schulz(G)) > 10 * GRAM_TOL


@pytest.mark.parametrize("shape", RECT_SHAPES, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_cpu_runs_the_gram_polynomial_in_float32(shape: tuple[int, int, int], seed: int) -> None:
    G = random_matrices(shape, seed)
    Y = F.orthogonalize(G, use_gram=True)
    assert not F.gram_form(G.device) and Y.dtype == torch.float32
    # The Gram path's polynomial (its singular values and band, as above) in the standard form in float32: five
    # steps, each rounding at 2^-24, amplified by the steep first Polar Express steps (slope ~7.9 near 0).
    # Measured <= 2.0e-6 on these matrices; 2^-17 (7.6e-6) leaves a factor of about four.
    assert rel_fro(Y, spectral_prediction(G, list(F.POLAR_EXPRESS_COEFFS))) <= 2.0**-17


def test_orthogonalize_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    rect = random_matrices((2, 8, 12), seed=3)
    square = random_matrices((2, 8, 8), seed=3)
    # On the CPU (no fast float16 products) the Gram schedule runs in the standard form, in float32
    assert torch.equal(
        F.orthogonalize(rect, use_gram=True), F.newton_schulz(rect, F.gram_schedule().coeffs, torch.float32)
    )
    monkeypatch.setattr(F, "STANDARD_FORM_DEVICES", frozenset())  # as on a GPU
    assert torch.equal(F.orthogonalize(rect, use_gram=True), F.gram_newton_schulz(rect))
    for gpu in (False, True):  # square matrices take the standard path whatever enable_gram, on every device
        monkeypatch.setattr(F, "STANDARD_FORM_DEVICES", frozenset() if gpu else frozenset({"cpu"}))
        assert torch.equal(F.orthogonalize(rect, use_gram=False), F.newton_schulz(rect))
        assert torch.equal(F.orthogonalize(square, use_gram=True), F.newton_schulz(square))
        assert torch.equal(F.orthogonalize(square, use_gram=False), F.newton_schulz(square))


# ----------------------------------------------------------------------------- padding, batches, zeros


def _orientation_preserving_pads(m: int, n: int) -> list[tuple[int, int]]:
    """(extra rows, extra cols) that keep the wide/tall orientation of an m x n matrix.

    Padding that flips the orientation (e.g. a square matrix grown by one row) makes the
    iteration work on X^T X instead of X X^T: the same polar factor in exact arithmetic,
    but a different sequence of roundings (measured up to 1e-2 relative), and padding a
    matrix's long side past its short side leaves it rank-deficient in the other
    orientation, where rounding noise in the null directions is amplified.
    """
    if m < n:
        return [(0, 1), (0, 7), (0, 16), (min(2, n - m - 1), 9), (1, 1)]
    if m > n:
        return [(1, 0), (7, 0), (16, 0), (9, min(2, m - n - 1)), (1, 1)]
    return [(0, 1), (0, 5), (3, 3)]


@pytest.mark.parametrize(
    ("fn", "tol"),
    [
        # Zero rows/columns add exact zeros to every dot product, so only the matmul
        # kernel's blocking over a longer summation can change a rounding. bfloat16:
        # measured bitwise identical here (and on 900 padded Gaussian cases); the bound
        # allows one bf16 flip.
        (F.newton_schulz, BF16_U),
        # float16 Gram path: often bitwise, but up to 4.2e-3 relative here (6.5e-3 over 180
        # padded Gaussian 64 x 16 cases) when the summation length of X^T X changes; a
        # rounding flip is amplified by the Polar Express polynomials as in GRAM_TOL.
        (F.gram_newton_schulz, GRAM_TOL),
    ],
    ids=["standard", "gram"],
)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_zero_padding_commutes(fn, tol: float, shape: tuple[int, int, int]) -> None:
    _, m, n = shape
    G = random_matrices(shape, seed=11)
    ref = fn(G)
    for extra_rows, extra_cols in _orientation_preserving_pads(m, n):
        padded = torch.nn.functional.pad(G, (0, extra_cols, 0, extra_rows))
        out = fn(padded)
        # The padding itself stays exactly zero: padded rows/columns of X stay zero
        # through every X X^T / Q X product.
        assert torch.count_nonzero(out[:, m:, :]) == 0
        assert torch.count_nonzero(out[:, :, n:]) == 0
        assert rel_fro(out[:, :m, :n], ref) <= tol, (extra_rows, extra_cols)


@pytest.mark.parametrize("fn", [F.newton_schulz, F.gram_newton_schulz], ids=["standard", "gram"])
def test_batch_slices_are_independent(fn) -> None:
    G = random_matrices((3, 16, 40), seed=5)
    G[1] *= 1e3  # each slice is normalised by its own Frobenius norm
    batched = fn(G)
    for i in range(3):
        single = fn(G[i : i + 1])
        # Same per-matrix arithmetic, but the CPU float16 bmm kernels may block a batch of 3
        # differently from a batch of 1, so allow rounding-level differences as above.
        # Measured: standard path bitwise; Gram path bitwise for slice 0 only.
        assert rel_fro(batched[i : i + 1], single) <= (BF16_U if fn is F.newton_schulz else GRAM_TOL)


@pytest.mark.parametrize(
    "fn", [F.newton_schulz, F.gram_newton_schulz, F.orthogonalize], ids=["standard", "gram", "dispatch"]
)
@pytest.mark.parametrize("shape", [(1, 8, 32), (2, 32, 8), (1, 6, 6)], ids=str)
def test_zero_matrix_stays_zero(fn, shape: tuple[int, int, int]) -> None:
    G = torch.zeros(shape)
    out = fn(G, True) if fn is F.orthogonalize else fn(G)
    assert out.shape == G.shape
    assert torch.isfinite(out).all()
    # NS_EPS floors the norm, so 0 / eps = 0 and every iteration keeps zeros.
    assert torch.count_nonzero(out) == 0


def test_zero_slice_in_a_batch_does_not_spoil_others() -> None:
    G = random_matrices((3, 8, 16), seed=2)
    G[1] = 0.0
    for fn in (F.newton_schulz, F.gram_newton_schulz):
        out = fn(G)
        assert torch.isfinite(out).all()
        assert torch.count_nonzero(out[1]) == 0
        assert rel_fro(out[[0, 2]], fn(G[[0, 2]])) <= GRAM_TOL


# ----------------------------------------------------------------------------- scalar tables


@pytest.mark.parametrize(
    ("rows", "cols", "lr_adjust", "coeff", "expected"),
    [
        # lr_adjust <= 0: match-RMS scale coeff * sqrt(max(rows, cols)).
        (16, 64, 0.0, 0.18, 0.18 * 8.0),
        (64, 16, 0.0, 0.18, 0.18 * 8.0),
        (9, 4, -1.0, 0.2, 0.2 * 3.0),
        (25, 25, 0.0, 0.18, 0.18 * 5.0),
        (4, 9, 0.0, 0.0, 0.0),
        # lr_adjust > 0: rectangular correction sqrt(max(1, rows / cols)), coeff unused.
        (16, 4, 2.0, 0.18, 2.0),
        (4, 16, 2.0, 0.18, 1.0),
        (8, 8, 1e-9, 123.0, 1.0),
        (36, 4, 10.0, 0.18, 3.0),
    ],
)
def test_muon_scale(rows: int, cols: int, lr_adjust: float, coeff: float, expected: float) -> None:
    assert F.muon_scale(rows, cols, lr_adjust, coeff) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize(
    ("lr", "lr_adjust", "expected"),
    [(1e-3, 0.0, 1e-3), (1e-3, -2.0, 1e-3), (1e-3, 10.0, 1e-4), (2e-2, 0.5, 4e-2)],
)
def test_adam_learning_rate(lr: float, lr_adjust: float, expected: float) -> None:
    # lr_adjust <= 0: Adam at lr (the match-RMS Muon scale); > 0: Adam at lr / lr_adjust (deepmd-kit 3.2.0's rule)
    assert F.adam_learning_rate(lr, lr_adjust) == pytest.approx(expected, rel=1e-15)


def _raw_score(m: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Magma's raw score of each row of momentum and gradient, as the loop takes it."""
    return F.magma_score(*F.magma_sums(m, g))


def test_magma_score_of_sums_table() -> None:
    g = torch.tensor([[1.0, 2.0, -3.0, 0.5]])
    ortho = torch.tensor([[2.0, -1.0, 0.0, 0.0]])  # <g, ortho> = 0
    assert float((g * ortho).sum()) == 0.0
    cases = [
        (g, "cos = 1", 1.0),
        (3.7 * g, "cos = 1, any positive scale", 1.0),
        (-g, "cos = -1", 0.0),
        (ortho, "cos = 0", 0.5),
        (torch.zeros_like(g), "zero momentum: cos = 0 / eps = 0", 0.5),
    ]
    # float32 sigmoid and the stretch (s - s_lo) / (s_hi - s_lo): a few float32 ulps.
    for m, what, expected in cases:
        score = _raw_score(m, g)
        assert score.shape == (1,), what
        assert score.dtype == torch.float32, what
        assert float(score) == pytest.approx(expected, abs=1e-6), what


def test_magma_score_from_partial_sums_is_the_raw_score() -> None:
    """The engine and the kernel add the sums of a block's pieces; the score is that of the whole block."""
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(3, 300, generator=gen)
    g = 0.4 * m + torch.randn(3, 300, generator=gen)
    pieces = [(m[:, i : i + 100], g[:, i : i + 100]) for i in range(0, 300, 100)]
    dot = sum((mp * gp).sum(-1) for mp, gp in pieces)
    mm = sum((mp * mp).sum(-1) for mp, _ in pieces)
    gg = sum((gp * gp).sum(-1) for _, gp in pieces)
    # float32 sums in another order than the norms: a few float32 roundings
    torch.testing.assert_close(F.magma_score(dot, mm.sqrt(), gg.sqrt()), _raw_score(m, g), rtol=0, atol=1e-6)
    assert float(_raw_score(m, g).min()) > 0.5  # aligned on purpose: not the neutral score


def test_magma_score_of_sums_rows_and_range() -> None:
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(64, 20, generator=gen, dtype=torch.float64)
    g = torch.randn(64, 20, generator=gen, dtype=torch.float64)
    score = _raw_score(m, g)
    assert score.shape == (64,) and score.dtype == torch.float32
    assert bool(((score >= 0) & (score <= 1)).all())
    # Row by row, a monotone function of the cosine: sigmoid(cos / 2), stretched.
    cos = torch.nn.functional.cosine_similarity(m, g, dim=-1)
    lo, hi = 1 / (1 + math.exp(0.5)), 1 / (1 + math.exp(-0.5))
    expected = (torch.sigmoid(cos / 2) - lo) / (hi - lo)
    # float32 evaluation of a float64 reference: well below 1e-5.
    torch.testing.assert_close(score.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("parts", [1, 4])
def test_magma_segment_sums_span_several_blocks(monkeypatch, parts: int) -> None:
    """Magma's per-matrix sums over segments longer than one block (two passes), empty ones, any order, the buffer
    taken in one part or in several (whose edges cut segments)."""
    lengths = [2 * F.SEGMENT_BLOCK + 5, 0, 7, F.SEGMENT_BLOCK, 3 * F.SEGMENT_BLOCK]
    monkeypatch.setattr(F, "SEGMENT_PART", -(-sum(lengths) // parts))
    matrix = [2, 4, 0, 3, 1]  # segment i holds (part of) matrix matrix[i]; matrix 4 is empty
    values = torch.randn(sum(lengths), 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = torch.zeros(5, 3, dtype=torch.float64)
    for chunk, m in zip(values.split(lengths), matrix, strict=True):
        expected[m] = chunk.sum(0)
    segments = F.Segments(lengths, matrix, 5, torch.device("cpu"))
    assert (len(segments.parts) > 1) == (parts > 1)  # whole blocks: about `parts` of them
    got = segments.sums(lambda part: values[part].unbind(1), 3)
    # float64, sums of a few thousand O(1) values in another order: agree to ~1e-13
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    # Magma's sums: on the CPU three dot products per segment, elsewhere these two passes; the same float64 sums of
    # exact products (float32 inputs), added in another order: a few float64 roundings of sums up to ~1e4.
    m, g = values[:, 0].float(), values[:, 1].float()
    dots = F.magma_segment_sums(m, g, segments)
    monkeypatch.setattr(F, "SEGMENT_SUM_DEVICES", frozenset({"cpu"}))
    torch.testing.assert_close(dots, F.magma_segment_sums(m, g, segments), rtol=0, atol=1e-10)
    assert not dots[4].any()  # the empty matrix


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale", [None, 1e30, 3.4e38])  # largest |m|, |g|: huge but finite, the sums must not overflow
@pytest.mark.parametrize("part", [None, 3000])  # the whole buffer in one part, or in four whose edges cut blocks
def test_magma_over_segments_is_the_loops_magma(
    monkeypatch, device: str, scale: float | None, part: int | None
) -> None:
    """The engine's Magma on a GPU (float64 sums over segments) gives the loop's multipliers, gated or not."""
    if part is not None:
        monkeypatch.setattr(F, "SEGMENT_PART", part)
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 1, 2000, 9000, 37]  # 9000 spans several blocks of the first pass
    mom = torch.randn(sum(lengths), generator=gen)
    grad = 0.3 * mom + torch.randn(sum(lengths), generator=gen)
    grad[6] = 0.0  # a block with a zero gradient: cos is 0 (the EPS floor), not NaN
    mom[2009 + 4096 : 2009 + 8192] *= 1e-3  # one stretch of the long block at another scale
    if scale is not None:
        mom, grad = (x.double() / x.abs().max() * scale for x in (mom, grad))
    mom, grad = mom.float().to(device), grad.float().to(device)
    assert torch.isfinite(mom).all() and torch.isfinite(grad).all()
    segments = F.Segments(lengths, list(range(len(lengths))), len(lengths), torch.device(device))
    for ok in (1.0, 0.0):
        gate = torch.tensor(ok, device=device)
        scores = torch.full((len(lengths),), 0.5, device=device)
        damp = F.magma_damp(scores, F.magma_segment_sums(mom, grad, segments), gate)
        ref_scores = torch.full((len(lengths),), 0.5, device=device)
        pieces = zip(mom.split(lengths), grad.split(lengths), strict=True)
        raw = torch.cat([F.magma_score(*F.magma_sums(m[None], g[None])) for m, g in pieces])
        ref = F.magma_scale_(ref_scores, raw, gate)
        # float64 sums against the loop's float32 ones (scaled by powers of two): a few float32 roundings
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(damp, ref, rtol=1e-5, atol=1e-6)


def test_magma_scale_ema() -> None:
    score = torch.full((3,), F.MAGMA_INITIAL_SCORE)
    raw = torch.tensor([1.0, 0.0, 0.5])
    scale = F.magma_scale_(score, raw)
    torch.testing.assert_close(score, torch.tensor([0.55, 0.45, 0.5]))
    torch.testing.assert_close(scale, 0.1 + 0.9 * torch.tensor([0.55, 0.45, 0.5]))
    for _ in range(200):
        scale = F.magma_scale_(score, torch.tensor([1.0, 0.0, 0.5]))
    # The EMA converges to raw, so the scale spans exactly [MAGMA_MIN_SCALE, 1].
    torch.testing.assert_close(scale, torch.tensor([1.0, 0.1, 0.55]))


@pytest.mark.parametrize(
    ("name", "leaf"),
    [
        ("layers.0.weight", "weight"),
        ("adam_scales.3", "adam_scales"),
        ("a.b.g1_residual.0", "g1_residual"),
        ("net.Layers.2.Matrix", "matrix"),
        ("x.12.34", "x"),
        ("matrix", "matrix"),
        ("0.1", "0"),  # the first segment is kept even when it is all digits
        ("model.compress_info.0", "compress_info"),
    ],
)
def test_leaf_name(name: str, leaf: str) -> None:
    assert F.leaf_name(name) == leaf


@pytest.mark.parametrize(
    ("name", "route"),
    [
        (None, "muon"),
        ("fitting_net.layers.0.matrix", "muon"),
        ("fitting_net.layers.0.bias", "adam"),
        ("fitting_net.layers.0.b", "adam"),
        ("layers.0.B", "adam"),
        ("attn.q_bias_raw", "adam"),
        ("attn.Bias.3", "adam"),
        ("norm.adam_scale", "adam"),
        ("norm.ADAM_gain.2", "adam"),
        ("layer_scale.adamw_gamma", "adamw"),
        ("layer_scale.AdamW_gamma.0", "adamw"),
        ("x.adamw_bias", "adam"),  # "bias" wins over the adamw_ prefix
        ("x.bias.weight", "muon"),  # only the leaf counts
        ("x.adam.weight", "muon"),
        ("x.adam", "muon"),  # no underscore: no prefix
        ("x.adamw", "muon"),
        ("x.ab", "muon"),
        ("x.idt", "muon"),  # by name; its rank sends it to Adam later
        ("x.g1_residual.0", "muon"),
    ],
)
def test_name_route(name: str | None, route: str) -> None:
    assert F.name_route(name) == route


@pytest.mark.parametrize(
    ("shape", "eff"),
    [
        ((3, 1, 4), (3, 4)),
        ((1, 1), (1,)),
        ((), (1,)),
        ((1,), (1,)),
        ((5,), (5,)),
        ((0, 4), (0, 4)),
        ((1, 0), (0,)),
        ((0,), (0,)),
        ((2, 1, 3, 1, 4), (2, 3, 4)),
        (torch.Size([1, 8]), (8,)),
    ],
)
def test_effective_shape(shape: tuple[int, ...], eff: tuple[int, ...]) -> None:
    assert F.effective_shape(shape) == eff


@pytest.mark.parametrize(
    ("eff", "views"),
    [
        ((5,), {"2d": None, "flat": None, "slice": None}),
        ((1,), {"2d": None, "flat": None, "slice": None}),
        ((3, 4), {"2d": (1, 3, 4), "flat": (1, 3, 4), "slice": (1, 3, 4)}),
        ((2, 3, 4), {"2d": None, "flat": (1, 6, 4), "slice": (2, 3, 4)}),
        ((2, 3, 4, 5), {"2d": None, "flat": (1, 24, 5), "slice": (6, 4, 5)}),
    ],
)
def test_matrix_view(eff: tuple[int, ...], views: dict[str, tuple[int, int, int] | None]) -> None:
    assert set(views) == set(F.MUON_MODES)
    for mode, view in views.items():
        assert F.matrix_view(eff, mode) == view, mode


@pytest.mark.parametrize("mode", ["3d", "Slice", "slice ", "", None])
def test_matrix_view_rejects_unknown_mode(mode) -> None:
    with pytest.raises(ValueError, match=r"Invalid muon_mode: .*; expected one of '2d', 'flat', 'slice'"):
        F.matrix_view((3, 4), mode)


@pytest.mark.parametrize(
    ("name", "shape", "mode", "route", "view"),
    [
        ("w.matrix", (3, 4), "slice", "muon", (1, 3, 4)),
        ("w.matrix", (1, 4), "slice", "adam", None),  # effective rank 1
        ("w.matrix", (1, 1), "flat", "adam", None),
        ("w.matrix", (0, 4), "2d", "muon", (1, 0, 4)),  # size 0: the optimizer skips it
        ("w.bias", (3, 4), "slice", "adam", None),
        ("w.adamw_gamma", (3, 4), "slice", "adamw", None),
        ("w.adamw_gamma", (4,), "slice", "adamw", None),  # the name wins over the rank
        ("w.kernel", (2, 3, 4), "2d", "adamw", None),
        ("w.kernel", (2, 3, 4), "flat", "muon", (1, 6, 4)),
        ("w.kernel", (2, 1, 3, 4), "slice", "muon", (2, 3, 4)),
        (None, (3, 4), "2d", "muon", (1, 3, 4)),
    ],
)
def test_route_parameter(name, shape, mode, route, view) -> None:
    r = F.route_parameter(name, shape, mode)
    assert (r.route, r.view) == (route, view)
    assert r.reason


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([1.0, -2.0, 0.0], 1.0),
        ([1.5e38, 1.5e38, -1.5e38], 1.0),  # below GRAD_LIMIT (2^127), though their float32 sum overflows
        ([3.0e38, 1.0], 0.0),  # finite, but at or above GRAD_LIMIT: the momentum's lerp would overflow
        ([1.0, float("inf")], 0.0),
        ([-float("inf"), 1.0], 0.0),
        ([float("nan")], 0.0),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_finite_gate(values: list[float], expected: float, dtype: torch.dtype) -> None:
    bad = torch.tensor(values).to(dtype)
    if dtype == torch.bfloat16 and expected:
        bad = bad.clamp(-1e30, 1e30)  # bfloat16's range is float32's; stay clear of its rounding to inf
    fine = torch.ones(3, dtype=torch.float64)
    assert F.finite_gate([bad]).item() == expected
    assert F.finite_gate([fine, bad]).item() == expected  # mixed dtypes, one flag
    assert F.finite_gate([fine]).dtype == torch.float32


def test_the_written_out_algorithm_states_the_specifications_constants() -> None:
    """The optimizer's docstring and the schema's Magma doc quote functional.py's constants, not other numbers."""
    from deepmd_hybridmuon import HybridMuonOptimizer
    from deepmd_hybridmuon.schema import hybrid_muon_arguments

    doc = " ".join((HybridMuonOptimizer.__doc__ or "").split())
    a, b, c = F.NS_FAST_COEFFS
    assert f"{F.NS_FAST_STEPS} iterations with ({a:.4f}, {b:.4f}, {c:.4f})" in doc
    assert f"{F.NS_POLISH_STEPS} with ({', '.join(f'{x:g}' for x in F.NS_POLISH_COEFFS)})" in doc
    steps = {5: "five"}[len(F.POLAR_EXPRESS_COEFFS)]
    ordinal = {2: "third"}[min(F.GRAM_RESTART_ITERATIONS)]  # 0-based iteration index
    assert (
        f"{steps} Polar Express steps (safety factor {F.GRAM_SAFETY_FACTOR:g}), restarted before the {ordinal}" in doc
    )
    assert f"sigmoid(cos(m, g)/{F.MAGMA_TAU:g})" in doc
    decay, floor = F.MAGMA_EMA_DECAY, F.MAGMA_MIN_SCALE
    assert f"{decay:g}\\sigma + {1 - decay:g} r` (from {F.MAGMA_INITIAL_SCORE:g})" in doc
    assert f"d = {floor:g} + {1 - floor:g}\\sigma" in doc
    assert f"\\epsilon = 10^{{{math.log10(F.ADAM_EPS):.0f}}}" in doc
    magma = " ".join(next(a for a in hybrid_muon_arguments() if a.name == "magma_muon").doc.split())
    assert (
        f"{floor:g} + {1 - floor:g}*score, the score a running average (EMA {decay:g}, from {F.MAGMA_INITIAL_SCORE:g})"
        in magma
    )


@pytest.mark.parametrize("use_gram", [True, False])
@pytest.mark.parametrize("shape", [(2, 8, 12), (2, 12, 8), (3, 8, 8)])
def test_orthogonalize_leaves_its_input_as_it_was(shape, use_gram):
    # The engine hands it views of its update buffer (a torch stack of one matrix, FSDP2's owned matrices).
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 8  # entries above 2: the downscale acts
    before = G.clone()
    F.orthogonalize(G, use_gram)
    assert torch.equal(G, before)


def test_newton_schulz_lifts_the_weak_directions_of_a_nearly_low_rank_update() -> None:
    # Why two runs of DPA-4 part in the matrices that start at zero (README, "Two runs of one input"): their first
    # updates are nearly rank one, and orthogonalisation raises every singular value towards 1, the noise's too, so
    # updates whose inputs differ by 1e-4 of their norm (the order of a GPU's parallel sums) differ by most of theirs.
    torch.manual_seed(0)
    low = torch.randn(1, 64, 1) @ torch.randn(1, 1, 32)  # rank one
    full = torch.randn(1, 64, 32)
    noise = [torch.randn(1, 64, 32) for _ in range(2)]

    def apart(g: torch.Tensor) -> float:
        a, b = (F.newton_schulz(g + 1e-4 * g.norm() / g.numel() ** 0.5 * n).float() for n in noise)
        return float((a - b).norm() / a.norm())

    assert apart(low) > 0.5  # measured 0.75
    assert apart(full) < 0.02  # bfloat16's own rounding: measured 0.007
