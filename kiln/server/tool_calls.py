"""Tool calling in the Hermes format (Qwen2.5's, Hermes', kiln's fallback template's): the chat template
shows the model its tools, the model answers `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, and they are parsed here into OpenAI's `tool_calls`, whole or as stream deltas. With
`tool_choice` required or a named function, a grammar (llguidance's Lark with `%json`) holds the answer
to such blocks whose JSON matches the chosen tools' schemas, so the call always parses; in auto mode
with a strict tool or `parallel_tool_calls` false, a grammar lets text through and holds each call the
model opens (at most one without parallel calls)."""

import json
import re
import uuid

from kiln.errors import KilnError
from kiln.runtime.structured_output import JSON_STYLE, StructuredOutput
from kiln.server.protocol import Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.S)


def constraint(tools: list[Tool], mode: str, parallel: bool, answer: StructuredOutput | None = None
               ) -> StructuredOutput | None:
    """The grammar of a required (`mode` "required") or named call; in auto mode, where a tool is strict
    or `parallel` is false, the grammar of free text in which each call, once the model opens one, is
    held to the tools' schemas (vLLM's structural tags); None otherwise (the calls parsed as written).
    In auto mode a JSON `answer` (the response format) takes the free text's place: the answer is calls,
    or that JSON; a required or named call leaves no text for `answer` to shape."""
    if mode == "none":
        return None
    holds = mode != "auto" or not parallel or any(t.function.strict for t in tools)
    if mode != "auto":
        answer = None  # a required or named call leaves no text for a response format to shape
    elif answer is not None and answer.kind != "json":
        if not holds:
            return None  # the answer's constraint alone; calls are parsed from it as written
        raise KilnError("a strict tool or parallel_tool_calls false holds the calls by a grammar, which constrains "
                        "the output already: beside it only a JSON response format is taken, not a regex, choice or "
                        "grammar (structured_outputs, guided_*)")
    if answer is None and not holds:
        return None
    chosen = [t for t in tools if mode in ("required", "auto") or t.function.name == mode]
    defs: dict = {}
    calls = [_call_schema(t, defs) for t in chosen]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if defs:
        schema["$defs"] = defs
    schema["x-guidance"] = JSON_STYLE
    body = f'"\\n" %json {json.dumps(schema)} "\\n{CLOSE}"'
    if answer is not None:  # calls (one without parallel calls), or the answer
        shape = json.loads(answer.spec)
        shape.setdefault("x-guidance", JSON_STYLE)
        calls = 'call ("\\n" call)*' if parallel else "call"
        grammar = f'start: {calls} | answer\ncall: "{OPEN}" {body}\nanswer: %json {json.dumps(shape)}'
    elif mode == "auto":  # text, the calls opened in it, text that opens none after them
        calls_then_text = "call* TEXT" if parallel else "TEXT | call TEXT"
        grammar = (f"start: {calls_then_text}\ncall: opened {body}\nopened[lazy]: /(?s:.*){OPEN}/\n"
                   f"TEXT: /(?s:.*)/ & ~/(?s:.*){OPEN}(?s:.*)/")
    else:
        many = "+" if parallel and mode == "required" else ""
        grammar = f'start: call{many}\ncall: "{OPEN}" {body} "\\n"'
    return StructuredOutput("grammar", grammar)


def _call_schema(tool: Tool, defs: dict) -> dict:
    """{"name": the tool's, "arguments": its parameters}; the parameters' `$defs` move to the root, where
    their `#/$defs/...` references point once the schema is nested."""
    params = dict(tool.function.parameters or {"type": "object"})
    for name, value in params.pop("$defs", {}).items():
        if defs.setdefault(name, value) != value:
            raise KilnError(f"tools define `$defs.{name}` twice, differently: give the definitions distinct names")
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": params},
            "required": ["name", "arguments"], "additionalProperties": False}


def _parsed(block: str) -> dict | None:
    """One call in OpenAI's shape, or None if the block is not {"name": str, "arguments": object}."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}


def held_back(text: str, marker: str = OPEN) -> int:
    """How many characters at the end of `text` could begin `marker`: held back from a stream."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class ToolCallParser:
    """Splits one choice's growing answer into content and whole calls: text before the first
    `<tool_call>` is content (less a tail that may begin one); each closed block that parses is a call;
    a block that does not, and whatever follows the calls when the answer ends, is content."""

    def __init__(self) -> None:
        self.sent = 0  # characters of the answer consumed
        self.calls = 0  # calls found so far
        self._in_calls = False
        self._scanned = 0  # where the search for the next `</tool_call>` goes on: each character read once

    def delta(self, text: str, finished: bool) -> dict:
        """The content and calls that `text` (the answer so far) adds: {"content"?, "tool_calls"?}, each
        call with its stream `index`."""
        content, calls = "", []
        if not self._in_calls:
            start = text.find(OPEN, self.sent)
            end = start if start >= 0 else len(text) - (0 if finished else held_back(text))
            content, self.sent, self._in_calls = text[self.sent:end], end, start >= 0
        while self._in_calls:
            close = text.find(CLOSE, max(self._scanned, self.sent))
            if close < 0:  # an open block: nothing to parse until it closes
                self._scanned = max(self.sent, len(text) - len(CLOSE) + 1)
                break
            self._scanned = close + len(CLOSE)
            block = _BLOCK.match(text, self.sent)  # stops at that close: it reads the block once
            if block is None:
                break
            call = _parsed(block.group(1))
            if call is None:
                content += text[self.sent:block.end()]
            else:
                calls.append({"index": self.calls, **call})
                self.calls += 1
            self.sent = block.end()
        if finished and self.sent < len(text):
            rest = text[self.sent:]
            tail = rest.strip()
            call = _parsed(tail[len(OPEN):].strip()) if tail.startswith(OPEN) else None  # cut short: unclosed
            if call is not None:
                calls.append({"index": self.calls, **call})
                self.calls += 1
            elif tail:
                content += rest
            self.sent = len(text)
        found: dict = {}
        if content:
            found["content"] = content
        if calls:
            found["tool_calls"] = calls
        return found


def parse(text: str) -> tuple[str | None, list[dict]]:
    """A whole answer's (content or None, calls in OpenAI's message shape)."""
    found = ToolCallParser().delta(text, finished=True)
    if "tool_calls" not in found:
        return text, []
    calls = [{k: v for k, v in call.items() if k != "index"} for call in found.get("tool_calls", [])]
    content = found.get("content")
    return (content if (content or "").strip() else None), calls
