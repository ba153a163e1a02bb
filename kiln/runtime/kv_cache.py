"""The paged KV cache: per-layer [2, num_blocks, block_size, kv_heads, head_dim] tensors and the
allocator that hands out their blocks."""

import torch

from kiln.errors import KilnError
from kiln.models.config import ModelConfig


class BlockAllocator:
    """A free list of block ids. Freed blocks are reused last-freed-first (warm in cache)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KilnError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free")
        blocks = self._free[-n:][::-1] if n else []
        del self._free[len(self._free) - n :]
        return blocks

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize * cfg.num_layers


def num_kv_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int, max_tokens: int) -> int:
    """Blocks that fit the memory budget, capped at what `max_tokens` resident tokens can use."""
    by_memory = memory_bytes // bytes_per_block(cfg, block_size, dtype)
    by_need = -(-max_tokens // block_size)
    return int(min(by_memory, by_need))


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    # Zeroed, not empty: attention multiplies masked-out slots by a zero probability, and 0 * NaN is NaN.
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]
