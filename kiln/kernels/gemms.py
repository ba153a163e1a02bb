"""Every CPU GEMM a projection or the LM head can run on, one record each: the one place a kernel id
is written.

A record says which projection kinds it serves, why it cannot run here (ISA, torch build, shape),
how its weight is packed, how a compile times it, and what it becomes in the graph. The compile
measures the candidates of each projection and rewrites the graph to the winner
(`kiln.passes.gemm_choice`); an artifact's load packs each weight in its record's format
(`kiln.weights.packing`); the LM head picks its int8 kernel from the same records
(`kiln.models.lm_head`). Adding a kernel means adding a record here, and its op.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.kernels import cpp_lowering, packed_linear, panel_linear, quant

aten, ops = torch.ops.aten, torch.ops.kiln

KINDS = ("float", "int8", "w7a8", "fp8", "int4", "int8_blocked", "int8_grouped")
"""Projection kinds: "float" (mm/addmm), "int8" (W8A8 `scaled_mm`, activations per token or tensor), "w7a8"
(int8 with 7-bit weight codes), "fp8" (fp8 `scaled_mm`), "int4" (W4A8 `int4_block_mm`), "int8_blocked"
(W8A8 `int8_block_mm`, activations per block of 32) and "int8_grouped" (the same with a weight scale per
output channel and block of 32: llama.cpp's Q8_0)."""
INT8_KINDS = ("int8", "w7a8")


@dataclass(frozen=True)
class Projection:
    """A projection's signature: what a GEMM candidate is chosen for."""

    kind: str
    shape: tuple[int, int]  # the weight's [N, K] (int4: its codes' [N, K / 2])
    dtype: torch.dtype
    bias: bool = False
    out_dtype: torch.dtype | None = None  # scaled_mm's
    groups: int = 0  # int4: the weight's groups per row (a scale and a minimum each); int8_grouped: its scales

    @property
    def code_max(self) -> int:
        """The largest weight code of an int8 kind: 7-bit for w7a8."""
        return packed_linear.W7A8_MAX if self.kind == "w7a8" else 127

    @property
    def act_dtype(self) -> torch.dtype:
        return self.dtype if self.kind == "float" else self.out_dtype


Insert = Callable[..., object]
"""insert(target, args, kwargs=None) -> a new graph node calling `target` (the pass supplies it)."""
NextWeight = Callable[[], torch.Tensor]
"""The next copy of the packed weight a timing run reads (copies stream from memory as a model's do)."""
Runner = Callable[[Projection, NextWeight, torch.Tensor | None, torch.Tensor | tuple], Callable]
"""runner(projection, next weight, bias, weight scale (int4: its scales and minimums)) -> a call of the GEMM
on the timing inputs."""


@dataclass(frozen=True)
class GemmCandidate:
    """One GEMM kernel. `emit(insert, x, weight, bias)` builds its call in a graph and returns its
    output: for int8 and fp8 kinds the unscaled fp32 product (the pass adds `scaled_mm`'s epilogue;
    `bias` is then None); for int4 the whole fp32 product, the activation's block scales and the
    weight's group scales and minimums applied, which it gets as (a_scale, scales, mins) in `bias`'s
    place (the pass adds the bias); for blocked int8 the product with the activation's block scales
    applied, which it gets as a_scale in `bias`'s place (the pass adds the weight's scales and the bias); for
    grouped int8 the whole product, which it gets (a_scale, scales) for (the pass adds the bias).
    A runner of an int4 kernel likewise gets (scales, mins) [N, groups] as its weight scale. `pack` makes the weight format from the weight as loaded (None: the weight as
    loaded), into `out` where `plain` (a plain tensor of the weight's shape and dtype)."""

    id: str
    kinds: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] | None  # None: any of the kinds'
    about: str
    runner: Runner
    emit: Callable | None
    pack: Callable[..., torch.Tensor] | None = None
    plain: bool = False
    op: torch._ops.OpOverload | None = None  # the one kiln op it calls, where it is one
    check: Callable[[Projection], str | None] = lambda p: None

    def unavailable(self, projection: Projection) -> str | None:
        """Why this kernel cannot run `projection` on this CPU and torch, or None."""
        if projection.kind not in self.kinds:
            return f"serves {', '.join(self.kinds)} projections, not {projection.kind}"
        if self.dtypes is not None and projection.dtype not in self.dtypes:
            return f"serves {', '.join(str(d).removeprefix('torch.') for d in self.dtypes)} weights"
        return self.check(projection)

    @property
    def packed(self) -> bool:
        """Whether the weight is stored in a format of this kernel's (else the graph reads it as loaded)."""
        return self.pack is not None


