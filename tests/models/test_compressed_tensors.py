"""Pre-quantized compressed-tensors checkpoints: config parsing, loading, and outputs against a
dequantized Hugging Face reference."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, KilnError, SamplingParams
from kiln.compiler.artifact import pass_matches, read_manifest
from kiln.models.compressed_tensors import CheckpointQuantization, parse_quantization_config
from kiln.models.quantization import Int4Linear, QuantLinear
from tests.oracle import PROMPTS, hf_greedy
from tests.quant_checkpoints import calibrate, dequantized_reference, quant_config, write_compressed


@pytest.fixture(scope="module")
def calibration(demo_dirs, hf_models) -> dict[str, dict[str, float]]:
    return {arch: calibrate(hf_models[arch], demo_dirs[arch]) for arch in ("llama", "qwen2")}


# -- config parsing ------------------------------------------------------------------------------

def test_parses_the_w8a8_layouts():
    assert parse_quantization_config(quant_config("int8")) == CheckpointQuantization("int8", False, False)
    assert parse_quantization_config(quant_config("fp8", per_tensor=True, static=True)) == \
        CheckpointQuantization("fp8", True, True)
    assert parse_quantization_config(None) is None


def _edit(path: str, value) -> dict:
    qc = quant_config("int8")
    *parents, leaf = path.split(".")
    node = qc
    for p in parents:
        node = node[p]
    node[leaf] = value
    return qc


def _int4_edit(key: str, value) -> dict:
    qc = quant_config("int4")
    qc["config_groups"]["group_0"]["weights"][key] = value
    return qc


def test_parses_w4a16_groups():
    assert parse_quantization_config(quant_config("int4", group_size=64)) == \
        CheckpointQuantization("int4", False, False, group_size=64)


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    (_edit("config_groups.group_0.weights.num_bits", 4), "4-bit weights in format 'int-quantized'"),
    (_edit("config_groups.group_0.weights.num_bits", 2), "weights are 2-bit int"),
    (_edit("config_groups.group_0.weights.symmetric", False), "weights are asymmetric"),
    (_edit("config_groups.group_0.input_activations", None), "weight-only quantization"),
    (_edit("config_groups.group_0.weights.strategy", "group"), "weight strategy 'group'"),
    (_edit("config_groups.group_0.input_activations.dynamic", False), "activation strategy 'token' with dynamic=False"),
    (_edit("config_groups.group_0.input_activations.type", "float"), "int weights with float activations"),
    (_edit("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "quantized KV cache"),
    (_edit("ignore", ["lm_head", "re:.*down_proj"]), "ignore entry 're:.*down_proj'"),
    (_edit("format", "pack-quantized"), "pack-quantized weights of other than 4 bits"),
    ({**quant_config("int4"), "format": "int-quantized"}, "4-bit weights in format 'int-quantized'"),
    (_int4_edit("symmetric", False), "with zero points"),
    (_int4_edit("strategy", "channel"), "4-bit weight strategy 'channel'"),
    (_int4_edit("actorder", "group"), "actorder 'group'"),
    (_int4_edit("group_size", 20), "group_size 20"),
])
def test_refuses_layouts_it_cannot_run_exactly(qc, message):
    with pytest.raises(KilnError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        parse_quantization_config(qc)


# -- loading and numerics --------------------------------------------------------------------------

def test_int8_checkpoint_runs_exactly_like_online_int8(demo_dirs, tmp_path):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "int8", "int8")
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    llm = LLM(ckpt)
    qkv = llm.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weight.dtype == torch.int8 and qkv.input_scale is None
    for a, b in zip(llm.generate(PROMPTS, params), LLM(demo_dirs["llama"], quantization="int8").generate(PROMPTS, params)):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


@pytest.mark.parametrize("arch, scheme, per_tensor, static", [
    ("llama", "int8", False, True),
    ("llama", "fp8", True, True),
    ("qwen2", "fp8", False, False),  # qkv bias stays full precision
])
def test_checkpoint_matches_dequantized_reference(demo_dirs, calibration, tmp_path, arch, scheme, per_tensor, static):
    ckpt = write_compressed(demo_dirs[arch], tmp_path / "ckpt", scheme, per_tensor,
                            calibration[arch] if static else None)
    _assert_matches(LLM(ckpt), dequantized_reference(demo_dirs[arch], ckpt, scheme))


def _assert_matches(llm: LLM, reference) -> None:
    """8 greedy tokens of 4 prompts: the reference's tokens, the typical logprob within 1e-4 and every one
    within 1e-2. kiln's and transformers' attention differ by ~1e-6, which can tip one activation across a
    rounding boundary of the quantizer (an fp8 step is 1/16 of the value; int4's int8 activation blocks a
    1/127 of their largest): such a logprob moves by up to a few 1e-3 (seen: 2.9e-3)."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    diffs = []
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], params)[0]
        tokens, logprobs = hf_greedy(reference, ids, 8)
        assert out.token_ids == tokens
        diffs += (torch.tensor(out.logprobs) - torch.tensor(logprobs)).abs().tolist()
    diffs = torch.tensor(diffs)
    assert diffs.max() < 1e-2 and diffs.median() < 1e-4, diffs


