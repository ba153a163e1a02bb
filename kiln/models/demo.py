"""Tiny demo models that kiln builds itself: random weights via transformers, a byte-level BPE
tokenizer trained with `tokenizers` on text shipped in the package. Nothing is downloaded."""

import logging
from importlib.resources import files
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
DEMO_ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def _arch_config(arch: str, vocab_size: int, eos_id: int, num_layers: int, hidden_size: int):
    """Per-architecture shapes that exercise GQA, odd head counts, tying and rope scaling."""
    import transformers as tf

    common = dict(
        vocab_size=vocab_size,
        num_hidden_layers=num_layers,
        max_position_embeddings=2048,
        eos_token_id=eos_id,
        bos_token_id=eos_id,
        initializer_range=0.05,
    )
    head_dim = 32
    if arch == "llama":  # GQA 4:1, llama3 rope scaling, untied
        return tf.LlamaConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_attention_heads=hidden_size // head_dim, num_key_value_heads=max(1, hidden_size // head_dim // 4),
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=64),
            rope_theta=10000.0, tie_word_embeddings=False, **common)
    if arch == "mistral":  # GQA 2:1, sliding window, untied
        return tf.MistralConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size,
            num_attention_heads=hidden_size // head_dim, num_key_value_heads=max(1, hidden_size // head_dim // 2),
            sliding_window=48, tie_word_embeddings=False, **common)
    if arch == "qwen2":  # odd head count (5), one KV head, qkv bias, tied
        heads = 5
        return tf.Qwen2Config(
            hidden_size=heads * 48, intermediate_size=2 * hidden_size,
            num_attention_heads=heads, num_key_value_heads=1, tie_word_embeddings=True, **common)
    if arch == "qwen3":  # q/k norm, head_dim decoupled from hidden_size, tied
        return tf.Qwen3Config(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size, head_dim=64,
            num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, **common)
    raise ValueError(f"unknown demo arch {arch!r}; choose from {', '.join(DEMO_ARCHS)}")


def train_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on the shipped corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = files("kiln.models").joinpath("demo_corpus.txt").read_text()
    tok.train_from_iterator(text.split("\n"), trainer=trainer)
    return tok


def write_demo_model(
    out_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 256,
    seed: int = 0,
    max_shard_size: str | None = None,
) -> Path:
    """Write config.json, safetensors weights and tokenizer files for a tiny random model."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    eos_id = tok.token_to_id(EOS_TOKEN)
    config = _arch_config(arch, tok.get_vocab_size(), eos_id, num_layers, hidden_size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(out)
    logger.info("wrote demo %s model (%d layers) to %s", arch, num_layers, out)
    return out
