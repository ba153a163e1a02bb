"""kiln's GEMMs for decode batches on x86 CPUs: fp32 and int8 on AVX-512 (int8 with VNNI), the weight
packed in panels of 16 output channels, each panel's K x 16 block contiguous, streamed once per call
while up to 16 token rows accumulate in registers, with the panel 16 KB ahead prefetched; and int4
(W4A8) and int8 with activation blocks (W8A8, a scale per 32) on AVX2 or AVX-512, in panels of 8.

At decode sizes a projection reads its weight from memory, and oneDNN's fp32 GEMM does not keep the
memory busy while it computes: this kernel runs close to the time it takes to stream the weight, and
so do the int8 kernel (`vpdpbusd`, four K per instruction) and the int4 kernel (4-bit codes unpacked
to bytes in registers, each block of 32 K's exact integer sums times its scales); on small
projections oneDNN's per-call costs outweigh the GEMM. docs/cpu.md has the measurements; the compile
times the kernels against the others on every projection (`kiln.passes.gemm_choice`).

Each kernel is C++ that AOTInductor compiles into the piece that calls it
(`kiln.kernels.cpp_lowering` splices its `PanelKernel` sources into the generated wrapper), so it
ships in the artifact like Inductor's own kernels and loading needs no compiler. At compile time, where a compiler
is at hand, `timing_kernel` builds the same source alone to time it against the other kernels
(`kiln.passes.gemm_choice`). Each op's own function is the reference: it unpacks the weight.
"""

import ctypes
import functools
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.kernels import cpp_source, quant
from kiln.kernels.quant import ACT_BLOCK

PANEL = 16
"""Output channels a panel holds: one AVX-512 register of fp32 (the kernels' KILN_PANEL, csrc/panel.h)."""
INT4_PANEL = 8
"""Output channels a panel of the int4 and blocked int8 kernels holds: one AVX2 register of fp32
(csrc/panel_int4_linear.cpp, csrc/panel_int8_block_linear.cpp)."""
PREFETCH_LINES = 256
"""How far ahead of the row being multiplied the kernel prefetches its weight, in 64-byte lines
(a K x 16 panel row is one line): chosen by timing; nearer left the GEMM waiting on memory. The kernels' KILN_PREFETCH_LINES (csrc/panel.h)."""

SOURCE = cpp_source.read("panel_linear.cpp")
"""The fp32 kernel's C++ (csrc/panel_linear.cpp), with its C entry point `kiln_panel_gemm`."""
INT8_SOURCE = cpp_source.read("panel_int8_linear.cpp")
"""The int8 kernel's C++ (csrc/panel_int8_linear.cpp), with its C entry point `kiln_panel_int8_gemm`."""
WRAPPER_SOURCE = cpp_source.read("panel_linear_shim.cpp")
"""kiln::panel_linear as a C shim function, which a piece's wrapper calls like torch's own."""
INT8_WRAPPER_SOURCE = cpp_source.read("panel_int8_linear_shim.cpp")
"""kiln::panel_int8_linear as a C shim function."""
INT4_SOURCE = cpp_source.read("panel_int4_linear.cpp")
"""The int4 kernel's C++ (csrc/panel_int4_linear.cpp), with its C entry point `kiln_panel_int4_gemm`."""
INT4_WRAPPER_SOURCE = cpp_source.read("panel_int4_linear_shim.cpp")
"""kiln::panel_int4_linear as a C shim function."""
INT8_BLOCK_SOURCE = cpp_source.read("panel_int8_block_linear.cpp")
"""The blocked int8 kernel's C++ (csrc/panel_int8_block_linear.cpp), with its C entry point
`kiln_panel_int8_block_gemm`."""
INT8_BLOCK_WRAPPER_SOURCE = cpp_source.read("panel_int8_block_linear_shim.cpp")
"""kiln::panel_int8_block_linear as a C shim function."""


