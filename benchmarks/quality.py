"""What quantization costs, on a real model: kiln's schemes beside llama.cpp's on SmolLM2-135M-Instruct.

    python benchmarks/smollm2.py                  # once: fetch and convert the model (build/smollm2)
    python benchmarks/quality.py [--llama-cpp DIR] [--systems hf,kiln-fp32,...] [--text FILE] [--ctx 256]
                                 [--windows N] [--threads N] [--kv-cache-dtype int8] [--work DIR] [--out FILE.json]

Perplexity follows llama.cpp's `llama-perplexity` on both sides: the text is tokenized once and cut
into consecutive windows of `--ctx` tokens; each window is run from its start and scored on its second
half (the logprob of each token from the ctx/2 + 1-th on, given everything before it in the window),
and the perplexity is exp of the mean negative logprob over all windows. kiln's logprobs come from
`prompt_logprobs` (compiled artifacts, except kiln-eager); transformers' (`hf`, fp32, the numeric
oracle) from its logits; llama.cpp's from its own `llama-perplexity` on GGUF files of the same
checkpoint (F32 written here with the package's own tokenizer, Q8_0 / Q4_K_M / Q4_0 by its
`llama-quantize`), built by `benchmarks/build_llama_cpp.sh`. The text is Lewis Carroll's Alice's
Adventures in Wonderland, chapters I-III (public domain, `benchmarks/data/alice.txt`).

Greedy agreement: eight prompts, 64 new tokens each, against kiln-fp32's tokens (identical prompts,
and the mean number of tokens before the first difference); kiln-gguf's also against llama.cpp's text on
the same file (`llama-simple`, which stops at end-of-sequence: compared as far as it went). Systems: hf, kiln-eager, kiln-fp32,
kiln-int8 and kiln-int4 (with the int8 LM head, as `peers.py` runs them), kiln-w7a8, and with
`--llama-cpp` llama.cpp-f32, -q8_0, -q4_k_m, -q4_0. kiln-gguf and llama.cpp-gguf run a GGUF file itself
(`--gguf FILE`, by default the model's own file beside its directory): the same bytes on both sides,
kiln holding them as it does by default (a Q4_0/Q4_1 file's projections as int4 codes unchanged, with
the int8 LM head).

`--kv-cache-dtype int8` stores every system's KV cache in 8 bits: kiln's int8 cache (codes and a scale per
token and KV head) and llama.cpp's `-ctk q8_0 -ctv q8_0` in its perplexity (its default cache is f16; its
greedy text, from `llama-simple`, keeps that default). What the cache costs is the perplexity of a run with
it over one without, at a long `--ctx` (2048).
"""

import argparse
import json
import math
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import llama_cpp_peer as llama_cpp  # noqa: E402
from harness import hf_cache_argument  # noqa: E402
import smollm2  # noqa: E402
from peers import KILN_OPTIONS, LM_HEADS  # noqa: E402

TEXT = HERE / "data" / "alice.txt"
LLAMA_CPP = tuple(llama_cpp.QUANTS)
KILN = ("kiln-eager", "kiln-fp32", "kiln-int8", "kiln-w7a8", "kiln-int4", "kiln-q8_0", "kiln-gguf")
SYSTEMS = ("hf", *KILN, *LLAMA_CPP, "llama.cpp-gguf")
DEFAULT_SYSTEMS = ("hf", "kiln-fp32", "kiln-int8", "kiln-int4", *LLAMA_CPP)
PROMPTS = ("The capital of France is", "Water boils at a temperature of", "The three primary colors are",
           "def fibonacci(n):\n", "Once upon a time, in a small village,", "The largest planet in our solar system is",
           "To make a cup of tea, first", "In 1969, the first person to walk on the moon was")
GREEDY_TOKENS = 64
REFERENCE = {"hf": None, "kiln": "kiln-fp32", "llama.cpp": "llama.cpp-f32"}
"""What each family's quantized rows are compared with: its own full precision."""


# ---- the protocol ----

def windows(tokens: list[int], ctx: int, limit: int | None = None) -> list[list[int]]:
    """Consecutive windows of `ctx` tokens (a shorter tail dropped), at most `limit`: llama-perplexity's chunks."""
    count = len(tokens) // ctx if limit is None else min(len(tokens) // ctx, limit)
    return [tokens[i * ctx:(i + 1) * ctx] for i in range(count)]


