"""The server's limits and its door: a bounded queue (503 with Retry-After), a request timeout (408),
the API key (401). Over the demo llama run eagerly, two sequences at a time."""

import asyncio
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from kiln import LLM, SamplingParams
from kiln.config import ServerConfig
from kiln.runtime.async_engine import AsyncEngine
from kiln.server.app import create_app
from tests.oracle import PROMPTS
from tests.server.live import live_server

MODEL = "demo-llama"
MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 2


@pytest.fixture(scope="module")
def llm(demo_dirs) -> LLM:
    return LLM(demo_dirs["llama"], max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS)


def _body(prompt: str, max_tokens: int = 8, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            **extra}


@pytest.fixture
def slow_steps(llm):
    """Each engine step takes at least 20 ms, so that requests pile up and time out predictably."""
    real = llm.engine.runner.execute

    def execute(*args, **kwargs):
        time.sleep(0.02)
        return real(*args, **kwargs)

    llm.engine.runner.execute = execute
    yield
    llm.engine.runner.execute = real


def test_a_flood_of_4x_the_queue_is_answered_in_full_and_stays_bounded(llm, slow_steps):
    """Every request of the flood gets a completion or a 503 with Retry-After; no more than
    max-num-seqs + max-queued-requests sequences are ever held."""
    max_queued, sent = 4, 4 * 4
    engine = AsyncEngine(llm.engine, model_name=MODEL, max_queued=max_queued)
    peak, add_all = [0], engine.add_all

    async def counted_add_all(*args, **kwargs):
        streams = await add_all(*args, **kwargs)
        peak[0] = max(peak[0], engine.num_requests)
        return streams

    engine.add_all = counted_add_all
    want = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].text
    engine.start()
    try:
        with live_server(create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN)) as url:
            async def flood() -> list[httpx.Response]:
                async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                    return await asyncio.gather(*(http.post("/v1/completions", json=_body(PROMPTS[0]))
                                                  for _ in range(sent)))

            responses = asyncio.run(flood())
            too_many = httpx.post(url + "/v1/completions", json=_body(PROMPTS[0], n=8))
    finally:
        engine.shutdown()
    done = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 503]
    assert len(done) + len(refused) == sent
    assert len(done) >= MAX_NUM_SEQS + max_queued and refused
    assert all(r.json()["choices"][0]["text"] == want for r in done)
    for r in refused:
        assert r.headers["retry-after"] == "1" and r.json()["error"]["code"] == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert peak[0] <= MAX_NUM_SEQS + max_queued
    assert too_many.status_code == 400 and "at most 6" in too_many.json()["error"]["message"]
    assert engine.num_requests == 0 and llm.engine.scheduler.kv_usage == 0


def test_a_request_past_the_timeout_is_stopped_with_a_408(llm, slow_steps):
    engine = AsyncEngine(llm.engine, model_name=MODEL, request_timeout=0.5)
    engine.start()
    try:
        with TestClient(create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN)) as http:
            long = _body(PROMPTS[0], max_tokens=200)
            slow = http.post("/v1/completions", json=long)  # 200 tokens at >= 20 ms a step: past 0.5 s
            assert slow.status_code == 408 and "request timeout of 0.5 s" in slow.json()["error"]["message"]
            lines = http.post("/v1/completions", json={**long, "stream": True}).text.splitlines()
            assert any('"RequestTimeoutError"' in line for line in lines) and lines[-2] == "data: [DONE]"
            assert http.post("/v1/completions", json=_body(PROMPTS[0], max_tokens=4)).status_code == 200
            deadline = time.monotonic() + 5
            while llm.engine.has_unfinished() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.num_requests == 0 and llm.engine.scheduler.kv_usage == 0  # the timed-out freed their blocks
    finally:
        engine.shutdown()


def test_the_api_key_is_required_except_where_exempt(llm):
    engine = AsyncEngine(llm.engine, model_name=MODEL)
    engine.start()
    config = ServerConfig(api_key="s3cret", api_key_scope="all", auth_exempt=("/health",))
    try:
        with TestClient(create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN, config=config)) as http:
            body = _body(PROMPTS[0], max_tokens=2)
            missing = http.post("/v1/completions", json=body)
            assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
            assert missing.json()["error"]["type"] == "AuthenticationError" and "no API key" in missing.json()["error"]["message"]
            wrong = http.post("/v1/completions", json=body, headers={"Authorization": "Bearer s3cre"})
            assert wrong.status_code == 401 and "not valid" in wrong.json()["error"]["message"]
            assert http.post("/v1/completions", content=b"{", headers={"Authorization": "Basic s3cret"}).status_code == 401
            good = {"Authorization": "Bearer s3cret"}
            assert http.post("/v1/completions", json=body, headers=good).status_code == 200
            assert http.get("/health").status_code == 200
            assert http.get("/metrics").status_code == 401 and http.get("/metrics", headers=good).status_code == 200
            schema = http.get("/openapi.json", headers=good).json()
            assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
            assert "401" in schema["paths"]["/v1/completions"]["post"]["responses"]
            assert "401" not in schema["paths"]["/health"]["get"]["responses"]
            assert http.get("/openapi.json").status_code == 401 and http.get("/docs").status_code == 401
    finally:
        engine.shutdown()


def test_the_api_key_guards_v1_only_by_default(llm):
    """vLLM's scope: the API under /v1/ needs the key; probes, scrapers, the schema and /tokenize do not."""
    engine = AsyncEngine(llm.engine, model_name=MODEL)
    engine.start()
    try:
        with TestClient(create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN,
                                   config=ServerConfig(api_key="s3cret"))) as http:
            for path in ("/v1/models", f"/v1/models/{MODEL}"):
                assert http.get(path).status_code == 401
                assert http.get(path, headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert http.post("/v1/completions", json=_body(PROMPTS[0], max_tokens=2)).status_code == 401
            for path in ("/health", "/metrics", "/openapi.json", "/docs", "/version"):
                assert http.get(path).status_code == 200, path
            assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
            schema = http.get("/openapi.json").json()
            assert "401" in schema["paths"]["/v1/completions"]["post"]["responses"]
            assert "401" not in schema["paths"]["/tokenize"]["post"]["responses"]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("options, message", [
    ({"api_key": " "}, "API key is empty"),
    ({"ssl_keyfile": "k.pem"}, "both --ssl-keyfile and --ssl-certfile"),
    ({"auth_exempt": ("/v1/models",), "api_key_scope": "all"}, "only /health and /metrics"),
    ({"auth_exempt": ("/health",)}, "goes with --api-key-scope all"),
    ({"request_timeout": 0}, "request_timeout must be > 0"),
])
def test_bad_server_options_are_refused_by_name(options, message):
    from kiln.errors import KilnError

    with pytest.raises(KilnError, match=message):
        ServerConfig(**options)
