"""The CUDA path's checks and timings in one run (issue 9's "on a GPU" list).

    python benchmarks/gpu_checks.py [--device cuda] [--dtype bfloat16] [--out results.json]
                                    [--only STEP,STEP] [--work DIR] [--skip-kernels]

Steps (each runs on its own: one that fails records its traceback and the rest still run; `--out`
is rewritten after every step, so a run cut short keeps what it measured):
- triton_cases: the Triton kernel cases (tests/kernels/triton_cases.py, fp8 included) on this device;
- fused_ops: each fused op vs its unfused sequence through `torch.ops.kiln` (the Triton kernels on
  CUDA), median microseconds at 1 and 64 tokens (benchmarks/fusions.py's pairs, on this device);
- agreement: on each demo architecture (random weights), compiled + piecewise CUDA graphs vs eager:
  greedy tokens and their logprobs (bf16 tolerance: same tokens up to the first near-tie, logprob gap
  reported);
- padding: three sequences decoding pad to the capture size 4; the same prompts with graphs off (no
  padding): tokens and logprobs of the first n rows;
- decode_batch1: one decode step at batch 1, eager, compiled without graphs, compiled with graphs
  (median ms, one run);
- serve_start: a fresh process with an empty Triton cache loads the llama artifact (graphs captured)
  and serves prompts of mixed lengths; counts Triton compiles (the artifact's kernels should cover
  every launch), Inductor compiles and Dynamo frames;
- quantized: int8 and fp8 (W8A8) llama, compiled + graphs vs eager;
- unfused: the llama compiled with the RoPE + KV-write fusion off (its KV write inside the graphs) vs eager;
- sampling: seeded temperature sampling through compiled + graphs twice gives the same tokens.

Run it with `CXX` naming a compiler that links libstdc++ as a shared library (the system's g++): one
that links it statically makes libraries torch crashes loading, which `kiln compile` refuses.
`--work DIR` keeps the demo models and artifacts between runs (steps after agreement reuse its
llama and artifact cache). On a CPU (`--device cpu`) the same steps run without graphs or Triton:
a smoke test of the script.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness import decode_step_seconds, emit, machine, median_seconds  # noqa: E402  (benchmarks/ is the script's dir)

from kiln import LLM, SamplingParams  # noqa: E402
from kiln.config import CompileConfig, PassConfig  # noqa: E402
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
        model_dir = _demo(work, arch)
        eager = LLM(model_dir, dtype=dtype, device=device).generate(PROMPTS, GREEDY)
        compiled = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache")
        out[arch] = _compare(compiled.generate(PROMPTS, GREEDY), eager)
        print(arch, out[arch], flush=True)
    return out


def _demo(work: Path, arch: str) -> Path:
    """The demo model of `arch` under `work`, written once (random weights)."""
    model_dir = work / arch
    return model_dir if (model_dir / "config.json").is_file() else write_demo_model(model_dir, arch=arch, train_steps=0)


def padding(work: Path, device: str, dtype: str) -> dict:
    model_dir = _demo(work, "llama")
    prompts = PROMPTS[:3]
    padded = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache",
                 cudagraph_sizes=(1, 2, 4, 8))
    plain = LLM(model_dir, dtype=dtype, device=device, compile=True, cache_dir=work / "cache", cudagraph_sizes=())
    result = _compare(padded.generate(prompts, GREEDY), plain.generate(prompts, GREEDY))
    print("padding", result, flush=True)
    return result


def decode_batch1(work: Path, device: str, dtype: str, steps: int) -> dict:
    model_dir = _demo(work, "llama")
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
import json, os, sys, time
import torch._dynamo.utils
from kiln import LLM, SamplingParams
from kiln.compiler import triton_cache
from kiln.compiler.counters import counters
start = time.perf_counter()
llm = LLM(sys.argv[1], dtype=sys.argv[2], device=sys.argv[3], compile=True, cache_dir=sys.argv[4],
          require_artifact=True)
ready = time.perf_counter() - start
llm.generate(json.loads(sys.argv[5]), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
print(json.dumps({"start_s": round(ready, 2), "kiln": dict(counters), "compiled": triton_cache.compiled_kernels,
                  "backend": sys.argv[3] != "cpu" and triton_cache.describe_backend(triton_cache.backend_key()),
                  "triton_env": {k: v for k, v in os.environ.items() if k.startswith("TRITON_")},
                  "dynamo_frames": sum(torch._dynamo.utils.counters["frames"].values()),
                  "inductor_imported": "torch._inductor.compile_fx" in sys.modules}))
"""


