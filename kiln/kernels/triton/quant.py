"""The quantizing epilogue the norm and activation kernels share: one row of fp32 values to int8 or
fp8, with the static scale given or a per-row (per-token) scale computed from the row itself,
exactly as `kiln.kernels.quant.quant_native` does."""

import torch
import triton
import triton.language as tl

from kiln.kernels.quant import _MIN_SCALE, FP8_MAX, INT8_MAX

NO_QUANT, STATIC, PER_TOKEN = 0, 1, 2


@triton.jit
def store_quantized(y, cols, mask, row, n_cols, q_ptr, scale_ptr, scale_out_ptr,
                    MODE: tl.constexpr, IS_INT8: tl.constexpr, QMAX: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Quantize `y` (fp32, one row) into q_ptr's row; per token, also write the row's scale."""
    if MODE == 1:
        s = tl.load(scale_ptr).to(tl.float32)
    else:
        s = tl.maximum(tl.max(tl.where(mask, tl.abs(y), 0.0), axis=0) / QMAX, MIN_SCALE)
        tl.store(scale_out_ptr + row, s)
    q = y / s
    if IS_INT8:
        q = tl.where(q >= 0, tl.floor(q + 0.5), tl.ceil(q - 0.5))  # round half away; ties are measure-zero
    q = tl.minimum(tl.maximum(q, -QMAX), QMAX)
    tl.store(q_ptr + row * n_cols + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def quant_args(rows: int, n_cols: int, quant_dtype: torch.dtype | None, scale: torch.Tensor | None,
               device: torch.device) -> tuple[dict, tuple]:
    """The launch arguments of the epilogue and the (q, scale) it will fill (empty when not quantizing)."""
    if quant_dtype is None:
        q, s = torch.empty(0, device=device), torch.empty(0, device=device)
        return dict(MODE=NO_QUANT, IS_INT8=False, QMAX=1.0, MIN_SCALE=_MIN_SCALE), (q, s, s)
    q = torch.empty(rows, n_cols, dtype=quant_dtype, device=device)
    qmax = INT8_MAX if quant_dtype == torch.int8 else float(FP8_MAX)
    if scale is not None:
        s = scale.float().reshape(1, 1).clone()
        mode = STATIC
    else:
        s = torch.empty(rows, 1, dtype=torch.float32, device=device)
        mode = PER_TOKEN
    return dict(MODE=mode, IS_INT8=quant_dtype == torch.int8, QMAX=qmax, MIN_SCALE=_MIN_SCALE), (q, s, s)
