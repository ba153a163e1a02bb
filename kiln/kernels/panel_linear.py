"""kiln's GEMMs for decode batches on AVX-512 CPUs, fp32 and int8 (VNNI): the weight packed in panels
of 16 output channels, each panel's K x 16 block contiguous, streamed once per call while up to 16
token rows accumulate in registers, with the panel 16 KB ahead prefetched.

At decode sizes a projection reads its weight from memory, and oneDNN's fp32 GEMM does not keep the
memory busy while it computes: on a 2-core AVX512 EPYC, Qwen2.5-0.5B's gate_up projection at 16
tokens took 1.07-1.24 ms on oneDNN's packed weight against 0.73 ms to stream the weight alone; this
kernel took 0.76-0.79 ms (and beat oneDNN at 1 to 33 tokens on every projection of that model, and
came within 0-7% of it at 256). The int8 kernel (`vpdpbusd`, four K per instruction) took 0.13 ms
for gate_up at 1 token and 0.23 ms at 16, against oneDNN's int8 GEMM's 0.19 and 0.30-0.43 ms; on
the small projections oneDNN spends some 20 us a call where the kernel takes 8-10.

Each kernel is C++ that AOTInductor compiles into the piece that calls it
(`kiln.compiler.panel_lowering` splices its `PanelKernel` sources into the generated wrapper), so it
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

from kiln.kernels import huge_pages

PANEL = 16
"""Output channels a panel holds: one AVX-512 register of fp32."""
PREFETCH_LINES = 256
"""How far ahead of the row being multiplied the kernel prefetches its weight, in 64-byte lines
(a K x 16 panel row is one line). Measured on the 0.5B shapes: 64 lines left gate_up 10% slower;
256 and 512 timed the same."""

_PRELUDE = """
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#ifndef KILN_PANEL_ROWS
#define KILN_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#endif
"""

SOURCE = _PRELUDE + f"""
// AOTInductor builds a piece's wrapper, where this lands, at -O1: the accumulators are named
// registers, not an array for the optimizer to promote, and the kernel asks for -O3 as well
#pragma GCC push_options
#pragma GCC optimize("O3")
namespace kiln_panel {{
#define KILN_PANEL_INIT(i) __m512 acc##i = init;
#define KILN_PANEL_FMA(i) if constexpr (ROWS > i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(x[k * ROWS + i]), wk, acc##i);
#define KILN_PANEL_STORE(i) if constexpr (ROWS > i) _mm512_storeu_ps(out + i * N, acc##i);

// ROWS (<= 16) token rows of x, transposed ([K, ROWS]), times one K x 16 panel of the weight, + bias, into out
template <int ROWS>
static inline void panel(const float* __restrict x, int64_t K, const float* __restrict w,
                         const float* __restrict bias, float* __restrict out, int64_t N) {{
  const __m512 init = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  KILN_PANEL_ROWS(KILN_PANEL_INIT)
  for (int64_t k = 0; k < K; ++k) {{
    _mm_prefetch((const char*)(w + (k + {PREFETCH_LINES}) * {PANEL}), _MM_HINT_T0);
    const __m512 wk = _mm512_loadu_ps(w + k * {PANEL});
    KILN_PANEL_ROWS(KILN_PANEL_FMA)
  }}
  KILN_PANEL_ROWS(KILN_PANEL_STORE)
}}

typedef void (*panel_fn)(const float*, int64_t, const float*, const float*, float*, int64_t);
static const panel_fn PANELS[17] = {{nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>, panel<13>, panel<14>, panel<15>, panel<16>}};
}}  // namespace kiln_panel

