"""Cut the traced graph at attention: L layers give 2L+1 pieces, of which the L+1 between
attentions are compiled and the attentions run eagerly (and, on CUDA, outside CUDA graphs)."""

from dataclasses import dataclass

import torch
from torch import fx
from torch.fx.passes.split_module import split_module

import kiln.kernels  # noqa: F401

SPLITTING_OPS: set = {torch.ops.kiln.attention}
"""Op packets to cut at; register more with `add_splitting_op`."""


def add_splitting_op(op: torch._ops.OpOverloadPacket) -> None:
    SPLITTING_OPS.add(op)


def _is_splitting(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", node.target)
    return packet in SPLITTING_OPS


@dataclass
class Piece:
    name: str
    graph: fx.GraphModule
    is_splitting: bool


def split_graph(graph: fx.GraphModule) -> tuple[fx.GraphModule, list[Piece]]:
    """Return the stitching module (calling `submod_i` in order) and its pieces."""
    counter = [0]

    def partition(node: fx.Node) -> int:
        if _is_splitting(node):
            counter[0] += 2
            return counter[0] - 1
        return counter[0]

    stitched = split_module(graph, None, partition, keep_original_order=True)
    pieces = [
        Piece(name, module, any(_is_splitting(n) for n in module.graph.nodes))
        for name, module in stitched.named_children()
    ]
    return stitched, pieces
