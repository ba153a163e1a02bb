"""Paged attention over a flat batch mixing prefills and decodes, in one Triton launch
(`kiln::attention` and `kiln::attention_quant` on CUDA).

A program takes up to BLOCK_Q consecutive query tokens of one sequence and the query heads that share
one KV head (GQA): BLOCK_Q x GROUP rows, so a decode's few heads still fill a tensor-core tile. It
walks the sequence's KV blocks through its block table BLOCK_N keys at a time with an online
softmax, so the [tokens, context] scores are never stored. The sequence of a program is found from
`query_start_loc` on the GPU: sequence s owns programs from `query_start_loc[s] // BLOCK_Q + s` on,
which over-counts by at most one block per sequence (the extra programs return at once) and needs
no copy of the batch layout to the host, so the launch can sit inside a CUDA graph.

Triton compiles one binary per specialization of the arguments. The ints that change from batch to
batch (sequence count, block-table width) and the serve-time settings (block size, window) are not
specialized, so a model needs two binaries per op (one for decode-only batches, one for the rest),
all built by `kiln compile` and shipped in the artifact (`kiln.compiler.triton_cache`).
"""

import os

import torch
import triton
import triton.language as tl

from kiln.kernels.quant import FP8_MAX, INT8_MAX

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=["num_seqs", "block_size", "bt_stride", "window"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, qsl_ptr, seq_lens_ptr, bt_ptr, out_scale_ptr,
    num_seqs, group, kv_heads, head_dim, block_size, bt_stride, q_stride_t, q_stride_h,
    scale_log2, window,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, DIM: tl.constexpr, SEQ_CHUNK: tl.constexpr,
    QUANT: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    owners = 0  # sequences whose first program is at or before this one: this one's sequence is the last
    for c in range(0, num_seqs, SEQ_CHUNK):
        s = c + tl.arange(0, SEQ_CHUNK)
        firsts = tl.load(qsl_ptr + s, mask=s < num_seqs, other=1 << 30) // BLOCK_Q + s
        owners += tl.sum((firsts <= b).to(tl.int32), axis=0)
    seq = owners - 1
    q_start = tl.load(qsl_ptr + seq)
    q_end = tl.load(qsl_ptr + seq + 1)
    t0 = q_start + (b - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if t0 < q_end:
        ctx = tl.load(seq_lens_ptr + seq)
        r = tl.arange(0, BLOCK_Q * GROUP)
        tok = t0 + r // GROUP
        g = r % GROUP
        rows = (tok < q_end) & (g < group)
        head = h * group + g
        pos = ctx - (q_end - tok)  # each row's position in its sequence: it sees keys 0..pos
        d = tl.arange(0, DIM)
        dims = d < head_dim
        q = tl.load(q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                    mask=rows[:, None] & dims[None, :], other=0.0).to(k_cache_ptr.dtype.element_ty)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([BLOCK_Q * GROUP], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_Q * GROUP], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP, DIM], tl.float32)
        hi = ctx - q_end + tl.minimum(t0 + BLOCK_Q, q_end)  # one past the last row's position
        lo = tl.where(window > 0, tl.maximum(ctx - (q_end - t0) - window + 1, 0) // BLOCK_N * BLOCK_N, 0)
        for start in range(lo, hi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            keys = j < hi
            block = tl.load(bt_ptr + seq * bt_stride + j // block_size, mask=keys, other=0).to(tl.int64)
            offs = (block * block_size + j % block_size)[:, None] * (kv_heads * head_dim) + h * head_dim + d[None, :]
            kv_mask = keys[:, None] & dims[None, :]
            k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)
            v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            seen = keys[None, :] & (j[None, :] <= pos[:, None])
            if window > 0:
                seen = seen & (j[None, :] > pos[:, None] - window)
            scores = tl.where(seen, scores * scale_log2, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet stay zero
            p = tl.exp2(scores - base[:, None])
            alpha = tl.exp2(m - base)
            total = total * alpha + tl.sum(p, axis=1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        o = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        dst = out_ptr + tok[:, None] * (group * kv_heads * head_dim) + head[:, None] * head_dim + d[None, :]
        keep = rows[:, None] & dims[None, :]
        if QUANT:
            o = o / tl.load(out_scale_ptr).to(tl.float32)
            if IS_INT8:
                o = tl.where(o >= 0, tl.floor(o + 0.5), tl.ceil(o - 0.5))
            o = tl.minimum(tl.maximum(o, -QMAX), QMAX)
        tl.store(dst, o.to(out_ptr.dtype.element_ty), mask=keep)


def launch_arguments(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                     seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int,
                     out: torch.Tensor, out_scale: torch.Tensor | None) -> tuple[tuple, tuple, dict]:
    """(grid, arguments, constexprs) of one launch: what the op launches, and what tests compile
    for a GPU they do not have."""
    tokens, q_heads, head_dim = query.shape
    kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    assert query.stride(-1) == 1 and kv_cache.is_contiguous() and block_tables.stride(-1) == 1
    group = q_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    # decode-only batches (one token per sequence) need one token per program; prefills fill 64 rows
    rows = 16 if tokens == num_seqs else 64
    block_q = max(rows // group_pad, 1)
    grid = (tokens // block_q + num_seqs, kv_heads)
    quant = out_scale is not None
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"  # its tl.dot misreads bf16 operands: use fp32 there
    args = (query, kv_cache[0], kv_cache[1], out, query_start_loc, seq_lens, block_tables, out_scale if quant else out,
            num_seqs, group, kv_heads, head_dim, block_size, block_tables.stride(0), query.stride(0), query.stride(1),
            scale * _LOG2E, sliding_window)
    constexprs = dict(
        GROUP=group_pad, BLOCK_Q=block_q, BLOCK_N=32, DIM=max(triton.next_power_of_2(head_dim), 16), SEQ_CHUNK=128,
        QUANT=quant, IS_INT8=out.dtype == torch.int8, QMAX=INT8_MAX if out.dtype == torch.int8 else float(FP8_MAX),
        IEEE=kv_cache.dtype == torch.float32 or interpreted, UPCAST=interpreted,
        # 64-row tiles with 4 warps spill at head dim 128 in fp32 (6.8 KB a thread in the sm_90 build)
        num_warps=4 if rows == 16 else 8,
    )
    return grid, args, constexprs


def _launch(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
            block_tables: torch.Tensor, scale: float, sliding_window: int, out: torch.Tensor,
            out_scale: torch.Tensor | None) -> None:
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return
    grid, args, constexprs = launch_arguments(query, kv_cache, query_start_loc, seq_lens, block_tables, scale,
                                              sliding_window, out, out_scale)
    _paged_attention_kernel[grid](*args, **constexprs)


def attention_triton(query: torch.Tensor, kv_cache: torch.Tensor, write_done: torch.Tensor,
                     query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                     scale: float, sliding_window: int) -> torch.Tensor:
    """`kiln::attention`: query [T, Hq, D] over `kv_cache` [2, blocks, block_size, kv_heads, D]."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    _launch(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, out, None)
    return out


def attention_quant_triton(query: torch.Tensor, kv_cache: torch.Tensor, write_done: torch.Tensor,
                           query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                           scale: float, sliding_window: int, quant_dtype: torch.dtype,
                           out_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`kiln::attention_quant`: the output quantized from the fp32 accumulators, heads flattened."""
    tokens, q_heads, head_dim = query.shape
    out = torch.empty(tokens, q_heads * head_dim, dtype=quant_dtype, device=query.device)
    s = out_scale.float().reshape(1, 1).clone()
    _launch(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, out, s)
    return out, s
