"""The kernel registry: background compilation in a child process, and a clean exit whatever its state.

A run that trained must exit 0 even when Triton is still compiling (issue: a daemon compile
thread inside native code aborted the interpreter at shutdown). These tests run on the CPU:
the "compilation" is a stand-in child process, or the real worker failing for want of a GPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from deepmd_hybridmuon import functional as F

K = pytest.importorskip("deepmd_hybridmuon.kernels")  # imports triton

GPU = torch.device("cuda", 0)  # only named: nothing here touches a GPU
PATHS = [(True, 64, 512), (False, 32, 48)]

# The interpreter exits while a stand-in compile process is running: one that sleeps (ends on
# SIGTERM) and one that ignores SIGTERM (killed after the registry's grace period).
SLEEPER = "import sys, time; open(sys.argv[1], 'w').write('started'); sys.stdin.buffer.read(); time.sleep(300)"
STUBBORN = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("worker", [SLEEPER, STUBBORN], ids=["sleeping", "ignores-sigterm"])
def test_interpreter_exits_cleanly_while_a_compile_is_in_flight(tmp_path, worker):
    marker = tmp_path / "started"
    script = textwrap.dedent(
        f"""
        import sys, threading, time
        from pathlib import Path
        import torch
        from deepmd_hybridmuon import kernels as K

        # An empty ledger: on a GPU machine the real variants may already be in Triton's cache,
        # which would load them in-process and start no (stand-in) compile process at all.
        K.compile.registry = K.KernelRegistry(
            worker=[sys.executable, "-c", {worker!r}, {str(marker)!r}], ledger=Path({str(tmp_path / "ledger")!r})
        )
        pending = K.prepare(torch.device("cuda", 0), torch.float32, {PATHS!r})
        deadline = time.monotonic() + 60
        while not __import__("os").path.exists({str(marker)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("pid", K.compile.registry.workers[0].process.pid)
        print("set", pending.is_set())
        K.compile.registry.setup.join()  # the one thread it starts only hashes files, briefly
        print("threads", sorted(t.name for t in threading.enumerate()))
        """
    )
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, run.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert out["set"] == "False"  # the exit came while the compilation was in flight
    assert out["threads"] == "['MainThread']"  # no compile thread exists that could die in native code
    # The stand-in is gone: terminated at exit (or killed after the 5 s grace period).
    pid = int(out["pid"])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    # Import of torch and triton (a few seconds on a CI core), plus at most the grace period.
    assert elapsed < 60


def test_the_real_worker_reports_each_variant_and_the_engine_keeps_the_torch_path(monkeypatch, caplog):
    # On a machine without a GPU the real compile process fails for every variant: each is
    # reported back, logged once, and remembered (no second attempt).
    if torch.cuda.is_available():
        pytest.skip("on a GPU the variants compile; tests/test_kernels.py covers that path")
    monkeypatch.setattr(K.compile, "registry", K.KernelRegistry())
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        pending = K.prepare(GPU, torch.float32, PATHS)
        assert pending is not None and not pending.is_set()  # a child process compiles
        assert pending.wait(300), "the compile process did not finish"
    failures = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    # one line per variant: standard program (32 x 48), Gram program streamed (64 x 512)
    assert len(failures) == 2, failures
    assert all("torch kernels instead" in line for line in failures)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        assert K.prepare(GPU, torch.float32, PATHS) is None
    assert not caplog.text


def test_a_compile_process_that_dies_fails_its_variants(monkeypatch, caplog, tmp_path):
    # Each registry here has an empty ledger: on a GPU machine Triton's cache may hold the real variants.
    dies = [sys.executable, "-c", "import sys; sys.exit(3)"]
    monkeypatch.setattr(K.compile, "registry", K.KernelRegistry(worker=dies, ledger=tmp_path))
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        pending = K.prepare(GPU, torch.float32, PATHS[:1])
        assert pending is not None and pending.wait(60)
    assert "compile process exited with status 3" in caplog.text
    assert K.prepare(GPU, torch.float32, PATHS[:1]) is None  # the torch path from now on


def test_variants_in_flight_are_not_compiled_twice(monkeypatch, tmp_path):
    marker = tmp_path / "started"
    registry = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=tmp_path / "ledger")
    monkeypatch.setattr(K.compile, "registry", registry)
    try:
        first = K.prepare(GPU, torch.float32, PATHS)
        started = len(registry.workers)
        second = K.prepare(GPU, torch.float32, PATHS)  # another param_group, same variants
        assert first is not None and second is not None
        assert len(registry.workers) == started
        # two variants (standard program, streamed Gram program), each compiled by one process
        compiling = [repr(key) for w in registry.workers for key in w.keys]
        assert len(compiling) == len(set(compiling)) == 2
        assert not K.wait_ready(0)
    finally:
        registry.close()
    assert K.wait_ready(0)


# A stand-in worker that "compiles" every key it is given (reports each one ok), as the real one
# does on a GPU; with it, loading in this process is a stand-in too (the real one needs a GPU).
REPORTS_OK = (
    "import pickle, sys; keys, _ = pickle.load(sys.stdin.buffer); "
    "print(*(f'{i}\\tok' for i in range(len(keys))), sep='\\n')"
)


def test_compiled_variants_load_one_per_step_and_a_later_run_needs_no_compile_process(monkeypatch, tmp_path):
    loaded: list[tuple] = []
    monkeypatch.setattr(K.compile, "_warm_up", lambda key, device: loaded.append(key))
    ledger = tmp_path / "ledger"
    # First run: the variants compile in a child process, then load here, one per poll (a
    # step asks once or twice), so that no step holds the training loop for all of them.
    first = K.KernelRegistry(worker=[sys.executable, "-c", REPORTS_OK], ledger=ledger)
    pending = first.prepare(GPU, torch.float32, PATHS)
    assert pending is not None and not pending.is_set() and first.workers
    for worker in first.workers:
        worker.process.wait(60)
    first.setup.join()  # Triton's set-up: no variant loads before it is done (off this thread)
    seen = [(pending.is_set(), len(loaded)) for _ in range(2)]  # standard program, streamed Gram program
    assert seen == [(False, 1), (True, 2)]
    # A later run with the same cache: no compile process (its stand-in would leave the
    # marker file); the variants load the same way, one per poll, from the first step on.
    marker = tmp_path / "started"
    later = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=ledger)
    pending = later.prepare(GPU, torch.float32, PATHS)
    assert pending is not None and len(loaded) == 2
    assert pending.wait(0)
    assert not later.workers and not marker.exists()
    assert sorted(map(repr, loaded[2:])) == sorted(map(repr, loaded[:2]))
    # A variant the cache has never held still goes to a compile process, and only that one.
    try:
        pending = later.prepare(GPU, torch.float32, [*PATHS, (True, 32, 4096)])
        assert pending is not None and not pending.is_set()
        assert [len(w.keys) for w in later.workers] == [1]
    finally:
        later.close()
    # Another cache (an emptied one, another TRITON_CACHE_DIR): a compile process again.
    other = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=tmp_path / "other")
    try:
        assert not other.prepare(GPU, torch.float32, PATHS).is_set()
        assert sum(len(w.keys) for w in other.workers) == 2
    finally:
        other.close()


def test_the_ledger_lives_in_tritons_cache_folder(monkeypatch, tmp_path):
    from deepmd_hybridmuon.kernels.compile import Ledger

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert Ledger().root == cache / "deepmd_hybridmuon"


# ----------------------------------------------------------------------------------------
# What the compile process warms up is what the engine launches
# ----------------------------------------------------------------------------------------

# One variant key of every kind the registry asks for (prepare()'s keys, dtype last).
KINDS = [
    (*K.compile._launch_key(False, 32, 48), 0, torch.float32),  # one program per matrix
    (*K.compile._launch_key(True, 64, 4096), 0, torch.float32),  # the Gram iteration, streamed
]


def _launched_kernels() -> set[str]:
    """Every Triton kernel some module of the package launches from the host directly (``name[grid](...)``)."""
    import re
    from pathlib import Path

    folder = Path(K.__file__).parent
    return {m for path in folder.glob("*.py") for m in re.findall(r"(_\w+_kernel)\[", path.read_text())}


def test_every_kernel_is_launched_through_its_declaration_and_specialises_on_types_only():
    """The launchers launch through ``common.Launch`` objects, the same ones the compile process warms up.

    That the arguments of every real launch are of the declared types: test_kernels.py
    (``test_every_launch_has_the_declared_argument_types``).
    """
    declared = {launch.kernel.fn.__name__: launch.kernel for key in KINDS for launch in K.compile._launches(key)}
    assert set(declared) == set(K.common.ALIGNED)  # every host-launched kernel (common.kernel)
    assert _launched_kernels() == set()  # none launched but through a declaration
    for name, kernel in declared.items():
        # A value-specialised argument (an integer equal to 1 or divisible by 16, a pointer's
        # alignment) would make the engine's launch a variant the compile process never built;
        # only pointers to the callers' own workspaces keep their alignment (always 16 bytes,
        # as test_kernels checks at every launch).
        loose = [p for p in kernel.params if not p.is_constexpr]
        aligned = K.common.ALIGNED[name]
        assert loose and all(p.do_not_specialize == p.do_not_specialize_on_alignment for p in loose), name
        assert {p.name for p in loose if not p.do_not_specialize} == set(aligned), name
        assert all(n.endswith("_ptr") and n not in ("src_ptr", "dst_ptr", "grad_ptr") for n in aligned), name


def test_the_ledger_key_changes_with_everything_that_fixes_a_binary(monkeypatch):
    ledger = K.compile.Ledger(root=None)
    base = KINDS[1]
    names = {ledger.name(key, (9, 0)) for key in KINDS}
    assert len(names) == len(KINDS)
    assert ledger.name(base, (9, 0)) == ledger.name(base, (9, 0))  # deterministic
    assert ledger.name((*base[:-1], torch.bfloat16), (9, 0)) != ledger.name(base, (9, 0))  # argument dtypes
    assert ledger.name(base, (8, 0)) != ledger.name(base, (9, 0))  # the GPU
    other = K.compile._launch_key(False, 64, 96)  # other constexprs (block sizes) of the same kernel
    assert ledger.name((*other, 0, torch.float32), (9, 0)) != ledger.name(base, (9, 0))
    # The options of a launch (num_warps, constexprs) and this package's sources are in the key.
    launches = K.compile._launches(base)
    changed = [K.common.Launch(la.kernel, *la.args, **{**la.kwargs, "num_warps": 2}) for la in launches]
    original = K.compile._launches
    monkeypatch.setattr(K.compile, "_launches", lambda key: changed if key == base else original(key))
    assert ledger.name(base, (9, 0)) not in names
    monkeypatch.setattr(K.compile, "_launches", original)
    fresh = K.compile.Ledger(root=None)
    monkeypatch.setattr(K.compile, "_sources_fingerprint", lambda: "edited kernels")
    assert fresh.name(base, (9, 0)) not in names


# A training process on a GPU, from an empty or a filled Triton cache, listening to Triton:
# every kernel it compiles or loads, every launcher it builds with the C compiler.
TRAINING = """
import json, sys, threading, time, torch
from triton import knobs
from triton.runtime import build
from deepmd_hybridmuon import HybridMuonOptimizer

events, steps = [], [0]
def heard(*, src, cache_hit, **_):
    detail = "" if cache_hit else repr((src.signature, src.constants, src.attrs))  # what a miss was built for
    events.append(("kernel", src.fn.__name__, cache_hit, steps[0], detail, threading.current_thread().name))
knobs.compilation.listener = heard
original = build._build
def counted(name, *args, **kwargs):
    events.append(("launcher", name, False, steps[0], "", threading.current_thread().name))
    return original(name, *args, **kwargs)
build._build = counted
gen = torch.Generator().manual_seed(0)
shapes = [(32, 48), (64, 96), (64, 4096), (240, 240), (136, 240), (300, 20), (7,), (5, 3)]
params = [torch.nn.Parameter(torch.randn(s, generator=gen).cuda()) for s in shapes]
opt = HybridMuonOptimizer(params, lr=1e-3, enable_gram=True, magma_muon=True)
host_ms, deadline = [], time.monotonic() + 400
while time.monotonic() < deadline:
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    opt.step()
    torch.cuda.synchronize()
    host_ms.append((time.perf_counter() - t0) * 1e3)
    steps[0] += 1
    row = opt.execution_table()[0]
    if row["kernels"] == "triton" and row["cuda_graph"]:
        break
print(json.dumps({"row": {k: row[k] for k in ("kernels", "cuda_graph")}, "events": events, "host_ms": host_ms,
                  "workers": len(__import__("deepmd_hybridmuon").kernels.compile.registry.workers)}))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_training_process_never_compiles_from_an_empty_or_a_filled_cache(tmp_path):
    import json

    fresh = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    runs = []
    # cold, then warm; last in the cache this test session's earlier GPU tests filled (their own
    # launches, in every order): a first step once took 39 s there
    for env in (fresh, fresh, dict(os.environ)):
        out = subprocess.run(
            [sys.executable, "-c", TRAINING], capture_output=True, text=True, env=env, timeout=600, check=False
        )
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for run in runs:
        assert run["row"] == {"kernels": "triton", "cuda_graph": True}
        # a cache miss, or a launcher built, in the training thread
        compiled_here = [e for e in run["events"] if not e[2] and e[5] == "MainThread"]
        assert compiled_here == [], compiled_here
        # Off it, only the set-up thread's one-time driver module (KernelRegistry.set_up),
        # built with the C compiler on a cold cache, loaded on a warm one.
        elsewhere = {(e[0], e[1], e[5]) for e in run["events"] if not e[2] and e[5] != "MainThread"}
        assert elsewhere <= {("launcher", "cuda_utils", "deepmd-hybridmuon-triton-set-up")}, elsewhere
        assert any(e[0] == "kernel" and e[2] for e in run["events"])  # the variants were loaded from the cache
    assert runs[1]["workers"] == 0  # the filled cache: no compile process was needed


def test_the_benchmarks_read_the_log_lines_the_package_writes():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import common

    from deepmd_hybridmuon.optimizer import KERNELS_IN_USE_LOG

    assert common.COMPILING_MARK in K.compile.COMPILING_LOG % 3
    assert common.KERNELS_FROM_STEP_RE.search(KERNELS_IN_USE_LOG % 7).group(1) == "7"


# Hashes every host kernel's Triton cache key, the Newton–Schulz kernel first or last (in a process
# that launched the others before it), and prints them.
_CACHE_KEYS = textwrap.dedent(
    """
    import json, sys
    from deepmd_hybridmuon.kernels import common
    kernels = [f for f in common.JITTED if f.fn.__name__ in common.ALIGNED]
    kernels.sort(key=lambda f: (f.fn.__name__ == "_newton_schulz_kernel") == (sys.argv[1] == "gram-last"))
    print(json.dumps({f.fn.__name__: f.cache_key for f in kernels}))
    """
)


def test_a_kernels_cache_key_does_not_depend_on_the_order_of_launches():
    """The compile process and the training process find each variant under one Triton cache key.

    Triton hashes a kernel lazily and folds in only the globals of helpers already hashed in
    that process: hashed first, a kernel once missed ``_matrix_meta``'s constants and was
    compiled again in the training process (kernels.common.settle_hashes).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    keys = [
        json.loads(
            subprocess.run(
                [sys.executable, "-c", _CACHE_KEYS, order], env=env, capture_output=True, text=True, check=True
            ).stdout
        )
        for order in ("gram-first", "gram-last")
    ]
    assert keys[0] == keys[1]
    assert len(keys[0]) == len(K.common.ALIGNED)  # every host kernel


@pytest.mark.parametrize(
    ("use_gram", "rows", "cols", "triton"),
    [
        (True, 128, 128, True),  # resident: 128 x 128 in registers
        (False, 64, 2048, True),  # a long matrix streamed through the workspace
        (True, 64, 2048, True),
        (True, 129, 129, False),  # the torch path, for every smaller side above 128
        (False, 256, 1600, False),
        (True, 257, 300, False),
    ],
)
def test_each_matrix_has_one_path_for_the_layout_and_the_registry(use_gram, rows, cols, triton):
    """kernels.on_triton decides; the layout's groups and the registry's variant keys follow it."""
    from deepmd_hybridmuon.engine.layout import assign

    assert F.on_triton(min(rows, cols)) == triton
    fused, buckets = assign([(1, rows, cols)], K, use_gram)
    assert (len(fused), len(buckets)) == (triton, not triton)
    if triton:
        assert K.compile._launch_key(use_gram, rows, cols)[0] == "ns"
    else:
        with pytest.raises(ValueError, match="torch path"):
            K.compile._launch_key(use_gram, rows, cols)
