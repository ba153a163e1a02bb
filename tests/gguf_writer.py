"""A GGUF file written from a Hugging Face model as llama.cpp's converter lays one out (its tensor names from
the `gguf` package's own map, a llama's query and key rows permuted for its rope, the tokenizer and chat
template in the metadata), each tensor in the type asked: the tests' GGUF checkpoints, written by the
`gguf` package, never downloaded."""

import json
from pathlib import Path

import numpy as np
import torch

CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

K_BLOCK_BYTES = {"Q4_K": 144, "Q6_K": 210}
"""Bytes of a 256-value block of the K-quants the `gguf` package dequantizes but cannot quantize."""


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute`: each head's rows, two halves interleaved."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _k_quant_bytes(rows: int, k: int, kind: str, seed: int) -> np.ndarray:
    """Random codes in `kind`'s block layout, with small fp16 super-scales (bytes 0-3 of a Q4_K block: d and
    dmin; the last two of a Q6_K block: d)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, k // 256, K_BLOCK_BYTES[kind]), dtype=np.uint8)
    scale = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)
    if kind == "Q4_K":
        blocks[..., 0:2] = scale
        blocks[..., 2:4] = np.frombuffer(np.float16(1e-4).tobytes(), np.uint8)
    else:
        blocks[..., -2:] = np.frombuffer(np.float16(2e-5).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(model, tokenizer, path: Path, arch: str, type_of) -> dict[str, torch.Tensor]:
    """Write `model` (transformers, fp32) and `tokenizer` (a `tokenizers` byte-level BPE) as GGUF `path` of
    architecture `arch`, tensor `name` in `type_of(name)` ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K");
    returns each tensor as the file holds it, dequantized, under its Hugging Face name: the reference."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    theta = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    writer.add_rope_freq_base(theta)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    held = {}
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        w = tensor.float().numpy()
        kind = type_of(name)
        if kind in K_BLOCK_BYTES:
            data = _k_quant_bytes(w.shape[0], w.shape[1], kind, index)
            value = quants.dequantize(data, GGMLQuantizationType[kind])
        elif kind in ("F32", "F16"):
            data = w.astype(np.float32 if kind == "F32" else np.float16)
            value = data.astype(np.float32)
        else:
            data = quants.quantize(w, GGMLQuantizationType[kind])
            value = quants.dequantize(data, GGMLQuantizationType[kind])
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            if kind in K_BLOCK_BYTES:  # the codes are the file's: the reference is their rows in HF's order
                value = _unpermute(value, heads)
            else:
                data = _permute(data, heads)
        gguf_name = names.get_name(name.removesuffix(".weight").removesuffix(".bias"))
        suffix = ".weight" if name.endswith(".weight") else ".bias"
        writer.add_tensor(gguf_name + suffix, data, raw_dtype=GGMLQuantizationType[kind]
                          if kind not in ("F32", "F16") else None)
        held[name] = torch.from_numpy(np.ascontiguousarray(value)).reshape(tensor.shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return held


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
