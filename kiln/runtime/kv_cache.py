"""The paged KV cache: per-layer [2, num_blocks, block_size, kv_heads, row] tensors (a row: head_dim values,
or in an int8 cache head_dim codes and their scale, `kiln.kernels.kv_cache`) and the allocator that hands out
their blocks."""

import hashlib
import math
import mmap
import sys
from array import array
from collections import OrderedDict

import torch

from kiln.errors import KilnError
from kiln.kernels.kv_cache import row_size
from kiln.models.config import ModelConfig


class BlockAllocator:
    """Hands out KV blocks and, with prefix caching, remembers full blocks by the hash of their
    tokens (and every token before them), so a later prompt with the same prefix reuses their K/V.

    A block is in use while any sequence holds it (reference counted). A freed block keeps its
    contents and hash until it is handed out again; the least recently freed goes first.
    """

    def __init__(self, num_blocks: int, prefix_caching: bool = False):
        self.num_blocks, self.prefix_caching = num_blocks, prefix_caching
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}
        self._by_hash: dict[bytes, int] = {}
        self.hits = self.queries = 0
        """Blocks found in the cache, blocks looked up: the prefix-cache hit rate."""

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KilnError(f"KV cache out of blocks: asked for {n}, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            h = self._hash_of.pop(block, None)
            if h is not None:  # evicted: its contents are about to be overwritten
                del self._by_hash[h]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        for block in reversed(blocks):  # a sequence's last blocks are the least likely to be shared
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None

    def register(self, block: int, block_hash: bytes) -> None:
        """`block` is full and its tokens hash to `block_hash`: later prompts may share it."""
        if self.prefix_caching and block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, now held by the caller."""
        if not self.prefix_caching:
            return []
        blocks = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            blocks.append(block)
        self.queries += len(hashes)
        self.hits += len(blocks)
        return blocks


def block_hashes(token_ids: list[int], block_size: int, start: int = 0, parent: bytes | None = None) -> list[bytes]:
    """sha256 of the full blocks of `token_ids` from block `start` on, each over the hash of the block
    before it (`parent`: block start - 1's) and its token ids as little-endian int64s, so equal hashes
    mean equal prefixes. Collision-resistant: with Python's 64-bit `hash()` a collision, found or
    forged, would let one request read another's KV blocks (vLLM moved to sha256 for this)."""
    hashes = []
    for i in range(start, len(token_ids) // block_size):
        block = array("q", token_ids[i * block_size : (i + 1) * block_size])
        if sys.byteorder != "little":
            block.byteswap()
        parent = hashlib.sha256((parent or b"") + block.tobytes()).digest()
        hashes.append(parent)
    return hashes


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None) -> int:
    """A block's bytes over all layers in a cache of `dtype`; `num_kv_heads`: the heads this rank keeps (default:
    all)."""
    row = row_size(cfg.head_dim, dtype) * dtype.itemsize
    return 2 * block_size * (num_kv_heads or cfg.num_kv_heads) * row * cfg.num_layers


def num_kv_blocks(cfg: ModelConfig, block_size: int, dtype: torch.dtype, memory_bytes: int, max_tokens: int,
                  num_kv_heads: int | None = None) -> int:
    """Blocks that fit the memory budget, capped at what `max_tokens` resident tokens can use."""
    by_memory = memory_bytes // bytes_per_block(cfg, block_size, dtype, num_kv_heads)
    by_need = -(-max_tokens // block_size)
    return int(min(by_memory, by_need))


def allocate_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device = "cpu",
    num_kv_heads: int | None = None,
) -> list[torch.Tensor]:
    """Each layer's cache: `num_blocks` blocks for the allocator to hand out, and one more at the end
    that it never does, whose last slot padded tokens (slot -1) may write (`kiln.kernels.kv_cache`)."""
    # Zeroed, not empty: attention multiplies masked-out slots by a zero probability, and 0 * NaN is NaN.
    shape = (2, num_blocks + 1, block_size, num_kv_heads or cfg.num_kv_heads, row_size(cfg.head_dim, dtype))
    if torch.device(device).type == "cpu":
        return [_zeroed_lazily(shape, dtype) for _ in range(cfg.num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


def _zeroed_lazily(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor on an anonymous memory mapping: zero by the OS's guarantee, its pages touched only
    when a block is first written, so start-up does not wait on writing a gigabyte of zeros."""
    mapping = mmap.mmap(-1, math.prod(shape) * dtype.itemsize)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
