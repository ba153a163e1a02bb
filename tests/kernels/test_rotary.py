import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from kiln.errors import KilnError
from kiln.kernels.rotary import rope_cos_sin_cache, rope_inv_freq

ops = torch.ops.kiln

LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=64)
LINEAR = dict(rope_type="linear", factor=4.0)


def _hf_config(scaling):
    return LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=512,
                       rope_scaling=scaling, rope_theta=10000.0)


@pytest.mark.parametrize("scaling", [LLAMA3, LINEAR], ids=["llama3", "linear"])
def test_scaled_inv_freq_equals_transformers(scaling):
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](_hf_config(scaling), "cpu")
    assert torch.equal(rope_inv_freq(32, 10000.0, scaling), hf_inv_freq)


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["default", "llama3"])
def test_neox_rotary_equals_transformers(scaling):
    cfg = _hf_config(scaling)
    positions = torch.tensor([0, 3, 17, 200, 511])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    cache = rope_cos_sin_cache(32, 512, 10000.0, scaling, torch.float32)
    out_q, out_k = ops.rotary_embedding(positions, q, k, cache, True)
    torch.testing.assert_close(out_q, ref_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out_k, ref_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


def test_gptj_rotary_rotates_adjacent_pairs():
    """GPT-J style treats (x[2i], x[2i+1]) as one complex number multiplied by e^(i*pos*freq_i)."""
    positions = torch.tensor([1, 9, 40])
    q, k = torch.randn(3, 2, 16), torch.randn(3, 1, 16)
    cache = rope_cos_sin_cache(16, 64, 500.0, None, torch.float32)
    angles = torch.outer(positions.float(), rope_inv_freq(16, 500.0, None))
    rot = torch.polar(torch.ones_like(angles), angles)[:, None, :]

    def ref(x):
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * rot).flatten(-2)

    out_q, out_k = ops.rotary_embedding(positions, q, k, cache, False)
    torch.testing.assert_close(out_q, ref(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_k, ref(k), atol=1e-5, rtol=1e-5)


def test_unsupported_rope_type_names_it():
    with pytest.raises(KilnError, match="'yarn' is not supported"):
        rope_inv_freq(32, 10000.0, dict(rope_type="yarn", factor=4.0))
