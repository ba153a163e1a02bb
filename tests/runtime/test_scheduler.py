"""Scheduling under pressure: chunked prefill, the sequence cap, and preemption when blocks run out
must not change what greedy decoding produces."""

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
