"""What OpenAI and vLLM clients script against, on a live `kiln serve` app over the demo llama (eager):
tool calling through the openai client, continuous usage in streams, usage counted once per prompt,
stop tokens left out of the text, vLLM's /tokenize, /detokenize, /version and stop_reason, the
openai client's models.retrieve, HEAD /health, and the fields kiln refuses rather than ignore."""

import json
import re

import httpx
import openai
import pytest

from kiln import LLM, SamplingParams
from tests.oracle import PROMPTS
from tests.server.live import live_app

MODEL = "demo-llama"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                   "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "additionalProperties": False, "$defs": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module")
def eager(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_model_len=1024)


@pytest.fixture(scope="module")
def reference(demo_dirs) -> LLM:
    """The same model outside the server, for the numbers a response is checked against: the served LLM's
    engine belongs to the server's engine thread, and a call into it from a test races that thread."""
    return LLM(demo_dirs["llama"], max_model_len=1024)


@pytest.fixture(scope="module")
def base(eager) -> str:
    with live_app(eager, MODEL, 1024) as url:
        yield url


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _chat(base: str, **fields) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 8, **fields}
    return httpx.post(base + "/v1/chat/completions", json=body, timeout=60)


def test_a_tool_round_trip_through_the_openai_client(client):
    """A named call is held to its schema by the grammar engine: it parses into tool_calls; the tool's
    result goes back with the assistant's call; the model answers in text."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.finish_reason == "stop" and choice.message.content is None  # named: OpenAI says stop
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=6,
                                           tool_choice="none", temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].message.content
    # the call and the tool's result reached the prompt through the template
    base = str(client.base_url).removesuffix("/v1/")
    rendered = httpx.post(base + "/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()
    text = httpx.post(base + "/detokenize", json={"tokens": rendered["tokens"]}).json()
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": ' in text["prompt"]
    assert "Tool: 18 degrees and sunny" in text["prompt"] and '"name": "get_weather"' in text["prompt"]


def test_required_tool_calls_match_a_tool_and_stream_as_deltas(client):
    """required: one or more calls, each to one of the tools, with $defs resolved; streamed, the calls
    come as tool_calls deltas that add up to the same answer."""
    request = dict(model=MODEL, messages=[{"role": "user", "content": "Time?"}], tools=[WEATHER, CLOCK],
                   tool_choice="required", max_tokens=120, seed=3, temperature=1.0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**request).choices[0]
    (call,) = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls"
    arguments = json.loads(call.function.arguments)
    assert (call.function.name, list(arguments)) in (("get_weather", ["city"]), ("get_time", ["zone"]))
    calls, content, reasons = {}, "", []
    for chunk in client.chat.completions.create(**request, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for c in delta.tool_calls or []:
            calls[c.index] = (c.function.name, c.function.arguments)
        reasons.append(chunk.choices[0].finish_reason)
    assert calls == {0: (call.function.name, call.function.arguments)} and content == ""
    assert reasons[-1] == "tool_calls"


def test_strict_tools_in_auto_mode_are_answered(client):
    """openai-agents' default `@function_tool` is strict, sent in auto mode (so is `pydantic_function_tool`'s):
    answered, with any call the model opens held to its schema (tests/server/test_tool_calls.py), not refused."""
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    for parallel in (True, False):
        choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                                tools=[strict, CLOCK], max_tokens=12, parallel_tool_calls=parallel,
                                                temperature=0).choices[0]
        assert choice.finish_reason in ("stop", "length") and choice.message.content
        assert len(choice.message.tool_calls or []) <= 1 or parallel


def test_auto_tool_calls_are_parsed_from_the_answer(base):
    """auto: the answer's <tool_call> blocks become tool_calls and the text before them content (a
    regex stands in for a model that chose to call), whole and streamed."""
    answer = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    fields = {"tools": [WEATHER], "max_tokens": 120, "structured_outputs": {"regex": re.escape(answer)}}
    whole = _chat(base, **fields).json()["choices"][0]
    assert whole["message"]["content"] == "Let me check. " and whole["finish_reason"] == "tool_calls"
    (call,) = whole["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    chunks = _events(httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Weather?"}], "stream": True, **fields}))
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == "Let me check. "
    streamed = [t for d in deltas for t in d.get("tool_calls", [])]
    assert [t["function"] for t in streamed] == [call["function"]] and streamed[0]["index"] == 0
    plain = _chat(base, **{**fields, "tool_choice": "none"}).json()["choices"][0]
    assert plain["message"]["content"] == answer and "tool_calls" not in plain["message"]


def _events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    lines = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("fields, message", [
    ({"tool_choice": "required"}, "needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "x": 1}}]},
     "tools.0.function.x"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "strict": True}}], "guided_regex": "a+"},
     "constrains the output already"),
])
def test_bad_tool_requests_are_400s_naming_the_problem(base, fields, message):
    response = _chat(base, **fields)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_continuous_usage_stats_in_every_chunk(base):
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): usage so far in every chunk."""
    for path, body in (("/v1/completions", {"prompt": PROMPTS[0]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]})):
        chunks = _events(httpx.post(base + path, timeout=60, json={
            "model": MODEL, "max_tokens": 7, "ignore_eos": True, "stream": True, "n": 2, **body,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
        assert all("usage" in c for c in chunks)
        used = [c["usage"]["completion_tokens"] for c in chunks]
        assert used == sorted(used) and used[-1] == 14 and chunks[-1]["choices"] == []
        prompt = chunks[0]["usage"]["prompt_tokens"]
        assert prompt > 0 and all(c["usage"] == {"prompt_tokens": prompt, "completion_tokens": u,
                                                 "total_tokens": prompt + u} for c, u in zip(chunks, used))


def test_usage_counts_the_prompt_once_whatever_n_and_best_of(client):
    one = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3).usage.prompt_tokens
    for extra in ({"n": 4}, {"n": 2, "best_of": 3}):
        usage = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=3, extra_body=extra).usage
        assert usage.prompt_tokens == one and usage.completion_tokens == 3 * extra.get("best_of", extra["n"])
    two = client.completions.create(model=MODEL, prompt=[PROMPTS[1], PROMPTS[1]], max_tokens=3, n=2).usage
    assert two.prompt_tokens == 2 * one  # two prompts: each once
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat_one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3).usage.prompt_tokens
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, n=3).usage.prompt_tokens == \
        chat_one


