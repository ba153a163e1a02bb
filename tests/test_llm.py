"""The foundation's acceptance tests: kiln equals Hugging Face transformers on the same weights."""

import pytest
import torch

from kiln import LLM, KilnError, SamplingParams
from tests.oracle import PROMPTS, hf_greedy

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def hf_reference(demo_dirs, hf_models):
    """Greedy tokens and logprobs from transformers for every architecture and prompt."""
    ref = {}
    for arch, model in hf_models.items():
        llm = LLM(demo_dirs[arch])
        ref[arch] = [hf_greedy(model, llm.tokenizer.encode(p), MAX_TOKENS) for p in PROMPTS]
    return ref


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize(
    "engine", [{}, {"max_num_seqs": 3, "max_num_batched_tokens": 16}], ids=["one-batch", "mixed-chunked"]
)
def test_greedy_equals_transformers(demo_dirs, hf_reference, arch, engine):
    """8 prompts of different lengths in one batch; `mixed-chunked` caps sequences and tokens per step
    so prompts are prefilled in chunks inside batches that also carry other sequences' decodes."""
    llm = LLM(demo_dirs[arch], **engine)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        steps.append([(n, n == s.num_pending) for s, n in
                      zip(batch.seqs, batch.num_tokens)])
        return batch

    llm.engine.scheduler.schedule = recording_schedule
    outs = llm.generate(PROMPTS, GREEDY)
    if engine:
        chunked = any(not done for step in steps for _, done in step)
        mixed = any({n == 1 for n, _ in step} == {True, False} for step in steps)
        assert chunked and mixed
    lengths = {len(o.prompt_token_ids) for o in outs}
    assert len(lengths) > 4 and max(lengths) > 16
    for out, (ref_tokens, ref_logprobs) in zip(outs, hf_reference[arch]):
        assert out.token_ids == ref_tokens
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_batched_equals_one_at_a_time(demo_dirs, arch):
    llm = LLM(demo_dirs[arch])
    batched = llm.generate(PROMPTS, GREEDY)
    for prompt, out in zip(PROMPTS, batched):
        single = llm.generate([prompt], GREEDY)[0]
        assert single.token_ids == out.token_ids
        assert single.logprobs == pytest.approx(out.logprobs, abs=1e-5)


