"""After replacements: restore a topological order and drop nodes whose results nobody uses.

Replacements insert the fused op where the pattern's last node was, which can precede a user
inserted earlier; a stable topological sort fixes that without reordering anything else. Mutating
ops (the KV-cache write) are impure to FX and are never dropped.
"""

from torch import fx

from kiln.passes.base import GraphPass


class DeadCodeElimination(GraphPass):
    """Stable topological sort, then dead-code elimination; counts the nodes removed."""

    name = "dead_code"

    def __call__(self, graph: fx.Graph) -> int:
        from torch._inductor.pattern_matcher import stable_topological_sort

        stable_topological_sort(graph)
        before = len(graph.nodes)
        graph.eliminate_dead_code()
        return before - len(graph.nodes)
