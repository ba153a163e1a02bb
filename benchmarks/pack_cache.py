"""The packed-weights cache on the 0.5B shape: what a start that finds its packed weights in the cache
costs, and what checking every byte of them costs.

    python benchmarks/pack_cache.py [--baseline GIT_REV] [--rounds 3] [--dtype float32] [--out results.json]

Writes a checkpoint of Qwen2.5-0.5B's shape (random weights, nothing downloaded), compiles it, then
in fresh processes, one after another and alternating when `--baseline` is given: `LLM(dir,
require_artifact=True)` with the packed weights already in the cache (one load before the rounds
writes them), reporting start to ready, the seconds the packed weights took to arrive (mapped, or
read and checked), and batch-1 decode ms a token in the first seconds after ready (the median of
three 16-step runs, before `huge_pages` has had idle time to collapse the weights). `--baseline REV` runs the same against kiln at that git revision (a worktree, its own cache),
so the two are compared within one run on one machine. `checksum_gb_per_s` times XXH3-128 over 2 GB
in memory (one thread), the check a start runs.
"""

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit, machine  # noqa: E402  (benchmarks/ is the script's dir)
from loading import SHAPES, write_checkpoint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, logging, sys, time
start = time.perf_counter()
logging.basicConfig(level=logging.WARNING)
logging.getLogger("kiln").setLevel(logging.INFO)
from kiln import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype=sys.argv[3], require_artifact=True, cache_dir=sys.argv[2])
ready = time.perf_counter() - start
params = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
llm.generate([[1, 2, 3]], params(1))
decode = []
for _ in range(3):  # a decode step: 17 tokens less 1 token, over 16
    t = time.perf_counter()
    llm.generate([[1, 2, 3]], params(1))
    one = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([[1, 2, 3]], params(17))
    decode.append((time.perf_counter() - t - one) / 16)
print(json.dumps({"ready_s": ready, "decode_ms": [d * 1e3 for d in decode]}))
"""


def run_child(root: Path, model_dir: Path, cache: Path, dtype: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), str(cache), dtype], capture_output=True,
                          text=True, timeout=3600, cwd=root, env={**_env(), "PYTHONPATH": str(root)})
    if proc.returncode != 0:
        raise SystemExit(f"{root}: {proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    found = re.search(r"(?:mapped|read) \d+ packed weights \(([\d.]+) GB\) from \S+(?:, checksums verified,)? in "
                      r"([\d.]+)s", proc.stderr)
    return {"ready_s": got["ready_s"], "packed_s": float(found[2]) if found else None,
            "packed_gb": float(found[1]) if found else None, "decode_ms": statistics.median(got["decode_ms"])}


def _env() -> dict:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}


def checksum_speed() -> float:
    import torch

    from kiln import checksum

    data = torch.randint(0, 256, (2 << 30,), dtype=torch.uint8).numpy()
    checksum.digest(memoryview(data[: 1 << 20]))
    best = min(_timed(lambda: checksum.digest(memoryview(data))) for _ in range(5))
    return (2 << 30) / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a git revision of kiln to compare against, in the same run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--work", type=Path, help="keep the checkpoint and caches here (default: a temp dir)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-pack-bench-"))
    model_dir = work / "0.5b"
    if not (model_dir / "model.safetensors").is_file():
        write_checkpoint(model_dir, SHAPES["0.5b"])
    systems = {"kiln": ROOT}
    if args.baseline:
        tree = work / f"kiln-{args.baseline}"
        if not tree.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), args.baseline], check=True,
                           capture_output=True)
        systems = {f"kiln@{args.baseline}": tree, "kiln": ROOT}
    for name, root in systems.items():  # compile, and a first load that writes the packed weights
        subprocess.run([sys.executable, "-m", "kiln", "compile", str(model_dir), "--dtype", args.dtype, "--cache-dir",
                        str(work / f"cache-{root.name}"), "-q"], check=True, cwd=root,
                       env={**_env(), "PYTHONPATH": str(root)})
        run_child(root, model_dir, work / f"cache-{root.name}", args.dtype)
    rounds: dict[str, list[dict]] = {name: [] for name in systems}
    for _ in range(args.rounds):
        for name, root in systems.items():
            rounds[name].append(run_child(root, model_dir, work / f"cache-{root.name}", args.dtype))
    results = {"machine": machine(), "dtype": args.dtype, "shape": "0.5b", "rounds": args.rounds,
               "checksum_gb_per_s": round(checksum_speed(), 1)}
    for name, runs in rounds.items():
        results[name] = {key: round(statistics.median(r[key] for r in runs), 3) for key in runs[0]
                         if runs[0][key] is not None}
        results[name]["ready_s_all"] = [round(r["ready_s"], 2) for r in runs]
    emit(results, args.out)


if __name__ == "__main__":
    main()
