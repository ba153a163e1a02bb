"""Write compressed-tensors W8A8 and W4A16 (pack-quantized) checkpoints from the demo models, the way
llm-compressor lays them out, and the dequantized Hugging Face reference they should match."""

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kiln.kernels.quant import FP8_MAX, INT8_MAX, quantize_weight
from kiln.models.quantization import SCHEMES
from tests.oracle import PROMPTS

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QMAX = {"int8": INT8_MAX, "fp8": FP8_MAX}


def quant_config(scheme: str, per_tensor: bool = False, static: bool = False, group_size: int = 128) -> dict:
    if scheme == "int4":
        return {
            "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 4, "type": "int", "symmetric": True, "dynamic": False, "strategy": "group",
                            "group_size": group_size, "actorder": None, "observer": "minmax"},
                "input_activations": None, "output_activations": None,
            }},
        }
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


def _fake_quant_blocks(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Reference int4 activation quantization in plain torch: int8 per token and block of `block` channels."""
    xb = x.view(*x.shape[:-1], x.shape[-1] // block, block)
    s = (xb.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-10)
    return ((xb / s).round().clamp(-127, 127) * s).view(x.shape)


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


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> compressed-tensors' int32 words [N, K / 8]: eight codes + 8 each,
    the first in the lowest bits (written here without kiln's code)."""
    u = (codes.numpy().astype(np.int64) + 8).astype(np.uint32)
    words = np.zeros((u.shape[0], u.shape[1] // 8), dtype=np.uint32)
    for i in range(8):
        words |= u[:, i::8] << (4 * i)
    return torch.from_numpy(words.view(np.int32))


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    u = words.numpy().view(np.uint32)
    codes = np.stack([(u >> (4 * i)) & 0xF for i in range(8)], axis=-1).reshape(u.shape[0], -1)
    return torch.from_numpy(codes.astype(np.int64) - 8)


def _int4_tensors(base: str, w: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """llm-compressor's W4A16 round-to-nearest: symmetric codes in [-8, 7], scale max|w| / 7.5 per group."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(torch.bfloat16)  # the Hub's exports keep bf16 scales
    codes = (g / scale.float()[..., None]).round().clamp(-8, 7).to(torch.int8).view(n, k)
    return {f"{base}.weight_packed": pack_words(codes), f"{base}.weight_scale": scale,
            f"{base}.weight_shape": torch.tensor([n, k], dtype=torch.int32)}


def write_compressed(src: Path, out: Path, scheme: str, per_tensor: bool = False,
                     input_amax: dict[str, float] | None = None, group_size: int = 128) -> Path:
    """A compressed-tensors copy of the demo checkpoint `src`, laid out the way llm-compressor saves one."""
    shutil.copytree(src, out)
    tensors = {}
    for name, w in load_file(src / "model.safetensors").items():
        if not _is_projection(name):
            tensors[name] = w
            continue
        base = name[: -len(".weight")]
        if scheme == "int4":
            tensors.update(_int4_tensors(base, w, group_size))
            continue
        if per_tensor:
            s = (w.abs().amax() / QMAX[scheme]).reshape(1)
            dtype = SCHEMES[scheme].dtype
            q = (w / s).round().clamp(-127, 127).to(dtype) if scheme == "int8" else (w / s).to(dtype)
            tensors[f"{base}.weight_scale"] = s
        else:
            q, s = quantize_weight(w, SCHEMES[scheme].dtype)
            tensors[f"{base}.weight_scale"] = s.reshape(-1, 1)
        tensors[f"{base}.weight"] = q.contiguous()
        if input_amax is not None:
            tensors[f"{base}.input_scale"] = torch.tensor([input_amax[base] / QMAX[scheme]])
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quant_config(scheme, per_tensor, static=input_amax is not None,
                                                 group_size=group_size)
    (out / "config.json").write_text(json.dumps(config))
    return out


def dequantized_reference(src: Path, ckpt: Path, scheme: str):
    """The Hugging Face model with every projection's weight replaced by its dequantized checkpoint
    weight and its input passed through the checkpoint's activation quantization."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    tensors = load_file(ckpt / "model.safetensors")
    for name, linear in _projections(model):
        if scheme == "int4":  # W4A16 run as W4A8: kiln quantizes the activations to int8 per token and block of 32
            scale = tensors[f"{name}.weight_scale"].float()
            codes = unpack_words(tensors[f"{name}.weight_packed"]).float()
            linear.weight.data = (codes.view(*scale.shape, -1) * scale[..., None]).view(codes.shape)
            linear.register_forward_pre_hook(lambda mod, a: (_fake_quant_blocks(a[0]),))
            continue
        scale = tensors[f"{name}.weight_scale"].reshape(-1, 1)
        linear.weight.data = tensors[f"{name}.weight"].float() * scale
        input_scale = tensors.get(f"{name}.input_scale")
        linear.register_forward_pre_hook(lambda mod, a, s=input_scale: (_fake_quant(a[0], s, scheme),))
    return model
