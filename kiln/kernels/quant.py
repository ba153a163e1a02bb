"""Quantization ops: quantize activations (int8 or fp8), multiply with quantized weights (W8A8, and
W4A8: 4-bit weight codes with a scale per group of input channels).

Scales are symmetric and fp32. Activation scales are per token ([T, 1], "dynamic") or one for the
tensor ([1, 1], "static"); 8-bit weight scales are per output channel ([N]), 4-bit ones per output
channel and group ([N, K / group]). Kept as separate ops so the fusion passes can fold a quantization
into the RMSNorm or SiLU*Mul before it.

4-bit codes are stored two to a byte along K ([N, K / 2] uint8), code + 8 in [0, 15], the even K in
the low nibble: compressed-tensors' `pack-quantized` int32 words read as bytes on a little-endian CPU.
"""

import torch

INT8_MAX = 127.0
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
_MIN_SCALE = 1e-10  # an all-zero token still gets a finite scale
INT_MM_CUDA_MIN_ROWS = 16  # torch._int_mm on CUDA: "self.size(0) needs to be greater than 16"


def _quant_native(x: torch.Tensor, scale: torch.Tensor | None, qmax: float, dtype: torch.dtype):
    x2 = x.reshape(-1, x.shape[-1]).float()
    if scale is None:
        s = (x2.abs().amax(dim=-1, keepdim=True) / qmax).clamp(min=_MIN_SCALE)
    else:
        s = scale.float().reshape(1, 1)
    q = x2 / s
    q = q.round().clamp(-qmax, qmax) if dtype == torch.int8 else q.clamp(-qmax, qmax)
    return q.to(dtype), s.clone()


def _quant_fake(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype):
    rows = x.numel() // x.shape[-1]
    return x.new_empty((rows, x.shape[-1]), dtype=dtype), x.new_empty((1 if scale is not None else rows, 1),
                                                                       dtype=torch.float32)


