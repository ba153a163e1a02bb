"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a regex, a
choice of strings or a Lark grammar, through llguidance.

llguidance was chosen by measurement against xgrammar (`benchmarks/structured_output.py`): it compiles
a schema in a small fraction of xgrammar's time (which each new schema's first token pays), and its
masks, though slower than xgrammar's, cost far below a decode step. It reads tokenizer.json itself, as kiln's tokenizer does, and brings
no other dependency. On CUDA its masks are computed while the GPU runs the step (`Engine.step`); they
are applied here with numpy and torch ops (llguidance's own helper calls `torch.compile`, which
serving never does)."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from kiln.errors import KilnError

Kind = Literal["json", "regex", "choice", "grammar"]

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Compact JSON, as vLLM emits it: flexible whitespace would let a model pad an object forever."""


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. `json`: a JSON schema (`{"type": "object"}` for any JSON
    object); `regex`; `choice`: one of these strings; `grammar`: Lark (or GBNF) text."""

    kind: Kind
    spec: str | tuple[str, ...]

    @classmethod
    def json_schema(cls, schema: dict | str) -> "StructuredOutput":
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> "StructuredOutput":
        return cls.json_schema({"type": "object"})


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and the ones that came."""

    def __init__(self, matcher) -> None:
        self._m = matcher

    def fill_mask(self, bitmask: torch.Tensor) -> None:
        """Write the allowed next tokens into `bitmask` (int32 words, one bit per token); releases the GIL."""
        self._m.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * bitmask.element_size())

    def accept(self, token: int) -> bool:
        return self._m.consume_token(token)

    def failure(self) -> KilnError | None:
        """Why llguidance gave up on this grammar (the first line of its error: it may append the whole
        grammar), or None. The request's own doing: a grammar too complex for it."""
        if not self._m.is_error():
            return None
        reason = self._m.get_error().strip().splitlines()[0][:500]
        return KilnError(f"structured output: llguidance stopped this request's grammar: {reason}")

    @property
    def done(self) -> bool:
        """The grammar is complete (or can go no further): the request stops here."""
        return self._m.is_stopped()


class GrammarBackend:
    """llguidance bound to one tokenizer and model vocabulary; each spec is compiled once (cached), and
    each request copies the compiled matcher."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json, self.vocab_size, self._eos = tokenizer_json, vocab_size, eos_token_ids

    @functools.cached_property
    def _tokenizer(self):
        import llguidance

        text = self._tokenizer_json.read_text()
        return llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self._eos or None)

    @functools.lru_cache(maxsize=256)
    def _grammar(self, spec: StructuredOutput) -> str:
        import llguidance

        try:
            if spec.kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=JSON_STYLE)
            elif spec.kind == "choice":
                grammar = llguidance.grammar_from("choice", json.dumps(list(spec.spec)))
            else:
                grammar = llguidance.grammar_from("regex" if spec.kind == "regex" else "grammar", spec.spec)
        except ValueError as e:
            raise KilnError(f"invalid {spec.kind} for structured output: {e}") from None
        bad, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer)
        if bad:
            raise KilnError(f"invalid {spec.kind} for structured output: {messages[0]}")
        return grammar

    def validate(self, spec: StructuredOutput) -> None:
        """Compile `spec` (a KilnError with llguidance's reason if it cannot be): done where the caller
        runs, a worker thread in the server, so that `matcher` on the engine thread only copies it."""
        self._prototype(spec)

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request: a copy of the compiled grammar's (microseconds, where building
        one took 30 ms for a 30 KB schema, once per sequence)."""
        return GrammarMatcher(self._prototype(spec).deep_copy())

    @functools.lru_cache(maxsize=64)
    def _prototype(self, spec: StructuredOutput):
        """The compiled matcher every request with `spec` copies; nothing ever advances it."""
        matcher = self._compile(self._grammar(spec))
        if matcher.is_error():
            raise KilnError(f"invalid {spec.kind} for structured output: {matcher.get_error()}")
        return matcher

    def _compile(self, grammar: str):
        """llguidance's default limits bound the work: the grammar's size and its lexer's states here, and
        each mask a step computes (lexer fuel 200k, 50k Earley items: under 20 ms), past which the
        request alone fails with llguidance's reason."""
        import llguidance

        return llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)


def fill_masks(matchers: list[GrammarMatcher], vocab_size: int) -> tuple[torch.Tensor, list[Exception | None]]:
    """[len(matchers), words] int32 bitmask of each matcher's allowed next tokens, and per matcher why
    it could not give one (its grammar too complex for llguidance, or any failure), or None: that
    request fails alone. One at a time: with the step's torch threads still spinning, llguidance's
    parallel executor measured slower."""
    bitmask = torch.zeros(len(matchers), (vocab_size + 31) // 32, dtype=torch.int32)
    errors: list[Exception | None] = [None] * len(matchers)
    for i, (row, matcher) in enumerate(zip(bitmask, matchers)):
        try:
            matcher.fill_mask(row)
            errors[i] = matcher.failure()
        except Exception as e:  # noqa: BLE001 - one request's grammar fails that request only
            errors[i] = e
    return bitmask, errors


def apply_masks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of `logits[rows]` to -inf, in place (logits past the bitmask's width too).
    The bits are unpacked by numpy (little-endian words: bit t of the row is token t)."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
    vocab = logits.shape[1]
    blocked = ~torch.from_numpy(bits[:, :vocab]).view(torch.bool).to(logits.device)
    if vocab > blocked.shape[1]:
        blocked = torch.cat([blocked, blocked.new_ones(len(rows), vocab - blocked.shape[1])], 1)
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(blocked, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(blocked, float("-inf")))