// out [M, N] = x [M, K] @ W.T (+ bias [N]), W packed by `pack`: each thread streams its share of the
// panels once; rows past 16 take further passes over a panel while it is in the cache. x is first
// transposed a group of 16 rows at a time, so that a step of K reads one cache line of it.
extern "C" void kiln_panel_gemm(const float* x, const float* w, const float* bias, float* out,
                                int64_t M, int64_t N, int64_t K) {{
  const int64_t panels = N / {PANEL};
  float* xt = (float*)aligned_alloc(64, ((M * K * sizeof(float) + 63) / 64) * 64);
  for (int64_t m = 0; m < M; m += 16) {{
    const int64_t rows = M - m < 16 ? M - m : 16;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < rows; ++i) xt[m * K + k * rows + i] = x[(m + i) * K + k];
  }}
  #pragma omp parallel
  {{
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (int64_t p = panels * t / threads; p < panels * (t + 1) / threads; ++p)
      for (int64_t m = 0; m < M; m += 16)
        kiln_panel::PANELS[M - m < 16 ? M - m : 16](xt + m * K, K, w + p * K * {PANEL},
                                                    bias ? bias + p * {PANEL} : nullptr,
                                                    out + m * N + p * {PANEL}, N);
  }}
  free(xt);
}}
#pragma GCC pop_options
"""

INT8_SOURCE = _PRELUDE + f"""
// The int8 kernel: the weight is stored as unsigned codes w + 128, which `vpdpbusd` multiplies by the
// signed activation codes four K at a time into int32 sums, exactly; each row's sum of its codes
// times 128, taken once, removes the shift: sum (w + 128) a = sum w a + 128 sum a.
#pragma GCC push_options
#pragma GCC optimize("O3")
namespace kiln_panel_int8 {{
#define KILN_PANEL_INT8_INIT(i) __m512i acc##i = _mm512_setzero_si512();
#define KILN_PANEL_INT8_DOT(i) if constexpr (ROWS > i) acc##i = _mm512_dpbusd_epi32(acc##i, wk, _mm512_set1_epi32(a[k * ROWS + i]));
#define KILN_PANEL_INT8_STORE(i) if constexpr (ROWS > i) _mm512_storeu_ps(out + i * N, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc##i, _mm512_set1_epi32(shift[i]))));

// ROWS (<= 16) token rows of a, four codes to an int32 and transposed ([K / 4, ROWS]), times one
// K x 16 panel of the weight, into out as fp32
template <int ROWS>
static inline void panel(const int32_t* __restrict a, const int32_t* __restrict shift, int64_t K4,
                         const uint8_t* __restrict w, float* __restrict out, int64_t N) {{
  KILN_PANEL_ROWS(KILN_PANEL_INT8_INIT)
  for (int64_t k = 0; k < K4; ++k) {{
    _mm_prefetch((const char*)(w + (k + {PREFETCH_LINES}) * 64), _MM_HINT_T0);
    const __m512i wk = _mm512_loadu_si512(w + k * 64);
    KILN_PANEL_ROWS(KILN_PANEL_INT8_DOT)
  }}
  KILN_PANEL_ROWS(KILN_PANEL_INT8_STORE)
}}

typedef void (*panel_fn)(const int32_t*, const int32_t*, int64_t, const uint8_t*, float*, int64_t);
static const panel_fn PANELS[17] = {{nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>, panel<13>, panel<14>, panel<15>, panel<16>}};
}}  // namespace kiln_panel_int8

// a [M, K] int8 in the layout `panel` reads: groups of 16 rows, four codes to an int32, transposed, into
// `at` [M * K / 4]; each row's 128 x (sum of its codes) into `shift` [M]
static void kiln_panel_int8_rows(const int8_t* a, int64_t M, int64_t K, int32_t* at, int32_t* shift) {{
  const int64_t K4 = K / 4;
  for (int64_t m = 0; m < M; ++m) {{
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += a[m * K + k];
    shift[m] = 128 * sum;
  }}
  for (int64_t m = 0; m < M; m += 16) {{
    const int64_t rows = M - m < 16 ? M - m : 16;
    for (int64_t k = 0; k < K4; ++k)
      for (int64_t i = 0; i < rows; ++i) __builtin_memcpy(at + m * K4 + k * rows + i, a + (m + i) * K + 4 * k, 4);
  }}
}}

// out[:, 16 first : 16 last] of the GEMM below: panels [first, last) for all M rows, from `kiln_panel_int8_rows`
static void kiln_panel_int8_panels(const int32_t* at, const int32_t* shift, const uint8_t* w, float* out, int64_t M,
                                   int64_t N, int64_t K, int64_t first, int64_t last) {{
  for (int64_t p = first; p < last; ++p)
    for (int64_t m = 0; m < M; m += 16)
      kiln_panel_int8::PANELS[M - m < 16 ? M - m : 16](at + m * (K / 4), shift + m, K / 4, w + p * K * {PANEL},
                                                       out + m * N + p * {PANEL}, N);
}}

// out [M, N] fp32 = a [M, K] int8 @ W.T summed in int32, W packed by `pack_int8` (K a multiple of 4)
extern "C" void kiln_panel_int8_gemm(const int8_t* a, const uint8_t* w, float* out, int64_t M, int64_t N,
                                     int64_t K) {{
  const int64_t panels = N / {PANEL};
  int32_t* at = (int32_t*)aligned_alloc(64, ((M * K / 4 + M + 15) / 16) * 64);
  int32_t* shift = at + M * K / 4;
  kiln_panel_int8_rows(a, M, K, at, shift);
  #pragma omp parallel
  {{
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    kiln_panel_int8_panels(at, shift, w, out, M, N, K, panels * t / threads, panels * (t + 1) / threads);
  }}
  free(at);
}}
#pragma GCC pop_options
"""

_SHIM_PROLOGUE = """
  int64_t *x_sizes, *w_sizes;
  void *x_data, *w_data, *out_data;
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(x, &x_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_sizes(w, &w_sizes));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(x, &x_data));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(w, &w_data));
  const int64_t sizes[2] = {x_sizes[0], w_sizes[0]}, strides[2] = {w_sizes[0], 1};
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                                       aoti_torch_device_type_cpu(), 0, ret));
  AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(*ret, &out_data));
"""
"""The start of each op's C shim function: the [M, N] fp32 output allocated for x [M, K] and w [N, K]."""

