// kiln::decode_attention's kernel: paged attention for a batch of decodes (one query token per sequence),
// K and V read where they sit in the cache, fp32 or int8 (a row's codes, then its fp32 scale: kv_cache.py).
// Spliced into the wrapper of the library AOTInductor builds from a graph of the one op, which an artifact
// ships.
#include <immintrin.h>
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
// The helpers are inlined by force: the wrapper is built at -O1, where GCC called even a vector store as a
// function in the loops here (the O3 pragma notwithstanding), which made the int8 kernel slower than the fp32 one
#define KILN_INLINE __attribute__((always_inline)) static inline
typedef float kiln_vf __attribute__((vector_size(4 * KILN_LANES)));
typedef int32_t kiln_vi __attribute__((vector_size(4 * KILN_LANES)));

KILN_INLINE kiln_vf kiln_load(const float* p) {
  kiln_vf x;
  __builtin_memcpy(&x, p, sizeof x);
  return x;
}

KILN_INLINE void kiln_store(float* p, kiln_vf x) { __builtin_memcpy(p, &x, sizeof x); }

// An int8 cache's codes, a vector's worth, as floats: sign-extended and converted, two instructions (GCC's
// __builtin_convertvector of int8 lanes goes through scalar registers, 7x slower)
KILN_INLINE kiln_vf kiln_load(const int8_t* p) {
#if defined(__AVX512F__)
  return (kiln_vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#elif defined(__AVX2__)
  return (kiln_vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#else
  kiln_vf x;
  for (int i = 0; i < KILN_LANES; ++i) x[i] = p[i];
  return x;
#endif
}

// One KV head's rows [0, rows) of a block (`at` its first, rows `stride` elements apart) as floats, and their
// distance: fp32 rows where they are; int8 rows (D codes, then their fp32 scale) dequantized into `tmp`
// [rows, D] once, for the G query heads that read them (each converting for itself took three times as long)
KILN_INLINE const float* kiln_rows(const float* at, int64_t stride, int64_t rows, int64_t D, float* tmp,
                                     int64_t* step) {
  *step = stride;
  return at;
}
KILN_INLINE const float* kiln_rows(const int8_t* at, int64_t stride, int64_t rows, int64_t D, float* tmp,
                                     int64_t* step) {
  const int64_t vectors = D / KILN_LANES * KILN_LANES;
  for (int64_t r = 0; r < rows; ++r) {
    const int8_t* codes = at + r * stride;
    float scale;
    __builtin_memcpy(&scale, codes + D, sizeof scale);
    float* row = tmp + r * D;
    int64_t c = 0;
    for (; c < vectors; c += KILN_LANES) kiln_store(row + c, kiln_load(codes + c) * scale);
    for (; c < D; ++c) row[c] = codes[c] * scale;
  }
  *step = D;
  return tmp;
}

// A vector's lanes folded to 8 (AVX-512's halves added), which the lane sums start from
typedef float kiln_v8 __attribute__((vector_size(32)));
KILN_INLINE kiln_v8 kiln_half(kiln_vf x) {
#if KILN_LANES == 16
  return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return x;
#endif
}

KILN_INLINE float kiln_sum(kiln_vf x) {
  const kiln_v8 h = kiln_half(x);
  return ((h[0] + h[4]) + (h[1] + h[5])) + ((h[2] + h[6]) + (h[3] + h[7]));
}

// exp(x) for x <= 0, to about an ulp: 2^k exp(r) with k = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by
// its Taylor series to r^6; x below -87 gives exp(-87) (~1e-38), not 0
KILN_INLINE kiln_vf kiln_exp(kiln_vf x) {
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

// The sums of eight vectors' lanes, as [sum a, ..., sum h]: pairwise sums in three levels, each a shuffle
// of two vectors (within 128-bit lanes, or of whole halves: one instruction each) and an addition
KILN_INLINE kiln_v8 kiln_pairs(kiln_v8 x, kiln_v8 y) {  // lanes 0, 1, 4, 5: x's pair sums; 2, 3, 6, 7: y's
  return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) + __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
}
KILN_INLINE kiln_v8 kiln_sum8(const kiln_vf* v) {
  const kiln_v8 abcd = kiln_pairs(kiln_pairs(kiln_half(v[0]), kiln_half(v[1])), kiln_pairs(kiln_half(v[2]), kiln_half(v[3])));
  const kiln_v8 efgh = kiln_pairs(kiln_pairs(kiln_half(v[4]), kiln_half(v[5])), kiln_pairs(kiln_half(v[6]), kiln_half(v[7])));
  // each 128-bit half of abcd holds a, b, c, d's half sums, of efgh e, f, g, h's
  return __builtin_shufflevector(abcd, efgh, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(abcd, efgh, 4, 5, 6, 7, 12, 13, 14, 15);
}

// q . k[r] for eight rows k[r] = k + r * stride of n floats (n a multiple of the vector width): q's vector is
// loaded once for all eight, and eight independent chains keep both adders busy where fewer would wait on
// each addition's latency
KILN_INLINE kiln_v8 kiln_dot_rows8(const float* q, const float* const* k, int64_t n) {
  kiln_vf acc[8] = {};
  for (int64_t i = 0; i < n; i += KILN_LANES) {
    const kiln_vf x = kiln_load(q + i);
    for (int r = 0; r < 8; ++r) acc[r] += x * kiln_load(k[r] + i);
  }
  return kiln_sum8(acc);
}

// acc[0, NV vectors) += sum over rows r of w[r] v[r * stride + ...]: the accumulators stay in registers over
// all the rows (NV <= 8 leaves registers for a row's load and its weight)
template <int NV>
KILN_INLINE void kiln_weighted_rows(const float* w, const float* v, int64_t stride, int64_t rows, float* acc) {
  kiln_vf a[NV];
  for (int i = 0; i < NV; ++i) a[i] = kiln_load(acc + i * KILN_LANES);
  for (int64_t r = 0; r < rows; ++r) {
    const float wr = w[r];
    const float* vr = v + r * stride;
    for (int i = 0; i < NV; ++i) a[i] += wr * kiln_load(vr + i * KILN_LANES);
  }
  for (int i = 0; i < NV; ++i) kiln_store(acc + i * KILN_LANES, a[i]);
}

// acc[D] += sum over rows r of w[r] v[r * stride + ...], for any D
static void kiln_weighted_sum(const float* w, const float* v, int64_t stride, int64_t rows, int64_t D, float* acc) {
  int64_t c = 0;
  for (; c + 8 * KILN_LANES <= D; c += 8 * KILN_LANES) kiln_weighted_rows<8>(w, v + c, stride, rows, acc + c);
  switch ((D - c) / KILN_LANES) {
    case 7: kiln_weighted_rows<7>(w, v + c, stride, rows, acc + c); break;
    case 6: kiln_weighted_rows<6>(w, v + c, stride, rows, acc + c); break;
    case 5: kiln_weighted_rows<5>(w, v + c, stride, rows, acc + c); break;
    case 4: kiln_weighted_rows<4>(w, v + c, stride, rows, acc + c); break;
    case 3: kiln_weighted_rows<3>(w, v + c, stride, rows, acc + c); break;
    case 2: kiln_weighted_rows<2>(w, v + c, stride, rows, acc + c); break;
    case 1: kiln_weighted_rows<1>(w, v + c, stride, rows, acc + c); break;
  }
  for (c += (D - c) / KILN_LANES * KILN_LANES; c < D; ++c)
    for (int64_t r = 0; r < rows; ++r) acc[c] += w[r] * v[r * stride + c];
}

// The blocks of a context are scattered over the cache, which the hardware prefetcher does not follow: each
// block (all its rows, every KV head's) is asked for while the block before it is worked on, a share of its
// cache lines at each of `steps` steps of that work (asked for at once, they overflow the core's
// outstanding misses and the requests wait in line)
struct kiln_ahead {
  const char* next;
  int64_t lines, per, done;
  kiln_ahead(const void* block, int64_t bytes, int64_t steps)
      : next((const char*)block), lines(block ? (bytes + 63) / 64 : 0), per((lines + steps - 1) / steps), done(0) {}
  __attribute__((always_inline)) inline void step() {
    for (int64_t u = 0; u < per && done < lines; ++u, ++done) __builtin_prefetch(next + done * 64);
  }
};

// Context rows [lo, hi) of one sequence (block table `table`), every KV head's G query heads q [HKV * G, D]
// together, so each block of K and V is read whole by one thread (one thread per KV head, each reading its
// head's half of every row, read the cache at a third of the machine's bandwidth): m[i] = query head i's highest
// scaled score, l[i] = the sum of exp(score - m[i]), acc [HKV * G, D] = the sum of exp(score - m[i]) v, with
// `scores` room for HKV * G * (hi - lo) floats and `tmp` for BS * D. K and V are [N, BS, HKV, R] each, a row R
// elements: D floats, or D int8 codes and their scale's four bytes.
template <typename T>
static void kiln_span(const float* q, const T* keys, const T* values, const int32_t* table, int64_t lo, int64_t hi,
                      int64_t BS, int64_t HKV, int64_t D, int64_t R, int64_t G, float scale, float* scores, float* tmp,
                      float* m, float* l, float* acc) {
  const int64_t n = hi - lo, stride = HKV * R, HQ = HKV * G, block = BS * stride;
  for (int64_t i = 0; i < HQ * D; ++i) acc[i] = 0.f;
  if (n <= 0) {
    for (int64_t i = 0; i < HQ; ++i) m[i] = -INFINITY, l[i] = 0.f;
    return;
  }
  const int64_t first = lo / BS, last = (hi - 1) / BS, vectors = D / KILN_LANES * KILN_LANES;
  for (int64_t j = first; j <= last; ++j) {  // scores, each query head's over a block's rows eight at a time
    const int64_t r0 = j == first ? lo - j * BS : 0, rows = (j == last ? hi - j * BS : BS) - r0;
    kiln_ahead ahead(j < last ? keys + table[j + 1] * block : nullptr, block * sizeof(T), HQ * ((rows + 7) / 8));
    for (int64_t h = 0; h < HKV; ++h) {
      int64_t step;
      const float* k = kiln_rows(keys + table[j] * block + r0 * stride + h * R, stride, rows, D, tmp, &step);
      for (int64_t i = h * G; i < (h + 1) * G; ++i) {
        const float* qi = q + i * D;
        float* s = scores + i * n + j * BS + r0 - lo;
        for (int64_t r = 0; r < rows; r += 8) {  // past the last row, the last row again, its scores not kept
          ahead.step();
          const float* kr[8];
          for (int u = 0; u < 8; ++u) kr[u] = k + (r + u < rows ? r + u : rows - 1) * step;
          kiln_v8 dots = kiln_dot_rows8(qi, kr, vectors);
          for (int64_t c = vectors; c < D; ++c)
            for (int u = 0; u < 8; ++u) dots[u] += qi[c] * kr[u][c];
          dots *= scale;
          if (r + 8 <= rows)
            __builtin_memcpy(s + r, &dots, sizeof dots);
          else
            for (int64_t u = 0; r + u < rows; ++u) s[r + u] = dots[u];
        }
      }
    }
  }
  for (int64_t i = 0; i < HQ; ++i) {  // exp(score - max), in place
    float* s = scores + i * n;
    kiln_vf tops = kiln_vf{} - INFINITY;
    int64_t c = 0;
    for (; c + KILN_LANES <= n; c += KILN_LANES) {
      const kiln_vf x = kiln_load(s + c);
      tops = x > tops ? x : tops;
    }
    float top = -INFINITY;
    for (int lane = 0; lane < KILN_LANES; ++lane) top = tops[lane] > top ? tops[lane] : top;
    for (; c < n; ++c) top = s[c] > top ? s[c] : top;
    kiln_vf sums = {};
    for (c = 0; c + KILN_LANES <= n; c += KILN_LANES) {
      const kiln_vf e = kiln_exp(kiln_load(s + c) - top);
      kiln_store(s + c, e);
      sums += e;
    }
    float sum = kiln_sum(sums);
    for (; c < n; ++c) sum += (s[c] = expf(s[c] - top));
    m[i] = top, l[i] = sum;
  }
  for (int64_t j = first; j <= last; ++j) {  // the weighted values, each query head's over a block's rows
    const int64_t r0 = j == first ? lo - j * BS : 0, rows = (j == last ? hi - j * BS : BS) - r0;
    kiln_ahead ahead(j < last ? values + table[j + 1] * block : nullptr, block * sizeof(T), HQ);
    for (int64_t h = 0; h < HKV; ++h) {
      int64_t step;
      const float* v = kiln_rows(values + table[j] * block + r0 * stride + h * R, stride, rows, D, tmp, &step);
      for (int64_t i = h * G; i < (h + 1) * G; ++i, ahead.step())
        kiln_weighted_sum(scores + i * n + j * BS + r0 - lo, v, step, rows, D, acc + i * D);
    }
  }
}

// The rows [start, end) of sequence b's context the query attends: its length, clamped to its block table,
// and only the last `window` of them where window > 0
KILN_INLINE int64_t kiln_context(const int32_t* lens, int64_t b, int64_t W, int64_t BS, int64_t window,
                                   int64_t* start) {
  const int64_t end = lens[b] < W * BS ? lens[b] : W * BS;
  *start = window > 0 && end > window ? end - window : 0;
  return end;
}

// Spans are at least this many tokens: a shorter one's setup and merge cost more than its thread gains
#define KILN_MIN_SPAN 128

// out [B, HQ, D] = softmax(scale q k^T) v per sequence b over its context (the last `window` tokens of
// it if window > 0), K and V read from the paged cache [2, N, BS, HKV, R] through tables [B, W] (R = D for
// fp32 rows, D + 4 for int8 rows). Each sequence's context is split into spans, enough of them to keep every
// thread busy (batch 1 too), each span worked on apart for all heads, then the spans merged by their maxima
// and sums (flash-decoding).
template <typename T>
static void kiln_decode(const float* q, const T* cache, const int32_t* tables, const int32_t* lens,
                        const float* params, float* out, int64_t B, int64_t HQ, int64_t D, int64_t N, int64_t BS,
                        int64_t HKV, int64_t R, int64_t W) {
  const float scale = params[0];
  const int64_t window = (int64_t)params[1], G = HQ / HKV, half = N * BS * HKV * R;
  int64_t longest = 0;
  for (int64_t b = 0, start; b < B; ++b) {
    const int64_t n = kiln_context(lens, b, W, BS, window, &start) - start;
    longest = n > longest ? n : longest;
  }
  const int64_t threads = omp_get_max_threads(), most = longest / KILN_MIN_SPAN > 1 ? longest / KILN_MIN_SPAN : 1;
  int64_t S = 1;  // spans per context: enough tasks for four per thread, so unequal contexts still balance
  while (S < most && B * S < 4 * threads) ++S;
  const int64_t record = HQ * D + 2 * HQ;  // a span's acc [HQ, D], then m [HQ], then l [HQ]
  float* spans = (float*)malloc(sizeof(float) * B * S * record);
  #pragma omp parallel
  {
    float* scores = nullptr;
    float* tmp = (float*)malloc(sizeof(float) * BS * D);  // a block's rows of one KV head, dequantized
    int64_t capacity = 0;
    #pragma omp for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < S; ++s) {
        int64_t start;
        const int64_t n = kiln_context(lens, b, W, BS, window, &start) - start;
        const int64_t lo = start + n * s / S, hi = start + n * (s + 1) / S;
        if (HQ * (hi - lo) > capacity) {
          capacity = HQ * (hi - lo);
          free(scores);
          scores = (float*)malloc(sizeof(float) * capacity);
        }
        float* rec = spans + (b * S + s) * record;
        kiln_span(q + b * HQ * D, cache, cache + half, tables + b * W, lo, hi, BS, HKV, D, R, G, scale, scores, tmp,
                  rec + HQ * D, rec + HQ * D + HQ, rec);
      }
    free(scores);
    free(tmp);
    #pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < HQ; ++i) {
        const float* first = spans + b * S * record;
        float top = -INFINITY, total = 0.f;
        for (int64_t s = 0; s < S; ++s) top = first[s * record + HQ * D + i] > top ? first[s * record + HQ * D + i] : top;
        float* o = out + (b * HQ + i) * D;
        for (int64_t c = 0; c < D; ++c) o[c] = 0.f;
        for (int64_t s = 0; s < S; ++s) {
          const float* rec = first + s * record;
          const float w = rec[HQ * D + i] == -INFINITY ? 0.f : expf(rec[HQ * D + i] - top);
          total += w * rec[HQ * D + HQ + i];
          for (int64_t c = 0; c < D; ++c) o[c] += w * rec[i * D + c];
        }
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t c = 0; c < D; ++c) o[c] *= inv;
      }
  }
  free(spans);
}

extern "C" void kiln_decode_attention(const float* q, const float* cache, const int32_t* tables, const int32_t* lens,
                                      const float* params, float* out, int64_t B, int64_t HQ, int64_t D, int64_t N,
                                      int64_t BS, int64_t HKV, int64_t W) {
  kiln_decode(q, cache, tables, lens, params, out, B, HQ, D, N, BS, HKV, D, W);
}

// The same over an int8 cache [2, N, BS, HKV, D + 4]
extern "C" void kiln_decode_attention_int8(const float* q, const int8_t* cache, const int32_t* tables,
                                           const int32_t* lens, const float* params, float* out, int64_t B,
                                           int64_t HQ, int64_t D, int64_t N, int64_t BS, int64_t HKV, int64_t W) {
  kiln_decode(q, cache, tables, lens, params, out, B, HQ, D, N, BS, HKV, D + 4, W);
}
#pragma GCC pop_options
