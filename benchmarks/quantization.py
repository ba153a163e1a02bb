"""Quantization: accuracy on the demo models and quantized vs fp32 decode speed on a 0.5B-shaped model.

    python benchmarks/quantization.py [--out results.json] [--skip-accuracy] [--skip-speed] [--compile]
                                      [--demo-dir DIR] [--variants int8,int4,...]

Accuracy (trained demo models, 8 prompts x 64 greedy tokens; W8A8 int8 and fp8, W7A8 int8 (7-bit
weight codes), W4A8 int4 (groups of up to 128), the int8 LM head alone and with int8 W8A8 or int4):
free-running agreement (same token at the same position; the first near-tie decides every later
position) on the corpus's 8 paragraph openings and on the tests' 8 prompts (some one-word: no single
right continuation), teacher-forced agreement on the latter (the quantized model's next token given
the full-precision prefix), the worst per-projection error (the LM head's error for the int8 head),
and the mean gap of the full-precision model's log-probability of its own greedy token under the
quantized model, teacher-forced.
Speed: a model of Qwen2.5-0.5B's shape with random weights (built here, ~2 GB in fp32), eager or
compiled, decode step time per batch size for fp32, int8, w7a8, fp8 and int4, one process, one run.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.oracle's prompts

from harness import decode_step_seconds, emit, machine  # noqa: E402  (benchmarks/ is the script's dir)
from kiln import LLM, SamplingParams  # noqa: E402
from kiln.models.lm_head import Int8Head  # noqa: E402
from kiln.models.quantization import SCHEMES, quantized_linear  # noqa: E402

QWEN25_05B = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)


VARIANTS = {"int8": {"quantization": "int8"}, "w7a8": {"quantization": "w7a8"},
            "fp8": {"quantization": "fp8"}, "lm_head_int8": {"lm_head_quantization": "int8"},
            "int8+lm_head_int8": {"quantization": "int8", "lm_head_quantization": "int8"},
            "w7a8+lm_head_w7a8": {"quantization": "w7a8", "lm_head_quantization": "w7a8"},
            "int4": {"quantization": "int4"},
            "int4+lm_head_int8": {"quantization": "int4", "lm_head_quantization": "int8"}}
"""What accuracy() compares with full precision: W8A8 (W7A8, W4A8) projections, the int8 LM head, and both."""


def accuracy(work: Path, demo_dir: Path | None = None, variants: list[str] | None = None) -> dict:
    from kiln.models.demo import DEMO_ARCHS, paragraph_openings, write_demo_model
    from tests.oracle import PROMPTS

    greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    results = {}
    for arch in DEMO_ARCHS:
        kept = demo_dir / arch if demo_dir is not None else None
        model_dir = kept if kept is not None and (kept / "config.json").is_file() else \
            write_demo_model(kept or work / arch, arch=arch)
        full = LLM(model_dir)
        inputs: dict[str, list[torch.Tensor]] = {}
        linears = [(n, m) for n, m in full.model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in n]
        hooks = [m.register_forward_hook(lambda mod, a, out, n=n: inputs.setdefault(n, []).append(a[0].clone()))
                 for n, m in linears]
        hidden: list[torch.Tensor] = []  # what the LM head reads
        runner = full.engine.runner
        logits_of = runner.compute_logits
        runner.compute_logits = lambda h: hidden.append(h.clone()) or logits_of(h)
        reference = full.generate(PROMPTS, greedy)
        runner.compute_logits = logits_of
        for h in hooks:
            h.remove()
        openings = paragraph_openings()
        opening_reference = full.generate(openings, greedy)
        for scheme, options in VARIANTS.items():
            if variants and scheme not in variants:
                continue
            quant = LLM(model_dir, **options)
            free = sum(sum(a == b for a, b in zip(q.token_ids, r.token_ids))
                       for q, r in zip(quant.generate(PROMPTS, greedy), reference))
            free_openings = sum(sum(a == b for a, b in zip(q.token_ids, r.token_ids))
                                for q, r in zip(quant.generate(openings, greedy), opening_reference))
            forced = 0
            for r in reference:
                outs = quant.generate([r.prompt_token_ids + r.token_ids[:i] for i in range(len(r.token_ids))], one)
                forced += sum(o.token_ids[0] == t for o, t in zip(outs, r.token_ids))
            total = sum(len(r.token_ids) for r in reference)
            gap = mean_logprob_gap(full, quant, reference)
            results[f"{arch}/{scheme}"] = {
                "free_running_agreement_openings": round(free_openings / (64 * len(openings)), 4),
                "free_running_agreement": round(free / total, 4),
                "teacher_forced_agreement": round(forced / total, 4),
                "mean_logprob_gap": round(gap, 4),
            }
            if "quantization" in options:
                worst = 0.0
                for name, linear in linears:
                    x = torch.cat(inputs[name])
                    ref = linear(x)
                    err = (quantized_linear(linear, options["quantization"])(x) - ref).norm() / ref.norm()
                    worst = max(worst, err.item())
                results[f"{arch}/{scheme}"]["worst_projection_rel_error"] = round(worst, 4)
            if "lm_head_quantization" in options:
                h = torch.cat(hidden)
                ref = h @ full.model.lm_head_weight().t()
                head = Int8Head(full.model.lm_head_weight(), SCHEMES[options["lm_head_quantization"]].weight_max)
                err = (head(h) - ref).norm() / ref.norm()
                results[f"{arch}/{scheme}"]["lm_head_rel_error"] = round(err.item(), 4)
            print(arch, scheme, results[f"{arch}/{scheme}"], flush=True)
    return results


def mean_logprob_gap(full: LLM, quant: LLM, reference: list) -> float:
    """The mean, over the full-precision model's greedy tokens, of its log-probability of each minus the
    quantized model's, both given the same (full-precision) prefix: >= 0 on average, 0 for no loss."""
    scored = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    gaps = []
    for r in reference:
        sequence = [r.prompt_token_ids + r.token_ids]
        want, got = (llm.generate(sequence, scored)[0].prompt_logprobs for llm in (full, quant))
        start = len(r.prompt_token_ids)
        gaps += [w - g for w, g in zip(want[start:], got[start:])]
    return sum(gaps) / len(gaps)


