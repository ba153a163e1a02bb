"""Cold start: how long from a fresh process to the first generated token, compiled and eager.

For each model (the demo llama and a wider one) it measures, each in a fresh process:
  cold_compile_s   `kiln compile` with an empty artifact cache and an empty Inductor cache
  warm_compile_s   `kiln compile` again, the artifact present
  artifact_first_token_s  start of a process that loads the artifact, to its first token
  eager_first_token_s     the same without compiling (kiln's eager path)
and, for depth, a 16-layer model of the demo's width compiled cold: `depth_ratio` is its compile
time over the 4-layer one (goal <= 1.3), with both models' unique blob counts.

    python benchmarks/cold_start.py [--out results.json] [--quick]

Prints one JSON object. `--quick` measures the demo model only (for CI).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_TOKEN = """
import sys, time
from kiln import LLM, SamplingParams
llm = LLM(sys.argv[1], compile=sys.argv[2] == "artifact", cache_dir=sys.argv[3], require_artifact=True)
llm.generate(["The kiln was"], SamplingParams(max_tokens=1, temperature=0))
print(time.time())
"""


def _run(cmd: list[str], env: dict) -> tuple[float, str]:
    start = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"benchmark step failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return time.time() - start, proc.stdout


def _first_token(model_dir: Path, mode: str, cache: Path, env: dict) -> float:
    start = time.time()
    _, out = _run([sys.executable, "-c", FIRST_TOKEN, str(model_dir), mode, str(cache)], env)
    return float(out.strip().splitlines()[-1]) - start


def _compile(model_dir: Path, cache: Path, env: dict) -> float:
    seconds, _ = _run([sys.executable, "-m", "kiln", "compile", str(model_dir), "--cache-dir", str(cache), "-q"], env)
    return seconds


def _blobs(cache: Path) -> int:
    (artifact,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    return len(list((artifact / "blobs").iterdir()))


def _cold_env(work: Path, name: str) -> dict:
    """Empty Inductor cache and temp dir (Inductor keeps its precompiled header under TMPDIR)."""
    (work / f"{name}-tmp").mkdir()
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"{name}-inductor"), "TMPDIR": str(work / f"{name}-tmp")}


def measure(name: str, model_dir: Path, work: Path, repeats: int) -> dict:
    cache, env = work / f"{name}-cache", _cold_env(work, name)
    result = {"cold_compile_s": _compile(model_dir, cache, env), "warm_compile_s": _compile(model_dir, cache, env)}
    result["blobs"] = _blobs(cache)
    # best of `repeats`: the machine is shared and noisy, the floor is what the code costs
    result["artifact_first_token_s"] = min(_first_token(model_dir, "artifact", cache, env) for _ in range(repeats))
    result["eager_first_token_s"] = min(_first_token(model_dir, "eager", cache, env) for _ in range(repeats))
    result["artifact_over_eager"] = result["artifact_first_token_s"] / result["eager_first_token_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="demo model only, one repeat (CI)")
    parser.add_argument("--repeats", type=int, default=3, help="first-token runs per mode; the best counts")
    args = parser.parse_args()

    from kiln.models.demo import write_demo_model

    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        work = Path(tmp)
        models = {"demo": write_demo_model(work / "demo", num_layers=4, train_steps=0)}
        if not args.quick:
            models["wide"] = write_demo_model(work / "wide", num_layers=4, hidden_size=1024, train_steps=0)
        results: dict = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
        import torch

        results["machine"]["torch"] = torch.__version__
        results["models"] = {name: measure(name, d, work, repeats) for name, d in models.items()}
        if not args.quick:
            deep = write_demo_model(work / "deep", num_layers=16, train_steps=0)
            deep_s = _compile(deep, work / "deep-cache", _cold_env(work, "deep"))
            shallow = results["models"]["demo"]
            results["depth"] = {
                "layers_4_cold_compile_s": shallow["cold_compile_s"],
                "layers_16_cold_compile_s": deep_s,
                "depth_ratio": deep_s / shallow["cold_compile_s"],
                "layers_4_blobs": shallow["blobs"],
                "layers_16_blobs": _blobs(work / "deep-cache"),
            }
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
