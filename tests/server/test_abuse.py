"""One request never harms another: `kiln serve` (a fresh process, with failures injected into chosen
requests by `faulty_serve`) against the attacks a hostile or careless client makes. Each attack gets
its 4xx or fails alone; the requests beside it get the tokens they get alone; the server stays up,
small and answering."""

import asyncio
import json
import os
import random
import signal
import socket
import sys
import time

import httpx
import pytest

from tests.oracle import PROMPTS
from tests.processes import REPO, free_port, server_process
from tests.server.faulty_serve import FAULTS, KILL_ENGINE, NAN_PROMPT_SCORES, SLOW_STEPS

MODEL = "demo"
VOCAB = 512
MAX_LOGIT_BIAS = 600
LIMITS = ["--max-model-len", "256", "--header-timeout", "1", "--body-timeout", "2", "--max-choices", "2500",
          "--max-grammar-bytes", "1M", "--max-logit-bias", str(MAX_LOGIT_BIAS)]


ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def _command(model_dir, port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tests.server.faulty_serve", "serve", str(model_dir), "--port", str(port),
            "--artifact", "eager", "--served-model-name", MODEL, *extra]


@pytest.fixture(scope="module")
def server(demo_dirs, tmp_path_factory):
    """(base URL, pid) of the faulty `kiln serve` over the demo llama, eager."""
    port, log = free_port(), tmp_path_factory.mktemp("abuse") / "serve.log"
    with server_process(_command(demo_dirs["llama"], port, *LIMITS), port, log, env=ENV) as (proc, url):
        yield url, proc.pid


