"""Tool calls: the chat template shows the model its tools; the model writes calls in its family's
format, which `--tool-call-parser` names (vLLM's names), one module each; they are parsed here into
OpenAI's `tool_calls`, whole or as stream deltas, and a grammar in the same format holds required,
named and (in auto mode with a strict tool or `parallel_tool_calls` false) opened calls to the tools'
schemas."""

from kiln.runtime.tokenizer import Tokenizer
from kiln.server.tool_calls.format import CallParser, ToolFormat, held_back
from kiln.server.tool_calls.hermes import Hermes
from kiln.server.tool_calls.llama3_json import Llama3Json
from kiln.server.tool_calls.mistral import Mistral
from kiln.server.tool_calls.qwen3 import Qwen3

FORMATS: dict[str, type[ToolFormat]] = {f.name: f for f in (Hermes, Llama3Json, Mistral, Qwen3)}
"""By `--tool-call-parser` name."""


def tool_format(name: str, tokenizer: Tokenizer | None = None) -> ToolFormat:
    """The format `name` for a model with `tokenizer` (which says whether its marker is a special token)."""
    return FORMATS[name](tokenizer)


__all__ = ["FORMATS", "CallParser", "ToolFormat", "held_back", "tool_format"]
