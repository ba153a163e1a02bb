// kiln::greedy_screen's kernel: quantize the hidden states, bound their error, run the int8 panel GEMM over
// the vocabulary, and compute again in fp32 only the tokens that can beat the int8 leader, in one call.
// Spliced into the wrapper of the library AOTInductor builds from a graph of the one op, which an artifact ships.
#include "panel_int8_linear.cpp"  // its GEMM: kiln_panel_int8_rows and kiln_panel_int8_panels
#include <float.h>
#include <math.h>

#pragma GCC push_options
#pragma GCC optimize("O3")

static inline float kiln_screen_dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// codes [K] and scale of x [K] as kiln::quant_int8 makes them (per row, symmetric, round half to even);
// false where x holds a NaN or an infinity
static bool kiln_screen_quantize(const float* x, int64_t K, int8_t* codes, float* scale) {
  float top = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = fabsf(x[k]);
    if (!(a <= FLT_MAX)) return false;
    top = a > top ? a : top;
  }
  const float s = top / 127.f > 1e-10f ? top / 127.f : 1e-10f;
  for (int64_t k = 0; k < K; ++k) {
    const float q = nearbyintf(x[k] / s);
    codes[k] = (int8_t)(q > 127.f ? 127.f : q < -127.f ? -127.f : q);
  }
  *scale = s;
  return true;
}

// A thread's best candidate of a row: the largest fp32 logit, the first token of equal ones
struct kiln_screen_best { float logit; int64_t token; };

static inline void kiln_screen_take(kiln_screen_best* best, float logit, int64_t token) {
  if (best->token < 0 || logit > best->logit || (logit == best->logit && token < best->token)) {
    best->logit = logit;
    best->token = token;
  }
}

// Row r's leader over the n threads' leaders `best` [n, R] (token -1: none), taken in thread order: the
// largest logit, the first token of equal ones, since each thread holds a later share of the vocabulary
static kiln_screen_best kiln_screen_lead(const kiln_screen_best* best, int64_t R, int64_t r, int64_t n) {
  kiln_screen_best lead = {0.f, -1};
  for (int64_t j = 0; j < n; ++j)
    if (best[j * R + r].token >= 0 && (lead.token < 0 || best[j * R + r].logit > lead.logit)) lead = best[j * R + r];
  return lead;
}

