"""kiln's norm and activation ops again, as `torch.library.triton_op`s (namespace `kiln_triton`,
same schemas): Inductor sees through a triton_op to its Triton kernels, so where the lowering pass
picks one (`kiln.passes.kernel_choice`) AOTInductor compiles the kernel into the piece's library and
a serving process launches it without Triton compiling anything. A plain custom op's CUDA kernel
would instead be called back through Python and compiled by Triton on first use."""

import torch
from torch.library import triton_op

from kiln.kernels.triton.activation import silu_and_mul_triton
from kiln.kernels.triton.norm import fused_add_rms_norm_triton, rms_norm_triton

Tensor = torch.Tensor


@triton_op("kiln_triton::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return rms_norm_triton(x, weight, eps)


@triton_op("kiln_triton::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return fused_add_rms_norm_triton(x, residual, weight, eps)


@triton_op("kiln_triton::rms_norm_quant", mutates_args=())
def rms_norm_quant(x: Tensor, weight: Tensor, eps: float, quant_dtype: torch.dtype,
                   scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return rms_norm_triton(x, weight, eps, quant_dtype, scale)


@triton_op("kiln_triton::fused_add_rms_norm_quant", mutates_args=())
def fused_add_rms_norm_quant(x: Tensor, residual: Tensor, weight: Tensor, eps: float, quant_dtype: torch.dtype,
                             scale: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return fused_add_rms_norm_triton(x, residual, weight, eps, quant_dtype, scale)


@triton_op("kiln_triton::silu_and_mul", mutates_args=())
def silu_and_mul(x: Tensor) -> Tensor:
    return silu_and_mul_triton(x)


@triton_op("kiln_triton::silu_and_mul_quant", mutates_args=())
def silu_and_mul_quant(x: Tensor, quant_dtype: torch.dtype, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    return silu_and_mul_triton(x, quant_dtype, scale)


OPS = ("rms_norm", "fused_add_rms_norm", "rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul",
       "silu_and_mul_quant")
"""The kiln ops with a triton_op twin here, by name in both namespaces."""
