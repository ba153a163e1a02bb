"""The artifact cache key: a hash of everything that changes compiled code, and nothing else.

Weights are not in it (one artifact serves every checkpoint of the same shapes); the manifest keeps
the factors themselves so two keys can be explained.
"""

import dataclasses
import hashlib
import json
import platform
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import torch

import kiln
from kiln.config import CompileConfig, dtype_name
from kiln.models.config import ModelConfig
from kiln.models.llama import CausalLM
from kiln.passes import GraphPass, PassManager

# The parts of kiln whose source shapes the traced graph or its compilation.
SOURCE_PARTS = ("kernels", "models", "compiler", "passes", "config.py")
# Their files that do: Python, and the C++ of kiln's kernels (kernels/csrc), which compiles into the pieces.
SOURCE_SUFFIXES = (".py", ".cpp", ".h")
# ModelConfig fields that do not reach the graph.
NOT_IN_GRAPH = ("eos_token_ids", "dtype")  # the checkpoint dtype; the one run in is a factor of its own


@cache
def kiln_source_hash() -> str:
    """sha256 over the kiln sources that shape compiled code (editing a pass or a kernel, its C++ too, rekeys)."""
    root = Path(kiln.__file__).parent
    h = hashlib.sha256()
    for part in SOURCE_PARTS:
        path = root / part
        if path.is_dir():
            files = sorted(f for f in path.rglob("*") if f.suffix in SOURCE_SUFFIXES)
        else:
            files = [path] if path.is_file() else []
        for f in files:
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


CPU_EXTENSIONS = ("avx512_vnni", "amx_tile")
"""x86 features beyond torch's CPU capability that Inductor compiles a CPU's kernels for where it has
them (its avx512_vnni and amx ISAs), as kiln's int8 panel GEMM does: an artifact needs them where it loads."""


def system_info(device: str = "cpu") -> dict:
    """What the compiled kernels were built for; read without a compiler (torch's own CPU probe)."""
    info = {"device": device, "machine": platform.machine(), "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cpu" and hasattr(torch.cpu, "get_capabilities"):
        found = torch.cpu.get_capabilities()
        info["cpu_extensions"] = [name for name in CPU_EXTENSIONS if found.get(name)]
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(device))
        info["gpu_arch"] = f"sm_{major}{minor}"
    return info


def key_factors(
    model_config: ModelConfig,
    dtype: torch.dtype,
    compile_config: CompileConfig,
    quantization: str | None = None,
    pass_uuids: dict[str, str] | None = None,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    lm_head_quantization: str | None = None,
    kv_cache_dtype: torch.dtype | None = None,
) -> dict:
    model = {k: v for k, v in dataclasses.asdict(model_config).items() if k not in NOT_IN_GRAPH}
    factors = {
        "model": model,
        "dtype": dtype_name(dtype),
        "quantization": quantization,
        "lm_head_quantization": lm_head_quantization,  # the head's kernel ships as a library for it
        "kv_cache_dtype": dtype_name(kv_cache_dtype) if kv_cache_dtype is not None else "auto",  # the write quantizes
        "compile": dataclasses.asdict(compile_config),
        "passes": dict(pass_uuids or {}),
        "tensor_parallel_size": tensor_parallel_size,  # every rank runs the same graph: the rank is no factor
        "kiln_source": kiln_source_hash(),
        "torch": torch.__version__,
        "python": python_version(),
        "system": system_info(device),
    }
    return json.loads(json.dumps(factors))  # as the manifest holds them: tuples read back as lists


def cache_key(factors: dict) -> str:
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]


def model_factors(model: CausalLM, compile_config: CompileConfig, passes: Sequence[GraphPass] = ()) -> dict:
    """The key factors of a built (and possibly quantized) model compiled with kiln's passes and the
    user's `passes`: what `LLM` looks up and the compiler writes under."""
    uuids = PassManager(compile_config.passes, passes).uuids()
    device = next(model.parameters()).device.type  # "cuda", not "cuda:1": the GPU's kind is in system_info
    return key_factors(model.config, model.dtype, compile_config, getattr(model, "quantization", None), uuids,
                       device=device, tensor_parallel_size=model.layout.world_size,
                       lm_head_quantization=getattr(model, "lm_head_quantization", None),
                       kv_cache_dtype=getattr(model, "kv_cache_dtype", None))
