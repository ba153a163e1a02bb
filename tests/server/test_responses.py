"""OpenAI's Responses API on a live app over the demo llama (eager), through the openai client: text whole
and streamed, instructions, function calls and their outputs across `previous_response_id`, the stored
responses' bound, and the fields kiln refuses by name."""

import httpx
import openai
import pytest

from kiln import LLM
from kiln.config import ServerConfig
from kiln.server.errors import ServerError
from kiln.server.responses import ResponseStore
from tests.server.live import live_app

MODEL = "demo-llama"
WEATHER = {"type": "function", "name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
    "additionalProperties": False}}


@pytest.fixture(scope="module")
def base(demo_dirs) -> str:
    with live_app(LLM(demo_dirs["llama"], max_model_len=1024), MODEL, 1024, ServerConfig(max_stored_responses=4)) as url:
        yield url


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _tokens(base: str, messages: list[dict], **fields) -> int:
    return httpx.post(base + "/tokenize", json={"model": MODEL, "messages": messages, **fields}).json()["count"]


def test_text_whole_and_streamed(base, client):
    ask = dict(model=MODEL, input="The kiln was", instructions="Be brief.", max_output_tokens=8, temperature=0,
               metadata={"run": "1"})
    whole = client.responses.create(**ask)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage.output_tokens == 8 and whole.metadata == {"run": "1"}
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The kiln was"}]
    assert whole.usage.input_tokens == _tokens(base, chat)  # the instructions are the system message
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text


def test_a_function_call_and_its_output_across_previous_response_id(base, client):
    question = "What is the weather?"
    first = client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=120)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments in (
        '{"city": "Paris"}', '{"city": "Oslo"}')
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[WEATHER], max_output_tokens=4,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "sunny"}])
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    tool_call = {"id": call.call_id, "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": call.arguments}}
    chat = [{"role": "user", "content": question}, {"role": "assistant", "content": "", "tool_calls": [tool_call]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    assert second.usage.input_tokens == _tokens(base, chat, tools=[{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k != "type"}}])  # the whole conversation reached the template
    streamed = list(client.responses.create(model=MODEL, input=question, tools=[WEATHER], tool_choice="required",
                                            max_output_tokens=120, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments in ('{"city": "Paris"}', '{"city": "Oslo"}')
    assert streamed[-1].type == "response.completed" and streamed[-1].response.output[0].type == "function_call"


@pytest.mark.parametrize("fields, status, message", [
    ({"previous_response_id": "resp_gone"}, 404, "no stored response `resp_gone`"),
    ({"include": ["message.output_text.logprobs"]}, 400, "leave include empty"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools.0"),
    ({"input": ""}, 400, "the input is empty"),
])
def test_what_kiln_cannot_do_is_refused_by_name(base, fields, status, message):
    response = httpx.post(base + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                        **fields})
    assert response.status_code == status and message in response.json()["error"]["message"], response.text


def test_a_response_not_stored_cannot_be_continued(client):
    kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input="and?", previous_response_id=kept.id, max_output_tokens=2)


def test_a_stored_response_is_retrieved_as_sent_and_deleted(client):
    """The openai client's responses.retrieve and delete: the response object as it was answered, whole or
    streamed; once deleted it can be neither retrieved nor continued."""
    whole = client.responses.create(model=MODEL, input="The kiln was", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(whole.id) == whole
    streamed = list(client.responses.create(model=MODEL, input="The kiln was", max_output_tokens=4, stream=True))
    assert client.responses.retrieve(streamed[-1].response.id) == streamed[-1].response
    client.responses.delete(whole.id)
    for call in (lambda: client.responses.retrieve(whole.id), lambda: client.responses.delete(whole.id),
                 lambda: client.responses.create(model=MODEL, input="and?", previous_response_id=whole.id)):
        with pytest.raises(openai.NotFoundError, match="deleted"):
            call()
    not_kept = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(not_kept.id)


def test_the_store_keeps_the_newest_within_its_bounds():
    store = ResponseStore(count=2, characters=200)
    for name in ("a", "b", "c"):
        store.put(name, [{"role": "user", "content": name}], {"id": name})
    assert store.get("c") and store.get("b")
    with pytest.raises(ServerError, match="keeps the newest 2"):
        store.get("a")
    store.put("big", [{"role": "user", "content": "x" * 130}], {"id": "big"})  # past 200 characters with b and c: they go
    assert store.get("big")
    with pytest.raises(ServerError):
        store.get("b")
