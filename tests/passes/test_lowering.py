"""Lowering on CPU: the rotary embedding becomes Inductor-fusable aten ops even beside the KV-cache
write (where the pattern matcher refuses to match), with the graph's numbers unchanged."""

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.lowering import Lowering
from tests.passes.conftest import assert_same_outputs, fresh

ops = torch.ops.kiln


@pytest.mark.parametrize("scheme", [None, "int8"])
def test_rotary_is_lowered_beside_the_cache_write(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    graph = traced.graph.graph
    assert count_ops(graph, ops.rotary_embedding) == layers
    matches = Lowering(choose=False)(graph)
    traced.graph.recompile()
    assert count_ops(graph, ops.rotary_embedding) == 0 and count_ops(graph, ops.kv_cache_write) == layers
    assert matches >= layers  # the rotaries, with the norms and activations the patterns lower
    graph.lint()
    assert_same_outputs(llm, traced, traced_graphs[scheme])
