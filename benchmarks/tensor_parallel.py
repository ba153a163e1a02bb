"""Decode step time at tensor parallel size 2 vs 1, eager and compiled, on the demo model.

    python benchmarks/tensor_parallel.py [--out results.json] [--batch 4] [--steps 32]

TP=1 runs in this process on all of its threads; TP=2 runs as two gloo ranks (this script again,
with torchrun's variables set), each on half the threads, so both use the same cores. On a CPU the
ranks share memory bandwidth and pay a gloo round trip per all_reduce: the figure is what it is.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import decode_step_seconds, emit, free_port, machine  # noqa: E402  (benchmarks/ is the script's dir)


def measure(model_dir: Path, cache: Path, tp: int, batch: int, steps: int) -> dict:
    """Median decode step (ms) of this process's rank, eager and from the compiled artifact."""
    from kiln import LLM

    results = {}
    for mode in ("eager", "compiled"):
        llm = LLM(model_dir, tensor_parallel_size=tp, compile=mode == "compiled", cache_dir=cache)
        decode_step_seconds(llm, batch, 4, prompt_len=16, vocab=400)  # warm-up
        results[f"{mode}_decode_step_ms"] = round(decode_step_seconds(llm, batch, steps, 16, 400) * 1e3, 3)
    return results


def two_ranks(model_dir: Path, cache: Path, batch: int, steps: int, threads: int) -> dict:
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(max(1, threads // 2))}
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank", str(model_dir), str(cache), str(batch),
                                       str(steps)], env=env, stdout=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=1800)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a TP=2 rank failed (exit statuses {[p.returncode for p in procs]})")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":  # one TP=2 rank, started by two_ranks()
        model_dir, cache, batch, steps = Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
        print(json.dumps(measure(model_dir, cache, 2, batch, steps)), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    parser.add_argument("--batch", type=int, default=4, help="sequences decoding together (default 4)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    args = parser.parse_args()
    from kiln.models.demo import write_demo_model

    results: dict = {"machine": machine(), "batch": args.batch}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-tp-") as tmp:
        model_dir = write_demo_model(Path(tmp) / "demo", train_steps=0)
        cache = Path(tmp) / "cache"
        results["tp1"] = measure(model_dir, cache, 1, args.batch, args.steps)
        results["tp2"] = two_ranks(model_dir, cache, args.batch, args.steps, torch.get_num_threads())
    for mode in ("eager", "compiled"):
        key = f"{mode}_decode_step_ms"
        results[f"{mode}_tp2_over_tp1"] = round(results["tp2"][key] / results["tp1"][key], 3)
    emit(results, args.out)


if __name__ == "__main__":
    main()
