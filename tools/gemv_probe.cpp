// Issue 58's first probe: an int8 weight-only GEMV (per-64-column float scales; each int8 widened to float32, then
// a fused multiply-add) against a float32 GEMV, one output row batch of one, on SmolLM2's and Qwen2.5-0.5B's
// projection shapes, weights read from memory (64 copies, so no copy stays in cache). Not kvrag's kernel: a
// measurement of what the simplest AVX-512 form gains on a CPU before one is written (docs/performance.md).
//
//   g++ -O3 -mavx512f -mavx512bw -o /tmp/gemv_probe tools/gemv_probe.cpp && taskset -c 1 /tmp/gemv_probe
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <vector>
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
void gemv_f32(const float* w, const float* x, float* y, int n, int k) {
  for (int r = 0; r < n; r += 4) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int e = 0; e < k; e += 16) {
      __m512 xv = _mm512_loadu_ps(x + e);
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(w + (size_t)(r + 0) * k + e), xv, a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(w + (size_t)(r + 1) * k + e), xv, a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(w + (size_t)(r + 2) * k + e), xv, a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(w + (size_t)(r + 3) * k + e), xv, a3);
    }
    y[r] = _mm512_reduce_add_ps(a0); y[r + 1] = _mm512_reduce_add_ps(a1);
    y[r + 2] = _mm512_reduce_add_ps(a2); y[r + 3] = _mm512_reduce_add_ps(a3);
  }
}
// W int8 [n, k], scales [n, k / 64]: y[r] = sum_g scale[r, g] * sum_{e in g} w[r, e] x[e]
void gemv_i8(const int8_t* w, const float* s, const float* x, float* y, int n, int k) {
  const int groups = k / 64;
  for (int r = 0; r < n; r += 4) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int g = 0; g < groups; ++g) {
      __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
      for (int c = 0; c < 4; ++c) {
        const int e = g * 64 + c * 16;
        __m512 xv = _mm512_loadu_ps(x + e);
        for (int i = 0; i < 4; ++i) {
          __m128i b = _mm_loadu_si128((const __m128i*)(w + (size_t)(r + i) * k + e));
          part[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), xv, part[i]);
        }
      }
      for (int i = 0; i < 4; ++i) acc[i] = _mm512_fmadd_ps(part[i], _mm512_set1_ps(s[(size_t)(r + i) * groups + g]), acc[i]);
    }
    for (int i = 0; i < 4; ++i) y[r + i] = _mm512_reduce_add_ps(acc[i]);
  }
}
int main(int argc, char** argv) {
  int shapes[][2] = {{1536, 576}, {576, 1536}, {4864, 896}, {896, 4864}, {8960, 1536}};
  for (auto& sh : shapes) {
    int n = sh[0], k = sh[1];
    std::vector<float> wf((size_t)n * k), x(k), y(n), s((size_t)n * k / 64);
    std::vector<int8_t> wi((size_t)n * k);
    for (auto& v : wf) v = rand() / (float)RAND_MAX - 0.5f;
    for (auto& v : wi) v = rand() % 255 - 127;
    for (auto& v : s) v = 0.01f;
    for (auto& v : x) v = rand() / (float)RAND_MAX;
    // several copies so that the weights come from memory, not cache (as in a decode step over all layers)
    const int copies = 64;
    std::vector<std::vector<float>> wfs(copies, wf); std::vector<std::vector<int8_t>> wis(copies, wi);
    double best_f = 1e9, best_i = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      double t = now(); for (int c = 0; c < copies; ++c) gemv_f32(wfs[c].data(), x.data(), y.data(), n, k); best_f = std::min(best_f, (now() - t) / copies);
      t = now(); for (int c = 0; c < copies; ++c) gemv_i8(wis[c].data(), s.data(), x.data(), y.data(), n, k); best_i = std::min(best_i, (now() - t) / copies);
    }
    printf("%5d x %5d  f32 %7.1f us (%5.1f GB/s)  int8 %7.1f us (%5.1f GB/s)  speed-up %.2fx\n", n, k, best_f * 1e6,
           n * (double)k * 4 / best_f / 1e9, best_i * 1e6, n * (double)k * 1.0625 / best_i / 1e9, best_f / best_i);
  }
}