def test_bfloat16_follows_transformers(demo_dirs):
    """bf16 rounding differs between batched and unbatched matmuls, so compare the first steps'
    logprobs loosely rather than whole greedy runs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(demo_dirs["llama"], dtype=torch.bfloat16).eval()
    llm = LLM(demo_dirs["llama"], dtype="bfloat16")
    prompt = llm.tokenizer.encode(PROMPTS[0])
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=5))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float().log_softmax(-1)
    assert out.token_ids[0] == int(ref.argmax())
    for token, lp in out.top_logprobs[0].items():
        assert lp == pytest.approx(float(ref[token]), abs=0.05)


def test_seeded_sampling_is_reproducible_and_batch_independent(demo_dirs):
    llm = LLM(demo_dirs["llama"])
    # the trained demo model is confident: a high temperature makes seeds matter
    p = SamplingParams(max_tokens=12, temperature=2.0, top_k=50, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[0]], p)[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batched = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2]], [others, p, others])[1].token_ids
    assert alone == batched
    other_seed = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=2.0, top_k=50, top_p=0.95, seed=99,
                                                                  ignore_eos=True))
    assert other_seed[0].token_ids != alone


def test_stop_string_cuts_text(demo_dirs):
    llm = LLM(demo_dirs["llama"])
    full = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    stop = full.text[5:8]
    assert len(stop) == 3 and stop.strip()
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_and_length(demo_dirs):
    llm = LLM(demo_dirs["llama"])
    full = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 10
    stop_at = full.token_ids[4]
    out = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    cut = full.token_ids.index(stop_at)
    assert out.token_ids == full.token_ids[: cut + 1]
    before, through = (llm.tokenizer.decode(full.token_ids[:n]) for n in (cut, cut + 1))
    assert out.text == before != through  # the stop token's text is left out (vLLM's rule)
    kept = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_at],
                                                     include_stop_str_in_output=True))[0]
    assert kept.text == through and kept.stop_reason == stop_at
    word = through[len(before) - 2:]  # a stop string ending in the stop token's text
    by_string = llm.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, stop=[word],
                                                          include_stop_str_in_output=True))[0]
    assert by_string.text == through and by_string.stop_reason == word


def test_max_model_len_caps_generation(demo_dirs):
    llm = LLM(demo_dirs["llama"], max_model_len=40)
    prompt = llm.tokenizer.encode(PROMPTS[2])
    assert len(prompt) < 40
    out = llm.generate([prompt], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(prompt) + len(out.token_ids) == 40
    with pytest.raises(KilnError, match="max_model_len is 40"):
        llm.generate([list(range(40))], SamplingParams())
    with pytest.raises(KilnError, match="prompt has at least 307693 tokens; max_model_len is 40"):
        llm.generate(["a b " * 1_000_000], SamplingParams())  # refused from its length, never tokenized


@pytest.mark.parametrize(
    "prompt, message",
    [([], "prompt is empty"), ([1, 99999], "token id 99999 is outside the vocabulary"), ([-1], "token id -1")],
)
def test_bad_prompts_are_rejected(demo_dirs, prompt, message):
    llm = LLM(demo_dirs["llama"])
    with pytest.raises(KilnError, match=message):
        llm.generate([prompt], SamplingParams())


def test_bad_sampling_params():
    with pytest.raises(KilnError, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(KilnError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.parametrize("field, value, message", [
    ("temperature", float("nan"), "temperature must be a finite number, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number, got inf"),
    ("top_p", float("nan"), "top_p must be a finite number"),
    ("repetition_penalty", "2", "repetition_penalty must be a finite number, got '2'"),
    ("seed", "x", "seed must be an integer, got 'x'"),
    ("max_tokens", 1.5, "max_tokens must be an integer, got 1.5"),
    ("logprobs", True, "logprobs must be an integer, got True"),
])
def test_sampling_params_refuse_nonsense_by_name(field, value, message):
    with pytest.raises(KilnError, match=message):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("value, message", [(0, "max_model_len must be >= 1, got 0"),
                                            (-5, "max_model_len must be >= 1, got -5"),
                                            (64.0, "max_model_len must be an integer, got 64.0")])
def test_llm_refuses_a_max_model_len_it_cannot_honour(demo_dirs, value, message):
    with pytest.raises(KilnError, match=message):
        LLM(demo_dirs["llama"], max_model_len=value)


def test_a_kv_cache_dtype_is_honoured_or_refused_by_name(demo_dirs):
    from kiln.config import parse_kv_cache_dtype

    with pytest.raises(KilnError, match="unknown KV cache dtype 'fp8'; choose from auto, int8"):
        LLM(demo_dirs["llama"], kv_cache_dtype="fp8")
    with pytest.raises(KilnError, match="--kv-cache-dtype int8 runs on CPU only"):
        parse_kv_cache_dtype("int8", torch.device("cuda"))
    assert parse_kv_cache_dtype("auto", torch.device("cuda")) is None
    assert parse_kv_cache_dtype("int8", torch.device("cpu")) == torch.int8


def test_one_bad_prompt_queues_nothing_and_the_next_call_is_whole(demo_dirs):
    """A batch with a prompt the engine refuses raises before any of it is queued, and leaves the
    engine as it was: the next call answers exactly what a fresh engine does."""
    llm = LLM(demo_dirs["llama"])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with pytest.raises(KilnError, match="token id 99999 is outside the vocabulary"):
        llm.generate(["The kiln", [99999]], params)
    assert not llm.engine.has_unfinished()
    again = llm.generate(["Clay and fire", "The kiln"], params)
    fresh = LLM(demo_dirs["llama"]).generate(["Clay and fire", "The kiln"], params)
    assert [o.token_ids for o in again] == [o.token_ids for o in fresh]


def test_an_interrupted_call_aborts_its_requests(demo_dirs, monkeypatch):
    """A call that fails mid-run (an interrupt, a failed batch) drops what it queued: nothing of it runs in the
    next call."""
    llm = LLM(demo_dirs["llama"])
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    step = llm.engine.step

    def interrupted():
        step()
        raise KeyboardInterrupt

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["The kiln", "Clay and fire"], params)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert [o.token_ids for o in llm.generate(["The kiln"], params)] == \
        [o.token_ids for o in LLM(demo_dirs["llama"]).generate(["The kiln"], params)]
