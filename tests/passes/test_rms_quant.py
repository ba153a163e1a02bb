"""RMSNorm+quant fusion: two sites per quantized layer, every quantization kind, outputs unchanged."""

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.fusion.rms_quant import RMSNormQuantFusion
from tests.passes.conftest import assert_same_outputs, SCHEMES, fresh

ops = torch.ops.kiln
QUANTS = (ops.quant_int8, ops.quant_fp8)


def unfused_sites(graph) -> int:
    """quant nodes fed by a norm's output: what the fusion must leave none of."""
    norms = (ops.rms_norm, ops.fused_add_rms_norm)
    count = 0
    for node in graph.nodes:
        if getattr(node.target, "overloadpacket", None) not in QUANTS:
            continue
        src = node.args[0]
        if src.target is not None and getattr(src.target, "overloadpacket", None) in norms:
            count += 1
        elif getattr(src, "args", None) and getattr(src.args[0], "target", None) is not None and \
                getattr(src.args[0].target, "overloadpacket", None) in norms:  # getitem of fused_add_rms_norm
            count += 1
    return count


@pytest.mark.parametrize("scheme", SCHEMES)
def test_fuses_every_norm_before_a_projection(quantized_llms, traced_graphs, scheme):
    llm, traced = quantized_llms[scheme], fresh(traced_graphs[scheme])
    layers = llm.model_config.num_layers
    assert unfused_sites(traced.graph.graph) == 2 * layers
    matches = RMSNormQuantFusion()(traced.graph.graph)
    traced.graph.recompile()
    graph = traced.graph.graph
    assert matches == 2 * layers
    assert count_ops(graph, ops.rms_norm_quant) == 1 and count_ops(graph, ops.fused_add_rms_norm_quant) == 2 * layers - 1
    assert unfused_sites(graph) == 0
    assert count_ops(graph, ops.rms_norm) == 0 and count_ops(graph, ops.fused_add_rms_norm) == 1  # the final norm
    static = scheme.endswith("static")
    fused = [n for n in graph.nodes if getattr(n.target, "overloadpacket", None) is ops.fused_add_rms_norm_quant]
    assert all(((len(n.args) > 5 and n.args[5] is not None) or n.kwargs.get("scale") is not None) == static
               for n in fused)
    assert_same_outputs(llm, traced, traced_graphs[scheme])


def test_nothing_to_fuse_without_quantization(traced_graphs):
    traced = fresh(traced_graphs[None])
    before = traced.graph.code
    assert RMSNormQuantFusion()(traced.graph.graph) == 0
    traced.graph.recompile()
    assert traced.graph.code == before


def test_fused_op_keeps_the_models_epsilon():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x, w):
        return ops.quant_int8(ops.rms_norm(x, w, 0.01), None)  # traced patterns use 1e-6

    gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 16), torch.randn(16))
    assert RMSNormQuantFusion()(gm.graph) == 1
    fused = next(n for n in gm.graph.nodes if n.target is ops.rms_norm_quant.default)
    assert fused.args[2] == 0.01
