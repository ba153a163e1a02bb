"""Structured output's cost: decode step time with a JSON-schema constraint vs unconstrained sampling,
batch 16, on the demo model's compiled artifact (a fast model, so the grammar's share shows), and
the grammar libraries side by side on one vocabulary (why kiln uses llguidance).

    python benchmarks/structured_output.py [--out results.json] [--cache-dir DIR] [--steps 48] [--rounds 6]

Step time is the median over the decode steps in which all 16 requests run, temperature 1, seeded,
from one step's start to the next's.
The library comparison (llguidance vs xgrammar when installed) builds a byte-level BPE tokenizer of
32k tokens here and reports tokenizer set-up, schema compile and per-token mask times on one JSON
document.
"""

import argparse
import importlib.metadata
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit, machine  # noqa: E402  (benchmarks/ is the script's dir)
from kiln import LLM, SamplingParams  # noqa: E402
from kiln.models.demo import write_demo_model  # noqa: E402
from kiln.runtime.structured_output import StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "kind": {"enum": ["kiln", "oven", "furnace"]},
        "size": {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "number"}},
                 "required": ["w", "h"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}},
    },
    "required": ["name", "kind", "size", "tags"],
    "additionalProperties": False,
}
DOCUMENT = {"name": "big brick kiln number one", "kind": "furnace", "size": {"w": 12, "h": 3.5},
            "tags": ["clay", "fire", "glaze"]}


def step_times(llm: LLM, structured: StructuredOutput | None, batch: int, steps: int) -> list[float]:
    """Seconds from the start of each engine step in which all `batch` requests decode to the start of
    the next: work kiln moves off the step (masks computed on a thread) is counted where it lands."""
    engine, times = llm.engine, []
    for i in range(batch):
        engine.add_request(llm.tokenizer.encode("The kiln was"), SamplingParams(
            max_tokens=steps, temperature=1.0, seed=i, ignore_eos=True, structured_output=structured))
    last = None
    while engine.has_unfinished():
        full = len(engine.scheduler.running) == batch and all(s.num_computed for s in engine.scheduler.running)
        start = time.perf_counter()
        if last is not None:
            times.append(start - last)
        engine.step()
        last = start if full else None
    return times


def _vocab_tokenizer(vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rnd = random.Random(0)
    words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 10))) for _ in range(60000)]
    lines = [" ".join(rnd.choice(words) for _ in range(12)) + " " + json.dumps(DOCUMENT) for _ in range(40000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def compare_libraries(vocab: int) -> dict:
    """Set-up, compile and mask times of each grammar library installed, on one schema and document."""
    tok = _vocab_tokenizer(vocab)
    n, eos = tok.get_vocab_size(), tok.token_to_id("<eos>")
    ids = tok.encode(json.dumps(DOCUMENT)).ids + [eos]
    results = {}
    import llguidance
    import llguidance.torch as llg_torch

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok.to_str(), n_vocab=n, eos_token=eos)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    mask, masks = llg_torch.allocate_token_bitmask(1, n), []
    for token in ids:
        start = time.perf_counter()
        llg_torch.fill_next_token_bitmask(matcher, mask, 0)
        masks.append(time.perf_counter() - start)
        assert matcher.consume_token(token)
    results["llguidance"] = {"version": llguidance.__version__, "tokenizer_ms": round(setup * 1e3, 1),
                             "schema_compile_ms": round(compile_s * 1e3, 2),
                             "mask_median_us": round(statistics.median(masks) * 1e6, 1),
                             "mask_max_us": round(max(masks) * 1e6, 1)}
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        results["xgrammar"] = "not installed (pip install xgrammar to compare)"
        return {"vocab": n, "document_tokens": len(ids), **results}
    start = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>"),
                                              vocab_size=n, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info)
    setup = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    mask, masks = xgr.allocate_token_bitmask(1, n), []
    for token in ids:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        masks.append(time.perf_counter() - start)
        assert matcher.accept_token(token)
    results["xgrammar"] = {"version": importlib.metadata.version("xgrammar"), "tokenizer_ms": round(setup * 1e3, 1),
                           "schema_compile_ms": round(compile_s * 1e3, 2),
                           "mask_median_us": round(statistics.median(masks) * 1e6, 1),
                           "mask_max_us": round(max(masks) * 1e6, 1)}
    return {"vocab": n, "document_tokens": len(ids), **results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--cache-dir", help="artifact cache (default: a temporary one, compiled here)")
    parser.add_argument("--steps", type=int, default=48, help="tokens per request (default 48)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of each variant (default 6)")
    parser.add_argument("--vocab", type=int, default=32000, help="the library comparison's vocabulary size")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_demo_model(Path(tmp) / "demo")
        llm = LLM(model, compile=True, cache_dir=args.cache_dir or str(Path(tmp) / "cache"), max_num_seqs=args.batch)
        constraints = {"none": None, "json_schema": StructuredOutput.json_schema(SCHEMA),
                       "json_object": StructuredOutput.json_object()}
        step_times(llm, None, args.batch, 8)  # warm-up
        medians = {}
        for _ in range(args.rounds):  # interleaved, so drift on a shared machine hits every variant alike
            for name, constraint in constraints.items():
                medians.setdefault(name, []).extend(step_times(llm, constraint, args.batch, args.steps))
        step_ms = {name: round(statistics.median(t) * 1e3, 3) for name, t in medians.items()}
    results = {
        "machine": machine(),
        "batch": args.batch,
        "decode_step_ms": step_ms,
        "ratio_vs_unconstrained": {name: round(ms / step_ms["none"], 3) for name, ms in step_ms.items()},
        "libraries": compare_libraries(args.vocab),
    }
    emit(results, args.out)


if __name__ == "__main__":
    main()