def _body(prompt: str = PROMPTS[0], **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


NEIGHBOURS = [_body(PROMPTS[1]), _body(PROMPTS[2], temperature=0.8, seed=11),
              _body(PROMPTS[3], presence_penalty=0.5, logprobs=2)]
"""Requests that run beside an attack: greedy, seeded sampling, and an adjusted row with logprobs."""


def _post(url: str, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


async def _together(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await asyncio.gather(*(http.post("/v1/completions", json=b) for b in bodies))


def _texts(responses: list[httpx.Response]) -> list[tuple[str, list[str] | None, list[float] | None]]:
    """Each choice's text, its tokens and their logprobs (where asked)."""
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    choices = [c for r in responses for c in r.json()["choices"]]
    return [(c["text"], c["logprobs"] and c["logprobs"]["tokens"], c["logprobs"] and c["logprobs"]["token_logprobs"])
            for c in choices]


@pytest.fixture(scope="module")
def alone(server) -> list[dict]:
    """Each neighbour's choice when it runs by itself."""
    return _texts([_post(server[0], body) for body in NEIGHBOURS])


def _alongside(url: str, attack: dict, alone: list[dict]) -> httpx.Response:
    """Send `attack` with the neighbours at once; check they got what they get alone; its response."""
    responses = asyncio.run(_together(url, [attack, *NEIGHBOURS]))
    for (text, tokens, logprobs), (text_alone, tokens_alone, logprobs_alone) in zip(_texts(responses[1:]), alone):
        assert (text, tokens) == (text_alone, tokens_alone)  # the same tokens; logprobs to a batch's rounding
        assert logprobs == logprobs_alone or logprobs == pytest.approx(logprobs_alone, abs=1e-4)
    assert httpx.get(url + "/health").status_code == 200
    return responses[0]


def _rss(pid: int) -> int:
    """Resident bytes of a process (VmRSS)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("seed, n", [(2**64, 1), (-(2**63) - 1, 1), (2**64 - 1, 2), (2**63 - 1, 2)])
def test_seeds_outside_64_bits_are_refused_and_serving_goes_on(server, path, seed, n):
    url = server[0]
    body = ({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = _post(url, {"model": MODEL, "max_tokens": 2, "seed": seed, "n": n, **body}, path)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed" and "922337203685477580" in response.json()["error"]["message"]
    edge = 2**63 - n if seed > 0 else -(2**63)
    assert _post(url, {"model": MODEL, "max_tokens": 2, "seed": edge, "n": n, **body}, path).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("seed", sorted(FAULTS), ids=[FAULTS[s] for s in sorted(FAULTS)])
def test_a_failure_in_one_request_fails_it_alone(server, alone, seed, stream):
    """Each stage of a request's life raising an exception type kiln has never heard of: that request
    gets a 500 in OpenAI's shape (an error event when streaming), the others their own tokens."""
    attack = _body(PROMPTS[4], seed=seed, presence_penalty=0.3, stream=stream)
    response = _alongside(server[0], attack, alone)
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        assert response.text.rstrip().endswith("data: [DONE]")
        assert events[-1]["error"]["type"] == "InternalServerError" and "Injected" in events[-1]["error"]["message"]
    else:
        assert response.status_code == 500, response.text
        assert response.json()["error"]["type"] == "InternalServerError" and "Injected" in response.json()["error"]["message"]


def test_every_token_masked_is_refused_alone(server, alone):
    attack = _body(temperature=1, min_tokens=1, stop_token_ids=list(range(VOCAB)))
    response = _alongside(server[0], attack, alone)
    assert response.status_code == 400 and "no token could be sampled" in response.json()["error"]["message"]


def test_a_grammar_llguidance_gives_up_on_fails_alone(server, alone):
    """2000 choices pass the cap here (2500) and llguidance's checks, then overflow its parser at the
    first token: that request ends with a 400 carrying llguidance's reason."""
    words, rng = ["the", "kiln", "fire", "clay", "pot"], random.Random(0)
    choices = [" ".join(rng.choice(words) for _ in range(5)) + str(i) for i in range(2000)]
    response = _alongside(server[0], _body(guided_choice=choices, max_tokens=30), alone)
    assert response.status_code == 400, response.text
    assert "max is 2000" in response.json()["error"]["message"]
    over = _post(server[0], _body(guided_choice=[f"c{i}" for i in range(2501)]))
    assert over.status_code == 400 and "--max-choices" in over.json()["error"]["message"]


def test_a_huge_body_is_refused_before_it_is_read(server):
    """100 MB, declared or streamed: 413 naming the flag, and the server's memory barely moves."""
    url, pid = server
    before = _rss(pid)
    declared = httpx.post(url + "/v1/completions", content=b"x" * (100 * 2**20), timeout=60)
    assert declared.status_code == 413 and "--max-request-bytes" in declared.json()["error"]["message"]

    def token_ids():
        yield b'{"model": "demo", "prompt": ['
        for _ in range(100):
            yield b"11," * (2**20 // 3)
        yield b"11]}"

    streamed = httpx.post(url + "/v1/completions", content=token_ids(), timeout=60)
    assert streamed.status_code == 413
    assert _rss(pid) - before < 200 * 2**20


def test_texts_are_refused_before_they_are_tokenized_whole(server, alone):
    """4 MB texts to /tokenize (four at once), /v1/completions and chat: each a 400 naming the limit,
    found from the text's length, not by tokenizing 2 million tokens (which took 0.8 GB each); the
    requests beside them get their own tokens and the server's memory stays put. Within the limits
    /tokenize counts exactly."""
    url, pid = server
    text, before = "a b " * 1_000_000, _rss(pid)

    async def attack() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            tokenize = [http.post("/tokenize", json={"prompt": text, "return_token_strs": True}) for _ in range(4)]
            chat = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 4,
                                                           "messages": [{"role": "user", "content": text}]})
            return await asyncio.gather(*tokenize, chat)

    *tokenized, chat = asyncio.run(attack())
    for response in tokenized:
        assert response.status_code == 400 and "/tokenize counts at most 1024" in response.json()["error"]["message"]
    for response in (chat, _alongside(url, _body(text), alone)):
        assert response.status_code == 400, response.text
        assert "has at least" in response.json()["error"]["message"] and "no room to generate" in response.text
    assert _rss(pid) - before < 100 * 2**20
    counted = _post(url, {"prompt": ("a b " * 512).strip()}, "/tokenize").json()
    assert counted["count"] == len(counted["tokens"]) == 1024
    assert _post(url, {"tokens": [11] * 1025}, "/detokenize").status_code == 400
    assert _post(url, {"tokens": [11] * 1024}, "/detokenize").json()["prompt"] == "+" * 1024


def test_caps_name_their_flags_and_large_requests_within_them_work(server, demo_dirs):
    from kiln.runtime.tokenizer import Tokenizer

    url = server[0]
    cases = [({"logit_bias": {str(t): 1 for t in range(MAX_LOGIT_BIAS + 1)}}, "--max-logit-bias"),
             ({"stop": [f"s{i}" for i in range(65)]}, "--max-stop-strings"),
             ({"stop": ["x" * 1025]}, "--max-stop-length"),
             ({"guided_regex": "(" + "|".join(f"w{i}" for i in range(150_000)) + ")"}, "--max-grammar-bytes"),
             ({"logit_bias": {"\u00b2": 1}}, "logit_bias"), ({"logit_bias": {"1" * 5000: 1}}, "logit_bias")]
    for extra, flag in cases:
        response = _post(url, _body(**extra))
        assert response.status_code == 400 and flag in response.json()["error"]["message"], (flag, response.text)
    # every token biased: the one raised is the only one ever chosen
    tok = Tokenizer(demo_dirs["llama"])
    [the] = tok.encode(" the", add_special_tokens=False)
    biased = {str(t): -100 for t in range(VOCAB)} | {str(the): 100}
    got = _post(url, _body(logit_bias=biased, max_tokens=4, temperature=0.7, seed=3)).json()["choices"][0]
    assert got["text"] == " the" * 4
    # 64 stop strings cut where the one that occurs alone does
    plain = _post(url, _body(max_tokens=24)).json()["choices"][0]["text"]
    stop = plain[10:13]
    one = _post(url, _body(max_tokens=24, stop=[stop])).json()["choices"][0]
    many = _post(url, _body(max_tokens=24, stop=[f"zq{i}" for i in range(63)] + [stop])).json()["choices"][0]
    assert one["text"] == many["text"] == plain[:plain.index(stop)] and many["finish_reason"] == "stop"


def test_slow_clients_are_cut_off(server):
    """Headers trickling past --header-timeout: the connection is closed; a body past --body-timeout: 408."""
    host, port = server[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        for _ in range(2):  # a byte now and then does not keep it open
            time.sleep(0.3)
            s.sendall(b"X")
        try:
            assert s.recv(1024) == b""  # closed by the server, well before the 10 s socket timeout
        except ConnectionResetError:
            pass
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"model\": ")
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 408") and b"--body-timeout" in answer
    assert httpx.get(server[0] + "/health").status_code == 200


def _strict_json(text: str):
    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
def test_nan_and_infinite_logprobs_are_still_json(server, stream):
    """Logits of NaN (a broken model) and -inf give logprobs JSON can carry: null and -9999.0."""
    body = _body(PROMPTS[0], seed=NAN_PROMPT_SCORES, echo=True, logprobs=1, max_tokens=2, stream=stream)
    response = _post(server[0], body)
    assert response.status_code == 200, response.text
    if stream:
        payloads = [_strict_json(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
        scores = payloads[0]["choices"][0]["logprobs"]["token_logprobs"]
    else:
        scores = _strict_json(response.text)["choices"][0]["logprobs"]["token_logprobs"]
    assert scores[:3] == [None, None, -9999.0]  # the first token has none; then NaN, then -inf


@pytest.mark.parametrize("raw", [
    b'{"model": "demo", "prompt": "\\ud800 kiln"}',
    b'{"model": "demo", "prompt": "kiln", "stop": ["\\udfff"]}',
    b'{"model": "demo", "messages": [{"role": "user", "content": "a\\ud83d"}]}',
])
def test_lone_surrogates_are_a_400(server, raw):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = httpx.post(server[0] + path, content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]


def test_a_dead_engine_thread_ends_the_process(demo_dirs, tmp_path):
    """A failure outside any request (a kiln bug in the engine loop) stops the engine thread: the request
    in flight is answered 503 and the process exits non-zero, for its supervisor to restart it."""
    port, log = free_port(), tmp_path / "serve.log"
    with server_process(_command(demo_dirs["llama"], port), port, log, env=ENV) as (proc, url):
        response = _post(url, _body(seed=KILL_ENGINE))
        assert response.status_code == 503 and "engine stopped" in response.json()["error"]["message"]
        assert proc.wait(timeout=60) == 1, "the server kept running with a dead engine"
    text = log.read_text()
    assert "the engine thread stopped" in text and "kiln: error: the engine stopped" in text


def _events(lines: list[str]) -> list:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in lines if line.startswith("data: ")]


def test_sigterm_drains_the_requests_in_flight(demo_dirs, tmp_path):
    """A rolling restart: SIGTERM during 16 streams and 2 whole-answer requests. Admission stops (503 with
    Retry-After, /health 503); the 8 short streams finish; the 8 long ones (slowed past --shutdown-timeout)
    end with an error event and [DONE], the whole-answer ones with a 503; none is cut silently; exit 0."""
    port, log = free_port(), tmp_path / "serve.log"
    options = ("--max-model-len", "256", "--shutdown-timeout", "3")
    with server_process(_command(demo_dirs["llama"], port, *options), port, log, env=ENV) as (proc, url):

        async def restart():
            first_tokens, all_started = 0, asyncio.Event()

            async def stream(http: httpx.AsyncClient, body: dict) -> list:
                nonlocal first_tokens
                lines = []
                async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                    assert response.status_code == 200
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and not lines:
                            first_tokens += 1
                            if first_tokens == 16:
                                all_started.set()
                        lines.append(line)
                return _events(lines)

            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                whole = [http.post("/v1/completions", json=_body(max_tokens=200, seed=SLOW_STEPS)) for _ in range(2)]
                short = [stream(http, _body(PROMPTS[i % 4], max_tokens=12)) for i in range(8)]
                slow = [stream(http, _body(PROMPTS[i % 4], max_tokens=200, seed=SLOW_STEPS)) for i in range(8)]
                tasks = [asyncio.ensure_future(t) for t in (*whole, *short, *slow)]  # the whole ones admitted first
                await asyncio.wait_for(all_started.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                refused, health = await http.post("/v1/completions", json=_body()), await http.get("/health")
                return await asyncio.gather(*tasks), refused, health

        (whole_a, whole_b, *streams), refused, health = asyncio.run(restart())
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5", refused.text
        assert "shutting down" in refused.json()["error"]["message"]
        assert health.status_code == 503, health.text
        for events in streams[:8]:
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length", events[-3:]
        for events in streams[8:]:
            assert events[-1] == "[DONE]" and "--shutdown-timeout of 3 s passed" in events[-2]["error"]["message"], \
                events[-3:]
        for response in (whole_a, whole_b):
            assert response.status_code == 503 and "shut down (SIGTERM)" in response.json()["error"]["message"], \
                response.text
        assert proc.wait(timeout=30) == 0, log.read_text()[-3000:]


def test_a_second_signal_exits_at_once(demo_dirs, tmp_path):
    """SIGTERM starts a drain of 60 s; SIGINT during it exits without waiting."""
    port, log = free_port(), tmp_path / "serve.log"
    options = ("--max-model-len", "256", "--shutdown-timeout", "60")
    with server_process(_command(demo_dirs["llama"], port, *options), port, log, env=ENV) as (proc, url):
        with httpx.stream("POST", url + "/v1/completions", timeout=120,
                          json=_body(max_tokens=200, seed=SLOW_STEPS, stream=True)) as response:
            lines = response.iter_lines()  # held: a dropped iterator closes the stream, which aborts the request
            first = next(lines)
            assert response.status_code == 200 and first.startswith("data: {"), first
            proc.send_signal(signal.SIGTERM)
            while httpx.get(url + "/health").status_code == 200:
                time.sleep(0.05)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=20) is not None
    assert "SIGINT again: exiting now" in log.read_text(), log.read_text()[-3000:]
