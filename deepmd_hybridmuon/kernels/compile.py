"""Compilation of the kernel variants off the training process: :class:`KernelRegistry`.

Contract. The training process never compiles a kernel and never builds a launcher: child
processes (:func:`compile_worker`, up to :data:`WORKERS`) do both into Triton's disk cache, while the engine steps
with the torch kernels; the training process then loads the variants from that cache, one
per step (tens of milliseconds each), and the engine switches to them once all are loaded.
The one thing built in the training process is Triton's own driver module (``cuda_utils``, once
per machine, in the set-up thread below).

* A variant is identified by a key (:func:`_launch_key` plus device index and dtype) and
  made of the launches :func:`_launches` gathers for it: the :class:`.common.Launch` objects
  each kernel family declares once (``newton_schulz.blocks_launch``) and
  its launchers launch through. The launched kernels take no value specialisation
  (:func:`.common.kernel`), so a variant is fixed by what those declarations hold; the compile
  process warms each one up from them, and the engine's real launches find exactly those binaries.
* Triton hashes a kernel together with the helpers it calls, and the result depended on which
  kernels a process had launched before; importing the kernels hashes them all in one fixed
  order (:func:`.common.settle_hashes`), so the child and the training process agree.
* The child also builds each launch's host launcher (a C module Triton builds with the system
  compiler at a kernel's first launch), so that the training process only loads it.
* Triton's one-time set-up of a process (a hash of its own library, its driver module) runs
  in a short thread (:meth:`KernelRegistry.set_up`); no variant loads before it ends.
* :class:`Ledger`: the variants some process compiled into this Triton cache. A later run
  finds them there: no child, the same one-per-step loading from the first step on.
* Why a process and not a thread: Triton compiles in native code (LLVM, ptxas). A daemon
  thread still inside it when the interpreter shuts down is ended by ``pthread_exit``, whose
  forced unwinding through C++ frames aborts the process ("FATAL: exception not rethrown")
  after a run that trained and saved. A child process is simply terminated at exit
  (:meth:`KernelRegistry.close`, registered with ``atexit``); Triton writes its cache files
  atomically, so a killed compilation leaves nothing half-written. The child also dies with
  its parent (``PR_SET_PDEATHSIG``).

:func:`prepare` and :func:`wait_ready` ask the process-wide :data:`registry`.
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..functional import on_triton
from .common import Launch
from .newton_schulz import blocks_launch, blocks_options

log = logging.getLogger("deepmd.hybridmuon")

Key = tuple[Any, ...]

#: Compile processes at most, each taking a share of the missing variants (the torch path runs
#: until the last one is done); each process costs a CUDA context and an import of torch.
WORKERS = 4
#: The log line when variants compile in the background (benchmarks read it).
COMPILING_LOG = "Triton kernels: compiling %d variants in the background; torch kernels until then"
#: Niceness of the compile processes (the training process's threads come first).
NICE = 10


def _shares(keys: list[Key]) -> list[list[Key]]:
    """``keys`` dealt to at most :data:`WORKERS` processes (fewer on few cores)."""
    # Under torchrun every rank of the node compiles: its share of the cores, halved.
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    count = max(1, min(WORKERS, len(keys), (os.cpu_count() or 1) // max(1, ranks) // 2))
    return [keys[i::count] for i in range(count)]


class Ledger:
    """The variants some process compiled into one Triton cache: an empty file each.

    A file's name hashes the variant's launches (:func:`_launches`: kernels, argument types,
    constexprs and options) with everything else Triton's own cache key depends on that can
    differ between runs sharing the cache: this package's kernel sources, the Triton and CUDA
    versions, and the GPU's compute capability. Emptying Triton's cache (the default location
    of the ledger) empties the ledger too.

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

    def name(self, key: Key, capability: tuple[int, int] | None) -> str:
        """The ledger's file name of ``key`` on a GPU of compute ``capability``."""
        if self._fingerprint is None:
            self._fingerprint = _sources_fingerprint()
        described = [launch.describe() for launch in _launches(key)]
        return hashlib.sha256(repr((self._fingerprint, capability, described)).encode()).hexdigest()[:40]

    def _path(self, key: Key, device: torch.device) -> Path:
        capability = torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None
        return self.root / self.name(key, capability)

    def has(self, key: Key, device: torch.device) -> bool:
        """Whether ``key`` was compiled into this cache by some process."""
        return self._path(key, device).exists()

    def add(self, key: Key, device: torch.device) -> None:
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
    """The variants one :func:`prepare` asked for: ``is_set()`` once all are loaded here or failed.

    Checking is cheap: a non-blocking ``waitpid`` per running worker, and at most one
    variant loaded from the disk cache per call (see :meth:`KernelRegistry.poll`).
    """

    def __init__(self, registry: KernelRegistry, keys: frozenset[Key]) -> None:
        self.registry, self.keys = registry, keys

    def is_set(self) -> bool:
        """Whether every variant asked for is loaded (or failed); never blocks long."""
        self.registry.poll()
        return self.keys <= (self.registry.ready | self.registry.failed)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the variants are compiled and loaded, or ``timeout`` seconds; return :meth:`is_set`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for worker in self.registry.workers_for(self.keys):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(subprocess.TimeoutExpired):
                worker.process.wait(left)
        self.registry.poll(load=False)
        if self.registry.setup is not None:
            self.registry.setup.join()
        while self.registry.loadable & self.keys:
            self.registry.poll()  # loads one more
        return self.is_set()


