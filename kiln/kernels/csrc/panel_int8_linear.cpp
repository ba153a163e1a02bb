// kiln::panel_int8_linear's kernel: out [M, N] fp32 = a [M, K] int8 @ W.T summed in int32, W packed by
// `panel_linear.pack_int8`. Compiled alone to time it, spliced into the wrapper of a piece that calls it, and
// the GEMM of the greedy screen (greedy_screen.cpp).
//
// The weight is stored as unsigned codes w + 128, which `vpdpbusd` multiplies by the signed activation
// codes four K at a time into int32 sums, exactly; each row's sum of its codes times 128, taken once,
// removes the shift: sum (w + 128) a = sum w a + 128 sum a.
#include "panel.h"

#pragma GCC push_options
#pragma GCC optimize("O3")
namespace kiln_panel_int8 {
#define KILN_PANEL_INT8_INIT(i) __m512i acc##i = _mm512_setzero_si512();
#define KILN_PANEL_INT8_DOT(i) if constexpr (ROWS > i) acc##i = _mm512_dpbusd_epi32(acc##i, wk, _mm512_set1_epi32(a[k * ROWS + i]));
#define KILN_PANEL_INT8_STORE(i) if constexpr (ROWS > i) _mm512_storeu_ps(out + i * N, _mm512_cvtepi32_ps(_mm512_sub_epi32(acc##i, _mm512_set1_epi32(shift[i]))));

// ROWS (<= 16) token rows of a, four codes to an int32 and transposed ([K / 4, ROWS]), times one
// K x 16 panel of the weight, into out as fp32
template <int ROWS>
static inline void panel(const int32_t* __restrict a, const int32_t* __restrict shift, int64_t K4,
                         const uint8_t* __restrict w, float* __restrict out, int64_t N) {
  KILN_PANEL_ROWS(KILN_PANEL_INT8_INIT)
  for (int64_t k = 0; k < K4; ++k) {
    _mm_prefetch((const char*)(w + (k + KILN_PREFETCH_LINES) * 64), _MM_HINT_T0);
    const __m512i wk = _mm512_loadu_si512(w + k * 64);
    KILN_PANEL_ROWS(KILN_PANEL_INT8_DOT)
  }
  KILN_PANEL_ROWS(KILN_PANEL_INT8_STORE)
}

typedef void (*panel_fn)(const int32_t*, const int32_t*, int64_t, const uint8_t*, float*, int64_t);
static const panel_fn PANELS[17] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>, panel<13>, panel<14>, panel<15>, panel<16>};
}  // namespace kiln_panel_int8

// a [M, K] int8 in the layout `panel` reads: groups of 16 rows, four codes to an int32, transposed, into
// `at` [M * K / 4]; each row's 128 x (sum of its codes) into `shift` [M]
static void kiln_panel_int8_rows(const int8_t* a, int64_t M, int64_t K, int32_t* at, int32_t* shift) {
  const int64_t K4 = K / 4;
  for (int64_t m = 0; m < M; ++m) {
    int32_t sum = 0;
    for (int64_t k = 0; k < K; ++k) sum += a[m * K + k];
    shift[m] = 128 * sum;
  }
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t rows = M - m < 16 ? M - m : 16;
    for (int64_t k = 0; k < K4; ++k)
      for (int64_t i = 0; i < rows; ++i) __builtin_memcpy(at + m * K4 + k * rows + i, a + (m + i) * K + 4 * k, 4);
  }
}

// out[:, 16 first : 16 last] of the GEMM below: panels [first, last) for all M rows, from `kiln_panel_int8_rows`
static void kiln_panel_int8_panels(const int32_t* at, const int32_t* shift, const uint8_t* w, float* out, int64_t M,
                                   int64_t N, int64_t K, int64_t first, int64_t last) {
  for (int64_t p = first; p < last; ++p)
    for (int64_t m = 0; m < M; m += 16)
      kiln_panel_int8::PANELS[M - m < 16 ? M - m : 16](at + m * (K / 4), shift + m, K / 4, w + p * K * KILN_PANEL,
                                                       out + m * N + p * KILN_PANEL, N);
}

// out [M, N] fp32 = a [M, K] int8 @ W.T summed in int32, W packed by `pack_int8` (K a multiple of 4)
extern "C" void kiln_panel_int8_gemm(const int8_t* a, const uint8_t* w, float* out, int64_t M, int64_t N,
                                     int64_t K) {
  const int64_t panels = N / KILN_PANEL;
  int32_t* at = (int32_t*)aligned_alloc(64, ((M * K / 4 + M + 15) / 16) * 64);
  int32_t* shift = at + M * K / 4;
  kiln_panel_int8_rows(a, M, K, at, shift);
  #pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    kiln_panel_int8_panels(at, shift, w, out, M, N, K, panels * t / threads, panels * (t + 1) / threads);
  }
  free(at);
}
#pragma GCC pop_options
