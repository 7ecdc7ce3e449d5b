"""The Triton kernels (the ``kernels`` package) against the reference functions.

With a GPU they run compiled on CUDA. Without one they run under Triton's CPU interpreter,
which must be switched on (``TRITON_INTERPRET=1``) before Triton is first imported: the
last test re-runs this module in a subprocess with it set (the ``kernels`` fixture of
conftest.py, which also works around two shortcomings of the interpreter). The flat
engine with these kernels is checked against the loop in ``test_parity.py``.
"""

from __future__ import annotations

import logging
import math
import os

import pytest
import torch
from conftest import KERNEL_MUON_TOL, run_interpreted

from deepmd_hybridmuon import functional as F

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
    [(False, SHAPES), (True, SHAPES), (False, STREAMED), (True, STREAMED)],
    ids=["resident", "resident-gram", "streamed", "streamed-gram"],
)
def test_newton_schulz_kernel_matches_the_reference(kernels, use_gram, shapes):
    K, device = kernels
    rows, cols = max(min(s) for s in shapes), max(max(s) for s in shapes)
    assert K.resident(rows, cols) == (shapes is SHAPES)
    assert F.on_triton(rows)
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
        # rounding of the bf16/fp16 products in another order: conftest.KERNEL_MUON_TOL
        assert err < KERNEL_MUON_TOL, (shapes[i], err)


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
    # HybridMuon's schedules: the constants the kernels once spelled out (five Gram
    # iterations, a restart before the third, ten standard iterations)
    assert K.gram_constants() == {"RESTARTS": (0, 0, 1, 0, 0), "FRESH_Q": (1, 0, 1, 0, 0), "UPDATES_R": (1, 0, 1, 1, 0)}

    _changed_schedules(monkeypatch)
    assert K.gram_constants() == {"RESTARTS": (0, 1, 0, 1), "FRESH_Q": (1, 1, 0, 1), "UPDATES_R": (0, 1, 0, 0)}
    assert torch.equal(K.coefficient_table(False, "cpu"), torch.tensor([F.NS_FAST_COEFFS] * 3))
    assert torch.equal(K.coefficient_table(True, "cpu"), torch.tensor(F.POLAR_EXPRESS_COEFFS))


def test_kernels_follow_a_changed_schedule(kernels, monkeypatch):
    """Every branch of the Newton–Schulz kernel runs ``functional``'s schedule: changed there, the kernels follow."""
    K, device = kernels
    gen = torch.Generator().manual_seed(11)
    cases = {  # (residency, use_gram): shapes
        ("resident", False): SHAPES[:2],
        ("resident", True): SHAPES[:2],
        ("streamed", True): [(17, 300), (40, 300)],
    }
    mats = {key: [torch.randn(s, generator=gen).to(device) for s in shapes] for key, shapes in cases.items()}
    default = {key: [F.orthogonalize(g[None], key[1])[0].float() for g in ms] for key, ms in mats.items()}
    _changed_schedules(monkeypatch)
    for (path, use_gram), ms in mats.items():
        rows, cols = max(min(m.shape) for m in ms), max(max(m.shape) for m in ms)
        assert K.resident(rows, cols) == (path == "resident"), path
        outs = _run_blocks(K, device, ms, use_gram)
        for g, out, before in zip(ms, outs, default[path, use_gram], strict=True):
            ref = F.orthogonalize(g[None], use_gram)[0].float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            # the bound and reason of test_newton_schulz_kernel_matches_the_reference
            assert err < KERNEL_MUON_TOL, (path, use_gram, g.shape, err)
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


SCALE_CASES = {  # the runner, use_gram and the shapes of every Newton-Schulz kernel branch
    "resident": (_run_blocks, False, SHAPES),
    "resident-gram": (_run_blocks, True, SHAPES),
    "streamed": (_run_blocks, False, STREAMED),
    "streamed-gram": (_run_blocks, True, [(17, 300), (40, 300)]),
}


