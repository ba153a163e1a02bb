"""W8A8 linear layers and online quantization of a loaded model.

`quantize_model` swaps every decoder projection (qkv, o, gate_up, down) for a `QuantLinear` holding
the weight in int8 or fp8 with one scale per output channel; activations are quantized per token at
run time. Embeddings, norms and the LM head stay in the model dtype.
"""

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.kernels import quantize_weight

ops = torch.ops.kiln

SCHEMES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def check_scheme(name: str | None) -> str | None:
    if name is not None and name not in SCHEMES:
        raise KilnError(f"unknown quantization {name!r}; choose from {', '.join(SCHEMES)}")
    return name


class QuantLinear(nn.Module):
    """y = quant(x) @ W_q.T * scales + bias, in the dtype of x. `weight` [N, K] is int8 or fp8,
    `weight_scale` [N] fp32; `input_scale` (static per-tensor activations) is None for per-token."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 input_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.input_scale = nn.Parameter(input_scale, requires_grad=False) if input_scale is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, dtype: torch.dtype) -> "QuantLinear":
        q, scale = quantize_weight(linear.weight.detach(), dtype)
        bias = linear.bias.detach() if linear.bias is not None else None
        return cls(q, scale, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quant = ops.quant_int8 if self.weight.dtype == torch.int8 else ops.quant_fp8
        q, s = quant(x, self.input_scale)
        return ops.scaled_mm(q, self.weight, s, self.weight_scale, x.dtype, self.bias)


def quantize_model(model: nn.Module, scheme: str) -> nn.Module:
    """Replace the decoder's projections by W8A8 `QuantLinear`s, in place (weights must be loaded)."""
    dtype = SCHEMES[check_scheme(scheme)]
    for module in list(model.modules()):
        for name in PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, QuantLinear.from_linear(child, dtype))
    model.quantization = scheme  # read by the compiler: the scheme is part of the artifact key
    return model
