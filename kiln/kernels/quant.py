"""Quantization ops: quantize activations (int8 or fp8), multiply with quantized weights (W8A8, and
W4A8: 4-bit weight codes with a scale and a minimum per group of input channels).

8-bit scales are symmetric and fp32. Activation scales are per token ([T, 1], "dynamic") or one for the
tensor ([1, 1], "static"), or for W4A8 and CPU int8 (`int8_block_mm`) per token and block of 32 input
channels ([T, K / 32]); 8-bit
weight scales are per output channel ([N]). 4-bit weights are asymmetric: a code 0..15 stands for
scale x code + minimum, a scale and a minimum (fp16) per output channel and group ([N, K / group]). Kept
as separate ops so the fusion passes can fold a quantization into the RMSNorm or SiLU*Mul before it.

4-bit codes are stored two to a byte along K ([N, K / 2] uint8), the even K in the low nibble:
compressed-tensors' `pack-quantized` int32 words read as bytes on a little-endian CPU (their symmetric
codes c stored as c + 8 are codes 0..15 with the minimum -8 x scale).
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


def int_products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [N, K].T for int8 codes, summed exactly, as fp32 (`torch._int_mm`'s numbers). On a CPU in
    fp64, whose sums of int8 products are exact for any K: torch 2.13's CPU `_int_mm` is 10-15x slower than its
    fp64 GEMM at these shapes."""
    if not a.is_cuda:
        return (a.double() @ b.double().t()).float()
    m = a.shape[0]
    if m <= INT_MM_CUDA_MIN_ROWS:  # zero rows up to the least cuBLAS's int8 GEMM takes
        a = torch.cat([a, a.new_zeros(INT_MM_CUDA_MIN_ROWS + 1 - m, a.shape[1])])
    return torch._int_mm(a, b.t())[:m].float()


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
        out = int_products(a, b) * a_scale.float() * b_row
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


ACT_BLOCK = 32
"""Input channels an activation scale of int8 and int4 projections covers on CPU (`quant_int8_blocked`), and
int4's smallest weight group: as llama.cpp's Q8_0 dot products, a scale per 32 activations loses a third of what
one per token loses (docs/models.md)."""
INT4_GROUP = 32
"""The group `quantize_weight_int4` is given by `--quantization int4`: a scale and a minimum per 32 weights."""
INT4_LEVELS = 15.0
"""The largest 4-bit code: codes 0..15 stand for scale x code + minimum."""


