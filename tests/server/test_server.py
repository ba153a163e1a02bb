"""`kiln serve`'s HTTP API, driven by the official openai client against a live server on loopback
(uvicorn in a thread) over the demo llama's compiled artifact."""

import asyncio
import json
import re
import time

import httpx
import openai
import pytest

from kiln import LLM, SamplingParams
from kiln.models.demo import paragraph_openings
from kiln.runtime.async_engine import AsyncEngine
from kiln.server.app import create_app
from tests.oracle import PROMPTS
from tests.server.live import live_server

MODEL = "demo-llama"
MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def served(demo_dirs, kiln_cache):
    """(base URL, AsyncEngine) of a live server; the engine runs the compiled artifact."""
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    engine = AsyncEngine(llm.engine, model_name=MODEL)
    engine.start()
    try:
        with live_server(create_app(engine, llm.tokenizer, MODEL, MAX_MODEL_LEN)) as url:
            yield url, engine
    finally:
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


def test_metrics_under_vllm_names_too(served, client):
    """Routers written for vLLM (the Gateway API Inference Extension, llm-d) read vLLM's names."""
    base = served[0]
    label = f'model_name="{MODEL}"'
    names = {"kiln_requests_total{finish_reason=\"length\"}":
             f'vllm:request_success_total{{finished_reason="length",{label}}}',
             "kiln_generation_tokens_total": f"vllm:generation_tokens_total{{{label}}}",
             "kiln_prompt_tokens_total": f"vllm:prompt_tokens_total{{{label}}}",
             "kiln_time_to_first_token_seconds_count": f"vllm:time_to_first_token_seconds_count{{{label}}}"}
    before = {name: _metric(base, name) for pair in names.items() for name in pair}
    prompt = [5, 6, 7, 8, 9]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, n=2,
                              extra_body={"ignore_eos": True})
    grew = {name: _metric(base, name) - before[name] for name in before}
    for kiln_name, vllm_name in names.items():
        assert grew[kiln_name] == grew[vllm_name], (kiln_name, grew)
    assert grew[f"vllm:generation_tokens_total{{{label}}}"] == 12
    assert grew[f"vllm:prompt_tokens_total{{{label}}}"] == 10
    assert grew[f'vllm:request_success_total{{finished_reason="length",{label}}}'] == 2
    text = httpx.get(base + "/metrics").text
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert re.search(rf"^{re.escape(gauge)}{{{label}}} \S+$", text, re.M), gauge
    assert re.search(r'^vllm:cache_config_info{block_size="\d+",cache_dtype="auto",num_gpu_blocks="\d+"} 1.0$', text, re.M)


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
def test_bad_completion_input_is_a_4xx_in_vllms_shape(served, body, status, text):
    response = httpx.post(served[0] + "/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert text in err["message"] and set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ({400: "BadRequestError", 404: "NotFoundError"}[status], status)


def test_echo_scores_the_prompt_as_transformers_does(served, hf_models, eager):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens 1 (and
    OpenAI's max_tokens 0, which generates nothing)."""
    import torch

    ids = eager.tokenizer.encode(PROMPTS[2])
    with torch.no_grad():
        want = hf_models["llama"](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    expected = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    for max_tokens in (1, 0):
        body = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
                "temperature": 0}
        answer = httpx.post(served[0] + "/v1/completions", json=body, timeout=60).json()
        [choice] = answer["choices"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + max_tokens and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
        assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:len(ids)], expected)) < 1e-4
        greedy = [int(want[i].argmax()) == t for i, t in enumerate(ids[1:])]
        tops = [list(t)[0] == tok for t, tok in zip(lp["top_logprobs"][1:len(ids)], lp["tokens"][1:])]
        assert tops == greedy  # how lm-eval decides is_greedy
        assert choice["text"].startswith(eager.tokenizer.decode(ids))
        assert lp["text_offset"][0] == 0 and answer["usage"]["completion_tokens"] == max_tokens
    text = httpx.post(served[0] + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[0], "echo": True, "max_tokens": 3, "temperature": 0,
        "ignore_eos": True}).json()["choices"][0]["text"]
    assert text.startswith(PROMPTS[0]) and len(text) > len(PROMPTS[0])
    streamed = [json.loads(line[6:]) for line in httpx.post(served[0] + "/v1/completions", json={
        "model": MODEL, "prompt": PROMPTS[0], "echo": True, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
        "stream": True}).text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in streamed) == text


