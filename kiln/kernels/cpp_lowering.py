"""The Inductor lowerings of kiln's C++ kernels: the panel GEMMs (`kiln.kernels.panel_linear`), the
decode attention (`kiln.kernels.decode_attention`) and the LM head's greedy screen
(`kiln.kernels.greedy_screen`). A kernel's C++ goes into the wrapper of the piece
that calls it, and the piece calls it like one of torch's C shim functions, from C++ with no Python.
The kernel is thus compiled with the piece, for the same ISA, and ships inside the artifact's library.
Each module's C++ is read from kiln/kernels/csrc (`kiln.kernels.cpp_source`).
"""

import functools
import hashlib
import inspect
import logging

import torch

from kiln.kernels import decode_attention, greedy_screen, panel_linear
from kiln.kernels.panel_linear import PanelKernel

logger = logging.getLogger(__name__)


@functools.cache
def register() -> bool:
    """Register the lowerings once per process (before a CPU piece is compiled); False when this torch's
    Inductor builds extern kernels differently (the compile then never chooses the kernels, nor ships the
    decode attention's library)."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import register_lowering
    except ImportError:
        return False
    expected = ["self", "layout", "inputs", "constant_args", "kwargs", "python_kernel_name", "cpp_kernel_name",
                "ordered_kwargs_for_cpp_kernel", "op_overload"]
    if list(inspect.signature(ir.ExternKernelAlloc.__init__).parameters) != expected:
        logger.info("this torch's Inductor builds extern kernels differently: kiln's panel GEMMs and decode "
                    "attention are not offered")
        return False

    class CppKernel(ir.ExternKernelAlloc):
        def __init__(self, op: str, source: str, shim: str, layout, inputs):
            super().__init__(layout, inputs, (), None, None, shim, (), getattr(torch.ops.kiln, op).default)
            self.op, self.source = op, source

        def codegen(self, wrapper):
            headers = getattr(wrapper, "_included_extra_headers", None)
            if headers is None:
                raise RuntimeError(f"kiln::{self.op} lowers for AOTInductor's C++ wrapper only")
            marker = f"kiln::{hashlib.sha256(self.source.encode()).hexdigest()[:16]}"  # each source spliced once
            if marker not in headers:
                headers.add(marker)
                wrapper.header.splice(self.source)
            super().codegen(wrapper)

    def realized(tensors) -> list:
        return [ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(t)) for t in tensors if t is not None]

    def lowering(kernel: PanelKernel):
        def lower(x, weight, bias=None):
            m, n = x.get_size()[0], weight.get_size()[0]
            layout = ir.FixedLayout(x.get_device(), torch.float32, [m, n])
            return ir.TensorBox.create(CppKernel(kernel.op, kernel.source + kernel.wrapper_source, kernel.shim,
                                                 layout, realized((x, weight, bias))))

        register_lowering(getattr(torch.ops.kiln, kernel.op).default, type_promotion_kind=None)(lower)

    lowering(panel_linear.FLOAT)
    lowering(panel_linear.INT8)

    def blocked_lowering(kernel: PanelKernel):
        """A kernel of int8 activations with block scales: (a, a_scale, weight, *the weight's group tensors)."""
        def lower(a, a_scale, weight, *groups):
            layout = ir.FixedLayout(a.get_device(), torch.float32, [a.get_size()[0], weight.get_size()[0]])
            return ir.TensorBox.create(CppKernel(kernel.op, kernel.source + kernel.wrapper_source, kernel.shim, layout,
                                                 realized((a, a_scale, weight, *groups))))

        register_lowering(getattr(torch.ops.kiln, kernel.op).default, type_promotion_kind=None)(lower)

    for kernel in (panel_linear.INT4, panel_linear.INT8_BLOCK, panel_linear.INT8_GROUP):  # the last two: one source
        blocked_lowering(kernel)

    def kernel_lowering(module, layout_of):
        """`module`'s op (a kernel module: SOURCE, WRAPPER_SOURCE, SHIM) lowered to its C++ kernel;
        `layout_of(*inputs)` is its output's [sizes], dtype."""
        op = getattr(torch.ops.kiln, module.LIBRARY).default

        @register_lowering(op, type_promotion_kind=None)
        def lower(*inputs):
            sizes, dtype = layout_of(*inputs)
            layout = ir.FixedLayout(inputs[0].get_device(), dtype, sizes)
            return ir.TensorBox.create(CppKernel(module.LIBRARY, module.SOURCE + module.WRAPPER_SOURCE, module.SHIM,
                                                 layout, realized(inputs)))

    kernel_lowering(decode_attention, lambda query, *rest: (list(query.get_size()), torch.float32))
    kernel_lowering(greedy_screen, lambda hidden, *rest: ([hidden.get_size()[0]], torch.int64))

    return True
