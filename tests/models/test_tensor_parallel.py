"""Each rank's share of a model: the layout's arithmetic and the loader reading only that share."""

import dataclasses

import pytest
import torch

from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.weights.loader import load_weights
from kiln.models.registry import create_model
from kiln.models.tensor_parallel import RankLayout, Shard

LLAMA = ModelConfig(architecture="LlamaForCausalLM", vocab_size=511, hidden_size=256, intermediate_size=512,
                    num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                    max_position_embeddings=256)


def test_layout_splits_heads_columns_and_vocabulary():
    r1 = RankLayout.of(LLAMA, ParallelConfig(rank=1, world_size=2))
    assert (r1.num_heads, r1.num_kv_heads, r1.kv_head_start, r1.intermediate_size) == (4, 1, 1, 256)
    assert (r1.vocab_per_rank, r1.vocab_start) == (256, 256)  # 511 padded to 512
    assert r1.shard("model.layers.0.self_attn.q_proj.weight") == Shard(0, 128, 128)
    assert r1.shard("model.layers.0.self_attn.v_proj.weight") == Shard(0, 32, 32)
    assert r1.shard("model.layers.0.mlp.up_proj.weight") == Shard(0, 256, 256)
    assert r1.shard("model.layers.0.self_attn.o_proj.weight") == Shard(1, 128, 128)
    assert r1.shard("model.layers.0.mlp.down_proj.weight") == Shard(1, 256, 256)
    assert r1.shard("model.layers.0.mlp.down_proj.bias") == Shard(0, 0, 0)  # rank 0 alone adds it
    assert r1.shard("lm_head.weight") == Shard(0, 256, 255)  # the last rank's rows end at the vocabulary
    assert r1.shard("model.layers.0.input_layernorm.weight") is None  # replicated
    assert RankLayout.of(LLAMA).shard("model.layers.0.self_attn.q_proj.weight") is None
    # quantized checkpoints: per-output-channel scales follow the rows; row-parallel layers keep them all
    assert r1.shard("model.layers.0.self_attn.q_proj.weight_scale") == Shard(0, 128, 128)
    assert r1.shard("model.layers.0.self_attn.o_proj.weight_scale") is None
    assert r1.shard("model.layers.0.mlp.gate_proj.input_scale") is None


def test_fewer_kv_heads_than_ranks_are_replicated():
    one_kv = dataclasses.replace(LLAMA, num_kv_heads=1)
    layouts = [RankLayout.of(one_kv, ParallelConfig(rank=r, world_size=2)) for r in range(2)]
    assert [(lay.num_kv_heads, lay.kv_head_start) for lay in layouts] == [(1, 0), (1, 0)]
    two_kv = [RankLayout.of(LLAMA, ParallelConfig(rank=r, world_size=4)) for r in range(4)]
    assert [lay.kv_head_start for lay in two_kv] == [0, 0, 1, 1]  # query heads 0-3 use KV head 0


def test_uneven_splits_are_refused_with_the_fix():
    with pytest.raises(KilnError, match="num_attention_heads 8 is not divisible by the tensor parallel size 3.*"
                                        "choose a tensor parallel size"):
        RankLayout.of(LLAMA, ParallelConfig(rank=0, world_size=3))
    with pytest.raises(KilnError, match="num_key_value_heads 3 neither divides"):
        RankLayout.of(dataclasses.replace(LLAMA, num_kv_heads=3, num_heads=12), ParallelConfig(rank=0, world_size=2))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_rank_loads_its_slices_of_the_checkpoint(demo_dirs, arch):
    cfg = ModelConfig.from_model_dir(demo_dirs[arch])
    full = create_model(cfg, torch.float32)
    load_weights(full, demo_dirs[arch])
    for rank in range(2):
        part = create_model(cfg, torch.float32, parallel=ParallelConfig(rank=rank, world_size=2))
        load_weights(part, demo_dirs[arch])
        lay = part.layout
        q, kv = lay.num_heads * cfg.head_dim, lay.num_kv_heads * cfg.head_dim
        qkv_full = full.model.layers[1].self_attn.qkv_proj.weight
        k0 = cfg.num_heads * cfg.head_dim + lay.kv_head_start * cfg.head_dim
        want = torch.cat([qkv_full[rank * q:(rank + 1) * q], qkv_full[k0:k0 + kv],
                          qkv_full[k0 + cfg.num_kv_heads * cfg.head_dim:][:kv]])
        torch.testing.assert_close(part.model.layers[1].self_attn.qkv_proj.weight, want, rtol=0, atol=0)
        o_full = full.model.layers[1].self_attn.o_proj.weight
        torch.testing.assert_close(part.model.layers[1].self_attn.o_proj.weight, o_full[:, rank * q:(rank + 1) * q],
                                   rtol=0, atol=0)
        rows = part.model.embed_tokens.weight
        own = full.model.embed_tokens.weight[lay.vocab_start:lay.vocab_start + lay.vocab_per_rank]
        torch.testing.assert_close(rows[:len(own)], own, rtol=0, atol=0)
        assert not rows[len(own):].any()  # padding rows are zero
        if cfg.qkv_bias:
            bias = full.model.layers[1].self_attn.qkv_proj.bias
            torch.testing.assert_close(part.model.layers[1].self_attn.qkv_proj.bias[:q], bias[rank * q:(rank + 1) * q])


def test_llm_asks_for_torchrun_when_it_is_one_process(demo_dirs, monkeypatch):
    from kiln import LLM

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(KilnError, match="tensor_parallel_size 2 needs as many processes.*torchrun --nproc-per-node 2"):
        LLM(demo_dirs["llama"], tensor_parallel_size=2)
