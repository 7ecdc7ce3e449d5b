"""The Triton kernels (the ``kernels`` package) against the reference functions and the per-tensor loop.

With a GPU they run compiled on CUDA. Without one they run under Triton's CPU interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before Triton is first imported: the
last test re-runs this module in a subprocess with it set. Two shortcomings of Triton 3.6's
interpreter are worked around, in the tests only:

* it converts a loaded scalar used as a loop bound with ``int()`` of a one-element array,
  which NumPy >= 2.4 rejects: the conversion is patched to take the element;
* it multiplies bfloat16 matrices wrongly (NumPy has no bfloat16): the standard
  iteration's workspace is float16 under the interpreter. The Gram iteration is float16
  anyway, so its arithmetic is the production one.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from deepmd_hybridmuon import HybridMuonOptimizer
from deepmd_hybridmuon import functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="module")
def kernels():
    """``deepmd_hybridmuon.kernels``, compiled (GPU) or interpreted (CPU); and the device."""
    pytest.importorskip("triton")
    if CUDA:
        from deepmd_hybridmuon import kernels as K

        mp = pytest.MonkeyPatch()
        mp.setattr(K, "registry", K.KernelRegistry(background=False))  # the kernels from the first step on
        yield K, torch.device("cuda")
        mp.undo()
        return
    if not INTERPRET:
        pytest.skip("no GPU: test_kernels_under_the_interpreter runs this module interpreted")
    import triton.runtime.interpreter as interpreter

    from deepmd_hybridmuon import kernels as K

    original = interpreter._patch_lang_tensor

    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    mp = pytest.MonkeyPatch()
    mp.setattr(interpreter, "_patch_lang_tensor", patch)
    mp.setattr(K, "STANDARD_WORK_DTYPE", torch.float16)
    yield K, torch.device("cpu")
    mp.undo()


# (rows, cols): wide, tall, square, a single row; with a 128 x 72 matrix (the largest
# smaller side, MAX_ROWS) and a larger side of 130 (not a multiple of the column chunk) the
# launch streams X through the workspace, without them every matrix stays in registers.
SHAPES = [(25, 50), (50, 25), (24, 24), (1, 40)]
STREAMED = [*SHAPES, (128, 72), (17, 130)]


def _layout(shapes):
    """Metadata rows of ``kernels.orthogonalize_blocks`` for matrices stored one after another."""
    meta, offset = [], 0
    for block, (rows, cols) in enumerate(shapes):
        small, large = min(rows, cols), max(rows, cols)
        strides = (1, small) if rows > cols else (large, 1)
        meta.append([offset, offset, small, large, *strides, block, 0])
        offset += rows * cols
    return meta, offset


@pytest.mark.parametrize(
    ("use_gram", "shapes"),
    [(False, SHAPES), (True, SHAPES), (False, STREAMED)],  # Gram of long matrices: the panel test
    ids=["resident", "resident-gram", "streamed"],
)
def test_newton_schulz_kernel_matches_the_reference(kernels, use_gram, shapes):
    K, device = kernels
    rows, cols = max(min(s) for s in shapes), max(max(s) for s in shapes)
    assert K.resident(rows, cols) == (shapes is SHAPES)
    gen = torch.Generator().manual_seed(0)
    mats = [torch.randn(s, generator=gen).to(device) for s in shapes]
    meta, size = _layout(shapes)
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    work = torch.zeros(size, dtype=K.work_dtype(use_gram), device=device)
    factor = torch.arange(1.0, len(shapes) + 1.0, device=device)
    table = torch.tensor(meta, dtype=torch.int64, device=device)
    coefs = K.coefficient_table(use_gram, device)
    K.orthogonalize_blocks(src, dst, work, table, coefs, factor, rows, cols, use_gram)
    for i, (g, out) in enumerate(zip(mats, dst.split([m.numel() for m in mats]), strict=True)):
        ref = F.gram_newton_schulz(g[None]) if use_gram else F.newton_schulz(g[None])
        ref = ref[0].float() * (i + 1)
        err = ((out.view_as(g) - ref).norm() / ref.norm()).item()
        # Both sides round every product to 8 (bf16) or 11 (fp16) bits, in different
        # summation orders; ten (five) iterations amplify the difference of one rounding
        # (2^-8 = 0.4 %) to at most about 2 % of the update (measured <= 1.6 %).
        assert err < 3e-2, (shapes[i], err)


def test_panel_kernels_match_the_reference(kernels):
    """Long matrices through the five panel launches (the Gram path of non-resident matrices)."""
    K, device = kernels
    gen = torch.Generator().manual_seed(2)
    mats = [torch.randn(s, generator=gen).to(device) for s in STREAMED]
    meta, size = _layout(STREAMED)
    panels, first = K.panel_table(meta)
    assert first[-1] == len(panels) == sum(-(-max(s) // K.PANEL) for s in STREAMED)
    rows = max(min(s) for s in STREAMED)
    bm = K.panel_block(rows)
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    K.orthogonalize_panels(
        src,
        dst,
        torch.zeros(size, dtype=torch.float16, device=device),
        torch.tensor(meta, dtype=torch.int64, device=device),
        torch.tensor(panels, dtype=torch.int64, device=device),
        torch.tensor(first, dtype=torch.int64, device=device),
        torch.zeros(len(panels), bm, bm, device=device),
        torch.zeros(len(meta), bm, bm, dtype=torch.float16, device=device),
        torch.zeros(len(meta), device=device),
        K.coefficient_table(True, device),
        torch.arange(1.0, len(STREAMED) + 1.0, device=device),
        rows,
    )
    for i, (g, out) in enumerate(zip(mats, dst.split([m.numel() for m in mats]), strict=True)):
        ref = F.gram_newton_schulz(g[None])[0].float() * (i + 1)
        err = ((out.view_as(g) - ref).norm() / ref.norm()).item()
        # as above; here the Gram matrix also comes from float32 (TF32 on a GPU) products of G
        assert err < 3e-2, (STREAMED[i], err)


# Matrices of the phased path, groups of one padded shape each: smaller sides spanning several
# 64-row tiles, not multiples of 64; wide and tall (padded 128 x 192); square ones (128 x 128,
# the standard iteration) and short ones (64 x 128, the Gram iteration). Small sizes: the
# interpreter is slow.
PHASED = {False: [(70, 150), (150, 70), (100, 140)], True: [(70, 150), (150, 70), (100, 140)]}
PHASED_SHORT = {False: [(72, 72), (100, 100)], True: [(20, 100), (100, 33)]}


@pytest.mark.parametrize("use_gram", [False, True], ids=["standard", "gram"])
@pytest.mark.parametrize("short", [False, True], ids=["rectangular", "square-or-short"])
def test_phased_kernel_matches_the_reference(kernels, use_gram, short):
    """One persistent launch with grid barriers (GPU), or one launch per phase (interpreter)."""
    K, device = kernels
    schedule = K.phased_schedule(use_gram)
    for row in schedule:  # no product writes a slot it reads
        if row[0] == 2:
            assert row[1] not in (row[2], row[3], row[5] if row[6] else None), row
    gen = torch.Generator().manual_seed(3)
    shapes = (PHASED_SHORT if short else PHASED)[use_gram]
    mats = [torch.randn(s, generator=gen, dtype=torch.float64).to(device) for s in shapes]
    matrices, offset = [], 0
    for block, (rows, cols) in enumerate(shapes):
        small, large = min(rows, cols), max(rows, cols)
        matrices.append((offset, small, large, *((1, small) if rows > cols else (large, 1)), block))
        offset += rows * cols
    shape = (K.padded(max(m for _, m, _, _, _, _ in matrices)), K.padded(max(n for _, _, n, _, _, _ in matrices)))
    assert all((K.padded(m), K.padded(n)) == shape for _, m, n, _, _, _ in matrices)
    meta, size = matrices, K.phased_workspace(matrices, use_gram)
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    work = torch.zeros(size, dtype=K.work_dtype(use_gram), device=device)
    tiles = len(meta) * K.phased_tiles(*shape)
    args = (torch.tensor(meta, dtype=torch.int64, device=device), shape, torch.zeros(tiles, device=device))
    coefs, factor = K.coefficient_table(use_gram, device), torch.arange(1.0, len(shapes) + 1.0, device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    for first, stop in ((0, len(schedule) - 1), (len(schedule) - 1, len(schedule))):  # as the engine runs it
        K.orthogonalize_phased(src, dst, work, *args, coefs, factor, counter, 5, use_gram, first=first, stop=stop)
    for i, (g, out) in enumerate(zip(mats, dst.split([m.numel() for m in mats]), strict=True)):
        ref = F.orthogonalize(g[None], use_gram)[0].double() * (i + 1)
        err = ((out.view_as(g) - ref).norm() / ref.norm()).item()
        # Same bound and reason as the Newton-Schulz kernel test (each product rounded to
        # 8 or 11 bits, in another summation order than cuBLAS).
        assert err < 3e-2, (shapes[i], err)


def _changed_schedules(monkeypatch):
    """Schedules unlike HybridMuon's, changed in ``functional`` only.

    Standard: three fast steps, no polish. Gram: the first four Polar Express rows,
    restarting before the second and the fourth iteration (two restarts, three segments).
    """
    monkeypatch.setattr(F, "NS_FAST_STEPS", 3)
    monkeypatch.setattr(F, "NS_POLISH_STEPS", 0)
    monkeypatch.setattr(F, "POLAR_EXPRESS_COEFFS", F.POLAR_EXPRESS_COEFFS[:4])
    monkeypatch.setattr(F, "GRAM_RESTART_ITERATIONS", frozenset({1, 3}))


def test_kernel_schedules_are_the_functional_tables(monkeypatch):
    """The kernels' schedule constants are derived from ``functional``'s tables, not written again."""
    K = pytest.importorskip("deepmd_hybridmuon.kernels")
    kind, out, it = K.PhaseColumn.KIND, K.PhaseColumn.OUT, K.PhaseColumn.ITERATION

    def launches():
        return [(r["START"], r["STOP"], a["FROM_SOURCE"], a["FINAL"]) for r, a in K.panel_launches()]

    # HybridMuon's schedules: the constants the kernels once spelled out (five Gram
    # iterations, a restart before the third, ten standard iterations)
    assert K.gram_constants() == {"RESTARTS": (0, 0, 1, 0, 0), "FRESH_Q": (1, 0, 1, 0, 0), "UPDATES_R": (1, 0, 1, 1, 0)}
    assert launches() == [(0, 2, True, False), (2, 5, False, True)]
    assert (K.phase_count(False), K.phase_count(True)) == (2 + 3 * 10, 20)

    _changed_schedules(monkeypatch)
    assert K.gram_constants() == {"RESTARTS": (0, 1, 0, 1), "FRESH_Q": (1, 1, 0, 1), "UPDATES_R": (0, 1, 0, 0)}
    assert launches() == [(0, 1, True, False), (1, 3, False, False), (3, 4, False, True)]
    assert torch.equal(K.coefficient_table(False, "cpu"), torch.tensor([F.NS_FAST_COEFFS] * 3))
    assert torch.equal(K.coefficient_table(True, "cpu"), torch.tensor(F.POLAR_EXPRESS_COEFFS))
    standard, gram = K.phased_schedule(False), K.phased_schedule(True)
    assert len(standard) == 2 + 3 * 3 and standard[-1][out] == K.DST
    products = [row for row in gram if row[kind] == K.PhaseKind.PRODUCT]
    assert {row[it] for row in products} == {0, 1, 2, 3} and gram[-1][out] == K.DST
    assert [row[it] for row in products if row[out] in (0, 1)] == [1, 3]  # X <- Q X: once per restart
    for row in products:  # no product writes a slot it reads
        assert row[out] not in (row[2], row[3], row[5] if row[6] else None), row


def test_kernels_follow_a_changed_schedule(kernels, monkeypatch):
    """Every Newton–Schulz family runs ``functional``'s schedule: changed there, the kernels follow."""
    K, device = kernels
    gen = torch.Generator().manual_seed(11)
    cases = {  # (path, use_gram): shapes
        ("blocks", False): SHAPES[:2],
        ("blocks", True): SHAPES[:2],
        ("panels", True): [(17, 130), (40, 70)],
        ("phased", False): PHASED_SHORT[False],
        ("phased", True): PHASED_SHORT[True],
    }
    mats = {key: [torch.randn(s, generator=gen).to(device) for s in shapes] for key, shapes in cases.items()}
    default = {key: [F.orthogonalize(g[None], key[1])[0].float() for g in ms] for key, ms in mats.items()}
    _changed_schedules(monkeypatch)
    for (path, use_gram), ms in mats.items():
        outs = {"blocks": _run_blocks, "panels": _run_panels, "phased": _run_phased}[path](K, device, ms, use_gram)
        for g, out, before in zip(ms, outs, default[path, use_gram], strict=True):
            ref = F.orthogonalize(g[None], use_gram)[0].float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            # the bound and reason of test_newton_schulz_kernel_matches_the_reference
            assert err < 3e-2, (path, use_gram, g.shape, err)
            # ... and the changed schedules are far from HybridMuon's (measured >= 0.2)
            assert ((ref - before).norm() / before.norm()).item() > 0.1, (path, use_gram, g.shape)


