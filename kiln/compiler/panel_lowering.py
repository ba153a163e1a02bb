"""The Inductor lowering of `kiln::panel_linear` (`kiln.kernels.panel_linear`): the kernel's C++ goes
into the wrapper of the piece that calls it, and the piece calls it like one of torch's C shim
functions, from C++ with no Python, on the packed weight the piece takes as an input. The kernel is
thus compiled with the piece, for the same ISA, and ships inside the artifact's library.
"""

import functools
import inspect
import logging

import torch

from kiln.kernels import panel_linear

logger = logging.getLogger(__name__)

_SPLICED = "kiln::panel_linear"
"""The marker, among the wrapper's included headers, of a wrapper that holds the kernel's source."""


@functools.cache
def register() -> bool:
    """Register the lowering once per process (before a CPU piece is compiled); False when this torch's
    Inductor builds extern kernels differently (the compile then never chooses the kernel)."""
    try:
        from torch._inductor import ir
        from torch._inductor.lowering import register_lowering
    except ImportError:
        return False
    expected = ["self", "layout", "inputs", "constant_args", "kwargs", "python_kernel_name", "cpp_kernel_name",
                "ordered_kwargs_for_cpp_kernel", "op_overload"]
    if list(inspect.signature(ir.ExternKernelAlloc.__init__).parameters) != expected:
        logger.info("this torch's Inductor builds extern kernels differently: kiln's panel GEMM is not offered")
        return False

    class PanelLinear(ir.ExternKernelAlloc):
        def __init__(self, layout, inputs):
            super().__init__(layout, inputs, (), None, None, "aoti_torch_cpu_kiln_panel_linear", (),
                             torch.ops.kiln.panel_linear.default)

        def codegen(self, wrapper):
            headers = getattr(wrapper, "_included_extra_headers", None)
            if headers is None:
                raise RuntimeError("kiln::panel_linear lowers for AOTInductor's C++ wrapper only")
            if _SPLICED not in headers:
                headers.add(_SPLICED)
                wrapper.header.splice(panel_linear.SOURCE + panel_linear.WRAPPER_SOURCE)
            super().codegen(wrapper)

    @register_lowering(torch.ops.kiln.panel_linear.default, type_promotion_kind=None)
    def _panel_linear(x, weight, bias=None):
        inputs = [ir.ExternKernel.require_contiguous(ir.ExternKernel.realize_input(t))
                  for t in (x, weight, bias) if t is not None]
        m, n = x.get_size()[0], weight.get_size()[0]
        layout = ir.FixedLayout(x.get_device(), torch.float32, [m, n])
        return ir.TensorBox.create(PanelLinear(layout, inputs))

    return True
