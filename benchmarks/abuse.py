"""`kiln serve` against a hostile client: what each attack is answered, and what it costs the requests
beside it; and how kiln stops (SIGTERM while serving, SIGKILL while compiling) and answers nonsense
through its Python API and CLI.

    python benchmarks/abuse.py [--out results.json] [--skip-costs]

Two servers, each a fresh `kiln serve` process run eagerly, as a user would start it:

- answers: the demo model, default limits. Each attack of the server's threat list once, with the
  status and message it gets, the seconds to its answer, the server's RSS before and after, and
  whether /health still answers 200 after it.
- stalls: a streaming neighbour's largest gap between tokens, alone and beside three n-16 requests
  with a 30 KB JSON schema each (grammars compile off the engine thread).
- drain: SIGTERM during 16 long streams under --shutdown-timeout 2: how each stream ended (finished,
  error event, cut), what a new request and /health got meanwhile, the exit status.
- killed_compile: SIGKILL on `kiln compile` with two forked workers; how many live on 5 s later.
- python_api_and_cli: a batch with one bad prompt and the call after it, nonsense LLM and
  SamplingParams arguments, `kiln cache ls` on a file, a KV cache smaller than max_model_len.
- costs: random weights in Qwen2.5-0.5B's shape with its full 151936-token vocabulary (a word-level
  tokenizer over it), the caps raised so that the costly requests are admitted. A plain request (32
  prompt tokens, 32 greedy tokens) is timed alone (median of 3), then again beside each attack: a
  100 MB body, one request with a 100k-entry logit_bias, one with 20k stop strings of 2 KB, and as
  the control a plain 64-token request (any neighbour shares the steps: the attacks' own cost is the
  ratio to the control). For the body: seconds to its 413 and the server's RSS before, after and at
  its peak.
"""

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import emit, machine, process_memory, start_server  # noqa: E402  (benchmarks/ is the script's dir)

PLAIN = {"model": "m", "prompt": [(13 * i) % 5000 + 100 for i in range(32)], "max_tokens": 32, "temperature": 0,
         "ignore_eos": True}


def attacks() -> dict[str, tuple[str, dict | bytes]]:
    """name -> (path, body) of each attack the server must turn away or contain."""
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    plain = {"model": "m", "prompt": "hi", "max_tokens": 2}
    text = "a b " * 1_000_000
    return {
        "seed 2^64": ("/v1/completions", {**plain, "seed": 2**64}),
        "seed -2^63-1 (chat)": ("/v1/chat/completions", {**chat, "seed": -(2**63) - 1}),
        "seed 2^64-1, n 2": ("/v1/completions", {**plain, "seed": 2**64 - 1, "n": 2}),
        "every token masked": ("/v1/completions", {**plain, "temperature": 1, "min_tokens": 1,
                                                   "stop_token_ids": list(range(512))}),
        "guided_choice of 2000": ("/v1/completions", {**plain, "guided_choice": [f"c{i}" for i in range(2000)]}),
        "100 MB prompt": ("/v1/completions", b'{"model": "m", "prompt": "' + b"x" * 100 * 2**20 + b'"}'),
        "5M logit_bias keys": ("/v1/completions", b'{"model": "m", "prompt": "hi", "logit_bias": {'
                               + b", ".join(b'"%d": 1' % i for i in range(5_000_000)) + b"}}"),
        "100k logit_bias entries": ("/v1/completions", {**plain, "logit_bias": {str(i): 1 for i in range(100_000)}}),
        "20k stop strings of 2 KB": ("/v1/completions", {**plain, "stop": ["x" * 2047 + str(i % 10) for i in range(20_000)]}),
        "logit_bias key '\u00b2'": ("/v1/completions", {**plain, "logit_bias": {"\u00b2": 1}}),
        "lone surrogate": ("/v1/completions", b'{"model": "m", "prompt": "\\ud800"}'),
        "NaN temperature": ("/v1/completions", b'{"model": "m", "prompt": "hi", "temperature": NaN}'),
        "/tokenize 4 MB with token strs": ("/tokenize", {"prompt": text, "return_token_strs": True}),
        "4 MB prompt": ("/v1/completions", {**plain, "prompt": text}),
        "4 MB chat message": ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": text}]}),
        "/detokenize 1M ids": ("/detokenize", {"tokens": [11] * 1_000_000}),
        "tool call arguments nested 200k deep": ("/v1/chat/completions", {**chat, "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
                "name": "f", "arguments": "[" * 200_000 + "]" * 200_000}}]}]}),
    }


