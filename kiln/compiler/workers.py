"""Compiling several pieces at once, in forked worker processes.

An AOTInductor compile is mostly single-threaded work done in turn: Inductor's Python codegen, then
g++ on the wrapper, then g++ on the kernels. With cores to spare the unique pieces compile side by
side. Workers are forked, so they start at once and inherit the traced graphs and fake tensors as
they are (nothing to serialize); each sends back only its library's bytes. Only CPU compiles fork: a
process that has initialized CUDA cannot be forked safely. `$KILN_COMPILE_WORKERS` sets the count
(1: everything in this process); the default is one per core this process may run on.

A fork copies every module as it stands, in whatever state another thread has it: a module another
thread is importing is copied half made, with its import lock held by a thread the child lacks (the
child hangs importing it), and an Inductor config entry that `unittest.mock` is restoring is copied
hidden (the child reads `torch._inductor.config.cpp.cxx does not exist`). So the fork waits until no
other thread is mid-import or mid-restore (`_before_fork`), each child shows again an entry that
another thread hid after that check (`_unhide_config`: fork handlers of other libraries run after
kiln's and may let other threads run), checks what it inherited before it compiles
(`_inherited_damage`), and a job that fails in a worker, for that or any reason, is compiled again
in this process before the compile fails, naming the piece.
"""

import _imp
import copy
import ctypes
import importlib._bootstrap
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field

import torch
from torch import fx

from kiln.compiler.aoti import CompiledLibrary, compile_library
from kiln.compiler.piece_cache import PieceCache, piece_cache_key
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

ENV = "KILN_COMPILE_WORKERS"


@dataclass
class CompileJob:
    """One library to build: a piece's graph for one set of example inputs (one size)."""

    graph: fx.GraphModule
    inputs: list
    fake_mode: object


_jobs: list[CompileJob] = []
"""The jobs of the running `compile_jobs`, read by the forked workers (inherited, not sent)."""

SETTLE_SECONDS = 10.0
"""How long one `compile_jobs` waits, over all its forks, for other threads to finish an import or a
config restore. Past it the fork goes ahead; a child that inherited the damage compiles nothing and
its jobs are compiled in this process instead."""


class UnsafeFork(RuntimeError):
    """A worker refused its job: it was forked while another thread had something half done."""


def _run(index: int) -> tuple[int, CompiledLibrary, float]:
    if _worker and _inheritance is not None:
        raise UnsafeFork(f"this worker was forked while {_inheritance}")
    job = _jobs[index]
    start = time.perf_counter()
    compiled = compile_library(copy.deepcopy(job.graph), job.inputs, job.fake_mode)
    return index, compiled, time.perf_counter() - start


def _config_modules() -> list:
    """torch's config modules loaded so far (`torch.utils._config_module`: Inductor's, Dynamo's, ...)."""
    config_module = sys.modules.get("torch.utils._config_module")
    kind = getattr(config_module, "ConfigModule", None)
    return [] if kind is None else [m for m in list(sys.modules.values()) if isinstance(m, kind)]


def _inherited_damage(me: int) -> str | None:
    """What a thread other than `me` has half done that a fork would copy as it stands, or None.

    Python's import system and torch's config modules have no fork handlers: a module's import lock
    records its owner (`_ModuleLock.owner`, None when free, CPython 3.11-3.13), and a config entry
    `unittest.mock` is restoring is hidden from every thread between its delattr and its setattr
    (`_ConfigEntry.hide`: torch's config values are per thread, the hiding is not)."""
    for ref in list(getattr(importlib._bootstrap, "_module_locks", {}).values()):
        lock = ref() if callable(ref) else None
        owner = getattr(lock, "owner", None)
        if owner is not None and owner != me:
            return f"thread {_thread_names.get(owner, owner)!r} was importing {getattr(lock, 'name', '?')}"
    for module in _config_modules():
        for name, entry in getattr(module, "_config", {}).items():
            if getattr(entry, "hide", False):
                return f"{module.__name__}.{name} was hidden mid-restore (unittest.mock's delattr before setattr)"
    return None


_forker: int | None = None
"""The thread of the `compile_jobs` now forking its workers: the fork handlers act on its forks only."""
_worker = False
"""True in a process forked by `compile_jobs`."""
_thread_names: dict[int, str] = {}
"""The parent's threads when it forked, by id: a child has only its own thread, and names the others."""
_settle_by = 0.0
_holding_import_lock = False
_settled = False
"""Whether the last fork followed a check that found nothing half done."""
_inheritance: str | None = None
"""In a worker: what `_inherited_damage` found as it began, before any code of its own ran."""


