"""Configuration objects, with every default in one place."""

from dataclasses import dataclass

import torch

from kiln.errors import KilnError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise KilnError(f"unknown dtype {name!r}; choose from {', '.join(DTYPES)}")
    return DTYPES[name]


@dataclass
class EngineConfig:
    """How the runtime batches and caches: the knobs of the scheduler and the paged KV cache."""

    block_size: int = 16
    """Tokens per KV-cache block."""
    kv_cache_memory_bytes: int = 1 << 30
    """Upper bound on KV-cache memory; the cache is never larger than max_num_seqs full sequences."""
    max_num_seqs: int = 64
    """Sequences running at once; more wait in the queue."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step; longer prompts are prefilled in chunks."""
    max_model_len: int | None = None
    """Prompt + generated tokens per sequence; None means the model's max_position_embeddings."""

    def __post_init__(self) -> None:
        for name in ("block_size", "kv_cache_memory_bytes", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise KilnError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
