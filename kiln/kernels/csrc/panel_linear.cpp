// kiln::panel_linear's kernel: out [M, N] = x [M, K] @ W.T (+ bias [N]) in fp32, W packed by
// `panel_linear.pack`. Compiled alone to time it, and spliced into the wrapper of a piece that calls it.
#include "panel.h"

// AOTInductor builds a piece's wrapper, where this lands, at -O1: the accumulators are named
// registers, not an array for the optimizer to promote, and the kernel asks for -O3 as well
#pragma GCC push_options
#pragma GCC optimize("O3")
namespace kiln_panel {
#define KILN_PANEL_INIT(i) __m512 acc##i = init;
#define KILN_PANEL_FMA(i) if constexpr (ROWS > i) acc##i = _mm512_fmadd_ps(_mm512_set1_ps(x[k * ROWS + i]), wk, acc##i);
#define KILN_PANEL_STORE(i) if constexpr (ROWS > i) _mm512_storeu_ps(out + i * N, acc##i);

// ROWS (<= 16) token rows of x, transposed ([K, ROWS]), times one K x 16 panel of the weight, + bias, into out
template <int ROWS>
static inline void panel(const float* __restrict x, int64_t K, const float* __restrict w,
                         const float* __restrict bias, float* __restrict out, int64_t N) {
  const __m512 init = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  KILN_PANEL_ROWS(KILN_PANEL_INIT)
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch((const char*)(w + (k + KILN_PREFETCH_LINES) * KILN_PANEL), _MM_HINT_T0);
    const __m512 wk = _mm512_loadu_ps(w + k * KILN_PANEL);
    KILN_PANEL_ROWS(KILN_PANEL_FMA)
  }
  KILN_PANEL_ROWS(KILN_PANEL_STORE)
}

typedef void (*panel_fn)(const float*, int64_t, const float*, const float*, float*, int64_t);
static const panel_fn PANELS[17] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>, panel<5>, panel<6>,
    panel<7>, panel<8>, panel<9>, panel<10>, panel<11>, panel<12>, panel<13>, panel<14>, panel<15>, panel<16>};
}  // namespace kiln_panel

// out [M, N] = x [M, K] @ W.T (+ bias [N]), W packed by `pack`: each thread streams its share of the
// panels once; rows past 16 take further passes over a panel while it is in the cache. x is first
// transposed a group of 16 rows at a time, so that a step of K reads one cache line of it.
extern "C" void kiln_panel_gemm(const float* x, const float* w, const float* bias, float* out,
                                int64_t M, int64_t N, int64_t K) {
  const int64_t panels = N / KILN_PANEL;
  float* xt = (float*)aligned_alloc(64, ((M * K * sizeof(float) + 63) / 64) * 64);
  for (int64_t m = 0; m < M; m += 16) {
    const int64_t rows = M - m < 16 ? M - m : 16;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t i = 0; i < rows; ++i) xt[m * K + k * rows + i] = x[(m + i) * K + k];
  }
  #pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (int64_t p = panels * t / threads; p < panels * (t + 1) / threads; ++p)
      for (int64_t m = 0; m < M; m += 16)
        kiln_panel::PANELS[M - m < 16 ? M - m : 16](xt + m * K, K, w + p * K * KILN_PANEL,
                                                    bias ? bias + p * KILN_PANEL : nullptr,
                                                    out + m * N + p * KILN_PANEL, N);
  }
  free(xt);
}
#pragma GCC pop_options
