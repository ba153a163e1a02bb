import importlib
import math

import pytest
import torch

import kiln.kernels  # noqa: F401
from kiln.kernels.attention import attention_call

ops = torch.ops.kiln
BLOCK = 4


def test_kv_cache_write_fills_slots_and_skips_padding():
    kv = torch.zeros(2, 3, BLOCK, 2, 8)
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    done = ops.kv_cache_write(k, v, kv, torch.tensor([5, 0, -1]))
    assert done.numel() == 0
    assert torch.equal(kv[0, 1, 1], k[0]) and torch.equal(kv[1, 1, 1], v[0])
    assert torch.equal(kv[0, 0, 0], k[1]) and torch.equal(kv[1, 0, 0], v[1])
    assert int((kv != 0).flatten(2).any(-1).sum()) == 4  # two slots, each in K and V; padding wrote nothing


def test_scatter_form_writes_the_same_slots_and_padding_only_into_the_scratch_slot():
    """The form Inductor compiles on CPU: the native op's writes, and slot -1 lands in the cache's last
    slot (the scratch block `allocate_kv_caches` adds), not in any slot a sequence owns."""
    from kiln.kernels.kv_cache import kv_cache_write_scatter

    kv, scattered = torch.zeros(2, 3, BLOCK, 2, 8), torch.zeros(2, 3, BLOCK, 2, 8)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    slots = torch.tensor([5, 0, -1, 9])
    ops.kv_cache_write(k, v, kv, slots)
    assert kv_cache_write_scatter(k, v, scattered, slots).numel() == 0
    assert torch.equal(scattered.flatten(1, 2)[:, :-1], kv.flatten(1, 2)[:, :-1])
    assert torch.equal(scattered[0, -1, -1], k[2]) and torch.equal(scattered[1, -1, -1], v[2])
    assert not kv[:, -1, -1].any()  # the op writes nothing for padding


def test_int8_cache_rows_hold_codes_and_their_scale():
    """An int8 cache's row: round(x / scale) for scale = max |x| / 127, then the scale's fp32 bytes; both write
    forms store the same bytes, and the values read back are within half a step of each row's scale."""
    from kiln.kernels.kv_cache import dequantize_rows, kv_cache_write_scatter, row_size

    assert row_size(8, torch.int8) == 12 and row_size(8, torch.float32) == 8
    kv, scattered = (torch.zeros(2, 3, BLOCK, 2, 12, dtype=torch.int8) for _ in range(2))
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    k[3, 1] = 0  # an all-zero row: scale 0, codes 0
    slots = torch.tensor([5, 0, -1, 9])
    ops.kv_cache_write(k, v, kv, slots)
    kv_cache_write_scatter(k, v, scattered, slots)
    assert torch.equal(scattered.flatten(1, 2)[:, :-1], kv.flatten(1, 2)[:, :-1])
    row = kv[0, 1, 1]  # slot 5: token 0's key
    scale = k[0].abs().amax(-1) / 127
    assert torch.equal(row[:, 8:].contiguous().view(torch.float32).flatten(), scale)
    assert torch.equal(row[:, :8], torch.round(k[0] / scale[:, None]).to(torch.int8))
    back = dequantize_rows(kv.flatten(1, 2)[:, [5, 0, 9]], torch.float32)
    expected = torch.stack([k[[0, 1, 3]], v[[0, 1, 3]]])
    assert ((back - expected).abs() <= expected.abs().amax(-1, keepdim=True) / 254 + 1e-7).all()
    assert not back[0, 2, 1].any()  # the zero row reads back as zeros
    assert not kv[:, -1, -1].any()  # padding wrote nothing


def _reference(q, keys, values, q_pos, scale, window):
    """One query token at position q_pos over a sequence's full K/V [ctx, Hkv, D]; GQA by head group."""
    hq, hkv = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for h in range(hq):
        kh = h // (hq // hkv)
        js = [j for j in range(q_pos + 1) if window <= 0 or q_pos - j < window]
        scores = torch.stack([q[h] @ keys[j, kh] for j in js]) * scale
        out[h] = (scores.softmax(0)[:, None] * torch.stack([values[j, kh] for j in js])).sum(0)
    return out


