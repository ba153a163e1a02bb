"""The Hermes tool-call grammars on their own: what each lets a model write, token by token through
llguidance, over a small trained tokenizer (the live server's round trips are in test_fidelity.py; the
other formats' grammars and parsers in test_tool_formats.py)."""

import json

import pytest

from kiln.models.demo import train_tokenizer
from kiln.errors import KilnError
from kiln.runtime.structured_output import GrammarBackend, StructuredOutput
from kiln.runtime.tokenizer import Tokenizer
from kiln.server.tool_calls import Hermes
from kiln.server.protocol import Tool

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}
HERMES = Hermes()
PLAIN = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def _call(name: str, arguments: dict) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def grammars(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    train_tokenizer().save(str(root / "tokenizer.json"))
    tokenizer = Tokenizer(root)
    backend = GrammarBackend(tokenizer.path, tokenizer._tok.get_vocab_size(), [0])

    def allows(tools: list[dict], parallel: bool, text: str, answer: StructuredOutput | None = None) -> bool:
        """Whether the auto-mode grammar (with a response format `answer`) lets a model write `text`, and stop."""
        spec = HERMES.constraint([Tool.model_validate(t) for t in tools], "auto", parallel, answer)
        matcher = backend.matcher(spec)
        accepted = all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))
        return accepted and matcher._m.is_accepting()  # end-of-sequence allowed here

    return allows


def test_auto_mode_holds_nothing_unless_a_tool_is_strict_or_calls_are_one():
    assert HERMES.constraint([Tool.model_validate(PLAIN)], "auto", True) is None
    assert HERMES.constraint([Tool.model_validate(PLAIN)], "auto", False) is not None
    assert HERMES.constraint([Tool.model_validate(WEATHER)], "auto", True) is not None


def test_strict_tools_in_auto_mode_let_text_through_and_hold_each_call(grammars):
    paris, oslo = _call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Oslo"})
    for text in ("It is sunny; no call needed.", "a < b and <tool_ca is not a call", f"Checking. {paris}",
                 f"{paris}\n{oslo}\nDone."):
        assert grammars([WEATHER, PLAIN], True, text), text
    for text in (_call("get_weather", {"city": "Rome"}), _call("get_weather", {}), _call("search", {"q": "x"}),
                 "<tool_call>\nnot json\n</tool_call>"):
        assert not grammars([WEATHER, PLAIN], True, text), text
    assert grammars([WEATHER, PLAIN], True, _call("get_time", {"zone": "UTC"}))  # held to its own schema


def test_one_call_at_most_without_parallel_calls(grammars):
    utc = _call("get_time", {"zone": "UTC"})
    assert grammars([PLAIN], False, f"Sure. {utc} That is all.")
    assert grammars([PLAIN], False, "Only text.")
    assert not grammars([PLAIN], False, f"{utc}\n{utc}")


def test_a_json_response_format_beside_tools_is_calls_or_that_json(grammars):
    """openai-agents' output_type with tools: the answer is the calls, or the JSON the format asks for."""
    sky = StructuredOutput.json_schema({"type": "object", "properties": {"sky": {"enum": ["sunny", "rainy"]}},
                                        "required": ["sky"], "additionalProperties": False})
    paris, oslo = _call("get_weather", {"city": "Paris"}), _call("get_weather", {"city": "Oslo"})
    for parallel, text, allowed in ((True, '{"sky": "sunny"}', True), (True, f"{paris}\n{oslo}", True),
                                    (False, paris, True), (False, f"{paris}\n{oslo}", False),
                                    (True, '{"sky": "green"}', False), (True, "It is sunny.", False),
                                    (True, f"{paris}\n{{\"sky\": \"sunny\"}}", False)):
        assert grammars([WEATHER], parallel, text, sky) is allowed, (parallel, text)
    for mode in ("required", "get_weather"):  # calls, and no text for the format to shape
        tools = [Tool.model_validate(WEATHER)]
        assert HERMES.constraint(tools, mode, True, sky) == HERMES.constraint(tools, mode, True)
    regex = StructuredOutput("regex", "a+")
    assert HERMES.constraint([Tool.model_validate(PLAIN)], "auto", True, regex) is None  # the regex alone
    with pytest.raises(KilnError, match="only a JSON response format is taken"):
        HERMES.constraint([Tool.model_validate(WEATHER)], "auto", True, regex)
