"""Compilation of the kernel variants off the training process: :class:`KernelRegistry`.

:func:`prepare` and :func:`wait_ready` ask the process-wide :data:`registry`; :func:`_compile`
lists, per variant key, the launches that compile it; :func:`compile_worker` is the child
process that runs it; :class:`Ledger` remembers which variants are already in Triton's cache.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import functional as F
from .common import MAX_ROWS, _warps, work_dtype
from .magma import _MAGMA_OPTIONS, _magma_finish_kernel, _magma_partial_kernel
from .newton_schulz import _newton_schulz_kernel, _ns_options
from .panel import (
    PANEL,
    _panel_apply_kernel,
    _panel_gram_kernel,
    _panel_reduce_kernel,
    panel_block,
    panel_launches,
    panelled,
)
from .phased import _phased_kernel, _phased_options, padded, phase_count
from .spans import _SPAN_OPTIONS, _apply_kernel, _gather_kernel, _momentum_kernel

log = logging.getLogger("deepmd.hybridmuon")

# ---------------------------------------------------------------------------
# Compilation off the training process
# ---------------------------------------------------------------------------
#
# Triton compiles a kernel variant the first time it is launched (about 2 s each, 7-8 s for
# the phased kernels) and caches it on disk. So that a first run does not wait ~20 s in its
# first step, the engine asks :func:`prepare` for the variants it needs; missing ones
# compile in a child process (:func:`compile_worker`) while the engine steps with the
# torch path. Once the child has exited, the training process loads the variants from
# Triton's disk cache (milliseconds) and the engine switches to the kernels (engine/).
#
# Why a process and not a thread: Triton compiles in native code (LLVM, ptxas). A
# daemon thread still inside it when the interpreter shuts down is ended by
# ``pthread_exit``, whose forced unwinding through C++ frames aborts the process
# ("FATAL: exception not rethrown") after a run that trained and saved. A child process
# can simply be terminated at exit (:meth:`KernelRegistry.close`, registered with
# ``atexit``); Triton writes its cache files atomically, so a killed compilation leaves
# nothing half-written. The child also dies with its parent (``PR_SET_PDEATHSIG``).
#
# Compiling with example tensors of the same dtypes gives the same variants as the real
# launches: integer arguments are not specialised on.
#
# A later run finds the variants in Triton's disk cache. Starting a child there would
# still cost seconds (it imports torch and Triton) of torch-path steps, then an engine
# rebuild, inside the first timed window of every run. So each variant this process has
# loaded is written down in a :class:`Ledger` beside Triton's cache, and a variant the
# ledger lists is loaded at once, in this process, at the first step (milliseconds). Should
# Triton's cache have lost it meanwhile, that load compiles it right there, in the training
# thread: seconds once, never a thread inside native code at exit.


class Ledger:
    """The variants some process loaded from (or compiled into) one Triton cache: an empty file each.

    A file's name hashes the variant's key with everything Triton's own cache key depends on
    that can differ between runs sharing the cache: this package's kernel sources and
    schedules, the Triton and CUDA versions, and the GPU's compute capability. Emptying
    Triton's cache (the default location of the ledger) empties the ledger too.

    Parameters
    ----------
    root
        The ledger's folder; default ``deepmd_hybridmuon/`` in Triton's cache folder
        (``TRITON_CACHE_DIR``, else ``~/.triton/cache``), read at first use.
    """

    def __init__(self, root: Path | None = None) -> None:
        self._root = root
        self._fingerprint: str | None = None

    @property
    def root(self) -> Path:
        """The ledger's folder."""
        if self._root is None:
            self._root = _triton_cache_dir() / "deepmd_hybridmuon"
        return self._root

    def _path(self, key: tuple[Any, ...], device: torch.device) -> Path:
        if self._fingerprint is None:
            self._fingerprint = _sources_fingerprint()
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        text = repr((self._fingerprint, capability, key[:-2], str(key[-1])))
        return self.root / hashlib.sha256(text.encode()).hexdigest()[:40]

    def has(self, key: tuple[Any, ...], device: torch.device) -> bool:
        """Whether ``key`` was loaded by some process with this cache."""
        return self._path(key, device).exists()

    def add(self, key: tuple[Any, ...], device: torch.device) -> None:
        """Note ``key`` as in the cache (best effort: a read-only cache only costs later runs a child)."""
        path = self._path(key, device)
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()


