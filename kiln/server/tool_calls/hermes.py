"""Hermes tool calls (Qwen2.5's, Hermes', kiln's fallback template's): the model writes
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` blocks, one per call, with text before and
after them."""

import re
from collections.abc import Callable

from kiln.server.protocol import Tool
from kiln.server.tool_calls.format import CallParser, ToolFormat, before_marker, decode_json, openai_call

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"\s*<tool_call>(.*?)</tool_call>", re.S)


def json_call(body: str) -> dict | None:
    """A block's JSON call in OpenAI's shape, or None if it is not {"name": str, "arguments": object}."""
    found = decode_json(body.strip(), 0)
    return openai_call(found[0]) if found is not None and found[1] == len(body.strip()) else None


class Hermes(ToolFormat):
    name, marker = "hermes", OPEN

    def parser(self, tools: list[Tool]) -> CallParser:
        return BlockParser(json_call)

    def calls_rule(self, call: str, many: bool) -> str:
        more = ' ("\\n" block)*' if many else ""
        return f'calls: block{more} "\\n"?\nblock: {self.opener} "\\n" {call} "\\n{CLOSE}"'

    def auto_grammar(self, call: str, parallel: bool) -> str:
        """Text, the calls opened in it, text that opens none after them."""
        calls_then_text = "block* TEXT" if parallel else "TEXT | block TEXT"
        return (f'start: {calls_then_text}\nblock: opened "\\n" {call} "\\n{CLOSE}"\n{self.opened_lexeme()}\n'
                f"{self.text_lexeme()}")


class BlockParser(CallParser):
    """Text before the first `<tool_call>` is content (less a tail that may begin one); each closed block
    whose body `read` makes a call is one; a block it does not, and whatever follows the calls when the
    answer ends, is content."""

    def __init__(self, read: Callable[[str], dict | None]) -> None:
        super().__init__()
        self.read = read
        self.sent = 0  # characters of the answer consumed
        self._in_calls = False
        self._scanned = 0  # where the search for the next `</tool_call>` goes on: each character read once

    def delta(self, text: str, finished: bool) -> dict:
        content, calls = "", []
        if not self._in_calls:
            content, self.sent, self._in_calls = before_marker(text, self.sent, OPEN, finished)
        while self._in_calls:
            close = text.find(CLOSE, max(self._scanned, self.sent))
            if close < 0:  # an open block: nothing to parse until it closes
                self._scanned = max(self.sent, len(text) - len(CLOSE) + 1)
                break
            self._scanned = close + len(CLOSE)
            block = _BLOCK.match(text, self.sent)  # stops at that close: it reads the block once
            if block is None:
                break
            call = self.read(block.group(1))
            if call is None:
                content += text[self.sent:block.end()]
            else:
                calls.append(call)
            self.sent = block.end()
        if finished and self.sent < len(text):
            rest = text[self.sent:]
            tail = rest.strip()
            call = self.read(tail[len(OPEN):]) if tail.startswith(OPEN) else None  # cut short: unclosed
            if call is not None:
                calls.append(call)
            elif tail:
                content += rest
            self.sent = len(text)
        return self.found(content, calls)
