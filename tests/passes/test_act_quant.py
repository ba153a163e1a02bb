"""SiLU*Mul+quant fusion: one site per quantized layer (down_proj's input), outputs unchanged."""

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.fusion.act_quant import SiluMulQuantFusion
from tests.passes.conftest import assert_same_outputs, SCHEMES, fresh

ops = torch.ops.kiln


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fuses_every_activation_before_down_proj(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    quant = ops.quant_int8 if scheme.startswith("int8") else ops.quant_fp8
    quants_before = count_ops(traced.graph.graph, quant)
    assert SiluMulQuantFusion()(traced.graph.graph) == layers
    traced.graph.recompile()
    graph = traced.graph.graph
    assert count_ops(graph, ops.silu_and_mul_quant) == layers and count_ops(graph, ops.silu_and_mul) == 0
    assert count_ops(graph, quant) == quants_before - layers
    assert_same_outputs(llm, traced, traced_graphs[scheme])


def test_unquantized_activation_is_left_alone(traced_graphs):
    traced = fresh(traced_graphs[None])
    assert SiluMulQuantFusion()(traced.graph.graph) == 0
    assert count_ops(traced.graph.graph, ops.silu_and_mul) == 4