@pytest.mark.parametrize("path", list(SCALE_CASES))
def test_newton_schulz_kernels_are_scale_invariant_up_to_the_gradient_limit(kernels, path):
    """G times 2^66 (~7e19), 2^100 (~1e30) and 2^126 (functional.GRAD_LIMIT / 2) gives the output of G.

    Each kernel scales G by the exact power of two that brings its largest element below 2
    (``functional.pow2_downscale``): here the same matrix for every factor, largest element 1.
    """
    K, device = kernels
    run, use_gram, shapes = SCALE_CASES[path]
    assert K.resident(max(min(s) for s in shapes), max(max(s) for s in shapes)) == path.startswith("resident")
    gen = torch.Generator().manual_seed(5)
    mats = []
    for s in shapes:
        g = torch.randn(s, generator=gen, dtype=torch.float64)
        mats.append((g / g.abs().max()).float().to(device))
    ref = run(K, device, mats, use_gram)
    for k in (66, 100, 126):
        outs = run(K, device, [m * 2.0**k for m in mats], use_gram)
        for g, out, r in zip(mats, outs, ref, strict=True):
            # Bitwise: every product and sum sees the same numbers. (The one term that does not
            # scale, eps = 1e-7 added to or flooring ||G||, vanishes in float32 against these
            # norms, all above 2.)
            assert torch.linalg.matrix_norm(g).item() > 2
            assert torch.equal(out, r), (path, tuple(g.shape), k)


def _host_kernels(K):
    """The kernels the package launches from the host (``_*_kernel`` in the kernel modules)."""
    m = K.newton_schulz
    return {getattr(m, n) for n in dir(m) if n.startswith("_") and n.endswith("_kernel")}


