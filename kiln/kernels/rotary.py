"""Rotary position embedding: the cos/sin table (with rope scaling) and the op that applies it."""

import math

import torch

from kiln.errors import KilnError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies, computed exactly as Hugging Face does so tables match bit for bit."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (theta**exponents)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise KilnError(
        f"rope type {rope_type!r} is not supported (kiln supports {', '.join(SUPPORTED_ROPE_TYPES)}); "
        "use a checkpoint with one of those or add the scaling to kiln/kernels/rotary.py"
    )


def rope_cos_sin_cache(
    rotary_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype
) -> torch.Tensor:
    """[max_positions, rotary_dim] table: cos in the first half of the last dim, sin in the second."""
    inv_freq = rope_inv_freq(rotary_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([out, x_pass], dim=-1) if x_pass.shape[-1] else out


def rotary_embedding_native(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


@torch.library.custom_op("kiln::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, Hq, D] and key [T, Hkv, D] by position; neox (halves) or GPT-J (pairs) style."""
    return rotary_embedding_native(positions, query, key, cos_sin_cache, is_neox)


@rotary_embedding.register_fake
def _(positions, query, key, cos_sin_cache, is_neox):
    return torch.empty_like(query), torch.empty_like(key)