def _no_onednn(projection: Projection) -> str | None:
    return None if torch.backends.mkldnn.is_available() else "this torch is built without oneDNN"


def _onednn_int8_check(projection: Projection) -> str | None:
    if not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    if not packed_linear.int8_gemm_exact(projection.code_max):
        return "oneDNN's int8 GEMM saturates on this CPU (no VNNI)"
    return None


def _fbgemm_check(projection: Projection) -> str | None:
    return None if packed_linear.fbgemm_available() else "this torch has no fbgemm quantized linear"


def _panels_check(projection: Projection) -> str | None:
    if not cpp_lowering.register():
        return "this torch's Inductor cannot compile the panel GEMMs into a piece"
    return panel_linear.available(projection.shape, projection.dtype, projection.groups,
                                  blocked=projection.kind in ("int8_blocked", "int8_grouped"))


# -- timing runners: the GEMMs alone (the graph fuses int8's shift and epilogue into other loops) --

def _aten_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    if p.kind == "float":
        return (lambda x: torch.addmm(bias, x, weight().t())) if bias is not None else (lambda x: x @ weight().t())
    if p.kind in INT8_KINDS:
        return lambda a, s: torch._int_mm(a, weight().t())
    if p.kind == "int4":
        return lambda a, s: quant.int4_block_mm(a, s, weight(), *scale, torch.float32)
    if p.kind == "int8_blocked":  # without the weight's scales, as the kernels (the graph applies them after)
        unit = torch.ones(p.shape[0])
        return lambda a, s: quant.int8_block_mm(a, s, weight(), unit, torch.float32)
    if p.kind == "int8_grouped":
        return lambda a, s: quant.int8_block_mm(a, s, weight(), scale, torch.float32)
    return lambda a, s: ops.scaled_mm(a, weight(), s, scale, p.out_dtype, bias)


def _onednn_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    return lambda x: ops.onednn_linear(x, weight(), bias)


def _onednn_int8_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    return lambda a, s: ops.onednn_int8_linear(packed_linear.shift_int8(a), weight())


def _fbgemm_int8_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    return lambda a, s: packed_linear.fbgemm_int8_linear(a, weight())


def _fbgemm_w7a8_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    return lambda a, s: packed_linear.fbgemm_w7a8_linear(a, weight())


