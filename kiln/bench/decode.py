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

For each depth D (`--depth`, the tokens already in a sequence's KV cache when its timed decode
begins: its prompt) and batch size B, B sequences of D prompt tokens are prefilled, then `--steps`
decode steps are timed one by one (their median is the round's; a step that also prefills is not
timed): `ms_per_token` is a step's time, the latency each sequence sees per token, and `tokens_per_s`
is B tokens over it. At depth a step also reads each sequence's KV cache, so the floor counts those
bytes too (`kv_bytes_per_token` times B sequences of D + (steps + 1) / 2 tokens, the timed steps'
mean). A VM's bandwidth can swing by half from one minute to the next, so each (depth, batch) is
timed right after a bandwidth reading of its own, in `--rounds` rounds: a round's `floor_fraction`
pairs the two, and the report gives the median of the rounds' fractions (and of their times; every
round is in `rounds`). Timing starts once the packed weights are on huge pages, as a server's are
after a moment idle (`kiln.weights.huge_pages`), and `huge_page_gb` says how much is there.
"""

import argparse
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from kiln.argtypes import batch_sizes, depths
from kiln.config import DTYPES, KV_CACHE_DTYPES, LM_HEAD_QUANTIZATIONS, QUANTIZATIONS
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


def kv_bytes_per_token(llm) -> int:
    """The KV-cache bytes one token holds over all layers (on this rank): what attending to it reads."""
    return sum(cache[:, 0, 0].numel() * cache.element_size() for cache in llm.engine.runner.kv_caches)


def decode_step_seconds(llm, batch: int, steps: int, prompt_len: int = 32, vocab: int = 1000) -> float:
    """Median wall time of one engine step with `batch` sequences decoding and nothing else, over `steps`
    such steps. Timing begins once every prompt is in the KV cache: a long prompt prefills in chunks, and
    a sequence whose prefill ended first decodes beside the others' chunks meanwhile."""
    from kiln import SamplingParams

    engine = llm.engine
    prompts = [[(7 * b + i) % vocab + 1 for i in range(prompt_len)] for b in range(batch)]
    params = SamplingParams(max_tokens=engine.max_model_len - prompt_len, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    waiting = set(ids)  # no token yet
    times: list[float] = []
    try:
        while len(times) < steps and engine.has_unfinished():
            decoding = not waiting
            start = time.perf_counter()
            outputs = engine.step()
            if decoding and engine.step_tokens == batch:
                times.append(time.perf_counter() - start)
            waiting -= {o.request_id for o in outputs}
    finally:
        for request_id in ids:  # they could go on to max_model_len
            engine.abort(request_id)
    if len(times) < steps:
        raise KilnError(f"{batch} sequences of {prompt_len} tokens decoded together {len(times)} steps, not {steps}: "
                        "the KV cache holds fewer of them at once (--kv-cache-memory, --max-num-seqs)")
    return statistics.median(times)


def prefill_seconds(llm, prompt_len: int, salt: int = 0, vocab: int = 1000) -> float:
    """Wall time from a prompt of `prompt_len` tokens to its first new token, prefilled in the engine's chunks
    (`max_num_batched_tokens`). Its tokens depend on `salt`: prompts of other salts, and `decode_step_seconds`'s,
    share no prefix-cached block with it."""
    from kiln import SamplingParams

    prompt = [(13 * i + 17 * salt + 5) % vocab + 1 for i in range(prompt_len)]
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    return time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory")
    parser.add_argument("--batches", type=batch_sizes, default=[1, 16], metavar="B,B,...",
                        help="decode batch sizes (default 1,16)")
    parser.add_argument("--steps", type=int, default=32, metavar="N", help="decode steps timed per batch (default 32)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds, each timing every batch right "
                        "after a bandwidth reading; figures are the rounds' medians (default 3)")
    parser.add_argument("--depth", type=depths, default=[32], metavar="D,D,...", help="tokens already in each "
                        "sequence's KV cache when timing begins (its prompt), e.g. 32,2048,8192 (default 32)")
    parser.add_argument("--compile", action="store_true", help="time the compiled artifact (compiling it first if "
                        "absent)")
    parser.add_argument("--require-artifact", action="store_true", help="time the compiled artifact; fail if it is "
                        "absent")
    parser.add_argument("--cache-dir", metavar="DIR", help="artifact cache (default $KILN_CACHE, else ~/.cache/kiln)")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="default auto: the checkpoint's")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="quantized projections: W8A8 (w7a8: 7-bit "
                        "weight codes), or int4 (W4A8)")
    parser.add_argument("--lm-head-quantization", choices=LM_HEAD_QUANTIZATIONS, help="an int8 LM head")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto", help="the KV cache's dtype "
                        "(int8: codes and a scale per token and KV head)")
    parser.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: the physical cores)")
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="write the JSON here too")