def _run_blocks(K, device, mats, use_gram):
    """``kernels.orthogonalize_blocks`` on ``mats`` (factor 1); the outputs."""
    shapes = [tuple(m.shape) for m in mats]
    rows, cols = max(min(s) for s in shapes), max(max(s) for s in shapes)
    meta, size = _layout(shapes)
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    work = torch.zeros(size, dtype=K.work_dtype(use_gram), device=device)
    table = torch.tensor(meta, dtype=torch.int64, device=device)
    coefs, factor = K.coefficient_table(use_gram, device), torch.ones(len(mats), device=device)
    K.orthogonalize_blocks(src, dst, work, table, coefs, factor, rows, cols, use_gram)
    return [out.view_as(m) for m, out in zip(mats, dst.split([m.numel() for m in mats]), strict=True)]


def _run_panels(K, device, mats, use_gram):
    """``kernels.orthogonalize_panels`` (the Gram iteration) on ``mats`` (factor 1); the outputs."""
    assert use_gram
    shapes = [tuple(m.shape) for m in mats]
    meta, size = _layout(shapes)
    panels, first = K.panel_table(meta)
    rows = max(min(s) for s in shapes)
    bm = K.panel_block(rows)
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    K.orthogonalize_panels(
        src,
        dst,
        torch.zeros(size, dtype=torch.float16, device=device),
        torch.tensor(meta, dtype=torch.int64, device=device),
        torch.tensor(panels, dtype=torch.int64, device=device),
        torch.tensor(first, dtype=torch.int64, device=device),
        torch.zeros(len(panels), bm, bm, device=device),
        torch.zeros(len(meta), bm, bm, dtype=torch.float16, device=device),
        torch.zeros(len(meta), device=device),
        K.coefficient_table(True, device),
        torch.ones(len(mats), device=device),
        rows,
    )
    return [out.view_as(m) for m, out in zip(mats, dst.split([m.numel() for m in mats]), strict=True)]


