"""Inductor lowerings of kiln's oneDNN projection ops (`kiln.kernels.packed_linear`) to torch's own
oneDNN kernels, which a compiled CPU piece calls through AOTInductor's C shim.

Left to Inductor's default, a custom op in an AOTInductor library is called through the proxy
executor: its arguments boxed from a JSON call table, then the op's Python function, on every call
(microseconds more a call than the C shim, and a decode step makes several calls a layer). Lowered, the library calls `mkldnn::_linear_pointwise` / `onednn::qlinear_pointwise`
from C++ with no Python and no GIL, on the packed weight the piece takes as an input, as torch's own
frozen-weight path does on a weight constant.
"""

import functools
import inspect
import logging

import torch

from kiln.kernels import packed_linear

logger = logging.getLogger(__name__)


@functools.cache
def register() -> bool:
    """Register the lowerings once per process (before a CPU piece is compiled); False when this torch's
    Inductor lacks the IR nodes they build (the ops then stay proxy calls)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        from torch._inductor import ir, mkldnn_ir
        from torch._inductor.lowering import register_lowering
        from torch._inductor.virtualized import V
    except ImportError:
        return False
    def parameters(fn) -> list[str]:
        return list(inspect.signature(fn).parameters)

    if not hasattr(mkldnn_ir, "QLinearPointwisePT2E") or not hasattr(mkldnn_ir, "may_convert_to_optional") or \
            parameters(mkldnn_ir.LinearUnary.create) != ["x", "w", "B", "attr", "scalars", "algorithm"] or \
            parameters(mkldnn_ir.QLinearPointwisePT2E) != ["layout", "inputs", "constant_args", "has_bias"]:
        logger.info("this torch's Inductor builds oneDNN linears differently: kiln's oneDNN ops stay proxy calls")
        return False
    ops = torch.ops.kiln

    @register_lowering(ops.onednn_linear.default, type_promotion_kind=None)
    def _onednn_linear(x, weight, bias=None):
        return ir.TensorBox.create(mkldnn_ir.LinearUnary.create(x, weight, bias, "none", [], ""))

    @register_lowering(ops.onednn_int8_linear.default, type_promotion_kind=None)
    def _onednn_int8_linear(a_shifted, weight, weight_scale=None):
        n = weight.get_size()[0]  # the fake weight is [N, K]; the packed one the library gets is [K, N]
        if weight_scale is None:
            weight_scale = V.graph.add_tensor_constant(torch.ones(int(n)))
        x_scale, x_zero_point, w_zero_point = (V.graph.add_tensor_constant(t) for t in (
            torch.tensor(1.0), torch.tensor(packed_linear.INT8_ZERO_POINT), torch.tensor(0)))
        x = ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(a_shifted))
        inputs = [x] + [ir.ExternKernel.realize_input(t) for t in
                        (x_scale, x_zero_point, weight, weight_scale, w_zero_point)]
        *m, _ = x.get_size()
        # the op's arguments after the tensors: no bias, output scale 1 and zero point 0, fp32 out, no post-op
        constant_args = [None, 1.0, 0, torch.float32, "none", mkldnn_ir.may_convert_to_optional([]), ""]
        return ir.TensorBox.create(mkldnn_ir.QLinearPointwisePT2E(
            layout=ir.FixedLayout(x.get_device(), torch.float32, [*m, n]), inputs=inputs,
            constant_args=constant_args, has_bias=False))

    return True
