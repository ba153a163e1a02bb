"""The KV-cache write, one program per token (`kiln::kv_cache_write` on CUDA), for graphs where the
RoPE + KV-write fusion is off. The native op selects the tokens with a slot >= 0 by boolean mask,
which copies the count to the host: not allowed while a CUDA graph is being captured. Here a token
whose slot is -1 (padding) just writes nothing."""

import torch
import triton
import triton.language as tl


@triton.jit
def copy_rows(src_ptr, dst_ptr, heads, head_dim, HEADS: tl.constexpr, DIM: tl.constexpr):
    """Copy `heads` rows of `head_dim` from src into dst (both row-major [heads, head_dim]), in dst's dtype."""
    h = tl.arange(0, HEADS)[:, None]
    d = tl.arange(0, DIM)[None, :]
    m = (h < heads) & (d < head_dim)
    x = tl.load(src_ptr + h * head_dim + d, mask=m)
    tl.store(dst_ptr + h * head_dim + d, x.to(dst_ptr.dtype.element_ty), mask=m)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_heads, head_dim, k_stride, v_stride,
                     KH: tl.constexpr, DIM: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        row = slot * kv_heads * head_dim
        copy_rows(k_ptr + t * k_stride, k_cache_ptr + row, kv_heads, head_dim, KH, DIM)
        copy_rows(v_ptr + t * v_stride, v_cache_ptr + row, kv_heads, head_dim, KH, DIM)


def kv_cache_write_triton(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> torch.Tensor:
    """`kiln::kv_cache_write`: key and value [T, kv_heads, head_dim] into `kv_cache` [2, blocks, block,
    kv_heads, head_dim] at their slots; returns the empty ordering token, like the native op."""
    tokens, kv_heads, head_dim = key.shape
    for x in (key, value):
        assert x.stride(-1) == 1 and x.stride(-2) == head_dim, "rows of whole heads, as the projections give"
    if tokens:
        _kv_write_kernel[(tokens,)](key, value, kv_cache[0], kv_cache[1], slot_mapping, kv_heads, head_dim,
                                    key.stride(0), value.stride(0), KH=triton.next_power_of_2(kv_heads),
                                    DIM=triton.next_power_of_2(head_dim))
    return kv_cache.new_empty(0)