def scored_logprobs(prompt_logprobs: list[float | None], ctx: int) -> list[float]:
    """The logprobs a window is scored on: its tokens from position ctx/2 + 1 on, each given all before it
    (`prompt_logprobs[i]` is token i's; the first is None)."""
    return [float(x) for x in prompt_logprobs[ctx // 2 + 1:ctx]]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


_FINAL = re.compile(r"Final estimate: PPL = ([\d.]+)")
_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks")


def parse_llama_perplexity(output: str) -> dict:
    """The final perplexity and the chunk count from `llama-perplexity`'s output."""
    final, chunks = _FINAL.search(output), _CHUNKS.search(output)
    if not final or not chunks:
        raise RuntimeError(f"llama-perplexity printed no final estimate:\n{output[-2000:]}")
    return {"perplexity": float(final[1]), "windows": int(chunks[1])}


# ---- the systems ----

def hf_run(model_dir: Path, chunks: list[list[int]], prompts: list[list[int]], ctx: int,
           new_tokens: int = GREEDY_TOKENS) -> dict:
    """transformers in fp32: each window's logits, and greedy tokens from `generate`."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    scored = []
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            picked = logp[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist()  # token i + 1 given 0..i
            scored += scored_logprobs([None, *picked], ctx)
        greedy = [_hf_greedy(model, p, new_tokens) for p in prompts]
    return {"logprobs": scored, "greedy": greedy}


def _hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens one forward at a time, end-of-sequence neither stopping nor masked (kiln's
    `ignore_eos`; `generate`'s `min_new_tokens` would mask it instead)."""
    import torch
    from transformers import DynamicCache

    cache = {hf_cache_argument(model): DynamicCache(config=model.config)}  # filled in place
    logits = model(torch.tensor([prompt]), use_cache=True, **cache).logits
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), use_cache=True, **cache).logits
    return tokens


def kiln_run(system: str, model_dir: Path, chunks: list[list[int]], prompts: list[list[int]], ctx: int,
             cache: Path, threads: int | None, new_tokens: int = GREEDY_TOKENS, kv_cache_dtype: str = "auto") -> dict:
    """kiln's `system`: each window's `prompt_logprobs`, and greedy tokens (windows a few at a time, so the
    logprob rows of one step stay small)."""
    from kiln import LLM, SamplingParams

    options: dict = {"threads": threads, "kv_cache_dtype": kv_cache_dtype}
    if system != "kiln-eager":
        options |= {"compile": True, "cache_dir": cache}
    if system in LM_HEADS:
        options["lm_head_quantization"] = LM_HEADS[system]
        if KILN_OPTIONS[system]:
            options["quantization"] = KILN_OPTIONS[system][1]
    start = time.perf_counter()
    llm = LLM(model_dir, **options)
    load_s = time.perf_counter() - start
    scored = []
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    for i in range(0, len(chunks), 4):
        for out in llm.generate(chunks[i:i + 4], params):
            scored += scored_logprobs(out.prompt_logprobs, ctx)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0,
                                                                        ignore_eos=True))]
    return {"logprobs": scored, "greedy": greedy, "load_s": round(load_s, 2),
            "artifact": str(llm.artifact_path) if llm.artifact_path else None}


def llama_cpp_run(system: str, files: dict[str, Path], llama_cpp_dir: Path, text: Path, ctx: int,
                  limit: int | None, threads: int, kv_cache_dtype: str = "auto") -> dict:
    cmd = [str(llama_cpp_dir / "bin" / "llama-perplexity"), "-m", str(files[system]), "-f", str(text), "-c", str(ctx),
           "-b", str(ctx), "-t", str(threads), "--poll", "0", *(["--chunks", str(limit)] if limit else []),
           *llama_cpp.kv_cache_flags(kv_cache_dtype)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{system}: llama-perplexity exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    run = parse_llama_perplexity(proc.stdout + proc.stderr)
    simple = llama_cpp_dir / "bin" / "llama-simple"
    if simple.is_file():  # an older build has none: rebuild with benchmarks/build_llama_cpp.sh
        run["greedy_text"] = [llama_greedy(simple, files[system], prompt) for prompt in PROMPTS]
    return run


def llama_greedy(simple: Path, file: Path, prompt: str) -> str:
    """llama.cpp's greedy continuation of `prompt` (`llama-simple` prints the prompt, then the new text)."""
    proc = subprocess.run([str(simple), "-m", str(file), "-n", str(GREEDY_TOKENS), prompt], capture_output=True,
                          text=True)
    if proc.returncode != 0 or not proc.stdout.startswith(prompt):
        raise RuntimeError(f"llama-simple exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return proc.stdout[len(prompt):]


# ---- the report ----

def agreement(greedy: list[list[int]], reference: list[list[int]]) -> dict:
    """Prompts whose greedy tokens equal the reference's, and the mean count of tokens before the first
    difference."""
    before = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), min(len(g), len(r)))
              for g, r in zip(greedy, reference)]
    return {"identical": sum(b == len(r) for b, r in zip(before, reference)), "prompts": len(reference),
            "mean_tokens_before_difference": round(sum(before) / len(before), 2)}


