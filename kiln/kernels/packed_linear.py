"""Projections on weights packed once at load time into the layout a library's kernel wants: oneDNN's
blocked float GEMM, its int8 GEMM (VNNI or AMX where the CPU has them), and fbgemm's int8 GEMM (fast
on AVX2 CPUs without VNNI, made exact there by splitting the activations, or by 7-bit weight codes).
kiln's own panel GEMMs are `kiln.kernels.panel_linear`; `kiln.kernels.gemms` lists them all.

The artifact stays independent of the weights: a compiled graph calls these ops on a weight input,
the manifest records which weights take which format, and the runtime packs them (`gemms.pack`) when
it binds the program to a model. Which projections use them is measured at compile time
(`kiln.passes.gemm_choice`). A packed weight is an opaque oneDNN tensor of the weight's shape and
dtype; each op also accepts the plain [N, K] weight, so the ops have a reference on any input.
"""

import functools
import warnings

import torch

ops = torch.ops.kiln

INT8_ZERO_POINT = 128
"""oneDNN's int8 GEMM takes unsigned activations: kiln's int8 codes are passed shifted by 128."""


def pack_onednn(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32/bf16 -> oneDNN's blocked layout, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous())


def pack_onednn_int8(w: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 codes -> oneDNN's int8 layout, for `onednn_int8_linear`."""
    return torch.ops.onednn.qlinear_prepack(w.contiguous(), None)


def pack_onednn_widened(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp8 codes widened to fp32 once, in oneDNN's blocked layout, for `onednn_linear`."""
    return torch.ops.mkldnn._reorder_linear_weight(w.float())


FBGEMM_ZERO_POINT = 64
"""fbgemm's int8 GEMM multiplies unsigned activations by signed weights and, without VNNI, adds each
pair of products in int16 (`vpmaddubsw`), which saturates for 8-bit codes. `fbgemm_int8_linear` splits
each int8 code a into 2*hi + lo (hi in [-64, 63], lo in {0, 1}) and runs both halves as rows of one
GEMM, shifted by this: every code it sees is in [0, 127], where a pair cannot saturate."""

W7A8_MAX = 63
"""The largest weight code of the W7A8 scheme: full int8 activations shifted to [1, 255] times
weights in [-63, 63] cannot saturate a pair (2 x 255 x 63 = 32130 < 32767), so fbgemm's kernel
runs them directly, on half the rows of the split."""
W7A8_ZERO_POINT = 128


def pack_fbgemm(w: torch.Tensor) -> torch.Tensor:
    """An [N, K] handle (one byte, broadcast) carrying fbgemm's packed weight: the compiled graph
    passes tensors only, and hands this one to `kiln::fbgemm_rows_linear` untouched."""
    handle = torch.zeros((), dtype=torch.int8).expand(w.shape)
    handle.fbgemm_packed = _fbgemm_prepack(w)
    return handle


def _fbgemm_prepack(w: torch.Tensor):
    """w [N, K] int8 codes -> fbgemm's packed weight, scale 1: the GEMM returns the plain sums."""
    engine = torch.backends.quantized.engine
    try:
        torch.backends.quantized.engine = "fbgemm"
        with warnings.catch_warnings():  # torch marks quantized tensors deprecated; the packed GEMM is what we want
            warnings.simplefilter("ignore", UserWarning)
            codes = torch._make_per_tensor_quantized_tensor(w.contiguous(), 1.0, 0)
            return torch.ops.quantized.linear_prepack(codes, None)
    finally:
        torch.backends.quantized.engine = engine


def is_packed(weight: torch.Tensor) -> bool:
    return weight.layout == torch._mkldnn or hasattr(weight, "fbgemm_packed")


@torch.library.custom_op("kiln::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias), in x's dtype, with `weight` [N, K] packed by `pack_onednn` (or
    `pack_onednn_widened`) or plain."""
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
    activation codes plus 128 (what oneDNN's u8 x s8 GEMM takes), `weight` [N, K] int8 is packed by
    `pack_onednn_int8` or plain. Without `weight_scale` the numbers are `torch._int_mm`'s (the caller
    scales them); with it ([N] fp32), each output channel is scaled in oneDNN's epilogue."""
    if not is_packed(weight):  # oneDNN reads only its own layout (a plain weight crashes it): pack for this call
        weight = pack_onednn_int8(weight)
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


def split_int8(a: torch.Tensor) -> torch.Tensor:
    """int8 codes [M, K] -> fp32 rows [2M, K]: hi = floor(a / 2) over lo = a - 2 hi, so a = 2 hi + lo
    with every value in [-64, 63] (see FBGEMM_ZERO_POINT)."""
    hi = torch.div(a, 2, rounding_mode="floor")
    return torch.cat([hi, a - 2 * hi]).float()


def join_int8(out: torch.Tensor) -> torch.Tensor:
    """`fbgemm_rows_linear`'s [2M, N] sums of split rows -> the [M, N] sums of the codes."""
    hi, lo = out.view(2, out.shape[0] // 2, out.shape[1]).unbind(0)
    return hi * 2 + lo


@torch.library.custom_op("kiln::fbgemm_rows_linear", mutates_args=())
def fbgemm_rows_linear(rows: torch.Tensor, weight: torch.Tensor,
                       zero_point: int = FBGEMM_ZERO_POINT) -> torch.Tensor:
    """rows @ weight.T in fp32 from int32 sums: `rows` [R, K] fp32 holds integers that fbgemm takes as
    unsigned codes `rows + zero_point`, `weight` [N, K] int8 is packed by `pack_fbgemm` or plain.
    Exact for rows in [-64, 63] at the default zero point (`split_int8`: the compiled graph splits and
    joins around it, where Inductor fuses both into the loops beside), and for int8 rows at
    W7A8_ZERO_POINT when every weight code is within W7A8_MAX."""
    if hasattr(weight, "fbgemm_packed"):
        packed = weight.fbgemm_packed
    elif weight.stride() == (0, 0):  # a handle whose packed weight did not come with it: its codes are not here
        raise RuntimeError("kiln::fbgemm_rows_linear got an fbgemm_int8 handle without its packed weight")
    else:
        packed = _fbgemm_prepack(weight)
    return torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(rows, 1.0, zero_point, packed)


@fbgemm_rows_linear.register_fake
def _(rows, weight, zero_point=FBGEMM_ZERO_POINT):
    return rows.new_empty((rows.shape[0], weight.shape[0]), dtype=torch.float32)


def fbgemm_int8_linear(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a @ weight.T in fp32 from exact int32 sums (`torch._int_mm`'s numbers; the caller scales them):
    `a` [M, K] int8 codes, `weight` as `fbgemm_rows_linear` takes it. fbgemm's AVX2 kernel would
    saturate on full 8-bit codes, so the codes are split in two (FBGEMM_ZERO_POINT) and the M rows
    become 2M; at decode sizes the GEMM streams the weight once either way."""
    return join_int8(ops.fbgemm_rows_linear(split_int8(a), weight))


def fbgemm_w7a8_linear(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a @ weight.T in fp32 from exact int32 sums, for weights whose codes are within W7A8_MAX (the
    "w7a8" scheme): `a` [M, K] int8 codes go to fbgemm whole, one row each."""
    return ops.fbgemm_rows_linear(a.float(), weight, W7A8_ZERO_POINT)


@functools.cache
def fbgemm_available() -> bool:
    """Whether this torch has fbgemm's quantized linear (deprecated with quantized tensors; absent on
    non-x86 builds)."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        a = torch.tensor([[127, -127, 3]], dtype=torch.int8)
        w = torch.tensor([[127, 127, -5], [-127, 1, 0]], dtype=torch.int8)
        return torch.equal(fbgemm_int8_linear(a, pack_fbgemm(w)), a.float() @ w.float().t())
    except (RuntimeError, AttributeError):
        return False


def shift_int8(a: torch.Tensor) -> torch.Tensor:
    """int8 codes -> the uint8 form `onednn_int8_linear` takes."""
    return (a.to(torch.int32) + INT8_ZERO_POINT).to(torch.uint8)


@functools.cache
def int8_gemm_exact(weight_max: int = 127) -> bool:
    """Whether oneDNN's u8 x s8 GEMM is exact on this CPU for the extreme codes (+-127 activations
    and +-`weight_max` weights over a long row). Without VNNI, x86 int8 GEMMs add pairs of products
    in int16, which saturates for 8-bit weights: such a kernel gives wrong numbers and must not be
    chosen. For 7-bit weights (W7A8_MAX) no pair saturates, and it is exact there too."""
    if not torch.backends.mkldnn.is_available():
        return False
    k = 4096
    a = torch.full((4, k), 127, dtype=torch.int8)
    a[1], a[2, ::2] = -127, -127
    w = torch.full((32, k), weight_max, dtype=torch.int8)
    w[::3] = -weight_max
    w[1::3, 1::2] = weight_max - 1  # odd and even codes: a kernel that halves the weights rounds one of them
    try:
        out = onednn_int8_linear(shift_int8(a), pack_onednn_int8(w))
    except RuntimeError:
        return False
    return torch.equal(out.double(), a.double() @ w.double().t())
