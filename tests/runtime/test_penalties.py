"""Penalties and biases against their formulas, computed here one row and one token at a time."""

import math

import pytest
import torch

from kiln.runtime.penalties import adjust_logits, prepare
from kiln.runtime.sampler import SamplingParams

VOCAB = 50
EOS = {2}


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM's order and formulas, token by token."""
    row = logits.tolist()
    for t, v in p.logit_bias.items():
        row[t] += v
    if len(output) < p.min_tokens:
        for t in EOS | set(p.stop_token_ids):
            row[t] = -math.inf
    for t in set(prompt) | set(output):
        r = p.repetition_penalty
        row[t] = row[t] / r if row[t] > 0 else row[t] * r
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(row)


CASES = [
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(logit_bias={5: 100.0, 7: -100.0, 9: 0.25}),
    SamplingParams(min_tokens=4, stop_token_ids=[11]),
    SamplingParams(min_tokens=2, logit_bias={2: 3.0}, repetition_penalty=1.1, frequency_penalty=0.3,
                   presence_penalty=0.2),
    SamplingParams(),
]


def test_each_row_is_adjusted_by_its_own_formula():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(len(CASES), VOCAB, generator=g) * 3
    prompts = [torch.randint(0, VOCAB, (12,), generator=g).tolist() for _ in CASES]
    outputs = [torch.randint(0, VOCAB, (int(n),), generator=g).tolist()
               for n in torch.randint(0, 8, (len(CASES),), generator=g)]
    outputs[6] = [1, 3]  # below its min_tokens
    before = logits.clone()
    got = adjust_logits(logits, [prepare(p, EOS, prompt, VOCAB, logits.device) for p, prompt in zip(CASES, prompts)],
                         outputs)
    assert torch.equal(logits, before)  # logprobs are reported from the raw logits
    for i, p in enumerate(CASES):
        torch.testing.assert_close(got[i], reference(logits[i], p, prompts[i], outputs[i]), rtol=0, atol=1e-6)
    assert not torch.equal(got[:-1], logits[:-1]) and torch.equal(got[-1], logits[-1])
    assert got[6, 2] == -math.inf and got[6, 11] == -math.inf


def test_a_batch_asking_nothing_is_not_copied():
    logits = torch.randn(3, VOCAB)
    plain = [prepare(SamplingParams(), EOS, [1], VOCAB, logits.device)] * 3
    assert plain == [None] * 3 and adjust_logits(logits, plain, [[2]] * 3) is logits


@pytest.mark.parametrize("bad, message", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_out_of_range_values_are_refused(bad, message):
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match=message):
        SamplingParams(**bad)