BATCHES = {
    "mixed": ([7, 11, 9, 1], [7, 4, 1, 1]),  # a fresh prefill, a chunked prefill over cached context, decodes
    "decodes": ([9, 1, 14], [1, 1, 1]),  # only decodes: the whole query is theirs
    "equal_prefills": ([1, 6, 6, 9, 6], [1, 6, 6, 1, 6]),  # three fresh prefills of one shape, one apart
}


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache", ["model", "int8"])
def test_paged_attention(batch, window, dtype, cache):
    """Prefills and decodes in one flat batch over shuffled, non-contiguous blocks, against a per-token
    reference; with an int8 cache, against the reference on the values its codes stand for."""
    from kiln.kernels.kv_cache import dequantize_rows, quantize_rows

    torch.manual_seed(0)
    hq, hkv, d = 6, 2, 16
    ctx_lens, q_lens = BATCHES[batch]
    perm = torch.randperm(16).tolist()
    tables, used = [], 0
    for c in ctx_lens:
        n = math.ceil(c / BLOCK)
        tables.append(perm[used : used + n])
        used += n
    width = max(map(len, tables))
    kv = torch.zeros(2, 16, BLOCK, hkv, d, dtype=dtype) if cache == "model" else \
        torch.zeros(2, 16, BLOCK, hkv, d + 4, dtype=torch.int8)
    full_k = [torch.randn(c, hkv, d, dtype=dtype) for c in ctx_lens]
    full_v = [torch.randn(c, hkv, d, dtype=dtype) for c in ctx_lens]
    # earlier steps wrote the context before this step's tokens
    for t, c, n, k, v in zip(tables, ctx_lens, q_lens, full_k, full_v):
        slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for p in range(c - n)], dtype=torch.long)
        ops.kv_cache_write(k[: c - n], v[: c - n], kv, slots)
    # this step's tokens
    slots = torch.tensor([t[p // BLOCK] * BLOCK + p % BLOCK for t, c, n in zip(tables, ctx_lens, q_lens)
                          for p in range(c - n, c)])
    new_k = torch.cat([k[c - n :] for k, c, n in zip(full_k, ctx_lens, q_lens)])
    new_v = torch.cat([v[c - n :] for v, c, n in zip(full_v, ctx_lens, q_lens)])
    q = torch.randn(sum(q_lens), hq, d, dtype=dtype)
    done = ops.kv_cache_write(new_k, new_v, kv, slots)
    starts = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    out = ops.attention(
        q, kv, done, starts, torch.tensor(ctx_lens, dtype=torch.int32),
        torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32), d**-0.5, window,
    )
    meta = (starts, torch.tensor(ctx_lens, dtype=torch.int32),
            torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32))
    assert torch.equal(attention_call(q, kv, done, *meta, d**-0.5, window), out)  # what compiled programs call
    tok = 0
    for c, n, k, v in zip(ctx_lens, q_lens, full_k, full_v):
        if cache == "int8":
            k, v = (dequantize_rows(quantize_rows(x), torch.float32) for x in (k, v))
        for i in range(n):
            ref = _reference(q[tok].float(), k.float(), v.float(), c - n + i, d**-0.5, window)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(out[tok].float(), ref, atol=tol, rtol=tol)
            tok += 1


def test_batch_plan_follows_metadata_changed_in_place():
    """Layers of one batch share a plan derived from the metadata; metadata edited in place (or new
    metadata with other values) gets a new plan, never a stale one."""
    torch.manual_seed(0)
    kv = torch.randn(2, 4, BLOCK, 1, 8)
    q = torch.randn(1, 2, 8)
    starts, tables = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([[2, 0, 3]], dtype=torch.int32)
    seq_lens = torch.tensor([9], dtype=torch.int32)
    keys = torch.cat([kv[0, b] for b in (2, 0, 3)])  # the sequence's context, in order
    values = torch.cat([kv[1, b] for b in (2, 0, 3)])
    for ctx in (9, 5):
        seq_lens.fill_(ctx)
        out = ops.attention(q, kv, kv.new_empty(0), starts, seq_lens, tables, 8**-0.5, 0)
        ref = _reference(q[0], keys[:ctx], values[:ctx], ctx - 1, 8**-0.5, 0)
        torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)


def test_one_batch_finds_the_plan_by_identity_and_new_metadata_still_plans(monkeypatch):
    """Within `one_batch` (a compiled forward) the layers' calls reuse the first call's plan without
    comparing values; outside it the values are compared, and other values get a plan of their own."""
    attention = importlib.import_module("kiln.kernels.attention")  # the module, not the op of its name
    made, compared = [], []
    make, equal = attention._make_plan, torch.equal
    monkeypatch.setattr(attention, "_make_plan", lambda *a: made.append(1) or make(*a))
    monkeypatch.setattr(torch, "equal", lambda *a: compared.append(1) or equal(*a))
    monkeypatch.setattr(attention, "_last_plan", [None])
    kv, q = torch.randn(2, 4, BLOCK, 1, 8), torch.randn(1, 2, 8)

    def meta(ctx):
        return (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                torch.tensor([[2, 0, 3]], dtype=torch.int32))

    first = meta(9)
    with attention.one_batch():
        outs = [attention.attention_call(q, kv, kv.new_empty(0), *first, 8**-0.5, 0) for _ in range(3)]
    assert (len(made), len(compared)) == (1, 0)
    outs.append(attention.attention_call(q, kv, kv.new_empty(0), *first, 8**-0.5, 0))
    assert (len(made), len(compared)) == (1, 3)
    with attention.one_batch():
        other = attention.attention_call(q, kv, kv.new_empty(0), *meta(5), 8**-0.5, 0)
    assert len(made) == 2 and all(equal(o, outs[0]) for o in outs) and not torch.allclose(other, outs[0])
    first[1].fill_(5)  # the same tensors, written in place before the next batch: planned again, not stale
    with attention.one_batch():
        again = attention.attention_call(q, kv, kv.new_empty(0), *first, 8**-0.5, 0)
        attention.attention_call(q, kv, kv.new_empty(0), *first, 8**-0.5, 0)
    assert equal(again, other) and len(made) == 2  # equal by value to the last plan's metadata: found, once
