// kiln::decode_attention's kernel: paged attention for a batch of decodes (one query token per sequence),
// K and V read where they sit in the cache. Spliced into the wrapper of the library AOTInductor builds from a
// graph of the one op, which an artifact ships.
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#pragma GCC push_options
#pragma GCC optimize("O3")
// Inductor builds the wrapper without loop vectorization: the vectors are spelled out (GCC's vector
// extension) at the CPU's widest registers, 16 floats with AVX-512, else 8. A wider vector than the registers
// is lowered through the stack on every operation (an AVX2 build of 16-float vectors ran 10x slower)
#if defined(__AVX512F__)
#define KILN_LANES 16
#else
#define KILN_LANES 8
#endif
typedef float kiln_vf __attribute__((vector_size(4 * KILN_LANES)));
typedef int32_t kiln_vi __attribute__((vector_size(4 * KILN_LANES)));

static inline kiln_vf kiln_load(const float* p) {
  kiln_vf x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

static inline float kiln_sum(kiln_vf x) {
  typedef float v8 __attribute__((vector_size(32)));
#if KILN_LANES == 16
  const v8 h = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const v8 h = x;
#endif
  return ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
}

// exp(x) for x <= 0, to about an ulp: 2^k exp(r) with k = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by
// its Taylor series to r^6; x below -87 gives exp(-87) (~1e-38), not 0
static inline kiln_vf kiln_exp(kiln_vf x) {
  const kiln_vf lowest = kiln_vf{} - 87.f;
  x = x < lowest ? lowest : x;
  const kiln_vf shifted = x * 1.44269504f + 12582912.f;  // k in the low mantissa bits
  const kiln_vf k = shifted - 12582912.f;
  const kiln_vf r = (x - k * 0.693145752f) - k * 1.42860677e-6f;
  kiln_vf p = r * (1.f / 720) + 1.f / 120;
  p = p * r + 1.f / 24;
  p = p * r + 1.f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const kiln_vi scale = (((kiln_vi)shifted - 0x4B400000) + 127) << 23;  // 2^k
  return p * (kiln_vf)scale;
}

// a . b over n floats
static inline float kiln_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  kiln_vf acc = {};
  int64_t i = 0;
  for (; i + KILN_LANES <= n; i += KILN_LANES) acc += kiln_load(a + i) * kiln_load(b + i);
  float sum = kiln_sum(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// y += w x over n floats
static inline void kiln_axpy(float w, const float* __restrict x, float* __restrict y, int64_t n) {
  int64_t i = 0;
  for (; i + KILN_LANES <= n; i += KILN_LANES) {
    const kiln_vf r = kiln_load(y + i) + w * kiln_load(x + i);
    __builtin_memcpy(y + i, &r, sizeof r);
  }
  for (; i < n; ++i) y[i] += w * x[i];
}

// Where token p's row of KV head h starts in the cache's K half, through the sequence's block table
static inline int64_t kiln_row(const int32_t* table, int64_t p, int64_t BS, int64_t HKV, int64_t h, int64_t D) {
  return ((table[p / BS] * BS + p % BS) * HKV + h) * D;
}

// The rows of the cache are scattered over blocks, which the hardware prefetcher does not follow:
// each loop over the context asks for the row KILN_AHEAD tokens on
#define KILN_AHEAD 8
static inline void kiln_prefetch(const float* row, int64_t D) {
  for (int64_t i = 0; i < D; i += 16) __builtin_prefetch(row + i);
}

// out [B, HQ, D] = softmax(scale q k^T) v per sequence b over its context (the last `window` tokens of
// it if window > 0), K and V read from the paged cache [2, N, BS, HKV, D] through tables [B, W]
extern "C" void kiln_decode_attention(const float* q, const float* cache, const int32_t* tables,
                                      const int32_t* lens, const float* params, float* out, int64_t B,
                                      int64_t HQ, int64_t D, int64_t N, int64_t BS, int64_t HKV, int64_t W) {
  const float scale = params[0];
  const int64_t window = (int64_t)params[1], G = HQ / HKV, half = N * BS * HKV * D;
  #pragma omp parallel
  {
    float* acc = (float*)malloc(sizeof(float) * G * D);
    float* scores = nullptr;
    int64_t capacity = 0;
    #pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < HKV; ++h) {
        const int64_t ctx = lens[b] < W * BS ? lens[b] : W * BS;
        const int64_t start = window > 0 && ctx > window ? ctx - window : 0, n = ctx - start;
        if (G * n > capacity) {
          capacity = G * n;
          free(scores);
          scores = (float*)malloc(sizeof(float) * capacity);
        }
        const float* qb = q + (b * HQ + h * G) * D;
        for (int64_t p = start; p < ctx; ++p) {
          if (p + KILN_AHEAD < ctx) kiln_prefetch(cache + kiln_row(tables + b * W, p + KILN_AHEAD, BS, HKV, h, D), D);
          const float* k = cache + kiln_row(tables + b * W, p, BS, HKV, h, D);
          for (int64_t g = 0; g < G; ++g) {
            scores[g * n + p - start] = kiln_dot(qb + g * D, k, D) * scale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* s = scores + g * n;
          float top = -INFINITY;
          for (int64_t i = 0; i < n; ++i) top = s[i] > top ? s[i] : top;
          kiln_vf sums = {};
          int64_t i = 0;
          for (; i + KILN_LANES <= n; i += KILN_LANES) {
            const kiln_vf e = kiln_exp(kiln_load(s + i) - top);
            __builtin_memcpy(s + i, &e, sizeof e);
            sums += e;
          }
          float sum = kiln_sum(sums);
          for (; i < n; ++i) sum += (s[i] = expf(s[i] - top));
          const float inv = 1.f / sum;
          for (i = 0; i < n; ++i) s[i] *= inv;
        }
        for (int64_t i = 0; i < G * D; ++i) acc[i] = 0.f;
        const float* values = cache + half;
        for (int64_t p = start; p < ctx; ++p) {
          if (p + KILN_AHEAD < ctx) kiln_prefetch(values + kiln_row(tables + b * W, p + KILN_AHEAD, BS, HKV, h, D), D);
          const float* v = values + kiln_row(tables + b * W, p, BS, HKV, h, D);
          for (int64_t g = 0; g < G; ++g) {
            kiln_axpy(scores[g * n + p - start], v, acc + g * D, D);
          }
        }
        float* ob = out + (b * HQ + h * G) * D;
        for (int64_t i = 0; i < G * D; ++i) ob[i] = acc[i];
      }
    free(scores);
    free(acc);
  }
}
#pragma GCC pop_options
