"""Rotary embedding of query and key with the rotated key and the value written straight into the
paged KV cache, one program per token (`kiln::rotary_embedding_kv_cache_write` on CUDA). A token whose
slot is -1 (padding) writes nothing; its query is still rotated."""

import torch
import triton
import triton.language as tl

from kiln.kernels.triton.kv_cache import copy_rows


@triton.jit
def _rotate_rows(src_ptr, dst_ptr, heads, pos_cs_ptr, half, head_dim,
                 IS_NEOX: tl.constexpr, HEADS: tl.constexpr, HALF: tl.constexpr, DIM: tl.constexpr):
    """Rotate `heads` rows of `head_dim` from src into dst (both row-major [heads, head_dim])."""
    h = tl.arange(0, HEADS)[:, None]
    i = tl.arange(0, HALF)[None, :]
    m = (h < heads) & (i < half)
    cos = tl.load(pos_cs_ptr + i, mask=i < half, other=0.0).to(tl.float32)
    sin = tl.load(pos_cs_ptr + half + i, mask=i < half, other=0.0).to(tl.float32)
    if IS_NEOX:
        first, second = i, i + half
    else:
        first, second = 2 * i, 2 * i + 1
    x1 = tl.load(src_ptr + h * head_dim + first, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src_ptr + h * head_dim + second, mask=m, other=0.0).to(tl.float32)
    tl.store(dst_ptr + h * head_dim + first, (x1 * cos - x2 * sin).to(dst_ptr.dtype.element_ty), mask=m)
    tl.store(dst_ptr + h * head_dim + second, (x2 * cos + x1 * sin).to(dst_ptr.dtype.element_ty), mask=m)
    d = tl.arange(0, DIM)[None, :]
    rest = (h < heads) & (d >= 2 * half) & (d < head_dim)  # dimensions past the rotary ones pass through
    tl.store(dst_ptr + h * head_dim + d, tl.load(src_ptr + h * head_dim + d, mask=rest, other=0.0), mask=rest)


@triton.jit
def _rope_kv_kernel(pos_ptr, q_ptr, k_ptr, v_ptr, cs_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                    q_heads, kv_heads, head_dim, half, q_stride, k_stride, v_stride,
                    IS_NEOX: tl.constexpr, QH: tl.constexpr, KH: tl.constexpr, HALF: tl.constexpr,
                    DIM: tl.constexpr):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t)
    cs = cs_ptr + pos * 2 * half
    _rotate_rows(q_ptr + t * q_stride, q_out_ptr + t * q_heads * head_dim, q_heads, cs, half, head_dim,
                 IS_NEOX, QH, HALF, DIM)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # the key is rotated straight into its cache row: nothing is stored, then read back
        row = slot * kv_heads * head_dim
        _rotate_rows(k_ptr + t * k_stride, k_cache_ptr + row, kv_heads, cs, half, head_dim, IS_NEOX, KH, HALF, DIM)
        copy_rows(v_ptr + t * v_stride, v_cache_ptr + row, kv_heads, head_dim, KH, DIM)


def rotary_embedding_kv_cache_write_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                           value: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool,
                                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """-> (rotated query, the ordering token), like the native op; `kv_cache` [2, blocks, block, heads, dim]."""
    tokens, q_heads, head_dim = query.shape
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=query.dtype, device=query.device)
    for x in (query, key, value):
        assert x.stride(-1) == 1 and x.stride(-2) == head_dim, "rows of whole heads, as the projections give"
    if tokens:
        grid, args, constexprs = launch_arguments(positions, query, key, value, cos_sin_cache, is_neox, kv_cache,
                                                  slot_mapping, q_out)
        _rope_kv_kernel[grid](*args, **constexprs)
    return q_out, kv_cache.new_empty(0)


def launch_arguments(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                     q_out: torch.Tensor) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs) of one launch. Nothing here varies with the batch but the
    grid, so a model needs one binary (per rotary style)."""
    tokens, q_heads, head_dim = query.shape
    kv_heads, half = key.shape[1], cos_sin_cache.shape[-1] // 2
    args = (positions, query, key, value, cos_sin_cache, q_out, kv_cache[0], kv_cache[1], slot_mapping,
            q_heads, kv_heads, head_dim, half, query.stride(0), key.stride(0), value.stride(0))
    constexprs = dict(IS_NEOX=is_neox, QH=triton.next_power_of_2(q_heads), KH=triton.next_power_of_2(kv_heads),
                      HALF=triton.next_power_of_2(half), DIM=triton.next_power_of_2(head_dim))
    return (tokens,), args, constexprs
