"""Paged attention over a flattened batch that mixes prefills (many query tokens) and decodes (one).

The batch is described only by tensors (`AttentionMetadata`), never by Python ints, so a traced
graph holds no per-batch constants and one compiled graph serves every batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[..., nblocks] block ids -> [..., kv_heads, nblocks * block_size, head_dim]."""
    x = cache[blocks]  # [..., nblocks, block_size, heads, dim]
    x = x.flatten(-4, -3)  # [..., slots, heads, dim]
    return x.transpose(-3, -2)


def attention_native(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
) -> torch.Tensor:
    """CPU path and reference: decodes run as one batched SDPA, each prefill as its own."""
    out = torch.empty_like(query)
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:])]
    decodes = [i for i, n in enumerate(q_lens) if n == 1]
    prefills = [i for i, n in enumerate(q_lens) if n > 1]
    window = sliding_window if sliding_window > 0 else None

    if decodes:
        idx = torch.tensor(decodes, device=query.device)
        ctx = seq_lens[idx].long()
        nblk = -(-max(lens[i] for i in decodes) // block_size)
        blocks = block_tables[idx, :nblk].long()
        k, v = _gather(kv_cache[0], blocks), _gather(kv_cache[1], blocks)  # [B, Hkv, S, D]
        pos = torch.arange(k.shape[-2], device=query.device)
        mask = pos[None, :] < ctx[:, None]
        if window is not None:
            mask &= pos[None, :] > (ctx[:, None] - 1 - window)
        tokens = query_start_loc[idx].long()
        q = query[tokens].unsqueeze(2)  # [B, Hq, 1, D]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[tokens] = o.squeeze(2)

    for i in prefills:
        start, n, ctx = starts[i], q_lens[i], lens[i]
        nblk = -(-ctx // block_size)
        blocks = block_tables[i, :nblk].long()
        k = _gather(kv_cache[0], blocks)[:, :ctx].unsqueeze(0)
        v = _gather(kv_cache[1], blocks)[:, :ctx].unsqueeze(0)
        q = query[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if n == ctx and window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - n, ctx, device=query.device)[:, None]
            k_pos = torch.arange(ctx, device=query.device)[None, :]
            mask = k_pos <= q_pos
            if window is not None:
                mask &= k_pos > q_pos - window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1)
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


@attention.register_fake
def _(query, kv_cache, write_done, query_start_loc, seq_lens, block_tables, scale, sliding_window):
    return torch.empty_like(query)
