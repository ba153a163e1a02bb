"""`kiln serve` under a flood: every request answered (a completion or a 503), memory bounded.

    python benchmarks/flood.py [--max-num-seqs 8] [--max-queued-requests 32] [--times 4] [--out results.json]

Writes a demo model, starts `kiln serve` on it eagerly (a fresh process, as a user would), then
sends `times` x (max-num-seqs + max-queued-requests) completions at once (512-token prompts, 32 new
tokens each) and counts the answers by status. Done twice: with the queue limit, and with a limit
too high to bite (the unbounded queue kiln had before), reporting the server's resident memory
before the flood and at its peak (VmHWM).
"""

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit, machine, process_memory, start_server  # noqa: E402  (benchmarks/ is the script's dir)


async def _flood(url: str, count: int, prompt: list[int]) -> collections.Counter:
    body = {"model": "m", "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        async def one() -> str:
            try:
                return str((await http.post("/v1/completions", json=body)).status_code)
            except httpx.TransportError as e:
                return type(e).__name__

        return collections.Counter(await asyncio.gather(*(one() for _ in range(count))))


def run(model_dir: Path, max_num_seqs: int, max_queued: int, count: int) -> dict:
    server, url, _ = start_server(model_dir, None, "--artifact", "eager", "--served-model-name", "m",
                                  "--max-num-seqs", str(max_num_seqs), "--max-queued-requests", str(max_queued),
                                  "--max-model-len", "1024")
    try:
        before = process_memory(server.pid, "VmRSS")
        start = time.perf_counter()
        statuses = asyncio.run(_flood(url, count, [10 + i % 400 for i in range(512)]))
        return {"max_num_seqs": max_num_seqs, "max_queued_requests": max_queued, "sent": count,
                "completed": statuses.pop("200", 0), "refused_503": statuses.pop("503", 0), "other": dict(statuses),
                "seconds": round(time.perf_counter() - start, 1), "rss_before_mb": round(before / 2**20),
                "rss_peak_mb": round(process_memory(server.pid, "VmHWM") / 2**20)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--max-queued-requests", type=int, default=32)
    parser.add_argument("--times", type=int, default=4, help="the flood, in multiples of what is admitted")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    from kiln.models.demo import write_demo_model

    count = args.times * (args.max_num_seqs + args.max_queued_requests)
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "demo", train_steps=0)
        results = {"machine": machine(),
                   "limited": run(model, args.max_num_seqs, args.max_queued_requests, count),
                   "unlimited": run(model, args.max_num_seqs, 1_000_000, count)}
    emit(results, args.out)


if __name__ == "__main__":
    main()
