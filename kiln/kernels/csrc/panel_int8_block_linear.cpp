// kiln::panel_int8_block_linear's kernel, W8A8 with activation blocks, on AVX2 (and AVX-512 VNNI's 256-bit dot
// product where the piece is compiled for it): out [M, N] fp32 = the sum over K's blocks of 32 of
//     a_scale[m, b] x sum_k a[m, k] w[n, k]
// for int8 activations a [M, K] with a scale per row and block of 32 (`kiln::quant_int8_blocked`), and int8
// weight codes w [N, K] packed by `panel_linear.pack_int8_blocked`; the weight's scale per output channel, the
// bias and the output dtype are the caller's (the graph fuses them into the next loop). `kiln_panel_int8_group_gemm`
// is the same product with a weight scale per output channel and block (llama.cpp's Q8_0: fp16, packed by
// `pack_int4_groups`), applied to each block's sum. Compiled alone to time it, and spliced into the wrapper of a
// piece that calls it.
//
// A panel holds 8 output channels, one register of fp32. A 32-byte line of a panel holds 4 K of its 8 channels:
// one activation row's four codes at those K, broadcast to every channel, multiply it. Both byte multipliers
// take an unsigned operand, so each product is formed as |a| x (w with a's sign): `vpsignb` moves the sign onto
// the weight. The products of a block of 32 K are summed exactly in integers: by `vpdpbusd` with AVX-512 VNNI,
// else by `vpmaddubsw` (pairs, at most 2 x 127 x 127, in int16) then `vpmaddwd` into int32. Each block's sum
// goes to fp32 times its activation scale.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#pragma GCC push_options
#pragma GCC optimize("O3")
#pragma GCC target("f16c")
namespace kiln_int8_block {
// Output channels a panel holds, input channels an activation scale covers, rows a panel call keeps in registers
constexpr int64_t PANEL = 8, BLOCK = 32, ROWS = 4, LINE = 32;
// How far ahead of the line being multiplied the weight is prefetched, in lines
constexpr int64_t PREFETCH = 128;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
static inline __attribute__((always_inline)) __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(acc, u, s);
}
#else
static inline __attribute__((always_inline)) __m256i dot(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// R (<= ROWS) rows of a, four codes to an int32 word and transposed ([K / 4, R]), as |a| (`au`) and a (`as`),
// with each row's block scales ([blocks, R]), times one panel (its K / 4 lines; with `scales`, its fp16 weight
// scales [blocks, PANEL]), into out as fp32
template <int R, bool GROUPED>
static inline void panel(const int32_t* __restrict au, const int32_t* __restrict as, const float* __restrict a_scale,
                         const int8_t* __restrict w, const uint16_t* __restrict scales, int64_t blocks,
                         float* __restrict out, int64_t N) {
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i acc[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int64_t s = b * (BLOCK / 4); s < (b + 1) * (BLOCK / 4); ++s) {
      _mm_prefetch((const char*)(w + (s + PREFETCH) * LINE), _MM_HINT_T0);
      const __m256i v = _mm256_loadu_si256((const __m256i*)(w + s * LINE));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r)
        acc[r] = dot(acc[r], _mm256_set1_epi32(au[s * R + r]), _mm256_sign_epi8(v, _mm256_set1_epi32(as[s * R + r])));
    }
    // the weight's 8 scales for this block, or 1 (x 1 is exact: the compiler drops it)
    const __m256 scale = GROUPED ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + b * PANEL)))
                                 : _mm256_set1_ps(1.0f);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
      sum[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[r]), _mm256_mul_ps(scale, _mm256_set1_ps(a_scale[b * R + r])),
                               sum[r]);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N, sum[r]);
}

typedef void (*panel_fn)(const int32_t*, const int32_t*, const float*, const int8_t*, const uint16_t*, int64_t, float*,
                         int64_t);
