"""Reasoning models' thinking, told apart from their answer (vLLM's `--reasoning-parser`): the text
before `</think>`, after a `<think>` the model may write first, is `reasoning_content`; the rest is the
answer, which tool calls are then parsed from.

- `deepseek_r1`: DeepSeek-R1 and its distills, whose template opens the thinking itself: until
  `</think>` everything is reasoning.
- `qwen3`: Qwen3's thinking is optional (`enable_thinking`): without a leading `<think>` the text is
  all answer."""

from typing import Literal

from kiln.server.tool_calls.format import held_back

OPEN, CLOSE = "<think>", "</think>"
Parser = Literal["deepseek_r1", "qwen3"]
PARSERS: tuple[str, ...] = ("deepseek_r1", "qwen3")


def split(text: str, parser: Parser, finished: bool) -> tuple[str, str]:
    """(reasoning, answer) of an answer's text so far. While it runs, a tail that may begin `<think>` or
    `</think>` is in neither, so a stream never takes back what it sent."""
    lead = len(text) - len(text.lstrip())
    opened = text.startswith(OPEN, lead)
    if not opened and not finished and OPEN.startswith(text[lead:]) and text[lead:]:
        return "", ""  # it may be opening the thinking
    start = lead + len(OPEN) if opened else 0
    end = text.find(CLOSE, start)
    if end >= 0:
        return text[start:end], text[end + len(CLOSE):]
    if parser == "qwen3" and not opened:
        return "", text
    return (text[start:] if finished else text[start:len(text) - held_back(text[start:], CLOSE)]), ""


class ReasoningStream:
    """One choice's reasoning and answer deltas as its text grows."""

    def __init__(self, parser: Parser):
        self.parser, self.reasoning_sent = parser, 0

    def delta(self, text: str, finished: bool) -> tuple[str, str]:
        """(the new reasoning, the whole answer so far)."""
        reasoning, answer = split(text, self.parser, finished)
        new = reasoning[self.reasoning_sent:]
        self.reasoning_sent = max(self.reasoning_sent, len(reasoning))
        return new, answer
