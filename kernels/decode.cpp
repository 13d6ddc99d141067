// One decode step's two memory-bound pieces for x86-64 CPUs with AVX-512: a bfloat16 matrix times one vector
// (every weight matrix of a layer, and the LM head), and one query row's attention over the bf16 decode cache.
//
// A decode step reads every weight once (270 MB for a 135M model) and does two multiply-adds a weight, so its
// speed is the memory's. torch's bf16 matmul with one row reaches 5-25 GB/s here and pays a thread barrier per
// call; these stream each matrix row by row on the calling thread (or split the rows over threads for the LM
// head), and the attention reads the cache's bf16 keys and values as they are, without a float32 copy.
//
// Numerics: bf16 inputs widen exactly to float32, products and sums are float32 (as torch's kernels), outputs
// round to nearest even. Only the order of the sums differs from torch.

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

// 16 bfloat16 values to float32 lanes: bf16 is the top half of a float32.
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline uint16_t to_bf16(float f) {  // round to nearest even (no NaN can reach here from finite inputs)
  uint32_t bits;
  __builtin_memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFF + ((bits >> 16) & 1);
  return static_cast<uint16_t>(bits >> 16);
}

inline float from_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// Rows r0..r1-1 of y = W x: W [N, K] bf16 row-major, x [K] float32 (K a multiple of 16). Four rows at a time,
// so four independent sums hide the multiply-add latency while the rows stream in order.
void gemv_rows(const uint16_t* w, const float* x, int64_t k, int64_t r0, int64_t r1, void* y, bool f32_out) {
  auto store = [&](int64_t r, float s) {
    if (f32_out)
      static_cast<float*>(y)[r] = from_bf16(to_bf16(s));  // bf16's value, widened: what .float() gives
    else
      static_cast<uint16_t*>(y)[r] = to_bf16(s);
  };
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const uint16_t* row = w + r * k;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t e = 0; e < k; e += 16) {
      const __m512 xv = _mm512_loadu_ps(x + e);
      a0 = _mm512_fmadd_ps(load_bf16(row + e), xv, a0);
      a1 = _mm512_fmadd_ps(load_bf16(row + k + e), xv, a1);
      a2 = _mm512_fmadd_ps(load_bf16(row + 2 * k + e), xv, a2);
      a3 = _mm512_fmadd_ps(load_bf16(row + 3 * k + e), xv, a3);
    }
    store(r, _mm512_reduce_add_ps(a0));
    store(r + 1, _mm512_reduce_add_ps(a1));
    store(r + 2, _mm512_reduce_add_ps(a2));
    store(r + 3, _mm512_reduce_add_ps(a3));
  }
  for (; r < r1; ++r) {
    __m512 a = _mm512_setzero_ps();
    for (int64_t e = 0; e < k; e += 16) a = _mm512_fmadd_ps(load_bf16(w + r * k + e), _mm512_loadu_ps(x + e), a);
    store(r, _mm512_reduce_add_ps(a));
  }
}

// exp(x) for float32 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); x <= 0 here.
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

// Lane i of the result is the sum of the 16 lanes of v[i]: 16 dot products finished in 15 shuffle-adds.
inline __m512 transpose_sum16(__m512* v) {
  for (int width = 8; width >= 1; width /= 2) {  // pairs (v[i], v[i + width]) fold into v[i]
    for (int i = 0; i < width; ++i) {
      __m512 a = v[i], b = v[i + width];
      __m512 lo, hi;
      if (width == 8) {  // 256-bit halves
        lo = _mm512_shuffle_f32x4(a, b, 0x44);
        hi = _mm512_shuffle_f32x4(a, b, 0xEE);
      } else if (width == 4) {  // 128-bit quarters
        lo = _mm512_shuffle_f32x4(a, b, 0x88);
        hi = _mm512_shuffle_f32x4(a, b, 0xDD);
      } else if (width == 2) {  // 64-bit pairs
        lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
        hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a), _mm512_castps_pd(b)));
      } else {  // single lanes
        lo = _mm512_shuffle_ps(a, b, 0x88);
        hi = _mm512_shuffle_ps(a, b, 0xDD);
      }
      v[i] = _mm512_add_ps(lo, hi);
    }
  }
  // the folds leave v[j]'s sum in lane perm[j] (perm is its own inverse): put each back in place
  const __m512i perm = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  return _mm512_permutexvar_ps(perm, v[0]);
}

}  // namespace

