"""Attention+quant fusion: one site per layer where o_proj's input is quantized with a static scale."""

import pytest
import torch

from kiln.compiler.split import split_graph
from kiln.passes import count_ops
from kiln.passes.fusion.attn_quant import AttentionQuantFusion
from tests.passes.conftest import assert_same_outputs, fresh

ops = torch.ops.kiln


@pytest.mark.parametrize("scheme", ["int8-static", "fp8-static"])
def test_fuses_every_static_quant_of_the_attention_output(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    quant = ops.quant_int8 if scheme.startswith("int8") else ops.quant_fp8
    quants_before = count_ops(traced.graph.graph, quant)
    assert AttentionQuantFusion()(traced.graph.graph) == layers
    traced.graph.recompile()
    graph = traced.graph.graph
    assert count_ops(graph, ops.attention_quant) == layers and count_ops(graph, ops.attention) == 0
    assert count_ops(graph, quant) == quants_before - layers
    for fused in (n for n in graph.nodes if n.target is ops.attention_quant.default):
        # still ordered after the cache write, and its output (q, scale) feeds o_proj's scaled_mm
        assert fused.args[2].target is ops.kv_cache_write.default
        users = {u.args[1]: u for u in fused.users}
        mm = next(iter(users[0].users))
        assert mm.target is ops.scaled_mm.default and mm.args[2] is users[1]
    _, pieces = split_graph(traced.graph)
    assert sum(p.is_splitting for p in pieces) == layers and len(pieces) == 2 * layers + 1
    for piece in pieces:  # the fused op's (q, scale) is unpacked in its own piece: no tuple crosses a cut
        assert all(not isinstance(n.meta["val"], tuple) for n in piece.graph.graph.nodes if n.op == "placeholder")
    assert_same_outputs(llm, traced, traced_graphs[scheme])


@pytest.mark.parametrize("scheme", [None, "int8", "fp8"])
def test_per_token_or_unquantized_output_is_left_alone(quantized_llms, traced_graphs, scheme):
    traced = fresh(traced_graphs[scheme])
    assert AttentionQuantFusion()(traced.graph.graph) == 0
    assert count_ops(traced.graph.graph, ops.attention) == quantized_llms[scheme].model_config.num_layers
