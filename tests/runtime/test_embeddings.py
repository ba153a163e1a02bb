"""Embeddings from a compiled artifact: the final hidden states pooled (last token or mean) and
L2-normalized equal transformers' last hidden state, prompts split into chunks and batched with others."""

import pytest
import torch
import torch.nn.functional as F

from kiln import LLM, SamplingParams
from kiln.errors import KilnError
from tests.oracle import PROMPTS


@pytest.fixture(scope="module")
def chunked(demo_dirs, kiln_cache, llama_artifact) -> LLM:
    """The demo llama's artifact, running at most 16 tokens a step: a long prompt runs in chunks."""
    return LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, max_num_batched_tokens=16)


def _hf(hf_models, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        hidden = hf_models["llama"](torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
    return F.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_are_transformers_last_hidden_state_pooled(chunked, hf_models, pooling):
    texts = [" ".join(PROMPTS[:4]), PROMPTS[5], PROMPTS[2]]
    ids = [chunked.tokenizer.encode(t) for t in texts]
    assert len(ids[0]) > 32  # three chunks at least
    got = chunked.embed(texts, pooling=pooling)
    for i, vector in zip(ids, got):
        assert len(vector) == chunked.model_config.hidden_size
        assert torch.allclose(torch.tensor(vector), _hf(hf_models, i, pooling), atol=2e-4)
    # again, the long prompt's blocks now in the prefix cache (which mean pooling must not use)
    again = chunked.embed(texts[0], pooling=pooling)[0]
    assert torch.allclose(torch.tensor(again), torch.tensor(got[0]), atol=1e-5)


def test_embeddings_run_beside_generation(chunked):
    params = [SamplingParams(max_tokens=5, temperature=0, ignore_eos=True), SamplingParams(pooling="mean")]
    generated, embedded = chunked.generate([PROMPTS[0], PROMPTS[1]], params)
    assert len(generated.token_ids) == 5 and generated.embedding is None
    assert embedded.token_ids == [] and embedded.finish_reason == "stop"
    assert embedded.embedding == pytest.approx(chunked.embed(PROMPTS[1], pooling="mean")[0], abs=1e-5)
    with pytest.raises(KilnError, match="pooling must be one of last, mean"):
        SamplingParams(pooling="max")