static const panel_fn PANELS[2][ROWS + 1] = {{nullptr, panel<1, false>, panel<2, false>, panel<3, false>, panel<4, false>},
                                             {nullptr, panel<1, true>, panel<2, true>, panel<3, true>, panel<4, true>}};

// a [M, K] int8 in the layout `panel` reads: blocks of ROWS rows, four codes to an int32 word, transposed, as
// |a| into `au` and as a into `as` [M * K / 4] each; each row's block scales, by row block, into `ss` [M * K / 32]
static void rows(const int8_t* a, const float* a_scales, int64_t M, int64_t K, int32_t* au, int32_t* as, float* ss) {
  const int64_t K4 = K / 4, blocks = K / BLOCK;
  for (int64_t m = 0; m < M; m += ROWS) {
    const int64_t n = M - m < ROWS ? M - m : ROWS;
    for (int64_t k = 0; k < K4; ++k)
      for (int64_t i = 0; i < n; ++i) {
        const int8_t* codes = a + (m + i) * K + 4 * k;
        uint8_t magnitude[4];
        for (int j = 0; j < 4; ++j) magnitude[j] = (uint8_t)(codes[j] < 0 ? -codes[j] : codes[j]);
        __builtin_memcpy(as + m * K4 + k * n + i, codes, 4);
        __builtin_memcpy(au + m * K4 + k * n + i, magnitude, 4);
      }
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < n; ++i) ss[m * blocks + b * n + i] = a_scales[(m + i) * blocks + b];
  }
}

// out [M, N] fp32 = a [M, K] int8 (scales a_scales [M, K / 32]) @ W.T in blocks of 32 K, W's int8 codes packed by
// `pack_int8_blocked` (N a multiple of 8, K of 32), times W's fp16 scales [N, K / 32] (packed by `pack_int4_groups`)
// where `scales` is not null
static void gemm(const int8_t* a, const float* a_scales, const int8_t* w, const uint16_t* scales, float* out,
                 int64_t M, int64_t N, int64_t K) {
  const int64_t panels = N / PANEL, blocks = K / BLOCK;
  int32_t* au = (int32_t*)aligned_alloc(64, ((2 * M * K / 4 + M * blocks + 15) / 16) * 64);
  int32_t* as = au + M * K / 4;
  float* ss = (float*)(as + M * K / 4);
  rows(a, a_scales, M, K, au, as, ss);
  const panel_fn* fns = PANELS[scales != nullptr];
  #pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (int64_t p = panels * t / threads; p < panels * (t + 1) / threads; ++p)
      for (int64_t m = 0; m < M; m += ROWS)
        fns[M - m < ROWS ? M - m : ROWS](au + m * (K / 4), as + m * (K / 4), ss + m * blocks, w + p * PANEL * K,
                                         scales ? scales + p * PANEL * blocks : nullptr, blocks,
                                         out + m * N + p * PANEL, N);
  }
  free(au);
}
}  // namespace kiln_int8_block

// out [M, N] fp32 = a [M, K] int8 (scales a_scales [M, K / 32]) @ W.T in blocks of 32 K, W's int8 codes packed by
// `pack_int8_blocked` (N a multiple of 8, K of 32); W's scales are the caller's
extern "C" void kiln_panel_int8_block_gemm(const int8_t* a, const float* a_scales, const int8_t* w, float* out,
                                           int64_t M, int64_t N, int64_t K) {
  kiln_int8_block::gemm(a, a_scales, w, nullptr, out, M, N, K);
}

// the same times W's fp16 scales per output channel and block of 32 K ([N, K / 32], packed by `pack_int4_groups`)
extern "C" void kiln_panel_int8_group_gemm(const int8_t* a, const float* a_scales, const int8_t* w,
                                           const uint16_t* scales, float* out, int64_t M, int64_t N, int64_t K) {
  kiln_int8_block::gemm(a, a_scales, w, scales, out, M, N, K);
}
#pragma GCC pop_options
