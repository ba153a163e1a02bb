"""Fused kiln ops vs their unfused sequences, and a compiled decode step with kiln's passes on vs off.

    python benchmarks/fusions.py [--out results.json] [--tokens 1,64] [--skip-e2e]

Op timings call each op through `torch.ops.kiln` (the dispatcher path a compiled piece takes for an
op it does not inline), median of many calls, at the hidden size of a 0.5B model. The end-to-end
part compiles the int8 demo model three times (all passes on; fusions off but lowering on; no passes
at all, so every kiln op stays an opaque call) and times decode steps of the same batch through each
artifact, alternating them three times in one process (best median each).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kiln.kernels  # noqa: E402,F401
from harness import decode_step_seconds, emit, machine, median_seconds  # noqa: E402  (benchmarks/ is the script's dir)

ops = torch.ops.kiln
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, HEAD_DIM = 896, 4864, 14, 2, 64


def op_pairs(tokens: int) -> dict[str, tuple]:
    """name -> (unfused callable, fused callable) on the same inputs."""
    x, res, w = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN), torch.randn(HIDDEN)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE)
    scale = torch.tensor([0.05])
    positions = torch.arange(tokens)
    q, k, v = torch.randn(tokens, HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(
        tokens, KV_HEADS, HEAD_DIM)
    cos_sin = torch.randn(4096, HEAD_DIM)
    cache = torch.zeros(2, (tokens + 15) // 16, 16, KV_HEADS, HEAD_DIM)
    slots = torch.arange(tokens)
    # attention: `tokens` decoding sequences of 128 cached tokens each
    ctx = 128
    kv = torch.randn(2, tokens * ctx // 16, 16, KV_HEADS, HEAD_DIM)
    starts = torch.arange(tokens + 1, dtype=torch.int32)
    seq_lens = torch.full((tokens,), ctx, dtype=torch.int32)
    tables = torch.arange(tokens * ctx // 16, dtype=torch.int32).reshape(tokens, ctx // 16)
    done = kv.new_empty(0)
    attn = (q, kv, done, starts, seq_lens, tables, HEAD_DIM ** -0.5, 0)
    return {
        "rms_norm+quant_int8": (lambda: ops.quant_int8(ops.rms_norm(x, w, 1e-6), None),
                                lambda: ops.rms_norm_quant(x, w, 1e-6, torch.int8, None)),
        "fused_add_rms_norm+quant_fp8_static": (
            lambda: ops.quant_fp8(ops.fused_add_rms_norm(x, res, w, 1e-6)[0], scale),
            lambda: ops.fused_add_rms_norm_quant(x, res, w, 1e-6, torch.float8_e4m3fn, scale)),
        "silu_and_mul+quant_int8": (lambda: ops.quant_int8(ops.silu_and_mul(gate_up), None),
                                    lambda: ops.silu_and_mul_quant(gate_up, torch.int8, None)),
        "rotary+kv_cache_write": (
            lambda: ops.kv_cache_write(ops.rotary_embedding(positions, q, k, cos_sin, True)[1], v, cache, slots),
            lambda: ops.rotary_embedding_kv_cache_write(positions, q, k, v, cos_sin, True, cache, slots)),
        "attention+quant_int8_static": (
            lambda: ops.quant_int8(ops.attention(*attn).view(tokens, -1), scale),
            lambda: ops.attention_quant(*attn, torch.int8, scale)),
    }


def ops_benchmark(token_counts: list[int]) -> dict:
    results = {}
    for tokens in token_counts:
        for name, (unfused, fused) in op_pairs(tokens).items():
            u, f = median_seconds(unfused), median_seconds(fused)
            results[f"{name}@{tokens}"] = {"unfused_us": round(u * 1e6, 1), "fused_us": round(f * 1e6, 1),
                                           "speedup": round(u / f, 3)}
            print(f"{name:<40} tokens {tokens:<5} unfused {u * 1e6:9.1f} us  fused {f * 1e6:9.1f} us  "
                  f"{u / f:5.2f}x", flush=True)
    return results


def e2e_benchmark(work: Path, batch: int, steps: int) -> dict:
    from kiln import LLM
    from kiln.config import CompileConfig, PassConfig
    from kiln.models.demo import write_demo_model

    model_dir = write_demo_model(work / "demo", train_steps=0)
    configs = {"passes_on": CompileConfig(),
               "fusions_off": CompileConfig(passes=PassConfig(rms_quant=False, act_quant=False, rope_kvcache=False,
                                                             attn_quant=False)),
               "no_passes": CompileConfig(passes=PassConfig(noop_elimination=False, rms_quant=False, act_quant=False,
                                                            rope_kvcache=False, attn_quant=False,
                                                            lowering=False))}
    llms = {name: LLM(model_dir, quantization="int8", compile=True, cache_dir=work / "cache", compile_config=config)
            for name, config in configs.items()}
    medians: dict[str, list[float]] = {name: [] for name in llms}
    for _ in range(3):  # alternate the configurations so warm-up and drift hit both alike
        for name, llm in llms.items():
            medians[name].append(decode_step_seconds(llm, batch, steps, prompt_len=16, vocab=400))
    results = {name: {"decode_step_ms": round(min(m) * 1e3, 3)} for name, m in medians.items()}
    print(results, flush=True)
    on = results["passes_on"]["decode_step_ms"]
    results["speedup_vs_fusions_off"] = round(results["fusions_off"]["decode_step_ms"] / on, 3)
    results["speedup_vs_no_passes"] = round(results["no_passes"]["decode_step_ms"] / on, 3)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    parser.add_argument("--tokens", default="1,64", help="token counts for the op timings (default 1,64)")
    parser.add_argument("--skip-e2e", action="store_true", help="op timings only (no compiles)")
    parser.add_argument("--batch", type=int, default=4, help="decode batch for the end-to-end part (default 4)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed (default 32)")
    args = parser.parse_args()
    results: dict = {"machine": machine()}
    results["ops"] = ops_benchmark([int(t) for t in args.tokens.split(",")])
    if not args.skip_e2e:
        with tempfile.TemporaryDirectory(prefix="kiln-bench-fusions-") as tmp:
            results["decode_int8_demo"] = e2e_benchmark(Path(tmp), args.batch, args.steps)
    emit(results, args.out)


if __name__ == "__main__":
    main()