def write_05b_model(out: Path) -> Path:
    """Random weights in Qwen2.5-0.5B's shape (token ids only: no tokenizer is needed), the LM head tied
    to the embedding as in the real checkpoint: one tensor, stored once."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B)
    with torch.device("meta"):
        model = Qwen2ForCausalLM(config)
    model.to_empty(device="cpu")  # (unties: the LM head gets storage of its own)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(out)
    return out


def speed(work: Path, batches: list[int], steps: int, compile: bool) -> dict:
    model_dir = write_05b_model(work / "qwen2.5-0.5b-shape")
    results = {}
    for scheme in (None, *SCHEMES):
        name = scheme or "fp32"
        llm = LLM(model_dir, quantization=scheme, compile=compile, cache_dir=work / "cache")
        decode_step_seconds(llm, 1, 2)  # warm-up: first-call costs (oneDNN primitives, op registration)
        results[name] = {str(b): round(decode_step_seconds(llm, b, steps), 5) for b in batches}
        print(name, {b: f"{s * 1e3:.1f} ms" for b, s in results[name].items()}, flush=True)
        del llm
    results["speedup_vs_fp32"] = {
        s: {b: round(results["fp32"][b] / results[s][b], 3) for b in results["fp32"]} for s in SCHEMES
    }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON results here too")
    parser.add_argument("--skip-accuracy", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--demo-dir", type=Path, help="keep the trained demo models here (DIR/ARCH), reused when "
                        "present (default: trained anew in a temporary folder)")
    parser.add_argument("--variants", help=f"accuracy of these only, of {','.join(VARIANTS)} (default: all)")
    parser.add_argument("--compile", action="store_true", help="time the compiled artifact (compiles first)")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes (default 1,8)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per batch (default 16)")
    args = parser.parse_args()
    variants = [v for v in (args.variants or "").split(",") if v]
    if set(variants) - set(VARIANTS):
        parser.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    if args.skip_accuracy and (variants or args.demo_dir):
        parser.error("--variants and --demo-dir choose what the accuracy part runs: drop them with --skip-accuracy")

    results: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-quant-") as tmp:
        if not args.skip_accuracy:
            results["accuracy"] = accuracy(Path(tmp), args.demo_dir, variants)
        if not args.skip_speed:
            batches = [int(b) for b in args.batches.split(",")]
            results["decode_0.5b"] = speed(Path(tmp), batches, args.steps, args.compile)
            results["decode_0.5b"]["compiled"] = args.compile
    emit(results, args.out)


if __name__ == "__main__":
    main()