@dataclass
class _Worker:
    process: subprocess.Popen
    keys: list[Key]
    device: torch.device


class KernelRegistry:
    """Which Triton variants this process has loaded, and the compilations under way.

    One object, used from the training thread only (no locks; one short-lived set-up thread,
    :meth:`set_up`). See the module
    docstring for the contract.

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
        self.ready: set[Key] = set()  # loaded in this process
        self.loadable: set[Key] = set()  # in the disk cache, not loaded here yet
        self.failed: set[Key] = set()
        self.workers: list[_Worker] = []
        self._closing_registered = False
        self.setup: threading.Thread | None = None

    def set_up(self, device: torch.device) -> None:
        """Start Triton's one-time set-up of a process off the training thread (once).

        The optimizer calls it when it is built (``engine.compilation.prepare_device``), so that the thread
        runs while deepmd prepares and runs the first forward and backward pass; the first
        :meth:`prepare` calls it otherwise.

        Triton's first cache lookup in a process hashes its own 400 MB library
        (``triton_key``, 0.4-0.7 s), its first launch imports its gluon package, sets up its
        CUDA driver module and asks ``ptxas`` its version: one step held for half a second in
        the training thread.
        A thread does it as soon as kernels are asked for, and no variant loads until it is
        done. The thread reads and hashes files, loads a module and runs subprocesses (no
        compiler runs inside this process: nothing native to cut short at exit), and is no
        daemon: an interpreter exiting in that second waits for it.
        """
        if self.setup is not None:
            return
        try:
            from triton.compiler import make_backend
            from triton.runtime.cache import triton_key
            from triton.runtime.driver import driver
        except ImportError:  # another Triton: its first load does this in the training thread
            return

        def set_up() -> None:
            # Best effort throughout: whatever fails here, the first load does in the training thread.
            # First the part that holds the interpreter's lock, while the training thread is
            # still in deepmd's set-up: Triton's launch binder imports its gluon package at
            # the first specialisation (0.12 s of Python, measured in a DPA-3 run's first load).
            with contextlib.suppress(Exception):
                import triton.experimental.gluon  # noqa: F401
            with contextlib.suppress(Exception):
                triton_key()  # reading and hashing release the lock
            with contextlib.suppress(Exception):
                torch.cuda.set_device(device)  # this thread's current device: the one the kernels run on
                make_backend(driver.active.get_current_target()).hash()  # runs ptxas and the C compiler

        self.setup = threading.Thread(target=set_up, name="deepmd-hybridmuon-triton-set-up")
        self.setup.start()

    def _may_load(self) -> bool:
        return self.setup is None or not self.setup.is_alive()

    # ----------------------------------------------------------------- asking

    def prepare(self, device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]]) -> _Pending | None:
        """Ask for the variants of ``paths`` ((use_gram, rows, cols) per launch).

        Returns an object whose ``is_set()`` becomes true once they are all loaded in this
        process: at once on the CPU (Triton's interpreter compiles nothing) or when
        ``background`` is off (they compile or load here before returning), else after the child has
        compiled the missing ones and one ``is_set()`` per variant has loaded it. ``None``
        when a variant failed to compile (the engine then keeps the torch path; the failure
        was logged once).
        """
        keys = {(*_launch_key(g, r, c), device.index, dtype) for g, r, c in paths}
        pending = _Pending(self, frozenset(keys))
        self.poll(load=False)
        if keys & self.failed:
            return None
        if device.type != "cuda":  # the interpreter does not compile
            self.ready |= keys
            return pending
        in_flight = {key for w in self.workers for key in w.keys}
        new = sorted(keys - self.ready - self.loadable - in_flight, key=repr)
        self.set_up(device)
        cached = [key for key in new if self.ledger.has(key, device)]
        missing = [key for key in new if key not in cached]
        self.loadable.update(cached)
        if not self.background:  # everything ready before returning, the cached variants too
            if self.setup is not None:
                self.setup.join()
            for key in cached:
                self._load(key)
        if missing and self.background:
            # A share whose process cannot start (an embedded interpreter, no memory) compiles
            # here, and only that share: the others are compiling already.
            unstarted = [key for part in _shares(missing) if not self._start(part, device) for key in part]
            if len(unstarted) < len(missing):
                log.info(
                    COMPILING_LOG,
                    len(missing) - len(unstarted),
                )
            missing = unstarted
        for key in missing:  # at once, in this process
            self._load(key, compile_here=True)
        if cached and not missing:
            log.info("Triton kernels: %d variants from the cache", len(cached))
        return None if keys & self.failed else pending

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait for the compilations under way and load their variants; ``False`` if some run after ``timeout`` s."""
        keys = frozenset(k for w in self.workers for k in w.keys) | frozenset(self.loadable)
        return _Pending(self, keys).wait(timeout)

    def workers_for(self, keys: frozenset[Key]) -> list[_Worker]:
        """The running workers compiling any of ``keys``."""
        return [w for w in self.workers if keys.intersection(w.keys)]

    # ---------------------------------------------------------------- workers

    def _start(self, keys: list[Key], device: torch.device) -> bool:
        """Start a worker for ``keys``; ``False`` if no child process can be started here."""
        if self.worker is None and not sys.executable:
            return False  # an embedded interpreter: compile in this process instead
        # The child imports this very package, wherever this process found it: first on its path, ahead of the
        # current directory, which `python -c` puts first (a checkout of another version there would win).
        root = str(Path(__file__).resolve().parents[2])
        code = f"import sys; sys.path.insert(0, {root!r}); from {__name__} import compile_worker; compile_worker()"
        command = self.worker or [sys.executable, "-c", code]
        env = dict(os.environ)
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

    def poll(self, load: bool = True) -> None:
        """Collect the workers that have exited; then, with ``load``, load one compiled variant here."""
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
                    self.ledger.add(key, worker.device)
                    self.loadable.add(key)
        if load and self.loadable and self._may_load():
            self._load(min(self.loadable, key=repr))

    def _load(self, key: Key, compile_here: bool = False) -> None:
        """Make ``key`` ready in this process: from the disk cache, or compiled here with ``compile_here``."""
        self.loadable.discard(key)
        try:
            _warm_up(key, _device(key))
        except Exception as err:  # a GPU or Triton without support for a kernel
            self._fail(key, str(err))
        else:
            self.ready.add(key)
            if compile_here:
                self.ledger.add(key, _device(key))

    def _fail(self, key: Key, error: str) -> None:
        self.failed.add(key)
        self.loadable.discard(key)
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
    with contextlib.suppress(OSError, AttributeError):
        os.nice(NICE)  # the training process's threads come first on a busy CPU
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
            _warm_up(key, device)
            status = "ok"
        except Exception as err:
            status = " ".join(f"{type(err).__name__}: {err}".split()) or "error"
        out.write(f"{i}\t{status}\n")
        out.flush()


#: The process-wide registry used by the engine.
registry = KernelRegistry()


def prepare(device: torch.device, dtype: torch.dtype, paths: list[tuple[bool, int, int]]) -> _Pending | None:
    """:meth:`KernelRegistry.prepare` of the process-wide :data:`registry`."""
    return registry.prepare(device, dtype, paths)


def wait_ready(timeout: float | None = None) -> bool:
    """:meth:`KernelRegistry.wait_ready` of the process-wide :data:`registry`."""
    return registry.wait_ready(timeout)


def set_up(device: torch.device) -> None:
    """:meth:`KernelRegistry.set_up` of the process-wide :data:`registry`."""
    registry.set_up(device)


def _device(key: Key) -> torch.device:
    """The CUDA device of a variant key (its index stands second to last, before the dtype)."""
    return torch.device("cuda") if key[-2] is None else torch.device("cuda", key[-2])


def _warm_up(key: Key, device: torch.device) -> None:
    for launch in _launches(key):
        launch.warm_up(device)


def _launch_key(use_gram: bool, rows: int, cols: int) -> tuple[Any, ...]:
    if on_triton(rows):
        return ("ns", blocks_options(rows, cols, use_gram))
    raise ValueError(f"no Triton kernel orthogonalises a {rows} x {cols} matrix (the torch path does)")


def _launches(key: Key) -> list[Launch]:
    """The launches of the variant ``key``: the objects through which the engine and the FSDP2 owners launch."""
    return [blocks_launch(key[-1], key[1])]
