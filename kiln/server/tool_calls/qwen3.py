"""Qwen3's tool calls: Hermes blocks (`<tool_call>` JSON `</tool_call>`), and inside them Qwen3-Coder's
XML as well, `<function=NAME>` with one `<parameter=KEY>value</parameter>` per argument, each value read
as its parameter's schema type says (a string stays text; numbers, booleans, objects and arrays are
JSON). Grammars hold calls to the JSON form, which both templates show the model."""

import json
import re

from kiln.server.protocol import Tool
from kiln.server.tool_calls.format import CallParser, openai_call
from kiln.server.tool_calls.hermes import BlockParser, Hermes, json_call

_FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)(?:</function>\s*)?$", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3(Hermes):
    name = "qwen3"

    def parser(self, tools: list[Tool]) -> CallParser:
        types = {t.function.name: {k: (v or {}).get("type") for k, v in
                                   ((t.function.parameters or {}).get("properties") or {}).items()} for t in tools}
        return BlockParser(lambda body: json_call(body) or _xml_call(body, types))


def _xml_call(body: str, types: dict[str, dict[str, object]]) -> dict | None:
    """A Qwen3-Coder call in OpenAI's shape, its arguments typed by the tool's parameter schema."""
    function = _FUNCTION.match(body)
    if function is None:
        return None
    name, params = function.group(1), types.get(function.group(1), {})
    arguments = {key: _typed(value, params.get(key)) for key, value in _PARAMETER.findall(function.group(2))}
    return openai_call({"name": name, "arguments": arguments})


def _typed(value: str, kind: object) -> object:
    """`value` as its schema `type` says: text for a string (or a type given as a list that holds
    "string"), else JSON where it parses (numbers, booleans, null, objects, arrays), else the text."""
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value
