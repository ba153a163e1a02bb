"""The KV-cache write: one combined [2, num_blocks, block_size, kv_heads, row] tensor per layer.

K and V live in one tensor because Inductor copies the whole spanned region when a mutating op
receives two views of one buffer (measured on torch 2.13).

A row is a token's head: head_dim values in the model's dtype, or in an int8 cache head_dim int8 codes
followed by their fp32 scale's four bytes (the head's largest magnitude / 127, chosen per token as it is
written: llama.cpp's Q8_0 with one block per head), so one tensor per layer still holds everything.

A cache's last slot is scratch: `allocate_kv_caches` adds a block no sequence is given, so a padded
token (slot -1) may write there, as the scatter form below does.
"""

import torch

SCALE_BYTES = 4
"""Bytes after an int8 row's codes: its scale, an fp32."""


def row_size(head_dim: int, dtype: torch.dtype) -> int:
    """A cache row's last dimension for a cache of `dtype`: head_dim, plus the scale's bytes in int8."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., D] -> [..., D + 4] int8: each row's codes round(x / scale) in [-127, 127], then its scale's bytes.
    An all-zero row gets scale 0 and codes 0."""
    amax = x.abs().amax(-1, keepdim=True).float()
    codes = torch.round(x.float() * (127 / amax.clamp_min(1e-30))).clamp(-127, 127).to(torch.int8)
    return torch.cat([codes, (amax / 127).view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] int8 rows -> [..., D] values in `dtype` (needs D % 4 == 0, as every cache has)."""
    d = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :d].to(torch.float32) * rows[..., d:].view(torch.float32)).to(dtype)


def as_cache_rows(x: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
    """Key or value rows [..., D] as `kv_cache` stores them."""
    return quantize_rows(x) if kv_cache.dtype == torch.int8 else x.to(kv_cache.dtype)


def kv_cache_write_native(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    heads, row = kv_cache.shape[-2:]
    slots = slot_mapping.long()
    if slots.is_cuda or (slots.numel() and int(slots.min()) < 0):  # on CPU, the mask only when there is padding
        valid = slots >= 0  # padded tokens carry slot -1 and write nothing
        slots, key, value = slots[valid], key[valid], value[valid]
    kv_cache[0].view(-1, heads, row).index_copy_(0, slots, as_cache_rows(key, kv_cache))
    kv_cache[1].view(-1, heads, row).index_copy_(0, slots, as_cache_rows(value, kv_cache))
    return kv_cache.new_empty(0)


def kv_cache_write_scatter(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """The write as one `index_put_` on the cache, the form Inductor generates into the piece's own
    code: on CPU an AOTInductor piece spends far longer calling the op than on the scatter.
    Slot -1 indexes the cache's last slot, the scratch one: padded tokens write there, unmasked."""
    slots = kv_cache.flatten(1, 2)  # [2, num_blocks * block_size, kv_heads, row]
    written = torch.ops.aten.index_put_.default(slots, [None, slot_mapping], as_cache_rows(torch.stack([key, value]),
                                                                                           kv_cache))
    return written.new_empty(0)  # the ordering token, a data edge from the write


@torch.library.custom_op("kiln::kv_cache_write", mutates_args=("kv_cache",))
def kv_cache_write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """Write each token's K and V [T, kv_heads, head_dim] into its slot (block * block_size + offset),
    quantized where the cache is int8.

    Returns an empty tensor that `kiln::attention` takes as input: an explicit data edge, so no
    graph pass can move the attention before the write it must see.
    """
    return kv_cache_write_native(key, value, kv_cache, slot_mapping)


@kv_cache_write.register_fake
def _(key, value, kv_cache, slot_mapping):
    return kv_cache.new_empty(0)
