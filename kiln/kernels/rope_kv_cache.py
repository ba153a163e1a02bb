"""Rotary embedding fused with the KV-cache write: the rotated key goes straight into the cache.

Created by the rope_kvcache pass. The op mutates the cache like `kiln::kv_cache_write` and returns
the same ordering token, which the attention takes as input, so the attention still runs after the
write it must see.
"""

import torch

from kiln.kernels.kv_cache import kv_cache_write_native
from kiln.kernels.rotary import rotary_embedding_native


@torch.library.custom_op("kiln::rotary_embedding_kv_cache_write", mutates_args=("kv_cache",))
def rotary_embedding_kv_cache_write(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by position, write the rotated key and the value into their slots;
    returns (rotated query, the write's ordering token)."""
    q, k = rotary_embedding_native(positions, query, key, cos_sin_cache, is_neox)
    return q, kv_cache_write_native(k, value, kv_cache, slot_mapping)


@rotary_embedding_kv_cache_write.register_fake
def _(positions, query, key, value, cos_sin_cache, is_neox, kv_cache, slot_mapping):
    return torch.empty_like(query), kv_cache.new_empty(0)
