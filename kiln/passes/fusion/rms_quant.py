"""RMSNorm (plain or with the residual add) followed by a quantization of its output => one op.

Every quantized layer has two sites: the norm before qkv_proj and the one before gate_up_proj.
"""

import torch

from kiln.passes.base import Pattern, PatternPass
from kiln.passes.fusion.quant_kinds import QUANT_KINDS, QuantKind

ops = torch.ops.kiln
EPS = {"eps": 1e-6}  # traced with this value; matches any


def _rms_norm(kind: QuantKind) -> Pattern:
    x, w, scale = torch.empty(4, 16), torch.empty(16), torch.empty(1)
    if kind.static:
        def search(x, weight, scale, eps):
            return kind.op(ops.rms_norm(x, weight, eps), scale)

        def replace(x, weight, scale, eps):
            return ops.rms_norm_quant(x, weight, eps, kind.dtype, scale)

        return Pattern(search, replace, [x, w, scale], EPS)

    def search(x, weight, eps):
        return kind.op(ops.rms_norm(x, weight, eps), None)

    def replace(x, weight, eps):
        return ops.rms_norm_quant(x, weight, eps, kind.dtype, None)

    return Pattern(search, replace, [x, w], EPS)


def _fused_add_rms_norm(kind: QuantKind) -> Pattern:
    x, residual, w, scale = torch.empty(4, 16), torch.empty(4, 16), torch.empty(16), torch.empty(1)
    if kind.static:
        def search(x, residual, weight, scale, eps):
            normed, new_residual = ops.fused_add_rms_norm(x, residual, weight, eps)
            q, s = kind.op(normed, scale)
            return q, s, new_residual

        def replace(x, residual, weight, scale, eps):
            return ops.fused_add_rms_norm_quant(x, residual, weight, eps, kind.dtype, scale)

        return Pattern(search, replace, [x, residual, w, scale], EPS)

    def search(x, residual, weight, eps):
        normed, new_residual = ops.fused_add_rms_norm(x, residual, weight, eps)
        q, s = kind.op(normed, None)
        return q, s, new_residual

    def replace(x, residual, weight, eps):
        return ops.fused_add_rms_norm_quant(x, residual, weight, eps, kind.dtype, None)

    return Pattern(search, replace, [x, residual, w], EPS)


class RMSNormQuantFusion(PatternPass):
    """rms_norm -> quant and fused_add_rms_norm -> quant => rms_norm_quant / fused_add_rms_norm_quant."""

    name = "rms_quant"

    def patterns(self) -> list[Pattern]:
        return [make(kind) for make in (_rms_norm, _fused_add_rms_norm) for kind in QUANT_KINDS]
