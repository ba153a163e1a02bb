"""Each `--tool-call-parser` format: its parser on whole and streamed answers, its grammars through
llguidance (the marker as text, and as the special token real Mistral and Llama tokenizers have), the
detokenizer keeping that token, and a live app's calls in each format."""

import json

import httpx
import pytest

from kiln import LLM
from kiln.config import ServerConfig
from kiln.models.demo import train_tokenizer
from kiln.runtime.structured_output import GrammarBackend
from kiln.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from kiln.server.protocol import Tool
from kiln.server.tool_calls import FORMATS, tool_format
from tests.server.live import live_app

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}}
TOOLS = [Tool.model_validate(WEATHER)]
PARIS, OSLO = {"city": "Paris"}, {"city": "Oslo", "days": 3}
CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {  # what a live demo model calls
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}}


def _json(name: str, arguments: dict, key: str = "arguments") -> str:
    return json.dumps({"name": name, key: arguments})


# (format, answer, its content, its calls as (name, arguments))
ANSWERS = [
    ("hermes", f"Checking. <tool_call>\n{_json('get_weather', PARIS)}\n</tool_call>", "Checking. ",
     [("get_weather", PARIS)]),
    ("qwen3", f"<tool_call>\n{_json('get_weather', PARIS)}\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", None,
     [("get_weather", PARIS), ("get_weather", OSLO)]),  # JSON, and Qwen3-Coder's XML typed by the schema
    ("mistral", f"Sure. [TOOL_CALLS][{_json('get_weather', PARIS)}, {_json('get_weather', OSLO)}]", "Sure. ",
     [("get_weather", PARIS), ("get_weather", OSLO)]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{json.dumps(PARIS)}[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]'
     f'{json.dumps(OSLO)}', None, [("get_weather", PARIS), ("get_weather", OSLO)]),  # the v11 and v13 forms
    ("llama3_json", f"{_json('get_weather', PARIS, 'parameters')}; {_json('get_weather', OSLO)}", None,
     [("get_weather", PARIS), ("get_weather", OSLO)]),
    ("llama3_json", f"<|python_tag|>{_json('get_weather', PARIS, 'parameters')}", None, [("get_weather", PARIS)]),
    # not calls: text, whatever the format
    ("llama3_json", 'It is {"name": "x"} sunny.', 'It is {"name": "x"} sunny.', []),
    ("llama3_json", '{"weather": "sunny"}', '{"weather": "sunny"}', []),
    ("mistral", "[TOOL_CALLS] not json", "[TOOL_CALLS] not json", []),
    ("mistral", "A [TOOL", "A [TOOL", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
]


@pytest.mark.parametrize("name, text, content, calls", ANSWERS)
def test_each_format_parses_its_calls(name, text, content, calls):
    found_content, found = tool_format(name).parse(text, TOOLS)
    assert found_content == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found] == calls


@pytest.mark.parametrize("name, text, content, calls", ANSWERS)
def test_a_stream_sends_the_whole_answer_once(name, text, content, calls):
    """Fed a character at a time, a parser sends the content and each call once, in order, as the whole
    answer has them: nothing it sent is taken back."""
    parser = tool_format(name).parser(TOOLS)
    deltas = [parser.delta(text[:n], False) for n in range(1, len(text) + 1)] + [parser.delta(text, True)]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in streamed] == list(range(len(calls)))
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in streamed] == calls
    assert ("".join(d.get("content", "") for d in deltas) or None) == (content or None)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    """The demo tokenizer, and the same with Mistral's and Llama's markers as special tokens."""
    found = {}
    for kind, specials in (("text", []), ("special", ["[TOOL_CALLS]", "<|python_tag|>"])):
        root = tmp_path_factory.mktemp(kind)
        tok = train_tokenizer()
        tok.add_special_tokens(specials)
        tok.save(str(root / "tokenizer.json"))
        found[kind] = Tokenizer(root)
    return found


def _allows(tokenizer: Tokenizer, name: str, mode: str, parallel: bool, pieces: list) -> bool:
    """Whether `name`'s grammar lets a model write `pieces` (texts, and special tokens' ids) and stop."""
    spec = tool_format(name, tokenizer).constraint(TOOLS, mode, parallel)
    matcher = GrammarBackend(tokenizer.path, tokenizer.vocab_size, [0]).matcher(spec)
    ids = [t for p in pieces for t in ([p] if isinstance(p, int) else tokenizer.encode(p, add_special_tokens=False))]
    return all(matcher.accept(t) for t in ids) and matcher._m.is_accepting()