def serve_start(work: Path, device: str, dtype: str) -> dict:
    """Serve the llama artifact (compiled by the steps before) in a fresh process whose Triton cache
    is empty: only the artifact's kernels are there to find. Also lists the shared libraries Triton
    wrote there (its per-kernel launchers and driver utilities, built with the C compiler by Triton
    3.6 at first launch, which no compilation listener reports)."""
    from kiln.compiler import artifact, triton_cache

    prompts = [p * k for k, p in enumerate(PROMPTS, 1)]  # lengths from a few tokens to many: decodes and prefills
    with tempfile.TemporaryDirectory(prefix="kiln-triton-cache-") as serve_cache:
        # the environment this process started with: Inductor has set TRITON_PTXAS_PATH here since
        env = {**triton_cache.startup_environ(), "TRITON_CACHE_DIR": serve_cache}
        proc = subprocess.run([sys.executable, "-c", SERVE_START, str(_demo(work, "llama")), dtype, device,
                               str(work / "cache"), json.dumps(prompts)], capture_output=True, text=True, env=env,
                              cwd=ROOT)
        libraries = sorted(f.name for f in Path(serve_cache).rglob("*.so"))
        if proc.returncode != 0:
            print("serve start failed:", proc.stderr[-3000:], flush=True)
            return {"returncode": proc.returncode}
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        artifacts = [p for p in (work / "cache").iterdir() if (p / artifact.MANIFEST).is_file()]
        shipped = [artifact.read_manifest(p).get("triton_kernels", {}).get("files", {}) for p in artifacts]
        result["artifact_triton_files"] = sorted(len(f) for f in shipped)
        result["shipped_entries"] = sorted(f for files in shipped for f in files if f.endswith(".json"))
        result["shipped_env"] = [artifact.read_manifest(p).get("triton_kernels", {}).get("env") for p in artifacts]
        result["shipped_backend"] = [triton_cache.describe_backend(b) for p in artifacts
                                     if (b := artifact.read_manifest(p).get("triton_kernels", {}).get("backend"))]
        result["warnings"] = [line for line in proc.stderr.splitlines() if "Triton kernels were built" in line]
        for kernel in result["compiled"]:  # why a shipped kernel did not match: its metadata beside this build's
            kernel["metadata_differs"] = _metadata_differences(Path(serve_cache) / kernel["entry"], kernel["name"],
                                                               [p / artifact.TRITON_KERNELS for p in artifacts])
    result["triton_kernels_compiled"] = result["kiln"].get("triton_kernels_compiled", 0)
    result["triton_libraries_built"] = libraries
    print("serve start", result, flush=True)
    return result


def _metadata_differences(built: Path, name: str, shipped_dirs: list[Path]) -> dict:
    """Each metadata field in which the kernel `name` built at serve differs from a shipped one."""
    mine = json.loads((built / f"{name}.json").read_text()) if (built / f"{name}.json").is_file() else {}
    for directory in shipped_dirs:
        for other in directory.glob(f"*/{name}.json"):
            theirs = json.loads(other.read_text())
            return {k: [mine.get(k), theirs.get(k)] for k in sorted(set(mine) | set(theirs))
                    if mine.get(k) != theirs.get(k)}
    return {"shipped": None}


def quantized(work: Path, device: str, dtype: str) -> dict:
    """W8A8 on the GPU: int8 (cuBLAS's int8 GEMM) and fp8 (row-scaled _scaled_mm), compiled + graphs vs eager."""
    out = {}
    for scheme in ("int8", "fp8"):
        eager = LLM(_demo(work, "llama"), dtype=dtype, device=device, quantization=scheme).generate(PROMPTS, GREEDY)
        compiled = LLM(_demo(work, "llama"), dtype=dtype, device=device, quantization=scheme, compile=True,
                       cache_dir=work / "cache")
        out[scheme] = _compare(compiled.generate(PROMPTS, GREEDY), eager)
        out[scheme]["kernel_choices"] = _kernel_choices(compiled)
        print(scheme, out[scheme], flush=True)
    return out


