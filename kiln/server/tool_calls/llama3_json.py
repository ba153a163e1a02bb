"""Llama 3.x JSON tool calls: an answer that starts with `{` (or Llama's `<|python_tag|>`) is calls,
{"name": ..., "parameters": {...}} objects separated by `;` ("arguments" is read too); any other answer
is text. Grammars hold calls to "parameters", which Llama's template asks for."""

from kiln.server.protocol import Tool
from kiln.server.tool_calls.format import CallParser, ToolFormat, decode_json, openai_call

PYTHON_TAG = "<|python_tag|>"


class Llama3Json(ToolFormat):
    name, marker, arguments = "llama3_json", PYTHON_TAG, "parameters"

    def parser(self, tools: list[Tool]) -> CallParser:
        return Llama3Parser()

    def calls_rule(self, call: str, many: bool) -> str:
        more = ' ("; " call)*' if many else ""
        return f"calls: call{more}\ncall: {call}"

    def auto_grammar(self, call: str, parallel: bool) -> str:
        """Calls, or text that does not start as they do."""
        return (f"start: calls | TEXT\n{self.calls_rule(call, parallel)}\n"
                r"TEXT: /(?s:.*)/ & ~/\s*(\{|<\|python_tag\|>)(?s:.*)/")


class Llama3Parser(CallParser):
    """Undecided while the answer is whitespace or may still be `<|python_tag|>`; then either all text,
    streamed as it comes, or calls, each sent once its object closes (an object that is not a call, and
    whatever cannot be read as calls when the answer ends, is content)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.mode: str | None = None  # "text" or "calls" once decided
        self._tried = 0  # JSON is decoded again only once a `}` has come since

    def delta(self, text: str, finished: bool) -> dict:
        content, calls = "", []
        if self.mode is None:
            head = text.lstrip()
            if head.startswith(PYTHON_TAG) or head.startswith("{"):
                self.mode = "calls"
                self.sent = len(text) - len(head) + (len(PYTHON_TAG) if head.startswith(PYTHON_TAG) else 0)
            elif finished or (head and not PYTHON_TAG.startswith(head)):
                self.mode = "text"
        if self.mode == "text":
            content, self.sent = text[self.sent:], len(text)
        while self.mode == "calls":
            at = len(text) - len(text[self.sent:].lstrip(" \t\r\n;"))
            if at == len(text) or text[at] != "{" or "}" not in text[max(self._tried, at):]:
                break
            value = decode_json(text, at)
            if value is None:
                self._tried = len(text)
                break
            call = openai_call(value[0], ("parameters", "arguments"))
            if call is None:
                content += text[self.sent:value[1]]
            else:
                calls.append(call)
            self.sent = value[1]
        if finished and self.sent < len(text):
            if text[self.sent:].strip():
                content += text[self.sent:]
            self.sent = len(text)
        return self.found(content, calls)
