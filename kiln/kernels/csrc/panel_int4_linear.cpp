// kiln::panel_int4_linear's kernel, W4A8 on AVX2 (and AVX-512 VNNI's 256-bit dot product where the piece is
// compiled for it): out [M, N] fp32 = the sum over K's blocks of 32 of
//     a_scale[m, b] x (scale[n, g] x sum_k code[n, k] a[m, k]  +  min[n, g] x sum_k a[m, k])
// for int8 activations a [M, K] with a scale per row and block of 32 (`kiln::quant_int8_blocked`), and 4-bit
// weight codes 0..15 standing for scale x code + min, a scale and a minimum per output channel and group of
// `K / groups` input channels (a multiple of 32), packed by `panel_linear.pack_int4` with the scales and
// minimums (fp16) by `pack_int4_groups`. Compiled alone to time it, and spliced into the wrapper of a piece that
// calls it.
//
// A panel holds 8 output channels, one register of fp32. A 32-byte line of a panel holds 8 K of its 8 channels
// as codes, the first 4 K in the low nibbles and the next 4 in the high ones: a mask and a shift give the bytes
// that multiply four K of one activation row at a time, broadcast to every channel. The products of a block of
// 32 K are summed exactly in integers: by `vpdpbusd` with AVX-512 VNNI, else by `vpmaddubsw` pairs (at most
// 2 x 15 x 128, and 8 of them, in int16) then `vpmaddwd`. Each block's sum goes to fp32 times its scales.
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#pragma GCC push_options
#pragma GCC optimize("O3")
#pragma GCC target("f16c")
namespace kiln_int4 {
// Output channels a panel holds, input channels an activation scale covers, rows a panel call keeps in registers
constexpr int64_t PANEL = 8, BLOCK = 32, ROWS = 4, LINE = 32;
// How far ahead of the line being multiplied the weight is prefetched, in lines
constexpr int64_t PREFETCH = 128;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
typedef __m256i acc_t;  // a block's int32 sums, one a channel
static inline __attribute__((always_inline)) acc_t acc_zero() { return _mm256_setzero_si256(); }
static inline __attribute__((always_inline)) acc_t acc_dot(acc_t acc, __m256i w, __m256i a) { return _mm256_dpbusd_epi32(acc, w, a); }
static inline __attribute__((always_inline)) __m256i acc_sum(acc_t acc) { return acc; }
#else
typedef __m256i acc_t;  // a block's int16 pair sums, two a channel
static inline __attribute__((always_inline)) acc_t acc_zero() { return _mm256_setzero_si256(); }
static inline __attribute__((always_inline)) acc_t acc_dot(acc_t acc, __m256i w, __m256i a) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, a)); }
static inline __attribute__((always_inline)) __m256i acc_sum(acc_t acc) { return _mm256_madd_epi16(acc, _mm256_set1_epi16(1)); }
#endif