@dataclass(frozen=True)
class PanelKernel:
    """One of the panel GEMMs, as a compiled piece calls it and as the compile times it."""

    op: str
    """The op a graph calls, `kiln::<op>`."""
    source: str
    """The kernel's C++, with its C entry point `entry` (what the timing build calls)."""
    entry: str
    wrapper_source: str
    """The C shim function `shim` that calls `entry` from the piece's wrapper."""
    shim: str
    isa: tuple[str, ...]
    """The compile flags of which the kernel needs one among Inductor's for this CPU."""
    takes_bias: bool
    """Whether `entry` takes a bias pointer after the weight's."""
    w4a8: bool = False
    """Whether `entry` is the int4 kernel's: the activations' block scales after them, the weight's group scales
    and minimums after it, and the group count after K."""
    blocked: bool = False
    """Whether `entry` takes the activations' block scales after them (the blocked int8 kernels)."""
    grouped: bool = False
    """Whether `entry` also takes the weight's fp16 scales per block after it (the grouped int8 kernel)."""


FLOAT = PanelKernel("panel_linear", SOURCE, "kiln_panel_gemm", WRAPPER_SOURCE, "aoti_torch_cpu_kiln_panel_linear",
                    ("-mavx512f",), takes_bias=True)
INT8 = PanelKernel("panel_int8_linear", INT8_SOURCE, "kiln_panel_int8_gemm", INT8_WRAPPER_SOURCE,
                   "aoti_torch_cpu_kiln_panel_int8_linear", ("-mavx512vnni",), takes_bias=False)
INT4 = PanelKernel("panel_int4_linear", INT4_SOURCE, "kiln_panel_int4_gemm", INT4_WRAPPER_SOURCE,
                   "aoti_torch_cpu_kiln_panel_int4_linear", ("-mavx2", "-mavx512f"), takes_bias=False, w4a8=True)
INT8_BLOCK = PanelKernel("panel_int8_block_linear", INT8_BLOCK_SOURCE, "kiln_panel_int8_block_gemm",
                         INT8_BLOCK_WRAPPER_SOURCE, "aoti_torch_cpu_kiln_panel_int8_block_linear",
                         ("-mavx2", "-mavx512f"), takes_bias=False, blocked=True)
INT8_GROUP = PanelKernel("panel_int8_group_linear", INT8_BLOCK_SOURCE, "kiln_panel_int8_group_gemm",
                         INT8_BLOCK_WRAPPER_SOURCE, "aoti_torch_cpu_kiln_panel_int8_group_linear",
                         ("-mavx2", "-mavx512f"), takes_bias=False, blocked=True, grouped=True)
"""The blocked int8 kernel with a weight scale per output channel and block (llama.cpp's Q8_0): the same C++."""