def _run_phased(K, device, mats, use_gram):
    """``kernels.orthogonalize_phased`` on ``mats`` (one padded shape, factor 1), in the engine's two launches."""
    matrices, offset = [], 0
    for block, m in enumerate(mats):
        rows, cols = m.shape
        small, large = min(rows, cols), max(rows, cols)
        matrices.append((offset, small, large, *((1, small) if rows > cols else (large, 1)), block))
        offset += rows * cols
    shape = (K.padded(max(m for _, m, *_ in matrices)), K.padded(max(n for _, _, n, *_ in matrices)))
    src = torch.cat([m.reshape(-1) for m in mats])
    dst = torch.full_like(src, float("nan"))
    work = torch.zeros(K.phased_workspace(matrices, use_gram), dtype=K.work_dtype(use_gram), device=device)
    partial = torch.zeros(len(matrices) * K.phased_tiles(*shape), device=device)
    table = torch.tensor(matrices, dtype=torch.int64, device=device)
    coefs, factor = K.coefficient_table(use_gram, device), torch.ones(len(mats), device=device)
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    n = K.phase_count(use_gram)
    for first, stop in ((0, n - 1), (n - 1, n)):
        K.orthogonalize_phased(
            src, dst, work, table, shape, partial, coefs, factor, counter, 5, use_gram, first=first, stop=stop
        )
    return [out.view_as(m) for m, out in zip(mats, dst.split([m.numel() for m in mats]), strict=True)]