def _before_fork() -> None:
    """Wait (until `_settle_by`) for other threads to finish what a fork must not copy half done, then
    hold the import lock until the fork: no thread starts an import meanwhile. Beside other threads,
    each check follows a fresh hold of the GIL (`time.sleep(0)`), so none is handed it between the
    check and the fork (a thread waiting for the GIL asks for it only after a switch interval, 5 ms)."""
    global _holding_import_lock, _settled
    if threading.get_ident() != _forker:
        return
    me = threading.get_ident()
    while True:
        if threading.active_count() > 1:
            time.sleep(0)
        _imp.acquire_lock()
        _settled = _inherited_damage(me) is None
        if _settled or time.monotonic() >= _settle_by:
            break
        _imp.release_lock()
        time.sleep(0.002)
    _holding_import_lock = True


def _after_fork_in_parent() -> None:
    global _holding_import_lock
    if _holding_import_lock:
        _holding_import_lock = False
        _imp.release_lock()


def _after_fork_in_child() -> None:
    """A worker: note what it inherited half done, before it runs any code of its own (which may
    import), then drop the import lock its parent held through the fork (Python hands the child the
    parent's extra hold)."""
    global _holding_import_lock, _forker, _inheritance, _worker
    _worker = _forker is not None and _forker == threading.get_ident()  # the forking thread is the child's one
    if _worker and _settled:
        _unhide_config()
    _inheritance = _inherited_damage(threading.get_ident()) if _worker else None
    if _holding_import_lock:
        _holding_import_lock = False
        if _imp.lock_held():
            _imp.release_lock()
    _forker = None


def _unhide_config() -> None:
    """In a worker whose parent found no config entry hidden, show again any hidden since: another
    thread began a `unittest.mock` restore after the check (a later fork handler let it run), which
    no thread will finish here. Config values are per thread (context variables); the hiding alone is
    not, so every entry reads as the forking thread saw it when it checked."""
    for module in _config_modules():
        for entry in getattr(module, "_config", {}).values():
            if getattr(entry, "hide", False):
                entry.hide = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                        after_in_child=_after_fork_in_child)


_probe: threading.Thread | None = None


def probe_cpu_in_background() -> None:
    """Start Inductor's probe of which vector ISAs g++ can build (one test build per ISA, seconds each
    with an empty Inductor cache), so it runs while the model is traced; Inductor keeps the answer
    in memory, and workers forked after it inherit it instead of each probing again.

    The thread must import nothing: a module two threads import at once can reach one of them half
    initialized (Python accepts a concurrent circular import), and the trace imports much of
    Inductor meanwhile. So what the probe imports is imported here, first."""
    global _probe
    try:
        import torch._inductor.codecache  # noqa: F401
        import torch._inductor.cpp_builder  # noqa: F401
        import torch.utils.cpp_extension  # noqa: F401
        from torch._inductor.cpu_vec_isa import valid_vec_isa_list
    except ImportError:  # a torch without it: each compile probes for itself
        return
    if _probe is None:
        _probe = threading.Thread(target=valid_vec_isa_list, name="kiln-isa-probe", daemon=True)
        _probe.start()


def cpu_probe_done() -> None:
    """Wait for the probe: its test builds take a core, so nothing timed (the GEMM choices) and no
    fork may run beside it."""
    if _probe is not None:
        _probe.join()


def worker_count(jobs: list[CompileJob]) -> int:
    """How many processes compile `jobs`: `$KILN_COMPILE_WORKERS`, else the usable cores; 1 for
    CUDA compiles (no fork after CUDA) and never more than there are jobs."""
    text = os.environ.get(ENV, "").strip()
    if text:
        if not text.isdigit() or int(text) < 1:
            raise KilnError(f"${ENV}={text!r}: expected a whole number of processes, 1 or more")
        wanted = int(text)
    else:
        wanted = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    on_cpu = all(v.device.type == "cpu" for job in jobs for v in job.inputs if isinstance(v, torch.Tensor))
    if not on_cpu or torch.cuda.is_initialized() or "fork" not in multiprocessing.get_all_start_methods():
        return 1
    return max(1, min(wanted, len(jobs)))


def compile_jobs(jobs: list[CompileJob], names: Sequence[str] | None = None
                 ) -> Iterator[tuple[int, CompiledLibrary, float]]:
    """Compile every job; yields (job index, library, seconds) as each finishes, in any order.
    `names[i]` names job i in logs and errors. A job that fails in a worker is compiled once more in
    this process; a job that fails there raises KilnError naming it."""
    global _jobs
    workers = worker_count(jobs)
    cpu_probe_done()  # never fork, or compile, while it runs
    _jobs = jobs

    def name(i: int) -> str:
        return names[i] if names is not None else f"library {i + 1} of {len(jobs)}"

    try:
        if workers == 1:
            for i in range(len(jobs)):
                yield _run_here(i, name(i))
            return
        logger.info("compiling %d libraries in %d processes", len(jobs), workers)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"), initializer=_die_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            try:
                futures = _submit_all(pool, len(jobs))
                for future in as_completed(futures):
                    i = futures[future]
                    error = future.exception()
                    yield future.result() if error is None else _retry_here(i, name(i), error)
            finally:
                pool.shutdown(wait=True, cancel_futures=True)  # a failure leaves nothing queued behind it
    finally:
        _jobs = []