def test_vllm_prompt_logprobs(served, hf_models, eager):
    import torch

    ids = eager.tokenizer.encode(PROMPTS[0])
    body = {"model": MODEL, "prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}
    [choice] = httpx.post(served[0] + "/v1/completions", json=body, timeout=60).json()["choices"]
    with torch.no_grad():
        want = hf_models["llama"](torch.tensor([ids])).logits[0].float().log_softmax(-1)
    prompt_logprobs = choice["prompt_logprobs"]
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for pos, (entry, token) in enumerate(zip(prompt_logprobs[1:], ids[1:])):
        assert abs(entry[str(token)]["logprob"] - want[pos, token].item()) < 1e-4
        assert entry[str(token)]["rank"] == int((want[pos] > want[pos, token]).sum()) + 1
        assert {str(t) for t in want[pos].topk(2).indices.tolist()} <= set(entry)


def _greedy_with_penalties(hf, prompt: list[int], n: int, bias: dict[int, float], presence: float = 0.0,
                           frequency: float = 0.0, repetition: float = 1.0) -> list[int]:
    """The reference: transformers' logits, the formulas applied here, argmax."""
    import torch

    ids, out, past, step = list(prompt), [], None, list(prompt)
    with torch.no_grad():
        for _ in range(n):
            run = hf(torch.tensor([step]), past_key_values=past, use_cache=True)
            logits, past = run.logits[0, -1].float(), run.past_key_values
            for t, v in bias.items():
                logits[t] += v
            for t in set(ids):
                logits[t] = logits[t] / repetition if logits[t] > 0 else logits[t] * repetition
            for t in set(out):
                logits[t] -= frequency * out.count(t) + presence
            token = int(logits.argmax())
            ids.append(token)
            out.append(token)
            step = [token]
    return out


@pytest.mark.parametrize("fields", [
    {"logit_bias": {"5": 100}}, {"logit_bias": {"first": -100, "17": 6.5}}, {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5}, {"repetition_penalty": 1.8}, {"presence_penalty": -0.5, "frequency_penalty": 1.5},
])
def test_penalties_and_biases_change_greedy_choices_by_their_formula(served, hf_models, eager, fields):
    """The demo model's logits are peaked: penalties within OpenAI's range change its greedy choice
    only once it starts repeating itself, hence 64 tokens."""
    ids, n = eager.tokenizer.encode(PROMPTS[2]), 64
    plain = _greedy_with_penalties(hf_models["llama"], ids, n, {})
    if "first" in fields.get("logit_bias", {}):  # a bias against the unbiased greedy's first token
        bias = dict(fields["logit_bias"])
        fields = {"logit_bias": {str(plain[0]): bias.pop("first"), **bias}}
    body = {"model": MODEL, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **fields}
    choice = httpx.post(served[0] + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    want = _greedy_with_penalties(hf_models["llama"], ids, n, {int(k): v for k, v in fields.get("logit_bias", {}).items()},
                                  fields.get("presence_penalty", 0.0), fields.get("frequency_penalty", 0.0),
                                  fields.get("repetition_penalty", 1.0))
    assert want != plain  # the field matters on this prompt
    assert [eager.tokenizer.decode([t]) for t in want] == choice["logprobs"]["tokens"]
    if fields == {"logit_bias": {"5": 100}}:
        assert want == [5] * n


KILN_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "kind": {"enum": ["kiln", "oven", "furnace"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 500},
                                                  "h": {"type": "integer", "minimum": -9, "maximum": 99}},
                 "required": ["w", "h"], "additionalProperties": False},
        "glazes": {"type": "array", "items": {"enum": ["celadon", "tenmoku", "shino"]}, "maxItems": 3},
        "fired": {"type": "boolean"},
    },
    "required": ["name", "kind", "size", "glazes", "fired"],
    "additionalProperties": False,
}