def test_magma_kernel_matches_the_reference(kernels):
    K, device = kernels
    gen = torch.Generator().manual_seed(1)
    lengths = [6, 1, 2000, 9000, 37]  # 9000 spans three partial sums
    mom = torch.randn(sum(lengths), generator=gen).to(device)
    grad = (0.3 * mom.cpu() + torch.randn(sum(lengths), generator=gen)).to(device)
    grad[6] = 0.0  # a block with a zero gradient: cos is 0 (the EPS floor), not NaN
    bounds, first = (torch.tensor(x, device=device) for x in K.magma_chunks(lengths))
    assert first.tolist() == [0, 1, 2, 3, 6, 7]
    partial = torch.empty(3 * (bounds.numel() - 1), device=device)
    base = torch.arange(1.0, len(lengths) + 1.0, device=device)
    neg_lr = torch.tensor(-0.5, device=device)
    for ok in (1.0, 0.0):
        scores = torch.full((len(lengths),), 0.5, device=device)
        out = torch.empty(len(lengths), device=device)
        gate = torch.tensor(ok, device=device)
        K.magma_factors(mom, grad, bounds, first, partial, base, scores, out, neg_lr, gate)
        ref_scores = torch.full((len(lengths),), 0.5, device=device)
        raw = torch.stack(
            [
                F.magma_raw_score(m[None], g[None])[0]
                for m, g in zip(mom.split(lengths), grad.split(lengths), strict=True)
            ]
        )
        ref = base * F.magma_scale_(ref_scores, raw, torch.tensor(ok, device=device)) * -0.5
        # float32 sums in another order: agreement to a few float32 roundings
        torch.testing.assert_close(scores, ref_scores, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gather_and_apply_match_torch_bitwise(kernels, dtype):
    """The address-table kernels: gradients into a flat buffer, then p * decay + delta."""
    K, device = kernels
    gen = torch.Generator().manual_seed(4)
    sizes = [5, 1, K.SPAN + 3, 2 * K.SPAN]  # spans end inside a tensor and at its end
    grads = [torch.randn(n, generator=gen, dtype=dtype).to(device) for n in sizes]
    params = [torch.randn(n, generator=gen, dtype=dtype).to(device) for n in sizes]
    decay_index = [0, 1, 2, 1]
    spans = torch.tensor(K.span_table(sizes, decay_index), dtype=torch.int64, device=device)
    flat = torch.full((sum(sizes),), float("nan"), dtype=dtype, device=device)
    finite = torch.full((spans.size(0),), -1.0, device=device)
    addresses = torch.tensor([g.data_ptr() for g in grads], device=device)
    K.gather(addresses, spans, flat, finite)
    assert torch.equal(flat, torch.cat(grads))
    assert finite.tolist() == [1.0] * spans.size(0)
    grads[2][K.SPAN + 1] = float("inf")  # in the second span of the third tensor
    grads[0][4] = float("nan")
    K.gather(addresses, spans, flat, finite)
    assert finite.tolist() == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]

    decays = torch.tensor([1.0, 0.999, 0.5], dtype=dtype, device=device)
    delta = torch.randn(sum(sizes), generator=gen, dtype=dtype).to(device)
    expected = [p * decays[d] + u for p, d, u in zip(params, decay_index, delta.split(sizes), strict=True)]
    K.apply_updates(torch.tensor([p.data_ptr() for p in params], device=device), spans, delta, decays)
    for p, e in zip(params, expected, strict=True):
        assert torch.equal(p, e)  # two roundings, as torch's multiply then add: bitwise


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_momentum_kernel_matches_the_reference(kernels, dtype):
    K, device = kernels
    gen = torch.Generator().manual_seed(8)
    n = 3000
    beta = 0.95
    betas = torch.tensor([beta, 1.0 - beta], dtype=dtype, device=device)
    for ok in (1.0, 0.0):
        grad = torch.randn(n, generator=gen, dtype=dtype).to(device)
        grad[7] = float("nan") if ok == 0.0 else grad[7]
        mom = torch.randn(n, generator=gen, dtype=dtype).to(device)
        ref_mom = mom.clone()
        gate = torch.tensor(ok, device=device)
        ref_update = F.nesterov_momentum_(ref_mom, F.sanitize(grad, gate), beta, gate)
        update = torch.empty_like(mom)
        K.momentum_update(grad, mom, update, gate, betas)
        # torch's lerp formula; either side may fuse a multiply-add (vectorised CPU code, nvcc),
        # which moves the result by about one rounding of the operands (|x| < 6 here), not of the result
        tol = 8 * torch.finfo(dtype).eps * 6
        torch.testing.assert_close(mom, ref_mom, rtol=0, atol=tol)
        torch.testing.assert_close(update, ref_update, rtol=0, atol=tol)
        if ok == 0.0:
            assert torch.equal(grad, torch.zeros_like(grad))  # sanitised in place


