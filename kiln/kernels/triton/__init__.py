"""Triton kernels for kiln ops: the ops' implementations for CUDA tensors.

Importing this package needs triton; `kiln.kernels` imports it (and `register`s the kernels) only
where CUDA is available, so a CPU process never pays for triton. Tests run the kernels on CPU
tensors under `TRITON_INTERPRET=1`, set before this package is first imported (triton chooses the
interpreter when it decorates a kernel).
"""

import torch

from kiln.kernels.triton import ops  # noqa: F401  (defines torch.ops.kiln_triton, which a library may call)
from kiln.kernels.triton.activation import silu_and_mul_triton
from kiln.kernels.triton.attention import attention_quant_triton, attention_triton
from kiln.kernels.triton.kv_cache import kv_cache_write_triton
from kiln.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton
from kiln.kernels.triton.rope_kv_cache import rotary_embedding_kv_cache_write_triton

__all__ = ["attention_quant_triton", "attention_triton", "fused_add_rms_norm_triton", "kv_cache_write_triton",
           "register", "rms_norm_triton", "rotary_embedding_kv_cache_write_triton", "silu_and_mul_triton"]


def register() -> None:
    """Make the Triton kernels the CUDA implementations of the kiln ops they cover."""
    impls = {
        "kiln::rms_norm": rms_norm_triton,
        "kiln::fused_add_rms_norm": fused_add_rms_norm_triton,
        "kiln::rms_norm_quant": rms_norm_triton,
        "kiln::fused_add_rms_norm_quant": fused_add_rms_norm_triton,
        "kiln::silu_and_mul": silu_and_mul_triton,
        "kiln::silu_and_mul_quant": silu_and_mul_triton,
        "kiln::kv_cache_write": kv_cache_write_triton,
        "kiln::rotary_embedding_kv_cache_write": rotary_embedding_kv_cache_write_triton,
        "kiln::attention": attention_triton,
        "kiln::attention_quant": attention_quant_triton,
    }
    for op, fn in impls.items():
        torch.library.register_kernel(op, "cuda", fn)