@pytest.mark.parametrize("fields, message", [
    ({"messages": [{"role": "user", "content": "hi", "refusal": None}]}, "messages.0.refusal"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache": 1}]}]}, "cache"),
    ({"messages": [{"role": "user", "content": "hi", "tool_call_id": "c"}]}, "tool_call_id belongs to tool"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "tool_calls belong"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options needs stream"),
])
def test_fields_that_would_be_ignored_are_refused(base, fields, message):
    response = _chat(base, **fields)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_a_message_name_reaches_the_chat_template(base):
    def tokens(**extra):
        return httpx.post(base + "/tokenize", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi", **extra}]}).json()["tokens"]

    named = httpx.post(base + "/detokenize", json={"tokens": tokens(name="alice")}).json()["prompt"]
    assert named.startswith("User (alice): hi") and tokens() != tokens(name="alice")


def test_vllms_chat_template_fields_shape_the_prompt(base):
    chat = [{"role": "user", "content": "Where is Paris?"}, {"role": "assistant", "content": "Paris is in"}]

    def tokens(**fields) -> list[int]:
        return httpx.post(base + "/tokenize", json={"model": MODEL, "messages": chat, **fields}).json()["tokens"]

    def prompt(**fields) -> str:
        return httpx.post(base + "/detokenize", json={"tokens": tokens(**fields)}).json()["prompt"]

    assert prompt().endswith("Assistant: Paris is in\nAssistant:")
    assert prompt(add_generation_prompt=False).endswith("Assistant: Paris is in\n")
    continued = {"add_generation_prompt": False, "continue_final_message": True}
    assert prompt(**continued).endswith("Assistant: Paris is in")
    # vLLM's fields, and the platform fields code written for OpenAI sends (no effect here: docs/serving.md)
    fields = {**continued, "messages": chat, "echo": True, "temperature": 0, "chat_template_kwargs": {
        "enable_thinking": False}, "store": False, "metadata": {"run": "7"}, "service_tier": "auto",
        "reasoning_effort": "low"}
    answer = _chat(base, **fields).json()
    content = answer["choices"][0]["message"]["content"]
    assert content.startswith("Paris is in") and len(content) > len("Paris is in")
    assert answer["usage"]["prompt_tokens"] == len(tokens(**continued))
    streamed = [json.loads(line[6:]) for line in _chat(base, **fields, stream=True).text.splitlines()
                if line.startswith("data: {")]
    assert streamed[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Paris is in"}
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in streamed) == content
    new_turn = _chat(base, messages=chat, echo=True).json()["choices"][0]["message"]["content"]
    assert new_turn.startswith("Paris is in")  # the final message is not continued, and is echoed all the same
    assert not _chat(base, messages=chat).json()["choices"][0]["message"]["content"].startswith("Paris is in")
    for bad, message in (({"continue_final_message": True}, "cannot both be true"),
                         ({"chat_template_kwargs": {"messages": []}}, "come from the request itself"),
                         ({"service_tier": "gold"}, "service_tier")):
        response = _chat(base, messages=chat, **bad)
        assert response.status_code == 400 and message in response.json()["error"]["message"], response.text


def test_embeddings_through_the_openai_client(base, client, reference):
    """/v1/embeddings: the openai client asks for base64 by default and decodes it; float gives the same
    vectors: the model's last hidden state at the last token, L2-normalized (tests/runtime/test_embeddings.py
    checks those against transformers)."""
    texts = [PROMPTS[0], PROMPTS[3]]
    answer = client.embeddings.create(model=MODEL, input=texts)
    want = reference.embed(texts)
    assert [d.index for d in answer.data] == [0, 1]
    assert all(d.embedding == pytest.approx(w, abs=1e-6) for d, w in zip(answer.data, want))
    ids = [reference.tokenizer.encode(t) for t in texts]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(map(len, ids))
    floats = httpx.post(base + "/v1/embeddings", json={"model": MODEL, "input": ids, "encoding_format": "float"})
    assert all(d["embedding"] == pytest.approx(w, abs=1e-6) for d, w in zip(floats.json()["data"], want))
    for body, message in (({"input": texts, "dimensions": 8}, "`dimensions` is not supported"),
                          ({"input": ""}, "the input is empty"), ({"input": [[1, -2]]}, "outside the vocabulary")):
        refused = httpx.post(base + "/v1/embeddings", json={"model": MODEL, **body})
        assert refused.status_code == 400 and message in refused.json()["error"]["message"], refused.text


def test_stop_tokens_leave_their_text_out_unless_asked(client, reference):
    """vLLM's rule: the stop token's (or stop string's) text is not in the output unless
    include_stop_str_in_output; stop_reason says which one stopped it."""
    greedy = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=10, temperature=0)
    ids = reference.generate([PROMPTS[3]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    stop_at = ids[4]
    before, through = (reference.tokenizer.decode(ids[:n]) for n in (ids.index(stop_at), ids.index(stop_at) + 1))
    cut = client.completions.create(**greedy, extra_body={"stop_token_ids": [stop_at]}).choices[0]
    assert cut.text == before != through and cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop_at
    kept = client.completions.create(**greedy, extra_body={"stop_token_ids": [stop_at],
                                                           "include_stop_str_in_output": True}).choices[0]
    assert kept.text == through and kept.model_extra["stop_reason"] == stop_at
    word = through[-3:]
    at = through.find(word)
    by_string = client.completions.create(**greedy, stop=[word], extra_body={"include_stop_str_in_output": True})
    assert by_string.choices[0].text == through[:at + 3] and by_string.choices[0].model_extra["stop_reason"] == word
    assert client.completions.create(**greedy, stop=[word]).choices[0].text == through[:at]
    chat = _chat_stop(client, stop_at)
    assert chat.finish_reason == "stop" and chat.model_extra["stop_reason"] == stop_at
    length = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0]
    assert length.finish_reason == "length" and length.model_extra["stop_reason"] is None


def test_special_tokens_are_left_out_of_the_text_unless_asked(client, eager):
    """vLLM's skip_special_tokens: the end-of-text token, made to come between words (EOS ignored), is
    in the text only with skip_special_tokens false."""
    eos = eager.tokenizer.eos_token_ids[0]
    spelled = eager.tokenizer._tok.id_to_token(eos)
    fields = dict(model=MODEL, prompt=PROMPTS[3], max_tokens=3, temperature=0)
    extra = {"ignore_eos": True, "logit_bias": {str(eos): 100}}
    assert client.completions.create(**fields, extra_body=extra).choices[0].text == ""
    kept = client.completions.create(**fields, extra_body={**extra, "skip_special_tokens": False}).choices[0]
    assert kept.text == spelled * 3


def test_the_user_field_reaches_the_request_log(base, caplog):
    """`user` changes no output and is written in the request's DEBUG line, as the docs say."""
    with caplog.at_level("DEBUG", logger="kiln.server.serving"):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                           ("/v1/embeddings", {"input": "hi"})):
            assert httpx.post(base + path, json={"model": MODEL, "user": "alice-7", **body}).status_code == 200
    lines = [r.getMessage() for r in caplog.records if "alice-7" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["ChatCompletionRequest", "EmbeddingRequest"], lines


def _chat_stop(client, token: int):
    """A chat answer stopped by `token`, which it is made to say first."""
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          logit_bias={str(token): 100}, extra_body={"stop_token_ids": [token]}
                                          ).choices[0]


def test_vllm_endpoints_and_model_fields(base, client, eager):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.model_extra["root"] == MODEL and card.model_extra["parent"] is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other-model")
    listed = client.models.list().data[0]
    assert listed.model_extra["root"] == MODEL and "parent" in listed.model_extra
    head = httpx.head(base + "/health")
    assert head.status_code == 200 and head.content == b""
    from kiln import __version__

    assert httpx.get(base + "/version").json() == {"version": __version__}
    tokenized = httpx.post(base + "/tokenize", json={"model": MODEL, "prompt": PROMPTS[2],
                                                     "return_token_strs": True}).json()
    assert tokenized["tokens"] == eager.tokenizer.encode(PROMPTS[2]) and tokenized["count"] == len(tokenized["tokens"])
    assert tokenized["max_model_len"] == 1024 and len(tokenized["token_strs"]) == tokenized["count"]
    assert httpx.post(base + "/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"] == \
        eager.tokenizer.decode(tokenized["tokens"])
    chat = httpx.post(base + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == eager.tokenizer.encode("User: hi\nAssistant:", add_special_tokens=False)
    for path, body, status in (("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400),
                               ("/tokenize", {"prompt": "x", "model": "other"}, 404),
                               ("/detokenize", {"tokens": [10**9]}, 400),
                               ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400)):
        response = httpx.post(base + path, json=body)
        assert response.status_code == status and response.json()["error"]["message"], (path, body)


def test_vllm_metrics_beside_the_older_ones(base, client):
    """The series vLLM dashboards and GIE releases read, on the live server's /metrics."""
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, extra_body={"ignore_eos": True})
    text = httpx.get(base + "/metrics").text
    label = f'model_name="{MODEL}"'

    def value(name: str) -> float:
        found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert found, name
        return float(found.group(1))

    assert value(f"vllm:gpu_cache_usage_perc{{{label}}}") == value(f"vllm:kv_cache_usage_perc{{{label}}}")
    assert value(f"vllm:request_queue_time_seconds_count{{{label}}}") >= 1
    assert value(f"vllm:time_per_output_token_seconds_count{{{label}}}") >= 3
    assert value(f"vllm:num_preemptions_total{{{label}}}") == 0
    queries, hits = (value(f"vllm:prefix_cache_{k}_total{{{label}}}") for k in ("queries", "hits"))
    assert queries >= len(PROMPTS[0].split()) and 0 <= hits <= queries
    assert re.search(r'^vllm:lora_requests_info\{.*max_lora="0".*\} \S+$', text, re.M)