def run(args: argparse.Namespace) -> int:
    from kiln import LLM
    from kiln.weights import huge_pages

    for name in ("steps", "rounds"):
        if getattr(args, name) < 1:
            raise KilnError(f"--{name} must be at least 1, got {getattr(args, name)}")
    llm = LLM(args.model_dir, dtype=args.dtype, compile=args.compile or args.require_artifact,
              require_artifact=args.require_artifact, cache_dir=args.cache_dir, quantization=args.quantization,
              lm_head_quantization=args.lm_head_quantization, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
              max_num_seqs=max(args.batches))
    engine = llm.engine
    holds = engine.scheduler.allocator.num_blocks * engine.config.block_size
    # a sequence's tokens at its last step: its prompt, the timed steps, and those it decoded while the
    # batch's other prompts still prefilled, at most a step per chunk of theirs
    chunks = -(-max(args.batches) * max(args.depth) // engine.config.max_num_batched_tokens)
    longest = max(args.depth) + args.steps + 1 + chunks
    if longest > engine.max_model_len or max(args.batches) * longest > holds:
        raise KilnError(f"--depth {max(args.depth)} and --steps {args.steps} make sequences of {longest} tokens: "
                        f"this model takes {engine.max_model_len} a sequence and its KV cache {holds} in all, "
                        f"for {max(args.batches)} sequences at once; lower --depth, --steps or --batches")
    decode_step_seconds(llm, 1, 2, min(args.depth))  # warm-up: first-call costs
    if not huge_pages.wait(HUGE_PAGES_WAIT_S):  # the steady state a server reaches once idle a moment
        logger.warning("packed weights not all on huge pages after %d s: measuring as they are", HUGE_PAGES_WAIT_S)
    huge_bytes = huge_pages.collapsed_bytes()
    probe = bandwidth_probe()
    screened = llm.engine.runner.greedy_tokens is not None  # greedy steps read int8 codes
    weights, kv_token = decode_weight_bytes(llm.model, screened), kv_bytes_per_token(llm)

    def step_bytes(depth: str, batch: str) -> int:
        return weights + round(int(batch) * kv_token * (int(depth) + (args.steps + 1) / 2))

    depth_keys, batch_keys = [str(d) for d in args.depth], [str(b) for b in args.batches]
    rounds = []
    for _ in range(args.rounds):  # each pair timed right after a bandwidth reading: the two share a phase
        reading = {key: {d: {} for d in depth_keys} for key in ("read_bandwidth_gb_s", "read_bandwidth_by",
                                                                "ms_per_token", "floor_fraction")}
        for d in depth_keys:
            for b in batch_keys:
                read = probe()
                ms = decode_step_seconds(llm, int(b), args.steps, int(d)) * 1e3
                reading["read_bandwidth_gb_s"][d][b] = round(read["best"] / 1e9, 2)
                reading["read_bandwidth_by"][d][b] = {how: round(v / 1e9, 2) for how, v in read.items() if how != "best"}
                reading["ms_per_token"][d][b] = round(ms, 3)
                reading["floor_fraction"][d][b] = round(step_bytes(d, b) / read["best"] * 1e3 / ms, 3)
        rounds.append(reading)
    bandwidth = statistics.median(gb for r in rounds for row in r["read_bandwidth_gb_s"].values()
                                  for gb in row.values()) * 1e9
    results: dict[str, dict] = {d: {} for d in depth_keys}
    for d in depth_keys:
        for b in batch_keys:
            ms = statistics.median(r["ms_per_token"][d][b] for r in rounds)
            results[d][b] = {"ms_per_token": round(ms, 3), "tokens_per_s": round(int(b) / ms * 1e3, 2),
                             "bytes_per_step": step_bytes(d, b),
                             "floor_fraction": round(statistics.median(r["floor_fraction"][d][b] for r in rounds), 3)}
    report = {"model": str(args.model_dir), "dtype": llm.dtype, "compiled": llm.artifact_path is not None,
              "quantization": args.quantization, "lm_head_quantization": args.lm_head_quantization,
              "kv_cache_dtype": args.kv_cache_dtype, "threads": llm.threads, "greedy_screen": screened, "weight_bytes_per_step": weights,
              "kv_bytes_per_token": kv_token, "read_bandwidth_gb_s": round(bandwidth / 1e9, 2),
              "huge_page_gb": round(huge_bytes / 1e9, 3), "floor_ms_per_step": round(weights / bandwidth * 1e3, 3),
              "steps": args.steps, "depths": results, "rounds": rounds}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0
