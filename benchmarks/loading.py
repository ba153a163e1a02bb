"""Loading real-size checkpoints: time and peak memory, kiln vs transformers, then compile and serve.

    python benchmarks/loading.py [--shapes 0.5b,1.5b] [--no-serve] [--work DIR] [--out results.json]

Writes bf16 checkpoints of Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (random weights, tied
embeddings; nothing is downloaded), then per shape, each in a fresh process one after another:
`kiln.LLM(dir)` (dtype auto: bf16, eager) and transformers' `AutoModelForCausalLM.from_pretrained(dir,
dtype="auto")`, reporting seconds to loaded and the peak resident memory the load added over the
process's memory before it (VmHWM - VmRSS before), as a multiple of the checkpoint's bytes, and the
process's peak once one token has been computed (transformers maps the file and reads its pages on
first use, so its load alone touches little). With
serving on (default), `kiln compile DIR` and then `kiln serve DIR --require-artifact` answering one
completion: compile seconds, start-to-ready seconds and the serving process's peak memory.
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

SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}
BASE = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": True, "hidden_act": "silu", "torch_dtype": "bfloat16"}

_CHILD = """
import json, sys, time
start = time.perf_counter()
def status(field):  # VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
system, model_dir = sys.argv[1], sys.argv[2]
if system == "kiln":
    from kiln import LLM
    before, t0 = status("VmRSS"), time.perf_counter()
    llm = LLM(model_dir)
    dtype = llm.dtype
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
                  "dtype": dtype, "peak_after_token": status("VmHWM")}))
"""


def write_checkpoint(out: Path, shape: dict) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.models.demo import EOS_TOKEN, train_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**BASE, **shape}))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out))
    gen = torch.Generator().manual_seed(0)
    tensors = {name: (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
               for name, p in hf.state_dict().items() if name != "lm_head.weight"}
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(), eos_token=EOS_TOKEN).save_pretrained(out)
    return out


def load_in_child(system: str, model_dir: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, system, str(model_dir)], capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1]}
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    size = (model_dir / "model.safetensors").stat().st_size
    added = got["peak"] - got["before"]
    return {"load_s": round(got["load_s"], 2), "dtype": got["dtype"], "peak_added_gb": round(added / 1e9, 3),
            "peak_added_x_checkpoint": round(added / size, 3), "process_peak_gb": round(got["peak"] / 1e9, 3),
            "process_peak_after_one_token_gb": round(got["peak_after_token"] / 1e9, 3)}


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
    parser.add_argument("--work", type=Path, help="where checkpoints and the artifact cache go (default: a "
                        "temporary directory)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    results: dict = {"machine": machine(), "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        for name in args.shapes.split(","):
            model_dir = work / f"qwen2.5-{name}-shape"
            if not (model_dir / "model.safetensors").is_file():
                write_checkpoint(model_dir, SHAPES[name])
            entry = {"checkpoint_gb": round((model_dir / "model.safetensors").stat().st_size / 1e9, 3),
                     "kiln": load_in_child("kiln", model_dir), "transformers": load_in_child("hf", model_dir)}
            if not args.no_serve:
                entry["serve"] = compile_and_serve(model_dir, work / "cache")
            results["shapes"][name] = entry
            print(json.dumps({name: entry}), file=sys.stderr, flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
