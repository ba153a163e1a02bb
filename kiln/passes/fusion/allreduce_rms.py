"""all_reduce -> fused_add_rms_norm (or its quant form) => one op (two sites per layer under tensor
parallelism).

Every row-parallel layer (o_proj, down_proj) ends in `kiln::all_reduce`, and each one's sum goes
straight into the next residual add + RMSNorm: after attention, the layer's post-attention norm;
after the MLP, the next layer's input norm (the final norm for the last layer). The fused op lets
the platform reduce and normalize together: on CPU, lowering gathers the ranks' partial sums and
Inductor sums, adds and normalizes them in one loop; on CUDA a one-shot kernel can do all of it.

It runs after rms_quant, so a quantized model's norm is already `fused_add_rms_norm_quant` and
fuses whole. A plain `GraphPass`: Inductor's pattern matcher cannot bind the group name, a string.
"""

import torch
from torch import fx

from kiln.passes.base import GraphPass, SizeRange

ops = torch.ops.kiln
FUSED = {ops.fused_add_rms_norm.default: ops.all_reduce_fused_add_rms_norm.default,
         ops.fused_add_rms_norm_quant.default: ops.all_reduce_fused_add_rms_norm_quant.default}
"""The norm an all_reduce feeds -> the op that does both. Both take the norm's arguments, then
(world_size, group_name)."""


class AllReduceRMSFusion(GraphPass):
    """all_reduce(x) -> fused_add_rms_norm[_quant](., residual, ...) => all_reduce_fused_add_rms_norm[_quant].

    `world_size` is the tensor parallel size the graph is compiled for (the fused op's gather needs
    it while tracing); `max_num_tokens` gates the fusion to batches of at most that many tokens
    (None: every batch), for platforms where the fused kernel only wins on small messages."""

    name = "allreduce_rms"

    def __init__(self, world_size: int = 1, max_num_tokens: int | None = None):
        self.world_size, self.max_num_tokens = world_size, max_num_tokens

    def applies_to(self, size_range: SizeRange) -> bool:
        return self.max_num_tokens is None or size_range[1] <= self.max_num_tokens

    def __call__(self, graph: fx.Graph) -> int:
        matches = 0
        for norm in list(graph.nodes):
            if norm.target not in FUSED:
                continue
            reduced = norm.args[0]
            if not (isinstance(reduced, fx.Node) and reduced.target is ops.all_reduce.default
                    and len(reduced.users) == 1):
                continue
            x, group_name = reduced.args
            with graph.inserting_before(norm):
                fused = graph.call_function(FUSED[norm.target], (x, *norm.args[1:], self.world_size, group_name))
            fused.meta["val"] = norm.meta["val"]
            norm.replace_all_uses_with(fused)
            graph.erase_node(norm)
            graph.erase_node(reduced)
            matches += 1
        return matches