PARAMS = {
    "emb.layers.1.matrix": (25, 50),
    "emb.layers.2.matrix": (50, 40),
    "emb.layers.2.bias": (40,),
    "fit.layers.1.matrix": (24, 24),
    "fit.layers.2.matrix": (24, 1),
    "rep.linear.weight": (3, 16, 20),
    "fit.long.matrix": (40, 300),  # too long to stay in registers: panels (Gram) or streamed
    # smaller side above MAX_ROWS: two phased groups (Gram and standard) in the same step
    "big.matrix": (160, 136),
    "big.square": (144, 144),
    # smaller side above MAX_PHASED_ROWS: a torch bucket (cuBLAS is faster there), in the same step
    "huge.matrix": (264, 270),
}


def _train(device, batched, dtype=torch.float32, steps=3, **options):
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype).to(device)) for k, s in PARAMS.items()}
    opt = HybridMuonOptimizer(
        list(params.values()), lr=1e-2, named_parameters=params.items(), batched=batched, **options
    )
    start = {k: p.detach().clone() for k, p in params.items()}
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=gen, dtype=dtype).to(device)
        opt.step()
    return {k: p.detach() - start[k] for k, p in params.items()}, opt


@pytest.mark.parametrize(
    ("enable_gram", "magma_muon", "dtype", "graph"),
    [
        (True, True, torch.float32, False),
        (False, False, torch.float32, False),
        (True, False, torch.float64, False),
        # captured (after two eager steps): Triton launches and the phased groups on side streams
        pytest.param(True, True, torch.float32, True, marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs")),
        pytest.param(False, True, torch.float64, True, marks=pytest.mark.skipif(not CUDA, reason="CUDA graphs")),
    ],
)
def test_engine_with_kernels_matches_the_loop(kernels, enable_gram, magma_muon, dtype, graph):
    _, device = kernels
    options = {"enable_gram": enable_gram, "magma_muon": magma_muon, "cuda_graph": graph}
    steps = 5 if graph else 3
    fast, opt = _train(device, True, dtype, steps, **options)
    ref, _ = _train(device, False, dtype, steps, **options)
    engine = opt._engines[0]
    assert engine.fused_paths, "the Triton path did not run"
    assert any(f.panelled for f in engine.fused_paths) == enable_gram
    assert {g.use_gram for g in engine.phased_paths} == {enable_gram, False}, "sides > MAX_ROWS: not phased"
    assert [(m[2], m[3]) for b in engine.buckets for m in b.members] == [(264, 270)], "side > MAX_PHASED_ROWS"
    assert (engine.graph is not None) == graph
    for name, r in ref.items():
        err = ((fast[name] - r).norm() / r.norm()).item()
        # Same bound and reason as the Newton-Schulz kernel test above.
        assert err < 3e-2, (name, err)


def test_engine_reads_non_contiguous_gradients(kernels):
    """The gather kernel reads gradients in place; a non-contiguous one is copied first."""
    _, device = kernels
    gen = torch.Generator().manual_seed(6)
    steps = []
    for batched in (True, False):
        w = torch.nn.Parameter(torch.randn(24, 40, generator=gen).to(device))
        b = torch.nn.Parameter(torch.randn(40, generator=gen).to(device))
        opt = HybridMuonOptimizer([w, b], lr=1e-2, named_parameters=[("w", w), ("b", b)], batched=batched)
        start = w.detach().clone()
        grad_gen = torch.Generator().manual_seed(7)
        for _ in range(3):
            w.grad = torch.randn(40, 24, generator=grad_gen).to(device).T  # a transposed view
            b.grad = torch.randn(40, generator=grad_gen).to(device)
            opt.step()
        steps.append(w.detach() - start)
        if batched:
            assert opt._engines[0].triton
    err = ((steps[0] - steps[1]).norm() / steps[1].norm()).item()
    assert err < 3e-2, err  # same bound and reason as the Newton-Schulz kernel test


def test_engine_with_kernels_decays_each_route_as_the_loop(kernels):
    """The update kernel's decay table: AdamW parameters, Muon matrices and plain Adam ones each get their own."""
    _, device = kernels
    shapes = {"fit.bias": (30,), "desc.adamw_scale": (5, 7), "fit.matrix": (12, 20), "fit.idt": (12,)}
    moved = []
    for batched in (True, False):
        gen = torch.Generator().manual_seed(10)
        params = {k: torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for k, s in shapes.items()}
        opt = HybridMuonOptimizer(
            list(params.values()), lr=1e-2, weight_decay=0.5, named_parameters=params.items(), batched=batched
        )
        for _ in range(3):
            for p in params.values():
                p.grad = torch.randn(p.shape, generator=gen).to(device)
            opt.step()
        if batched:
            assert opt._engines[0].triton
        moved.append({k: p.detach().clone() for k, p in params.items()})
    for name in ("fit.bias", "desc.adamw_scale", "fit.idt"):  # elementwise routes: float32 rounding only
        torch.testing.assert_close(moved[0][name], moved[1][name], rtol=1e-5, atol=1e-6)
    err = ((moved[0]["fit.matrix"] - moved[1]["fit.matrix"]).norm() / moved[1]["fit.matrix"].norm()).item()
    assert err < 1e-2, err  # Newton-Schulz rounding on a 2 % per-step decay (see the kernel test's bound)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_engine_with_kernels_skips_a_non_finite_step(kernels, bad):
    """The gradient copy flags the non-finite span; nothing moves: parameters, moments, momentum, Magma."""
    _, device = kernels
    _, opt = _train(device, True, steps=2)  # the Triton path (the interpreter on a CPU)
    assert opt._engines[0].triton
    params = opt.param_groups[0]["params"]
    before = [p.detach().clone() for p in params]
    state = {(i, k): v.clone() for i, p in enumerate(params) for k, v in opt.state[p].items() if torch.is_tensor(v)}
    gen = torch.Generator().manual_seed(9)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    params[3].grad.view(-1)[-1] = bad  # the last element of one Muon matrix
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    after = {(i, k): v for i, p in enumerate(params) for k, v in opt.state[p].items() if torch.is_tensor(v)}
    assert all(torch.equal(after[key], v) for key, v in state.items())


@pytest.mark.skipif(not CUDA, reason="Triton compiles only for a GPU")
def test_first_steps_take_the_torch_path_while_triton_compiles(kernels, monkeypatch):
    K, device = kernels
    monkeypatch.setattr(K, "registry", K.KernelRegistry())  # as in a fresh process
    _, opt = _train(device, True, torch.float32, steps=1)
    engine = opt._engines[0]
    assert engine.compiling is not None and not engine.fused_paths
    assert engine.compiling.wait(300), "compilation did not finish"
    gen = torch.Generator().manual_seed(5)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt.step()
    rebuilt = opt._engines[0]
    assert rebuilt is not engine and rebuilt.compiling is None and rebuilt.fused_paths
    assert all(torch.isfinite(p).all() for p in opt.param_groups[0]["params"])


def test_a_kernel_that_does_not_compile_leaves_the_torch_path(monkeypatch, caplog):
    K = pytest.importorskip("deepmd_hybridmuon.kernels")
    monkeypatch.setattr(K, "registry", K.KernelRegistry(background=False))

    def broken(key, device):
        raise RuntimeError("unsupported instruction")

    monkeypatch.setattr(K, "_compile", broken)
    gpu = torch.device("cuda", 0)  # only named: the broken compiler never touches it
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        assert K.prepare(gpu, torch.float32, [(True, 64, 512)], magma=True) is None
    assert "did not compile (unsupported instruction); torch kernels instead" in caplog.text
    # remembered: no second attempt, no second warning
    caplog.clear()
    assert K.prepare(gpu, torch.float32, [(True, 64, 512)], magma=True) is None
    assert not caplog.text


@pytest.mark.skipif(CUDA or INTERPRET, reason="the kernels run directly here")
def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "not under_the_interpreter"]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    assert " passed" in run.stdout, run.stdout[-2000:]  # not everything skipped