def quant_native(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x` to int8 or fp8: static per-tensor with `scale`, else per token (the ops' reference)."""
    return _quant_native(x, scale, INT8_MAX if dtype == torch.int8 else FP8_MAX, dtype)


def quant_fake(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _quant_fake(x, scale, dtype)


def _define_quant(name: str, qmax: float, dtype: torch.dtype):
    def native(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return _quant_native(x, scale, qmax, dtype)

    native.__doc__ = f"x [..., K] -> ({dtype} [T, K], fp32 scale): static per-tensor with `scale`, else per token."
    op = torch.library.custom_op(f"kiln::{name}", native, mutates_args=())
    op.register_fake(lambda x, scale=None: _quant_fake(x, scale, dtype))
    return op


quant_int8 = _define_quant("quant_int8", INT8_MAX, torch.int8)
quant_fp8 = _define_quant("quant_fp8", FP8_MAX, torch.float8_e4m3fn)


@torch.library.custom_op("kiln::scaled_mm", mutates_args=())
def scaled_mm(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale[:, None]).T + bias for quantized a [M, K] and weight b [N, K]
    (both int8, or both float8_e4m3fn), accumulated in int32 / fp32."""
    b_row = b_scale.float().reshape(1, -1)
    if a.dtype == torch.int8:
        m = a.shape[0]
        if a.is_cuda and m <= INT_MM_CUDA_MIN_ROWS:  # zero rows up to the least cuBLAS's int8 GEMM takes
            a = torch.cat([a, a.new_zeros(INT_MM_CUDA_MIN_ROWS + 1 - m, a.shape[1])])
        out = torch._int_mm(a, b.t())[:m].float() * a_scale.float() * b_row
    elif not a.is_cuda:  # fp32 on the dequantized values: what torch 2.13's CPU _scaled_mm does for row scales
        out = (a.float() @ b.float().t()) * a_scale.float() * b_row  # (2.11's refuses them)
    elif out_dtype in (torch.bfloat16, torch.float16):  # cuBLAS scales rows in its epilogue, 16-bit outputs only
        a_col = a_scale.float().expand(a.shape[0], 1).contiguous()
        return torch._scaled_mm(a, b.t(), scale_a=a_col, scale_b=b_row, out_dtype=out_dtype,
                                bias=None if bias is None else bias.to(out_dtype))
    else:  # fp32 out: unit per-tensor scales, then the row and column scales
        one = a_scale.new_ones((), dtype=torch.float32)
        out = torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.float32) * a_scale.float() * b_row
    return _biased(out, bias, out_dtype)


def _biased(out: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    return (out if bias is None else out + bias.float()).to(out_dtype)


def _scaled_mm_fake(a, b, a_scale, b_scale, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


scaled_mm.register_fake(_scaled_mm_fake)


def quantize_weight(w: torch.Tensor, dtype: torch.dtype,
                    qmax: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (quantized [N, K], fp32 scale [N]): symmetric, one scale per output channel,
    codes in [-qmax, qmax] (default the dtype's: 127 for int8, 448 for fp8; W7A8 passes 63). The
    numbers of the per-token quant op, in fewer passes over the weight (it runs at load time, on
    every projection): the max-abs as max(amax, -amin), without an |w| copy (vectorized reductions,
    faster on CPU than the inf-norm), the rest a block of rows at a time, so the fp32 temporaries stay
    in the CPU's caches."""
    qmax = qmax or (INT8_MAX if dtype == torch.int8 else FP8_MAX)
    s = (torch.maximum(w.amax(dim=-1), w.amin(dim=-1).neg()).float() / qmax).clamp_(min=_MIN_SCALE)
    out = torch.empty(w.shape, dtype=dtype, device=w.device)
    rows = max(1, (1 << 19) // max(1, w.shape[-1]))  # ~2 MB of fp32 per block
    for i in range(0, w.shape[0], rows):
        q = torch.div(w[i:i + rows].float(), s[i:i + rows, None])
        if dtype == torch.int8:
            q.round_()
        out[i:i + rows] = q.clamp_(-qmax, qmax)
    return out, s


INT4_MAX = 7.0
"""The largest 4-bit weight code kiln quantizes to: symmetric codes in [-7, 7] (stored codes take -8 too)."""
INT4_GROUPS = (128, 64, 32)
"""Group sizes `quantize_weight_int4` picks from, the largest that divides a row: 128 is what GPTQ/AWQ-style
compressed-tensors exports use."""


def int4_group_size(k: int) -> int | None:
    """The group size a row of `k` input channels is quantized with, or None if none divides it."""
    return next((g for g in INT4_GROUPS if k % g == 0), None)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] in [-8, 7] -> [N, K / 2] uint8, code + 8, even K in the low nibble."""
    u = (codes.to(torch.int16) + 8).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The int8 codes [N, K] `pack_nibbles` was given."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], -1).to(torch.int8) - 8


def quantize_weight_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (4-bit codes [N, K / 2] uint8 as `pack_nibbles` stores them, fp32 scales
    [N, K / group]): symmetric, codes in [-7, 7], one scale per output channel and group of `group`
    input channels (round to nearest), a block of rows at a time like `quantize_weight`."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} input channels are not a multiple of the group size {group}")
    out = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((n, k // group), dtype=torch.float32, device=w.device)
    rows = max(1, (1 << 19) // max(1, k))
    for i in range(0, n, rows):
        g = w[i:i + rows].float().reshape(-1, k // group, group)
        s = (torch.maximum(g.amax(dim=-1), g.amin(dim=-1).neg()) / INT4_MAX).clamp_(min=_MIN_SCALE)
        q = torch.div(g, s[..., None]).round_().clamp_(-INT4_MAX, INT4_MAX)
        out[i:i + rows] = pack_nibbles(q.reshape(-1, k).to(torch.int8))
        scales[i:i + rows] = s
    return out, scales


def dequantize_int4(weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that 4-bit codes and their group scales stand for."""
    codes = unpack_nibbles(weight).float()
    n, groups = scales.shape
    return (codes.view(n, groups, -1) * scales.float()[..., None]).view(n, -1)


@torch.library.custom_op("kiln::int4_scaled_mm", mutates_args=())
def int4_scaled_mm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A8: (a * a_scale) @ W.T + bias for int8 a [M, K] and 4-bit weight codes b [N, K / 2]
    (`pack_nibbles`) with group scales b_scale [N, groups]: each group's products summed exactly in
    int32, times the group's scale, summed over the groups. The eager path: the stored codes + 8 go to
    torch's int8 GEMM as they are (0..15 are int8 values), each group's sum losing 8 x its activation
    sum, so no fp32 copy of the weight is made."""
    n, groups = b_scale.shape
    shifted = torch.stack((b & 0x0F, b >> 4), dim=-1).view(n, -1).view(torch.int8)  # codes + 8
    size = shifted.shape[1] // groups
    out = a.new_zeros((a.shape[0], n), dtype=torch.float32)
    for g in range(groups):
        part = slice(g * size, (g + 1) * size)
        rows = a[:, part].contiguous()
        sums = torch._int_mm(rows, shifted[:, part].t()) - 8 * rows.sum(-1, keepdim=True, dtype=torch.int32)
        out += sums.float() * b_scale[:, g].float()
    return _biased(out * a_scale.float(), bias, out_dtype)


int4_scaled_mm.register_fake(_scaled_mm_fake)
