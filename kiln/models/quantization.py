"""Quantized linear layers: online quantization of a loaded model, or the empty layers a pre-quantized
checkpoint loads into.

`quantize_model` swaps every decoder projection (qkv, o, gate_up, down) for a `QuantLinear` holding
the weight in int8 or fp8 with one scale per output channel (activations quantized at run time: int8's
per token and block of 32 on a CPU, else per token), or for "int4" an `Int4Linear` holding 4-bit codes
with a scale and a minimum per output channel and group of 32 input channels (W4A8: activations
quantized per token and block of 32). "q8_0" is int8 with an fp16 weight scale per output channel and
group of 32 input channels (llama.cpp's Q8_0; activations per token and block of 32, on the CPU only).
"w7a8" is int8 with weight codes in [-63, 63] and per-token
activations: on x86 CPUs without VNNI, fbgemm's int8 GEMM is exact on those without splitting the
activations (`kiln.kernels.packed_linear`). `quantized_layout` gives a model the same layers, empty,
for a compressed-tensors checkpoint; with static activations each layer also holds one calibrated
`input_scale`. Embeddings, norms and the LM head stay in the model dtype.
"""

import logging
from dataclasses import dataclass

import torch
from torch import nn

from kiln.config import NO_QUANTIZATION
from kiln.errors import KilnError
from kiln.kernels import packed_linear, quantize_weight
from kiln.kernels.quant import ACT_BLOCK, INT4_GROUP, quantize_weight_grouped, quantize_weight_int4

logger = logging.getLogger(__name__)

ops = torch.ops.kiln


@dataclass(frozen=True)
class Scheme:
    """How a scheme stores weights: their dtype and largest code (None: the dtype's own)."""

    dtype: torch.dtype
    weight_max: float | None = None


SCHEMES = {"int8": Scheme(torch.int8), "w7a8": Scheme(torch.int8, float(packed_linear.W7A8_MAX)),
           "fp8": Scheme(torch.float8_e4m3fn), "int4": Scheme(torch.uint8), "q8_0": Scheme(torch.int8)}
CPU_ONLY = ("int4", "q8_0")
"""Schemes whose activations take a scale per block of 32, which only the CPU's kernels run."""
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def stored_or(asked: str | None, weights) -> str | None:
    """The scheme to run: `asked`, or where none was, the one the checkpoint holds its projections in as stored
    (`ModelWeights.stored_quantization`); "none" is full precision either way."""
    if asked == NO_QUANTIZATION:
        return None
    if asked is None and (stored := weights.stored_quantization()):
        scheme, how = stored
        logger.info("%s holds its projections quantized: they run as kiln's %s, %s (--quantization to choose, none "
                    "for full precision)", weights.name, scheme, how)
        return scheme
    return asked


def check_scheme(name: str | None) -> str | None:
    if name is not None and name not in SCHEMES:
        raise KilnError(f"unknown quantization {name!r}; choose from {', '.join(SCHEMES)}")
    return name


