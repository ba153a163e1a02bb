"""`--quantization` on a full-precision checkpoint quantizes each projection as the loader reads it: the
same codes and scales as quantizing the loaded model, without ever holding all projections in full
precision (what lets an 8B-class bf16 checkpoint start int8 on a 24 GB machine)."""

import json
import subprocess
import sys

import pytest
import torch

from kiln.models.config import ModelConfig
from kiln.models.demo import write_demo_model
from kiln.models.quantization import quantize_model
from kiln.models.registry import create_model
from kiln.weights.loader import load_weights


@pytest.mark.parametrize("scheme", ["int8", "w7a8", "fp8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_same_weights_as_quantizing_after_loading(demo_dirs, scheme, dtype):
    _check_streamed_equals_after(demo_dirs["qwen2"], scheme, dtype)  # biased q/k/v


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "int4"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_experts_are_quantized_expert_by_expert_as_they_load(moe_dirs, arch, scheme):
    """Each expert's checkpoint tensors land in their rows of the stacked experts, quantized there: the
    codes, scales (and int4's minimums) of quantizing the loaded stack."""
    got = _check_streamed_equals_after(moe_dirs[arch], scheme, torch.bfloat16)
    ffn = "mlp" if arch == "qwen3_moe" else "block_sparse_moe"
    codes = got[f"model.layers.1.{ffn}.experts.down_proj.weight"]
    assert codes.dtype == (torch.uint8 if scheme == "int4" else torch.int8)


def _check_streamed_equals_after(model_dir, scheme: str, dtype: torch.dtype) -> dict:
    cfg = ModelConfig.from_model_dir(model_dir)
    streamed = create_model(cfg, dtype, quantize=scheme)
    load_weights(streamed, model_dir)
    after = create_model(cfg, dtype)
    load_weights(after, model_dir)
    quantize_model(after, scheme)
    got, want = dict(streamed.named_parameters()), dict(after.named_parameters())
    assert got.keys() == want.keys() and streamed.quantization == after.quantization == scheme
    for name, p in want.items():  # bit for bit (fp8 compared as bytes)
        bits = (lambda t: t.view(torch.uint8)) if p.element_size() == 1 else (lambda t: t)
        assert got[name].dtype == p.dtype and torch.equal(bits(got[name]), bits(p)), name
    return got


PEAK = """
import json, sys, torch
from kiln.models.config import ModelConfig
from kiln.models.quantization import quantize_model
from kiln.models.registry import create_model
from kiln.weights.loader import load_weights
model_dir, streamed = sys.argv[1], sys.argv[2] == "1"
cfg = ModelConfig.from_model_dir(model_dir)
def status(key):  # kB
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from here
before = status("VmRSS:")
model = create_model(cfg, torch.float32, quantize="int8" if streamed else None)
load_weights(model, model_dir)
quantize_model(model, "int8")
print(json.dumps((status("VmHWM:") - before) * 1024))
"""


def test_loading_int8_never_holds_the_full_precision_projections(tmp_path):
    """Peak memory of the load, in fresh processes: quantizing as it reads stays far below loading the
    fp32 model and quantizing it (which holds the fp32 projections and their int8 codes at once)."""
    model_dir = write_demo_model(tmp_path / "m", arch="llama", num_layers=8, hidden_size=1024, train_steps=0)
    cfg = ModelConfig.from_model_dir(model_dir)
    per_layer = cfg.hidden_size * (2 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim
                                   + 3 * cfg.intermediate_size)
    fp32_projections = 4 * cfg.num_layers * per_layer

    def peak(streamed: bool) -> int:
        out = subprocess.run([sys.executable, "-c", PEAK, str(model_dir), "1" if streamed else "0"],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout)

    streamed, loaded_first = peak(True), peak(False)
    assert streamed < loaded_first - fp32_projections / 2, (streamed, loaded_first, fp32_projections)
    assert streamed < fp32_projections / 2  # the int8 codes (a quarter) and one tensor in flight


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mixtral"])
def test_the_memory_check_counts_the_quantized_bytes(demo_dirs, moe_dirs, arch, scheme):
    """What `LLM` checks against the memory available before loading: the bytes the model then holds
    (Mixtral's experts named w1, w2, w3)."""
    from kiln.weights.model_weights import ModelWeights

    model_dir = {**demo_dirs, **moe_dirs}[arch]
    cfg = ModelConfig.from_model_dir(model_dir)
    for dtype in (torch.float32, torch.bfloat16):
        model = create_model(cfg, dtype, quantize=scheme)
        load_weights(model, model_dir)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        weights = ModelWeights(model_dir)
        assert weights.bytes_in(dtype, quantize=scheme) == held < weights.bytes_in(dtype)
