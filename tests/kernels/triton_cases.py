"""The cases `test_triton.py` runs in a fresh process: kiln's Triton kernels against the native ops
they implement, on CUDA where there is one, else on CPU tensors under Triton's interpreter (tiny
shapes: it runs the kernels in numpy)."""

import os

import pytest
import torch

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
assert DEVICE == "cuda" or os.environ.get("TRITON_INTERPRET") == "1", "run on CPU with TRITON_INTERPRET=1"

from kiln.kernels.activation import silu_and_mul_native  # noqa: E402
from kiln.kernels.norm import fused_add_rms_norm_native, rms_norm_native  # noqa: E402
from kiln.kernels.quant import quant_native  # noqa: E402
from kiln.kernels.triton import (fused_add_rms_norm_triton, register, rms_norm_triton,  # noqa: E402
                                 silu_and_mul_triton)

FP8_ON_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter does not convert to fp8 e4m3fn as "
                                "the GPU does (values off by several steps): checked on a GPU only")
QUANTS = [None, (torch.int8, None), (torch.int8, 0.05), pytest.param((torch.float8_e4m3fn, None), marks=FP8_ON_GPU),
          pytest.param((torch.float8_e4m3fn, 0.05), marks=FP8_ON_GPU)]
# The interpreter rounds fp32 -> bf16 toward zero where the GPU and torch round to nearest: in bf16
# every rounded intermediate may sit one step away, so scales and codes get that much slack.
SCALE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def _close(got, want, dtype):
    if want.dtype == torch.int8:
        assert (got.int() - want.int()).abs().max() <= 1  # a value a rounding step from .5 may land either side
        if dtype == torch.float32:
            assert (got != want).float().mean() < 0.02
    elif want.dtype == torch.float8_e4m3fn:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=0.07)  # one fp8 step
    else:
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def _quant(x, quant):
    dtype, scale = quant
    return quant_native(x, None if scale is None else torch.tensor([scale], device=x.device), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", QUANTS)
def test_rms_norm_and_fused_add(dtype, quant):
    torch.manual_seed(0)
    x, res = torch.randn(5, 40, dtype=dtype, device=DEVICE), torch.randn(5, 40, dtype=dtype, device=DEVICE)
    w = (torch.rand(40, device=DEVICE) + 0.5).to(dtype)
    args = () if quant is None else (quant[0], None if quant[1] is None else torch.tensor([quant[1]], device=DEVICE))
    normed, new_res = fused_add_rms_norm_native(x, res, w, 1e-6)
    plain = rms_norm_native(x, w, 1e-6)
    got_plain = rms_norm_triton(x, w, 1e-6, *args)
    got_fused = fused_add_rms_norm_triton(x, res, w, 1e-6, *args)
    # the residual sum: exact in fp32; in bf16 within one step (the interpreter rounds fp32 -> bf16 toward zero)
    exact = dtype == torch.float32
    torch.testing.assert_close(got_fused[-1], new_res, atol=0 if exact else 1.6e-2, rtol=0 if exact else 8e-3)
    if quant is None:
        _close(got_plain, plain, dtype)
        _close(got_fused[0], normed, dtype)
        return
    for got, ref in ((got_plain, plain), (got_fused[:2], normed)):
        q, s = _quant(ref, quant)
        torch.testing.assert_close(got[1], s, atol=0, rtol=SCALE_RTOL[dtype])
        _close(got[0], q, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("quant", QUANTS)
def test_silu_and_mul(dtype, quant):
    torch.manual_seed(1)
    x = torch.randn(3, 2, 48, dtype=dtype, device=DEVICE)
    want = silu_and_mul_native(x)
    if quant is None:
        _close(silu_and_mul_triton(x), want, dtype)
        return
    q, s = _quant(want, quant)
    got_q, got_s = silu_and_mul_triton(x, quant[0], None if quant[1] is None else torch.tensor([quant[1]], device=DEVICE))
    torch.testing.assert_close(got_s, s, atol=0, rtol=SCALE_RTOL[dtype])
    _close(got_q, q, dtype)


def test_no_tokens():
    x = torch.empty(0, 16, device=DEVICE)
    assert rms_norm_triton(x, torch.ones(16, device=DEVICE), 1e-6).shape == (0, 16)


def test_register_makes_them_the_cuda_kernels():
    register()
    for op in ("rms_norm", "fused_add_rms_norm_quant", "silu_and_mul_quant", "kv_cache_write",
               "rotary_embedding_kv_cache_write", "attention", "attention_quant"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kiln::{op}", "CUDA")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [16, 12])  # all of head_dim 16, or part of it
def test_rope_and_kv_cache_write(dtype, is_neox, rotary_dim):
    from kiln.kernels.rope_kv_cache import rotary_embedding_kv_cache_write
    from kiln.kernels.rotary import rope_cos_sin_cache
    from kiln.kernels.triton.rope_kv_cache import rotary_embedding_kv_cache_write_triton

    torch.manual_seed(2)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)  # strided views, as in the model
    q, k, v = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    cos_sin = rope_cos_sin_cache(rotary_dim, 64, 10000.0, None, dtype).to(DEVICE)
    positions = torch.tensor([0, 3, 7, 30, 63], device=DEVICE)
    slots = torch.tensor([1, 17, -1, 5, 40], device=DEVICE)  # -1: a padded token writes nothing
    want_cache, got_cache = (torch.zeros(2, 3, 16, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2))
    want_q, _ = rotary_embedding_kv_cache_write(positions, q, k, v, cos_sin, is_neox, want_cache, slots)
    got_q, token = rotary_embedding_kv_cache_write_triton(positions, q, k, v, cos_sin, is_neox, got_cache, slots)
    _close(got_q, want_q, dtype)
    _close(got_cache, want_cache, dtype)
    assert token.numel() == 0 and not got_cache.view(2, -1, kv_heads, dim)[:, [0, 2, 3, 4]].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_cache_write(dtype):
    from kiln.kernels.kv_cache import kv_cache_write_native
    from kiln.kernels.triton.kv_cache import kv_cache_write_triton

    torch.manual_seed(4)
    tokens, heads, kv_heads, dim = 5, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=dtype, device=DEVICE)
    _, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)  # strided views, as in the model
    k, v = k.view(tokens, kv_heads, dim), v.view(tokens, kv_heads, dim)
    slots = torch.tensor([1, 17, -1, 5, 40], device=DEVICE)  # -1: a padded token writes nothing
    want, got = (torch.zeros(2, 3, 16, kv_heads, dim, dtype=dtype, device=DEVICE) for _ in range(2))
    kv_cache_write_native(k, v, want, slots)
    assert kv_cache_write_triton(k, v, got, slots).numel() == 0
    assert torch.equal(got, want) and want.any()


