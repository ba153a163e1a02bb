"""`kiln serve` under load, and its start-to-ready time from an artifact vs eager, in one run.

    python benchmarks/serving.py [--clients 16] [--requests 4] [--max-tokens 64] [--out results.json]

Writes a demo model (random weights), compiles its artifact, then starts `kiln serve` twice as a
user would (a fresh process each): from the artifact and eager, timing from process start to the
first 200 on /health; against each, N concurrent clients on loopback each stream `--requests`
completions one after another. Reports output tokens per second, and time-to-first-token and
inter-token-latency percentiles (p50/p90/p99) as clients see them.
"""

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit, machine, start_server  # noqa: E402  (benchmarks/ is the script's dir)

MODEL = "bench"


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50_ms": round(q[49] * 1e3, 2), "p90_ms": round(q[89] * 1e3, 2), "p99_ms": round(q[98] * 1e3, 2)}


async def _client(http: httpx.AsyncClient, base: str, prompts: list[str], max_tokens: int, stats: dict) -> None:
    for prompt in prompts:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        sent = time.perf_counter()
        last = None
        async with http.stream("POST", base + "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    stats["tokens"] += chunk["usage"]["completion_tokens"]
                if not chunk["choices"] or not chunk["choices"][0]["text"]:
                    continue
                now = time.perf_counter()
                if last is None:
                    stats["ttft"].append(now - sent)
                else:
                    stats["itl"].append(now - last)
                last = now


async def load(base: str, clients: int, requests: int, max_tokens: int) -> dict:
    from kiln.models.demo import paragraph_openings

    openings = paragraph_openings(5)
    stats: dict = {"tokens": 0, "ttft": [], "itl": []}
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        start = time.perf_counter()
        await asyncio.gather(*(
            _client(http, base, [openings[(c + r) % len(openings)] for r in range(requests)], max_tokens, stats)
            for c in range(clients)))
        wall = time.perf_counter() - start
    return {"clients": clients, "requests": clients * requests, "output_tokens": stats["tokens"],
            "seconds": round(wall, 2), "output_tokens_per_s": round(stats["tokens"] / wall, 1),
            "ttft": _percentiles(stats["ttft"]), "itl": _percentiles(stats["itl"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (default 16)")
    parser.add_argument("--requests", type=int, default=4, help="requests per client, one after another (default 4)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    args = parser.parse_args()
    from kiln.models.demo import write_demo_model

    results: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-serving-") as tmp:
        work = Path(tmp)
        model_dir = write_demo_model(work / "demo", train_steps=0)
        subprocess.run([sys.executable, "-m", "kiln", "compile", str(model_dir), "--cache-dir", str(work / "cache"),
                        "-q"], check=True, capture_output=True)
        for mode in ("artifact", "eager"):
            artifact = ["--require-artifact"] if mode == "artifact" else ["--artifact", "eager"]
            proc, base, seconds = start_server(model_dir, work / f"{mode}.log", "--cache-dir", str(work / "cache"),
                                               "--served-model-name", MODEL, *artifact)
            try:
                results[mode] = {"start_to_ready_s": round(seconds, 2),
                                 **asyncio.run(load(base, args.clients, args.requests, args.max_tokens))}
            finally:
                proc.terminate()
                proc.wait()
            print(mode, results[mode], flush=True)
        results["throughput_artifact_vs_eager"] = round(results["artifact"]["output_tokens_per_s"]
                                                        / results["eager"]["output_tokens_per_s"], 3)
    emit(results, args.out)


if __name__ == "__main__":
    main()
