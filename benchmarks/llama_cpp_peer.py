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

QUANTS = {"llama.cpp-f32": None, "llama.cpp-q8_0": "Q8_0", "llama.cpp-q4_k_m": "Q4_K_M"}
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


def write_gguf(model_dir: Path, out: Path, llama_cpp: Path) -> Path:
    """The checkpoint in `model_dir` (a Qwen2 config.json and safetensors) as an F32 GGUF at `out`."""
    sys.path.insert(0, str(llama_cpp / "src" / "vendor" / "llama.cpp" / "gguf-py"))
    import gguf
    from safetensors.torch import load_file

    from kiln.models.config import ModelConfig

    cfg = ModelConfig.from_model_dir(model_dir)  # reads both transformers' config layouts (rope_parameters)
    if cfg.architecture != "Qwen2ForCausalLM":
        raise SystemExit(f"llama.cpp peer: only Qwen2 checkpoints are written as GGUF here, not {cfg.architecture}")
    writer = gguf.GGUFWriter(str(out), arch="qwen2")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"<{i}>" for i in range(cfg.vocab_size)])
    writer.add_token_types([gguf.TokenType.NORMAL] * cfg.vocab_size)
    writer.add_token_merges(["< 0"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for path in sorted(model_dir.glob("*.safetensors")):
        for name, tensor in load_file(path).items():
            writer.add_tensor(gguf_name(name), tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def prepare(model_dir: Path, work: Path, llama_cpp: Path, systems: list[str]) -> dict[str, Path]:
    """Each llama.cpp system's GGUF file: the F32 one written once, the others quantized from it."""
    f32 = work / "model-f32.gguf"
    if not f32.is_file():
        write_gguf(model_dir, f32, llama_cpp)
    files = {}
    for system in systems:
        kind = QUANTS[system]
        files[system] = f32 if kind is None else work / f"model-{kind.lower()}.gguf"
        if kind is not None and not files[system].is_file():
            subprocess.run([str(llama_cpp / "bin" / "llama-quantize"), str(f32), str(files[system]), kind],
                           check=True, capture_output=True)
    return files


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*\d+\s*\|\s*([\d.]+)\s*\|\s*[\d.]+\s*\|\s*([\d.]+)\s*\|"
                  r"\s*([\d.]+)\s*\|")


def measure(llama_cpp: Path, model: Path, threads: int, prompts: int, prompt_len: int, new_tokens: int) -> dict:
    """peers.py's figures from one `llama-batched-bench` run at batch 1 and `prompts`."""
    cmd = [str(llama_cpp / "bin" / "llama-batched-bench"), "-m", str(model), "-npp", str(prompt_len), "-ntg",
           str(new_tokens), "-npl", f"1,{prompts}", "-t", str(threads), "--poll", "0", "-lm", "none",
           "-c", str(prompts * (prompt_len + new_tokens))]
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