def answers(model_dir: Path) -> dict:
    server, url, _ = start_server(model_dir, None, "--artifact", "eager", "--served-model-name", "m")
    try:
        found = {}
        for name, (path, body) in attacks().items():
            start = time.perf_counter()
            content = body if isinstance(body, bytes) else None
            rss = process_memory(server.pid, "VmRSS")
            r = httpx.post(url + path, content=content, json=None if content else body, timeout=120)
            message = r.json()["error"]["message"] if r.status_code != 200 else "ok"
            found[name] = {"status": r.status_code, "seconds": round(time.perf_counter() - start, 3),
                           "message": message[:160], "healthy_after": httpx.get(url + "/health").status_code == 200,
                           "rss_mb_before": rss >> 20, "rss_mb_after": process_memory(server.pid, "VmRSS") >> 20}
            print(f"{name}: {r.status_code} {message[:100]}", flush=True)
        return found
    finally:
        server.terminate()
        server.wait(timeout=60)


async def _plain_latency(http: httpx.AsyncClient) -> float:
    start = time.perf_counter()
    r = await http.post("/v1/completions", json=PLAIN)
    assert r.status_code == 200, r.text
    return time.perf_counter() - start


async def _beside(url: str, attack) -> dict:
    """The plain request's latency while `attack` (a coroutine function taking the client) runs."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        task = asyncio.create_task(attack(http))
        await asyncio.sleep(0.05)  # the attack is admitted first
        latency = await _plain_latency(http)
        result = await task
    return {"plain_s": round(latency, 3), **result}


def _grammar(salt: int) -> dict:
    """A 30 KB JSON schema: anyOf 75 objects of 10 required integers (property names salted, so that each
    request compiles its own)."""
    return {"anyOf": [{"type": "object", "properties": {f"p{salt}_{i}_{j}": {"type": "integer"} for j in range(10)},
                       "required": [f"p{salt}_{i}_{j}" for j in range(10)]} for i in range(75)]}


async def _largest_gap(url: str, attacks: list[dict]) -> float:
    """A streaming neighbour's largest gap between tokens (seconds) while `attacks` are sent one after another."""
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        stamps = []

        async def neighbour():
            body = {"model": "m", "prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        stamps.append(time.perf_counter())

        task = asyncio.create_task(neighbour())
        while not stamps:
            await asyncio.sleep(0.01)
        for body in attacks:
            await http.post("/v1/completions", json=body)
        await task
    return max(b - a for a, b in zip(stamps, stamps[1:]))


def stalls(model_dir: Path) -> dict:
    """Grammar building on the engine thread (#58 item 2): a streaming neighbour's largest gap between
    tokens, alone and beside three back-to-back requests of n 16 with a 30 KB schema each."""
    server, url, _ = start_server(model_dir, None, "--artifact", "eager", "--served-model-name", "m")
    try:
        attacks = [{"model": "m", "prompt": "x", "max_tokens": 2, "n": 16, "guided_json": _grammar(i)} for i in range(3)]
        found = {"largest_gap_alone_s": round(asyncio.run(_largest_gap(url, [])), 3),
                 "largest_gap_beside_s": round(asyncio.run(_largest_gap(url, attacks)), 3)}
        print("grammar stall:", found, flush=True)
        return found
    finally:
        server.terminate()
        server.wait(timeout=60)


def drain(model_dir: Path) -> dict:
    """A rolling restart (#58 item 5): SIGTERM during 16 streams that outlast --shutdown-timeout 2. How each
    stream ended, what a request and /health got during the drain, and the exit status."""
    server, url, _ = start_server(model_dir, None, "--artifact", "eager", "--served-model-name", "m",
                                  "--shutdown-timeout", "2")

    async def run() -> dict:
        ends, started = [], asyncio.Event()

        async def stream(http):
            last, done = None, False
            body = {"model": "m", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            try:
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            started.set()
                            done, last = line == "data: [DONE]", last if line == "data: [DONE]" else line
            except httpx.HTTPError:
                done = False
            ends.append(("error event" if '"error"' in (last or "") else "finished") if done else "cut")

        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            tasks = [asyncio.create_task(stream(http)) for _ in range(16)]
            await started.wait()
            await asyncio.sleep(0.5)
            start = time.perf_counter()
            server.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            during = {}
            for name, call in (("request", lambda: http.post("/v1/completions", json={"model": "m", "prompt": "hi"})),
                               ("health", lambda: http.get("/health"))):
                try:
                    r = await call()
                    during[name] = r.status_code if r.status_code != 503 or name == "health" else \
                        f"503, Retry-After {r.headers.get('retry-after')}"
                except httpx.HTTPError as e:
                    during[name] = type(e).__name__
            await asyncio.gather(*tasks, return_exceptions=True)
        code = await asyncio.to_thread(server.wait, 60)
        return {"streams": {kind: ends.count(kind) for kind in ("finished", "error event", "cut")},
                "during_drain": during,
                "exit_code": code, "exit_s": round(time.perf_counter() - start, 2)}

    try:
        found = asyncio.run(run())
        print("drain:", found, flush=True)
        return found
    finally:
        server.kill()


def killed_compile(model_dir: Path, cache: Path) -> dict:
    """SIGKILL on `kiln compile` while its forked workers compile (#58 item 4): workers alive 5 s later."""
    env = {**os.environ, "KILN_COMPILE_WORKERS": "2"}
    argv = [sys.executable, "-m", "kiln", "compile", str(model_dir), "--cache-dir", str(cache)]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    command = "\0".join(argv).encode() + b"\0"  # a forked worker's (/proc may show the parent's before the exec)
    workers: list[int] = []
    while len(workers) < 2 and proc.poll() is None:
        time.sleep(0.1)
        workers = [p for p in _children(proc.pid) if _read(f"/proc/{p}/cmdline") == command]
    proc.kill()
    proc.wait()
    time.sleep(5)
    alive = [p for p in workers if _read(f"/proc/{p}/stat").rsplit(b")", 1)[-1].split()[:1] not in ([], [b"Z"])]
    for p in alive:
        os.kill(p, signal.SIGKILL)
    found = {"workers": len(workers), "alive_5s_after": len(alive)}
    print("killed compile:", found, flush=True)
    return found


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _children(pid: int) -> list[int]:
    return [int(e.name) for e in Path("/proc").iterdir() if e.name.isdigit()
            and _read(f"/proc/{e.name}/stat").rsplit(b")", 1)[-1].split()[1:2] == [str(pid).encode()]]


def python_api_and_cli(model_dir: Path, work: Path) -> dict:
    """#58 items 3, 7, 8 and 10: what the Python API and the CLI answer to nonsense, and when."""
    from kiln import LLM, SamplingParams

    def outcome(fn) -> str:
        try:
            fn()
            return "accepted"
        except Exception as e:  # noqa: BLE001 - the answer is the row
            return f"{type(e).__name__}: {str(e)[:120]}"

    llm = LLM(model_dir)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    found = {"generate with one bad prompt": outcome(lambda: llm.generate(["The kiln", [99999]], greedy)),
             "the next call": outcome(lambda: llm.generate(["The kiln"], greedy)),
             "LLM(max_model_len=0)": outcome(lambda: LLM(model_dir, max_model_len=0)),
             "SamplingParams(temperature=nan)": outcome(lambda: SamplingParams(temperature=float("nan"))),
             'SamplingParams(seed="x")': outcome(lambda: SamplingParams(seed="x"))}
    (work / "not-a-dir").write_text("x")
    for name, args in (("kiln cache ls on a file", ["cache", "ls", "--cache-dir", str(work / "not-a-dir")]),
                       ("kiln generate, KV cache below max_model_len", ["generate", str(model_dir), "--prompt", "x",
                        "--kv-cache-memory", "64K", "--max-model-len", "1024"])):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True, timeout=300)
        found[name] = {"exit": proc.returncode, "stderr": proc.stderr.strip()[-160:],
                       "seconds": round(time.perf_counter() - start, 2)}
    for name, value in found.items():
        print(f"{name}: {value}", flush=True)
    return found


def costs(work: Path) -> dict:
    model_dir = write_model(work / "qwen2.5-0.5b-shape")
    server, url, ready = start_server(model_dir, None, "--artifact", "eager", "--served-model-name", "m",
                                      "--max-model-len", "2048", "--max-request-bytes", "64M",
                                      "--max-logit-bias", "200000", "--max-stop-strings", "20000",
                                      "--max-stop-length", "2048")
    try:
        async def solo() -> list[float]:
            async with httpx.AsyncClient(base_url=url, timeout=600) as http:
                await _plain_latency(http)  # warm-up
                return [await _plain_latency(http) for _ in range(3)]

        alone = statistics.median(asyncio.run(solo()))
        results = {"ready_s": round(ready, 1), "plain_alone_s": round(alone, 3)}
        before = process_memory(server.pid, "VmRSS")

        async def huge_body(http):
            start = time.perf_counter()
            r = await http.post("/v1/completions", content=b"x" * (100 * 2**20))
            return {"status": r.status_code, "answered_s": round(time.perf_counter() - start, 3)}

        async def control(http):  # what any neighbour costs: sharing the steps
            r = await http.post("/v1/completions", json={**PLAIN, "max_tokens": 64})
            return {"status": r.status_code}

        async def bias(http):
            body = {**PLAIN, "max_tokens": 64, "logit_bias": {str(i): 0.5 for i in range(100_000)}}
            r = await http.post("/v1/completions", json=body)
            return {"status": r.status_code}

        async def stops(http):
            body = {**PLAIN, "max_tokens": 64, "stop": ["x" * 2047 + str(i % 10) for i in range(20_000)]}
            r = await http.post("/v1/completions", json=body)
            return {"status": r.status_code}

        for name, attack in (("100 MB body", huge_body), ("plain neighbour", control), ("100k logit_bias", bias),
                             ("20k stop strings", stops)):
            found = asyncio.run(_beside(url, attack))
            found["plain_vs_alone"] = round(found["plain_s"] / alone, 2)
            if name in ("100k logit_bias", "20k stop strings"):
                found["plain_vs_beside_plain"] = round(found["plain_s"] / results["plain neighbour"]["plain_s"], 2)
            if name == "100 MB body":
                found.update(rss_before_mb=round(before / 2**20), rss_after_mb=round(process_memory(server.pid, "VmRSS") / 2**20),
                             rss_peak_mb=round(process_memory(server.pid, "VmHWM") / 2**20))
            results[name] = found
            print(name, found, flush=True)
        return results
    finally:
        server.terminate()
        server.wait(timeout=60)


def write_model(out: Path) -> Path:
    """Qwen2.5-0.5B's shape with random weights (`quantization.write_05b_model`), and a word-level
    tokenizer over its whole vocabulary: token i is the word "w{i}"."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers
    from quantization import write_05b_model

    if not (out / "config.json").is_file():
        write_05b_model(out)
    config = json.loads((out / "config.json").read_text())
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(config["vocab_size"])}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--skip-costs", action="store_true", help="the answers only (no 0.5B-shaped model)")
    args = parser.parse_args()
    from kiln.models.demo import write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        demo = write_demo_model(Path(tmp) / "demo", train_steps=0)
        results = {"machine": machine(), "answers": answers(demo), "stalls": stalls(demo), "drain": drain(demo),
                   "killed_compile": killed_compile(demo, Path(tmp) / "cache"),
                   "python_api_and_cli": python_api_and_cli(demo, Path(tmp))}
        if not args.skip_costs:
            results["costs"] = costs(Path(tmp))
    emit(results, args.out)


if __name__ == "__main__":
    main()
