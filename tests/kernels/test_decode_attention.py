"""The decode attention kernel, as its library runs it, against the op's reference (torch's SDPA over
the gathered cache), and the attention call's choice of it."""

import sys

import pytest
import torch

from kiln.compiler import libraries
from kiln.compiler.aoti import LoadedLibrary
from kiln.kernels import cpp_lowering, decode_attention
from kiln.kernels.attention import attention_native
from kiln.kernels.kv_cache import dequantize_rows, quantize_rows


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    path = tmp_path_factory.mktemp("decode") / "decode_attention.so"
    path.write_bytes(libraries.build([libraries.DECODE_ATTENTION])[decode_attention.LIBRARY].library)
    return LoadedLibrary(path, decode_attention.LIBRARY_ARGS)


def _case(seqs: int, hq: int, hkv: int, d: int, block: int, blocks: int, width: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, blocks, block, hkv, d, generator=gen)
    query = torch.randn(seqs, hq, d, generator=gen)
    tables = torch.randint(0, blocks, (seqs, width), dtype=torch.int32, generator=gen)
    lens = torch.randint(1, width * block + 1, (seqs,), dtype=torch.int32, generator=gen)
    return query, cache, tables, lens


@pytest.mark.parametrize("shape", [
    (1, 14, 2, 64, 16, 40, 8),  # Qwen2.5-0.5B's heads, batch 1
    (5, 8, 8, 32, 4, 30, 6),  # no GQA, blocks of 4
    (3, 12, 4, 40, 16, 20, 4),  # a head size the 16-wide vectors leave a tail of
    (2, 6, 3, 36, 8, 24, 12),  # a head size any vector width leaves a tail of, blocks of 8
    (16, 4, 1, 128, 16, 64, 50),  # 16 sequences, one KV head, up to 800 tokens of context
])
@pytest.mark.parametrize("window", [0, 7])
def test_library_matches_reference(library, shape, window):
    query, cache, tables, lens = _case(*shape)
    params = decode_attention.params(0.125, window)
    expected = torch.ops.kiln.decode_attention(query, cache, tables, lens, params)
    out = library(query, cache, tables, lens, params)[0]
    assert out.shape == query.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seqs, window", [(1, 0), (1, 1000), (3, 0), (2, 333)])
def test_long_contexts_split_into_spans_match_the_reference(library, seqs, window, threads):
    """Contexts of hundreds to thousands of tokens are split into spans (one per task, at least 128 tokens)
    whose partial softmaxes the kernel merges; batch 1 on one or two threads, unequal lengths, a window that
    starts inside a span, and a block table in no order all give the reference's numbers."""
    query, cache, tables, _ = _case(seqs, 14, 2, 64, 16, 260, 128, seed=seqs + window)
    lens = torch.tensor([2048, 131, 1500][:seqs], dtype=torch.int32)
    tables = torch.stack([torch.randperm(260, dtype=torch.int32)[:128] for _ in range(seqs)])
    params = decode_attention.params(0.125, window)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = library(query, cache, tables, lens, params)[0]
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, torch.ops.kiln.decode_attention(query, cache, tables, lens, params),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [
    (1, 14, 2, 64, 16, 40, 8),
    (3, 12, 4, 40, 16, 20, 4),  # a tail past the vectors
    (2, 6, 3, 36, 8, 24, 12),
])
@pytest.mark.parametrize("window", [0, 7])
def test_int8_cache_matches_the_reference_on_its_dequantized_values(library, shape, window):
    """An int8 cache (codes and a scale per row) gives what the fp32 kernel gives on the values the codes
    stand for, and what the op's reference gives on the int8 cache itself."""
    query, cache, tables, lens = _case(*shape)
    rows = quantize_rows(cache)
    assert rows.dtype == torch.int8 and rows.shape[-1] == shape[3] + 4
    params = decode_attention.params(0.125, window)
    out = library(query, rows, tables, lens, params)[0]
    on_values = library(query, dequantize_rows(rows, torch.float32), tables, lens, params)[0]
    torch.testing.assert_close(out, on_values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out, torch.ops.kiln.decode_attention(query, rows, tables, lens, params),
                               rtol=1e-5, atol=1e-5)
    assert not torch.equal(out, library(query, cache, tables, lens, params)[0])  # the codes were read, not fp32


