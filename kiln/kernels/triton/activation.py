"""silu(gate) * up over the MLP's concatenated [gate | up], optionally quantizing the output, one
program per token. Rounding follows `silu_and_mul_native`: silu in fp32 rounded to the input dtype,
then the product in the input dtype."""

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from kiln.kernels.triton.quant import quant_args, store_quantized
from kiln.kernels.triton.row_launch import row_warps


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, q_ptr, scale_ptr, scale_out_ptr, d, BLOCK: tl.constexpr,
                         MODE: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)
    y = (silu.to(tl.float32) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
    if MODE == 0:
        tl.store(out_ptr + row * d + cols, y, mask=mask)
    else:
        store_quantized(y.to(tl.float32), cols, mask, row, d, q_ptr, scale_ptr, scale_out_ptr,
                        MODE, IS_INT8, QMAX, MIN_SCALE)


def silu_and_mul_triton(x: torch.Tensor, quant_dtype: torch.dtype | None = None, scale: torch.Tensor | None = None):
    """`silu_and_mul(x)`, or with `quant_dtype` `quant(silu_and_mul(x))` -> (q, scale)."""
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d).contiguous()
    rows = x2.shape[0]
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device) if quant_dtype is None else x2.new_empty(0)
    meta, (q, scale_in, scale_out) = quant_args(rows, d, quant_dtype, scale, x.device)
    block = triton.next_power_of_2(d)
    if rows:
        wrap_triton(_silu_and_mul_kernel)[(rows,)](x2, out, q, scale_in, scale_out, d,
                                                   BLOCK=block, num_warps=row_warps(block), **meta)
    if quant_dtype is None:
        return out.view(*x.shape[:-1], d)
    return q, scale_out