def test_json_schema_outputs_always_validate(served):
    """20 seeded samples (temperature 1, a random-ish demo model that would never write JSON by
    itself), ten to a batch: every one parses and matches the schema, nested object and enums included."""
    import jsonschema

    body = {"model": MODEL, "messages": [{"role": "user", "content": "Describe a kiln"}], "max_tokens": 200,
            "temperature": 1.0, "n": 10,
            "response_format": {"type": "json_schema", "json_schema": {"name": "kiln", "schema": KILN_SCHEMA}}}
    choices = [c for seed in (0, 10) for c in httpx.post(served[0] + "/v1/chat/completions", json={**body, "seed": seed},
                                                          timeout=120).json()["choices"]]  # seeds 0-19
    docs = [json.loads(c["message"]["content"]) for c in choices]
    assert all(c["finish_reason"] == "stop" for c in choices)
    for doc in docs:
        jsonschema.validate(doc, KILN_SCHEMA)
    assert len({json.dumps(d) for d in docs}) > 10  # sampled, not one answer 20 times
    assert [list(d) for d in docs] == [list(KILN_SCHEMA["properties"])] * 20  # the schema's order
    again = httpx.post(served[0] + "/v1/chat/completions", json={**body, "n": 2, "seed": 0}, timeout=120).json()
    assert [c["message"]["content"] for c in again["choices"]] == \
        [c["message"]["content"] for c in choices[:2]]  # seeded: reproducible


@pytest.mark.parametrize("fields, check", [
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}},
     lambda t: 2 <= len(json.loads(t)) <= 4 and all(isinstance(x, int) for x in json.loads(t))),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2,4}"}}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2,4}", t)),
    ({"guided_choice": ["red clay", "blue glaze"]}, lambda t: t in ("red clay", "blue glaze")),
    ({"structured_outputs": {"choice": ["stoneware", "porcelain"]}}, lambda t: t in ("stoneware", "porcelain")),
    ({"guided_grammar": 'start: "fire" " " ("low" | "high")'}, lambda t: t in ("fire low", "fire high")),
])
def test_vllm_and_openai_constraint_fields(served, fields, check):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 120, "temperature": 1.0, "seed": 3, "n": 4,
            **fields}
    answer = httpx.post(served[0] + "/v1/completions", json=body, timeout=120).json()
    # sampled at temperature 1 from the demo model, a JSON string or number may run past max_tokens
    stopped = [c for c in answer["choices"] if c["finish_reason"] == "stop"]
    assert len(stopped) >= 3 and all(c["finish_reason"] == "length" for c in answer["choices"] if c not in stopped)
    for choice in stopped:
        assert check(choice["text"]), choice


def test_grammars_compile_off_the_engine_thread(served, monkeypatch):
    """A 30 KB schema with n=16 (16 matchers): compiled once, on a worker thread before admission; the
    engine thread only copies it (it used to build every matcher itself, 30 ms each, stalling every
    stream). The choices still follow the schema."""
    import threading

    from kiln.runtime.structured_output import GrammarBackend

    compiled_on, compile = [], GrammarBackend._compile
    monkeypatch.setattr(GrammarBackend, "_compile", lambda self, grammar: compiled_on.append(
        threading.current_thread().name) or compile(self, grammar))
    schema = {"anyOf": [{"type": "object", "properties": {f"p{i}_{j}": {"type": "integer"} for j in range(10)},
                         "required": [f"p{i}_{j}" for j in range(10)]} for i in range(75)]}
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "seed": 5, "n": 16,
            "guided_json": schema}
    answer = httpx.post(served[0] + "/v1/completions", json=body, timeout=120).json()
    assert len(answer["choices"]) == 16 and all(c["text"].startswith('{"p') for c in answer["choices"])
    assert len(compiled_on) == 1 and compiled_on[0] != "kiln-engine", compiled_on


