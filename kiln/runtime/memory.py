"""How much memory a model needs and the machine has: the check before loading (fail with the
numbers and the options that would fit, not an OOM kill) and the KV cache sized from what is left."""

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.units import format_size
from kiln.errors import KilnError
from kiln.models.config import ModelConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30


def available_bytes(device: torch.device) -> int:
    """Memory this process can still take: free GPU memory, or on the CPU the kernel's MemAvailable
    (reclaimable page cache counts) bounded by the cgroup's limit when there is one."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:  # not Linux
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return max(available, 0)


def activation_bytes(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """A generous bound on what one step allocates besides weights and KV cache: the widest hidden
    states of a full token budget (fp32) and the logits of every running sequence, twice over."""
    width = 4 * cfg.hidden_size + 3 * cfg.intermediate_size + cfg.num_heads * cfg.head_dim
    return 2 * 4 * (max_num_batched_tokens * width + max_num_seqs * cfg.vocab_size)


@dataclass
class MemoryPlan:
    """What a model will take, checked against what the machine has before anything is loaded."""

    weights: int
    """Bytes of this rank's weights in the dtype they run in."""
    activations: int
    kv_min: int
    """The smallest KV cache worth starting with (one sequence, or one step's token budget), or the one
    asked for."""
    available: int
    utilization: float
    """The share of the memory left after the weights that the KV cache and activations may take
    (the engine sizes its KV cache by the same rule once the weights are in)."""
    kv_given: bool = False
    """The KV cache's size was asked for: it is taken as given, and `utilization` does not apply."""

    @property
    def needed(self) -> int:
        """Bytes of memory available that this plan needs."""
        if self.kv_given:
            return self.weights + self.activations + self.kv_min
        return self.weights + -(-(self.activations + self.kv_min) // self.utilization)

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    @property
    def kv_room(self) -> int:
        """The most KV-cache bytes that fit beside the weights and activations, by this plan's rule."""
        if self.kv_given:
            return self.available - self.weights - self.activations
        return int((self.available - self.weights) * self.utilization) - self.activations

    def check(self, dtype_name: str, options: list[str]) -> None:
        """KilnError with the numbers and `options` (each one a change that would fit), if it does not fit."""
        if self.fits:
            return
        kv = "the KV cache asked for" if self.kv_given else "a minimal KV cache"
        at = "" if self.kv_given else f", at memory utilization {self.utilization:g}"
        raise KilnError(
            f"the model does not fit: {format_size(self.weights)} of weights in {dtype_name} + {format_size(self.kv_min)} "
            f"for {kv} + {format_size(self.activations)} for activations{at}, but {format_size(self.available)} "
            "is available. Options: " + "; ".join(options)
        )
