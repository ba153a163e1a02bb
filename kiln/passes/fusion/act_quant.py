"""SiLU*Mul followed by a quantization of its output => one op (one site per quantized layer: the
input of down_proj)."""

import torch

from kiln.passes.base import Pattern, PatternPass
from kiln.passes.fusion.quant_kinds import QUANT_KINDS, QuantKind

ops = torch.ops.kiln


def _silu_and_mul(kind: QuantKind) -> Pattern:
    x, scale = torch.empty(4, 32), torch.empty(1)
    if kind.static:
        def search(x, scale):
            return kind.op(ops.silu_and_mul(x), scale)

        def replace(x, scale):
            return ops.silu_and_mul_quant(x, kind.dtype, scale)

        return Pattern(search, replace, [x, scale])

    def search(x):
        return kind.op(ops.silu_and_mul(x), None)

    def replace(x):
        return ops.silu_and_mul_quant(x, kind.dtype, None)

    return Pattern(search, replace, [x])


class SiluMulQuantFusion(PatternPass):
    """silu_and_mul -> quant => silu_and_mul_quant."""

    name = "act_quant"

    def patterns(self) -> list[Pattern]:
        return [_silu_and_mul(kind) for kind in QUANT_KINDS]
