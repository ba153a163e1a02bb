"""Tiny demo models that kiln builds itself: a byte-level BPE tokenizer trained with `tokenizers` on
text shipped in the package, a transformers model initialized at random and, unless told otherwise,
trained for a few seconds on that same text. Nothing is downloaded.

Training matters for a demo: a random model's next-token distribution is nearly flat, so its greedy
text is noise and any perturbation (quantization, a reordered sum) flips near-tied tokens. A model that
has learned the corpus answers its prompts with the corpus's sentences and has confident predictions,
like a real checkpoint.
"""

import logging
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `kiln --help` reads this module's constants
    import torch

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
DEMO_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
MOE_DEMO_ARCHS = ("qwen3_moe", "mixtral")
"""Mixture-of-experts demo models: `kiln demo-model --arch`, and the MoE tests, which build their own."""
TRAIN_STEPS = 200  # enough for the 4-layer demo llama to repeat its corpus, in seconds on 2 CPU cores


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
    if arch == "qwen2":  # 6 heads of 48 (no power of two), one KV head (replicated under TP), qkv bias, tied
        heads = 6
        return tf.Qwen2Config(
            hidden_size=heads * 48, intermediate_size=2 * hidden_size,
            num_attention_heads=heads, num_key_value_heads=1, tie_word_embeddings=True, **common)
    if arch == "qwen3":  # q/k norm, head_dim decoupled from hidden_size, tied
        return tf.Qwen3Config(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size, head_dim=64,
            num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True, **common)
    # The MoE demos' attention is their dense twin's (qwen3's, mistral's without the window): the pieces up to
    # the first attention are the same compile, which the piece cache shares.
    if arch == "qwen3_moe":  # 8 experts of hidden_size / 4, top 2 renormalized, q/k norm, tied
        return tf.Qwen3MoeConfig(
            hidden_size=hidden_size, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 4,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, head_dim=64, num_attention_heads=6,
            num_key_value_heads=2, tie_word_embeddings=True, **common)
    if arch == "mixtral":  # 4 experts of hidden_size / 2, top 2, GQA 2:1, untied
        return tf.MixtralConfig(
            hidden_size=hidden_size, intermediate_size=hidden_size // 2, num_local_experts=4, num_experts_per_tok=2,
            num_attention_heads=hidden_size // head_dim, num_key_value_heads=max(1, hidden_size // head_dim // 2),
            rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, **common)
    raise ValueError(f"unknown demo arch {arch!r}; choose from {', '.join(DEMO_ARCHS + MOE_DEMO_ARCHS)}")


def corpus() -> str:
    return files("kiln.models").joinpath("demo_corpus.txt").read_text()


def paragraph_openings(words: int = 6) -> list[str]:
    """The first words of each paragraph of the corpus: prompts whose continuation a trained demo
    model knows (a one-word prompt like "A" opens several sentences and has no single answer)."""
    return [" ".join(p.split()[:words]) for p in corpus().split("\n\n") if p.strip()]


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
    tok.train_from_iterator(corpus().split("\n"), trainer=trainer)
    return tok


def write_demo_model(
    out_dir: str | Path,
    arch: str = "llama",
    num_layers: int = 4,
    hidden_size: int = 256,
    seed: int = 0,
    max_shard_size: str | None = None,
    train_steps: int = TRAIN_STEPS,
    progress: bool | None = None,
) -> Path:
    """Write config.json, safetensors weights and tokenizer files for a tiny model, trained on the
    demo corpus for `train_steps` steps (0: random weights)."""
    import torch
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
    if train_steps:
        train_on_corpus(model, tok.encode(corpus()).ids, train_steps, seed, progress)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(out)
    logger.info("wrote demo %s model (%d layers) to %s", arch, num_layers, out)
    return out


def train_on_corpus(model: "torch.nn.Module", ids: list[int], steps: int, seed: int = 0,
                    progress: bool | None = None, seq_len: int = 64, batch: int = 8, lr: float = 3e-3) -> float:
    """Next-token training on random windows of `ids` (AdamW, one-cycle schedule); returns the last loss."""
    import torch
    from tqdm import tqdm

    data = torch.tensor(ids)
    if len(data) <= seq_len:
        raise ValueError(f"corpus has {len(data)} tokens; training needs more than seq_len={seq_len}")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=steps, pct_start=0.1)
    model.train()
    disable = None if progress is None else not progress
    with tqdm(range(steps), desc="kiln demo-model: training", unit="step", disable=disable) as bar:
        for _ in bar:
            starts = torch.randint(0, len(data) - seq_len, (batch,), generator=gen)
            x = torch.stack([data[i : i + seq_len] for i in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    model.eval()
    logger.info("trained the demo model for %d steps, final loss %.3f", steps, loss.item())
    return loss.item()
