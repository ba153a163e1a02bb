"""kiln's op set ("kiln IR"): torch.library custom ops that graph passes see whole.

Each op has a schema, a fake impl for tracing, and a native torch impl (the reference and the CPU
path). Importing this package registers them under `torch.ops.kiln`; on CPU the dispatcher calls
each op's function directly (`_direct_cpu_kernels`).
"""

from kiln.kernels import decode_attention, panel_linear  # noqa: F401  register their ops with the ones below
from kiln.kernels.activation import silu_and_mul
from kiln.kernels.attention import AttentionMetadata, attention
from kiln.kernels.attention_quant import attention_quant
from kiln.kernels.collective import (all_gather, all_reduce, all_reduce_fused_add_rms_norm,
                                     all_reduce_fused_add_rms_norm_quant)
from kiln.kernels.fused_quant import fused_add_rms_norm_quant, rms_norm_quant, silu_and_mul_quant
from kiln.kernels.kv_cache import kv_cache_write
from kiln.kernels.moe import fused_moe
from kiln.kernels.norm import fused_add_rms_norm, rms_norm
from kiln.kernels.packed_linear import onednn_int8_linear, onednn_linear
from kiln.kernels.quant import quant_fp8, quant_int8, quantize_weight, scaled_mm
from kiln.kernels.rope_kv_cache import rotary_embedding_kv_cache_write
from kiln.kernels.rotary import rope_cos_sin_cache, rotary_embedding

__all__ = [
    "AttentionMetadata",
    "all_gather",
    "all_reduce",
    "all_reduce_fused_add_rms_norm",
    "all_reduce_fused_add_rms_norm_quant",
    "attention",
    "attention_quant",
    "fused_add_rms_norm",
    "fused_add_rms_norm_quant",
    "fused_moe",
    "kv_cache_write",
    "onednn_int8_linear",
    "onednn_linear",
    "quant_fp8",
    "quant_int8",
    "quantize_weight",
    "rms_norm",
    "rms_norm_quant",
    "rope_cos_sin_cache",
    "rotary_embedding",
    "rotary_embedding_kv_cache_write",
    "scaled_mm",
    "silu_and_mul",
    "silu_and_mul_quant",
]


def _register_triton_kernels() -> None:
    """On a CUDA machine with triton, kiln's Triton kernels serve the ops for CUDA tensors; a CPU
    process never imports triton."""
    import importlib.util

    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        from kiln.kernels.triton import register

        register()


def _no_lazy_dynamo_import() -> None:
    """torch wraps each custom op's implementation to import torch._dynamo on its first call (about a
    second, paid by the first request of every `kiln serve`). Dynamo never runs these
    implementations (it records the op whole), so each is marked as already wrapped. A torch that
    wraps differently leaves the attribute unread."""
    from torch._library.custom_ops import OPDEFS

    for name, opdef in list(OPDEFS.items()):
        if name.startswith("kiln::"):
            for backend in opdef._backend_fns.values():
                inner = getattr(backend, "__wrapped__", None)
                if inner is not None and not hasattr(inner, "__dynamo_disable"):
                    setattr(inner, "__dynamo_disable", inner)


def _direct_cpu_kernels() -> None:
    """torch calls a custom op's implementation through a Python wrapper (argument and aliasing checks
    on every call), and a CPU decode step of a 24-layer model calls ~150 kiln ops. Each op's own
    function is also registered as its CPU kernel, which the dispatcher calls straight, some
    microseconds a call less. The same function serves MkldnnCPU, the key a call dispatches on
    when it passes a packed oneDNN weight (else it falls through to the wrapper). Tracing still sees
    each op whole through its fake impl. An op with a CPU kernel of its own, or a torch that keeps
    the function elsewhere, keeps the wrapper."""
    import torch
    from torch._library.custom_ops import OPDEFS

    lib = torch.library.Library("kiln", "IMPL")
    for name, opdef in list(OPDEFS.items()):
        fn = getattr(opdef, "_init_fn", None)
        if name.startswith("kiln::") and fn is not None and "cpu" not in getattr(opdef, "_backend_fns", {}):
            for key in ("CPU", "MkldnnCPU"):
                lib.impl(name.removeprefix("kiln::"), fn, key)
    _LIBRARIES.append(lib)  # a Library unregisters its kernels when it is garbage collected


_LIBRARIES: list = []
_register_triton_kernels()
_no_lazy_dynamo_import()
_direct_cpu_kernels()
