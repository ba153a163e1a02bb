"""Lowering on CPU: the rotary embedding and the KV-cache write become Inductor-fusable aten ops
(the write an in-place scatter into the cache), with the graph's numbers unchanged."""

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.lowering import Lowering
from tests.passes.conftest import assert_same_outputs, fresh

ops = torch.ops.kiln


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_rotary_and_cache_write_are_lowered(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    graph = traced.graph.graph
    assert count_ops(graph, ops.rotary_embedding) == layers
    matches = Lowering(choose=False)(graph)
    traced.graph.recompile()
    assert count_ops(graph, ops.rotary_embedding) == 0 and count_ops(graph, ops.kv_cache_write) == 0
    assert count_ops(graph, torch.ops.aten.index_put_) == layers
    assert matches >= 2 * layers  # the rotaries and writes, with the norms and activations the patterns lower
    graph.lint()
    assert_same_outputs(llm, traced, traced_graphs[scheme])
