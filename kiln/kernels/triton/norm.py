"""RMSNorm and residual-add + RMSNorm, optionally quantizing the output, one program per token.

Rounding follows the native ops (`kiln.kernels.norm`): the residual sum is rounded to the input
dtype, normalized in fp32, rounded again, then scaled by the weight in the input dtype.
"""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.kernels.triton.quant import quant_args, store_quantized
from kiln.kernels.triton.row_launch import row_warps


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, q_ptr, scale_ptr, scale_out_ptr,
                     n_cols, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
                     MODE: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = (w * normed).to(x_ptr.dtype.element_ty)
    if MODE == 0:
        tl.store(out_ptr + row * n_cols + cols, y, mask=mask)
    else:
        store_quantized(y.to(tl.float32), cols, mask, row, n_cols, q_ptr, scale_ptr, scale_out_ptr,
                        MODE, IS_INT8, QMAX, MIN_SCALE)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            quant_dtype: torch.dtype | None, scale: torch.Tensor | None):
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    rows = x2.shape[0]
    res2 = residual.reshape(-1, n_cols).contiguous() if residual is not None else x2
    out = torch.empty_like(x2) if quant_dtype is None else torch.empty(0, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(x2) if residual is not None else out
    meta, (q, scale_in, scale_out) = quant_args(rows, n_cols, quant_dtype, scale, x.device)
    block = triton.next_power_of_2(n_cols)
    if rows:
        wrap_triton(_rms_norm_kernel)[(rows,)](
            x2, res2, weight, out, res_out, q, scale_in, scale_out, n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=row_warps(block), **meta)
    res_out = res_out.view(x.shape) if residual is not None else None
    if quant_dtype is None:
        return out.view(x.shape), res_out
    return q, scale_out, res_out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype | None = None,
                    scale: torch.Tensor | None = None):
    """`rms_norm(x)`, or with `quant_dtype` `quant(rms_norm(x))` -> (q, scale)."""
    result = _launch(x, None, weight, eps, quant_dtype, scale)
    return result[0] if quant_dtype is None else result[:2]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              quant_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None):
    """(rms_norm(x + residual), x + residual), or with `quant_dtype` (q, scale, x + residual)."""
    return _launch(x, residual, weight, eps, quant_dtype, scale)
