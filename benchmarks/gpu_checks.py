"""The CUDA path's checks and timings in one run (issue 9's "on a GPU" list).

    python benchmarks/gpu_checks.py [--device cuda] [--dtype bfloat16] [--out results.json] [--skip-kernels]

1. agreement: on each demo architecture (random weights), compiled + piecewise CUDA graphs vs eager:
   greedy tokens and their logprobs for the test prompts (bf16 tolerance: same tokens up to the
   first near-tie, logprob gap reported);
2. padding: three sequences decoding pad to the capture size 4; the same prompts with graphs off
   (no padding): tokens and logprobs of the first n rows;
3. batch-1 decode step: eager, compiled without graphs, compiled with graphs (median ms, one run);
4. each fused op vs its unfused sequence through `torch.ops.kiln` (the Triton kernels on CUDA),
   median microseconds at 1 and 64 tokens (benchmarks/fusions.py's pairs, on this device);
5. the Triton kernel cases (tests/kernels/triton_cases.py, fp8 included) on this device;
6. a serve start compiles nothing: a fresh process with an empty Triton cache loads the llama
   artifact (graphs captured) and serves prompts of mixed lengths; counts Triton compiles (the
   artifact's kernels should cover every launch), Inductor compiles and Dynamo frames.

On a CPU (`--device cpu`) it runs the same steps without graphs or Triton: a smoke test of the script.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import decode_step_seconds, emit, machine, median_seconds  # noqa: E402  (benchmarks/ is the script's dir)

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.models.demo import DEMO_ARCHS, write_demo_model  # noqa: E402
from tests.oracle import PROMPTS  # noqa: E402

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)


def _compare(got, want) -> dict:
    """Tokens equal up to where they first differ, and the largest logprob gap before that."""
    same, gap = 0, 0.0
    for g, w in zip(got, want):
        n = next((i for i, (a, b) in enumerate(zip(g.token_ids, w.token_ids)) if a != b), len(w.token_ids))
        same += n == len(w.token_ids)
        if n:
            gap = max(gap, max(abs(a - b) for a, b in zip(g.logprobs[:n], w.logprobs[:n])))
    return {"prompts_identical": same, "prompts": len(want), "max_logprob_gap": round(gap, 5)}


def agreement(work: Path, device: str, dtype: str) -> dict:
    out = {}
    for arch in DEMO_ARCHS:
        model_dir = write_demo_model(work / arch, arch=arch, train_steps=0)
        eager = LLM(model_dir, dtype=dtype, device=device).generate(PROMPTS, GREEDY)
        compiled = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache")
        out[arch] = _compare(compiled.generate(PROMPTS, GREEDY), eager)
        print(arch, out[arch], flush=True)
    return out


def padding(work: Path, device: str, dtype: str) -> dict:
    model_dir = work / "llama"
    prompts = PROMPTS[:3]
    padded = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache",
                 cudagraph_sizes=(1, 2, 4, 8))
    plain = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache", cudagraph_sizes=())
    result = _compare(padded.generate(prompts, GREEDY), plain.generate(prompts, GREEDY))
    print("padding", result, flush=True)
    return result


def decode_batch1(work: Path, device: str, dtype: str, steps: int) -> dict:
    model_dir = work / "llama"
    llms = {"eager": LLM(model_dir, dtype=dtype, device=device),
            "compiled": LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache",
                            cudagraph_sizes=()),
            "compiled_graphs": LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache")}
    medians: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(3):  # alternate, so drift falls on all alike
        for name, llm in llms.items():
            medians[name].append(decode_step_seconds(llm, 1, steps, prompt_len=16, vocab=400))
    result = {f"{name}_ms": round(min(m) * 1e3, 4) for name, m in medians.items()}
    result["graphs_speedup_vs_eager"] = round(result["eager_ms"] / result["compiled_graphs_ms"], 3)
    result["graphs_speedup_vs_compiled"] = round(result["compiled_ms"] / result["compiled_graphs_ms"], 3)
    print("decode batch 1", result, flush=True)
    return result


def fused_ops(device: str, token_counts: list[int]) -> dict:
    from fusions import op_pairs  # noqa: E402

    sync = torch.cuda.synchronize if device.startswith("cuda") else None

    results = {}
    for tokens in token_counts:
        with torch.device(device):
            pairs = op_pairs(tokens)
        for name, (unfused, fused) in pairs.items():
            u, f = median_seconds(unfused, sync=sync) * 1e6, median_seconds(fused, sync=sync) * 1e6
            results[f"{name}@{tokens}"] = {"unfused_us": round(u, 1), "fused_us": round(f, 1), "speedup": round(u / f, 3)}
            print(f"{name:<40} tokens {tokens:<5} unfused {u:9.1f} us  fused {f:9.1f} us  {u / f:5.2f}x", flush=True)
    return results


def kernel_cases(device: str) -> dict:
    env = dict(os.environ) if device.startswith("cuda") else {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "kernels" / "triton_cases.py")], capture_output=True, text=True,
                          cwd=ROOT, env=env)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print("triton cases:", summary, flush=True)
    return {"returncode": proc.returncode, "summary": summary}


SERVE_START = """
import json, sys, time
import torch._dynamo.utils
from kiln import LLM, SamplingParams
from kiln.compiler.counters import counters
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], device=sys.argv[3], compile=True, cache_dir=sys.argv[4],
          require_artifact=True)