def text_agreement(greedy: list[list[int]], texts: list[str], tokenizer) -> dict:
    """As `agreement`, of kiln's tokens with another runtime's text: the tokens whose text, with all before
    them, starts that text (or holds all of it, where the other stopped at end-of-sequence)."""
    before = []
    for tokens, text in zip(greedy, texts):
        n = 0
        while n < len(tokens):
            mine = tokenizer.decode(tokens[:n + 1])
            if not (text.startswith(mine) or mine.startswith(text)):
                break
            n += 1
        before.append(n)
    return {"identical": sum(b == len(g) for b, g in zip(before, greedy)), "prompts": len(texts),
            "mean_tokens_before_difference": round(sum(before) / len(before), 2)}


def summarize(runs: dict[str, dict], tokenizer=None) -> dict:
    """Each system's perplexity and its change from its own family's full precision (kiln-fp32 for kiln,
    llama.cpp-f32 for llama.cpp), greedy agreement with kiln-fp32, and kiln-gguf's with llama.cpp-gguf."""
    table = {}
    for system, run in runs.items():
        if "error" in run:
            table[system] = {"error": run["error"][-300:]}
            continue
        ppl = run.get("perplexity") or perplexity(run["logprobs"])
        row = {"perplexity": round(ppl, 4), "windows": run.get("windows")}
        family = system.split("-")[0]
        ref = REFERENCE.get(family)
        if ref and ref != system and ref in runs and "error" not in runs[ref]:
            ref_ppl = runs[ref].get("perplexity") or perplexity(runs[ref]["logprobs"])
            row["vs_full_precision"] = round(ppl / ref_ppl - 1, 4)
        if "greedy" in run and "kiln-fp32" in runs and "greedy" in runs["kiln-fp32"] and system != "kiln-fp32":
            row["greedy_vs_kiln_fp32"] = agreement(run["greedy"], runs["kiln-fp32"]["greedy"])
        peer = runs.get("llama.cpp-gguf", {})
        if system == "kiln-gguf" and "greedy" in run and "greedy_text" in peer and tokenizer is not None:
            row["greedy_vs_llama_cpp"] = text_agreement(run["greedy"], peer["greedy_text"], tokenizer)
        table[system] = row
    return table