def _paged_batch(q_heads, kv_heads, dim, dtype, shape, block_size=4, blocks=32):
    """A flat batch of sequences (query tokens, context length), each over scattered cache blocks."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(2, blocks, block_size, kv_heads, dim, generator=g).to(dtype).to(DEVICE)
    order = torch.randperm(blocks, generator=g)
    per_seq = -(-max(ctx for _, ctx in shape) // block_size)
    tables = torch.zeros(len(shape), per_seq, dtype=torch.int32)
    used = 0
    for i, (_, ctx) in enumerate(shape):
        n = -(-ctx // block_size)
        tables[i, :n] = order[used:used + n]
        used += n
    starts = torch.tensor([0, *torch.tensor([q for q, _ in shape]).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(int(starts[-1]), q_heads, dim, generator=g).to(dtype).to(DEVICE)
    lens = torch.tensor([ctx for _, ctx in shape], dtype=torch.int32)
    return query, cache, starts.to(DEVICE), lens.to(DEVICE), tables.to(DEVICE)


MIXED = [(1, 7), (5, 5), (3, 10), (1, 1), (6, 13)]  # decodes, a whole prefill, chunked prefills
DECODES = [(1, 9), (1, 1), (1, 16), (1, 3)]
LONG = [(40, 45), (1, 5), (33, 33)]  # queries over two programs, keys over two tiles of 32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(4, 2, 16), (6, 1, 48), (2, 2, 32)])  # (Hq, Hkv, head dim): GQA, MQA, MHA
@pytest.mark.parametrize("shape", [MIXED, DECODES, LONG], ids=["mixed", "decodes", "long"])
@pytest.mark.parametrize("window", [0, 3])
def test_paged_attention(dtype, heads, shape, window):
    from kiln.kernels.attention import attention_native
    from kiln.kernels.triton.attention import attention_triton

    query, cache, starts, lens, tables = _paged_batch(*heads, dtype, shape)
    scale = heads[2] ** -0.5
    want = attention_native(query, cache, starts, lens, tables, scale, window)
    got = attention_triton(query, cache, cache.new_empty(0), starts, lens, tables, scale, window)
    _close(got, want, dtype)


@pytest.mark.parametrize("quant", [(torch.int8, 0.02), pytest.param((torch.float8_e4m3fn, 0.002), marks=FP8_ON_GPU)])
def test_paged_attention_quant(quant):
    from kiln.kernels.attention_quant import attention_quant
    from kiln.kernels.triton.attention import attention_quant_triton

    query, cache, starts, lens, tables = _paged_batch(4, 2, 16, torch.float32, MIXED)
    scale = torch.tensor([quant[1]], device=DEVICE)
    want_q, want_s = attention_quant(query, cache, cache.new_empty(0), starts, lens, tables, 0.25, 0, quant[0], scale)
    got_q, got_s = attention_quant_triton(query, cache, cache.new_empty(0), starts, lens, tables, 0.25, 0, quant[0],
                                          scale)
    assert got_s.shape == want_s.shape == (1, 1) and torch.equal(got_s, want_s)
    _close(got_q, want_q, torch.float32)


def test_paged_attention_more_sequences_than_one_chunk():
    """A program finds its sequence by scanning query_start_loc 128 sequences at a time: 130 sequences
    (prefills at both ends) take two chunks."""
    from kiln.kernels.attention import attention_native
    from kiln.kernels.triton.attention import attention_triton

    shape = [(3, 5)] + [(1, 2 + i % 5) for i in range(128)] + [(4, 6)]
    query, cache, starts, lens, tables = _paged_batch(2, 1, 16, torch.float32, shape, blocks=400)
    want = attention_native(query, cache, starts, lens, tables, 0.25, 0)
    got = attention_triton(query, cache, cache.new_empty(0), starts, lens, tables, 0.25, 0)
    _close(got, want, torch.float32)


def test_paged_attention_no_tokens():
    from kiln.kernels.triton.attention import attention_triton

    query, cache, starts, lens, tables = _paged_batch(4, 2, 16, torch.float32, [(1, 3)])
    empty = attention_triton(query[:0], cache, cache.new_empty(0), starts[:1], lens[:0], tables[:0], 0.25, 0)
    assert empty.shape == (0, 4, 16)
