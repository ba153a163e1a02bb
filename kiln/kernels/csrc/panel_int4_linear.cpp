// kiln::panel_int4_linear's kernel: out [M, N] fp32 = the sum over K's groups of (a [M, K] int8 @ W.T
// summed in int32 within the group) x the group's scale per output channel, W's 4-bit codes packed by
// `panel_linear.pack_int4` and its scales [N, groups] fp32 by `pack` (each panel's [groups, 16],
// read in order beside its codes). Compiled alone to time it, and spliced into the wrapper of a piece that
// calls it.
//
// A 64-byte line of a panel holds 8 K of its 16 channels as unsigned codes w + 8, the first 4 K in the low
// nibbles and the next 4 in the high ones: two masks and a shift give the bytes `vpdpbusd` multiplies by
// the signed activation codes, four K per instruction, exactly. Each group's int32 sums lose the shift
// (8 x the row's sum of its codes over the group) and go to fp32 times the group's 16 scales.
#include "panel.h"

#pragma GCC push_options
#pragma GCC optimize("O3")
namespace kiln_panel_int4 {
// Token rows a panel keeps in registers: an int32 accumulator and an fp32 one each; up to
// KILN_INT4_TWO_CHAINS rows, a second int32 one (the high nibbles'), so that a few rows' products do not wait
// on one chain of `vpdpbusd` latencies
#define KILN_INT4_ROWS 8
#define KILN_INT4_TWO_CHAINS 4
#define KILN_INT4_EACH_ROW(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define KILN_INT4_SUM(i) __m512 sum##i = _mm512_setzero_ps();
#define KILN_INT4_ACC(i) __m512i acc##i = _mm512_setzero_si512(), high##i = _mm512_setzero_si512();
#define KILN_INT4_DOT(i) if constexpr (ROWS > i) { \
    acc##i = _mm512_dpbusd_epi32(acc##i, lo, _mm512_set1_epi32(ag[(2 * s) * ROWS + i])); \
    if constexpr (ROWS <= KILN_INT4_TWO_CHAINS) \
      high##i = _mm512_dpbusd_epi32(high##i, hi, _mm512_set1_epi32(ag[(2 * s + 1) * ROWS + i])); \
    else acc##i = _mm512_dpbusd_epi32(acc##i, hi, _mm512_set1_epi32(ag[(2 * s + 1) * ROWS + i])); }
#define KILN_INT4_SCALE(i) if constexpr (ROWS > i) sum##i = _mm512_fmadd_ps(_mm512_cvtepi32_ps( \
    _mm512_sub_epi32(_mm512_add_epi32(acc##i, high##i), _mm512_set1_epi32(shift[g * ROWS + i]))), scale, sum##i);
#define KILN_INT4_STORE(i) if constexpr (ROWS > i) _mm512_storeu_ps(out + i * N, sum##i);

// ROWS (<= 8) token rows of a, four codes to an int32 and transposed ([K / 4, ROWS]), with their shifts
// ([groups, ROWS]), times one panel of 16 channels (`lines` 64-byte lines a group), into out as fp32;
// `scales` is the panel's [groups, 16]
template <int ROWS>
static inline void panel(const int32_t* __restrict a, const int32_t* __restrict shift,
                         const float* __restrict scales, int64_t groups, int64_t lines,
                         const uint8_t* __restrict w, float* __restrict out, int64_t N) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  KILN_INT4_EACH_ROW(KILN_INT4_SUM)
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * lines * 64;
    const int32_t* ag = a + g * lines * 2 * ROWS;
    KILN_INT4_EACH_ROW(KILN_INT4_ACC)
    int64_t s = 0;
    if constexpr (ROWS == 1) {  // one row: two lines a step into four chains, so latency never waits on one
      __m512i acc_next = _mm512_setzero_si512(), high_next = _mm512_setzero_si512();
      for (; s + 1 < lines; s += 2) {
        _mm_prefetch((const char*)(wg + (s + KILN_PREFETCH_LINES) * 64), _MM_HINT_T0);
        _mm_prefetch((const char*)(wg + (s + 1 + KILN_PREFETCH_LINES) * 64), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(wg + s * 64), u = _mm512_loadu_si512(wg + (s + 1) * 64);
        acc0 = _mm512_dpbusd_epi32(acc0, _mm512_and_si512(v, nibble), _mm512_set1_epi32(ag[2 * s]));
        high0 = _mm512_dpbusd_epi32(high0, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble),
                                    _mm512_set1_epi32(ag[2 * s + 1]));
        acc_next = _mm512_dpbusd_epi32(acc_next, _mm512_and_si512(u, nibble), _mm512_set1_epi32(ag[2 * s + 2]));
        high_next = _mm512_dpbusd_epi32(high_next, _mm512_and_si512(_mm512_srli_epi16(u, 4), nibble),
                                        _mm512_set1_epi32(ag[2 * s + 3]));
      }
      acc0 = _mm512_add_epi32(acc0, acc_next);
      high0 = _mm512_add_epi32(high0, high_next);
    }
    for (; s < lines; ++s) {
      _mm_prefetch((const char*)(wg + (s + KILN_PREFETCH_LINES) * 64), _MM_HINT_T0);
      const __m512i v = _mm512_loadu_si512(wg + s * 64);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      KILN_INT4_EACH_ROW(KILN_INT4_DOT)
    }
    const __m512 scale = _mm512_loadu_ps(scales + g * KILN_PANEL);
    KILN_INT4_EACH_ROW(KILN_INT4_SCALE)
  }
  KILN_INT4_EACH_ROW(KILN_INT4_STORE)
}

typedef void (*panel_fn)(const int32_t*, const int32_t*, const float*, int64_t, int64_t, const uint8_t*, float*,
                         int64_t);
static const panel_fn PANELS[KILN_INT4_ROWS + 1] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>,
                                                    panel<6>, panel<7>, panel<8>};
}  // namespace kiln_panel_int4

