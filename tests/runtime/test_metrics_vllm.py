"""The vLLM-named metrics routers and Grafana boards read beyond the basic ones (queue time, preemptions,
prefix-cache hits, the older aliases, the LoRA info gauge), fed by a real AsyncEngine over an eager
engine, each beside its kiln twin."""

import asyncio
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln import LLM, SamplingParams
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.metrics import Metrics
from tests.oracle import PROMPTS

MODEL = "demo-llama"
LABEL = {"model_name": MODEL}


def _samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}


def _get(metrics: Metrics, name: str, labels: dict[str, str] | None = None) -> float:
    """The sample's value; KeyError if it is not exported at all."""
    return _samples(metrics)[name, frozenset((labels or {}).items())]


def _serve(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams, together: bool) -> list:
    """Run the prompts through the started engine (all added at once, or one after the other); the
    finished outputs."""

    async def one_batch(batch: list[list[int]]) -> list:
        streams = await engine.add_all([(ids, params, None) for ids in batch])
        return [[out async for out in stream][-1] for stream in streams]

    async def main() -> list:
        if together:
            return await one_batch(prompts)
        return [out for ids in prompts for out in await one_batch([ids])]

    return asyncio.run(main())


@pytest.fixture(scope="module")
def eager(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_model_len=256)


def test_prefix_cache_queue_time_and_per_token_series(eager):
    assert eager.engine.config.enable_prefix_caching
    engine = AsyncEngine(eager.engine, model_name=MODEL)
    m = engine.metrics
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:request_queue_time_seconds_count", "vllm:time_per_output_token_seconds_count"):
        assert _get(m, name, LABEL) == 0  # exported before any request, as vLLM does
    prompt = eager.tokenizer.encode(PROMPTS[6] + " " + PROMPTS[2])
    assert len(prompt) > 33  # at least two full 16-token blocks to share
    engine.start()
    try:
        outs = _serve(engine, [prompt, prompt], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True),
                      together=False)
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outs] == [5, 5]
    cached = (len(prompt) - 1) // 16 * 16  # the second finds the first's full blocks; one token is recomputed
    for kiln_name, vllm_name, want in (("kiln_prefix_cache_queries_total", "vllm:prefix_cache_queries_total",
                                        2 * len(prompt)),
                                       ("kiln_prefix_cache_hits_total", "vllm:prefix_cache_hits_total", cached),
                                       ("kiln_num_preemptions_total", "vllm:num_preemptions_total", 0)):
        assert _get(m, kiln_name) == _get(m, vllm_name, LABEL) == want, kiln_name
    # one gap per token after each request's first, observed under both names
    gaps = _get(m, "vllm:time_per_output_token_seconds_count", LABEL)
    assert gaps == _get(m, "vllm:inter_token_latency_seconds_count", LABEL) == 2 * 4
    assert _get(m, "vllm:time_per_output_token_seconds_sum", LABEL) == pytest.approx(
        _get(m, "vllm:inter_token_latency_seconds_sum", LABEL))
    # one queue time per request, shorter than its time to the first token
    assert _get(m, "kiln_request_queue_time_seconds_count") == _get(
        m, "vllm:request_queue_time_seconds_count", LABEL) == 2
    queued = _get(m, "vllm:request_queue_time_seconds_sum", LABEL)
    assert 0 < queued < _get(m, "vllm:time_to_first_token_seconds_sum", LABEL)


