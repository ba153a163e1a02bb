"""What every tool-call format shares: a call's JSON schema for the grammars, the call in OpenAI's shape,
the streaming parser's interface, and the grammar rules each format fills in.

A format's grammars hold the answer to calls (tool_choice required or a named function), or let text
through and hold each call the model opens (auto mode with a strict tool or `parallel_tool_calls` false:
vLLM's structural tags), or make it calls or a JSON response format. The marker that opens the calls is
matched as the tokenizer's special token where it is one (Mistral's `[TOOL_CALLS]`, Llama's
`<|python_tag|>`): the detokenizer then keeps special tokens so that the parser sees it."""

import json
import uuid
from abc import ABC, abstractmethod

from kiln.errors import KilnError
from kiln.runtime.structured_output import JSON_STYLE, StructuredOutput
from kiln.runtime.tokenizer import Tokenizer
from kiln.server.protocol import Tool


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`: held back from a stream."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def before_marker(text: str, sent: int, marker: str, finished: bool) -> tuple[str, int, bool]:
    """(the content from `sent` up to `marker` or the end, where it stops, whether the marker was found);
    while the answer runs, a tail that may begin the marker is held back."""
    start = text.find(marker, sent)
    end = start if start >= 0 else len(text) - (0 if finished else held_back(text, marker))
    return text[sent:end], end, start >= 0


def openai_call(call: object, keys: tuple[str, ...] = ("arguments",)) -> dict | None:
    """A model's call {"name": str, <one of keys>: object} in OpenAI's shape (arguments as a JSON string),
    or None if it has not that shape."""
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = next((call[k] for k in keys if k in call), None)
    if not isinstance(arguments, dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}


def decode_json(text: str, start: int) -> tuple[object, int] | None:
    """The JSON value at `text[start:]` and where it ends, or None while it is incomplete or not JSON."""
    try:
        return json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None


class CallParser(ABC):
    """One choice's growing answer split into content and whole calls, each sent once."""

    def __init__(self) -> None:
        self.calls = 0  # calls found so far

    @abstractmethod
    def delta(self, text: str, finished: bool) -> dict:
        """The content and calls that `text` (the answer so far) adds: {"content"?, "tool_calls"?}, each
        call with its stream `index`."""

    def found(self, content: str, calls: list[dict]) -> dict:
        """The delta of `content` and `calls`, the calls numbered on from the ones sent before."""
        result: dict = {"content": content} if content else {}
        if calls:
            result["tool_calls"] = [{"index": self.calls + i, **call} for i, call in enumerate(calls)]
            self.calls += len(calls)
        return result


class ToolFormat(ABC):
    """One model family's way of writing tool calls. `marker` opens the calls; `arguments` is the key its
    call JSON gives the arguments under."""

    name: str
    marker: str
    arguments = "arguments"

    def __init__(self, tokenizer: Tokenizer | None = None):
        self.special_id = tokenizer.special_token_id(self.marker) if tokenizer is not None else None
        """The marker's id where the tokenizer has it as a special token, else None (it is text)."""

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether answers with tools are detokenized with their special tokens, the marker among them."""
        return self.special_id is not None

    @property
    def opener(self) -> str:
        """The marker in a Lark grammar: its special token, or its text."""
        return f"<[{self.special_id}]>" if self.special_id is not None else json.dumps(self.marker)

    @abstractmethod
    def parser(self, tools: list[Tool]) -> CallParser:
        """A parser for one choice's answer."""

    def parse(self, text: str, tools: list[Tool]) -> tuple[str | None, list[dict]]:
        """A whole answer's (content or None, calls in OpenAI's message shape)."""
        found = self.parser(tools).delta(text, finished=True)
        if "tool_calls" not in found:
            return text, []
        calls = [{k: v for k, v in call.items() if k != "index"} for call in found["tool_calls"]]
        content = found.get("content")
        return (content if (content or "").strip() else None), calls

    def constraint(self, tools: list[Tool], mode: str, parallel: bool, answer: StructuredOutput | None = None
                   ) -> StructuredOutput | None:
        """The grammar of a required (`mode` "required") or named call; in auto mode, where a tool is strict
        or `parallel` is false, the grammar of free text in which each call, once the model opens one, is
        held to the tools' schemas; None otherwise (the calls parsed as written). In auto mode a JSON
        `answer` (the response format) takes the free text's place: the answer is calls, or that JSON; a
        required or named call leaves no text for `answer` to shape."""
        if mode == "none":
            return None
        holds = mode != "auto" or not parallel or any(t.function.strict for t in tools)
        if mode != "auto":
            answer = None
        elif answer is not None and answer.kind != "json":
            if not holds:
                return None  # the answer's constraint alone; calls are parsed from it as written
            raise KilnError("a strict tool or parallel_tool_calls false holds the calls by a grammar, which "
                            "constrains the output already: beside it only a JSON response format is taken, not a "
                            "regex, choice or grammar (structured_outputs, guided_*)")
        if answer is None and not holds:
            return None
        chosen = [t for t in tools if mode in ("required", "auto") or t.function.name == mode]
        defs: dict = {}
        calls = [self.call_schema(t, defs) for t in chosen]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        if defs:
            schema["$defs"] = defs
        schema["x-guidance"] = JSON_STYLE
        call = f"%json {json.dumps(schema)}"
        if answer is not None:
            shape = json.loads(answer.spec)
            shape.setdefault("x-guidance", JSON_STYLE)
            grammar = f"start: calls | answer\n{self.calls_rule(call, parallel)}\nanswer: %json {json.dumps(shape)}"
        elif mode == "auto":
            grammar = self.auto_grammar(call, parallel)
        else:
            grammar = f"start: calls\n{self.calls_rule(call, parallel and mode == 'required')}"
        return StructuredOutput("grammar", grammar)

    def call_schema(self, tool: Tool, defs: dict) -> dict:
        """{"name": the tool's, <arguments>: its parameters}; the parameters' `$defs` move to the root,
        where their `#/$defs/...` references point once the schema is nested."""
        params = dict(tool.function.parameters or {"type": "object"})
        for name, value in params.pop("$defs", {}).items():
            if defs.setdefault(name, value) != value:
                raise KilnError(f"tools define `$defs.{name}` twice, differently: give the definitions distinct names")
        return {"type": "object", "properties": {"name": {"const": tool.function.name}, self.arguments: params},
                "required": ["name", self.arguments], "additionalProperties": False}

    @abstractmethod
    def calls_rule(self, call: str, many: bool) -> str:
        """Lark rules defining `calls`: the marker and one call (`call` is its `%json` lexeme), or as many
        as the model writes if `many`."""

    @abstractmethod
    def auto_grammar(self, call: str, parallel: bool) -> str:
        """Free text in which calls, once opened, are held (one at most unless `parallel`)."""

    def text_lexeme(self) -> str:
        """Text that never spells the marker (as a special token, it cannot contain it at all)."""
        marker = _regex_literal(self.marker)
        return f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/"

    def opened_lexeme(self) -> str:
        """`opened`: text up to and with the marker. A lazy lexeme when the marker is text (it ends as soon as
        the marker is written); text then the special token otherwise, where the token ends the text."""
        if self.special_id is not None:
            return f"opened: TEXT {self.opener}"
        return f"opened[lazy]: /(?s:.*){_regex_literal(self.marker)}/"


def _regex_literal(text: str) -> str:
    """`text` matched literally in a Lark regex (/.../)."""
    return "".join("\\" + c if c in "\\.^$|?*+()[]{}/" else c for c in text)
