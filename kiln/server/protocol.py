"""The OpenAI-compatible API's wire format: request bodies (pydantic models, strict, refusing fields
kiln does not implement), the error shape, and how responses become JSON bytes.

Request bodies are parsed from bytes by pydantic's own JSON parser, off the event loop: it refuses a
lone surrogate escape (text no tokenizer can take) and gives positions for malformed JSON.
"""

import json
import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.errors import KilnError
from kiln.runtime.sampler import SEED_MAX, SEED_MIN, SamplingParams
from kiln.runtime.structured_output import StructuredOutput

TOKEN_ID = re.compile(r"[0-9]{1,10}")
"""A token id as a JSON object key (logit_bias): ASCII digits only, short enough for any vocabulary."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema", description="the JSON schema the output must match")
    strict: bool | None = Field(None, description="kiln's output always matches the schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _constraint(kind: str, value) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value)
    return StructuredOutput(kind, tuple(value) if kind == "choice" else value)


class SamplingRequest(BaseModel):
    """Fields completions and chat share. A field kiln does not implement is refused with a 400
    naming it (`extra="forbid"`): accepted and ignored, it would give wrong answers silently. JSON's
    NaN and Infinity extensions are refused too (`allow_inf_nan`)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX, description="choice i uses seed + i")
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string, as in JSON) -> bias in "
                                                "[-100, 100]")
    min_tokens: int = Field(0, ge=0)
    user: str | None = Field(None, description="an end-user id for the logs; it changes no output")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output matches")
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, description="a Lark or GBNF grammar")

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the request asks for, whichever field it came in."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput.json_object()))
        if rf is not None and rf.type == "json_schema":
            found.append(("response_format", StructuredOutput.json_schema(rf.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    found.append((f"structured_outputs.{name}", _constraint(name, value)))
            if so.json_object:
                found.append(("structured_outputs.json_object", StructuredOutput.json_object()))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", _constraint(name, value)))
        if len(found) > 1:
            raise KilnError(f"{found[0][0]} and {found[1][0]} both constrain the output: give one")
        return found[0][1] if found else None

    @property
    def sequences(self) -> int:
        """Sequences sampled per prompt: choice i's seed is seed + i."""
        return self.n

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                        prompt_logprobs: int | None = None,
                        structured_output: StructuredOutput | None = None) -> SamplingParams:
        """Choice `index`'s parameters; `structured_output` as `structured_output()` gave it (computed
        once per request, not per choice)."""
        stop = self.stop_strings
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(t): v for t, v in (self.logit_bias or {}).items()}, min_tokens=min(self.min_tokens, max_tokens),
            structured_output=structured_output,
        )

    @model_validator(mode="after")
    def _check_biases_and_seed(self):
        if any(not -100 <= v <= 100 for v in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not TOKEN_ID.fullmatch(t) for t in self.logit_bias or {}):
            raise ValueError("logit_bias keys must be token ids (non-negative integers of at most 10 digits)")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.sequences - 1):
            raise ValueError(f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], and choice i "
                             f"uses seed + i: with {self.sequences} choices at most {SEED_MAX - (self.sequences - 1)}")
        return self


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="the prompt before the completion, with its logprobs if logprobs is set")
    best_of: int | None = Field(None, ge=1, le=16, description="sample this many, return the n most likely")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: logprobs of the prompt tokens")
    suffix: str | None = Field(None, description="not supported: only null or empty")

    @property
    def sequences(self) -> int:
        return self.best_of or self.n

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix: kiln does not insert text (no fill-in-the-middle); leave it out")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ValueError("best_of > n cannot stream: the best choices are known only at the end")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot stream; ask without stream")
        if self.max_tokens == 0 and (self.stream or not self.echo):
            raise ValueError("max_tokens 0 generates nothing: set echo (without stream) to score the prompt, "
                             "or ask for >= 1")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None, max_length=0, description="not supported: only null or empty")
    tool_choice: Literal["none"] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every status the server answers with other than 200."""

    error: ErrorDetail


def validation_message(error: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic found in a `model` request body. A check of the
    whole body names its field first ("seed must be ..."), which becomes the param."""
    first = error.errors()[0] if error.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('msg', '')})", None
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return (f"`{param}` is not supported by kiln: leave it out (kiln refuses a field rather than "
                "ignore it)"), param
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:
        named = message.split(" ", 1)[0]
        return message, named if named in model.model_fields else None
    return f"{param}: {message}", param


LOGPROB_FLOOR = -9999.0
"""What a logprob of -inf is sent as (vLLM's value): JSON has no infinity."""


def to_json(payload) -> bytes:
    """`payload` as JSON bytes that every client can parse: a NaN becomes null and an infinity
    +-9999.0, where plain json.dumps would write `NaN` (not JSON) or refuse."""
    try:
        text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        text = json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return text.encode("utf-8", "replace")


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else math.copysign(-LOGPROB_FLOOR, value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
