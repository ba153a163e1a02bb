"""`kiln bench decode MODEL_DIR`: decode time per token at each batch size, and how close it comes to
the memory-bandwidth floor.

A decode step reads every weight once (the projections and the LM head; an embedding lookup reads only
the batch's rows; a mixture-of-experts layer at least its top-k experts), so no step can take less than
those bytes over the machine's read bandwidth. The bandwidth is measured here, on the same threads, over
512 MiB (far more than the CPU's caches), as the faster of two reads: the best of a few plain sums, and
the best of a few batch-1 calls of kiln's int8 panel GEMM (where it runs), which streams a weight as a
decode step does. Either alone can under-read a machine: on one Intel Xeon the sum read slower than the
GEMM streams, which put a step "above" its floor. `floor_fraction` is that floor over the measured step:
1.0 would be reading the weights as fast as this machine was seen to read and doing nothing else.

For each batch size B, B sequences of `--prompt-len` tokens are prefilled, then `--steps` decode steps
are timed one by one (their median is the round's): `ms_per_token` is a step's time, the latency each
sequence sees per token, and `tokens_per_s` is B tokens over it. A VM's bandwidth can swing by half
from one minute to the next, so each batch is timed right after a bandwidth reading of its own, in
`--rounds` rounds: a round's `floor_fraction` pairs the two, and the report gives the median of the
rounds' fractions (and of their times; every round is in `rounds`). Timing starts once the packed
weights are on huge pages, as a server's are after a moment idle (`kiln.weights.huge_pages`), and
`huge_page_gb` says how much is there.
"""

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kiln.argtypes import batch_sizes
from kiln.config import DTYPES, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

BANDWIDTH_BYTES = 512 << 20
HUGE_PAGES_WAIT_S = 60
"""How long timing waits for the packed weights to reach huge pages (seconds a GB on a 2-core VM)."""


