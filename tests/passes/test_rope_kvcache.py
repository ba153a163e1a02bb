"""RoPE+KV-cache write fusion: one site per layer, attention still ordered after the write. The pass
fuses CUDA graphs only; these tests let it fuse the CPU demo graphs to check the rewrite."""

import operator

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.fusion.rope_kvcache import RopeKVCacheFusion
from tests.passes.conftest import assert_same_outputs, fresh

ops = torch.ops.kiln


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_fuses_every_layer_and_keeps_attention_after_the_write(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    assert RopeKVCacheFusion()(fresh(traced_graphs[scheme]).graph.graph) == 0  # a CPU graph: nothing to gain
    assert RopeKVCacheFusion(devices=("cpu",))(traced.graph.graph) == layers
    traced.graph.recompile()
    graph = traced.graph.graph
    assert count_ops(graph, ops.rotary_embedding_kv_cache_write) == layers
    assert count_ops(graph, ops.rotary_embedding) == 0 and count_ops(graph, ops.kv_cache_write) == 0
    for attention in (n for n in graph.nodes if getattr(n.target, "overloadpacket", None) is ops.attention):
        token = attention.args[2]  # the write's ordering token
        assert token.target is operator.getitem and token.args[1] == 1
        assert token.args[0].target is ops.rotary_embedding_kv_cache_write.default
        assert attention.args[1] is token.args[0].args[6]  # it reads the cache the fused op writes
    assert_same_outputs(llm, traced, traced_graphs[scheme])


def test_rotated_key_with_another_user_is_not_fused():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(positions, q, k, v, cos_sin, cache, slots):
        q2, k2 = ops.rotary_embedding(positions, q, k, cos_sin, True)
        written = ops.kv_cache_write(k2, v, cache, slots)
        return q2, written, k2.sum()  # the rotated key is needed elsewhere: fusing would lose it

    args = [torch.arange(4), torch.randn(4, 2, 8), torch.randn(4, 1, 8), torch.randn(4, 1, 8), torch.randn(16, 8),
            torch.zeros(2, 2, 4, 1, 8), torch.arange(4)]
    gm = make_fx(f, tracing_mode="fake")(*args)
    assert RopeKVCacheFusion(devices=("cpu",))(gm.graph) == 0
