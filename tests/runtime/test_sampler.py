import pytest
import torch

from kiln.runtime.sampler import ARGMAX_BLOCK, SamplingParams, greedy, sample


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def test_greedy_and_logprobs():
    logits = torch.randn(3, 50)
    out = sample(logits, [SamplingParams(temperature=0, logprobs=3)] * 3, [None] * 3, _gen())
    assert out.token_ids == logits.argmax(-1).tolist()
    expect = logits.log_softmax(-1).max(-1).values
    assert out.logprobs == pytest.approx(expect.tolist(), abs=1e-6)
    assert all(len(t) == 3 and max(t.values()) == pytest.approx(lp) for t, lp in zip(out.top_logprobs, out.logprobs))


def test_top_k_and_top_p_restrict_the_support():
    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    top5 = set(logits[0].topk(5).indices.tolist())
    drawn = {sample(logits, [SamplingParams(temperature=1.5, top_k=5)], [None], _gen(i)).token_ids[0]
             for i in range(200)}
    assert drawn <= top5 and len(drawn) > 1
    probs = logits[0].softmax(-1)
    order = probs.argsort(descending=True)
    nucleus_size = int((probs[order].cumsum(0) < 0.5).sum()) + 1
    nucleus = set(order[:nucleus_size].tolist())
    drawn = {sample(logits, [SamplingParams(top_p=0.5)], [None], _gen(i)).token_ids[0] for i in range(200)}
    assert drawn <= nucleus and len(drawn) == len(nucleus)


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    gen = _gen(0)
    counts = torch.zeros(3)
    for _ in range(3000):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [None], gen).token_ids[0]] += 1
    torch.testing.assert_close(counts / 3000, logits[0].softmax(-1), atol=0.03, rtol=0)


def test_per_request_generator_wins_over_default():
    logits = torch.zeros(2, 1000)
    p = SamplingParams(temperature=1.0)
    a = sample(logits, [p, p], [_gen(7), None], _gen(1)).token_ids
    b = sample(logits, [p, p], [_gen(7), None], _gen(2)).token_ids
    assert a[0] == b[0] and a[1] != b[1]


def test_min_p_keeps_tokens_near_the_most_likely():
    logits = torch.tensor([[4.0, 3.5, 1.0, 0.0, -2.0]])
    probs = logits[0].softmax(-1)
    kept = {i for i in range(5) if probs[i] >= 0.2 * probs.max()}
    drawn = {sample(logits, [SamplingParams(temperature=1.0, min_p=0.2)], [None], _gen(i)).token_ids[0]
             for i in range(200)}
    assert drawn == kept == {0, 1}
    with pytest.raises(Exception, match="min_p"):
        SamplingParams(min_p=1.5)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("vocab", [ARGMAX_BLOCK * 40, ARGMAX_BLOCK * 40 + 7])
def test_greedy_is_argmax_with_its_ties_and_nans(rows, vocab):
    """The first index of the largest value, as torch.argmax: ties in one block and across blocks,
    NaN as the largest, and a vocabulary that is not a multiple of the block (torch's own argmax)."""
    torch.manual_seed(0)
    logits = torch.randn(rows, vocab)
    logits[0, [3, 5, ARGMAX_BLOCK * 7]] = 50.0
    if rows > 1:
        logits[1, [ARGMAX_BLOCK * 9 + 1, ARGMAX_BLOCK * 30]] = float("nan")
    assert torch.equal(greedy(logits), logits.argmax(-1))
    assert greedy(logits)[0] == 3
    assert torch.equal(greedy(logits[:, ::2]), logits[:, ::2].argmax(-1))  # not contiguous