class QuantLinear(nn.Module):
    """y = quant(x) @ W_q.T * scales + bias, in the dtype of x. `weight` [N, K] is int8 or fp8,
    `weight_scale` [N] fp32, or for q8_0 [N, K / 32] fp16 (a scale per group of 32 input channels); `input_scale` (static per-tensor activations) is None for dynamic ones, which
    are quantized per token, or on a CPU per token and block of `act_block` input channels where that is set
    (int8: what llama.cpp's Q8_0 dot products do; cuBLAS's int8 GEMM takes per-token scales only)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None, act_block: int = 0):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.input_scale = nn.Parameter(input_scale, requires_grad=False) if input_scale is not None else None
        self.act_block = act_block

    @classmethod
    def from_linear(cls, linear: nn.Linear, scheme: str) -> "QuantLinear":
        if scheme == "q8_0":
            q, scale = quantize_weight_grouped(linear.weight.detach(), act_block("q8_0", linear.weight.shape[1]))
        else:
            q, scale = quantize_weight(linear.weight.detach(), SCHEMES[scheme].dtype, SCHEMES[scheme].weight_max)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(q, scale, bias, act_block=act_block(scheme, q.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_block and self.input_scale is None and x.device.type == "cpu":
            q, s = ops.quant_int8_blocked(x, self.act_block)
            return ops.int8_block_mm(q, s, self.weight, self.weight_scale, x.dtype, self.bias)
        quant = ops.quant_int8 if self.weight.dtype == torch.int8 else ops.quant_fp8
        q, s = quant(x, self.input_scale)
        return ops.scaled_mm(q, self.weight, s, self.weight_scale, x.dtype, self.bias)


class Int4Linear(nn.Module):
    """y = quant(x) @ W.T + bias, in the dtype of x, W held as 4-bit codes: `weight` [N, K / 2] uint8
    (two codes a byte, `kiln.kernels.quant.pack_nibbles`) standing for `weight_scale` x code + `weight_min`,
    both [N, K / group] fp16. The activations are quantized to int8 per token and block of 32 (W4A8), also
    for a W4A16 checkpoint (its symmetric codes have the minimum -8 x scale)."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, weight_min: torch.Tensor,
                 bias: torch.Tensor | None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.weight_min = nn.Parameter(weight_min, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int4Linear":
        weight = linear.weight.detach()
        codes, scales, mins = quantize_weight_int4(weight, int4_group(weight.shape[1]))
        return cls(codes, scales, mins, linear.bias.detach() if linear.bias is not None else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, s = ops.quant_int8_blocked(x, ACT_BLOCK)
        return ops.int4_block_mm(q, s, self.weight, self.weight_scale, self.weight_min, x.dtype, self.bias)


def act_block(scheme: str, k: int) -> int:
    """The activation block of a dynamic projection of `k` input channels under `scheme`: ACT_BLOCK for int8
    where it divides k, else 0 (per token: fp8, w7a8, whose fbgemm kernel multiplies whole rows); q8_0's
    weight groups are its activation blocks, which must divide k."""
    if scheme == "q8_0":
        if k % ACT_BLOCK:
            raise KilnError(f"--quantization q8_0 needs each projection's input channels in groups of {ACT_BLOCK}; "
                            f"one has {k}: use --quantization int8")
        return ACT_BLOCK
    return ACT_BLOCK if scheme == "int8" and k % ACT_BLOCK == 0 else 0


def quantized_linear(linear: nn.Linear, scheme: str) -> nn.Module:
    """`linear` quantized with `scheme`: an `Int4Linear` for int4, else a `QuantLinear`."""
    return Int4Linear.from_linear(linear) if scheme == "int4" else QuantLinear.from_linear(linear, scheme)


def check_int4_placement(scheme: str | None, device: torch.device) -> None:
    """int4 and q8_0 run on the CPU only: refused elsewhere, by name."""
    if scheme in CPU_ONLY and device.type != "cpu":
        what = "int4 (W4A8) weights" if scheme == "int4" else "q8_0 weights (a scale per 32)"
        raise KilnError(f"{what} run on the CPU only; this is {device}: use --quantization int8 or fp8, "
                        "or --device cpu")


def int4_group(k: int) -> int:
    """The group size `--quantization int4` quantizes a projection of `k` input channels with."""
    if k % INT4_GROUP:
        raise KilnError(f"--quantization int4 needs each projection's input channels in groups of {INT4_GROUP}; "
                        f"one has {k}: use --quantization int8")
    return INT4_GROUP


def _swap_projections(model: nn.Module, make) -> None:
    for module in list(model.modules()):
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, make(child))


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Replace the decoder's projections by W8A8 `QuantLinear`s, in place (weights must be loaded).
    A model built for a checkpoint that is already quantized with `scheme` is left as it is."""
    check_scheme(scheme)
    held = getattr(model, "quantization", None)
    if held is not None:
        if held != scheme:
            raise KilnError(f"the checkpoint is already quantized ({held}, compressed-tensors): "
                            f"drop --quantization {scheme}")
        return model
    _swap_projections(model, lambda linear: quantized_linear(linear, scheme))
    model.quantization = scheme  # read by the compiler: the scheme is part of the artifact key
    return model


def quantized_layout(model: nn.Module, scheme: str, static_input: bool, group_size: int | None = None) -> nn.Module:
    """Give a freshly built model empty `QuantLinear`s (int4: `Int4Linear`s, in groups of `group_size`,
    default `int4_group`'s) of the checkpoint's layout, in place; the loader fills them. Built on the
    model's device (meta while `create_model` builds)."""
    dtype = SCHEMES[check_scheme(scheme)].dtype

    def empty(linear: nn.Linear) -> nn.Module:
        w = linear.weight
        bias = linear.bias.detach() if linear.bias is not None else None
        if scheme == "int4":
            n, k = w.shape
            group = group_size or int4_group(k)
            if k % group:
                ranks = getattr(getattr(model, "layout", None), "world_size", 1)
                what, fix = (("a rank's share of a projection", "use a tensor parallel size that leaves whole groups")
                             if ranks > 1 else ("a projection", "the weights do not match the config"))
                raise KilnError(f"{what}, {k} input channels, does not split into the checkpoint's groups of "
                                f"{group}: {fix}")
            groups = (torch.empty((n, k // group), dtype=torch.float16, device=w.device) for _ in range(2))
            return Int4Linear(torch.empty((n, k // 2), dtype=torch.uint8, device=w.device), *groups, bias)
        input_scale = torch.empty(1, dtype=torch.float32, device=w.device) if static_input else None
        block = act_block(scheme, w.shape[1])
        scale = torch.empty((w.shape[0], w.shape[1] // block), dtype=torch.float16, device=w.device) \
            if scheme == "q8_0" else torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
        return QuantLinear(torch.empty(w.shape, dtype=dtype, device=w.device), scale, bias, input_scale, block)

    _swap_projections(model, empty)
    model.quantization = scheme
    return model
