"""Rotary embedding followed by the KV-cache write of the rotated key => one op (one site per layer).

On CUDA only, where the fused op is one Triton kernel. On CPU it has no kernel of its own: it would
run the rotary eagerly beside the write, where unfused the lowering hands the rotary to Inductor,
which fuses it into the loop after the QKV projection (`benchmarks/fusions.py` measures both).

A plain `GraphPass`, not a `PatternPass`: Inductor's pattern matcher refuses any match that spans a
mutation (the cache write starts a new mutation region in kiln's unfunctionalized graph). The fused
op returns the write's ordering token, so the attention keeps its data dependency on the write.
"""

import operator

import torch
from torch import fx

from kiln.passes.base import GraphPass

ops = torch.ops.kiln


def _packet(node) -> object:
    return getattr(getattr(node, "target", None), "overloadpacket", None)


def _rotated_key_source(write: fx.Node) -> fx.Node | None:
    """The rotary node whose rotated key (and nothing else of it but the query) feeds `write`."""
    key = write.args[0]
    if not (isinstance(key, fx.Node) and key.target is operator.getitem and key.args[1] == 1):
        return None
    rotary = key.args[0]
    if _packet(rotary) is not ops.rotary_embedding or len(key.users) != 1:
        return None
    if any(u.target is not operator.getitem for u in rotary.users):
        return None
    return rotary


class RopeKVCacheFusion(GraphPass):
    """rotary_embedding -> kv_cache_write(rotated key) => rotary_embedding_kv_cache_write."""

    name = "rope_kvcache"

    def __init__(self, devices: tuple[str, ...] = ("cuda",)):
        self.devices = devices
        """Where the fused op pays off: graphs whose KV caches live elsewhere are left alone."""

    def __call__(self, graph: fx.Graph) -> int:
        matches = 0
        for write in list(graph.nodes):
            if _packet(write) is not ops.kv_cache_write or write.args[2].meta["val"].device.type not in self.devices:
                continue
            rotary = _rotated_key_source(write)
            if rotary is None:
                continue
            positions, query, key, cos_sin_cache, is_neox = rotary.args
            _, value, kv_cache, slot_mapping = write.args
            with graph.inserting_before(write):
                fused = graph.call_function(
                    ops.rotary_embedding_kv_cache_write.default,
                    (positions, query, key, value, cos_sin_cache, is_neox, kv_cache, slot_mapping),
                )
                q = graph.call_function(operator.getitem, (fused, 0))
                token = graph.call_function(operator.getitem, (fused, 1))
            fused.meta["val"] = (rotary.meta["val"][0], write.meta["val"])
            q.meta["val"], token.meta["val"] = fused.meta["val"]
            write.replace_all_uses_with(token)
            for user in list(rotary.users):  # the query getitem moves to the fused op; the key's dies
                if user.args[1] == 0:
                    user.replace_all_uses_with(q)
            graph.erase_node(write)
            for user in list(rotary.users):
                graph.erase_node(user)
            graph.erase_node(rotary)
            matches += 1
        return matches
