"""The clients people run against vLLM, against a live `kiln serve`: a table of client x feature x result.

    python benchmarks/clients.py [--model DIR] [--out FILE.json]

Each check drives one client feature end to end (the request the client builds, the answer it parses)
on the demo model (trained briefly: its text is no answer to anything, so checks assert that the
client's round trip works, not what the model says; greedy runs that must end use a grammar or a
length limit). A client that is not installed is reported as such, not as passing: `pip install openai
openai-agents langchain-openai litellm "lm_eval[api]" guidellm` adds them (guidellm and lm-eval bring
torch: install them beside the installed one, `-c <(echo torch==VERSION)`). guidellm and lm-eval run
small here; their full runs are `benchmarks/guidellm.sh` and `benchmarks/eval_parity.py`.
"""

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Literal

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import emit, start_server  # noqa: E402

MODEL = "demo"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                                                "additionalProperties": False}}}
CHECKS: list[tuple[str, str, str, Callable[[str, Path], str]]] = []
"""(client, its package, feature, check(base URL, the model's directory) -> what it saw)."""


def check(client: str, package: str, feature: str):
    def register(fn: Callable[[str, Path], str]) -> Callable[[str, Path], str]:
        CHECKS.append((client, package, feature, fn))
        return fn
    return register


def _openai(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@check("openai", "openai", "chat, streamed and not")
def _(base: str, model: Path) -> str:
    client = _openai(base)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)
    assert whole == streamed, (whole, streamed)
    return f"{len(whole)} characters, the same streamed"


@check("openai", "openai", "tools: a required call and its result")
def _(base: str, model: Path) -> str:
    client = _openai(base)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], tool_choice="required",
                                           max_tokens=120, parallel_tool_calls=False)
    (call,) = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=4)
    return f"{call.function.name}({call.function.arguments})"


@check("openai", "openai", "parse() with a Pydantic model")
def _(base: str, model: Path) -> str:
    from pydantic import BaseModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    parsed = _openai(base).chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Sky?"}],
                                                  response_format=Sky, max_tokens=40).choices[0].message.parsed
    assert isinstance(parsed, Sky)
    return repr(parsed)


@check("openai", "openai", "responses: text, streamed, a function call across previous_response_id")
def _(base: str, model: Path) -> str:
    client = _openai(base)
    text = client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0)
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=8, temperature=0, stream=True))
    assert events[-1].response.output_text == text.output_text
    tool = {"type": "function", **WEATHER["function"], "strict": True}
    first = client.responses.create(model=MODEL, input="Weather?", tools=[tool], tool_choice="required",
                                    max_output_tokens=120, parallel_tool_calls=False)
    call = first.output[0]
    client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=4,
                            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    return f"{len(events)} events; {call.name}({call.arguments}) answered"


@check("openai", "openai", "embeddings (base64, the client's default)")
def _(base: str, model: Path) -> str:
    data = _openai(base).embeddings.create(model=MODEL, input=["a", "b"]).data
    return f"{len(data)} vectors of {len(data[0].embedding)}"


def _agents(base: str, model_class: str) -> str:
    import agents
    from openai import AsyncOpenAI
    from pydantic import BaseModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    model = getattr(agents, model_class)(model=MODEL, openai_client=client)
    helper = agents.Agent(name="helper", instructions="Answer.", model=model, output_type=Sky)
    agent = agents.Agent(name="main", instructions="Use the tools.", tools=[get_weather], handoffs=[helper],
                         model=model, output_type=Sky)  # strict tools and a handoff, in auto mode
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)
    return f"{result.final_output!r} after {[type(i).__name__ for i in result.new_items]}"


@check("openai-agents", "agents", "a @function_tool agent with a handoff, on OpenAIResponsesModel")
def _(base: str, model: Path) -> str:
    return _agents(base, "OpenAIResponsesModel")


@check("openai-agents", "agents", "the same on OpenAIChatCompletionsModel")
def _(base: str, model: Path) -> str:
    return _agents(base, "OpenAIChatCompletionsModel")


def _langchain(base: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="unused", max_tokens=120, temperature=0)


@check("langchain", "langchain_openai", "bind_tools(strict=True)")
def _(base: str, model: Path) -> str:
    answer = _langchain(base).bind_tools([WEATHER], strict=True, tool_choice="get_weather").invoke("Weather?")
    return repr(answer.tool_calls)[:120]


@check("langchain", "langchain_openai", "with_structured_output")
def _(base: str, model: Path) -> str:
    from pydantic import BaseModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    return repr(_langchain(base).with_structured_output(Sky).invoke("Sky?"))


@check("litellm", "litellm", "completion")
def _(base: str, model: Path) -> str:
    import litellm

    answer = litellm.completion(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="unused", max_tokens=8,
                                messages=[{"role": "user", "content": "Hi"}])
    return f"{len(answer.choices[0].message.content)} characters"


@check("litellm", "litellm", "embedding")
def _(base: str, model: Path) -> str:
    import litellm

    answer = litellm.embedding(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="unused", input=["a"])
    return f"{len(answer.data)} vector of {len(answer.data[0]['embedding'])}"