def test_int8_long_context_on_two_threads(library):
    query, cache, _, _ = _case(2, 14, 2, 64, 16, 260, 128, seed=5)
    rows = quantize_rows(cache)
    lens = torch.tensor([2048, 700], dtype=torch.int32)
    tables = torch.stack([torch.randperm(260, dtype=torch.int32)[:128] for _ in range(2)])
    params = decode_attention.params(0.125, 0)
    torch.testing.assert_close(library(query, rows, tables, lens, params)[0],
                               torch.ops.kiln.decode_attention(query, rows, tables, lens, params), rtol=1e-5, atol=1e-5)


def test_one_token_of_context_is_its_value(library):
    query, cache, tables, lens = _case(2, 4, 2, 16, 4, 8, 2)
    lens = torch.tensor([1, 1], dtype=torch.int32)
    out = library(query, cache, tables, lens, decode_attention.params(1.0, 0))[0]
    values = cache[1, tables[:, 0].long(), 0]  # [seqs, kv_heads, d]: each head's one value
    torch.testing.assert_close(out, values.repeat_interleave(2, dim=1))


def test_attention_runs_the_library_for_decodes_only(library):
    """A batch of decodes in fp32 goes to the library; a batch with a prefill, or bf16, does not; the
    numbers are the same either way."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return library(*args)

    query, cache, tables, lens = _case(3, 4, 2, 16, 4, 16, 4)
    starts = torch.arange(4, dtype=torch.int32)
    out = attention_native(query, cache, starts, lens, tables, 0.25, 0, decode=counted)
    torch.testing.assert_close(out, attention_native(query, cache, starts, lens, tables, 0.25, 0))
    assert calls == [3]
    mixed = torch.tensor([0, 1, 3], dtype=torch.int32)  # the second sequence has two query tokens
    two = torch.tensor([5, 9], dtype=torch.int32)
    out = attention_native(query, cache, mixed, two, tables[:2], 0.25, 0, decode=counted)
    torch.testing.assert_close(out, attention_native(query, cache, mixed, two, tables[:2], 0.25, 0))
    attention_native(query.bfloat16(), cache.bfloat16(), starts, lens, tables, 0.25, 0, decode=counted)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)  # the same values, not row-major
    out = attention_native(strided, cache, starts, lens, tables, 0.25, 0, decode=counted)
    torch.testing.assert_close(out, attention_native(query, cache, starts, lens, tables, 0.25, 0))
    assert calls == [3]


def test_a_batch_of_decodes_skips_the_plan(library, monkeypatch):
    """The library needs none of the plan's masks and gathers: a batch of decodes is told by its
    query offsets alone, once per compiled forward, and a sequence with no query token is not taken
    for a decode."""
    attention = sys.modules["kiln.kernels.attention"]
    monkeypatch.setattr(attention, "_plan", lambda *args: pytest.fail("planned a batch of decodes"))
    query, cache, tables, lens = _case(3, 4, 2, 16, 4, 16, 4)
    starts = torch.arange(4, dtype=torch.int32)
    with attention.one_batch():
        for _ in range(2):  # the second layer finds the answer by the offsets' identity
            out = attention_native(query, cache, starts, lens, tables, 0.25, 0, decode=library)
    torch.testing.assert_close(out, library(query, cache, tables, lens, decode_attention.params(0.25, 0))[0])
    assert attention._all_decodes(starts, 3) and not attention._all_decodes(starts, 2)
    assert not attention._all_decodes(torch.tensor([0, 0, 2, 3], dtype=torch.int32), 3)  # 0, 2 and 1 tokens


def test_library_is_shipped_only_where_it_lowers(monkeypatch):
    """fp32 on CPU only, and never without its lowering: AOTInductor would otherwise build a library
    that calls the op's Python reference."""
    cpu = torch.device("cpu")
    assert libraries.attention_wanted(cpu, torch.float32)
    assert not libraries.attention_wanted(cpu, torch.bfloat16)
    assert not libraries.attention_wanted(torch.device("cuda"), torch.float32)
    monkeypatch.setattr(cpp_lowering, "register", lambda: False)
    assert not libraries.attention_wanted(cpu, torch.float32)
