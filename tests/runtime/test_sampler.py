import pytest
import torch

from kiln.runtime.sampler import ARGMAX_BLOCK, DRAW_BLOCK, DRAW_FLOOR, SamplingParams, draw, greedy, sample


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
    assert torch.equal(logits, torch.tensor([[0.0, 1.0, 2.0]]))  # drawn from a copy: logprobs read the logits


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


def test_draw_follows_each_rows_distribution_and_never_a_masked_token():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")], [float("-inf"), 0.0, 0.0, float("-inf")]])
    gens = [_gen(1), _gen(2)]
    counts = torch.zeros(2, 4)
    for _ in range(4000):
        for row, token in enumerate(draw(logits.clone(), gens)):
            counts[row, token] += 1
    torch.testing.assert_close(counts / 4000, logits.softmax(-1), atol=0.03, rtol=0)
    assert counts[:, 3].sum() == 0 and counts[1, 0] == 0


def test_draw_at_the_top_of_the_range_takes_the_last_token_that_can_be_drawn(monkeypatch):
    """A uniform draw that rounds up to the rows' total weight finds no token above it: the last token
    of weight > 0 is taken, never a masked one past it."""
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), float("-inf")]])
    monkeypatch.setattr(torch, "rand", lambda *args, **kwargs: torch.ones(1, dtype=torch.float64))
    assert draw(logits, [_gen()]) == [2]


def test_rows_with_nothing_to_draw_get_none_and_leave_the_others_as_drawn_alone():
    """A NaN row and an all -inf row draw nothing and consume no random number; the good row gets
    the token it gets alone, from the same generator state."""
    inf = float("inf")
    logits = torch.tensor([[0.0, float("nan"), 1.0], [-inf, -inf, -inf], [0.3, 1.0, 0.2]])
    gens = [_gen(1), _gen(2), _gen(3)]
    alone = draw(logits[2:].clone(), [_gen(3)])[0]
    assert draw(logits.clone(), gens) == [None, None, alone]
    assert torch.equal(gens[0].get_state(), _gen(1).get_state())


def test_sample_fails_only_the_rows_with_no_token():
    """Every token masked is the request's doing (KilnError); a NaN in the logits is the model's. The
    other rows, greedy or sampled, get the tokens they get alone."""
    from kiln.errors import KilnError

    inf = float("inf")
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    logits[1] = -inf
    logits[2, 17] = float("nan")
    params = [SamplingParams(temperature=0.8, seed=5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2)]
    gens = [_gen(5), _gen(6), None, None]
    result = sample(logits.clone(), params, gens, _gen(0))
    assert isinstance(result.failures[1], KilnError) and "every token is masked" in str(result.failures[1])
    assert isinstance(result.failures[2], RuntimeError) and "nan" in str(result.failures[2])
    assert result.failures[0] is None and result.failures[3] is None
    assert result.token_ids[0] == sample(logits[:1].clone(), params[:1], [_gen(5)], _gen(0)).token_ids[0]
    assert result.token_ids[3] == int(logits[3].argmax()) and result.logprobs[3] is not None


@pytest.mark.parametrize("vocab", [DRAW_BLOCK * 3, DRAW_BLOCK * 3 + 5])
def test_draw_across_blocks_matches_the_distribution(vocab):
    """Weights spread over several blocks (and a vocabulary that is not whole blocks): each token's
    frequency is its probability; tokens DRAW_FLOOR nats below the top are never drawn."""
    logits = torch.full((1, vocab), float("-inf"))
    picks = [0, DRAW_BLOCK - 1, DRAW_BLOCK + 3, vocab - 1]
    logits[0, picks] = torch.tensor([0.5, 0.0, 1.0, 0.2])
    logits[0, 7] = -DRAW_FLOOR - 1.0
    gen, counts = _gen(3), torch.zeros(vocab)
    for _ in range(6000):
        counts[draw(logits.clone(), [gen])[0]] += 1
    torch.testing.assert_close(counts[picks] / 6000, logits[0, picks].softmax(-1), atol=0.03, rtol=0)
    assert counts.sum() == counts[picks].sum()
