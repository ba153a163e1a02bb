"""The lowering's kernel choice: measured per op and signature, retargets the winners to their
`kiln_triton` twins (which lowering then leaves whole), records every decision. On CPU nothing is
measured; here a stand-in timer decides, since the real candidates need a GPU."""

import pytest
import torch

from kiln.passes import count_ops
from kiln.passes.fusion.act_quant import SiluMulQuantFusion
from kiln.passes.fusion.rms_quant import RMSNormQuantFusion
from kiln.passes.kernel_choice import choose_kernels, measured_tokens, time_call, triton_twins
from kiln.passes.lowering import Lowering
from tests.passes.conftest import fresh

pytest.importorskip("triton")
import kiln.kernels.triton.ops  # noqa: E402,F401  (defines torch.ops.kiln_triton without running anything)

ops = torch.ops.kiln


def _fused(traced_graphs):
    traced = fresh(traced_graphs["int8"])
    graph = traced.graph.graph
    RMSNormQuantFusion()(graph)
    SiluMulQuantFusion()(graph)
    return traced, graph


def test_winners_are_retargeted_and_kept_whole_by_lowering(traced_graphs, quantized_llms):
    traced, graph = _fused(traced_graphs)
    layers = quantized_llms["int8"].model_config.num_layers
    twins = {name: getattr(torch.ops.kiln_triton, name).default for name in
             ("fused_add_rms_norm_quant", "silu_and_mul_quant", "rms_norm_quant")}
    timed = []

    hidden = quantized_llms["int8"].model_config.hidden_size

    def timer(fn, args):  # the Triton kernel is measured first: faster for norms, slower for activations
        timed.append(args[0].shape[0])
        kernel_turn = len(timed) % 2 == 1
        is_norm = args[0].shape[-1] == hidden  # the activation's input is [tokens, 2 x intermediate]
        return (1.0 if is_norm else 3.0) if kernel_turn else 2.0

    choices = choose_kernels(graph, (1, 64), twins=twins, timer=timer, device_types=("cpu",))
    by_op = {c.op: c for c in choices}
    assert set(by_op) == set(twins) and timed.count(1) == timed.count(64) == 2 * len(choices)
    assert by_op["fused_add_rms_norm_quant"].kernel == "triton" and by_op["fused_add_rms_norm_quant"].calls == 2 * layers - 1
    assert by_op["rms_norm_quant"].kernel == "triton" and by_op["silu_and_mul_quant"].kernel == "inductor"
    assert by_op["silu_and_mul_quant"].triton_ms == (3.0, 3.0) and by_op["silu_and_mul_quant"].inductor_ms == (2.0, 2.0)
    kt = torch.ops.kiln_triton
    assert count_ops(graph, kt.fused_add_rms_norm_quant) == 2 * layers - 1 and count_ops(graph, kt.rms_norm_quant) == 1
    assert count_ops(graph, ops.fused_add_rms_norm_quant) == 0 and count_ops(graph, ops.silu_and_mul_quant) == layers

    Lowering(choose=False)(graph)  # the twins stay whole; the activations are lowered
    assert count_ops(graph, kt.fused_add_rms_norm_quant) == 2 * layers - 1 and count_ops(graph, kt.rms_norm_quant) == 1
    assert count_ops(graph, ops.silu_and_mul_quant) == 0
    graph.lint()


def test_cpu_graphs_measure_nothing(traced_graphs):
    traced, graph = _fused(traced_graphs)
    assert torch.cuda.is_available() or triton_twins() is None  # no CUDA: no candidates at all
    assert choose_kernels(graph, (1, 64), timer=lambda fn, args: pytest.fail("measured on CPU")) == []
    lowering = Lowering()
    lowering.size_range = (1, 2048)
    assert lowering(graph) > 0 and lowering.choices == []
    assert not any(isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "kiln_triton"
                   for n in graph.nodes)


def test_measured_token_counts_and_timer():
    assert measured_tokens((1, 2048)) == (1, 2048) and measured_tokens((16, 16)) == (16,)
    assert measured_tokens((65, 100_000)) == (65, 4096)
    assert time_call(torch.add, [torch.ones(4), torch.ones(4)], repeats=3) > 0


def test_a_twin_traces_to_its_kernel_with_the_launch_options():
    """AOTAutograd (what Inductor compiles) sees through a twin to its Triton kernel and keeps the
    launch's num_warps: what AOTInductor builds into the library."""
    from functorch.compile import aot_function
    from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs = []
    with FakeTensorMode():
        x = torch.randn(4, 2 * 20000)
        aot_function(lambda x: torch.ops.kiln_triton.silu_and_mul(x), fw_compiler=lambda gm, _: graphs.append(gm) or gm)(x)
    (node,) = [n for n in graphs[0].graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
    assert kernel.fn.__name__ == "_silu_and_mul_kernel"
    assert [config.num_warps for config in kernel.configs] == [16]  # row_warps(32768): 16, not Triton's 4