def print_table(table: dict, tokenizer, runs: dict) -> None:
    print(f"\n{'system':<18} {'perplexity':>10} {'vs its fp32':>12}  greedy vs kiln-fp32")
    for system, row in table.items():
        if "error" in row:
            print(f"{system:<18} failed: {row['error'][-200:]}")
            continue
        change = f"{row['vs_full_precision'] * 100:+.1f}%" if "vs_full_precision" in row else ""
        greedy = row.get("greedy_vs_kiln_fp32") or row.get("greedy_vs_llama_cpp")
        agree = f"{greedy['identical']}/{greedy['prompts']} identical, {greedy['mean_tokens_before_difference']} " \
                f"tokens before a difference" if greedy else ""
        if "greedy_vs_llama_cpp" in row:
            agree += " (vs llama.cpp-gguf)"
        print(f"{system:<18} {row['perplexity']:>10.3f} {change:>12}  {agree}")
    if tokenizer is not None:
        for system, run in runs.items():
            if run.get("greedy"):
                print(f"  {system}: {PROMPTS[0]!r} ->{tokenizer.decode(run['greedy'][0])!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="the Hugging Face directory (default: what benchmarks/smollm2.py "
                        "wrote, build/smollm2/hf)")
    parser.add_argument("--llama-cpp", type=Path, help="the folder benchmarks/build_llama_cpp.sh wrote (llama.cpp's "
                        "systems need it)")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    parser.add_argument("--text", type=Path, default=TEXT, help="the text scored (default benchmarks/data/alice.txt)")
    parser.add_argument("--ctx", type=int, default=256, help="window length in tokens (default 256, even)")
    parser.add_argument("--windows", type=int, help="score only the first N windows (default all)")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for every system (default 2)")
    parser.add_argument("--work", type=Path, help="artifacts and GGUF files (default: a temporary dir)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--gguf", type=Path, metavar="FILE", help="the GGUF file kiln-gguf and llama.cpp-gguf run "
                        "(default: the model's own, beside its directory)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "int8"), default="auto", help="int8: every system's KV "
                        "cache in 8 bits (kiln's int8, llama.cpp's q8_0); default auto: kiln's model dtype, llama.cpp's f16")
    args = parser.parse_args()
    systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    if any(s in LLAMA_CPP or s == "llama.cpp-gguf" for s in systems) and not args.llama_cpp:
        parser.error("llama.cpp's systems need --llama-cpp DIR (benchmarks/build_llama_cpp.sh builds it)")
    if args.ctx < 4 or args.ctx % 2:
        parser.error(f"--ctx must be an even number of at least 4, got {args.ctx}")
    model = args.model or smollm2.model_dir()
    if model is None:
        parser.error("no model: run `python benchmarks/smollm2.py` first (it fetches and converts SmolLM2-135M), "
                     "or give --model DIR")
    from kiln.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(model)
    tokens = tokenizer.encode(args.text.read_text())
    chunks = windows(tokens, args.ctx, args.windows)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    results: dict = {"model": str(model), "text": str(args.text), "tokens": len(tokens), "ctx": args.ctx,
                     "windows": len(chunks), "threads": args.threads, "kv_cache_dtype": args.kv_cache_dtype, "runs": {}}
    print(f"{len(tokens)} tokens, {len(chunks)} windows of {args.ctx}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-quality-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        files = {}
        llama_systems = [s for s in systems if s in LLAMA_CPP]
        if llama_systems:
            gguf = model.parent / smollm2.GGUF_NAME  # its tokenizer: llama.cpp tokenizes the text itself
            if not gguf.is_file():
                parser.error(f"llama.cpp's systems need the model's own GGUF beside {model} (its tokenizer): "
                             "use the directory benchmarks/smollm2.py wrote")
            files = llama_cpp.prepare(model, work, args.llama_cpp, llama_systems, tokenizer=gguf)
        if any(s.endswith("-gguf") for s in systems):
            files["llama.cpp-gguf"] = args.gguf or model.parent / smollm2.GGUF_NAME
            if not files["llama.cpp-gguf"].is_file():
                parser.error(f"no GGUF file {files['llama.cpp-gguf']}: give --gguf FILE")
        for system in systems:
            start = time.perf_counter()
            try:
                if system == "hf":
                    run = hf_run(model, chunks, prompts, args.ctx)
                elif system in KILN:
                    source = files["llama.cpp-gguf"] if system == "kiln-gguf" else model
                    run = kiln_run(system, source, chunks, prompts, args.ctx, work / "cache", args.threads,
                                   kv_cache_dtype=args.kv_cache_dtype)
                else:
                    run = llama_cpp_run(system, files, args.llama_cpp, args.text, args.ctx, args.windows, args.threads,
                                        args.kv_cache_dtype)
            except Exception as e:  # one system's failure is reported, the others still run
                run = {"error": f"{type(e).__name__}: {e}"}
            run["seconds"] = round(time.perf_counter() - start, 1)
            results["runs"][system] = run
            shown = run.get("perplexity") or (perplexity(run["logprobs"]) if "logprobs" in run else None)
            print(f"{system}: perplexity {shown} ({run['seconds']} s){'  ' + run['error'] if 'error' in run else ''}",
                  flush=True)
    results["summary"] = summarize(results["runs"], tokenizer)
    print_table(results["summary"], tokenizer, results["runs"])
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
