"""llama.cpp as a peer for `peers.py`: the same checkpoint as GGUF (F32, and Q8_0 / Q4_K_M made by its
own `llama-quantize`), timed by its own `llama-batched-bench`.

The tools come from `benchmarks/build_llama_cpp.sh`, which builds them from llama-cpp-python's
source distribution; the GGUF is written here with the `gguf` package that source vendors, straight
from the safetensors (its `convert_hf_to_gguf.py` refuses a tokenizer it does not know). The token
list is placeholders: the benchmark feeds token ids, never text. ggml's threads spin while they wait
unless `--poll 0`, and on these VMs a memory-mapped model read erratically: `-lm none` loads it into
memory, as kiln does.
"""

import re
import subprocess
import sys
from pathlib import Path

QUANTS = {"llama.cpp-f32": None, "llama.cpp-q8_0": "Q8_0", "llama.cpp-q4_k_m": "Q4_K_M", "llama.cpp-q4_0": "Q4_0"}
"""The llama.cpp systems and the `llama-quantize` type each runs (None: the F32 file)."""

_BLOCK = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def gguf_name(name: str) -> str:
    """A Hugging Face Qwen2/Llama tensor name as llama.cpp names it."""
    if name in _TOP:
        return _TOP[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


ARCHS = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
"""The checkpoints written as GGUF here, and llama.cpp's name for each."""


def write_gguf(model_dir: Path, out: Path, llama_cpp: Path, quant: str | None = None,
               tokenizer: Path | None = None) -> Path:
    """The checkpoint in `model_dir` (a Qwen2 or Llama config.json and safetensors) as a GGUF at `out`:
    F32, or with `quant="Q8_0"` its matrices quantized by gguf-py as they are written (an 8B model's
    F32 or BF16 file would not fit beside its checkpoint on a 64 GB disk). Tensors are streamed one at
    a time: the writer never holds the model. A Llama-3 rope scaling is left out (speed only). The token
    list is placeholders, or `tokenizer`'s: a GGUF whose tokenizer fields are copied (a real model's text
    tokenized by llama.cpp itself, as `llama-perplexity` does). A Llama's query and key rows are permuted
    to the interleaved rotary pairs llama.cpp's llama architecture rotates."""
    sys.path.insert(0, str(llama_cpp / "src" / "vendor" / "llama.cpp" / "gguf-py"))
    import gguf
    import numpy as np
    from safetensors import safe_open

    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_model_dir(model_dir)  # reads both transformers' config layouts (rope_parameters)
    if cfg.architecture not in ARCHS:
        raise SystemExit(f"llama.cpp peer: only {', '.join(ARCHS)} checkpoints are written as GGUF here, "
                         f"not {cfg.architecture}")
    qtype = getattr(gguf.GGMLQuantizationType, quant) if quant else None
    writer = gguf.GGUFWriter(str(out), arch=ARCHS[cfg.architecture])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quant == "Q8_0" else gguf.LlamaFileType.ALL_F32)
    if tokenizer is None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list([f"<{i}>" for i in range(cfg.vocab_size)])
        writer.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
        writer.add_token_merges(["< 0"])
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
    else:
        _copy_tokenizer(gguf, tokenizer, writer)
    files = sorted(model_dir.glob("*.safetensors"))
    names = [(path, name) for path in files for name in safe_open(path, "pt").keys()]

    def quantized(shape) -> bool:
        return qtype is not None and len(shape) == 2

    for path, name in names:  # the tensor table first, then each tensor's bytes in the same order
        with safe_open(path, "pt") as f:
            shape = f.get_slice(name).get_shape()
        if quantized(shape):
            byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype)
            writer.add_tensor_info(gguf_name(name), byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), qtype)
        else:
            writer.add_tensor_info(gguf_name(name), shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for path, name in names:
        with safe_open(path, "pt") as f:
            data = f.get_tensor(name).float().numpy()
        if cfg.architecture == "LlamaForCausalLM" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = _interleave_rotary(data, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        writer.write_tensor_data(gguf.quants.quantize(data, qtype) if quantized(data.shape) else data)
    writer.close()
    return out


def _interleave_rotary(weight, heads: int):
    """A query or key projection's rows, each head's halves (the rotary pairs Hugging Face's Llama rotates:
    i and i + D/2) interleaved (2i, 2i + 1), as llama.cpp's llama architecture rotates them."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _copy_tokenizer(gguf, source: Path, writer) -> None:
    """Every `tokenizer.ggml.*` field of the GGUF `source` into `writer`, as it is."""
    reader = gguf.GGUFReader(str(source))
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            writer.add_key_value(key, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)


def prepare(model_dir: Path, work: Path, llama_cpp: Path, systems: list[str],
            source: str | None = None, tokenizer: Path | None = None) -> dict[str, Path]:
    """Each llama.cpp system's GGUF file, written once: the F32 file (`source` None), or the file of type
    `source` ("Q8_0", for a model whose F32 file would not fit on the disk), then each other type made
    from it by `llama-quantize` (from a Q8_0 source, requantized: its speed is what counts here)."""
    base = work / f"model-{(source or 'f32').lower()}.gguf"
    if not base.is_file():
        write_gguf(model_dir, base, llama_cpp, source, tokenizer)
    files = {}
    for system in systems:
        kind = QUANTS[system]
        if source is not None and kind is None:
            raise SystemExit(f"{system}: this model's GGUF is written as {source}, not F32")
        files[system] = work / f"model-{(kind or 'f32').lower()}.gguf"
        if not files[system].is_file():
            requantize = ["--allow-requantize"] if source is not None else []
            quantize = [str(llama_cpp / "bin" / "llama-quantize"), *requantize, str(base), str(files[system]), kind]
            subprocess.run(quantize, check=True, capture_output=True)
    return files


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|\s*([\d.]+)\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|"
                  r"\s*([\d.]+)\s*\|")


def kv_cache_flags(kv_cache_dtype: str) -> list[str]:
    """llama.cpp's KV-cache options for kiln's `--kv-cache-dtype`: int8 is its q8_0 for K and V (a scale per 32);
    auto keeps its default, f16."""
    return ["-ctk", "q8_0", "-ctv", "q8_0"] if kv_cache_dtype == "int8" else []


def measure(llama_cpp: Path, model: Path, threads: int, prompts: int, prompt_len: int, new_tokens: int,
            kv_cache_dtype: str = "auto") -> dict:
    """peers.py's figures from one `llama-batched-bench` run at batch 1 and `prompts`."""
    cmd = [str(llama_cpp / "bin" / "llama-batched-bench"), "-m", str(model), "-npp", str(prompt_len), "-ntg",
           str(new_tokens), "-npl", f"1,{prompts}", "-t", str(threads), "--poll", "0", "-lm", "none",
           "-c", str(prompts * (prompt_len + new_tokens)), *kv_cache_flags(kv_cache_dtype)]
    return figures(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout, prompts, new_tokens)


def figures(table: str, prompts: int, new_tokens: int) -> dict:
    """From llama-batched-bench's table: the prefill of all `prompts` (T_PP), decode tokens per second
    with them all (S_TG), and ms per token at batch 1 (T_TG over the tokens)."""
    rows = {int(m[3]): m for m in (_ROW.match(line) for line in table.splitlines()) if m}
    if set(rows) != {1, prompts}:
        raise RuntimeError(f"llama-batched-bench printed no rows for batches 1 and {prompts}:\n{table[-2000:]}")
    one, many = rows[1], rows[prompts]
    return {"prefill_s": float(many[4]), "batch16_tok_s": float(many[6]),
            "batch1_ms_per_token": float(one[5]) / new_tokens * 1e3}


def measure_depths(llama_cpp: Path, model: Path, threads: int, depths: list[int], new_tokens: int,
                   kv_cache_dtype: str = "auto") -> dict:
    """peers.py's `--depth` figures from one `llama-bench` run: batch-1 ms per token of `new_tokens`
    generated after `-d D` tokens of context, at each depth D."""
    import json

    cmd = [str(llama_cpp / "bin" / "llama-bench"), "-m", str(model), "-p", "0", "-n", str(new_tokens),
           "-d", ",".join(map(str, depths)), "-r", "1", "-t", str(threads), "--poll", "0", "-lm", "none", "-o", "json",
           *kv_cache_flags(kv_cache_dtype)]
    runs = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return depth_figures(runs, depths, new_tokens)


def measure_prefills(llama_cpp: Path, model: Path, threads: int, lengths: list[int],
                     kv_cache_dtype: str = "auto") -> dict:
    """peers.py's `--depth` prefill figures from one `llama-bench -p N,... -n 0` run: seconds to process a
    prompt of N tokens (in llama.cpp's batches of 2048), at each N."""
    import json

    cmd = [str(llama_cpp / "bin" / "llama-bench"), "-m", str(model), "-p", ",".join(map(str, lengths)), "-n", "0",
           "-r", "1", "-t", str(threads), "--poll", "0", "-lm", "none", "-o", "json", *kv_cache_flags(kv_cache_dtype)]
    return prefill_figures(json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout), lengths)


def prefill_figures(runs: list[dict], lengths: list[int]) -> dict:
    """From llama-bench's JSON records: seconds to prefill each prompt length (its tokens over tokens per second)."""
    found = {int(r["n_prompt"]): int(r["n_prompt"]) / float(r["avg_ts"]) for r in runs
             if int(r["n_gen"]) == 0 and int(r.get("n_depth", 0)) == 0}
    if set(found) != set(lengths):
        raise RuntimeError(f"llama-bench reported prompts of {sorted(found)}, asked for {lengths}: {runs}")
    return {prefill_key(n): round(found[n], 4) for n in lengths}


def prefill_key(tokens: int) -> str:
    """The figure of a prompt of `tokens` prefilled, in seconds, as peers.py's results name it."""
    return f"prefill_s_of_{tokens}"


def depth_figures(runs: list[dict], depths: list[int], new_tokens: int) -> dict:
    """From llama-bench's JSON records: ms per generated token (1000 over its tokens per second) at each depth."""
    found = {int(r["n_depth"]): 1e3 / float(r["avg_ts"]) for r in runs if int(r["n_gen"]) == new_tokens}
    if set(found) != set(depths):
        raise RuntimeError(f"llama-bench reported depths {sorted(found)}, asked for {depths}: {runs}")
    return {depth_key(d): round(found[d], 4) for d in depths}


def depth_key(depth: int) -> str:
    """The figure of batch-1 decode at `depth` tokens of context, as peers.py's results name it."""
    return f"b1_ms_per_token_at_{depth}"
