"""Mistral's tool calls: after text (or none), `[TOOL_CALLS]` then a JSON array of
{"name": ..., "arguments": {...}} (the v0.3 template's form), or, from the v11 tokenizer on, one
`[TOOL_CALLS]name[ARGS]{...}` per call (v13 adds `[CALL_ID]id` before `[ARGS]`). The calls end the
answer. Grammars hold calls to the array form."""

import re

from kiln.server.protocol import Tool
from kiln.server.tool_calls.format import CallParser, ToolFormat, before_marker, decode_json, openai_call

MARKER = "[TOOL_CALLS]"
_NAMED = re.compile(r"([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?\[ARGS\]")


class Mistral(ToolFormat):
    name, marker = "mistral", MARKER

    def parser(self, tools: list[Tool]) -> CallParser:
        return MistralParser()

    def calls_rule(self, call: str, many: bool) -> str:
        more = ' ("," " " call)*' if many else ""
        return f'calls: {self.opener} "[" call{more} "]"\ncall: {call}'

    def auto_grammar(self, call: str, parallel: bool) -> str:
        more = ' ("," " " call)*' if parallel else ""
        return (f'start: TEXT | opened "[" call{more} "]"\ncall: {call}\n{self.opened_lexeme()}\n'
                f"{self.text_lexeme()}")


class MistralParser(CallParser):
    """Text before `[TOOL_CALLS]` is content (less a tail that may begin it); after it, each array or
    `name[ARGS]{...}` call is sent once whole. What does not parse as calls when the answer ends is content."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self._in_calls = False
        self._tried = 0  # JSON is decoded again only once a closing bracket has come since

    def delta(self, text: str, finished: bool) -> dict:
        content, calls = "", []
        if not self._in_calls:
            content, self.sent, self._in_calls = before_marker(text, self.sent, MARKER, finished)
        while self._in_calls:
            at = self.sent
            while True:  # past whitespace and markers
                stripped = len(text) - len(text[at:].lstrip())
                at = stripped + len(MARKER) if text.startswith(MARKER, stripped) else stripped
                if at == stripped:
                    break
            if at == len(text) or not any(c in "]}" for c in text[max(self._tried, at):]):
                break
            named = None if text[at] == "[" else _NAMED.match(text, at)
            value = decode_json(text, named.end() if named else at) if text[at] == "[" or named else None
            if value is None:
                self._tried = len(text)
                break
            found = [openai_call(c) for c in value[0]] if named is None and isinstance(value[0], list) else \
                [openai_call({"name": named.group(1), "arguments": value[0]})] if named else [None]
            if not found or None in found:  # not calls: the text stays content
                content += text[self.sent:value[1]]
            else:
                calls += found
            self.sent = value[1]
        if finished and self.sent < len(text):
            rest = text[self.sent:]
            if rest.strip() and rest.strip() != MARKER:
                content += rest
            self.sent = len(text)
        return self.found(content, calls)
