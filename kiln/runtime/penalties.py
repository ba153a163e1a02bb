"""What a request does to the logits before sampling: `logit_bias`, `min_tokens`, and the repetition,
frequency and presence penalties, with vLLM's formulas. Each request's share is prepared once when it
is admitted; a batch where no request asks for any pays nothing."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.sampler import SamplingParams


def needs_adjusting(p: SamplingParams) -> bool:
    return bool(p.logit_bias or p.min_tokens or p.presence_penalty or p.frequency_penalty
                or p.repetition_penalty != 1.0)


@dataclass(frozen=True)
class Adjustment:
    """One request's changes to its logits, as tensors built once when it is admitted: a request with a
    large `logit_bias` or many `stop_token_ids` pays for them there, not in every step it shares."""

    params: SamplingParams
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None
    banned: torch.Tensor | None
    """EOS and `stop_token_ids`: -inf until `min_tokens` tokens are generated."""
    in_prompt: torch.Tensor | None
    """[vocab] bool, the tokens of the prompt, for `repetition_penalty` (the prompt is not counted again
    each step)."""


def prepare(params: SamplingParams, eos_token_ids: set[int], prompt: Sequence[int], vocab: int,
            device: torch.device) -> Adjustment | None:
    """The request's `Adjustment`, or None when it changes nothing."""
    if not needs_adjusting(params):
        return None
    bias_ids = bias_values = banned = in_prompt = None
    if params.logit_bias:
        bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), device=device)
    if params.min_tokens:
        banned = torch.tensor(sorted(eos_token_ids | set(params.stop_token_ids)), dtype=torch.long, device=device)
    if params.repetition_penalty != 1.0:
        in_prompt = _counts([prompt], vocab, device)[0] > 0
    return Adjustment(params, bias_ids, bias_values, banned, in_prompt)


def adjust_logits(logits: torch.Tensor, adjustments: Sequence[Adjustment | None],
                  outputs: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits [rows, vocab] as the sampler should see them; `logits` itself is left as it is (its
    log-softmax is what logprobs report). For each row, in this order:

    - `logit_bias[t]` is added to token t's logit;
    - while fewer than `min_tokens` tokens are generated, EOS and `stop_token_ids` get -inf;
    - `repetition_penalty` r divides the positive logits of tokens seen in the prompt or the output by
      r and multiplies the others by r;
    - `frequency_penalty` f and `presence_penalty` p subtract f * count(t) + p * (count(t) > 0),
      counting t among the generated tokens only.
    """
    rows = [i for i, a in enumerate(adjustments) if a is not None]
    if not rows:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    params = {i: adjustments[i].params for i in rows}

    for i in rows:
        a = adjustments[i]
        if a.bias_ids is not None:
            out[i].index_add_(0, a.bias_ids, a.bias_values.to(out.dtype))
        if a.banned is not None and len(outputs[i]) < a.params.min_tokens:
            out[i].index_fill_(0, a.banned, float("-inf"))

    rep = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep:
        seen = (_counts([outputs[i] for i in rep], vocab, device) > 0) | torch.stack(
            [adjustments[i].in_prompt for i in rep])
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


def _counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts, from one scatter over the padded lists."""
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)  # padding counts in column `vocab`
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = torch.as_tensor(tokens, dtype=torch.long)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded.to(device), torch.ones(padded.shape, device=device))
    return counts[:, :vocab]