def _triton_cache_dir() -> Path:
    """Triton's disk cache folder, as Triton itself resolves it."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton before knobs (3.4)
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def _sources_fingerprint() -> str:
    """A hash of what the compiled variants are made of: this package's kernel and schedule sources, versions."""
    import triton

    digest = hashlib.sha256(f"{triton.__version__} {torch.version.cuda}".encode())
    here = Path(__file__).resolve().parent
    for path in [*sorted(here.glob("*.py")), here.parent / "functional.py"]:
        digest.update(path.read_bytes())
    return digest.hexdigest()


class _Pending:
    """The variants one :func:`prepare` asked for: ``is_set()`` once all are compiled or failed.

    Checking is cheap (a non-blocking ``waitpid`` per running worker) and, once a worker has
    exited, loads its variants into this process (see :meth:`KernelRegistry.poll`).
    """

    def __init__(self, registry: KernelRegistry, keys: frozenset[tuple[Any, ...]]) -> None:
        self.registry, self.keys = registry, keys

    def is_set(self) -> bool:
        """Whether every variant asked for is compiled (or failed); never blocks."""
        self.registry.poll()
        return self.keys <= (self.registry.ready | self.registry.failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`is_set` or ``timeout`` seconds; return :meth:`is_set`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self.registry.workers_for(self.keys):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(left)
        return self.is_set()


@dataclass
class _Worker:
    process: subprocess.Popen
    keys: list[tuple[Any, ...]]
    device: torch.device


class KernelRegistry:
    """Which Triton variants this process has compiled, and the compilations under way.

    One object, used from the training thread only (no locks, no threads). A variant is
    identified by a key (:func:`_launch_key` plus device index and dtype).

    Parameters
    ----------
    background
        Compile missing variants in a child process (default) rather than at once in this
        one (the tests' way of getting the kernels from the first step on).
    worker
        The child's command line; it reads ``(keys, device index)`` pickled on its standard
        input and writes one line per key on its standard output (see :func:`compile_worker`).
        Default: this package's :func:`compile_worker` under the current interpreter.
    ledger
        Where the variants already in Triton's cache are noted (:class:`Ledger`); a folder, or
        default beside Triton's cache.
    """

    def __init__(self, *, background: bool = True, worker: list[str] | None = None, ledger: Path | None = None) -> None:
        self.background = background
        self.worker = worker
        self.ledger = Ledger(ledger)
        self.ready: set[tuple[Any, ...]] = set()
        self.failed: set[tuple[Any, ...]] = set()
        self.workers: list[_Worker] = []
        self._closing_registered = False

    # ----------------------------------------------------------------- asking

    def prepare(
        self, device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool
    ) -> _Pending | None:
        """Start compiling the variants for ``paths`` ((use_gram, rows, cols) per launch), spans and Magma.

        Returns an object whose ``is_set()`` becomes true once they are compiled: at once
        when they already are, when the :class:`Ledger` lists them (they load from Triton's
        cache before returning), or when ``background`` is off (they compile before
        returning); ``None`` when a variant failed to compile earlier in this process (the
        engine then keeps the torch path; the failure was logged once).
        """
        keys = {(*_launch_key(g, r, c), device.index, dtype) for g, r, c in paths}
        keys.add(("spans", device.index, dtype))
        if magma:
            keys.add(("magma", device.index, dtype))
        pending = _Pending(self, frozenset(keys))
        self.poll()
        if keys & self.failed:
            return None
        in_flight = {key for w in self.workers for key in w.keys}
        missing = sorted(keys - self.ready - in_flight, key=repr)
        if device.type != "cuda":  # the interpreter does not compile
            self.ready |= keys
            return pending
        cached = [key for key in missing if self.ledger.has(key, device)]
        missing = [key for key in missing if key not in cached]
        if missing and self.background and self._start(missing, device):
            missing = []
        for key in cached + missing:  # at once, in this process
            self._load(key, device)
        return None if keys & self.failed else pending

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the compilations under way; ``False`` if some still run after ``timeout`` seconds."""
        return _Pending(self, frozenset(k for w in self.workers for k in w.keys)).wait(timeout)

    def workers_for(self, keys: frozenset[tuple[Any, ...]]) -> list[_Worker]:
        """The running workers compiling any of ``keys``."""
        return [w for w in self.workers if keys.intersection(w.keys)]

    # ---------------------------------------------------------------- workers

    def _start(self, keys: list[tuple[Any, ...]], device: torch.device) -> bool:
        """Start a worker for ``keys``; ``False`` if no child process can be started here."""
        if self.worker is None and not sys.executable:
            return False  # an embedded interpreter: compile in this process instead
        command = self.worker or [sys.executable, "-c", f"from {__name__} import compile_worker; compile_worker()"]
        env = dict(os.environ)
        # The child imports this very package, wherever this process found it.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        try:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        except OSError as err:
            log.info("Triton kernels: no compile process (%s); compiling in this process", err)
            return False
        assert process.stdin is not None  # stdin=PIPE
        with contextlib.suppress(BrokenPipeError):
            process.stdin.write(pickle.dumps((keys, device.index or 0)))
            process.stdin.close()
        self.workers.append(_Worker(process, keys, device))
        if not self._closing_registered:
            atexit.register(self.close)
            self._closing_registered = True
        return True

    def poll(self) -> None:
        """Load the variants of every worker that has exited (from Triton's disk cache)."""
        for worker in [w for w in self.workers if w.process.poll() is not None]:
            self.workers.remove(worker)
            assert worker.process.stdout is not None  # stdout=PIPE
            lines = worker.process.stdout.read().decode(errors="replace").splitlines()
            worker.process.stdout.close()
            errors = dict(line.split("\t", 1) for line in lines if "\t" in line)
            for index, key in enumerate(worker.keys):
                error = errors.get(str(index))
                if error is None and len(lines) < len(worker.keys):
                    error = f"compile process exited with status {worker.process.returncode}"
                if error is not None and error != "ok":
                    self._fail(key, error)
                else:
                    self._load(key, worker.device)

    def _load(self, key: tuple[Any, ...], device: torch.device) -> None:
        """Compile ``key`` in this process (a disk-cache hit after a worker has compiled it)."""
        try:
            _compile(key, device)
        except Exception as err:  # a GPU or Triton without support for a kernel
            self._fail(key, str(err))
        else:
            self.ready.add(key)
            self.ledger.add(key, device)

    def _fail(self, key: tuple[Any, ...], error: str) -> None:
        self.failed.add(key)
        log.warning("Triton kernel %s did not compile (%s); torch kernels instead", key[:-2], error)

    def close(self) -> None:
        """Stop the workers still compiling (at interpreter exit; their variants are dropped)."""
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.terminate()
        for worker in self.workers:
            try:
                worker.process.wait(5)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
        self.workers.clear()


def compile_worker() -> None:
    """Entry of the compile process: compile the keys read from stdin, one result line per key.

    Each line is ``index<TAB>ok`` or ``index<TAB>error text``. Anything the compilers print
    goes to stderr. The process ends with its parent (Linux ``PR_SET_PDEATHSIG``; elsewhere it
    checks the parent between keys).
    """
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        pr_set_pdeathsig = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints of the compilers must not mix with the result lines
    keys, index = pickle.load(sys.stdin.buffer)
    device = torch.device("cuda", index)
    for i, key in enumerate(keys):
        if os.getppid() != parent:
            return  # orphaned: nobody will load the variants
        try:
            if i == 0:
                torch.cuda.set_device(device)
            _compile(key, device)
            status = "ok"
        except Exception as err:
            status = " ".join(f"{type(err).__name__}: {err}".split()) or "error"
        out.write(f"{i}\t{status}\n")
        out.flush()


#: The process-wide registry used by the engine.
registry = KernelRegistry()


def prepare(
    device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]], magma: bool
) -> _Pending | None:
    """:meth:`KernelRegistry.prepare` of the process-wide :data:`registry`."""
    return registry.prepare(device, dtype, paths, magma)


