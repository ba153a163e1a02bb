"""Packed weights moved onto transparent huge pages by a background thread, while the CPUs idle.

A batch-1 decode step reads each packed weight once, straight from memory: on 4 KB pages that is a
TLB miss every 4 KB, and on 2 MB pages the step is measurably shorter (docs/cpu.md).

Why not at allocation: on a VM whose balloon reports free memory to the host (Firecracker's, as on
kiln's CI machines), a fresh 2 MB page is memory the host must fault in again, several times slower
than 4 KB pages, which would lengthen a fresh process's start to ready. So `empty` maps a tensor on a 2 MB boundary with ordinary pages, and once the runtime is up
(`start`) a thread at Linux's idle scheduling class collapses each written one into huge pages
(`madvise(MADV_COLLAPSE)`, Linux 6.1+) when no other thread wants a CPU. The weights stay where they
are, readable throughout. Under a steady load the thread barely runs; a burst that arrives mid-collapse may wait once for one 2 MB page's few milliseconds in
the kernel. Where the kernel cannot collapse, the advice alone lets its khugepaged do it, slowly.
"""

import ctypes
import functools
import logging
import math
import mmap
import os
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
"""The x86-64 transparent huge page: 2 MB. A tensor under this size is an ordinary allocation."""

MADV_COLLAPSE = 25
"""Linux's synchronous collapse into huge pages (not among Python 3.11's mmap constants)."""

_mappings: dict[int, tuple[weakref.ref, int]] = {}
"""The start of each live tensor `empty` mapped, not yet queued: (its mapping, the length of its whole
huge pages)."""
_pending: list[tuple[weakref.ref, int, int]] = []
"""(the mapping, the start and length of its whole huge pages) for each tensor queued, not yet collapsed."""
_lock = threading.Condition()
_thread: threading.Thread | None = None
_in_flight = 0
_collapsed = 0


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized contiguous CPU tensor starting on a 2 MB boundary, on ordinary pages until,
    once written, it is handed to `collapse_later`; freed, with its mapping, when the last view of it
    goes. Where Linux's huge pages are not to be had, `torch.empty`."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # private: a shared anonymous mapping is shared memory, which gets no huge pages here
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
    skip = -buffer.data_ptr() % HUGE_PAGE
    start = buffer.data_ptr() + skip

    def forget(ref: weakref.ref) -> None:
        with _lock:
            if _mappings.get(start, (None,))[0] is ref:
                del _mappings[start]

    with _lock:
        _mappings[start] = (weakref.ref(mapping, forget), nbytes // HUGE_PAGE * HUGE_PAGE)
    return buffer[skip:skip + nbytes].view(dtype).view(shape)


def collapse_later(tensor: torch.Tensor) -> None:
    """Queue a tensor from `empty`, now written, for the background thread (`start`): advised
    before it is written, its pages would be faulted in huge, at the cost this module avoids. A
    tensor `empty` did not map is left as it is."""
    with _lock:
        entry = _mappings.pop(tensor.data_ptr(), None)
        if entry is not None:
            _pending.append((entry[0], tensor.data_ptr(), entry[1]))
            _lock.notify_all()


def collapse_pending() -> int:
    """Collapse every live tensor queued (`collapse_later`) into huge pages, here and now;
    returns the bytes collapsed. Where the kernel cannot, advises them for khugepaged instead."""
    global _collapsed, _in_flight
    done = 0
    while True:
        with _lock:
            if not _pending:
                return done
            ref, start, length = _pending.pop(0)
            _in_flight += 1
        collapsed = 0
        try:
            mapping = ref()  # held while it is collapsed: the memory cannot be unmapped meanwhile
            if mapping is not None:
                _libc().madvise(start, length, mmap.MADV_HUGEPAGE)
                collapsed = length if _libc().madvise(start, length, MADV_COLLAPSE) == 0 else 0
            del mapping
        finally:
            with _lock:
                _in_flight -= 1
                _collapsed += collapsed
                _lock.notify_all()
        done += collapsed


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)  # a ctypes call lets go of the GIL: a collapse holds up no Python thread
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def start() -> None:
    """Start the background thread that collapses the queued tensors, those queued so far and
    later ones (once per process). It runs at Linux's idle scheduling class: only on a CPU nothing else
    wants, so serving never waits on it."""
    global _thread
    with _lock:
        if _thread is not None or not hasattr(os, "SCHED_IDLE"):
            return
        _thread = threading.Thread(target=_run, name="kiln-huge-pages", daemon=True)
        _thread.start()


def _run() -> None:
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
    except OSError:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    while True:
        began = time.perf_counter()
        done = collapse_pending()
        if done:
            logger.info("moved %.2f GB of packed weights onto huge pages in the background in %.2fs", done / 1e9,
                        time.perf_counter() - began)
        with _lock:
            _lock.wait_for(lambda: _pending)


def wait(timeout: float) -> bool:
    """Wait up to `timeout` seconds for the background thread to collapse what is pending (a
    benchmark's steady state); True when nothing is left."""
    with _lock:
        if _thread is None:
            return not _pending
        return _lock.wait_for(lambda: not _pending and not _in_flight, timeout)


def collapsed_bytes() -> int:
    """Bytes collapsed into huge pages in this process so far."""
    return _collapsed
