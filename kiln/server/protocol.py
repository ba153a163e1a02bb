"""The OpenAI-compatible API's wire format: request bodies (pydantic models, strict, refusing fields
kiln does not implement), the error shape, and how responses become JSON bytes.

Request bodies are parsed from bytes by pydantic's own JSON parser, off the event loop: it refuses a
lone surrogate escape (text no tokenizer can take) and gives positions for malformed JSON.
"""

import json
import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from kiln.errors import KilnError
from kiln.runtime.sampler import SEED_MAX, SEED_MIN, SamplingParams
from kiln.runtime.structured_output import StructuredOutput
from kiln.runtime.tokenizer import TEMPLATE_VARIABLES

class Strict(BaseModel):
    """A request object: strict types, and a key it does not know is refused (400 naming it)."""

    model_config = ConfigDict(extra="forbid", strict=True)


def _whole(value):
    """JSON has one number type: 5.0 is the integer 5 (JSON Schema says so), though 5.5 and "5" are not."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds):
    """An integer field within `bounds` (ge, le): strict, but a whole number written with a decimal point
    is taken. The bounds come before the validator, so that the schema states them."""
    return Annotated[int, Field(**bounds), BeforeValidator(_whole)]


Int = integer()
NonEmptyText = Annotated[str, Field(min_length=1)]

TOKEN_ID = re.compile(r"[0-9]{1,10}")
"""A token id as a JSON object key (logit_bias): ASCII digits only, short enough for any vocabulary."""
TokenIdKey = Annotated[str, Field(pattern=f"^{TOKEN_ID.pattern}$")]


def _only_token_id_keys(schema: dict) -> None:
    """pydantic states the key pattern as `patternProperties`, which lets other keys through: close it."""
    for kind in schema.get("anyOf", [schema]):
        if "patternProperties" in kind:
            kind["additionalProperties"] = False


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="vLLM's: usage so far in every chunk")


class JsonSchemaFormat(Strict):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema", description="the JSON schema the output must match")
    strict: bool | None = Field(None, description="kiln's output always matches the schema")


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self


_NULL = {"type": "null"}


def _at_most_one(free: dict[str, dict], branch: dict[str, dict] | None = None) -> dict:
    """JSON Schema: at most one field of `free` is other than its schema there (what asks for nothing);
    `branch` adds what must hold when that one is a given field. Written as branches, all fields free but
    one, which schemathesis' canonicalizer expands (it gives up on if/then chains or pairs of six)."""
    return {"anyOf": [{"properties": {g: s for g, s in free.items() if g != f},
                       **({"allOf": [(branch or {})[f]]} if f in (branch or {}) else {})} for f in free]}


def _unless(field: str, then: dict) -> dict:
    """JSON Schema: `field` absent or null, or `then`."""
    return {"anyOf": [{"properties": {field: _NULL}}, then]}


def _true(field: str) -> dict:
    return {"required": [field], "properties": {field: {"const": True}}}


_FREE_STRUCTURED = {"json": _NULL, "regex": _NULL, "choice": _NULL, "grammar": _NULL,
                    "json_object": {"not": {"const": True}}}