def _kernel_choices(llm: LLM) -> list:
    manifest = json.loads((llm.artifact_path / "manifest.json").read_text())
    return [(c["op"], c["kernel"], c["tokens"], c["triton_ms"], c["inductor_ms"])
            for v in manifest["variants"] for c in v["kernel_choices"]]


def unfused(work: Path, device: str, dtype: str) -> dict:
    """The RoPE + KV-write fusion off: the plain KV-cache write runs inside the captured graphs."""
    config = CompileConfig(passes=PassConfig(rope_kvcache=False))
    eager = LLM(_demo(work, "llama"), dtype=dtype, device=device).generate(PROMPTS, GREEDY)
    compiled = LLM(_demo(work, "llama"), dtype=dtype, device=device, compile=True, cache_dir=work / "cache",
                   compile_config=config)
    result = _compare(compiled.generate(PROMPTS, GREEDY), eager)
    print("unfused", result, flush=True)
    return result


def sampling(work: Path, device: str, dtype: str) -> dict:
    """Seeded sampling on the GPU (its generators on the device): the same seeds, the same tokens."""
    llm = LLM(_demo(work, "llama"), dtype=dtype, device=device, compile=True, cache_dir=work / "cache")
    params = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    first, second = (llm.generate(PROMPTS, params) for _ in range(2))
    result = {"same_tokens": [a.token_ids == b.token_ids for a, b in zip(first, second)],
              "distinct_outputs": len({tuple(o.token_ids) for o in first})}
    print("sampling", result, flush=True)
    return result


STEPS = ("triton_cases", "fused_ops", "agreement", "padding", "decode_batch1", "serve_start", "quantized", "unfused",
         "sampling")


def _run_step(results: dict, name: str, fn, out: Path | None) -> None:
    """Run one step into `results[name]`; a failure is recorded with its traceback, not raised."""
    start = time.perf_counter()
    try:
        results[name] = fn()
    except Exception:
        results[name] = {"error": traceback.format_exc()[-6000:]}
        print(f"step {name} failed:\n{results[name]['error']}", flush=True)
    results.setdefault("step_seconds", {})[name] = round(time.perf_counter() - start, 1)
    if out:
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed at batch 1 (default 64)")
    parser.add_argument("--tokens", default="1,64", help="token counts for the fused-op timings")
    parser.add_argument("--skip-kernels", action="store_true", help="skip the Triton kernel cases")
    parser.add_argument("--only", help=f"comma-separated steps to run (default all: {','.join(STEPS)})")
    parser.add_argument("--work", type=Path, help="keep demo models and artifacts here (default: a temporary dir)")
    parser.add_argument("--out", type=Path, help="write the JSON results here too (after every step)")
    args = parser.parse_args()
    steps = args.only.split(",") if args.only else [s for s in STEPS if not (args.skip_kernels and s == "triton_cases")]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"unknown steps {unknown}: choose from {', '.join(STEPS)}")
    results: dict = {"machine": machine(), "device": args.device, "dtype": args.dtype}
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-cuda-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        d, t = args.device, args.dtype
        run = {
            "triton_cases": lambda: kernel_cases(d),
            "fused_ops": lambda: fused_ops(d, [int(n) for n in args.tokens.split(",")]),
            "agreement": lambda: agreement(work, d, t),
            "padding": lambda: padding(work, d, t),
            "decode_batch1": lambda: decode_batch1(work, d, t, args.steps),
            "serve_start": lambda: serve_start(work, d, t),
            "quantized": lambda: quantized(work, d, t),
            "unfused": lambda: unfused(work, d, t),
            "sampling": lambda: sampling(work, d, t),
        }
        for name in steps:
            _run_step(results, name, run[name], args.out)
    emit(results, args.out)


if __name__ == "__main__":
    main()
