"""kiln's oneDNN projection ops compile to C shim calls of torch's oneDNN kernels: no call table (no
proxy executor, no Python per call), the same numbers as the ops, at any token count."""

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler.aoti import LoadedLibrary, compile_library, tensor_args
from kiln.compiler.compile import normalize
from kiln.kernels import gemms, onednn_lowering, packed_linear

ops = torch.ops.kiln
pytestmark = pytest.mark.skipif(not onednn_lowering.register(), reason="this torch cannot lower oneDNN linears")


def _library(fn, examples: list[torch.Tensor], tmp_path):
    """`fn` compiled for `examples` (the first dynamic in its rows), loaded; and its C++ source."""
    mode = FakeTensorMode(shape_env=ShapeEnv())
    rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC], constraint_sizes=[None] * 2)

    def static(t):
        return StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC] * t.dim(), constraint_sizes=[None] * t.dim())

    inputs = [mode.from_tensor(t, symbolic_context=rows if i == 0 else static(t)) for i, t in enumerate(examples)]
    graph = normalize(fx.symbolic_trace(fn))
    for node, value in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        node.meta["val"] = value
    compiled = compile_library(graph, inputs, mode)
    assert compiled.calls is None  # no op left for the proxy executor
    (tmp_path / "piece.so").write_bytes(compiled.library)
    return LoadedLibrary(tmp_path / "piece.so", tensor_args(inputs)), "\n".join(compiled.sources.values())


def test_float_projection_calls_onednn_from_cpp(tmp_path):
    def fn(x, w1, w2):
        return ops.onednn_linear(torch.relu(ops.onednn_linear(x, w1, None)) * 2, w2, None)

    w1, w2 = torch.randn(48, 32), torch.randn(24, 48)
    run, source = _library(fn, [torch.randn(5, 32), w1, w2], tmp_path)
    assert source.count("aoti_torch_cpu__linear_pointwise(") == 2
    packed = [gemms.pack("onednn", w) for w in (w1, w2)]
    for rows in (1, 7, 40):
        x = torch.randn(rows, 32)
        [out] = run(x, *packed)
        torch.testing.assert_close(out, fn(x, *packed), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not packed_linear.int8_gemm_exact(), reason="oneDNN's int8 GEMM saturates on this CPU (no VNNI)")
def test_int8_projection_calls_onednn_from_cpp(tmp_path):
    def fn(a, w):  # the shift and the scaling, as the GEMM choice writes them around the op
        codes = (a.to(torch.int32) + packed_linear.INT8_ZERO_POINT).to(torch.uint8)
        return ops.onednn_int8_linear(codes, w) * 0.5

    w = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    run, source = _library(fn, [torch.randint(-127, 128, (5, 64), dtype=torch.int8), w], tmp_path)
    assert source.count("aoti_torch_cpu__qlinear_pointwise_tensor(") == 1
    packed = gemms.pack("onednn_int8", w)
    for rows in (1, 9, 33):
        a = torch.randint(-127, 128, (rows, 64), dtype=torch.int8)
        [out] = run(a, packed)
        assert torch.equal(out, (a.long() @ w.long().t()).float() * 0.5)  # exact int32 sums