WRAPPER_SOURCE = """
// kiln::panel_linear as a C shim function (an optional tensor comes as a pointer to its handle), for
// the piece's wrapper to call like torch's own
static AOTITorchError aoti_torch_cpu_kiln_panel_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* bias,
                                                       AtenTensorHandle* ret) {""" + _SHIM_PROLOGUE + """
  void* bias_data = nullptr;
  if (bias) AOTI_TORCH_ERROR_CODE_CHECK(aoti_torch_get_data_ptr(*bias, &bias_data));
  kiln_panel_gemm((const float*)x_data, (const float*)w_data, (const float*)bias_data, (float*)out_data,
                  x_sizes[0], w_sizes[0], x_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
"""

INT8_WRAPPER_SOURCE = """
// kiln::panel_int8_linear as a C shim function
static AOTITorchError aoti_torch_cpu_kiln_panel_int8_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                            AtenTensorHandle* ret) {""" + _SHIM_PROLOGUE + """
  kiln_panel_int8_gemm((const int8_t*)x_data, (const uint8_t*)w_data, (float*)out_data, x_sizes[0], w_sizes[0],
                       x_sizes[1]);
  return AOTI_TORCH_SUCCESS;
}
"""


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
    isa: str
    """The compile flag the kernel needs among Inductor's for this CPU."""
    takes_bias: bool
    """Whether `entry` takes a bias pointer after the weight's."""


FLOAT = PanelKernel("panel_linear", SOURCE, "kiln_panel_gemm", WRAPPER_SOURCE, "aoti_torch_cpu_kiln_panel_linear",
                    "-mavx512f", takes_bias=True)
INT8 = PanelKernel("panel_int8_linear", INT8_SOURCE, "kiln_panel_int8_gemm", INT8_WRAPPER_SOURCE,
                   "aoti_torch_cpu_kiln_panel_int8_linear", "-mavx512vnni", takes_bias=False)


def pack(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] fp32 weight -> the same shape and strides holding its panels: a compiled graph takes it
    where it took the weight. Written into `out` (a contiguous [N, K] tensor of w's dtype) if given,
    else into a tensor queued for huge pages (`huge_pages`). N must be a multiple of PANEL."""
    n, k = w.shape
    fresh = out is None
    out = huge_pages.empty((n, k), w.dtype) if fresh else out
    out.view(n // PANEL, k, PANEL).copy_(w.reshape(n // PANEL, PANEL, k).transpose(1, 2))
    if fresh:
        huge_pages.collapse_later(out)
    return out


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """The weight `pack` was given."""
    n, k = packed.shape
    return packed.view(n // PANEL, k, PANEL).transpose(1, 2).reshape(n, k)


def pack_int8(w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[N, K] int8 codes -> the same shape holding, per panel, each group of 4 K of its 16 channels
    together ([K / 4, 16, 4]), as unsigned codes w + 128 in int8's bytes; written into `out` (a
    contiguous [N, K] int8 tensor) if given, else into a tensor queued for huge pages. N must be a
    multiple of PANEL and K of 4."""
    n, k = w.shape
    fresh = out is None
    out = huge_pages.empty((n, k), torch.int8) if fresh else out
    panels = out.view(n // PANEL, k // 4, PANEL, 4)
    panels.copy_(w.reshape(n // PANEL, PANEL, k // 4, 4).transpose(1, 2))
    panels.view(torch.uint8).bitwise_xor_(0x80)
    if fresh:
        huge_pages.collapse_later(out)
    return out


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:
    """The codes `pack_int8` was given."""
    n, k = packed.shape
    panels = (packed.view(torch.uint8) ^ 0x80).view(torch.int8).view(n // PANEL, k // 4, PANEL, 4)
    return panels.transpose(1, 2).reshape(n, k)


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
    return torch._int_mm(a, unpack_int8(weight).t()).float()


@panel_int8_linear.register_fake
def _(a, weight):
    return a.new_empty((a.shape[0], weight.shape[0]), dtype=torch.float32)


INT8_MAX_K = (1 << 31) // (255 * 128)
"""The longest row whose int32 sums of (w + 128) x a cannot overflow."""


def available(shape: tuple[int, int], dtype: torch.dtype) -> str | None:
    """Why no panel GEMM can run an [N, K] projection of `dtype` (fp32, or int8 codes) here, or None."""
    n, k = shape
    if dtype not in (torch.float32, torch.int8):
        return "fp32 and int8 weights only"
    if n % PANEL:
        return f"{n} output channels are not a multiple of {PANEL}"
    kernel = FLOAT if dtype == torch.float32 else INT8
    if kernel is INT8 and (k % 4 or k > INT8_MAX_K):
        return f"{k} input channels are not a multiple of 4 up to {INT8_MAX_K}"
    if kernel.isa not in _arch_flags():
        return f"the compile targets no {kernel.isa.removeprefix('-m')}"
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
    gemm.argtypes = [ctypes.c_void_p] * (4 if kernel.takes_bias else 3) + [ctypes.c_int64] * 3

    def run(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None and not kernel.takes_bias:
            raise ValueError(f"kiln::{kernel.op} takes no bias")
        x = x.contiguous()
        out = x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
        bias_pointer = [bias.data_ptr() if bias is not None else None] if kernel.takes_bias else []
        gemm(x.data_ptr(), weight.data_ptr(), *bias_pointer, out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1])
        return out

    return run
