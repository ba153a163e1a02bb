"""Attention followed by a static quantization of its output => attention writing quantized output
(one site per layer with a calibrated `input_scale` on o_proj: static W8A8 checkpoints).

A plain `GraphPass`: the attention is a splitting op whose output crosses into the next piece, and
the match is a fixed three-node chain (attention -> flatten heads -> static quant), so a walk over
the attentions is simpler than a pattern. Per-token (dynamic) quantization is left alone: its
scales need the whole row of every head, which an attention kernel does not hold at once.
"""

import operator

import torch
from torch import fx

from kiln.passes.base import GraphPass

ops = torch.ops.kiln
aten = torch.ops.aten
VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
QUANT_DTYPES = {ops.quant_int8: torch.int8, ops.quant_fp8: torch.float8_e4m3fn}


def _packet(node) -> object:
    return getattr(getattr(node, "target", None), "overloadpacket", None)


def _only_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _static_scale(quant: fx.Node) -> fx.Node | None:
    scale = quant.args[1] if len(quant.args) > 1 else quant.kwargs.get("scale")
    return scale if isinstance(scale, fx.Node) else None


def _flattens_heads(view: fx.Node, attention: fx.Node) -> bool:
    """`view` turns the attention's [T, H, D] into [T, H * D] (what the fused op returns)."""
    out, flat = attention.meta["val"], view.meta["val"]
    return tuple(flat.shape) == (out.shape[0], out.shape[1] * out.shape[2])


class AttentionQuantFusion(GraphPass):
    """attention -> view [T, H*D] -> static quant => attention_quant."""

    name = "attn_quant"

    def __call__(self, graph: fx.Graph) -> int:
        matches = 0
        for attention in list(graph.nodes):
            if _packet(attention) is not ops.attention:
                continue
            view = _only_user(attention)
            if view is None or view.target not in VIEWS or not _flattens_heads(view, attention):
                continue
            quant = _only_user(view)
            if quant is None or _packet(quant) not in QUANT_DTYPES or _static_scale(quant) is None:
                continue
            if any(user.target is not operator.getitem for user in quant.users):
                continue
            with graph.inserting_before(quant):
                fused = graph.call_function(
                    ops.attention_quant.default,
                    (*attention.args, QUANT_DTYPES[_packet(quant)], _static_scale(quant)),
                )
            fused.meta["val"] = quant.meta["val"]  # the same (quantized [T, H*D], scale [1, 1])
            for user in list(quant.users):  # unpack right after the op, so in its piece
                with graph.inserting_after(fused):
                    item = graph.call_function(operator.getitem, (fused, user.args[1]))
                item.meta = dict(user.meta)
                user.replace_all_uses_with(item)
                graph.erase_node(user)
            for node in (quant, view, attention):
                graph.erase_node(node)
            matches += 1
        return matches
