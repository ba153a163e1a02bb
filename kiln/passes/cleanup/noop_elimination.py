"""Remove reshapes, views, expands, aliases and slices that return their input's shape unchanged.

They are left behind by model code written for any rank and by replacements; removing them lets
patterns that would otherwise be interrupted by one (norm -> view -> quant) match.
"""

import torch
from torch import fx

from kiln.passes.base import GraphPass

aten = torch.ops.aten
SHAPE_OPS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
             aten.alias.default}


def _value(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def _known_true(expr) -> bool:
    """torch's `statically_known_true`, imported on first use: its module imports sympy (slow to import), which
    a process that only loads artifacts never needs."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return statically_known_true(expr)


def _same_shape(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _is_noop(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    src, out = _value(node.args[0]) if node.args else None, _value(node)
    if src is None or out is None or src.dtype != out.dtype:
        return False
    if node.target in SHAPE_OPS:
        return _same_shape(src, out)
    if node.target is aten.slice.Tensor:
        _, dim, start, end, step = (*node.args, *[None] * (5 - len(node.args)))[:5]
        dim = dim or 0
        whole = end is None or _known_true(end >= src.shape[dim])
        return (start in (None, 0)) and whole and step in (None, 1) and _same_shape(src, out)
    return False


class NoOpElimination(GraphPass):
    """view / reshape / expand / alias / slice that change nothing => their input."""

    name = "noop_elimination"

    def __call__(self, graph: fx.Graph) -> int:
        removed = 0
        for node in list(graph.nodes):
            if _is_noop(node):
                node.replace_all_uses_with(node.args[0])
                graph.erase_node(node)
                removed += 1
        return removed
