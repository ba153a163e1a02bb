"""`kiln serve`'s HTTP API, driven by the official openai client against a live server on loopback
(uvicorn in a thread) over the demo llama's compiled artifact."""

import asyncio
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from kiln import LLM, SamplingParams
from kiln.models.demo import paragraph_openings
from kiln.runtime.async_engine import AsyncEngine
from kiln.runtime.server import create_app
from tests.oracle import PROMPTS

MODEL = "demo-llama"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def served(demo_dirs, kiln_cache):
    """(base URL, AsyncEngine) of a live server; the engine runs the compiled artifact."""
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    engine = AsyncEngine(llm.engine)
    engine.start()
    app = create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", engine
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def eager(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_model_len=MAX_MODEL_LEN)


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics").text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_completions_match_the_engine(client, eager):
    want = eager.generate(PROMPTS[:3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for prompt, w in zip(PROMPTS[:3], want):
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == w.text and got.choices[0].finish_reason == "length"
        assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(w.prompt_token_ids)
        chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                stream=True, extra_body={"ignore_eos": True}))
        assert "".join(c.choices[0].text for c in chunks) == w.text
        assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_and_token_prompts(client, eager):
    ids = eager.tokenizer.encode(PROMPTS[0])
    want = eager.generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3))[0]
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.logprobs.token_logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert all(len(top) == 3 for top in got.logprobs.top_logprobs)
    assert got.logprobs.text_offset == [len("".join(got.logprobs.tokens[:i])) for i in range(6)]
    two = client.completions.create(model=MODEL, prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in two.choices] == [0, 1, 2, 3]
    assert two.choices[0].text == two.choices[1].text  # greedy: both choices of one prompt agree


def test_chat_streaming_and_not(client, eager):
    messages = [{"role": "system", "content": "You are a potter."}, {"role": "user", "content": "Tell me of kilns."}]
    prompt = eager.tokenizer.apply_chat_template(messages)
    assert prompt.endswith("Assistant:") and "User: Tell me of kilns." in prompt  # the fallback template
    want = eager.generate([eager.tokenizer.encode(prompt)], SamplingParams(max_tokens=10, temperature=0))[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == want.text and got.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)
    lp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0, logprobs=True,
                                        top_logprobs=2).choices[0].logprobs.content
    assert len(lp) == 3 and all(len(t.top_logprobs) == 2 for t in lp)


def test_stop_strings_cut_the_text_streamed_or_not(client, eager):
    full = eager.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
    stop = full[10:13]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop])
    assert got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == got.choices[0].text


def test_64_concurrent_streams_equal_one_at_a_time(served, client):
    base, engine = served
    prompts = [(p, 8 + i % 9) for i, p in enumerate((paragraph_openings(4) + PROMPTS) * 4)][:64]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].text for p, n in prompts]
    finished_before = _metric(base, 'kiln_requests_total{finish_reason="length"}')
    tokens_before = _metric(base, "kiln_generation_tokens_total")

    async def one(aclient, prompt, n):
        text = ""
        async for chunk in await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                            stream=True, extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
        return text

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in prompts))

    assert asyncio.run(all_at_once()) == alone
    assert _metric(base, 'kiln_requests_total{finish_reason="length"}') - finished_before == 64
    assert _metric(base, "kiln_generation_tokens_total") - tokens_before == sum(n for _, n in prompts)
    assert _metric(base, "kiln_time_to_first_token_seconds_count") >= 64
    assert _metric(base, "kiln_requests_running") == 0 and engine.num_requests == 0


def test_a_client_that_leaves_mid_stream_frees_its_request(served):
    base, engine = served
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    deadline = time.time() + 10
    while (engine.num_requests or engine.engine.has_unfinished()) and time.time() < deadline:
        time.sleep(0.05)
    assert engine.num_requests == 0 and not engine.engine.has_unfinished()
    assert engine.engine.scheduler.kv_usage == 0


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": PROMPTS[0], "n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[0]}]}),
])
def test_a_client_that_leaves_before_a_whole_answer_aborts_it(served, path, body):
    base, engine = served
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True, **body}
    aborted = _metric(base, 'kiln_requests_total{finish_reason="abort"}')
    tokens = _metric(base, "kiln_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + path, json=body, timeout=httpx.Timeout(10, read=0.2))
    deadline = time.time() + 10
    while engine.num_requests and time.time() < deadline:
        time.sleep(0.02)
    assert engine.num_requests == 0
    assert _metric(base, 'kiln_requests_total{finish_reason="abort"}') - aborted == body.get("n", 1)
    assert _metric(base, "kiln_generation_tokens_total") - tokens < 200 * body.get("n", 1)
    while engine.engine.has_unfinished() and time.time() < deadline:
        time.sleep(0.02)
    assert engine.engine.scheduler.kv_usage == 0


@pytest.mark.parametrize("body, status, text", [
    ({"prompt": [1, -3, 4]}, 400, "outside the vocabulary"),
    ({"prompt": [1, 10**6]}, 400, "outside the vocabulary"),
    ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": [5] * MAX_MODEL_LEN}, 400, "no room to generate"),
    ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "context"),
    ({"prompt": "hi", "model": "gpt-9"}, 404, "does not exist"),
    ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"prompt": 42}, 400, "prompt"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ({"prompt": "hi", "stop": [""]}, 400, "stop"),
])
def test_bad_completion_input_is_a_4xx_in_openai_shape(served, body, status, text):
    response = httpx.post(served[0] + "/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert text in err["message"] and {"message", "type", "param", "code"} <= set(err)


def test_malformed_requests_are_4xx(served):
    base = served[0]
    bad_json = httpx.post(base + "/v1/completions", content=b'{"model": "demo-llama", "prompt": ',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL}):
        response = httpx.post(base + "/v1/chat/completions", json=body)
        assert response.status_code == 400 and "error" in response.json(), body
    assert httpx.get(base + "/v1/nothing").status_code == 404
    assert httpx.get(base + "/v1/completions").status_code == 405
    assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(base + "/health").status_code == 200


def test_schema_fuzz_finds_no_server_errors(served):
    """schemathesis generates requests from the server's own OpenAPI schema (valid and not): none may
    get a 5xx. Bounded: 30 examples per operation."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings

    base = served[0]
    schema = schemathesis.openapi.from_url(base + "/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def no_server_error(case):
            response = case.call(base_url=base, timeout=60)
            assert response.status_code < 500, f"{case.method} {case.path} {case.body!r}: {response.text}"

        no_server_error()
        checked += 1
    assert checked == 5  # completions, chat, models, health, metrics


def test_a_stopped_engine_is_unhealthy_and_refuses_work(eager):
    from fastapi.testclient import TestClient

    stopped = AsyncEngine(eager.engine)  # never started: as after a failed step
    with TestClient(create_app(stopped, eager.tokenizer, MODEL, MAX_MODEL_LEN)) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
