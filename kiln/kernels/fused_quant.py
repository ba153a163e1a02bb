"""Fused ops the fusion passes create: a norm or activation and the quantization of its output.

One op instead of two means one pass over the activations and no full-precision intermediate in
memory. `quant_dtype` is torch.int8 or torch.float8_e4m3fn; `scale` is the static per-tensor
activation scale, or None for per-token scales, exactly as in `kiln::quant_int8/quant_fp8`.
The native impls are the unfused sequences (the reference); the CUDA issue adds Triton kernels.
"""

import torch

from kiln.kernels.activation import silu_and_mul_native
from kiln.kernels.norm import fused_add_rms_norm_native, rms_norm_native
from kiln.kernels.quant import quant_fake, quant_native


def rms_norm_quant_native(x, weight, eps, quant_dtype, scale=None):
    return quant_native(rms_norm_native(x, weight, eps), scale, quant_dtype)


def fused_add_rms_norm_quant_native(x, residual, weight, eps, quant_dtype, scale=None):
    normed, new_residual = fused_add_rms_norm_native(x, residual, weight, eps)
    return (*quant_native(normed, scale, quant_dtype), new_residual)


def silu_and_mul_quant_native(x, quant_dtype, scale=None):
    return quant_native(silu_and_mul_native(x), scale, quant_dtype)


@torch.library.custom_op("kiln::rms_norm_quant", mutates_args=())
def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant(rms_norm(x)) -> (quantized [T, K], fp32 scale)."""
    return rms_norm_quant_native(x, weight, eps, quant_dtype, scale)


@rms_norm_quant.register_fake
def _(x, weight, eps, quant_dtype, scale=None):
    return quant_fake(x, scale, quant_dtype)


@torch.library.custom_op("kiln::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quant_dtype: torch.dtype,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return quant(rms_norm(residual)), residual` -> (q, scale, residual)."""
    return fused_add_rms_norm_quant_native(x, residual, weight, eps, quant_dtype, scale)


@fused_add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, quant_dtype, scale=None):
    return (*quant_fake(x, scale, quant_dtype), torch.empty_like(x))


@torch.library.custom_op("kiln::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(
    x: torch.Tensor, quant_dtype: torch.dtype, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """quant(silu(x[..., :d]) * x[..., d:]) -> (quantized [T, d], fp32 scale)."""
    return silu_and_mul_quant_native(x, quant_dtype, scale)


@silu_and_mul_quant.register_fake
def _(x, quant_dtype, scale=None):
    return quant_fake(x.new_empty((*x.shape[:-1], x.shape[-1] // 2)), scale, quant_dtype)