def pack(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] fp32 weight -> the same shape and strides holding its panels: a compiled graph takes it
    where it took the weight (the int4 kernel's [N, groups] scales are packed so too). Written into
    `out` (a contiguous [N, K] tensor of w's dtype) if given, else into a new tensor
    (`kiln.weights.formats` gives memory on huge pages). N must be a multiple of PANEL."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=w.dtype) if out is None else out
    out.view(n // PANEL, k, PANEL).copy_(w.reshape(n // PANEL, PANEL, k).transpose(1, 2))
    return out


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The weight `pack` was given."""
    n, k = packed.shape
    return packed.view(n // PANEL, k, PANEL).transpose(1, 2).reshape(n, k)


def pack_int8(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] int8 codes -> the same shape holding, per panel, each group of 4 K of its 16 channels
    together ([K / 4, 16, 4]), as unsigned codes w + 128 in int8's bytes; written into `out` (a
    contiguous [N, K] int8 tensor) if given, else into a new tensor. N must be a multiple of PANEL
    and K of 4."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.int8) if out is None else out
    panels = out.view(n // PANEL, k // 4, PANEL, 4)
    panels.copy_(w.reshape(n // PANEL, PANEL, k // 4, 4).transpose(1, 2))
    panels.view(torch.uint8).bitwise_xor_(0x80)
    return out


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack_int8` was given."""
    n, k = packed.shape
    panels = (packed.view(torch.uint8) ^ 0x80).view(torch.int8).view(n // PANEL, k // 4, PANEL, 4)
    return panels.transpose(1, 2).reshape(n, k)


def pack_int8_blocked(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] int8 codes -> the same shape holding, per panel of INT4_PANEL channels, each 4 K of them in one
    32-byte line ([K / 4, 8, 4]), for the blocked int8 kernel; written into `out` (a contiguous [N, K] int8
    tensor) if given. N must be a multiple of INT4_PANEL and K of 4."""
    n, k = w.shape
    out = torch.empty((n, k), dtype=torch.int8) if out is None else out
    out.view(n // INT4_PANEL, k // 4, INT4_PANEL, 4).copy_(w.reshape(n // INT4_PANEL, INT4_PANEL, k // 4, 4).transpose(1, 2))
    return out


def unpack_int8_blocked(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack_int8_blocked` was given."""
    n, k = packed.shape
    return packed.view(n // INT4_PANEL, k // 4, INT4_PANEL, 4).transpose(1, 2).reshape(n, k)


def pack_int4(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K / 2] 4-bit codes as loaded (`kiln.kernels.quant.pack_nibbles`) -> the same shape holding, per
    panel of INT4_PANEL channels, each 8 K of them in one 32-byte line: byte 4c + j holds channel c's K j in
    the low nibble and K 4 + j in the high one. Written into `out` (a contiguous [N, K / 2] uint8 tensor) if
    given. N must be a multiple of INT4_PANEL and K of 8."""
    n, half = w.shape
    lo, hi = (w & 0x0F), (w >> 4)
    codes = torch.stack((lo, hi), dim=-1).view(n // INT4_PANEL, INT4_PANEL, half // 4, 2, 4)  # [P, c, line, h, j]
    lines = codes[:, :, :, 0] | (codes[:, :, :, 1] << 4)  # [P, c, line, j]
    out = torch.empty((n, half), dtype=torch.uint8) if out is None else out
    out.view(n // INT4_PANEL, half // 4, INT4_PANEL, 4).copy_(lines.transpose(1, 2))
    return out


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack_int4` was given."""
    n, half = packed.shape
    lines = packed.view(n // INT4_PANEL, half // 4, INT4_PANEL, 4).transpose(1, 2)  # [P, c, line, j]
    codes = torch.stack((lines & 0x0F, lines >> 4), dim=3)  # [P, c, line, h, j]
    codes = codes.reshape(n, half * 2)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def pack_int4_groups(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """An int4 weight's scales or minimums [N, groups] (fp16) -> the same shape holding each panel's
    [groups, INT4_PANEL] in order, which the kernel reads beside the panel's codes."""
    n, groups = t.shape
    out = torch.empty_like(t) if out is None else out
    out.view(n // INT4_PANEL, groups, INT4_PANEL).copy_(t.reshape(n // INT4_PANEL, INT4_PANEL, groups).transpose(1, 2))
    return out


def unpack_int4_groups(packed: torch.Tensor) -> torch.Tensor:
    """The scales or minimums `pack_int4_groups` was given."""
    n, groups = packed.shape
    return packed.view(n // INT4_PANEL, groups, INT4_PANEL).transpose(1, 2).reshape(n, groups)


@torch.library.custom_op("kiln::panel_linear", mutates_args=())
def panel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W.T (+ bias) in fp32, `weight` holding W [N, K] packed by `pack`. This function is
    the reference (it unpacks W); a compiled piece runs the kernel (`SOURCE`)."""
    w = unpack(weight)
    return torch.addmm(bias, x, w.t()) if bias is not None else x @ w.t()


@panel_linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.custom_op("kiln::panel_int8_linear", mutates_args=())
def panel_int8_linear(a: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """a [M, K] int8 @ W.T summed in int32, as fp32 (`torch._int_mm`'s numbers; the caller scales
    them), `weight` holding W [N, K] int8 packed by `pack_int8`. This function is the reference (it
    unpacks W); a compiled piece runs the kernel (`INT8_SOURCE`)."""
    return quant.int_products(a, unpack_int8(weight))


@panel_int8_linear.register_fake
def _(a, weight):
    return a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("kiln::panel_int4_linear", mutates_args=())
def panel_int4_linear(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
                      mins: torch.Tensor) -> torch.Tensor:
    """`kiln::int4_block_mm` in fp32 without a bias, `weight` holding the 4-bit codes packed by `pack_int4` and
    `scales` and `mins` the groups' [N, groups] fp16 packed by `pack_int4_groups`. This function is the
    reference (it unpacks them); a compiled piece runs the kernel (`INT4_SOURCE`)."""
    from kiln.kernels.quant import int4_block_mm

    return int4_block_mm(a, a_scale, unpack_int4(weight), unpack_int4_groups(scales), unpack_int4_groups(mins),
                         torch.float32)


@panel_int4_linear.register_fake
def _(a, a_scale, weight, scales, mins):
    return a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("kiln::panel_int8_block_linear", mutates_args=())
def panel_int8_block_linear(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`kiln::int8_block_mm` in fp32 without the weight's scales or a bias, `weight` holding the int8 codes
    packed by `pack_int8_blocked`. This function is the reference (it unpacks them); a compiled piece runs the
    kernel (`INT8_BLOCK_SOURCE`)."""
    from kiln.kernels.quant import int8_block_mm

    codes = unpack_int8_blocked(weight)
    return int8_block_mm(a, a_scale, codes, a_scale.new_ones(codes.shape[0]), torch.float32)


@panel_int8_block_linear.register_fake
def _(a, a_scale, weight):
    return a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("kiln::panel_int8_group_linear", mutates_args=())
def panel_int8_group_linear(a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                            scales: torch.Tensor) -> torch.Tensor:
    """`kiln::int8_block_mm` with the weight's scales per group of ACT_BLOCK, in fp32 without a bias: `weight` holds
    the int8 codes packed by `pack_int8_blocked`, `scales` their [N, K / ACT_BLOCK] fp16 packed by
    `pack_int4_groups`. This function is the reference (it unpacks them); a compiled piece runs the kernel
    (`INT8_BLOCK_SOURCE`'s grouped entry)."""
    return quant.int8_block_mm(a, a_scale, unpack_int8_blocked(weight), unpack_int4_groups(scales), torch.float32)


@panel_int8_group_linear.register_fake
def _(a, a_scale, weight, scales):
    return a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)


INT8_MAX_K = (1 << 31) // (255 * 128)
"""The longest row whose int32 sums of (w + 128) x a cannot overflow."""


def available(shape: tuple[int, int], dtype: torch.dtype, groups: int = 0, blocked: bool = False) -> str | None:
    """Why no panel GEMM can run an [N, K] projection of `dtype` (fp32, int8 codes (`blocked`: with activation
    blocks, and with `groups` also a weight scale per block), or 4-bit codes two to a uint8 in `groups` groups,
    `shape` then the codes' [N, K / 2]) here, or None."""
    n, k = shape
    if dtype not in (torch.float32, torch.int8, torch.uint8):
        return "fp32, int8 and int4 weights only"
    kernel = (INT8_GROUP if groups else INT8_BLOCK) if blocked else \
        {torch.float32: FLOAT, torch.int8: INT8, torch.uint8: INT4}[dtype]
    panel = INT4_PANEL if kernel in (INT4, INT8_BLOCK, INT8_GROUP) else PANEL
    if n % panel:
        return f"{n} output channels are not a multiple of {panel}"
    if kernel is INT4 and (groups <= 0 or (2 * k) % groups or (2 * k // groups) % ACT_BLOCK):
        return f"groups of {2 * k} / {groups} input channels are not a multiple of {ACT_BLOCK}"
    if kernel in (INT8_BLOCK, INT8_GROUP) and k % ACT_BLOCK:
        return f"{k} input channels are not a multiple of {ACT_BLOCK}"
    if kernel is INT8_GROUP and groups * ACT_BLOCK != k:
        return f"a weight scale per {k} / {groups} input channels, where the kernel takes one per {ACT_BLOCK}"
    if kernel is INT8 and (k % 4 or k > INT8_MAX_K):
        return f"{k} input channels are not a multiple of 4 up to {INT8_MAX_K}"
    if not set(kernel.isa) & set(_arch_flags()):
        return f"the compile targets no {' or '.join(f.removeprefix('-m') for f in kernel.isa)}"
    if timing_kernel(kernel) is None:
        return "no C++ compiler to build it for timing"
    return None


@functools.cache
def _arch_flags() -> list[str]:
    """The ISA flags Inductor compiles this CPU's kernels with (the piece the kernel lands in)."""
    from torch._inductor import cpu_vec_isa

    return cpu_vec_isa.pick_vec_isa().build_arch_flags().split()


def _wrapper_opt_level() -> str:
    from torch._inductor import config

    return getattr(config.aot_inductor, "compile_wrapper_opt_level", "O1")


@functools.cache
def timing_kernel(kernel: PanelKernel = FLOAT) -> Callable[..., torch.Tensor] | None:
    """`kernel` built alone as AOTInductor builds the wrapper it lands in (its optimization level, the
    ISA flags Inductor gives this CPU), as a function of its op's arguments: what the compile times
    and checks against torch's GEMM. None without a C++ compiler."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return None
    build = Path(tempfile.mkdtemp(prefix="kiln-panel-"))
    source, library = build / "panel.cpp", build / "panel.so"
    source.write_text(kernel.source)
    try:
        subprocess.run([compiler, f"-{_wrapper_opt_level()}", "-fopenmp", "-shared", "-fPIC", *_arch_flags(),
                        str(source), "-o", str(library)],
                       check=True, capture_output=True)
        gemm = getattr(ctypes.CDLL(str(library)), kernel.entry)
    except (subprocess.CalledProcessError, OSError, AttributeError):
        return None
    finally:
        shutil.rmtree(build, ignore_errors=True)  # the loaded library stays mapped
    if kernel.w4a8:
        gemm.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        return functools.partial(_run_w4a8, gemm)
    if kernel.grouped:
        gemm.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
        return functools.partial(_run_grouped, gemm)
    if kernel.blocked:
        gemm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        return functools.partial(_run_blocked, gemm)
    gemm.argtypes = [ctypes.c_void_p] * (4 if kernel.takes_bias else 3) + [ctypes.c_int64] * 3

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias)."""
        if bias is not None and not kernel.takes_bias:
            raise ValueError(f"kiln::{kernel.op} takes no bias")
        x = x.contiguous()
        out = x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        bias_pointer = [bias.data_ptr() if bias is not None else None] if kernel.takes_bias else []
        gemm(x.data_ptr(), weight.data_ptr(), *bias_pointer, out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
        return out

    return run


def _run_w4a8(gemm, a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
              mins: torch.Tensor) -> torch.Tensor:
    """The int4 kernel on `kiln::panel_int4_linear`'s arguments."""
    a, a_scale = a.contiguous(), a_scale.float().contiguous()
    scales, mins = (t.to(torch.float16).contiguous() for t in (scales, mins))
    out = a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)
    gemm(a.data_ptr(), a_scale.data_ptr(), weight.data_ptr(), scales.data_ptr(), mins.data_ptr(), out.data_ptr(),
         a.shape[0], weight.shape[0], a.shape[1], scales.shape[1])
    return out


def _run_blocked(gemm, a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The blocked int8 kernel on `kiln::panel_int8_block_linear`'s arguments."""
    a, a_scale = a.contiguous(), a_scale.float().contiguous()
    out = a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)
    gemm(a.data_ptr(), a_scale.data_ptr(), weight.data_ptr(), out.data_ptr(), a.shape[0], weight.shape[0], a.shape[1])
    return out


def _run_grouped(gemm, a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor,
                 scales: torch.Tensor) -> torch.Tensor:
    """The grouped int8 kernel on `kiln::panel_int8_group_linear`'s arguments."""
    a, a_scale, scales = a.contiguous(), a_scale.float().contiguous(), scales.to(torch.float16).contiguous()
    out = a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)
    gemm(a.data_ptr(), a_scale.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(), a.shape[0],
         weight.shape[0], a.shape[1])
    return out