@pytest.mark.parametrize("arch, group", [("llama", 128), ("qwen2", 32)])  # qwen2: 288 wide
def test_w4a16_checkpoint_matches_dequantized_reference(demo_dirs, tmp_path, arch, group):
    """llm-compressor's pack-quantized W4A16 layout loads into kiln's int4 layers as it is (codes and
    scales exactly, the minimum -8 x scale), and runs as W4A8: the reference quantizes the activations
    the same way, in blocks of 32."""
    ckpt = write_compressed(demo_dirs[arch], tmp_path / "w4", "int4", group_size=group)
    reference = dequantized_reference(demo_dirs[arch], ckpt, "int4")
    llm = LLM(ckpt)
    down = llm.model.model.layers[1].mlp.down_proj
    assert isinstance(down, Int4Linear) and down.weight.dtype == torch.uint8
    hidden, inter = llm.model_config.hidden_size, down.weight.shape[1] * 2
    assert tuple(down.weight.shape) == (hidden, inter // 2) and tuple(down.weight_scale.shape) == (hidden, inter // group)
    assert torch.equal(down.weight_min, down.weight_scale * -8)  # symmetric codes c stored as c + 8
    _assert_matches(llm, reference)


def test_w4a16_groups_a_rank_would_cut_are_refused(demo_dirs, tmp_path):
    """qwen2's 6 heads of 48 over 2 ranks leave o_proj 144 input channels a rank: not whole groups of 32."""
    from kiln.config import ParallelConfig
    from kiln.models.config import ModelConfig
    from kiln.models.registry import create_model

    ckpt = write_compressed(demo_dirs["qwen2"], tmp_path / "w4", "int4", group_size=32)
    with pytest.raises(KilnError, match="a rank's share of a projection, 144 input channels, does not split into the "
                                        "checkpoint's groups of 32: use a tensor parallel size"):
        create_model(ModelConfig.from_model_dir(ckpt), torch.float32, parallel=ParallelConfig(rank=0, world_size=2))


def test_w4a16_weight_shape_is_checked(demo_dirs, tmp_path):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "w4", "int4")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight_shape"] = torch.tensor([256, 256], dtype=torch.int32)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(KilnError, match=r"'model.layers.0.mlp.down_proj.weight_shape' in model.safetensors says the "
                                        r"weight is \[256, 256\], but config.json implies \[256, 512\]"):
        LLM(ckpt)


def test_merged_projection_takes_the_largest_input_scale(demo_dirs, calibration, tmp_path):
    amax = dict(calibration["llama"])
    amax["model.layers.1.self_attn.k_proj"] *= 3
    amax["model.layers.1.mlp.gate_proj"] /= 2
    llm = LLM(write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "int8", input_amax=amax))
    layer = llm.model.model.layers[1]
    assert layer.self_attn.qkv_proj.input_scale.item() == pytest.approx(amax["model.layers.1.self_attn.k_proj"] / 127)
    assert layer.mlp.gate_up_proj.input_scale.item() == pytest.approx(amax["model.layers.1.mlp.up_proj"] / 127)


def test_static_input_scales_load_onto_the_models_device(demo_dirs, calibration, tmp_path):
    """The checkpoint's scales are read on the CPU; the model's may sit elsewhere (meta stands in for CUDA)."""
    from kiln.models.config import ModelConfig
    from kiln.weights.loader import load_weights
    from kiln.models.registry import create_model

    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "int8", input_amax=calibration["llama"])
    model = create_model(ModelConfig.from_model_dir(ckpt), torch.float32, device="meta")
    load_weights(model, ckpt)
    assert model.model.layers[0].mlp.gate_up_proj.input_scale.device.type == "meta"


def test_compiled_static_fp8_checkpoint_equals_eager(demo_dirs, calibration, tmp_path, kiln_cache):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "fp8", "fp8", per_tensor=True,
                            input_amax=calibration["llama"])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    eager = LLM(ckpt).generate(PROMPTS, params)
    llm = LLM(ckpt, compile=True, cache_dir=kiln_cache)
    [passes] = pass_matches(read_manifest(llm.artifact_path)).values()
    assert passes["attn_quant"] == 4  # the attentions write fp8 and run eagerly as splitting ops
    compiled = llm.generate(PROMPTS, params)
    for c, e in zip(compiled, eager):
        assert c.token_ids == e.token_ids
        # the artifact may run the fp8 projections as oneDNN fp32 GEMMs on widened weights, which sum in
        # another order than eager's; a static fp8 activation then rounds differently now and then, and its
        # logprob moves by up to a few 1e-3 (seen: 4.9e-3), while the typical one stays at 1e-4
        diff = (torch.tensor(c.logprobs) - torch.tensor(e.logprobs)).abs()
        assert diff.max() < 2e-2 and diff.median() < 1e-4, diff


# -- bad input -----------------------------------------------------------------------------------

def test_weights_of_the_wrong_dtype_are_refused(demo_dirs, tmp_path):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "int8")
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = tensors["model.layers.0.mlp.down_proj.weight"].float()
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(KilnError, match=r"'model.layers.0.mlp.down_proj.weight' in model.safetensors is "
                                        r"torch.float32, but config.json's quantization_config implies torch.int8"):
        LLM(ckpt)


def test_missing_scale_is_named(demo_dirs, tmp_path):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "fp8")
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.2.self_attn.v_proj.weight_scale"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(KilnError, match="missing tensor 'model.layers.2.self_attn.v_proj.weight_scale'"):
        LLM(ckpt)


def test_quantization_option_must_agree_with_the_checkpoint(demo_dirs, tmp_path):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "int8")
    with pytest.raises(KilnError, match=r"already quantized \(int8, compressed-tensors\): drop --quantization fp8"):
        LLM(ckpt, quantization="fp8")
    assert LLM(ckpt, quantization="int8").model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
