"""The activation quantizations a fused op can absorb: (quant op, target dtype, static scale?)."""

from typing import NamedTuple

import torch

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)

ops = torch.ops.kiln


class QuantKind(NamedTuple):
    op: torch._ops.OpOverloadPacket
    dtype: torch.dtype
    static: bool  # per-tensor scale input, else per-token scales computed by the op


QUANT_KINDS = [
    QuantKind(ops.quant_int8, torch.int8, False),
    QuantKind(ops.quant_int8, torch.int8, True),
    QuantKind(ops.quant_fp8, torch.float8_e4m3fn, False),
    QuantKind(ops.quant_fp8, torch.float8_e4m3fn, True),
]