def _quant_blocked_native(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = x.reshape(-1, x.shape[-1]).float()
    rows, k = x2.shape
    xb = x2.view(rows, k // block, block)
    s = (xb.abs().amax(dim=-1) / INT8_MAX).clamp(min=_MIN_SCALE)
    q = torch.div(xb, s[..., None]).round().clamp(-INT8_MAX, INT8_MAX)
    return q.view(rows, k).to(torch.int8), s


@torch.library.custom_op("kiln::quant_int8_blocked", mutates_args=())
def quant_int8_blocked(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 [T, K], fp32 scales [T, K / block]): symmetric, a scale per token and block of
    `block` input channels (K a multiple of it)."""
    return _quant_blocked_native(x, block)


@quant_int8_blocked.register_fake
def _(x, block):
    rows = x.numel() // x.shape[-1]
    return (x.new_empty((rows, x.shape[-1]), dtype=torch.int8),
            x.new_empty((rows, x.shape[-1] // block), dtype=torch.float32))


def quant_int8_blocked_native(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`kiln::quant_int8_blocked`'s aten form, which Inductor fuses into the loop before it."""
    return _quant_blocked_native(x, block)


def dequantize_blocked(a: torch.Tensor, a_scale: torch.Tensor) -> torch.Tensor:
    """The fp32 activations [M, K] that int8 codes `a` with a scale per row and block of ACT_BLOCK stand for."""
    m, k = a.shape
    return (a.float().view(m, k // ACT_BLOCK, ACT_BLOCK) * a_scale.float()[..., None]).view(m, k)


@torch.library.custom_op("kiln::int8_block_mm", mutates_args=())
def int8_block_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 with activation blocks: (a * a_scale) @ (b * b_scale[:, None]).T + bias for int8 a [M, K] with a
    scale per row and block of ACT_BLOCK (a_scale [M, K / ACT_BLOCK]) and int8 weight codes b [N, K] with a
    scale per output channel, or with b_scale [N, K / ACT_BLOCK] one per output channel and block (llama.cpp's
    Q8_0). The eager path: the activations dequantized to fp32 and the weight widened for torch's float GEMM,
    a block of output channels at a time (products of int8 codes are exact in fp32; the kernel sums each
    block's in integers, fp32 in another order)."""
    m, k = a.shape
    x = dequantize_blocked(a, a_scale)
    out = a.new_empty((m, b.shape[0]), dtype=torch.float32)
    grouped = b_scale.dim() == 2
    rows = max(1, (1 << 20) // k)  # ~4 MB of fp32 weight at a time
    for i in range(0, b.shape[0], rows):
        w = b[i:i + rows].float()
        if grouped:
            w = (w.view(w.shape[0], -1, ACT_BLOCK) * b_scale[i:i + rows].float()[..., None]).view(w.shape[0], k)
        torch.mm(x, w.t(), out=out[:, i:i + rows])
    return _biased(out if grouped else out * b_scale.float().reshape(1, -1), bias, out_dtype)


@int8_block_mm.register_fake
def _(a, a_scale, b, b_scale, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 -> [N, K / 2] uint8, the even K in the low nibble."""
    u = codes.to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] (uint8, 0..15) `pack_nibbles` was given."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def quantize_weight_int4(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (4-bit codes [N, K / 2] uint8 as `pack_nibbles` stores them, scales and minimums
    [N, K / group] fp16): asymmetric, each group of `group` input channels of a row spans its own min..max in
    16 levels (w ~ scale x code + min, round to nearest), as llama.cpp's Q4_1. The scale and minimum are
    rounded to fp16 before the codes are chosen, so the codes fit the values stored. A block of rows at a
    time like `quantize_weight`."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} input channels are not a multiple of the group size {group}")
    out = torch.empty((n, k // 2), dtype=torch.uint8, device=w.device)
    scales = torch.empty((n, k // group), dtype=torch.float16, device=w.device)
    mins = torch.empty((n, k // group), dtype=torch.float16, device=w.device)
    rows = max(1, (1 << 19) // max(1, k))
    for i in range(0, n, rows):
        g = w[i:i + rows].float().reshape(-1, k // group, group)
        low = g.amin(dim=-1).half()
        s = ((g.amax(dim=-1) - low.float()) / INT4_LEVELS).clamp_(min=_MIN_SCALE).half()
        q = torch.div(g - low.float()[..., None], s.float()[..., None]).round_().clamp_(0, INT4_LEVELS)
        out[i:i + rows] = pack_nibbles(q.reshape(-1, k))
        scales[i:i + rows], mins[i:i + rows] = s, low
    return out, scales, mins


def quantize_weight_grouped(w: torch.Tensor, group: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (int8 codes [N, K], fp16 scales [N, K / group]): symmetric, each group of `group` input
    channels of a row its own scale max|w| / 127, rounded to fp16 before the codes are chosen (llama.cpp's Q8_0).
    A block of rows at a time like `quantize_weight`."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"{k} input channels are not a multiple of the group size {group}")
    out = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scales = torch.empty((n, k // group), dtype=torch.float16, device=w.device)
    rows = max(1, (1 << 19) // max(1, k))
    for i in range(0, n, rows):
        g = w[i:i + rows].float().reshape(-1, k // group, group)
        s = (torch.maximum(g.amax(dim=-1), g.amin(dim=-1).neg()) / INT8_MAX).half().clamp_(min=2 ** -24)
        out[i:i + rows] = torch.div(g, s.float()[..., None]).round_().clamp_(-INT8_MAX, INT8_MAX).reshape(-1, k)
        scales[i:i + rows] = s
    return out, scales


def dequantize_int4(weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that 4-bit codes and their group scales and minimums stand for."""
    codes = unpack_nibbles(weight).float()
    n, groups = scales.shape
    return (codes.view(n, groups, -1) * scales.float()[..., None] + mins.float()[..., None]).view(n, -1)


@torch.library.custom_op("kiln::int4_block_mm", mutates_args=())
def int4_block_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                  b_min: torch.Tensor, out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W4A8: (a * a_scale) @ W.T + bias for int8 a [M, K] with a scale per row and block of ACT_BLOCK
    (a_scale [M, K / ACT_BLOCK]) and W [N, K] held as 4-bit codes b [N, K / 2] (`pack_nibbles`) standing for
    b_scale x code + b_min, per output channel and group ([N, groups], groups of a multiple of ACT_BLOCK).
    The eager path: both operands dequantized to fp32 for torch's float GEMM, a block of output channels at
    a time (the kernel sums each block's integer products exactly; fp32 sums them in another order)."""
    n, groups = b_scale.shape
    m, k = a.shape
    x = dequantize_blocked(a, a_scale)
    out = a.new_empty((m, n), dtype=torch.float32)
    rows = max(1, (1 << 20) // k)  # ~4 MB of fp32 weight at a time
    for i in range(0, n, rows):
        w = dequantize_int4(b[i:i + rows], b_scale[i:i + rows], b_min[i:i + rows])
        torch.mm(x, w.t(), out=out[:, i:i + rows])
    return _biased(out, bias, out_dtype)


@int4_block_mm.register_fake
def _(a, a_scale, b, b_scale, b_min, out_dtype, bias=None):
    return a.new_empty((a.shape[0], b.shape[0]), dtype=out_dtype)

