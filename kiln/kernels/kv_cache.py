"""The KV-cache write: one combined [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer.

K and V live in one tensor because Inductor copies the whole spanned region when a mutating op
receives two views of one buffer (measured on torch 2.13).

A cache's last slot is scratch: `allocate_kv_caches` adds a block no sequence is given, so a padded
token (slot -1) may write there, as the scatter form below does.
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


def kv_cache_write_scatter(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """The write as one `index_put_` on the cache, the form Inductor generates into the piece's own
    code: on CPU an AOTInductor piece spends far longer calling the op than on the scatter.
    Slot -1 indexes the cache's last slot, the scratch one: padded tokens write there, unmasked."""
    slots = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, head_dim]
    written = torch.ops.aten.index_put_.default(slots, [None, slot_mapping], torch.stack([key, value]).to(slots.dtype))
    return written.new_empty(0)  # the ordering token, a data edge from the write


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