// R (<= ROWS) rows of a, four codes to an int32 word and transposed ([K / 4, R]), with each row's block scale
// and block scale x block sum ([blocks, R] each), times one panel (its `groups` groups of `lines` lines, their
// fp16 scales and minimums [groups, PANEL] each), into out as fp32
template <int R>
static inline void panel(const int32_t* __restrict a, const float* __restrict a_scale, const float* __restrict a_min,
                         const uint8_t* __restrict w, const uint16_t* __restrict scales,
                         const uint16_t* __restrict mins, int64_t groups, int64_t lines, float* __restrict out,
                         int64_t N) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256 sum[R];
  for (int r = 0; r < R; ++r) sum[r] = _mm256_setzero_ps();
  const int64_t blocks = lines / (BLOCK / 8);  // blocks a group
  for (int64_t g = 0; g < groups; ++g) {
    const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(scales + g * PANEL)));
    const __m256 min = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(mins + g * PANEL)));
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const int64_t b = g * blocks + blk, first = b * (BLOCK / 8);
      acc_t acc[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r] = acc_zero();
      for (int64_t s = first; s < first + BLOCK / 8; ++s) {
        _mm_prefetch((const char*)(w + (s + PREFETCH) * LINE), _MM_HINT_T0);
        const __m256i v = _mm256_loadu_si256((const __m256i*)(w + s * LINE));
        const __m256i lo = _mm256_and_si256(v, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          acc[r] = acc_dot(acc[r], lo, _mm256_set1_epi32(a[(2 * s) * R + r]));
          acc[r] = acc_dot(acc[r], hi, _mm256_set1_epi32(a[(2 * s + 1) * R + r]));
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(acc_sum(acc[r]));
        sum[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scale, _mm256_set1_ps(a_scale[b * R + r])), sum[r]);
        sum[r] = _mm256_fmadd_ps(min, _mm256_set1_ps(a_min[b * R + r]), sum[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * N, sum[r]);
}

typedef void (*panel_fn)(const int32_t*, const float*, const float*, const uint8_t*, const uint16_t*,
                         const uint16_t*, int64_t, int64_t, float*, int64_t);
static const panel_fn PANELS[ROWS + 1] = {nullptr, panel<1>, panel<2>, panel<3>, panel<4>};

// a [M, K] int8 in the layout `panel` reads: blocks of ROWS rows, four codes to an int32 word, transposed, into
// `at` [M * K / 4]; each row's block scale and block scale x block sum, by row block, into `as` and `am`
// [M * K / BLOCK] each
static void rows(const int8_t* a, const float* a_scales, int64_t M, int64_t K, int32_t* at, float* as, float* am) {
  const int64_t K4 = K / 4, blocks = K / BLOCK;
  for (int64_t m = 0; m < M; m += ROWS) {
    const int64_t n = M - m < ROWS ? M - m : ROWS;
    for (int64_t k = 0; k < K4; ++k)
      for (int64_t i = 0; i < n; ++i) __builtin_memcpy(at + m * K4 + k * n + i, a + (m + i) * K + 4 * k, 4);
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t i = 0; i < n; ++i) {
        int32_t total = 0;
        for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; ++k) total += a[(m + i) * K + k];
        const float scale = a_scales[(m + i) * blocks + b];
        as[m * blocks + b * n + i] = scale;
        am[m * blocks + b * n + i] = scale * (float)total;
      }
  }
}
}  // namespace kiln_int4

// out [M, N] fp32 = a [M, K] int8 (scales a_scales [M, K / 32]) @ W.T, W's 4-bit codes packed by `pack_int4`
// ([N, K / 2] bytes) with their fp16 scales and minimums [N, groups] packed by `pack_int4_groups` (N a multiple
// of 8, K / groups a multiple of 32)
extern "C" void kiln_panel_int4_gemm(const int8_t* a, const float* a_scales, const uint8_t* w,
                                     const uint16_t* scales, const uint16_t* mins, float* out, int64_t M, int64_t N,
                                     int64_t K, int64_t groups) {
  using namespace kiln_int4;
  const int64_t panels = N / PANEL, blocks = K / BLOCK, lines = K / groups / 8;
  int32_t* at = (int32_t*)aligned_alloc(64, ((M * K / 4 + 2 * M * blocks + 15) / 16) * 64);
  float* as = (float*)(at + M * K / 4);
  float* am = as + M * blocks;
  kiln_int4::rows(a, a_scales, M, K, at, as, am);
  #pragma omp parallel
  {
    const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
    for (int64_t p = panels * t / threads; p < panels * (t + 1) / threads; ++p)
      for (int64_t m = 0; m < M; m += ROWS)
        PANELS[M - m < ROWS ? M - m : ROWS](at + m * (K / 4), as + m * blocks, am + m * blocks,
                                            w + p * PANEL * (K / 2), scales + p * PANEL * groups,
                                            mins + p * PANEL * groups, groups, lines, out + m * N + p * PANEL, N);
  }
  free(at);
}
#pragma GCC pop_options
