import math

import pytest
import torch

from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.runtime.kv_cache import (BlockAllocator, allocate_kv_caches, block_hashes, bytes_per_block,
                                   num_kv_blocks)

CFG = ModelConfig("LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=128, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4,
                  max_position_embeddings=128)


def test_allocator_hands_out_distinct_blocks_and_reuses_freed():
    alloc = BlockAllocator(6)
    a, b = alloc.allocate(2), alloc.allocate(3)
    assert len(set(a + b)) == 5 and alloc.num_free == 1
    with pytest.raises(KilnError, match="asked for 2, 1 free"):
        alloc.allocate(2)
    alloc.free(a)
    assert alloc.num_free == 3 and set(alloc.allocate(3)) >= set(a)
    assert alloc.allocate(0) == []


def test_prefix_cache_shares_full_blocks_until_evicted():
    alloc = BlockAllocator(4, prefix_caching=True)
    tokens = list(range(10))
    hashes = block_hashes(tokens, 4)
    assert len(hashes) == 2 and block_hashes(tokens[:4], 4) == hashes[:1]  # chained: prefixes agree
    assert block_hashes([9] + tokens[1:], 4)[1] != hashes[1]  # a different first block changes the second's hash
    first = alloc.allocate(3)
    for block, h in zip(first, hashes):
        alloc.register(block, h)
    assert alloc.lookup(hashes) == first[:2]  # shared while the first holder still runs
    alloc.free(first)
    alloc.free(first[:2])
    assert alloc.num_free == 4
    assert alloc.lookup(hashes[:1] + [12345]) == first[:1] and alloc.num_free == 3  # a hit leaves the free list
    alloc.free(first[:1])
    alloc.allocate(4)  # every block handed out again: the cached contents are gone
    assert alloc.lookup(hashes) == [] and (alloc.hits, alloc.queries) == (3, 6)


def test_block_count_respects_memory_and_need():
    per_block = bytes_per_block(CFG, 16, torch.float32)
    assert per_block == 2 * 16 * 2 * 16 * 4 * 3
    assert num_kv_blocks(CFG, 16, torch.float32, 10 * per_block, 10_000) == 10
    assert num_kv_blocks(CFG, 16, torch.float32, 1 << 30, 100) == 7


def test_an_int8_cache_holds_a_row_of_codes_and_a_scale():
    """Each head's row is head_dim int8 codes and 4 bytes of scale: for head_dim 16, 20 bytes where fp32 takes 64,
    so the same memory holds 3.2x the blocks."""
    assert bytes_per_block(CFG, 16, torch.int8) == 2 * 16 * 2 * (16 + 4) * 3
    budget = 100 * bytes_per_block(CFG, 16, torch.float32)
    assert num_kv_blocks(CFG, 16, torch.int8, budget, 10**6) == 320
    caches = allocate_kv_caches(CFG, 5, 16, torch.int8)
    assert caches[0].shape == (2, 6, 16, 2, 20) and caches[0].dtype == torch.int8 and not caches[0].any()


def test_kv_tensors_are_combined_and_zeroed():
    caches = allocate_kv_caches(CFG, 5, 16, torch.bfloat16)
    assert len(caches) == 3
    assert caches[0].shape == (2, 6, 16, 2, 16) and caches[0].dtype == torch.bfloat16  # + the scratch block
    assert not caches[0].any()


def test_block_hashes_are_chained_sha256():
    """Known answer: block i's hash is sha256(hash of block i-1 + its ids as little-endian int64)."""
    import hashlib
    import struct

    tokens = [1, 2, 3, 4, 70000, 6, 7, 8, 9]
    first = hashlib.sha256(struct.pack("<4q", 1, 2, 3, 4)).digest()
    second = hashlib.sha256(first + struct.pack("<4q", 70000, 6, 7, 8)).digest()
    assert block_hashes(tokens, 4) == [first, second]
    assert block_hashes(tokens, 4, start=1, parent=first) == [second]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_an_int8_cache_keeps_the_logprobs_of_the_model_dtypes(demo_dirs, arch):
    """Every prompt token's logprob over 300 tokens of context, read from an int8 cache and from the fp32 one:
    within a quarter of a nat, a hundredth on average (the demo's heads are 16 wide: each row's one scale
    covers few values), and the perplexity within 0.5%."""
    from kiln import LLM, SamplingParams
    from kiln.models.demo import corpus

    llm = LLM(demo_dirs[arch])
    ids = llm.tokenizer.encode(corpus())[:300]
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    full = torch.tensor(llm.generate([ids], params)[0].prompt_logprobs[1:])
    int8 = LLM(demo_dirs[arch], kv_cache_dtype="int8")
    assert int8.engine.runner.kv_caches[0].dtype == torch.int8
    quantized = torch.tensor(int8.generate([ids], params)[0].prompt_logprobs[1:])
    diff = (quantized - full).abs()
    assert 0 < diff.mean() < 1.5e-2 and diff.max() < 0.25, (diff.mean(), diff.max())
    assert abs(float(quantized.mean() - full.mean())) < math.log(1.005), (quantized.mean(), full.mean())
