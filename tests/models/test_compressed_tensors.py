"""Pre-quantized compressed-tensors checkpoints: config parsing, loading, and outputs against a
dequantized Hugging Face reference."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, KilnError, SamplingParams
from kiln.kernels.quant import FP8_MAX, INT8_MAX, quantize_weight
from kiln.models.compressed_tensors import CheckpointQuantization, parse_quantization_config
from kiln.models.quantization import SCHEMES, QuantLinear
from tests.oracle import PROMPTS, hf_greedy

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QMAX = {"int8": INT8_MAX, "fp8": FP8_MAX}


def quant_config(scheme: str, per_tensor: bool = False, static: bool = False) -> dict:
    kind = "int" if scheme == "int8" else "float"
    return {
        "quant_method": "compressed-tensors",
        "format": f"{kind}-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": False,
                        "strategy": "tensor" if per_tensor else "channel"},
            "input_activations": {"num_bits": 8, "type": kind, "symmetric": True, "dynamic": not static,
                                  "strategy": "tensor" if static else "token"},
        }},
    }


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS


def _fake_quant(x: torch.Tensor, scale: torch.Tensor | None, scheme: str) -> torch.Tensor:
    """Reference activation quantization in plain torch: per token, or per tensor with `scale`."""
    s = (x.abs().amax(-1, keepdim=True) / QMAX[scheme]).clamp(min=1e-10) if scale is None else scale
    q = x / s
    q = q.round().clamp(-127, 127) if scheme == "int8" else q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    return q * s


def _projections(hf_model):
    return [(n, m) for n, m in hf_model.named_modules() if n.split(".")[-1] in PROJECTIONS]


def calibrate(hf_model, model_dir: Path) -> dict[str, float]:
    """Largest |input| of every decoder projection over the test prompts (static activation scales)."""
    from kiln.runtime.tokenizer import Tokenizer

    amax: dict[str, float] = {}

    def record(name, x):
        amax[name] = max(amax.get(name, 0.0), x.abs().max().item())

    hooks = [m.register_forward_pre_hook(lambda mod, a, n=n: record(n, a[0])) for n, m in _projections(hf_model)]
    tok = Tokenizer(model_dir)
    with torch.no_grad():
        for p in PROMPTS:
            hf_model(torch.tensor([tok.encode(p)]))
    for h in hooks:
        h.remove()
    return amax


def write_compressed(src: Path, out: Path, scheme: str, per_tensor: bool = False,
                     input_amax: dict[str, float] | None = None) -> Path:
    """A compressed-tensors copy of the demo checkpoint `src`, laid out the way llm-compressor saves one."""
    shutil.copytree(src, out)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not _is_projection(name):
            tensors[name] = w
            continue
        base = name[: -len(".weight")]
        if per_tensor:
            s = (w.abs().amax() / QMAX[scheme]).reshape(1)
            q = (w / s).round().clamp(-127, 127).to(torch.int8) if scheme == "int8" else (w / s).to(SCHEMES[scheme])
            tensors[f"{base}.weight_scale"] = s
        else:
            q, s = quantize_weight(w, SCHEMES[scheme])
            tensors[f"{base}.weight_scale"] = s.reshape(-1, 1)
        tensors[f"{base}.weight"] = q.contiguous()
        if input_amax is not None:
            tensors[f"{base}.input_scale"] = torch.tensor([input_amax[base] / QMAX[scheme]])
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(scheme, per_tensor, static=input_amax is not None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def dequantized_reference(src: Path, ckpt: Path, scheme: str):
    """The Hugging Face model with every projection's weight replaced by its dequantized checkpoint
    weight and its input passed through the checkpoint's activation quantization."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors = load_file(ckpt / "model.safetensors")
    for name, linear in _projections(model):
        scale = tensors[f"{name}.weight_scale"].reshape(-1, 1)
        linear.weight.data = tensors[f"{name}.weight"].float() * scale
        input_scale = tensors.get(f"{name}.input_scale")
        linear.register_forward_pre_hook(lambda mod, a, s=input_scale: (_fake_quant(a[0], s, scheme),))
    return model


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


@pytest.mark.parametrize("qc, message", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq' is not supported"),
    (_edit("config_groups.group_0.weights.num_bits", 4), "weights are 4-bit int"),
    (_edit("config_groups.group_0.weights.symmetric", False), "weights are asymmetric"),
    (_edit("config_groups.group_0.input_activations", None), "weight-only quantization"),
    (_edit("config_groups.group_0.weights.strategy", "group"), "weight strategy 'group'"),
    (_edit("config_groups.group_0.input_activations.dynamic", False), "activation strategy 'token' with dynamic=False"),
    (_edit("config_groups.group_0.input_activations.type", "float"), "int weights with float activations"),
    (_edit("kv_cache_scheme", {"num_bits": 8, "type": "float"}), "quantized KV cache"),
    (_edit("ignore", ["lm_head", "re:.*down_proj"]), "ignore entry 're:.*down_proj'"),
    (_edit("format", "pack-quantized"), "format 'pack-quantized'"),
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
    reference = dequantized_reference(demo_dirs[arch], ckpt, scheme)
    llm = LLM(ckpt)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for prompt in PROMPTS[:4]:
        ids = llm.tokenizer.encode(prompt)
        out = llm.generate([ids], params)[0]
        tokens, logprobs = hf_greedy(reference, ids, 8)
        assert out.token_ids == tokens
        # kiln's and transformers' attention differ by ~1e-6, which can tip one activation across a
        # rounding boundary of the quantizer (an fp8 step is 1/16 of the value): hence 1e-3, not 1e-4
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(logprobs), atol=1e-3, rtol=0)


def test_merged_projection_takes_the_largest_input_scale(demo_dirs, calibration, tmp_path):
    amax = dict(calibration["llama"])
    amax["model.layers.1.self_attn.k_proj"] *= 3
    amax["model.layers.1.mlp.gate_proj"] /= 2
    llm = LLM(write_compressed(demo_dirs["llama"], tmp_path / "ckpt", "int8", input_amax=amax))
    layer = llm.model.model.layers[1]
    assert layer.self_attn.qkv_proj.input_scale.item() == pytest.approx(amax["model.layers.1.self_attn.k_proj"] / 127)
    assert layer.mlp.gate_up_proj.input_scale.item() == pytest.approx(amax["model.layers.1.mlp.up_proj"] / 127)


def test_compiled_static_fp8_checkpoint_equals_eager(demo_dirs, calibration, tmp_path, kiln_cache):
    ckpt = write_compressed(demo_dirs["llama"], tmp_path / "fp8", "fp8", per_tensor=True,
                            input_amax=calibration["llama"])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)
    eager = LLM(ckpt).generate(PROMPTS, params)
    compiled = LLM(ckpt, compile=True, cache_dir=kiln_cache).generate(PROMPTS, params)
    for c, e in zip(compiled, eager):
        assert c.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


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
