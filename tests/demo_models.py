"""The demo models the suite shares, trained side by side: a process per core, each on one thread (a
demo's training barely uses a second core, and gives the same weights bit for bit on one thread)."""

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _write(arch: str, out: str) -> str:
    import torch

    from kiln.models.demo import write_demo_model

    torch.set_num_threads(1)
    return str(write_demo_model(out, arch=arch))


def write_demo_models(targets: dict[str, Path]) -> dict[str, Path]:
    """{arch: the directory written} for each {arch: directory to write}, trained in parallel (spawned
    processes: forking a process whose OpenMP threads have run can hang the child)."""
    workers = max(1, min(len(targets), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = pool.map(_write, list(targets), [str(p) for p in targets.values()])
        return {arch: Path(path) for arch, path in zip(targets, done)}