"""structured_outputs' fields when they constrain nothing."""


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: at most one of its constraints (the schema says so too)."""

    model_config = ConfigDict(json_schema_extra=_at_most_one(_FREE_STRUCTURED))

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, min_length=1)
    json_object: bool | None = None


def _constraint(kind: str, value) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value)
    return StructuredOutput(kind, tuple(value) if kind == "choice" else value)


_FREE = {"min_tokens": {"maximum": 0},  # a grammar decides where its output ends
         "response_format": {"anyOf": [_NULL, {"type": "object", "properties": {"type": {"const": "text"}}}]},
         "structured_outputs": {"anyOf": [_NULL, {"type": "object", "properties": _FREE_STRUCTURED}]},
         **{f"guided_{k}": _NULL for k in ("json", "regex", "choice", "grammar")}}
"""Each way of constraining the output (min_tokens among them: it and a grammar cannot both decide where
the output ends), when it asks for nothing: a request gives at most one other."""

_STREAM_OPTIONS_RULE = _unless("stream_options", _true("stream"))


class SamplingRequest(Strict):
    """Fields completions and chat share. A field kiln does not implement is refused with a 400
    naming it (`extra="forbid"`): accepted and ignored, it would give wrong answers silently. JSON's
    NaN and Infinity extensions are refused too (`allow_inf_nan`). The schema states the one-constraint
    rule, so that a client generating requests from it (schemathesis) sends only valid ones."""

    model_config = ConfigDict(allow_inf_nan=False, json_schema_extra={"allOf": [_at_most_one(_FREE),
                                                                                 _STREAM_OPTIONS_RULE]})

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: integer(ge=-1) = -1
    min_p: float = Field(0.0, ge=0, le=1)
    n: integer(ge=1, le=16) = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: NonEmptyText | list[NonEmptyText] | None = None
    stop_token_ids: list[Int] | None = None
    seed: integer(ge=SEED_MIN, le=SEED_MAX) | None = Field(None, description="choice i uses seed + i")
    ignore_eos: bool = False
    include_stop_str_in_output: bool = Field(False, description="vLLM's: keep the stop string or stop token's "
                                             "text at the end of the output")
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)
    logit_bias: dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, description="token id (a string, as in JSON) -> bias", json_schema_extra=_only_token_id_keys)
    min_tokens: integer(ge=0) = 0
    skip_special_tokens: bool = Field(True, description="vLLM's: leave special tokens out of the text")
    user: str | None = Field(None, description="an end-user id, in the request's DEBUG log line; it changes no output")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output matches")
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, min_length=1, description="a Lark or GBNF grammar")

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
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(t): v for t, v in (self.logit_bias or {}).items()}, min_tokens=min(self.min_tokens, max_tokens),
            structured_output=structured_output, skip_special_tokens=self.skip_special_tokens,
        )

    @model_validator(mode="after")
    def _check_sampling(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.sequences - 1):
            raise ValueError(f"seed must be a signed 64-bit integer, in [{SEED_MIN}, {SEED_MAX}], and choice i "
                             f"uses seed + i: with {self.sequences} choices at most {SEED_MAX - (self.sequences - 1)}")
        return self


TokenIds = Annotated[list[Int], Field(min_length=1)]


def _refuse_empty(value, name: str):
    """An empty text or token list, alone or in a list, refused before the union's own checks (which would
    name each type it is not)."""
    if value in ("", []) or (isinstance(value, list) and any(v in ("", []) for v in value)):
        raise ValueError(f"the {name} is empty: give text or at least one token id")
    return value


class CompletionRequest(SamplingRequest):
    model_config = ConfigDict(json_schema_extra={"allOf": [_at_most_one(_FREE), {"anyOf": [  # what may stream
        {"required": ["stream"], "properties": {"stream": {"const": True}, "prompt_logprobs": _NULL,
                                                "max_tokens": {"not": {"const": 0}}}},
        {"properties": {"stream": {"not": {"const": True}}, "stream_options": _NULL,
                        "max_tokens": {"not": {"const": 0}}}},
        {"required": ["echo"], "properties": {"stream": {"not": {"const": True}}, "stream_options": _NULL,
                                              "echo": {"const": True}}}]}]})
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1)] = Field(description="text, texts, token ids or lists of "
                                                                "them; none empty")
    max_tokens: integer(ge=0) | None = Field(16, description="0 only with echo: score the prompt, generate nothing")
    logprobs: integer(ge=0, le=20) | None = None
    echo: bool = Field(False, description="the prompt before the completion, with its logprobs if logprobs is set")
    best_of: integer(ge=1, le=16) | None = Field(None, description="sample this many, return the n most likely")
    prompt_logprobs: integer(ge=0, le=20) | None = Field(None, description="vLLM's: logprobs of the prompt tokens")
    suffix: str | None = Field(None, max_length=0, description="not supported: only null or empty")

    @property
    def sequences(self) -> int:
        return self.best_of or self.n

    @field_validator("prompt", mode="before")
    @classmethod
    def _not_empty(cls, prompt):
        return _refuse_empty(prompt, "prompt")

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


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str = Field(description="the arguments as a JSON text, as the model wrote them")


class ToolCall(Strict):
    """A call an assistant message made earlier in the conversation, sent back with the tool's result."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}, "tool_call_id": _NULL}},
        {"properties": {"role": {"const": "tool"}, "tool_calls": _NULL}},
        {"properties": {"tool_calls": _NULL, "tool_call_id": _NULL}}]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="the participant's name, passed to the chat template")
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant message's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    @model_validator(mode="after")
    def _check(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError(f"tool_calls belong to assistant messages, not {self.role} ones")
        if self.tool_call_id is not None and self.role != "tool":
            raise ValueError(f"tool_call_id belongs to tool messages, not {self.role} ones")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def for_template(self) -> dict:
        """The message as chat templates read it (transformers' shape): a call's arguments as an object."""
        message: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": c.type, "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text
    except RecursionError:  # Python's parser recurses per level: a 400, not the handler's 500
        raise KilnError("a tool call's arguments nest deeper than JSON can be read here") from None


class FunctionDefinition(Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments (default: any object)")
    strict: bool | None = Field(None, description="true: calls match the parameters schema, which a grammar "
                                "holds (in auto mode, each call the model opens)")


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    type: Literal["function"]
    function: NamedFunction


_TEMPLATE_RULE = {"anyOf": [{"properties": {"continue_final_message": {"not": {"const": True}}}},
                            {"required": ["add_generation_prompt"],
                             "properties": {"add_generation_prompt": {"const": False}}}]}
"""continue_final_message only with add_generation_prompt false (the prompt ends inside the final message)."""

TemplateKwargs = Annotated[dict, Field(json_schema_extra={"propertyNames": {"not": {"enum": sorted(TEMPLATE_VARIABLES)}}},
                                       description="more variables for the chat template (Qwen3's enable_thinking); "
                                       "not the ones the request itself gives it")]


CALLS_NEED_TOOLS = {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", "auto", None]}}},
                               {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}
"""tool_choice required or a named function only with tools."""


class ChatTemplateFields(Strict):
    """vLLM's fields that shape how the chat template renders the conversation."""

    add_generation_prompt: bool = Field(True, description="end the prompt with the template's opening of the "
                                        "assistant's turn")
    continue_final_message: bool = Field(False, description="end the prompt inside the final message, which the "
                                         "model goes on writing (needs add_generation_prompt false)")
    chat_template_kwargs: TemplateKwargs | None = None

    def template_options(self, **more) -> dict:
        """`Tokenizer.apply_chat_template`'s keyword arguments for these fields (and `more` template variables)."""
        kwargs = {**(self.chat_template_kwargs or {}), **{k: v for k, v in more.items() if v is not None}}
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message, "template_kwargs": kwargs}


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    model_config = ConfigDict(json_schema_extra={"allOf": [
        _at_most_one(_FREE), CALLS_NEED_TOOLS, _STREAM_OPTIONS_RULE, _unless("top_logprobs", _true("logprobs")),
        _TEMPLATE_RULE]})

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: integer(ge=1) | None = None
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: integer(ge=0, le=20) | None = Field(None, description="only with logprobs true")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default: auto with tools, none without; required and named calls are held to "
        "the tools' schemas by the grammar engine (a response format then has no text to shape)")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per answer, which a grammar "
                                      "holds")
    echo: bool = Field(False, description="vLLM's: an answer starts with the final message's text when that "
                       "message is the assistant's")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None, description="given to the chat template as `reasoning_effort`; templates that read it act on it")
    store: bool | None = Field(None, description="no effect: kiln keeps no completions (OpenAI's stored "
                               "completions); see docs/serving.md")
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, description="no effect: kiln keeps no completions; see docs/serving.md")
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = Field(
        None, description="no effect: one tier here; see docs/serving.md")

    @property
    def tool_mode(self) -> str:
        """none, auto, required, or the named function's name."""
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return choice.function.name
        return choice or ("auto" if self.tools else "none")

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        if isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required":
            names = [t.function.name for t in self.tools or ()]
            if not names:
                raise ValueError("tool_choice required or a named function needs tools")
            if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
                raise ValueError(f"tool_choice names `{self.tool_choice.function.name}`, which is not among the "
                                 f"tools ({', '.join(names)})")
        return self


_CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools")


class TokenizeRequest(Strict):
    """vLLM's /tokenize: a prompt, or a chat rendered by the chat template first."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": _NULL,
                                                **{f: _NULL for f in _CHAT_ONLY}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": _NULL},
         "allOf": [_TEMPLATE_RULE]}]})

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages "
                                            "(the template writes them)")
    add_generation_prompt: bool | None = Field(None, description="messages only; default true")
    continue_final_message: bool | None = Field(None, description="messages only; as in chat")
    chat_template_kwargs: TemplateKwargs | None = Field(None, description="messages only; as in chat")
    tools: list[Tool] | None = Field(None, max_length=128, description="messages only")
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _check(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give prompt or messages, one of them")
        given = [f for f in _CHAT_ONLY if getattr(self, f) is not None]
        if self.prompt is not None and given:
            raise ValueError(f"{', '.join(given)} go with messages, not prompt")
        return self

    def template_options(self) -> dict:
        return ChatTemplateFields(add_generation_prompt=self.add_generation_prompt is not False,
                                  continue_final_message=bool(self.continue_final_message),
                                  chat_template_kwargs=self.chat_template_kwargs).template_options()


class EmbeddingRequest(Strict):
    """OpenAI's /v1/embeddings: texts or token ids, each embedded whole (`--pooling` says how). A field
    it does not take (`dimensions`: kiln returns the model's hidden size) is refused by name."""

    model: str
    input: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=2048)] | TokenIds | \
        Annotated[list[TokenIds], Field(min_length=1, max_length=2048)] = Field(
            description="a text, texts, token ids or lists of them (at most 2048); none empty")
    encoding_format: Literal["float", "base64"] = Field("float", description="base64: each vector's float32 "
                                                        "bytes, little-endian")
    user: str | None = Field(None, description="an end-user id, in the request's DEBUG log line; it changes no output")

    @field_validator("input", mode="before")
    @classmethod
    def _not_empty(cls, value):
        return _refuse_empty(value, "input")


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[integer(ge=0)]


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="named for the status: BadRequestError, NotFoundError, InternalServerError, ...")
    param: str | None = None
    code: int = Field(description="the HTTP status")


class ErrorResponse(BaseModel):
    """vLLM's error shape, for every status the server answers with other than 200."""

    error: ErrorDetail


def validation_message(error: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(message, param) for the problem pydantic found in a `model` request body: the deepest one (of a
    union's members the one that got furthest, e.g. an unknown key in a content part), else the first.
    A check of the whole body names its field first ("seed must be ..."), which becomes the param."""

    def place(e: dict) -> list[str]:  # a key as the client sent it may be long: cut
        return [str(p)[:40] for p in e.get("loc", ()) if p != "body" and not _union_tag(p)]

    first = max(error.errors(), key=lambda e: len(place(e)), default={})
    loc = place(first)
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


def _union_tag(part) -> bool:
    """pydantic's name of the union member an error is about ("constrained-str", "list[int]", "str"): not
    a place in the body."""
    return isinstance(part, str) and (any(c in part for c in "[]-") or part in ("str", "int", "float", "bool", "dict"))


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
