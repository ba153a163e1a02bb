"""CPU threads for kiln's kernels: the machine's physical cores unless told otherwise. A core's second
hardware thread shares its vector units, so GEMMs gain nothing from it, and OpenMP's barriers wait
on the slowest thread."""

import logging
import os
from pathlib import Path

from kiln.errors import KilnError

logger = logging.getLogger(__name__)


def physical_cores() -> int:
    """Distinct physical cores among the CPUs this process may run on (Linux sysfs; elsewhere, or
    where sysfs is hidden, the CPU count)."""
    cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add((topology / "physical_package_id").read_text().strip() + ":" +
                      (topology / "core_id").read_text().strip())
        except OSError:
            return len(cpus)
    return len(cores) or len(cpus)


def use_threads(threads: int | None = None) -> int:
    """Run torch's CPU kernels on `threads` threads, else on the physical cores; returns how many."""
    import torch

    if threads is not None and threads < 1:
        raise KilnError(f"threads must be at least 1, got {threads}")
    count = threads or physical_cores()
    torch.set_num_threads(count)
    logger.info(describe(count, threads is not None))
    return count


def describe(count: int, asked: bool) -> str:
    """The line a start-up shows about its threads."""
    why = "as asked" if asked else "the machine's physical cores; --threads N to change"
    return f"{count} CPU threads ({why})"
