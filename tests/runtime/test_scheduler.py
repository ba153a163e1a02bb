"""Scheduling under pressure: chunked prefill, the sequence cap, and preemption when blocks run out
must not change what greedy decoding produces."""

import torch

from kiln import LLM, SamplingParams
from kiln.config import EngineConfig
from kiln.runtime.sampler import SamplingParams as SP
from kiln.runtime.scheduler import Scheduler, Sequence
from tests.oracle import PROMPTS


def test_budget_cap_and_chunking():
    sched = Scheduler(EngineConfig(block_size=4, max_num_seqs=2, max_num_batched_tokens=10), num_blocks=100)
    seqs = [Sequence(str(i), list(range(7)), SP()) for i in range(3)]
    for s in seqs:
        sched.add(s)
    batch = sched.schedule()
    assert batch.seqs == seqs[:2] and batch.num_tokens == [7, 3]  # second prompt chunked, third waits
    assert [len(s.block_ids) for s in seqs[:2]] == [2, 1]
    assert len(sched.waiting) == 1


def test_preemption_keeps_greedy_outputs(demo_dirs):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    roomy = LLM(demo_dirs["llama"]).generate(PROMPTS, params)
    # 12 blocks of 16 tokens cannot hold eight growing sequences at once
    tight = LLM(demo_dirs["llama"], max_model_len=128, kv_cache_memory_bytes=12 * 16 * 2 * 2 * 32 * 4 * 4)
    assert tight.engine.scheduler.allocator.num_blocks == 12
    outs = tight.generate(PROMPTS, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    assert tight.engine.scheduler.allocator.num_free == 12  # every block came back


def test_prefix_caching_skips_the_shared_prefix_and_keeps_outputs(demo_dirs):
    shared = PROMPTS[6]  # 30+ tokens: at least one full 16-token block
    prompts = [shared, shared + " Then", shared + " And the"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    off = LLM(demo_dirs["llama"], enable_prefix_caching=False)
    want = [off.generate(p, params)[0] for p in prompts]
    assert off.engine.scheduler.allocator.hits == 0
    llm = LLM(demo_dirs["llama"])
    forward, sizes = llm.engine.runner.forward, []
    llm.engine.runner.forward = lambda ids, *rest: sizes.append(len(ids)) or forward(ids, *rest)
    got = []
    for p in prompts:
        sizes.clear()
        got.append(llm.generate(p, params)[0])
        prompt_len = len(got[-1].prompt_token_ids)
        cached = 0 if p is shared else len(llm.tokenizer.encode(shared)) // 16 * 16  # the shared full blocks
        assert sizes[0] == prompt_len - min(cached, (prompt_len - 1) // 16 * 16)  # the prefill skips cached blocks
    assert llm.engine.scheduler.allocator.hits >= 2
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-4, rtol=0)