def _fp8_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    def finish(out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = out * s * scale
        return (out + bias if bias is not None else out).to(p.out_dtype)

    return lambda a, s: finish(ops.onednn_linear(a.float(), weight(), None), s)


def _panels_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    gemm = panel_linear.timing_kernel()
    return lambda x: gemm(x, weight(), bias)


def _panels_int8_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    gemm = panel_linear.timing_kernel(panel_linear.INT8)
    return lambda a, s: gemm(a, weight())


def _panels_int4_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    gemm = panel_linear.timing_kernel(panel_linear.INT4)
    scales, mins = (panel_linear.pack_int4_groups(t) for t in scale)
    return lambda a, s: gemm(a, s, weight(), scales, mins)


def _panels_int8_block_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    gemm = panel_linear.timing_kernel(panel_linear.INT8_BLOCK)
    return lambda a, s: gemm(a, s, weight())


def _panels_int8_group_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    gemm = panel_linear.timing_kernel(panel_linear.INT8_GROUP)
    scales = panel_linear.pack_int4_groups(scale)
    return lambda a, s: gemm(a, s, weight(), scales)


def _widened_runner(p: Projection, weight: NextWeight, bias, scale) -> Callable:
    return lambda a, s: a.float() @ weight().float().t()


# -- what each becomes in the graph --

def _float_emit(op) -> Callable:
    return lambda insert, x, weight, bias: insert(op, (x, weight, bias))


def _aten_emit(insert: Insert, a, weight, bias):
    """int8: torch._int_mm, which AOTInductor calls from C++ with no Python op around it; int4 and blocked
    int8 (`bias` holds their scales): the activations dequantized to fp32 in the graph, and the weight too
    (Inductor fuses each into one loop), for torch's float GEMM: the path for CPUs without their panel GEMMs
    (neither AVX2 nor AVX-512), and blocked int8's on prefill chunks where that computes faster."""
    if weight.meta["val"].dtype == torch.uint8:
        return _dequantized_int4_emit(insert, a, weight, bias)
    if isinstance(bias, tuple):
        return _dequantized_int8_grouped_emit(insert, a, weight, bias)
    if bias is not None:
        return _dequantized_int8_blocked_emit(insert, a, weight, bias)
    sums = insert(aten._int_mm.default, (a, insert(aten.t.default, (weight,))))
    return insert(aten._to_copy.default, (sums,), {"dtype": torch.float32})


def _dequantized_int4_emit(insert: Insert, a, weight, extra):
    a_scale, scales, mins = extra
    n, half = weight.meta["val"].shape
    groups = scales.meta["val"].shape[1]
    lo = insert(aten.bitwise_and.Scalar, (weight, 0x0F))
    hi = insert(aten.bitwise_right_shift.Tensor_Scalar, (weight, 4))
    codes = insert(aten.view.default, (insert(aten.stack.default, ([lo, hi], -1)), [n, groups, 2 * half // groups]))
    wide = insert(aten._to_copy.default, (codes,), {"dtype": torch.float32})
    scale, low = (insert(aten.unsqueeze.default, (insert(aten._to_copy.default, (t,), {"dtype": torch.float32}), -1))
                  for t in (scales, mins))
    w = insert(aten.view.default, (insert(aten.add.Tensor, (insert(aten.mul.Tensor, (wide, scale)), low)), [n, 2 * half]))
    return insert(aten.mm.default, (_dequantized_rows(insert, a, a_scale, 2 * half), insert(aten.t.default, (w,))))


def _dequantized_rows(insert: Insert, a, a_scale, k: int):
    """int8 activations [M, k] with a scale per row and block of ACT_BLOCK, as fp32 in graph ops
    (`quant.dequantize_blocked`'s numbers)."""
    rows = insert(aten.view.default, (insert(aten._to_copy.default, (a,), {"dtype": torch.float32}),
                                      [-1, k // quant.ACT_BLOCK, quant.ACT_BLOCK]))
    return insert(aten.view.default, (insert(aten.mul.Tensor, (rows, insert(aten.unsqueeze.default, (a_scale, -1)))),
                                      [-1, k]))


def _dequantized_int8_blocked_emit(insert: Insert, a, weight, a_scale):
    wide = insert(aten._to_copy.default, (weight,), {"dtype": torch.float32})
    x = _dequantized_rows(insert, a, a_scale, weight.meta["val"].shape[1])
    return insert(aten.mm.default, (x, insert(aten.t.default, (wide,))))


def _dequantized_int8_grouped_emit(insert: Insert, a, weight, extra):
    a_scale, scales = extra
    n, k = weight.meta["val"].shape
    wide = insert(aten.view.default, (insert(aten._to_copy.default, (weight,), {"dtype": torch.float32}),
                                      [n, k // quant.ACT_BLOCK, quant.ACT_BLOCK]))
    scale = insert(aten.unsqueeze.default, (insert(aten._to_copy.default, (scales,), {"dtype": torch.float32}), -1))
    w = insert(aten.view.default, (insert(aten.mul.Tensor, (wide, scale)), [n, k]))
    return insert(aten.mm.default, (_dequantized_rows(insert, a, a_scale, k), insert(aten.t.default, (w,))))


def _panels_int8_group_emit(insert: Insert, a, weight, extra):
    return insert(ops.panel_int8_group_linear.default, (a, extra[0], weight, extra[1]))


def _panels_int8_block_emit(insert: Insert, a, weight, a_scale):
    return insert(ops.panel_int8_block_linear.default, (a, a_scale, weight))


def _panels_int4_emit(insert: Insert, a, weight, extra):
    return insert(ops.panel_int4_linear.default, (a, *extra[:1], weight, *extra[1:]))


def _onednn_int8_emit(insert: Insert, a, weight, bias):
    # through int32, not int16: Inductor vectorizes int32 casts, int16's run as a scalar loop
    wide = insert(aten._to_copy.default, (a,), {"dtype": torch.int32})
    shifted = insert(aten.add.Tensor, (wide, packed_linear.INT8_ZERO_POINT))
    codes = insert(aten._to_copy.default, (shifted,), {"dtype": torch.uint8})
    return insert(ops.onednn_int8_linear.default, (codes, weight))


def _fbgemm_int8_emit(insert: Insert, a, weight, bias):
    """`packed_linear.fbgemm_int8_linear`, its split and join in the graph (fused into the loops beside)."""
    half = insert(aten.div.Tensor_mode, (a, 2), {"rounding_mode": "floor"})
    rest = insert(aten.sub.Tensor, (a, insert(aten.mul.Tensor, (half, 2))))
    rows = insert(aten._to_copy.default, (insert(aten.cat.default, ([half, rest],)),), {"dtype": torch.float32})
    sums = insert(aten.view.default, (insert(ops.fbgemm_rows_linear.default, (rows, weight)),
                                      [2, -1, weight.meta["val"].shape[0]]))
    hi, lo = (insert(aten.select.int, (sums, 0, i)) for i in (0, 1))
    return insert(aten.add.Tensor, (insert(aten.mul.Tensor, (hi, 2)), lo))


def _fbgemm_w7a8_emit(insert: Insert, a, weight, bias):
    rows = insert(aten._to_copy.default, (a,), {"dtype": torch.float32})
    return insert(ops.fbgemm_rows_linear.default, (rows, weight, packed_linear.W7A8_ZERO_POINT))


def _panels_int8_emit(insert: Insert, a, weight, bias):
    return insert(ops.panel_int8_linear.default, (a, weight))


def _widened_emit(insert: Insert, a, weight, bias):
    wide = insert(aten._to_copy.default, (weight,), {"dtype": torch.float32})
    rows = insert(aten._to_copy.default, (a,), {"dtype": torch.float32})
    return insert(aten.mm.default, (rows, insert(aten.t.default, (wide,))))


def _fp8_emit(insert: Insert, a, weight, bias):
    wide = insert(aten._to_copy.default, (a,), {"dtype": torch.float32})
    return insert(ops.onednn_linear.default, (wide, weight, None))


ATEN = GemmCandidate("aten", KINDS, None, "torch's GEMM on the weight as loaded (what Inductor calls for mm/addmm, "
                     "and scaled_mm's native form): the baseline every candidate is measured against; int8 "
                     "projections become torch._int_mm, int4 ones dequantize in the graph", _aten_runner, _aten_emit)
ONEDNN = GemmCandidate("onednn", ("float",), None, "oneDNN blocked layout (fp32/bf16), for kiln::onednn_linear",
                       _onednn_runner, _float_emit(ops.onednn_linear.default), packed_linear.pack_onednn,
                       op=ops.onednn_linear.default, check=_no_onednn)
ONEDNN_INT8 = GemmCandidate("onednn_int8", INT8_KINDS, (torch.int8,),
                            "oneDNN int8 layout, for kiln::onednn_int8_linear (exact only with VNNI or AMX, "
                            "or on 7-bit codes)", _onednn_int8_runner, _onednn_int8_emit,
                            packed_linear.pack_onednn_int8, op=ops.onednn_int8_linear.default,
                            check=_onednn_int8_check)
FBGEMM_INT8 = GemmCandidate("fbgemm_int8", ("int8",), (torch.int8,),
                            "fbgemm's packed int8 weight; 8-bit activations split in two rows each so that AVX2's "
                            "int16 pair sums cannot saturate", _fbgemm_int8_runner, _fbgemm_int8_emit,
                            packed_linear.pack_fbgemm, op=ops.fbgemm_rows_linear.default, check=_fbgemm_check)
FBGEMM_W7A8 = GemmCandidate("fbgemm_w7a8", ("w7a8",), (torch.int8,),
                            "fbgemm's packed weight of 7-bit codes, activations whole", _fbgemm_w7a8_runner,
                            _fbgemm_w7a8_emit, packed_linear.pack_fbgemm, op=ops.fbgemm_rows_linear.default,
                            check=_fbgemm_check)
ONEDNN_FP8 = GemmCandidate("onednn_fp8_as_fp32", ("fp8",), (torch.float8_e4m3fn,),
                           "fp8 codes widened to fp32 once, oneDNN blocked layout, for kiln::onednn_linear",
                           _fp8_runner, _fp8_emit, packed_linear.pack_onednn_widened, op=ops.onednn_linear.default,
                           check=_no_onednn)
PANELS16 = GemmCandidate("panels16", ("float",), (torch.float32,),
                         "kiln's fp32 panel GEMM for decode batches: panels of 16 output channels, compiled into "
                         "the piece", _panels_runner, _float_emit(ops.panel_linear.default), panel_linear.pack,
                         plain=True, op=ops.panel_linear.default, check=_panels_check)
PANELS16_INT8 = GemmCandidate("panels16_int8", INT8_KINDS, (torch.int8,),
                              "kiln's int8 panel GEMM: panels of 16 output channels, codes + 128",
                              _panels_int8_runner, _panels_int8_emit, panel_linear.pack_int8, plain=True,
                              op=ops.panel_int8_linear.default, check=_panels_check)
PANELS8_INT4 = GemmCandidate("panels8_int4", ("int4",), (torch.uint8,),
                             "kiln's W4A8 panel GEMM (AVX2, or AVX-512 VNNI's 256-bit dot product): panels of 8 "
                             "output channels, 8 K of them a 32-byte line of 4-bit codes, unpacked in registers",
                             _panels_int4_runner, _panels_int4_emit, panel_linear.pack_int4, plain=True,
                             op=ops.panel_int4_linear.default, check=_panels_check)
PANELS8_INT8_BLOCK = GemmCandidate("panels8_int8_blocked", ("int8_blocked",), (torch.int8,),
                                   "kiln's W8A8 panel GEMM with activation blocks (AVX2, or AVX-512 VNNI's 256-bit "
                                   "dot product): panels of 8 output channels, 4 K of them a 32-byte line, each "
                                   "block of 32 K summed exactly, times its scale", _panels_int8_block_runner,
                                   _panels_int8_block_emit, panel_linear.pack_int8_blocked, plain=True,
                                   op=ops.panel_int8_block_linear.default, check=_panels_check)
PANELS8_INT8_GROUP = GemmCandidate("panels8_int8_grouped", ("int8_grouped",), (torch.int8,),
                                   "kiln's W8A8 panel GEMM with activation blocks, each block's sum also times its "
                                   "weight scale (fp16, per output channel): the blocked kernel's panels",
                                   _panels_int8_group_runner, _panels_int8_group_emit, panel_linear.pack_int8_blocked,
                                   plain=True, op=ops.panel_int8_group_linear.default, check=_panels_check)
INT4_GROUPS = GemmCandidate("panels8_int4_groups", (), None, "the group scales and minimums (fp16) of a weight on "
                            "kiln's W4A8 panel GEMM or the grouped int8 one, each panel's [groups, 8] in order (a "
                            "format, never a kernel of its own)", _aten_runner, None, panel_linear.pack_int4_groups,
                            plain=True)
WIDENED = GemmCandidate("widened", INT8_KINDS, (torch.int8,),
                        "int8 codes widened to fp32 per call for torch's float GEMM (exact: integer products): "
                        "where a CPU's int8 GEMMs are slow, large prefill chunks compute faster so",
                        _widened_runner, _widened_emit)

ALL = (ONEDNN, ONEDNN_INT8, FBGEMM_INT8, FBGEMM_W7A8, ONEDNN_FP8, PANELS16, PANELS16_INT8, PANELS8_INT4,
       PANELS8_INT8_BLOCK, PANELS8_INT8_GROUP, WIDENED)
"""The candidates, in the order they are tried (ties go to the earlier)."""
BY_ID = {c.id: c for c in (ATEN, *ALL)}
FORMATS = {c.id: c for c in (*ALL, INT4_GROUPS) if c.packed}
"""The weight formats: a packed candidate's format has its id (and the int4 panel GEMM's group scales and
minimums have theirs)."""
SCALE_FORMATS = {PANELS8_INT4.id: INT4_GROUPS.id, PANELS8_INT8_GROUP.id: INT4_GROUPS.id}
"""The format of the group scales (and minimums) a kernel reads beside its weight, where it packs them too."""
PLAIN_FORMATS = tuple(c.id for c in (*ALL, INT4_GROUPS) if c.plain)
"""Formats whose packed weight is a plain tensor of the weight's shape and dtype, which `pack` can write
into memory given to it (the pack cache gives a file's)."""


def for_kind(kind: str) -> tuple[GemmCandidate, ...]:
    """The candidates a projection of `kind` is measured with against torch's GEMM."""
    return tuple(c for c in ALL if kind in c.kinds)


def pack(format: str, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`weight` [N, K] as loaded -> the tensor a compiled graph passes to the format's kernel; written
    into `out` (contiguous, of the weight's shape and dtype) if given, for a format in PLAIN_FORMATS."""
    candidate = FORMATS[format]
    with torch.no_grad():
        if out is None:
            return candidate.pack(weight.detach())
        if not candidate.plain:
            raise ValueError(f"weight format {format!r} packs into memory of its own, not into `out`")
        return candidate.pack(weight.detach(), out=out)


def int8_head_kernel(seven_bit: bool = False) -> GemmCandidate | None:
    """The int8 GEMM an LM head runs on this CPU without measuring: oneDNN's where it is exact (VNNI
    or AMX), else fbgemm's (on 7-bit codes as they are, on 8-bit ones through split rows); None where
    neither is."""
    probe = Projection("int8", (0, 0), torch.int8)
    if ONEDNN_INT8.check(probe) is None:
        return ONEDNN_INT8
    fbgemm = FBGEMM_W7A8 if seven_bit else FBGEMM_INT8
    return fbgemm if fbgemm.check(probe) is None else None


HEAD_CANDIDATES = (ONEDNN, PANELS16)
"""The kernels an fp32 LM head is measured with (it runs outside the graph: a panel GEMM chosen for it
ships as a library of its own)."""
SCREEN_CANDIDATES = (ONEDNN_INT8, PANELS16_INT8)
"""The int8 GEMMs the LM head's greedy screen is measured with."""
