"""Loading real-size checkpoints: time and peak memory, kiln vs transformers, then compile and serve.

    python benchmarks/loading.py [--shapes 0.5b,1.5b] [--no-serve] [--work DIR] [--out results.json]
    python benchmarks/loading.py --shapes llama3-8b --quantization int8 --no-serve --no-transformers

Writes bf16 checkpoints of Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (random weights, tied
embeddings), or of Llama-3-8B's (untied, 16 GB), shard by shard so that writing never holds the
whole model; nothing is downloaded. Then per shape, each in a fresh process one after another:
`kiln.LLM(dir)` (dtype auto: bf16, eager) and transformers' `AutoModelForCausalLM.from_pretrained(dir,
dtype="auto")`, reporting seconds to loaded and the peak resident memory the load added over the
process's memory before it (VmHWM - VmRSS before), as a multiple of the checkpoint's bytes, and the
process's peak once one token has been computed (transformers maps the file and reads its pages on
first use, so its load alone touches little). With
serving on (default), `kiln compile DIR` and then `kiln serve DIR --require-artifact` answering one
completion: compile seconds, start-to-ready seconds and the serving process's peak memory.

With `--quantization int8` (or w7a8, fp8, int4) kiln quantizes each projection as it reads it; the report
then gives the bytes the model holds (`weights_gb`) and its KV cache (`kv_cache_gb`), and the load's
peak over their sum (`peak_added_x_weights_and_kv`): what an 8B-class checkpoint needs on a 24 GB machine.
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit, machine, process_memory, start_server  # noqa: E402  (benchmarks/ is the script's dir)
from kiln.config import QUANTIZATIONS  # noqa: E402

SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}
BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}
SHAPES["llama3-8b"] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
                       "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
                       "tie_word_embeddings": False, "hidden_size": 4096, "intermediate_size": 14336,
                       "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8}
SHARD_BYTES = 2 << 30
"""Largest checkpoint shard written (the writer holds one shard's tensors at a time)."""

_CHILD = """
import json, sys, time
start = time.perf_counter()
def status(field):  # VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
system, model_dir, quantization = sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None
extra = {}
if system == "kiln":
    from kiln import LLM
    before, t0 = status("VmRSS"), time.perf_counter()
    llm = LLM(model_dir, quantization=quantization)
    dtype = llm.dtype
    extra["weights"] = sum(p.numel() * p.element_size() for p in llm.model.parameters())
    extra["kv_cache"] = sum(t.numel() * t.element_size() for t in llm.engine.runner.kv_caches)
else:
    import torch
    from transformers import AutoModelForCausalLM
    before, t0 = status("VmRSS"), time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    dtype = str(model.dtype)
loaded = time.perf_counter() - t0
peak = status("VmHWM")
if system == "kiln":  # one token, so that every weight has been read (a mapped file's pages come in on use)
    from kiln import SamplingParams
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1))
else:
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
print(json.dumps({"load_s": loaded, "process_s": time.perf_counter() - start, "before": before, "peak": peak,
                  "dtype": dtype, "peak_after_token": status("VmHWM"), **extra}))
"""


def write_checkpoint(out: Path, shape: dict) -> Path:
    """Random bf16 weights in `shape`, written in shards of at most `SHARD_BYTES` with their index."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from kiln.models.demo import EOS_TOKEN, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    config = {**BASE, **shape}
    (out / "config.json").write_text(json.dumps(config))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    gen = torch.Generator().manual_seed(0)
    shards: list[dict] = [{}]
    for name, p in hf.state_dict().items():
        if name == "lm_head.weight" and config["tie_word_embeddings"]:
            continue
        if shards[-1] and sum(t.nbytes for t in shards[-1].values()) + p.numel() * 2 > SHARD_BYTES:
            _save_shard(shards, out, save_file)
        shards[-1][name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
    _save_shard(shards, out, save_file)
    names = [f"model-{i + 1:05d}-of-{len(shards) - 1:05d}.safetensors" for i in range(len(shards) - 1)]
    weight_map = {}
    for i, name in enumerate(names):
        (out / f"shard-{i}.safetensors").rename(out / name)
        weight_map.update({tensor: name for tensor in shards[i]})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), eos_token=EOS_TOKEN).save_pretrained(out)
    return out


def _save_shard(shards: list[dict], out: Path, save_file) -> None:
    """Write the last shard, keep only its tensor names (as keys), and start the next."""
    save_file(shards[-1], out / f"shard-{len(shards) - 1}.safetensors", metadata={"format": "pt"})
    shards[-1] = dict.fromkeys(shards[-1])
    shards.append({})


def checkpoint_size(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


def load_in_child(system: str, model_dir: Path, quantization: str | None = None) -> dict:
    args = [system, str(model_dir)] + ([quantization] if quantization else [])
    proc = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    size = checkpoint_size(model_dir)
    added = got["peak"] - got["before"]
    result = {"load_s": round(got["load_s"], 2), "dtype": got["dtype"], "peak_added_gb": round(added / 1e9, 3),
              "peak_added_x_checkpoint": round(added / size, 3), "process_peak_gb": round(got["peak"] / 1e9, 3),
              "process_peak_after_one_token_gb": round(got["peak_after_token"] / 1e9, 3)}
    if "weights" in got:
        result |= {"quantization": quantization, "weights_gb": round(got["weights"] / 1e9, 3),
                   "kv_cache_gb": round(got["kv_cache"] / 1e9, 3),
                   "peak_added_x_weights_and_kv": round(added / (got["weights"] + got["kv_cache"]), 3)}
    return result


def compile_and_serve(model_dir: Path, cache: Path) -> dict:
    """`kiln compile`, then `kiln serve --require-artifact` until one completion comes back."""
    import httpx

    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kiln", "compile", str(model_dir), "--cache-dir", str(cache), "-q"],
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        return {"error": "compile: " + proc.stderr.strip()[-500:]}
    compile_s = time.perf_counter() - start
    server, url, ready_s = start_server(model_dir, None, "--cache-dir", str(cache), "--require-artifact",
                                        "--served-model-name", "m")
    try:
        body = {"model": "m", "prompt": "The kiln was", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        start = time.perf_counter()
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()
        return {"compile_s": round(compile_s, 1), "serve_ready_s": round(ready_s, 2),
                "completion_16_tokens_s": round(time.perf_counter() - start, 2),
                "completion_tokens": out["usage"]["completion_tokens"],
                "serve_peak_gb": round(process_memory(server.pid) / 1e9, 3)}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.5b,1.5b", help="comma-separated, of " + ", ".join(SHAPES))
    parser.add_argument("--no-serve", action="store_true", help="skip compiling and serving")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' load")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="kiln quantizes while loading")
    parser.add_argument("--work", type=Path, help="where checkpoints and the artifact cache go (default: a "
                        "temporary directory)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in args.shapes.split(","):
            model_dir = work / f"{name}-shape"
            if not (model_dir / "model.safetensors.index.json").is_file():
                write_checkpoint(model_dir, SHAPES[name])
            entry = {"checkpoint_gb": round(checkpoint_size(model_dir) / 1e9, 3),
                     "kiln": load_in_child("kiln", model_dir, args.quantization)}
            if not args.no_transformers:
                entry["transformers"] = load_in_child("hf", model_dir)
            if not args.no_serve:
                entry["serve"] = compile_and_serve(model_dir, work / "cache")
            results["shapes"][name] = entry
            print(json.dumps({name: entry}), file=sys.stderr, flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
