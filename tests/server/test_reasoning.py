"""Reasoning models' thinking told from their answer (`--reasoning-parser`): the split itself as a stream
grows, and chat and the Responses API on a live app (a regex stands in for a model that thinks)."""

import json
import re

import httpx
import pytest

from kiln import LLM
from kiln.config import ServerConfig
from kiln.server.reasoning import split
from tests.server.live import live_app

MODEL = "demo-llama"


@pytest.mark.parametrize("text, parser, finished, want", [
    ("<think>plan</think>\n\nHi", "qwen3", True, ("plan", "\n\nHi")),
    ("plan</think>Hi", "deepseek_r1", True, ("plan", "Hi")),  # R1's template opens the thinking itself
    ("Hello", "qwen3", True, ("", "Hello")),  # Qwen3 without thinking
    ("Hello", "deepseek_r1", False, ("Hello", "")),
    ("<thi", "qwen3", False, ("", "")),  # may be opening it: held back
    ("<think>pla</thi", "qwen3", False, ("pla", "")),  # may be closing it: held back
    ("<think>cut short", "qwen3", True, ("cut short", "")),
])
def test_the_thinking_and_the_answer(text, parser, finished, want):
    assert split(text, parser, finished) == want


def test_every_prefix_splits_into_a_prefix_of_the_whole():
    """What a stream sends is never taken back: each prefix's parts begin the whole's."""
    text = "<think>first, the plan</think>\n\nThe answer."
    whole = split(text, "qwen3", True)
    for n in range(len(text) + 1):
        thought, answer = split(text[:n], "qwen3", False)
        assert whole[0].startswith(thought) and whole[1].startswith(answer), n


@pytest.fixture(scope="module")
def base(demo_dirs) -> str:
    with live_app(LLM(demo_dirs["llama"], max_model_len=1024), MODEL, 1024, ServerConfig(reasoning_parser="qwen3")) as url:
        yield url


THINKING = "<think>The user greets me.</think>\n\nHello there."


def test_chat_gives_the_thinking_as_reasoning_content(base):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 80,
            "structured_outputs": {"regex": re.escape(THINKING)}}
    message = httpx.post(base + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "The user greets me." and message["content"] == "\n\nHello there."
    lines = httpx.post(base + "/v1/chat/completions", json={**body, "stream": True}, timeout=60).text.splitlines()
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in lines if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user greets me."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nHello there."


def test_the_responses_api_gives_a_reasoning_item():
    """The Responses API has no regex to make the demo model think: its answer is built from an output."""
    from types import SimpleNamespace

    from kiln.runtime.engine import RequestOutput
    from kiln.server.responses import Responder, ResponseStore, ResponsesRequest, chat_of

    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi"})
    chat, _ = chat_of(body, ResponseStore(1))
    server = SimpleNamespace(config=ServerConfig(reasoning_parser="qwen3"), model_name=MODEL)
    out = RequestOutput("r", None, [1], [2, 3], THINKING, None, None, "stop")
    output = Responder(server, body, chat, 1).whole(out)["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"][0]["text"] == "The user greets me."
    assert output[1]["content"][0]["text"] == "\n\nHello there."