@pytest.mark.parametrize("fields, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid json for structured output"),
    ({"guided_regex": "[0-9"}, "invalid regex for structured output"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_regex and guided_choice both constrain the output"),
    ({"response_format": {"type": "json_object"}, "guided_json": {"type": "object"}},
     "response_format and guided_json both constrain the output"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "`structured_outputs.whitespace_pattern`"),
    ({"response_format": {"type": "json_schema"}}, "json_schema goes with type json_schema"),
    ({"guided_json": {"type": "object"}, "min_tokens": 3}, "min_tokens cannot be combined with structured output"),
])
def test_bad_constraints_get_400s_naming_them(served, fields, message):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, **fields}
    r = httpx.post(served[0] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text


def test_best_of_returns_the_most_likely_of_its_samples(served):
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 1.0, "seed": 11, "ignore_eos": True}
    samples = httpx.post(served[0] + "/v1/completions", json={**body, "n": 4, "logprobs": 0}).json()["choices"]
    best = httpx.post(served[0] + "/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    ranked = sorted(samples, key=lambda c: -sum(c["logprobs"]["token_logprobs"]))
    assert [c["text"] for c in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in best["choices"]] == [0, 1] and best["choices"][0]["logprobs"] is None
    assert best["usage"]["completion_tokens"] == 4 * 8


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "guided_decoding_backend", "xgrammar"),
    ("/v1/completions", "frequency_penalties", 1.0),
    ("/v1/completions", "suffix", " the end"),
    ("/v1/completions", "guided_whitespace_pattern", " "),
    ("/v1/chat/completions", "response_format", {"type": "json_object", "strict": True}),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}),
    ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
])
def test_fields_kiln_would_ignore_are_refused_by_name(served, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]})
    response = httpx.post(served[0] + path, json=body)
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["message"]
    neutral = {"suffix": "", "response_format": {"type": "text"}}
    if field in neutral:  # the value that asks for nothing is accepted
        assert httpx.post(served[0] + path, json={**body, field: neutral[field]}).status_code == 200


def test_malformed_requests_are_4xx(served):
    base = served[0]
    bad_json = httpx.post(base + "/v1/completions", content=b'{"model": "demo-llama", "prompt": ',
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL}):
        response = httpx.post(base + "/v1/chat/completions", json=body)
        assert response.status_code == 400 and "error" in response.json(), body
    deep = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 200_000 + "]" * 200_000}}]}]
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": deep}), ("/tokenize", {"messages": deep})):
        response = httpx.post(base + path, json=body)  # Python's JSON parser recursed past its limit: was a 500
        assert response.status_code == 400 and "nest deeper" in response.json()["error"]["message"], response.text
    assert httpx.get(base + "/v1/nothing").status_code == 404
    assert httpx.get(base + "/v1/completions").status_code == 405
    assert httpx.get(base + "/v1/models").json()["data"][0]["id"] == MODEL
    assert httpx.get(base + "/health").status_code == 200


UNSTATABLE = ("leaves no room to generate", "exceed the model's context", "/tokenize counts at most", "must be >= n",
              "seed must be",
              "constrains the output already", "which is not among the tools")
"""Refusals of schema-valid requests that the schema does not state: a prompt's length in tokens against the
context (a text's against 4 contexts for /tokenize), one number against another (best_of >= n, seed + n - 1
within 64 bits) and a named tool_choice against the tools' names, which JSON Schema cannot; and an output constraint beside the grammar that strict tools or
parallel_tool_calls false bring in auto mode, which it can but schemathesis's canonicalizer then gives up on the
chat schema (over 32 branches)."""