def wait_ready(timeout: float | None = None) -> bool:
    """:meth:`KernelRegistry.wait_ready` of the process-wide :data:`registry`."""
    return registry.wait_ready(timeout)


def _launch_key(use_gram: bool, rows: int, cols: int) -> tuple[Any, ...]:
    if rows > MAX_ROWS:
        return ("phased", use_gram, (padded(rows), padded(cols)))
    if panelled(use_gram, rows, cols):
        return ("panel", panel_block(rows))
    return ("ns", tuple(sorted(_ns_options(rows, cols, use_gram).items())))


def _compile(key: tuple[Any, ...], device: torch.device) -> None:
    kind, dtype = key[0], key[-1]
    vec = torch.zeros(16, dtype=dtype, device=device)
    f32 = torch.zeros(16, dtype=torch.float32, device=device)
    f16 = torch.zeros(16, dtype=torch.float16, device=device)
    i64 = torch.zeros(16, dtype=torch.int64, device=device)
    if kind == "magma":
        _magma_partial_kernel.warmup(vec, vec, i64, f32, 2, BLOCK=1024, grid=(1,))
        _magma_finish_kernel.warmup(i64, f32, 2, f32, f32, f32, vec[0], f32[0], **_MAGMA_OPTIONS, grid=(1,))
    elif kind == "phased":  # the engine's two launches: all phases but the last, and the last
        use_gram, shape = key[1], key[2]
        work = torch.zeros(16, dtype=work_dtype(use_gram), device=device)
        args = (vec, vec, work, i64, 1, f32, f32, f32, torch.zeros(1, dtype=torch.int32, device=device), F.NS_EPS)
        n = phase_count(use_gram)
        for first, stop in ((0, n - 1), (n - 1, n)):
            options = _phased_options(use_gram, shape, stop - first > 1)
            _phased_kernel.warmup(*args, FIRST=first, STOP=stop, **options, grid=(1,))
    elif kind == "spans":
        _gather_kernel.warmup(i64, i64, vec, f32, **_SPAN_OPTIONS, grid=(1,))
        betas = torch.zeros(2, dtype=torch.promote_types(dtype, torch.float32), device=device)
        _momentum_kernel.warmup(vec, vec, vec, f32, betas, 16, BLOCK=_SPAN_OPTIONS["BLOCK"], num_warps=4, grid=(1,))
        _apply_kernel.warmup(i64, i64, vec, vec, **_SPAN_OPTIONS, enable_fp_fusion=False, grid=(1,))
    elif kind == "panel":
        bm = key[1]
        warps = _warps(bm)
        _panel_gram_kernel.warmup(vec, i64, i64, f32, BM=bm, BN=PANEL, num_warps=warps, grid=(1,))
        for reduce, apply in panel_launches():  # one (reduce, apply) pair per segment of the Gram schedule
            _panel_reduce_kernel.warmup(i64, f32, f16, f32, f32, F.NS_EPS, BM=bm, **reduce, num_warps=warps, grid=(1,))
            args = (vec, f16, vec, i64, i64, f16, f32, f32, f32)
            _panel_apply_kernel.warmup(*args, BM=bm, BN=PANEL, **apply, num_warps=warps, grid=(1,))
    else:
        options = dict(key[1])
        work = torch.zeros(16, dtype=work_dtype(options["GRAM"]), device=device)
        _newton_schulz_kernel.warmup(vec, vec, work, i64, f32, f32, 2, F.NS_EPS, **options, grid=(1,))
