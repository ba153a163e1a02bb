"""Compiling several pieces at once, in forked worker processes.

An AOTInductor compile is mostly single-threaded work done in turn: Inductor's Python codegen, then
g++ on the wrapper, then g++ on the kernels. With cores to spare the unique pieces compile side by
side. Workers are forked, so they start at once and inherit the traced graphs and fake tensors as
they are (nothing to serialize); each sends back only its library's bytes. Only CPU compiles fork: a
process that has initialized CUDA cannot be forked safely. `$KILN_COMPILE_WORKERS` sets the count
(1: everything in this process); the default is one per core this process may run on.
"""

import copy
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

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


def _run(index: int) -> tuple[int, CompiledLibrary, float]:
    job = _jobs[index]
    start = time.perf_counter()
    compiled = compile_library(copy.deepcopy(job.graph), job.inputs, job.fake_mode)
    return index, compiled, time.perf_counter() - start


_probe: threading.Thread | None = None


def probe_cpu_in_background() -> None:
    """Start Inductor's probe of which vector ISAs g++ can build (one test build per ISA: 18 s here
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


def compile_jobs(jobs: list[CompileJob]) -> Iterator[tuple[int, CompiledLibrary, float]]:
    """Compile every job; yields (job index, library, seconds) as each finishes, in any order."""
    global _jobs
    workers = worker_count(jobs)
    cpu_probe_done()  # never fork, or compile, while it runs
    _jobs = jobs
    try:
        if workers == 1:
            for i in range(len(jobs)):
                yield _run(i)
            return
        logger.info("compiling %d libraries in %d processes", len(jobs), workers)
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            for future in as_completed([pool.submit(_run, i) for i in range(len(jobs))]):
                yield future.result()
    finally:
        _jobs = []


def compile_cached(jobs: dict[str, CompileJob], cache: PieceCache | None,
                   describe: Callable[[str], str]) -> dict[str, CompiledLibrary]:
    """Each named job's library: from the piece cache where another compile built it, else compiled
    side by side and stored there. `describe(name)` names a library in the logs."""
    built: dict[str, CompiledLibrary] = {}
    todo = []
    for name, job in jobs.items():
        key = piece_cache_key(job.graph, job.inputs) if cache is not None else None
        hit = cache.get(key) if key is not None else None
        if hit is not None:
            built[name] = hit
            logger.info("reused %s from the piece cache", describe(name))
        else:
            todo.append((name, key))
    for i, compiled, seconds in compile_jobs([jobs[name] for name, _ in todo]):
        name, key = todo[i]
        built[name] = compiled
        if key is not None:
            cache.put(key, compiled)
        logger.info("compiled %s in %.2fs", describe(name), seconds)
    return built