def test_schemathesis_checks_pass(served, tmp_path):
    """schemathesis's CLI with all its checks against the live server: no 5xx (it found a temperature
    of 1e-300 and a repetition_penalty of 5e-324 that killed the engine), documented statuses and
    content types, 405s with Allow, schema-invalid input refused, and schema-valid input accepted: the
    schema states the non-empty prompt, the one-constraint rule and the other rules between fields.
    A failure other than a slow response, or a refusal of valid input other than `UNSTATABLE`, fails."""
    import base64
    import subprocess
    import sys

    report = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", served[0] + "/openapi.json", "--checks",
                           "all", "--max-examples", "25", "--seed", "1", "--request-timeout", "60", "--report", "ndjson",
                           "--report-dir", str(report)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    operations = sum(len(ops) for ops in httpx.get(served[0] + "/openapi.json").json()["paths"].values())
    assert f"Selected: {operations}/{operations}" in proc.stdout, proc.stdout[-2000:]  # every one tested
    codes, refused = set(), []
    for line in next(report.glob("*.ndjson")).read_text().splitlines():
        recorder = json.loads(line).get("ScenarioFinished", {}).get("recorder", {})
        for case, checks in recorder.get("checks", {}).items():
            for failure in (c["failure_info"]["failure"] for c in checks if c.get("failure_info")):
                codes.add(failure["code"])
                if failure["code"] == "ST202":
                    content = recorder["interactions"][case]["response"]["content"]
                    refused.append(json.loads(base64.b64decode(content["$base64"]))["error"]["message"])
    assert codes <= {"ST112", "ST202"}, (codes, proc.stdout[-4000:])  # ST112: a response slower than 10 s
    assert all(any(reason in message for reason in UNSTATABLE) for message in refused), refused


def test_extreme_sampling_values_are_safe(served):
    base = served[0]
    greedy = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = httpx.post(base + "/v1/completions", json=greedy).json()["choices"][0]["text"]
    tiny = httpx.post(base + "/v1/completions", json={**greedy, "temperature": 1e-300}).json()
    assert tiny["choices"][0]["text"] == want  # below 1e-5: greedy, as in vLLM
    r = httpx.post(base + "/v1/completions", json={**greedy, "repetition_penalty": 5e-324})
    assert r.status_code == 400 and "repetition_penalty" in r.json()["error"]["message"]
    assert httpx.get(base + "/health").status_code == 200


def test_openapi_documents_every_status(served):
    schema = httpx.get(served[0] + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "405", "408", "413", "499", "500", "503"}
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        model = schema["components"]["schemas"][body.rsplit("/", 1)[1]]
        assert model["properties"]["model"]["enum"] == [MODEL] and "seed" in model["properties"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    r = httpx.request("DELETE", served[0] + "/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.json()["error"]["message"]


def test_a_failed_step_fails_its_requests_only_and_serving_goes_on(eager):
    """A bug in a step: the requests it ran get a 500 in OpenAI's shape (an error event when
    streaming), the engine stays up and healthy, and the next request is served correctly."""
    from fastapi.testclient import TestClient

    engine = AsyncEngine(eager.engine, model_name=MODEL)
    real, fail = eager.engine.runner.execute, [True]

    def execute(*args, **kwargs):
        if fail.pop() if fail else False:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    want = eager.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].text
    eager.engine.runner.execute = execute
    engine.start()
    try:
        with TestClient(create_app(engine, eager.tokenizer, MODEL, MAX_MODEL_LEN)) as http:
            failed = http.post("/v1/completions", json=body)
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
            assert "injected" in failed.json()["error"]["message"]
            assert http.get("/health").status_code == 200
            assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
            fail.append(True)
            lines = http.post("/v1/completions", json={**body, "stream": True}).text.splitlines()
            assert any('"error"' in line and "injected" in line for line in lines) and lines[-2] == "data: [DONE]"
            assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want
            assert engine.num_requests == 0 and eager.engine.scheduler.kv_usage == 0
    finally:
        engine.shutdown()
        eager.engine.runner.execute = real


def test_a_stopped_engine_is_unhealthy_and_refuses_work(eager):
    from fastapi.testclient import TestClient

    stopped = AsyncEngine(eager.engine)  # never started: as after a failed step
    with TestClient(create_app(stopped, eager.tokenizer, MODEL, MAX_MODEL_LEN)) as http:
        assert http.get("/health").status_code == 503
        response = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert response.status_code == 503 and "not running" in response.json()["error"]["message"]