@check("guidellm", "guidellm", "a synchronous run: streamed chat with continuous usage, 0 errors")
def _(base: str, model: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "benchmarks.json"
        subprocess.run([sys.executable, "-m", "guidellm", "run", "--disable-console-interactive",
                        "--backend", f"kind=openai_http,target={base},model={MODEL}",
                        "--tokenizer", f"kind=huggingface_auto,model={model}",
                        "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8", "--profile", "kind=synchronous",
                        "--constraint", "kind=max_requests,count=6", "--output", f"kind=json,path={out}"],
                       check=True, capture_output=True, text=True, timeout=600)
        totals = json.loads(out.read_text())["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["successful"] == totals["total"] > 0 and totals["errored"] == 0, totals
    return f"{totals['successful']} requests, {totals['errored']} errors"


def _lm_eval(base: str, model: Path, task: dict, limit: int | None = None) -> dict:
    """lm-eval's `local-completions` (echo and logprobs for loglikelihoods, as against vLLM) on one task
    defined from kiln's demo corpus (lm-eval's local `json` loader: nothing is downloaded)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in task.pop("docs")))
        config = {**task, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                  "test_split": "test"}
        (Path(tmp) / "task.yaml").write_text(json.dumps(config))  # YAML reads JSON
        out = lm_eval.simple_evaluate(
            model="local-completions", tasks=[task["task"]], limit=limit, task_manager=TaskManager(include_path=tmp),
            model_args=f"model={MODEL},base_url={base}/v1/completions,tokenizer_backend=huggingface,"
                       f"tokenizer={model},num_concurrent=2,max_retries=1")
    return out["results"][task["task"]]


@check("lm-eval", "lm_eval", "loglikelihood: multiple choice")
def _(base: str, model: Path) -> str:
    from eval_parity import TASK

    docs = [json.loads(line) for line in (HERE / "eval_parity" / f"{TASK}.jsonl").read_text().splitlines()]
    found = _lm_eval(base, model, {"task": "kiln_clients_mc", "docs": docs[:16], "output_type": "multiple_choice",
                                   "doc_to_text": "{{context}}", "doc_to_choice": "{{choices}}",
                                   "doc_to_target": "{{answer}}", "metric_list": [{"metric": "acc"}]})
    return f"accuracy {found['acc,none']:.2f} over 16 items"


@check("lm-eval", "lm_eval", "loglikelihood_rolling: perplexity of whole texts")
def _(base: str, model: Path) -> str:
    from kiln.models.demo import corpus

    texts = [p for p in corpus().split("\n\n") if p.strip()][:4]
    found = _lm_eval(base, model, {"task": "kiln_clients_rolling", "docs": [{"text": t} for t in texts],
                                   "output_type": "loglikelihood_rolling", "doc_to_text": "",
                                   "doc_to_target": "{{text}}", "metric_list": [{"metric": "word_perplexity"}]})
    return f"word perplexity {found['word_perplexity,none']:.2f} over {len(texts)} texts"


@check("lm-eval", "lm_eval", "generate_until: greedy continuations")
def _(base: str, model: Path) -> str:
    from kiln.models.demo import corpus

    sentences = [w for w in (s.split() for s in corpus().split(".")) if len(w) > 8][:8]
    docs = [{"context": " ".join(w[:6]), "answer": " " + " ".join(w[6:])} for w in sentences]  # the sentence's end
    found = _lm_eval(base, model, {"task": "kiln_clients_gen", "docs": docs, "output_type": "generate_until",
                                   "doc_to_text": "{{context}}", "doc_to_target": "{{answer}}",
                                   "generation_kwargs": {"until": [".", "\n"], "max_gen_toks": 48, "do_sample": False},
                                   "metric_list": [{"metric": "exact_match"}]})
    return f"exact match {found['exact_match,none']:.2f} over {len(docs)} prompts"


def run(base: str, model: Path) -> list[dict]:
    rows = []
    for client, package, feature, fn in CHECKS:
        row = {"client": client, "feature": feature}
        if importlib.util.find_spec(package) is None:
            rows.append({**row, "result": "not installed"})
            continue
        try:
            rows.append({**row, "result": "ok", "saw": fn(base, model)})
        except Exception as e:  # noqa: BLE001 - a failed check is a row, and the next one runs
            rows.append({**row, "result": "FAILED", "saw": f"{type(e).__name__}: {e}"[:300],
                         "trace": traceback.format_exc()[-1500:]})
        print(f"{client:<14} {feature:<72} {rows[-1]['result']}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="a model directory (default: the demo model, written here)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-clients-") as tmp:
        model = args.model
        if model is None:
            from kiln.models.demo import write_demo_model

            model = write_demo_model(Path(tmp) / "demo", train_steps=200)
        proc, base, _ = start_server(model, Path(tmp) / "serve.log", "--served-model-name", MODEL,
                                     "--max-model-len", "1024", "--artifact", "eager")
        try:
            rows = run(base, model)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    failed = [r for r in rows if r["result"] == "FAILED"]
    emit({"rows": rows, "failed": len(failed)}, args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
