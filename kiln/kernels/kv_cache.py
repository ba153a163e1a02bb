"""The KV-cache write: one combined [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.

K and V live in one tensor because Inductor copies the whole spanned region when a mutating op
receives two views of one buffer (TORCH_NOTES.md).
"""

import torch


def kv_cache_write_native(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    heads, dim = kv_cache.shape[-2:]
    slots = slot_mapping.long()
    if slots.is_cuda or (slots.numel() and int(slots.min()) < 0):  # on CPU, the mask only when there is padding
        valid = slots >= 0  # padded tokens carry slot -1 and write nothing
        slots, key, value = slots[valid], key[valid], value[valid]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slots, key.to(kv_cache.dtype))
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slots, value.to(kv_cache.dtype))
    return kv_cache.new_empty(0)


@torch.library.custom_op("kiln::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Write each token's K and V [T, kv_heads, head_dim] into its slot (block * block_size + offset).

    Returns an empty tensor that `kiln::attention` takes as input: an explicit data edge, so no
    graph pass can move the attention before the write it must see.
    """
    return kv_cache_write_native(key, value, kv_cache, slot_mapping)


@kv_cache_write.register_fake
def _(key, value, kv_cache, slot_mapping):
    return kv_cache.new_empty(0)