@pytest.mark.parametrize("name, calls, texts", [
    ("mistral", [f"[TOOL_CALLS][{_json('get_weather', PARIS)}]",
                 f"Sure. [TOOL_CALLS][{_json('get_weather', PARIS)}, {_json('get_weather', OSLO)}]"],
     [f"[TOOL_CALLS][{_json('get_weather', {'city': 'Rome'})}]", f"[TOOL_CALLS]{_json('get_weather', PARIS)}"]),
    ("llama3_json", [_json("get_weather", PARIS, "parameters"),
                     f"{_json('get_weather', PARIS, 'parameters')}; {_json('get_weather', OSLO, 'parameters')}"],
     [_json("get_weather", PARIS), _json("get_weather", {"city": "Rome"}, "parameters")]),
])
def test_strict_calls_in_auto_mode_are_held_to_the_format_and_schema(tokenizers, name, calls, texts):
    tok = tokenizers["text"]
    assert _allows(tok, name, "auto", True, ["It is sunny, no call needed."])
    for text in calls:
        assert _allows(tok, name, "auto", True, [text]), text
        assert tool_format(name).parse(text, TOOLS)[1], text  # what the grammar lets through parses
    for text in texts:
        assert not _allows(tok, name, "auto", True, [text]), text
    assert not _allows(tok, name, "auto", False, [calls[1]])  # one call without parallel calls


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_required_call_parses_in_every_format(tokenizers, name):
    """What the required grammar lets a model write (here the format's canonical call) is what its parser reads."""
    call = {"hermes": f"<tool_call>\n{_json('get_weather', PARIS)}\n</tool_call>",
            "qwen3": f"<tool_call>\n{_json('get_weather', PARIS)}\n</tool_call>",
            "mistral": f"[TOOL_CALLS][{_json('get_weather', PARIS)}]",
            "llama3_json": _json("get_weather", PARIS, "parameters")}[name]
    assert _allows(tokenizers["text"], name, "required", False, [call])
    assert not _allows(tokenizers["text"], name, "required", False, ["The weather is fine."])
    assert [c["function"]["name"] for c in tool_format(name).parse(call, TOOLS)[1]] == ["get_weather"]


def test_a_special_marker_is_matched_as_its_token_and_kept_in_the_text(tokenizers):
    """Where `[TOOL_CALLS]` is a special token the grammar writes that token (the model's own), never the
    marker spelled as text, and the detokenizer keeps it for the parser when told to."""
    tok = tokenizers["special"]
    mistral = tool_format("mistral", tok)
    marker = tok.special_token_id("[TOOL_CALLS]")
    assert marker is not None and mistral.keeps_special_tokens and not tool_format("mistral").keeps_special_tokens
    call = f"[{_json('get_weather', PARIS)}]"
    assert _allows(tok, "mistral", "required", False, [marker, call])
    spelled = ["[TOOL", "_CALLS]"]  # the marker's text in ordinary tokens (the tokenizer would encode it as the token)
    assert not _allows(tok, "mistral", "required", False, [*spelled, call])
    assert _allows(tok, "mistral", "auto", True, ["Sure. ", marker, call])
    assert _allows(tok, "mistral", "auto", True, ["No call."])
    assert not _allows(tok, "mistral", "auto", True, ["Sure. ", *spelled, call])  # spelled: it would go unheld
    ids = tok.encode("Sure. ", add_special_tokens=False) + [marker] + tok.encode(call, add_special_tokens=False)
    for skip, want in ((False, "Sure. [TOOL_CALLS]" + call), (True, "Sure. " + call)):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(detok.add(t) for t in ids) == want
    assert tok.special_token_id("<|python_tag|>") is not None and tok.special_token_id("Sure") is None


@pytest.fixture(scope="module")
def eager(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_model_len=1024)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_live_app_answers_calls_in_its_format(eager, name):
    """`--tool-call-parser NAME`: a named call, whole and streamed, is written in the format (the grammar
    holds the demo model to it) and comes back as the same tool call."""
    with live_app(eager, "demo", 1024, ServerConfig(tool_call_parser=name)) as base:
        body = {"model": "demo", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [CITY],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 120, "seed": 1}
        whole = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        (call,) = whole["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Oslo")
        with httpx.stream("POST", base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        streamed = [c for e in events for ch in e["choices"] for c in ch["delta"].get("tool_calls") or []]
        assert [c["function"]["arguments"] for c in streamed] == [call["function"]["arguments"]]