def test_preemptions_are_counted_and_a_preempted_request_queues_once(demo_dirs):
    # 12 blocks of 16 tokens cannot hold eight growing sequences at once (see test_scheduler)
    tight = LLM(demo_dirs["llama"], max_model_len=128, kv_cache_memory_bytes=12 * 16 * 2 * 2 * 32 * 4 * 4,
                enable_prefix_caching=False)
    engine = AsyncEngine(tight.engine, model_name=MODEL)
    engine.start()
    try:
        prompts = [tight.tokenizer.encode(p) for p in PROMPTS]
        outs = _serve(engine, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), together=True)
    finally:
        engine.shutdown()
    assert all(len(o.token_ids) == 40 for o in outs)
    preemptions = tight.engine.scheduler.num_preemptions
    assert preemptions > 0
    m = engine.metrics
    assert _get(m, "kiln_num_preemptions_total") == _get(m, "vllm:num_preemptions_total", LABEL) == preemptions
    assert _get(m, "vllm:request_queue_time_seconds_count", LABEL) == len(PROMPTS)  # re-admissions are not counted
    assert _get(m, "vllm:prefix_cache_queries_total", LABEL) == _get(m, "vllm:prefix_cache_hits_total", LABEL) == 0
    # a server started later over the same engine counts from its own start
    assert _get(AsyncEngine(tight.engine).metrics, "kiln_num_preemptions_total") == 0


def test_gpu_cache_usage_is_the_kv_cache_usage():
    m = Metrics(MODEL)
    m.scheduler_state(running=3, waiting=1, kv_usage=0.375)
    assert _get(m, "vllm:gpu_cache_usage_perc", LABEL) == _get(m, "vllm:kv_cache_usage_perc", LABEL) == 0.375
    m.scheduler_state(running=0, waiting=0, kv_usage=0.0)
    assert _get(m, "vllm:gpu_cache_usage_perc", LABEL) == 0


def test_lora_requests_info_reads_as_vllm_without_adapters():
    before = time.time()
    m = Metrics(MODEL)
    labels = {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""}
    assert before <= _get(m, "vllm:lora_requests_info", labels) <= time.time()


def test_request_phases_parameters_and_step_sizes(eager):
    """vLLM v1's series its Grafana board reads: each step's token count, each request's prefill, decode and
    inference times, its n, max_tokens and longest choice; latency buckets up to vLLM's 7,680 s."""
    engine = AsyncEngine(eager.engine, model_name=MODEL)
    m = engine.metrics
    prompts = [eager.tokenizer.encode(p) for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=6, temperature=0)

    async def main() -> list:  # one request of two choices, one of one
        two = await engine.add_all([(prompts[0], params, None), (prompts[0], params, None)], n=2)
        one = await engine.add_all([(prompts[1], params, None)])
        return [[out async for out in stream][-1] for stream in two + one]

    engine.start()
    try:
        outs = asyncio.run(main())
    finally:
        engine.shutdown()
    generated = [len(o.token_ids) for o in outs]
    for name in ("iteration_tokens_total", "request_prefill_time_seconds", "request_params_n"):
        assert _get(m, f"kiln_{name}_sum") == _get(m, f"vllm:{name}_sum", LABEL), name
    # every prompt token runs once (the two choices' prompts each: no full block to share), and every generated
    # token but each sequence's last
    ran = sum(len(prompts[0 if i < 2 else 1]) + g - 1 for i, g in enumerate(generated))
    assert _get(m, "vllm:iteration_tokens_total_sum", LABEL) == ran
    assert 0 < _get(m, "vllm:iteration_tokens_total_count", LABEL) <= ran
    assert _get(m, "vllm:request_params_n_count", LABEL) == 2 and _get(m, "vllm:request_params_n_sum", LABEL) == 3
    assert _get(m, "vllm:request_max_num_generation_tokens_sum", LABEL) == max(generated[:2]) + generated[2]
    assert _get(m, "vllm:request_params_max_tokens_sum", LABEL) == 3 * 6
    prefill, decode, inference = (_get(m, f"vllm:request_{phase}_time_seconds_sum", LABEL)
                                  for phase in ("prefill", "decode", "inference"))
    assert _get(m, "vllm:request_decode_time_seconds_count", LABEL) == 3 and prefill > 0 and decode > 0
    assert inference == pytest.approx(prefill + decode)
    assert inference <= _get(m, "vllm:e2e_request_latency_seconds_sum", LABEL)
    assert _get(m, "vllm:e2e_request_latency_seconds_bucket", {**LABEL, "le": "7680.0"}) == 3
