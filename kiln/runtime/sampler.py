"""Sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, and logprobs (penalties and
biases adjust the logits first: `penalties.py`)."""

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError
from kiln.runtime.structured_output import StructuredOutput


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops."""

    max_tokens: int = 16
    temperature: float = 1.0
    """0 means greedy (so does anything below 1e-5)."""
    top_k: int = -1
    """Keep the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    min_p: float = 0.0
    """Keep tokens at least this fraction as likely as the most likely one; 0 keeps all."""
    seed: int | None = None
    """Per-request seed, a signed 64-bit integer: the same seed gives the same tokens whatever else is
    in the batch."""
    stop: list[str] = field(default_factory=list)
    """Stop strings: generation ends when one appears; the text is cut before it."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Token ids that end generation; their text is left out of the output, as EOS's is."""
    include_stop_str_in_output: bool = False
    """Keep the stop string, or the stop token's text, at the end of the output (vLLM's field)."""
    ignore_eos: bool = False
    logprobs: int | None = None
    """None: no logprobs. 0: the chosen token's. k: also the k most likely tokens' at each step."""
    prompt_logprobs: int | None = None
    """None: none. 0: each prompt token's logprob given the tokens before it (the first token has
    none). k: also the k most likely tokens' at each prompt position."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token generated so far (OpenAI's and vLLM's formula)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it has been generated."""
    repetition_penalty: float = 1.0
    """Tokens of the prompt or the output: positive logits divided by it, negative ones multiplied."""
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits of these token ids."""
    min_tokens: int = 0
    """Until this many tokens are generated, EOS and `stop_token_ids` cannot be sampled and stop
    strings do not stop."""
    structured_output: StructuredOutput | None = None
    """Constrain the output to a JSON schema, a regex, a choice or a grammar; the request stops when
    it is complete."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text (vLLM's default); false keeps them, as a tool-call format whose
    marker is one (Mistral's `[TOOL_CALLS]`) needs. A stop token's or EOS's text is cut either way."""
    pooling: str | None = None
    """Embed the prompt instead of generating: the model's final hidden states pooled ("last": the last
    token's; "mean": their average over the prompt) and L2-normalized, as vLLM pools decoder models, in
    `RequestOutput.embedding`; no token is sampled."""

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("max_tokens", "top_k", "min_tokens", "seed", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            optional = name in ("seed", "logprobs", "prompt_logprobs")
            if (isinstance(value, bool) or not isinstance(value, int)) and not (optional and value is None):
                raise KilnError(f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise KilnError(f"{name} must be a finite number, got {value!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise KilnError(f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], got {self.seed}")
        if self.max_tokens < 1:
            raise KilnError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise KilnError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise KilnError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise KilnError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise KilnError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.logprobs is not None and self.logprobs < 0:
            raise KilnError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise KilnError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise KilnError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.01 <= self.repetition_penalty <= 100:  # beyond it, logits / penalty overflow to inf
            raise KilnError(f"repetition_penalty must be in [0.01, 100], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise KilnError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        self.logit_bias = {int(t): float(v) for t, v in self.logit_bias.items()}
        if any(not -100 <= v <= 100 for v in self.logit_bias.values()):
            raise KilnError("logit_bias values must be in [-100, 100]")
        if any(not s for s in self.stop):
            raise KilnError("stop strings must be non-empty")
        if self.pooling not in POOLINGS:
            raise KilnError(f"pooling must be one of {', '.join(p for p in POOLINGS if p)}, got {self.pooling!r}")
        if self.pooling is not None and (self.structured_output is not None or self.prompt_logprobs is not None):
            raise KilnError("an embedding (pooling) generates nothing: it takes no structured output or "
                            "prompt_logprobs")
        if self.structured_output is not None and self.min_tokens:
            raise KilnError("min_tokens cannot be combined with structured output: the grammar decides where the "
                            "output ends")


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
POOLINGS = (None, "last", "mean")
"""`SamplingParams.pooling`'s values: None generates."""
"""The seeds a request may give (vLLM's range); torch's generator refuses some outside it."""

GREEDY_BELOW = 1e-5
"""Temperatures under this sample greedily (as vLLM does): dividing by 1e-300 overflows the logits."""


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    """The chosen token's logprob, for the rows that asked for logprobs (None for the others)."""
    top_logprobs: list[dict[int, float] | None]
    failures: list[Exception | None]
    """Per row, why it has no token (its entry in `token_ids` is then meaningless), or None."""

    @classmethod
    def of(cls, token_ids: list[int]) -> "SampleResult":
        """Tokens alone: no logprobs, no failure."""
        return cls(token_ids, [None] * len(token_ids), [None] * len(token_ids), [None] * len(token_ids))


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Mask a row of logits to -inf outside its top-k, nucleus (top-p) and min-p sets."""
    if min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # mass before this token already exceeds top_p
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


ARGMAX_BLOCK = 128


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` of [rows, vocab], the same first index of the largest value (NaN counting as
    largest), in two short passes: the largest of each block of 128, then the block that holds the first.
    torch's CPU argmax over a long row is not vectorized; its max over blocks is, and so is this."""
    rows, vocab = logits.shape
    if vocab % ARGMAX_BLOCK or logits.device.type != "cpu" or not logits.is_contiguous():
        return logits.argmax(-1)
    blocks = logits.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)
    first = blocks.amax(-1).argmax(-1)
    return first * ARGMAX_BLOCK + blocks[torch.arange(rows), first].argmax(-1)


DRAW_BLOCK = 128
DRAW_FLOOR = 80.0
"""`draw` never draws a token this many nats or more below the row's most likely one (a probability
under 1.8e-35 each, 3e-30 for all of a 151936-token vocabulary): its weight would be a denormal
float, on which exp and sums run many times slower."""


def draw(logits: torch.Tensor, generators: list[torch.Generator]) -> list[int | None]:
    """One token per row of `logits` [rows, vocab] (-inf: never drawn; overwritten), with probability
    softmax(row), by inverse transform sampling: one uniform draw per row from its generator, found
    first among the sums of blocks of DRAW_BLOCK weights, then inside its block (cumulative sums in
    fp64). torch.multinomial draws an exponential per token instead, many times slower over a large
    vocabulary. Computed in place: a fresh [16, 151936] tensor costs more in page faults than in
    arithmetic. A row with nothing to draw (every logit -inf, or a NaN or inf among them) gets None,
    and its generator is left untouched."""
    rows, vocab = logits.shape
    shifted = logits.sub_(logits.amax(-1, keepdim=True))  # NaN throughout a row with a NaN or an inf
    floor = torch.tensor(-DRAW_FLOOR, device=logits.device).exp()
    weights = shifted.clamp_(min=-DRAW_FLOOR).exp_()
    weights = weights.masked_fill_(weights <= floor, 0.0)
    if vocab % DRAW_BLOCK:
        weights = torch.nn.functional.pad(weights, (0, DRAW_BLOCK - vocab % DRAW_BLOCK))
    blocks = weights.view(rows, -1, DRAW_BLOCK)
    cumulative = blocks.sum(-1).cumsum(-1, dtype=torch.float64)  # [rows, blocks]
    total = cumulative[:, -1]
    drawable = (torch.isfinite(total) & (total > 0)).tolist()
    good = [row for row, ok in enumerate(drawable) if ok]
    if len(good) < rows:
        if not good:
            return [None] * rows
        blocks, cumulative, total = blocks[good], cumulative[good], total[good]
        generators = [generators[row] for row in good]
    uniform = torch.cat([torch.rand(1, dtype=torch.float64, device=logits.device, generator=g) for g in generators])
    target = uniform * total
    block = _first_above(cumulative, target)
    before = torch.where(block > 0, cumulative.gather(1, (block - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inside = blocks[torch.arange(len(good), device=logits.device), block].cumsum(-1, dtype=torch.float64)
    drawn = iter((block * DRAW_BLOCK + _first_above(inside, target - before)).tolist())
    return [next(drawn) if ok else None for ok in drawable]


def _first_above(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative sum exceeds `target` (so never one of weight 0); where
    rounding left none above it, the last of weight > 0 (the first that reaches the row's total)."""
    index = torch.searchsorted(cumulative, target[:, None], right=True).squeeze(1)
    over = index >= cumulative.shape[1]
    if bool(over.any()):
        index = torch.where(over, (cumulative < cumulative[:, -1:]).sum(-1), index)
    return index


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
    adjusted: torch.Tensor | None = None,
) -> SampleResult:
    """Pick one token per row of fp32 logits [num_seqs, vocab], from `adjusted` where given (the
    logits after penalties, biases and grammar masks).

    Reported logprobs are of the model's raw distribution (before penalties, temperature and
    filtering, as vLLM's default), for the rows that ask for them only: a log-softmax over a large
    vocabulary costs a millisecond a row. A row with no token to pick fails alone (`SampleResult.failures`).
    """
    adjusted = logits if adjusted is None else adjusted
    best = greedy(adjusted)
    failures = _unsampleable(adjusted.gather(1, best[:, None]).squeeze(1))
    tokens = best.tolist()
    sampled = [row for row, p in enumerate(params) if p.temperature >= GREEDY_BELOW and failures[row] is None]
    if sampled:
        temperatures = torch.tensor([params[r].temperature for r in sampled], device=adjusted.device)
        scaled = (adjusted if len(sampled) == len(params) else adjusted[sampled]) / temperatures[:, None]
        for i, row in enumerate(sampled):
            p = params[row]
            if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0:
                scaled[i] = _filter(scaled[i], p.top_k, p.top_p, p.min_p)
        drawn = draw(scaled, [generators[r] or default_generator for r in sampled])
        for row, token in zip(sampled, drawn):
            if token is None:  # the largest logit is finite, so filtering keeps it: never expected
                failures[row] = RuntimeError("sampling found no token to draw after temperature and filtering")
            else:
                tokens[row] = token
    chosen: list[float | None] = [None] * len(params)
    top: list[dict[int, float] | None] = [None] * len(params)
    rows = [row for row, p in enumerate(params) if p.logprobs is not None and failures[row] is None]
    if rows:
        found, alts = token_logprobs(logits[rows], [tokens[r] for r in rows], [params[r].logprobs for r in rows])
        for row, value, alt in zip(rows, found, alts):
            chosen[row], top[row] = value, alt
    return SampleResult(tokens, chosen, top, failures)


def _unsampleable(peaks: torch.Tensor) -> list[Exception | None]:
    """Per row, from its largest adjusted logit: why no token can be picked from it, or None. Every
    logit -inf is the request's own doing (a KilnError); a NaN or inf is the model's."""
    failures: list[Exception | None] = [None] * len(peaks)
    if bool(torch.isfinite(peaks).all()):
        return failures
    for row, peak in enumerate(peaks.tolist()):
        if peak == float("-inf"):
            failures[row] = KilnError("no token can be sampled: every token is masked for this request (by "
                                      "stop_token_ids and EOS under min_tokens, or by its structured output)")
        elif not math.isfinite(peak):
            failures[row] = RuntimeError(f"the model's logits for this request hold {peak}: no token can be sampled")
    return failures


def token_logprobs(logits: torch.Tensor, tokens: list[int], tops: list[int], ranks: bool = False):
    """Per row of `logits`: the logprob of `tokens[row]`, and where `tops[row]` > 0 the `tops[row]`
    most likely tokens' (None where 0); with `ranks`, also each token's rank (1: the most likely)."""
    logprobs = logits.float().log_softmax(-1)
    picked = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    values = logprobs.gather(1, picked)
    alts: list[dict[int, float] | None] = [None] * len(tokens)
    for i, k in enumerate(tops):
        if k:
            vals, ids = logprobs[i].topk(min(k, logprobs.shape[-1]))
            alts[i] = dict(zip(ids.tolist(), vals.tolist()))
    found = values.squeeze(1).tolist()
    if ranks:
        return found, alts, ((logprobs > values).sum(-1) + 1).tolist()
    return found, alts
