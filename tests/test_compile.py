"""The kernel registry: background compilation in a child process, and a clean exit whatever its state.

A run that trained must exit 0 even when Triton is still compiling (issue: a daemon compile
thread inside native code aborted the interpreter at shutdown). These tests run on the CPU:
the "compilation" is a stand-in child process, or the real worker failing for want of a GPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

K = pytest.importorskip("deepmd_hybridmuon.kernels")  # imports triton

GPU = torch.device("cuda", 0)  # only named: nothing here touches a GPU
PATHS = [(True, 64, 512), (False, 240, 240)]

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
        pending = K.prepare(torch.device("cuda", 0), torch.float32, {PATHS!r}, magma=True)
        deadline = time.monotonic() + 60
        while not __import__("os").path.exists({str(marker)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        print("pid", K.compile.registry.workers[0].process.pid)
        print("set", pending.is_set())
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
        pending = K.prepare(GPU, torch.float32, PATHS, magma=True)
        assert pending is not None and not pending.is_set()  # a child process compiles
        assert pending.wait(300), "the compile process did not finish"
    failures = [r.getMessage() for r in caplog.records if "did not compile" in r.getMessage()]
    # one line per variant: standard phased (240 x 240), Gram panel (64 x 512), spans, Magma
    assert len(failures) == 4, failures
    assert all("torch kernels instead" in line for line in failures)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        assert K.prepare(GPU, torch.float32, PATHS, magma=True) is None
    assert not caplog.text


def test_a_compile_process_that_dies_fails_its_variants(monkeypatch, caplog, tmp_path):
    # Each registry here has an empty ledger: on a GPU machine Triton's cache may hold the real variants.
    dies = [sys.executable, "-c", "import sys; sys.exit(3)"]
    monkeypatch.setattr(K.compile, "registry", K.KernelRegistry(worker=dies, ledger=tmp_path))
    with caplog.at_level(logging.WARNING, logger="deepmd.hybridmuon"):
        pending = K.prepare(GPU, torch.float32, PATHS[:1], magma=False)
        assert pending is not None and pending.wait(60)
    assert "compile process exited with status 3" in caplog.text
    assert K.prepare(GPU, torch.float32, PATHS[:1], magma=False) is None  # the torch path from now on


def test_variants_in_flight_are_not_compiled_twice(monkeypatch, tmp_path):
    marker = tmp_path / "started"
    registry = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=tmp_path / "ledger")
    monkeypatch.setattr(K.compile, "registry", registry)
    try:
        first = K.prepare(GPU, torch.float32, PATHS, magma=True)
        second = K.prepare(GPU, torch.float32, PATHS, magma=True)  # another param_group, same variants
        assert first is not None and second is not None
        assert len(registry.workers) == 1
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


def test_variants_already_in_the_cache_load_at_once_without_a_compile_process(monkeypatch, tmp_path):
    loaded: list[tuple] = []
    monkeypatch.setattr(K.compile, "_compile", lambda key, device: loaded.append(key))
    ledger = tmp_path / "ledger"
    # First run: the variants compile in a child process, then load here.
    first = K.KernelRegistry(worker=[sys.executable, "-c", REPORTS_OK], ledger=ledger)
    pending = first.prepare(GPU, torch.float32, PATHS, magma=True)
    assert pending is not None and not pending.is_set() and len(first.workers) == 1
    assert pending.wait(60)
    assert len(loaded) == 4  # standard phased, Gram panel, spans, Magma: each loaded once
    # A later run with the same cache: no compile process (its stand-in would leave the
    # marker file), the variants load before prepare() returns.
    marker = tmp_path / "started"
    later = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=ledger)
    pending = later.prepare(GPU, torch.float32, PATHS, magma=True)
    assert pending is not None and pending.is_set()
    assert not later.workers and not marker.exists()
    assert sorted(map(repr, loaded[4:])) == sorted(map(repr, loaded[:4]))
    # A variant the cache has never held still goes to a compile process, and only that one.
    try:
        pending = later.prepare(GPU, torch.float32, [*PATHS, (True, 32, 4096)], magma=True)
        assert pending is not None and not pending.is_set()
        assert [len(w.keys) for w in later.workers] == [1]
    finally:
        later.close()
    # Another cache (an emptied one, another TRITON_CACHE_DIR): a compile process again.
    other = K.KernelRegistry(worker=[sys.executable, "-c", SLEEPER, str(marker)], ledger=tmp_path / "other")
    try:
        assert not other.prepare(GPU, torch.float32, PATHS, magma=True).is_set()
        assert len(other.workers) == 1
    finally:
        other.close()


def test_the_ledger_lives_in_tritons_cache_folder(monkeypatch, tmp_path):
    from deepmd_hybridmuon.kernels.compile import Ledger

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    assert Ledger().root == cache / "deepmd_hybridmuon"