def test_the_pointers_compiled_as_aligned_are_aligned_at_every_launch_of_the_engine(kernels, monkeypatch):
    """Every pointer a kernel is compiled to take as 16-byte aligned (``kernels.common.kernel``) is so.

    An unaligned one would not be wrong, but a variant the compile process never built: a
    compile in the training process. One engine step over every path (one program per
    matrix in registers or streamed, the torch path) records each launch's arguments.
    """
    import inspect

    from deepmd_hybridmuon import HybridMuonOptimizer

    K, device = kernels
    launched = {}
    kernels_launched = _host_kernels(K)
    for kernel in kernels_launched:
        aligned = K.common.ALIGNED[kernel.fn.__name__]
        signature, run = inspect.signature(kernel.fn), kernel.run

        def checked(*args, _aligned=aligned, _signature=signature, _run=run, _name=kernel.fn.__name__, **kw):
            bound = _signature.bind_partial(*args, **{k: v for k, v in kw.items() if k in _signature.parameters})
            launched.setdefault(_name, []).extend((name, bound.arguments[name].data_ptr() % 16) for name in _aligned)
            return _run(*args, **kw)

        monkeypatch.setattr(kernel, "run", checked)
    gen = torch.Generator().manual_seed(0)
    # one program per matrix, a streamed long matrix, one of the torch path, Adam parameters at odd lengths
    shapes = [(32, 48), (16, 2048), (136, 140), (7,), (5, 3)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = HybridMuonOptimizer(params, lr=1e-3, magma_muon=True)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt.step()
    assert opt.execution_table()[0]["kernels"] == "triton"
    assert set(launched) == {kernel.fn.__name__ for kernel in kernels_launched}
    assert all(offset == 0 for args in launched.values() for _, offset in args), launched


#: (parameter dtype, largest |g| of the Muon gradients): 1e20 and 1e30, whose squares overflow
#: float32; half functional.GRAD_LIMIT, the largest power of two that steps; the dtype's largest
#: number (None), which float32 and bfloat16 skip (at or above GRAD_LIMIT) and float16 (65504,
#: whose squares fit float32 anyway) steps with.
HUGE = [(d, s) for d in (torch.float32, torch.bfloat16) for s in (1e20, 1e30, F.GRAD_LIMIT / 2, None)]
HUGE.append((torch.float16, None))


_HUGE_IDS = {1e20: "1e20", 1e30: "1e30", F.GRAD_LIMIT / 2: "half-limit", None: "max"}


@pytest.mark.parametrize(
    ("dtype", "scale"), HUGE, ids=[f"{str(d).removeprefix('torch.')}-{_HUGE_IDS[s]}" for d, s in HUGE]
)
def test_huge_finite_muon_gradients_leave_every_parameter_and_state_finite_on_the_kernels(kernels, dtype, scale):
    """A huge finite Muon gradient steps as the same gradient scaled down to about 1 (every kernel path).

    Every Triton path normalises G as (G 2^-e) / ||G 2^-e|| with an exact power of two 2^-e
    that brings its largest element below 2, as the torch path does (test_hostile.py), so no
    sum of squares overflows and the step is the one on G scaled down; nothing non-finite is
    written, also in the step after, from the state of the first. At or above
    functional.GRAD_LIMIT the step is skipped.
    """
    from deepmd_hybridmuon import HybridMuonOptimizer

    K, device = kernels
    if dtype == torch.bfloat16 and device.type == "cpu":
        pytest.skip("bfloat16 vectors: on a GPU only (the interpreter computes them wrongly, NumPy has no bfloat16)")
    gen = torch.Generator().manual_seed(0)
    # one program per matrix in registers, a long one streamed, one of the torch path; the Adam vector: a small gradient
    shapes = [(32, 48), (16, 2048), (136, 140), (7,)]
    paths = [(F.on_triton(min(s)), K.resident(min(s), max(s))) for s in shapes[:3]]
    assert paths == [(True, True), (True, False), (False, False)]
    init = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    top = float(torch.finfo(dtype).max) if scale is None else scale
    grads = []
    for s in shapes:
        g = torch.randn(s, generator=gen, dtype=torch.float64)
        grads.append((g / g.abs().max() * (top if len(s) == 2 else 1.0)).to(dtype))
    # the same gradients scaled down by a power of two (exact): their largest element in [1, 2)
    down = 2.0 ** -math.floor(math.log2(top))
    small = [g * down if g.dim() == 2 else g for g in grads]

    def step(gradients):
        params = [torch.nn.Parameter(p.to(device, copy=True)) for p in init]
        opt = HybridMuonOptimizer(params, lr=0.5, magma_muon=True)
        for p, g in zip(params, gradients, strict=True):
            p.grad = g.to(device)
        opt.step()
        assert opt.execution_table()[0]["kernels"] == "triton"
        return params, opt

    params, opt = step(grads)
    if top >= F.GRAD_LIMIT:  # skipped, Adam vector too
        assert all(torch.equal(p.cpu(), p0) for p, p0 in zip(params, init, strict=True))
    else:
        reference, _ = step(small)
        for p, q, p0 in zip(params, reference, init, strict=True):
            delta, expected = (p.cpu().double() - p0.double()), (q.cpu().double() - p0.double())
            assert expected.norm() > 0.1
            # Every scaling is an exact power of two, so the normalised matrices are the same and
            # the steps equal bitwise (measured under the interpreter), but for 1 / (||G|| + eps),
            # whose float32 rounding eps may move by one unit for the small gradient only; Newton-
            # Schulz amplifies such a rounding of its input as one of its products'
            # (conftest.KERNEL_MUON_TOL). A zero update or a NaN, as before, is far beyond it.
            err = ((delta - expected).norm() / expected.norm()).item()
            assert err < KERNEL_MUON_TOL, (tuple(p.shape), err)
    for p in params:  # a second step, from the state of the first
        g = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.grad = (g / g.abs().max() * (top if p.dim() == 2 else 1.0)).to(dtype).to(device)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)
    for entry in opt.state.values():
        assert all(torch.isfinite(v).all() for v in entry.values() if torch.is_tensor(v))