def _submit_all(pool: ProcessPoolExecutor, count: int) -> dict[Future, int]:
    """Submit every job; a fork pool forks all its workers on the first submit, from this thread,
    so the fork handlers are armed for this thread only, and only meanwhile."""
    global _forker, _settle_by, _thread_names
    _thread_names = {t.ident: t.name for t in threading.enumerate()}
    _forker, _settle_by = threading.get_ident(), time.monotonic() + SETTLE_SECONDS
    started = time.perf_counter()
    try:
        futures = {pool.submit(_run, i): i for i in range(count)}
    finally:
        _forker = None
    seconds = time.perf_counter() - started
    if seconds > 0.5:
        logger.info("forking the compile workers waited %.2fs for other threads to finish an import or a config "
                    "restore", seconds)
    return futures


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _die_with_parent(parent: int) -> None:
    """A worker's first act: have Linux SIGKILL it when its parent dies, however the parent dies (a
    SIGKILL cannot be caught, and a worker left behind holds its memory, blocked on a pipe nobody reads).
    The signal follows the thread that forked it, which waits for the workers before it returns."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("a compile worker cannot ask to die with its parent: %s", os.strerror(ctypes.get_errno()))
    if os.getppid() != parent:  # the parent died before the request took
        os._exit(1)


def _run_here(index: int, name: str) -> tuple[int, CompiledLibrary, float]:
    try:
        return _run(index)
    except Exception as e:
        raise KilnError(f"compiling {name} failed: {_said(e)}") from e


def _said(error: BaseException) -> str:
    return str(error) if isinstance(error, KilnError) else f"{type(error).__name__}: {error}"


def _retry_here(index: int, name: str, error: BaseException) -> tuple[int, CompiledLibrary, float]:
    """Compile a job whose worker failed once more, in this process: a worker may have inherited a
    state no thread here still has (or died of something else); a second failure is the piece's own."""
    if isinstance(error, UnsafeFork):
        logger.warning("compiling %s in this process: %s", name, error)
    else:
        logger.warning("compiling %s failed in a worker process (%s); compiling it again in this process",
                       name, _said(error))
    try:
        return _run(index)
    except Exception as e:
        raise KilnError(f"compiling {name} failed twice, in a worker process ({_said(error)}) and again in this "
                        f"process: {_said(e)}. It fails without a fork too, so the cause is the piece's graph or "
                        "the C++ toolchain: see the traceback above") from e


@dataclass
class NamedJobs:
    """Named libraries that compile beside another compile's jobs (`compile_pieces` takes them): the
    libraries an artifact ships besides its pieces need nothing from the pieces, and pieces alone leave
    cores idle at their tail (three unique pieces on two cores). Each comes from the piece cache where
    another compile built it; what is compiled is stored there."""

    jobs: dict[str, CompileJob]
    cache: PieceCache | None
    describe: Callable[[str], str]
    """Names a library in the logs."""
    built: dict[str, CompiledLibrary] = field(default_factory=dict)

    def todo(self) -> list[tuple[str, str | None]]:
        """Take what the piece cache holds; the (name, piece-cache key) of each job left to compile."""
        left = []
        for name, job in self.jobs.items():
            key = piece_cache_key(job.graph, job.inputs) if self.cache is not None else None
            hit = self.cache.get(key) if key is not None else None
            if hit is not None:
                self.built[name] = hit
                logger.info("reused %s from the piece cache", self.describe(name))
            elif name not in self.built:
                left.append((name, key))
        return left

    def done(self, name: str, key: str | None, compiled: CompiledLibrary, seconds: float) -> None:
        self.built[name] = compiled
        if key is not None:
            self.cache.put(key, compiled)
        logger.info("compiled %s in %.2fs", self.describe(name), seconds)


def compile_cached(jobs: dict[str, CompileJob], cache: PieceCache | None,
                   describe: Callable[[str], str]) -> dict[str, CompiledLibrary]:
    """Each named job's library: from the piece cache where another compile built it, else compiled
    side by side and stored there. `describe(name)` names a library in the logs."""
    named = NamedJobs(jobs, cache, describe)
    todo = named.todo()
    for i, compiled, seconds in compile_jobs([jobs[name] for name, _ in todo], [describe(name) for name, _ in todo]):
        named.done(*todo[i], compiled, seconds)
    return named.built
