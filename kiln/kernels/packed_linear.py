"""Projections on weights packed once at load time into the layout a CPU kernel wants: oneDNN's
blocked float GEMM, and its int8 GEMM (VNNI or AMX where the CPU has them).

The artifact stays independent of the weights: a compiled graph calls these ops on a weight input,
the manifest records which weights take which format, and the runtime packs them (`pack`) when it
binds the program to a model. Which projections use them is measured at compile time
(`kiln.passes.gemm_choice`). A packed weight is an opaque oneDNN tensor of the weight's shape and
dtype; each op also accepts the plain [N, K] weight, so the ops have a reference on any input.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

INT8_ZERO_POINT = 128
"""oneDNN's int8 GEMM takes unsigned activations: kiln's int8 codes are passed shifted by 128."""


@dataclass(frozen=True)
class WeightFormat:
    """How a weight is stored for its kernel: `pack` makes it from the weight as loaded."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]
    about: str


def _onednn_float(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def _onednn_int8(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(w.contiguous(), None)


def _onednn_fp8_widened(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.float())


FORMATS = {f.name: f for f in (
    WeightFormat("onednn", _onednn_float, "oneDNN blocked layout (fp32/bf16), for kiln::onednn_linear"),
    WeightFormat("onednn_int8", _onednn_int8, "oneDNN int8 layout, for kiln::onednn_int8_linear"),
    WeightFormat("onednn_fp8_as_fp32", _onednn_fp8_widened,
                 "fp8 codes widened to fp32 once, oneDNN blocked layout, for kiln::onednn_linear"),
)}


def pack(format_name: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as loaded -> the tensor a compiled graph passes to the format's kernel."""
    with torch.no_grad():
        return FORMATS[format_name].pack(weight.detach())


def is_packed(weight: torch.Tensor) -> bool:
    return weight.layout == torch._mkldnn


@torch.library.custom_op("kiln::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), in x's dtype, with `weight` [N, K] packed by the "onednn"
    (or "onednn_fp8_as_fp32") format or plain."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


_ZERO = torch.zeros((), dtype=torch.int64)
_ONES: dict[int, torch.Tensor] = {}


@torch.library.custom_op("kiln::onednn_int8_linear", mutates_args=())
def onednn_int8_linear(a_shifted: torch.Tensor, weight: torch.Tensor,
                       weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """(a - 128) @ weight.T in fp32, accumulated in int32: `a_shifted` [M, K] uint8 holds int8
    activation codes plus 128 (what oneDNN's u8 x s8 GEMM takes), `weight` [N, K] int8 is packed by the
    "onednn_int8" format or plain. Without `weight_scale` the numbers are `torch._int_mm`'s (the caller
    scales them); with it ([N] fp32), each output channel is scaled in oneDNN's epilogue."""
    if not is_packed(weight):  # oneDNN reads only its own layout (a plain weight crashes it): pack for this call
        weight = pack("onednn_int8", weight)
    if weight_scale is None:
        n = weight.shape[1]  # packed as [K, N]
        if n not in _ONES:
            _ONES[n] = torch.ones(n)
        weight_scale = _ONES[n]
    return torch.ops.onednn.qlinear_pointwise(a_shifted, 1.0, INT8_ZERO_POINT, weight, weight_scale.float(), _ZERO,
                                              None, 1.0, 0, torch.float32, "none", [], "")


@onednn_int8_linear.register_fake
def _(a_shifted, weight, weight_scale=None):
    return a_shifted.new_empty((a_shifted.shape[0], weight.shape[0]), dtype=torch.float32)


def shift_int8(a: torch.Tensor) -> torch.Tensor:
    """int8 codes -> the uint8 form `onednn_int8_linear` takes."""
    return (a.to(torch.int16) + INT8_ZERO_POINT).to(torch.uint8)


@functools.cache
def int8_gemm_exact() -> bool:
    """Whether oneDNN's u8 x s8 GEMM is exact on this CPU for the extreme codes (+-127 activations
    and weights over a long row). Without VNNI, x86 int8 GEMMs add pairs of products in int16,
    which saturates there: such a kernel gives wrong numbers and must not be chosen."""
    if not torch.backends.mkldnn.is_available():
        return False
    k = 4096
    a = torch.full((4, k), 127, dtype=torch.int8)
    a[1], a[2, ::2] = -127, -127
    w = torch.full((32, k), 127, dtype=torch.int8)
    w[::3] = -127
    try:
        out = onednn_int8_linear(shift_int8(a), pack("onednn_int8", w))
    except RuntimeError:
        return False
    return torch.equal(out.double(), a.double() @ w.double().t())
