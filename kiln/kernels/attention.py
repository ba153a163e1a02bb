"""Paged attention over a flattened batch that mixes prefills (many query tokens) and decodes (one).

The batch is described only by tensors (`AttentionMetadata`), never by Python ints, so a traced
graph holds no per-batch constants and one compiled graph serves every batch.
"""

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kiln.kernels.kv_cache import dequantize_rows


@dataclass
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the paged KV cache.

    slot_mapping:    [num_tokens] int64, cache slot (block * block_size + offset) per token; -1 = padding
    query_start_loc: [num_seqs + 1] int32, cumulative query lengths (sequence i owns tokens [q[i], q[i+1]))
    seq_lens:        [num_seqs] int32, context length per sequence including this step's tokens
    block_tables:    [num_seqs, max_blocks] int32, KV block ids per sequence (padded with 0)
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


def _gather(kv_cache: torch.Tensor, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[seqs, nblocks] block ids -> K and V, each [seqs, kv_heads, nblocks * block_size, head_dim] in
    `dtype` (an int8 cache's rows dequantized): views of one copy of both made block by block (what
    SDPA's CPU kernel reads without another copy: one gather instead of two)."""
    seqs, nblocks = blocks.shape
    x = kv_cache.index_select(1, blocks.flatten())  # [2, seqs * nblocks, block_size, heads, row]
    if kv_cache.dtype == torch.int8:
        x = dequantize_rows(x, dtype)
    x = x.view(2, seqs, nblocks * kv_cache.shape[2], *x.shape[3:]).transpose(2, 3)
    return x[0], x[1]


@dataclass
class _Prefills:
    """Prefills of one shape: `count` sequences of `n` query tokens over `ctx` tokens of context."""

    starts: list[int]
    n: int
    ctx: int
    blocks: torch.Tensor  # [count, ceil(ctx / block_size)] int64
    rows: torch.Tensor | None  # their query rows, in order; None: one contiguous run from starts[0]
    mask: torch.Tensor | None  # [n, ctx] bool; None: plain causal (n == ctx, no window)


@dataclass
class _Plan:
    """What every layer's attention of one batch shares: derived once from the metadata, not per layer."""

    decode_rows: torch.Tensor | None  # query rows of the one-token sequences; None if the batch has none
    decode_all: bool  # the batch is only decodes: their rows are the whole query, in order
    decode_blocks: torch.Tensor | None  # [decodes, nblocks] int64
    decode_mask: torch.Tensor | None  # [decodes, 1, 1, slots], 0 or -inf in the query's dtype
    prefills: list[_Prefills]


@dataclass
class _CachedPlan:
    """The last batch's plan and what it was made from."""

    meta: tuple[torch.Tensor, ...]  # the metadata tensors themselves
    copies: tuple[torch.Tensor, ...]  # their values then
    config: tuple  # (block size, window, dtype)
    plan: _Plan
    batch: int  # the `one_batch` it was made or last found in (0: none)


_last_plan: list[_CachedPlan | None] = [None]
_batch = [0, 0]  # [the `one_batch` now open (0: none), the last one opened]


@contextlib.contextmanager
def one_batch():
    """Within it every attention call is of one batch, as in one forward of a compiled program:
    the layers' calls find the first one's plan by their metadata tensors' identity, not by comparing
    values (several times slower; what calls outside it, or in the next batch, do)."""
    _batch[1] += 1
    _batch[0] = _batch[1]
    try:
        yield
    finally:
        _batch[0] = 0


def _plan(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int,
          window: int | None, dtype: torch.dtype) -> _Plan:
    """The batch's plan, computed on the first layer's call and reused by the others, which receive
    the same metadata."""
    meta, config = (query_start_loc, seq_lens, block_tables), (block_size, window, dtype)
    cached = _last_plan[0]
    if cached is not None and cached.config == config:
        if _batch[0] and cached.batch == _batch[0] and all(a is b for a, b in zip(cached.meta, meta)):
            return cached.plan
        if all(a.shape == b.shape and a.device == b.device and torch.equal(a, b) for a, b in zip(cached.copies, meta)):
            cached.meta, cached.batch = meta, _batch[0]  # this batch's next layers find it by identity
            return cached.plan
    plan = _make_plan(query_start_loc, seq_lens, block_tables, block_size, window, dtype)
    _last_plan[0] = _CachedPlan(meta, tuple(t.clone() for t in meta), config, plan, _batch[0])
    return plan


_last_decodes: list[tuple[int, torch.Tensor, bool] | None] = [None]


def _all_decodes(query_start_loc: torch.Tensor, tokens: int) -> bool:
    """Whether every sequence of the batch has one query token: found once per `one_batch`, then by
    the tensor's identity, without the plan, whose masks and block gathers the library needs none of."""
    cached = _last_decodes[0]
    if _batch[0] and cached is not None and cached[0] == _batch[0] and cached[1] is query_start_loc:
        return cached[2]
    answer = query_start_loc.shape[0] == tokens + 1 and torch.equal(
        query_start_loc, torch.arange(tokens + 1, dtype=query_start_loc.dtype, device=query_start_loc.device))
    _last_decodes[0] = (_batch[0], query_start_loc, answer)
    return answer


def decode_params(scale: float, window: int) -> torch.Tensor:
    """The `params` argument of a `decode` library (`kiln::decode_attention`, `attention_native` calls it):
    [scale, window] as fp32 (a window of 0 or less: the whole context). Here, with its caller, so that the
    kernel's module can take its reference from this one without this one importing it."""
    return torch.tensor([scale, float(max(window, 0))], dtype=torch.float32)


@functools.lru_cache(maxsize=8)
def _decode_params(scale: float, sliding_window: int) -> torch.Tensor:
    """The decode library's `params` tensor, made once per layer shape, not per call."""
    return decode_params(scale, sliding_window)


def _make_plan(query_start_loc, seq_lens, block_tables, block_size: int, window: int | None,
               dtype: torch.dtype) -> _Plan:
    device = query_start_loc.device
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    plan = _Plan(None, False, None, None, [])
    if decodes:
        idx = torch.tensor(decodes, device=device)
        nblk = -(-max(lens[i] for i in decodes) // block_size)
        ctx = seq_lens[idx].long()
        pos = torch.arange(nblk * block_size, device=device)
        mask = pos[None, :] < ctx[:, None]
        if window is not None:
            mask &= pos[None, :] > (ctx[:, None] - 1 - window)
        plan.decode_all = len(decodes) == len(q_lens)
        plan.decode_rows = query_start_loc[idx].long()
        plan.decode_blocks = block_tables[idx, :nblk].long()
        plan.decode_mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(~mask, float("-inf"))[
            :, None, None, :]  # additive: SDPA's CPU kernel reads it as is (a boolean mask it converts)
    groups: dict[tuple[int, int], list[int]] = {}
    for i, n in enumerate(q_lens):
        if n > 1:
            groups.setdefault((n, lens[i]), []).append(i)
    for (n, ctx), seqs in groups.items():
        nblk = -(-ctx // block_size)
        first = [starts[i] for i in seqs]
        contiguous = all(b - a == n for a, b in zip(first, first[1:]))
        rows = None if contiguous else torch.cat([torch.arange(s, s + n, device=device) for s in first])
        mask = None
        if n != ctx or window is not None:
            q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]
            k_pos = torch.arange(ctx, device=device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
        plan.prefills.append(_Prefills(first, n, ctx, block_tables[seqs, :nblk].long(), rows, mask))
    return plan


def attention_native(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    decode: Callable | None = None,
) -> torch.Tensor:
    """CPU path and reference: the decodes run as one SDPA (each KV head's query group as the query
    rows, so no KV head is repeated), the prefills as one SDPA per shape (sequences of equal query and
    context lengths, the usual batched prompts, together). A batch of only decodes in fp32 runs on
    `decode` where given: the decode attention library (`kiln.kernels.decode_attention`). An int8 cache's
    rows are dequantized as they are read."""
    if decode is not None and query.dtype == torch.float32 and kv_cache.dtype in (torch.float32, torch.int8) \
            and block_tables.dtype == seq_lens.dtype == torch.int32 and query.is_contiguous() \
            and kv_cache.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous() \
            and _all_decodes(query_start_loc, query.shape[0]):  # what the kernel reads, as it reads it
        return decode(query, kv_cache, block_tables, seq_lens, _decode_params(scale, sliding_window))[0]
    window = sliding_window if sliding_window > 0 else None
    plan = _plan(query_start_loc, seq_lens, block_tables, kv_cache.shape[2], window, query.dtype)
    hq, d = query.shape[1], query.shape[2]
    hkv = kv_cache.shape[3]
    if plan.decode_rows is not None:
        k, v = _gather(kv_cache, plan.decode_blocks, query.dtype)  # [B, Hkv, S, D]
        q = query if plan.decode_all else query[plan.decode_rows]
        o = F.scaled_dot_product_attention(q.reshape(-1, hkv, hq // hkv, d), k, v, attn_mask=plan.decode_mask,
                                           scale=scale).reshape(-1, hq, d)
        if plan.decode_all:
            return o
        out = torch.empty_like(query)
        out[plan.decode_rows] = o
    else:
        out = torch.empty_like(query)
    for group in plan.prefills:
        count, n = len(group.starts), group.n
        k, v = (x[:, :, : group.ctx] for x in _gather(kv_cache, group.blocks, query.dtype))  # [count, Hkv, ctx, D]
        rows = slice(group.starts[0], group.starts[0] + count * n) if group.rows is None else group.rows
        q = query[rows].view(count, n, hq, d).transpose(1, 2)  # [count, Hq, n, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, is_causal=group.mask is None,
                                           scale=scale, enable_gqa=True)
        out[rows] = o.transpose(1, 2).reshape(count * n, hq, d)
    return out


@torch.library.custom_op("kiln::attention", mutates_args=())
def attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    write_done: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over the paged cache; GQA when Hq > kv_heads.

    `write_done` is the output of this layer's `kiln::kv_cache_write`: the data edge that keeps the
    write first. `sliding_window` <= 0 means full attention.
    """
    return attention_native(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window)


def attention_call(query: torch.Tensor, kv_cache: torch.Tensor, write_done: torch.Tensor,
                   query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                   sliding_window: int, decode: Callable | None = None) -> torch.Tensor:
    """`kiln::attention` as a compiled program calls it between its pieces: on CPU straight to its
    implementation, not through the op dispatcher (microseconds a call, one call a layer per step),
    batches of decodes on the artifact's `decode` library where it ships one; elsewhere
    through the op, which picks the device's kernel."""
    if query.device.type == "cpu":
        return attention_native(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window,
                                decode)
    return torch.ops.kiln.attention.default(query, kv_cache, write_done, query_start_loc, seq_lens, block_tables,
                                            scale, sliding_window)


@attention.register_fake
def _(query, kv_cache, write_done, query_start_loc, seq_lens, block_tables, scale, sliding_window):
    return torch.empty_like(query)
