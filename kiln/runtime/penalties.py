"""What a request does to the logits before sampling: `logit_bias`, `min_tokens`, and the repetition,
frequency and presence penalties, with vLLM's formulas. Vectorized over the rows that ask for any of
them; a batch where none does pays nothing."""

from collections.abc import Sequence

import torch

from kiln.runtime.sampler import SamplingParams


def needs_adjusting(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


def adjust_logits(logits: torch.Tensor, params: Sequence[SamplingParams], prompts: Sequence[Sequence[int]],
                  outputs: Sequence[Sequence[int]], eos_token_ids: set[int]) -> torch.Tensor:
    """The logits [rows, vocab] as the sampler should see them; `logits` itself is left as it is (its
    log-softmax is what logprobs report). For each row, in this order:

    - `logit_bias[t]` is added to token t's logit;
    - while fewer than `min_tokens` tokens are generated, EOS and `stop_token_ids` get -inf;
    - `repetition_penalty` r divides the positive logits of tokens seen in the prompt or the output by
      r and multiplies the others by r;
    - `frequency_penalty` f and `presence_penalty` p subtract f * count(t) + p * (count(t) > 0),
      counting t among the generated tokens only.
    """
    rows = [i for i, p in enumerate(params) if needs_adjusting(p)]
    if not rows:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device

    bias = [(i, t, v) for i in rows for t, v in params[i].logit_bias.items()]
    if bias:
        r, t, v = zip(*bias)
        out.index_put_((_ids(r, device), _ids(t, device)), torch.tensor(v, dtype=out.dtype, device=device),
                       accumulate=True)

    banned = [(i, t) for i in rows if len(outputs[i]) < params[i].min_tokens
              for t in eos_token_ids | set(params[i].stop_token_ids)]
    if banned:
        r, t = zip(*banned)
        out[_ids(r, device), _ids(t, device)] = float("-inf")

    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        seen = _counts([list(prompts[i]) + list(outputs[i]) for i in rep], vocab, device) > 0
        penalty = torch.tensor([params[i].repetition_penalty for i in rep], dtype=out.dtype, device=device)[:, None]
        x = out[rep]
        out[rep] = torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)

    additive = [i for i in rows if params[i].frequency_penalty or params[i].presence_penalty]
    if additive:
        counts = _counts([outputs[i] for i in additive], vocab, device)
        freq = torch.tensor([params[i].frequency_penalty for i in additive], dtype=out.dtype, device=device)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in additive], dtype=out.dtype, device=device)[:, None]
        out[additive] -= freq * counts + pres * (counts > 0)
    return out


def _ids(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts, from one scatter over the padded lists."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # padding counts in column `vocab`
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]
