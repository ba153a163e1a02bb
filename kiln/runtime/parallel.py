"""Tensor-parallel process groups from `torchrun`'s environment: gloo on CPU, NCCL on CUDA.

`torchrun --nproc-per-node N` sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; a
process started without them is a world of one and joins no group.
"""

import logging
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from kiln.config import ParallelConfig
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_from_env(device: str = "cpu", timeout_s: float = 300.0) -> ParallelConfig:
    """Join the process group the environment describes (once per process) and say where this rank
    sits. Without torchrun's variables: rank 0 of 1, no group."""
    if "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) == 1:
        return ParallelConfig()
    missing = [v for v in TORCHRUN_VARIABLES if v not in os.environ]
    if missing:
        raise KilnError(f"WORLD_SIZE is set but {', '.join(missing)} is not: start kiln with `torchrun "
                        "--nproc-per-node N ...`, which sets them all")
    if not dist.is_initialized():
        backend = backend_for(device)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
        logger.info("rank %d of %d joined a %s group", dist.get_rank(), dist.get_world_size(), backend)
    # "" names the default group: graphs traced here and by a single-process `kiln compile` agree
    return ParallelConfig(dist.get_rank(), dist.get_world_size(), "")