// a [M, K] int8 in the layout `panel` reads: blocks of 8 rows, four codes to an int32, transposed, into
// `at` [M * K / 4]; each row's 8 x (sum of its codes over each group) into `shift` [M * groups], by block
static void kiln_panel_int4_rows(const int8_t* a, int64_t M, int64_t K, int64_t groups, int32_t* at,
                                 int32_t* shift) {
  const int64_t K4 = K / 4, G = K / groups;
  for (int64_t m = 0; m < M; m += KILN_INT4_ROWS) {
    const int64_t rows = M - m < KILN_INT4_ROWS ? M - m : KILN_INT4_ROWS;
    for (int64_t k = 0; k < K4; ++k)
      for (int64_t i = 0; i < rows; ++i) __builtin_memcpy(at + m * K4 + k * rows + i, a + (m + i) * K + 4 * k, 4);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t i = 0; i < rows; ++i) {
        int32_t sum = 0;
        for (int64_t k = g * G; k < (g + 1) * G; ++k) sum += a[(m + i) * K + k];
        shift[m * groups + g * rows + i] = 8 * sum;
      }
  }
}

// out[:, 16 first : 16 last] of the GEMM below: panels [first, last) for all M rows, from `kiln_panel_int4_rows`
static void kiln_panel_int4_panels(const int32_t* at, const int32_t* shift, const uint8_t* w, const float* scales,
                                   float* out, int64_t M, int64_t N, int64_t K, int64_t groups, int64_t first,
                                   int64_t last) {
  const int64_t lines = K / groups / 8;
  for (int64_t p = first; p < last; ++p)
    for (int64_t m = 0; m < M; m += KILN_INT4_ROWS)
      kiln_panel_int4::PANELS[M - m < KILN_INT4_ROWS ? M - m : KILN_INT4_ROWS](
          at + m * (K / 4), shift + m * groups, scales + p * KILN_PANEL * groups, groups, lines,
          w + p * KILN_PANEL * (K / 2), out + m * N + p * KILN_PANEL, N);
}

// out [M, N] fp32 = a [M, K] int8 @ W.T by groups of K / groups, each group's int32 sums times its scale,
// W's codes packed by `pack_int4` ([N, K / 2] bytes), `scales` [N, groups] by `pack` (K / groups a
// multiple of 8)
extern "C" void kiln_panel_int4_gemm(const int8_t* a, const uint8_t* w, const float* scales, float* out, int64_t M,
                                     int64_t N, int64_t K, int64_t groups) {
  const int64_t panels = N / KILN_PANEL;
  int32_t* at = (int32_t*)aligned_alloc(64, ((M * K / 4 + M * groups + 15) / 16) * 64);
  int32_t* shift = at + M * K / 4;
  kiln_panel_int4_rows(a, M, K, groups, at, shift);
  #pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    kiln_panel_int4_panels(at, shift, w, scales, out, M, N, K, groups, panels * t / threads,
                           panels * (t + 1) / threads);
  }
  free(at);
}
#pragma GCC pop_options