// y [N] = W [N, K] x [K]: W and x bfloat16, y bfloat16 (f32_out 0) or bf16-rounded float32 (1). K % 16 == 0.
// n_threads > 1 splits the rows (worth it for a large matrix only: a thread costs tens of microseconds).
extern "C" int kvrag_decode_gemv(const uint16_t* w, const uint16_t* x, void* y, int64_t n, int64_t k, int f32_out,
                                 int n_threads) {
  if (k % 16 || k <= 0) return 1;
  thread_local std::vector<float> xf;
  xf.resize(k);
  for (int64_t e = 0; e < k; ++e) xf[e] = from_bf16(x[e]);
  const int t = std::max(1, std::min<int>(n_threads, static_cast<int>(n / 1024)));
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i)
    pool.emplace_back(gemv_rows, w, xf.data(), k, n * i / t, n * (i + 1) / t, y, f32_out != 0);
  gemv_rows(w, xf.data(), k, 0, n / t, y, f32_out != 0);
  for (auto& th : pool) th.join();
  return 0;
}

// One query row's attention over keys 0..S-1: q [Hq, D] bf16 (rotated), k and v [S, Hkv, D] bf16 at row stride
// Hkv * D (the decode cache's first S rows), out [Hq, D] bf16. Query head h reads KV head h / (Hq / Hkv).
// Scores, softmax and the weighted sum of values in float32, as decoding's float32 matmuls compute them.
extern "C" int kvrag_decode_attention(const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
                                      int64_t n_keys, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                                      float scale) {
  if (head_dim % 16 || head_dim > 256 || n_kv_heads <= 0 || n_q_heads % n_kv_heads || n_keys <= 0) return 1;
  const int64_t group = n_q_heads / n_kv_heads, row = n_kv_heads * head_dim, nv = head_dim / 16;
  if (group > 8) return 2;
  const int64_t s_pad = (n_keys + 15) / 16 * 16;
  thread_local std::vector<float> scores;
  scores.assign(group * s_pad, 0.0f);
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    for (int64_t j = 0; j < group; ++j) {
      __m512 qv[16];
      for (int64_t c = 0; c < nv; ++c) qv[c] = load_bf16(q + ((h * group + j) * head_dim) + 16 * c);
      float* sc = scores.data() + j * s_pad;
      __m512 best = _mm512_set1_ps(-3.0e38f);
      for (int64_t s0 = 0; s0 < n_keys; s0 += 16) {  // 16 keys' dot products, then one transposed sum
        __m512 acc[16];
        for (int i = 0; i < 16; ++i) {
          acc[i] = _mm512_setzero_ps();
          if (s0 + i < n_keys) {
            const uint16_t* kr = k + (s0 + i) * row + h * head_dim;
            for (int64_t c = 0; c < nv; ++c) acc[i] = _mm512_fmadd_ps(qv[c], load_bf16(kr + 16 * c), acc[i]);
          }
        }
        const __m512 s = _mm512_mul_ps(transpose_sum16(acc), _mm512_set1_ps(scale));
        const __mmask16 live = n_keys - s0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n_keys - s0)) - 1);
        _mm512_storeu_ps(sc + s0, s);
        best = _mm512_mask_max_ps(best, live, best, s);
      }
      const float m = _mm512_reduce_max_ps(best);
      __m512 total = _mm512_setzero_ps();
      for (int64_t s0 = 0; s0 < n_keys; s0 += 16) {
        const __mmask16 live = n_keys - s0 >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n_keys - s0)) - 1);
        const __m512 p = _mm512_maskz_mov_ps(live, exp_ps(_mm512_sub_ps(_mm512_loadu_ps(sc + s0), _mm512_set1_ps(m))));
        _mm512_storeu_ps(sc + s0, p);
        total = _mm512_add_ps(total, p);
      }
      const float inv = 1.0f / _mm512_reduce_add_ps(total);
      for (int64_t s = 0; s < n_keys; ++s) sc[s] *= inv;  // softmax's probabilities, as softmax() returns them
    }
    // out_j = sum_s p_j[s] v[s]: each value row read once for the group's query heads
    __m512 acc[8][16];
    for (int64_t j = 0; j < group && j < 8; ++j)
      for (int64_t c = 0; c < nv; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < n_keys; ++s) {
      const uint16_t* vr = v + s * row + h * head_dim;
      for (int64_t c = 0; c < nv; ++c) {
        const __m512 vv = load_bf16(vr + 16 * c);
        for (int64_t j = 0; j < group; ++j)
          acc[j][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[j * s_pad + s]), vv, acc[j][c]);
      }
    }
    for (int64_t j = 0; j < group; ++j) {
      alignas(64) float lanes[16];
      for (int64_t c = 0; c < nv; ++c) {
        _mm512_store_ps(lanes, acc[j][c]);
        for (int i = 0; i < 16; ++i) out[(h * group + j) * head_dim + 16 * c + i] = to_bf16(lanes[i]);
      }
    }
  }
  return 0;
}