def bandwidth_probe(repeats: int = 5) -> Callable[[], dict[str, float]]:
    """A probe of the read bandwidth: each call gives bytes per second read over 512 MiB, best of
    `repeats`: by a plain sum ("sum"), by kiln's int8 panel GEMM at batch 1 ("gemv", where it runs), and
    the faster ("best"). The tensor, allocated once, sits on huge pages where the packed weights go there
    too, so the floor does not count what they save."""
    import torch

    from kiln.kernels import panel_linear
    from kiln.weights import huge_pages

    def best_of(fn) -> float:
        fn()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        return BANDWIDTH_BYTES / best

    x = huge_pages.empty((BANDWIDTH_BYTES // 4,), torch.float32).fill_(1.0)
    huge_pages.collapse_later(x)
    huge_pages.collapse_pending()
    huge_pages.wait(HUGE_PAGES_WAIT_S)
    k = 4096
    gemv = None
    if panel_linear.available((BANDWIDTH_BYTES // k, k), torch.int8) is None:
        gemm = panel_linear.timing_kernel(panel_linear.INT8)
        weight, row = x.view(torch.int8).view(-1, k), torch.ones((1, k), dtype=torch.int8)
        gemv = lambda: gemm(row, weight)  # noqa: E731

    def probe() -> dict[str, float]:
        out = {"sum": best_of(x.sum)}
        if gemv is not None:
            out["gemv"] = best_of(gemv)
        out["best"] = max(out.values())
        return out

    return probe


def decode_weight_bytes(model, screened: bool = False) -> int:
    """The bytes of weights one decode step reads: every parameter but the embedding table (looked up
    by row), plus the LM head as it runs (int8 codes and scales for an int8 head, and for the copy a
    `GreedyScreen` reads for greedy tokens when `screened`). A mixture-of-experts layer counts the top-k
    experts a token reads, the fewest any step reads (a batch's tokens may all choose the same ones)."""
    from kiln.models.moe import SparseMoeBlock
    from kiln.weights.packing import RELEASED

    head = model.lm_head_weight()
    released = getattr(model, RELEASED, {})  # weights a compiled program reads packed only
    total = sum(shape.numel() * model.get_parameter(name).element_size() for name, shape in released.items())
    total += sum(p.numel() * p.element_size() for p in model.parameters() if p is not head
                 and p is not model.model.embed_tokens.weight)
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
            total -= experts - experts * block.top_k // block.experts.num
    kernel = model.lm_head_kernel
    if screened or kernel is not None and hasattr(kernel, "scale"):  # int8: one byte a weight, a scale a row
        return total + head.numel() + head.shape[0] * 4
    return total + head.numel() * head.element_size()


def decode_step_seconds(llm, batch: int, steps: int, prompt_len: int = 32, vocab: int = 1000) -> float:
    """Median wall time of one engine step with `batch` sequences decoding (the prefill step excluded)."""
    from kiln import SamplingParams

    prompts = [[(7 * b + i) % vocab + 1 for i in range(prompt_len)] for b in range(batch)]
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    engine, times, first = llm.engine, [], True
    for p in prompts:
        engine.add_request(p, params)
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        if not first:
            times.append(time.perf_counter() - start)
        first = False
    return statistics.median(times)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory")
    parser.add_argument("--batches", type=batch_sizes, default=[1, 16], metavar="B,B,...",
                        help="decode batch sizes (default 1,16)")
    parser.add_argument("--steps", type=int, default=32, metavar="N", help="decode steps timed per batch (default 32)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds, each timing every batch right "
                        "after a bandwidth reading; figures are the rounds' medians (default 3)")
    parser.add_argument("--prompt-len", type=int, default=32, metavar="N", help="prompt tokens per sequence "
                        "(default 32): the context decode attends to")
    parser.add_argument("--compile", action="store_true", help="time the compiled artifact (compiling it first if "
                        "absent)")
    parser.add_argument("--require-artifact", action="store_true", help="time the compiled artifact; fail if it is "
                        "absent")
    parser.add_argument("--cache-dir", metavar="DIR", help="artifact cache (default $KILN_CACHE, else ~/.cache/kiln)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="default auto: the checkpoint's")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="quantized projections: W8A8 (w7a8: 7-bit "
                        "weight codes), or int4 (W4A8)")
    parser.add_argument("--lm-head-quantization", choices=LM_HEAD_QUANTIZATIONS, help="an int8 LM head")
    parser.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: the physical cores)")
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON here too")


def run(args: argparse.Namespace) -> int:
    from kiln import LLM
    from kiln.weights import huge_pages

    for name in ("steps", "prompt_len", "rounds"):
        if getattr(args, name) < 1:
            raise KilnError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    llm = LLM(args.model_dir, dtype=args.dtype, compile=args.compile or args.require_artifact,
              require_artifact=args.require_artifact, cache_dir=args.cache_dir, quantization=args.quantization,
              lm_head_quantization=args.lm_head_quantization, threads=args.threads,
              max_num_seqs=max(args.batches))
    decode_step_seconds(llm, 1, 2, args.prompt_len)  # warm-up: first-call costs
    if not huge_pages.wait(HUGE_PAGES_WAIT_S):  # the steady state a server reaches once idle a moment
        logger.warning("packed weights not all on huge pages after %d s: measuring as they are", HUGE_PAGES_WAIT_S)
    huge_bytes = huge_pages.collapsed_bytes()
    probe = bandwidth_probe()
    screened = llm.engine.runner.greedy_tokens is not None  # greedy steps read int8 codes
    weights = decode_weight_bytes(llm.model, screened)
    rounds = []
    for _ in range(args.rounds):  # each batch timed right after a bandwidth reading: the pair shares a phase
        reads, times = {}, {}
        for batch in args.batches:
            reads[str(batch)] = probe()
            times[str(batch)] = decode_step_seconds(llm, batch, args.steps, args.prompt_len) * 1e3
        rounds.append({"read_bandwidth_gb_s": {b: round(r["best"] / 1e9, 2) for b, r in reads.items()},
                       "read_bandwidth_by": {b: {how: round(v / 1e9, 2) for how, v in r.items() if how != "best"}
                                             for b, r in reads.items()},
                       "ms_per_token": {b: round(ms, 3) for b, ms in times.items()},
                       "floor_fraction": {b: round(weights / reads[b]["best"] * 1e3 / ms, 3)
                                          for b, ms in times.items()}})
    bandwidth = statistics.median(gb for r in rounds for gb in r["read_bandwidth_gb_s"].values()) * 1e9
    floor_ms = weights / bandwidth * 1e3
    results = {}
    for batch in map(str, args.batches):
        ms = statistics.median(r["ms_per_token"][batch] for r in rounds)
        results[batch] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(int(batch) / ms * 1e3, 2),
                          "floor_fraction": round(statistics.median(r["floor_fraction"][batch] for r in rounds), 3)}
    report = {"model": str(args.model_dir), "dtype": llm.dtype, "compiled": llm.artifact_path is not None,
              "quantization": args.quantization, "lm_head_quantization": args.lm_head_quantization,
              "threads": llm.threads, "greedy_screen": screened, "weight_bytes_per_step": weights,
              "read_bandwidth_gb_s": round(bandwidth / 1e9, 2), "huge_page_gb": round(huge_bytes / 1e9, 3),
              "floor_ms_per_step": round(floor_ms, 3), "prompt_len": args.prompt_len, "batches": results,
              "rounds": rounds}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