def test_adam_gradient_beyond_its_limit_skips_the_step_on_the_kernels(kernels):
    """An Adam gradient at ADAM_GRAD_LIMIT stops the whole step with the Triton kernels too."""
    from deepmd_hybridmuon import HybridMuonOptimizer

    _, device = kernels
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in ((32, 48), (7,))]
    opt = HybridMuonOptimizer(params, lr=0.5)
    before = [p.detach().clone() for p in params]
    for top in (F.ADAM_GRAD_LIMIT, F.ADAM_GRAD_LIMIT / 2):  # skipped, then taken
        params[0].grad = torch.randn(32, 48, generator=gen).to(device)
        params[1].grad = torch.full((7,), top).to(device)
        opt.step()
        assert opt.execution_table()[0]["kernels"] == "triton"
        moved = [not torch.equal(p, b) for p, b in zip(params, before, strict=True)]
        assert moved == [top < F.ADAM_GRAD_LIMIT] * 2
        assert all(torch.isfinite(p).all() for p in params)


def test_every_launch_has_the_declared_argument_types(kernels, monkeypatch):
    """Each real launch's arguments are of the types its declaration gives the compile process.

    The declarations (``common.Launch``, ``compile._launches``) are what the compile process
    warms up; a launch with other argument dtypes would be a variant compiled in the training
    process. One engine step over matrices of every path (one program per matrix in registers or
    streamed, the torch path) and an Adam vector makes every kernel launch.
    """
    from conftest import make_optimizer

    K, device = kernels
    launched = set()
    seen = []
    real = K.common.Launch.__call__

    def checked(launch, grid, *args):
        assert len(args) == len(launch.args), launch
        for declared, actual in zip(launch.args, args, strict=True):
            if isinstance(declared, torch.dtype):
                assert isinstance(actual, torch.Tensor) and actual.dtype == declared, (launch, actual)
            else:
                assert type(actual) is type(declared), (launch, actual)
        launched.add(launch.kernel.fn.__name__)
        seen.append(launch)
        real(launch, grid, *args)

    monkeypatch.setattr(K.common.Launch, "__call__", checked)
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 48), (16, 1100), (136, 140), (7,)]  # in registers, streamed (Gram), torch path, Adam
    paths = [(F.on_triton(min(s)), K.resident(min(s), max(s))) for s in shapes[:3]]
    assert paths == [(True, True), (True, False), (False, False)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen).to(device)) for s in shapes]
    opt = make_optimizer(params, "engine-eager", lr=1e-3, enable_gram=True, magma_muon=True)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(device)
    opt.step()
    assert opt.execution_table()[0]["kernels"] == "triton"
    assert launched == set(K.common.ALIGNED)
    # ... and each launch is one of those the compile process warms up for this group's variants
    keys = [(*K.compile._launch_key(True, *s), None, torch.float32) for s in shapes[:2]]
    declared = {launch for key in keys for launch in K.compile._launches(key)}
    for launch in seen:
        assert launch in declared, launch


def test_a_kernel_that_does_not_compile_leaves_the_torch_path(monkeypatch, caplog):
    K = pytest.importorskip("deepmd_hybridmuon.kernels")
    monkeypatch.setattr(K.compile, "registry", K.KernelRegistry(background=False))

    def broken(key, device):
        raise RuntimeError("unsupported instruction")

    monkeypatch.setattr(K.compile, "_warm_up", broken)
    gpu = torch.device("cuda", 0)  # only named: the broken compiler never touches it
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        assert K.prepare(gpu, torch.float32, [(True, 64, 512)]) is None
    assert "did not compile (unsupported instruction); torch kernels instead" in caplog.text
    # remembered: no second attempt, no second warning
    caplog.clear()
    assert K.prepare(gpu, torch.float32, [(True, 64, 512)]) is None
    assert not caplog.text


@pytest.mark.skipif(CUDA or INTERPRET, reason="the kernels run directly here")
def test_kernels_under_the_interpreter():
    run_interpreted(__file__, "not under_the_interpreter")