ready = time.perf_counter() - start
llm.generate(json.loads(sys.argv[5]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"start_s": round(ready, 2), "kiln": dict(counters),
                  "dynamo_frames": sum(torch._dynamo.utils.counters["frames"].values()),
                  "inductor_imported": "torch._inductor.compile_fx" in sys.modules}))
"""


def serve_start(work: Path, device: str, dtype: str) -> dict:
    """Serve the llama artifact (compiled by the steps before) in a fresh process whose Triton cache
    is empty: only the artifact's kernels are there to find."""
    import json

    from kiln.compiler import artifact

    prompts = [p * k for k, p in enumerate(PROMPTS, 1)]  # lengths from a few tokens to many: decodes and prefills
    with tempfile.TemporaryDirectory(prefix="kiln-triton-cache-") as triton_cache:
        env = {**os.environ, "TRITON_CACHE_DIR": triton_cache}
        proc = subprocess.run([sys.executable, "-c", SERVE_START, str(work / "llama"), dtype, device,
                               str(work / "cache"), json.dumps(prompts)], capture_output=True, text=True, env=env,
                              cwd=ROOT)
    if proc.returncode != 0:
        print("serve start failed:", proc.stderr[-3000:], flush=True)
        return {"returncode": proc.returncode}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    shipped = [artifact.read_manifest(p).get("triton_kernels", {}).get("files", {})
               for p in (work / "cache").iterdir() if (p / artifact.MANIFEST).is_file()]
    result["artifact_triton_files"] = sorted(len(f) for f in shipped)
    result["triton_kernels_compiled"] = result["kiln"].get("triton_kernels_compiled", 0)
    print("serve start", result, flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed at batch 1 (default 64)")
    parser.add_argument("--tokens", default="1,64", help="token counts for the fused-op timings")
    parser.add_argument("--skip-kernels", action="store_true", help="skip the Triton kernel cases")
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "device": args.device, "dtype": args.dtype}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-cuda-") as tmp:
        work = Path(tmp)
        results["agreement"] = agreement(work, args.device, args.dtype)
        results["padding"] = padding(work, args.device, args.dtype)
        results["decode_batch1"] = decode_batch1(work, args.device, args.dtype, args.steps)
        results["serve_start"] = serve_start(work, args.device, args.dtype)
    results["fused_ops"] = fused_ops(args.device, [int(t) for t in args.tokens.split(",")])
    if not args.skip_kernels:
        results["triton_cases"] = kernel_cases(args.device)
    emit(results, args.out)


if __name__ == "__main__":
    main()
