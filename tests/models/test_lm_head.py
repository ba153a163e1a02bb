"""The opt-in int8 LM head: its logits track full precision's, its greedy tokens mostly agree, and it is
what both the eager and the compiled paths run once asked for."""

import pytest
import torch

from kiln import LLM, KilnError, SamplingParams
from kiln.models.lm_head import Int8Head
from tests.oracle import PROMPTS

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)


def test_int8_head_tracks_full_precision(demo_dirs):
    full = LLM(demo_dirs["llama"])
    int8 = LLM(demo_dirs["llama"], lm_head_quantization="int8")
    assert isinstance(int8.model.lm_head_kernel, Int8Head) and full.model.lm_head_kernel is None
    hidden = torch.randn(5, full.model_config.hidden_size)
    ref, got = full.model.compute_logits(hidden), int8.model.compute_logits(hidden)
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.02
    a, b = full.generate(PROMPTS, GREEDY), int8.generate(PROMPTS, GREEDY)
    same = sum(x == y for p, q in zip(a, b) for x, y in zip(p.token_ids, q.token_ids))
    assert same / sum(len(p.token_ids) for p in a) >= 0.75  # the trained demo: near ties decide the rest


def test_compiled_program_keeps_the_int8_head(demo_dirs, kiln_cache):
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, lm_head_quantization="int8")
    eager = LLM(demo_dirs["llama"], lm_head_quantization="int8")
    hidden = torch.randn(3, llm.model_config.hidden_size)
    # the artifact may ask for a packed fp32 head; the int8 head asked for wins
    torch.testing.assert_close(llm.engine.runner.compute_logits(hidden), eager.model.compute_logits(hidden))


def test_unknown_head_quantization_is_refused(demo_dirs):
    with pytest.raises(KilnError, match="unknown LM head quantization 'int4'; choose from int8"):
        LLM(demo_dirs["llama"], lm_head_quantization="int4")
