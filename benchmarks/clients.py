"""The clients people run against vLLM, against a live `kiln serve`: a table of client x feature x result.

    python benchmarks/clients.py [--model DIR] [--out FILE.json]

Each check drives one client feature end to end (the request the client builds, the answer it parses)
on the demo model (trained briefly: its text is no answer to anything, so checks assert that the
client's round trip works, not what the model says; greedy runs that must end use a grammar or a
length limit). A client that is not installed is reported as such, not as passing: `pip install openai
openai-agents langchain-openai litellm` adds them. guidellm and lm-eval have their own runners
(`benchmarks/guidellm.sh`, `benchmarks/eval_parity.py`).
"""

import argparse
import importlib.util
import json
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
CHECKS: list[tuple[str, str, str, Callable[[str], str]]] = []
"""(client, its package, feature, check(base URL) -> what it saw)."""


def check(client: str, package: str, feature: str):
    def register(fn: Callable[[str], str]) -> Callable[[str], str]:
        CHECKS.append((client, package, feature, fn))
        return fn
    return register


def _openai(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


@check("openai", "openai", "chat, streamed and not")
def _(base: str) -> str:
    client = _openai(base)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stream=True)
                       if c.choices)
    assert whole == streamed, (whole, streamed)
    return f"{len(whole)} characters, the same streamed"


@check("openai", "openai", "tools: a required call and its result")
def _(base: str) -> str:
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
def _(base: str) -> str:
    from pydantic import BaseModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    parsed = _openai(base).chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Sky?"}],
                                                  response_format=Sky, max_tokens=40).choices[0].message.parsed
    assert isinstance(parsed, Sky)
    return repr(parsed)


@check("openai", "openai", "responses: text, streamed, a function call across previous_response_id")
def _(base: str) -> str:
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
def _(base: str) -> str:
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
def _(base: str) -> str:
    return _agents(base, "OpenAIResponsesModel")


@check("openai-agents", "agents", "the same on OpenAIChatCompletionsModel")
def _(base: str) -> str:
    return _agents(base, "OpenAIChatCompletionsModel")


def _langchain(base: str):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="unused", max_tokens=120, temperature=0)


@check("langchain", "langchain_openai", "bind_tools(strict=True)")
def _(base: str) -> str:
    answer = _langchain(base).bind_tools([WEATHER], strict=True, tool_choice="get_weather").invoke("Weather?")
    return repr(answer.tool_calls)[:120]


@check("langchain", "langchain_openai", "with_structured_output")
def _(base: str) -> str:
    from pydantic import BaseModel

    class Sky(BaseModel):
        sky: Literal["sunny", "rainy"]

    return repr(_langchain(base).with_structured_output(Sky).invoke("Sky?"))


@check("litellm", "litellm", "completion")
def _(base: str) -> str:
    import litellm

    answer = litellm.completion(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="unused", max_tokens=8,
                                messages=[{"role": "user", "content": "Hi"}])
    return f"{len(answer.choices[0].message.content)} characters"


@check("litellm", "litellm", "embedding")
def _(base: str) -> str:
    import litellm

    answer = litellm.embedding(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="unused", input=["a"])
    return f"{len(answer.data)} vector of {len(answer.data[0]['embedding'])}"


def run(base: str) -> list[dict]:
    rows = []
    for client, package, feature, fn in CHECKS:
        row = {"client": client, "feature": feature}
        if importlib.util.find_spec(package) is None:
            rows.append({**row, "result": "not installed"})
            continue
        try:
            rows.append({**row, "result": "ok", "saw": fn(base)})
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
            rows = run(base)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    failed = [r for r in rows if r["result"] == "FAILED"]
    emit({"rows": rows, "failed": len(failed)}, args.out)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
