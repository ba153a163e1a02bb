import json

import pytest

from kiln.errors import KilnError
from kiln.models.config import ModelConfig

BASE = dict(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def test_transformers4_and_5_rope_fields_agree():
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)
    v4 = ModelConfig.from_hf(dict(BASE, architectures=["LlamaForCausalLM"], rope_theta=500000.0, rope_scaling=scaling))
    v5 = ModelConfig.from_hf(dict(BASE, architectures=["LlamaForCausalLM"],
                                  rope_parameters=dict(scaling, rope_theta=500000.0)))
    assert v4 == v5
    assert v4.rope_theta == 500000.0 and v4.rope_scaling["rope_type"] == "llama3"
    assert v4.head_dim == 16 and v4.num_kv_heads == 2


def test_architecture_flags():
    qwen2 = ModelConfig.from_hf(dict(BASE, architectures=["Qwen2ForCausalLM"], sliding_window=32))
    assert qwen2.qkv_bias and not qwen2.o_bias and qwen2.sliding_window is None  # use_sliding_window off
    qwen3 = ModelConfig.from_hf(dict(BASE, architectures=["Qwen3ForCausalLM"], head_dim=32))
    assert qwen3.qk_norm and qwen3.head_dim == 32 and not qwen3.qkv_bias
    mistral = ModelConfig.from_hf(dict(BASE, architectures=["MistralForCausalLM"], sliding_window=32))
    assert mistral.sliding_window == 32


def test_unsupported_architecture_is_one_clear_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, architectures=["GPT2LMHeadModel"])))
    with pytest.raises(KilnError) as err:
        ModelConfig.from_model_dir(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg


def test_missing_config_field_is_named(tmp_path):
    cfg = dict(BASE, architectures=["LlamaForCausalLM"])
    del cfg["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(KilnError, match="intermediate_size"):
        ModelConfig.from_model_dir(tmp_path)