// tokens [R]: each row's argmax of an int8 LM head's logits s (t_v (q . c_v)), fp32 rounded after each
// product as Int8Head computes them (q, s: the row quantized as kiln::quant_int8 does), the first of
// equal ones; -1 for a row with a NaN or an infinity in h or in its logits. The codes c are the head.
static void kiln_int8_head_argmax(const float* h, const uint8_t* w, const float* t, int64_t* tokens, int64_t R,
                                  int64_t V, int64_t K) {
  const int64_t panels = V / 16;
  int8_t* codes = (int8_t*)malloc(R * K);
  float* scale = (float*)malloc(sizeof(float) * R);
  bool* finite = (bool*)malloc(R);
  for (int64_t r = 0; r < R; ++r) finite[r] = kiln_screen_quantize(h + r * K, K, codes + r * K, scale + r);
  int32_t* at = (int32_t*)aligned_alloc(64, ((R * K / 4 + R + 15) / 16) * 64);
  int32_t* shift = at + R * K / 4;
  kiln_panel_int8_rows(codes, R, K, at, shift);
  float* y = (float*)malloc(sizeof(float) * R * V);
  const int threads = omp_get_max_threads();
  kiln_screen_best* best = (kiln_screen_best*)malloc(sizeof(kiln_screen_best) * threads * R);
  bool* nan = (bool*)calloc(threads * R, 1);
  for (int64_t j = 0; j < threads * R; ++j) best[j].token = -1;
  #pragma omp parallel num_threads(threads)
  {
    const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t first = panels * i / n * 16, last = panels * (i + 1) / n * 16;
    kiln_panel_int8_panels(at, shift, w, y, R, V, K, first / 16, last / 16);
    for (int64_t r = 0; r < R; ++r) {
      kiln_screen_best* lead = best + i * R + r;
      const float* yr = y + r * V;
      const float s = scale[r];
      for (int64_t v = first; v < last; ++v) {
        const float logit = (yr[v] * t[v]) * s;
        if (logit != logit) nan[i * R + r] = true;
        if (lead->token < 0 || logit > lead->logit) lead->logit = logit, lead->token = v;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    bool bad = !finite[r];
    for (int j = 0; j < threads; ++j) bad = bad || nan[j * R + r];
    tokens[r] = bad ? -1 : kiln_screen_lead(best, R, r, threads).token;
  }
  free(nan), free(best), free(y), free(at), free(finite), free(scale), free(codes);
}

// tokens [R]: each row's argmax of h [R, K] @ W.T over the vocabulary (W [V, K] fp32), from the int8
// panels `w` of W's codes with scales `t` [V]; -1 for a row with a NaN or infinity, and for every row
// when the candidates outnumber params[3] per row. params: the largest row norms of W, of its codes
// times their scales and of their difference (each raised by 2 gamma), and the candidate cap. A
// negative cap: `w` and `t` are an int8 LM head itself, W is not read, and the tokens are the argmax
// of its logits (kiln_int8_head_argmax).
extern "C" void kiln_greedy_screen(const float* h, const uint8_t* w, const float* t, const float* W,
                                   const double* params, int64_t* tokens, int64_t R, int64_t V, int64_t K) {
  if (params[3] < 0) return kiln_int8_head_argmax(h, w, t, tokens, R, V, K);
  const double u = ldexp(1.0, -24), gamma = (K + 1) * u / (1 - (K + 1) * u);
  const double norm_w = params[0], norm_wq = params[1], norm_dw = params[2];
  const int64_t cap = (int64_t)params[3] * R, panels = V / 16;
  // row r's codes, then a row of the residual's codes for each row whose quantization error outweighs
  // the weight's; `second[r]` is that row's index, or -1
  int8_t* codes = (int8_t*)calloc(2 * R * K, 1);
  float* scale = (float*)malloc(sizeof(float) * 2 * R);
  float* threshold = (float*)malloc(sizeof(float) * R);
  double* window = (double*)malloc(sizeof(double) * R);
  int64_t* second = (int64_t*)malloc(sizeof(int64_t) * R);
  float* residual = (float*)malloc(sizeof(float) * K);
  bool* finite = (bool*)malloc(R);
  int64_t M = R;
  for (int64_t r = 0; r < R; ++r) {
    const float* x = h + r * K;
    second[r] = -1;
    finite[r] = kiln_screen_quantize(x, K, codes + r * K, scale + r);
    if (!finite[r]) continue;
    const double s = scale[r];
    double norm = 0, quant_norm = 0, error = 0;
    for (int64_t k = 0; k < K; ++k) {
      const double quant = codes[r * K + k] * s, diff = quant - x[k];
      norm += (double)x[k] * x[k];
      quant_norm += quant * quant;
      error += diff * diff;
    }
    norm = sqrt(norm), quant_norm = sqrt(quant_norm), error = sqrt(error);
    double rounding = 3.01 * u * quant_norm;
    if (error * norm_w > quant_norm * norm_dw) {  // the residual h - h' quantized in turn: two codes a row
      for (int64_t k = 0; k < K; ++k) residual[k] = (float)(x[k] - codes[r * K + k] * s);
      kiln_screen_quantize(residual, K, codes + M * K, scale + M);
      const double sr = scale[M];
      double rest = 0, residual_norm = 0;
      for (int64_t k = 0; k < K; ++k) {
        const double quant = codes[M * K + k] * sr, left = codes[r * K + k] * s + quant - x[k];
        rest += left * left;
        residual_norm += quant * quant;
      }
      error = sqrt(rest), quant_norm += sqrt(residual_norm);
      rounding = 6.01 * u * quant_norm;
      second[r] = M++;
    }
    window[r] = error * norm_w + quant_norm * norm_dw + rounding * norm_wq + 3 * gamma * norm * norm_w;
  }
  int32_t* at = (int32_t*)aligned_alloc(64, ((M * K / 4 + M + 15) / 16) * 64);
  int32_t* shift = at + M * K / 4;
  kiln_panel_int8_rows(codes, M, K, at, shift);
  float* y = (float*)malloc(sizeof(float) * M * V);
  const int threads = omp_get_max_threads();
  kiln_screen_best* best = (kiln_screen_best*)malloc(sizeof(kiln_screen_best) * threads * R);
  for (int64_t j = 0; j < threads * R; ++j) best[j].token = -1;  // a thread the team leaves out has none
  int64_t* found = (int64_t*)calloc(threads, sizeof(int64_t));
  #pragma omp parallel num_threads(threads)
  {
    const int64_t i = omp_get_thread_num(), n = omp_get_num_threads();
    const int64_t first = panels * i / n * 16, last = panels * (i + 1) / n * 16;
    kiln_panel_int8_panels(at, shift, w, y, M, V, K, first / 16, last / 16);
    // y = t (q . c), as s y is the logit; a second row's y joins its first's, scaled by its scale's ratio
    for (int64_t r = 0; r < R; ++r) {
      kiln_screen_best* lead = best + i * R + r;
      lead->token = -1;
      float* yr = y + r * V;
      const float* y2 = second[r] >= 0 ? y + second[r] * V : nullptr;
      const float ratio = second[r] >= 0 ? scale[second[r]] / scale[r] : 0.f;
      for (int64_t v = first; v < last; ++v) {
        yr[v] *= t[v];
        if (y2) yr[v] += (y2[v] * t[v]) * ratio;
        if (lead->token < 0 || yr[v] > lead->logit) lead->logit = yr[v], lead->token = v;
      }
    }
    #pragma omp barrier
    #pragma omp single
    for (int64_t r = 0; r < R; ++r) {  // the threshold a token's y must reach to beat the leader in fp32
      const kiln_screen_best lead = kiln_screen_lead(best, R, r, n);
      threshold[r] = NAN;
      if (finite[r] && lead.token >= 0) {
        const double logit = kiln_screen_dot(W + lead.token * K, h + r * K, K);
        threshold[r] = nextafterf((float)((logit - window[r]) / scale[r]), -INFINITY);
      }
    }
    // each thread computes its candidates' fp32 logits: a few rows of W, in its own half of y
    int64_t count = 0;
    for (int64_t r = 0; r < R; ++r) {
      kiln_screen_best* top = best + i * R + r;
      top->token = -1;
      const float bar = threshold[r];
      if (!(bar > -INFINITY && bar < INFINITY)) continue;
      const float* yr = y + r * V;
      for (int64_t v = first; v < last && count <= cap; ++v)
        if (yr[v] >= bar) {
          ++count;
          kiln_screen_take(top, kiln_screen_dot(W + v * K, h + r * K, K), v);
        }
    }
    found[i] = count;
  }
  int64_t total = 0;
  for (int j = 0; j < threads; ++j) total += found[j];
  for (int64_t r = 0; r < R; ++r) {
    kiln_screen_best top = {0.f, -1};
    for (int j = 0; j < threads; ++j)
      if (best[j * R + r].token >= 0) kiln_screen_take(&top, best[j * R + r].logit, best[j * R + r].token);
    tokens[r] = total > cap || !(threshold[r] > -INFINITY && threshold[r] < INFINITY) ? -1 : top.token;
  }
  free(found), free(best), free(y), free(at), free(finite), free(residual), free(second), free(window);
  free(threshold), free(scale), free(codes);
}
#pragma GCC pop_options
