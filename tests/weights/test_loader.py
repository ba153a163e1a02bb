import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.models.demo import write_demo_model
from kiln.weights.loader import load_weights
from kiln.models.registry import create_model


def _load(model_dir, dtype=torch.float32):
    model = create_model(ModelConfig.from_model_dir(model_dir), dtype)
    load_weights(model, model_dir)
    return model


def _copy_with(src, dst, edit):
    """Copy a single-file demo model, rewriting its tensors with `edit(dict)`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_sharded_checkpoint_equals_single_file(tmp_path):
    single = write_demo_model(tmp_path / "single", arch="qwen2", train_steps=0)
    sharded = write_demo_model(tmp_path / "sharded", arch="qwen2", max_shard_size="200KB", train_steps=0)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = _load(single), _load(sharded)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name


def test_merged_projections_hold_the_checkpoint_slices(demo_dirs):
    model = _load(demo_dirs["llama"])
    raw = load_file(demo_dirs["llama"] / "model.safetensors")
    qkv = model.model.layers[1].self_attn.qkv_proj.weight
    expect = torch.cat([raw[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(qkv, expect)
    gate_up = model.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([raw["model.layers.1.mlp.gate_proj.weight"],
                                           raw["model.layers.1.mlp.up_proj.weight"]]))


def test_bfloat16_load_casts(demo_dirs):
    model = _load(demo_dirs["qwen3"], torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_missing_tensor_is_named(demo_dirs, tmp_path):
    d = _copy_with(demo_dirs["llama"], tmp_path / "m", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(KilnError, match=r"missing tensor 'model.layers.2.mlp.up_proj.weight'$"):
        _load(d)


def test_wrong_shape_is_named(demo_dirs, tmp_path):
    def edit(t):
        t["model.layers.0.self_attn.k_proj.weight"] = t["model.layers.0.self_attn.k_proj.weight"][:-1].clone()

    d = _copy_with(demo_dirs["llama"], tmp_path / "m", edit)
    with pytest.raises(KilnError, match=r"'model.layers.0.self_attn.k_proj.weight' .* has shape \[63, 256\]"):
        _load(d)


def test_unexpected_tensor_is_named(demo_dirs, tmp_path):
    d = _copy_with(demo_dirs["llama"], tmp_path / "m", lambda t: t.update({"model.extra.weight": torch.ones(2)}))
    with pytest.raises(KilnError, match="unexpected tensor 'model.extra.weight'"):
        _load(d)


def test_no_weights(demo_dirs, tmp_path):
    (tmp_path / "config.json").write_text((demo_dirs["llama"] / "config.json").read_text())
    with pytest.raises(KilnError, match="no \\*.safetensors"):
        _load(tmp_path)


def test_tied_config_with_a_stored_lm_head_uses_it_as_transformers_does(demo_dirs, tmp_path, caplog):
    """Qwen2-style tied config, but the checkpoint carries its own lm_head.weight: transformers unties
    and uses it, so kiln must too (dropping it changes every logit). An equal copy stays tied."""
    from transformers import AutoModelForCausalLM

    from tests.oracle import hf_greedy

    generator = torch.Generator().manual_seed(0)

    def own_head(t):
        t["lm_head.weight"] = torch.randn(t["model.embed_tokens.weight"].shape, generator=generator) * 0.05

    untied = _copy_with(demo_dirs["qwen2"], tmp_path / "own_head", own_head)
    with caplog.at_level("WARNING", logger="kiln"):
        model = _load(untied)
    assert not model.config.tie_word_embeddings and "stores an lm_head.weight of its own" in caplog.text
    stored = load_file(untied / "model.safetensors")["lm_head.weight"]
    assert torch.equal(model.lm_head_weight(), stored)
    hf = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32).eval()
    assert torch.equal(hf.lm_head.weight, stored)  # the oracle agrees on which weight counts
    ids = [3, 17, 42, 5, 9]
    want, _ = hf_greedy(hf, ids, 6)
    from kiln import LLM, SamplingParams

    [out] = LLM(untied, max_model_len=64).generate([ids], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert out.token_ids == want

    caplog.clear()
    copy = _copy_with(demo_dirs["qwen2"], tmp_path / "copied_head",
                      lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].clone()))
    with caplog.at_level("WARNING", logger="kiln"):
        assert _load(copy).config.tie_word_embeddings
    assert "lm_head" not in caplog.text


def test_the_load_returns_the_checksum_of_every_byte_it_read(demo_dirs, tmp_path):
    """What keys the packed weights: the same bytes anywhere give the same checksum; one weight's
    change, even in a file of the same size, another."""
    config = ModelConfig.from_model_dir(demo_dirs["llama"])
    checksum = load_weights(create_model(config, torch.float32), demo_dirs["llama"])
    assert len(checksum) == 32
    copy = _copy_with(demo_dirs["llama"], tmp_path / "copy", lambda tensors: None)  # rewritten, same tensors
    assert load_weights(create_model(config, torch.float32), copy) == checksum

    def nudge(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] += 1.0

    edited = _copy_with(demo_dirs["llama"], tmp_path / "edited", nudge)
    assert (edited / "model.safetensors").stat().st_size == (copy / "model.safetensors").stat().st_size
    assert load_weights(create_model(config, torch.float32), edited) != checksum
