// The vector layer every kvrag kernel is written in: one source per kernel, built once per instruction set
// (kernels/native.py: AVX-512, AVX2 + AVX-VNNI, AVX2; each with FMA and F16C). `W` float32 lanes a vector (16 or
// 8); the kernels step by W, so the ISA changes how many lanes an inner loop takes, not the logic around it.
// Lane for lane each operation rounds as IEEE float32 does on every ISA; only the reductions' trees are the
// ISA's own (reduce_add and transpose_sum give the same bits within one ISA, which the batch invariance needs).
#pragma once

#include <immintrin.h>

#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define KVRAG_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVRAG_AVX512 0
#else
#error "kvrag's kernels need AVX-512 (F, BW, VL, DQ) or AVX2 with FMA and F16C"
#endif

namespace kvrag_simd {

#if KVRAG_AVX512
constexpr int W = 16;
using vf = __m512;
using vi = __m512i;
using vmask = __mmask16;

inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf loadu(const float* p) { return _mm512_loadu_ps(p); }
inline vf load(const float* p) { return _mm512_load_ps(p); }  // 64-byte aligned
inline void storeu(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void store(float* p, vf v) { _mm512_store_ps(p, v); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf abs(vf a) { return _mm512_abs_ps(a); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a b + c
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_even(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf p, vf n) { return _mm512_scalef_ps(p, n); }  // p 2^n, n integral

inline vi izero() { return _mm512_setzero_si512(); }
inline vi iset1(int32_t x) { return _mm512_set1_epi32(x); }
inline vi iloadu(const void* p) { return _mm512_loadu_si512(p); }
inline vi iload(const void* p) { return _mm512_load_si512(p); }
inline void istoreu(void* p, vi v) { _mm512_storeu_si512(p, v); }
inline vi iadd(vi a, vi b) { return _mm512_add_epi32(a, b); }
inline vi isub(vi a, vi b) { return _mm512_sub_epi32(a, b); }
inline vi iand(vi a, vi b) { return _mm512_and_si512(a, b); }
inline vi ixor(vi a, vi b) { return _mm512_xor_si512(a, b); }
inline vi srli32(vi a, int n) { return _mm512_srli_epi32(a, n); }
inline vi srli16(vi a, int n) { return _mm512_srli_epi16(a, n); }
inline vi slli32(vi a, int n) { return _mm512_slli_epi32(a, n); }
inline vi ibyte(int8_t x) { return _mm512_set1_epi8(x); }
inline int32_t ireduce_add(vi v) { return _mm512_reduce_add_epi32(v); }
inline vi to_int(vf v) { return _mm512_cvtps_epi32(v); }  // round to nearest even
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf as_float(vi v) { return _mm512_castsi512_ps(v); }
inline vi as_int(vf v) { return _mm512_castps_si512(v); }
inline vi lane_index() { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// W unsigned 16-bit values widened to 32-bit lanes; W 32-bit lanes (each < 2^16) narrowed and stored; W int32
// (each in [-128, 127]) stored as int8
inline vi widen_u16(const uint16_t* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_u16(uint16_t* p, vi v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(v)); }
inline void store_i8(int8_t* p, vi v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v)); }
inline vf load_fp16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf fp16_lanes(__m256i halves) { return _mm512_cvtph_ps(halves); }

// masks: lanes i < n; lanes where first + i <= last; m ? a : b; m ? a : 0; the lanes' max where m
inline vmask lanes_below(int64_t n) { return n >= W ? vmask(0xFFFF) : static_cast<vmask>((1u << n) - 1); }
inline vmask lanes_upto(int32_t first, int32_t last) {
  return _mm512_cmple_epi32_mask(_mm512_add_epi32(lane_index(), _mm512_set1_epi32(first)), _mm512_set1_epi32(last));
}
inline vf select(vmask m, vf a, vf b) { return _mm512_mask_mov_ps(b, m, a); }
inline vf keep(vmask m, vf a) { return _mm512_maskz_mov_ps(m, a); }

// Lane i of the result is the sum of the W lanes of v[i], folding halves, quarters, pairs, then lanes:
// _mm512_reduce_add_ps's tree, so either gives the same bits.
inline vf transpose_sum(vf* v) {
  for (int width = 8; width >= 1; width /= 2) {  // pairs (v[i], v[i + width]) fold into v[i]
    for (int i = 0; i < width; ++i) {
      const vf a = v[i], b = v[i + width];
      vf lo, hi;
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

// W rows of W 32-bit lanes written as columns: lane e of the W rows at out + e * stride
inline void transpose(const vi* rows, uint32_t* out, int64_t stride) {
  vi t[16], u[16], v[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[4g + c]: lane 4L + c of rows 4g..4g+3, in 128-bit lane L
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int g = 0; g < 16; g += 8) {
    for (int c = 0; c < 4; ++c) {  // rows g..g+7: v[g + c] holds lanes c and 8 + c, v[g + 4 + c] 4 + c and 12 + c
      v[g + c] = _mm512_shuffle_i32x4(u[g + c], u[g + 4 + c], 0x88);
      v[g + 4 + c] = _mm512_shuffle_i32x4(u[g + c], u[g + 4 + c], 0xDD);
    }
  }
  for (int c = 0; c < 8; ++c) {  // v[c] and v[8 + c]: lanes c and 8 + c of all 16 rows
    _mm512_storeu_si512(out + c * stride, _mm512_shuffle_i32x4(v[c], v[8 + c], 0x88));
    _mm512_storeu_si512(out + (c + 8) * stride, _mm512_shuffle_i32x4(v[c], v[8 + c], 0xDD));
  }
}

#else  // AVX2 + FMA + F16C: 8 lanes
constexpr int W = 8;
using vf = __m256;
using vi = __m256i;
using vmask = __m256;  // all-ones lanes where set

inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf loadu(const float* p) { return _mm256_loadu_ps(p); }
inline vf load(const float* p) { return _mm256_load_ps(p); }  // 32-byte aligned
inline void storeu(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void store(float* p, vf v) { _mm256_store_ps(p, v); }
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf abs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
// ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)): transpose_sum's tree
inline float reduce_add(vf v) {
  const __m128 y = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 z = _mm_add_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_add_ss(z, _mm_movehdup_ps(z)));
}
inline float reduce_max(vf v) {
  const __m128 y = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 z = _mm_max_ps(y, _mm_movehl_ps(y, y));
  return _mm_cvtss_f32(_mm_max_ss(z, _mm_movehdup_ps(z)));
}
inline vf round_even(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// p 2^n for integral n in [-126, 127] (exp_ps's range): an exact multiply by a normal power of two, as scalef
inline vf scale_pow2(vf p, vf n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline vi izero() { return _mm256_setzero_si256(); }
inline vi iset1(int32_t x) { return _mm256_set1_epi32(x); }
inline vi iloadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline vi iload(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
inline void istoreu(void* p, vi v) { _mm256_storeu_si256(static_cast<__m256i*>(p), v); }
inline vi iadd(vi a, vi b) { return _mm256_add_epi32(a, b); }
inline vi isub(vi a, vi b) { return _mm256_sub_epi32(a, b); }
inline vi iand(vi a, vi b) { return _mm256_and_si256(a, b); }
inline vi ixor(vi a, vi b) { return _mm256_xor_si256(a, b); }
inline vi srli32(vi a, int n) { return _mm256_srli_epi32(a, n); }
inline vi srli16(vi a, int n) { return _mm256_srli_epi16(a, n); }
inline vi slli32(vi a, int n) { return _mm256_slli_epi32(a, n); }
inline vi ibyte(int8_t x) { return _mm256_set1_epi8(x); }
inline int32_t ireduce_add(vi v) {
  const __m128i y = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i z = _mm_add_epi32(y, _mm_unpackhi_epi64(y, y));
  return _mm_cvtsi128_si32(_mm_add_epi32(z, _mm_shuffle_epi32(z, 1)));
}
inline vi to_int(vf v) { return _mm256_cvtps_epi32(v); }
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline vf as_float(vi v) { return _mm256_castsi256_ps(v); }
inline vi as_int(vf v) { return _mm256_castps_si256(v); }
inline vi lane_index() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }

inline vi widen_u16(const uint16_t* p) { return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store_u16(uint16_t* p, vi v) {
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline void store_i8(int8_t* p, vi v) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(words, words));
}
inline vf load_fp16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf fp16_lanes(__m128i halves) { return _mm256_cvtph_ps(halves); }

inline vmask lanes_below(int64_t n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n < W ? n : W)), lane_index()));
}
inline vmask lanes_upto(int32_t first, int32_t last) {  // first + i <= last, i.e. not (first + i > last)
  const __m256i at = _mm256_add_epi32(lane_index(), _mm256_set1_epi32(first));
  return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_cmpgt_epi32(at, _mm256_set1_epi32(last)), _mm256_set1_epi32(-1)));
}
inline vf select(vmask m, vf a, vf b) { return _mm256_blendv_ps(b, a, m); }
inline vf keep(vmask m, vf a) { return _mm256_and_ps(m, a); }

// Lane i of the result is the sum of the 8 lanes of v[i], in reduce_add's tree.
inline vf transpose_sum(vf* v) {
  for (int i = 0; i < 4; ++i) {  // 128-bit halves: v[i] = [sum of halves of v[i] | of v[i + 4]]
    const vf a = v[i], b = v[i + 4];
    v[i] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int i = 0; i < 2; ++i) {  // 64-bit pairs
    const __m256d a = _mm256_castps_pd(v[i]), b = _mm256_castps_pd(v[i + 2]);
    v[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  const vf sums = _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
  // the folds leave v[j]'s sum in lane perm[j] (its own inverse): put each back in place
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 2, 1, 3, 4, 6, 5, 7));
}

// 8 rows of 8 32-bit lanes written as columns: lane e of the 8 rows at out + e * stride
inline void transpose(const vi* rows, uint32_t* out, int64_t stride) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(_mm256_castsi256_ps(rows[i]), _mm256_castsi256_ps(rows[i + 1]));
    t[i + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(rows[i]), _mm256_castsi256_ps(rows[i + 1]));
  }
  for (int i = 0; i < 8; i += 4) {  // u[4g + c]: lane 4L + c of rows 4g..4g+3, in 128-bit lane L
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {  // lanes c (low halves) and 4 + c (high halves) of the 8 rows
    _mm256_storeu_ps(reinterpret_cast<float*>(out + c * stride), _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
    _mm256_storeu_ps(reinterpret_cast<float*>(out + (c + 4) * stride), _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
  }
}
#endif

// W bfloat16 values as float32 lanes: bf16 is the top half of a float32 (exact)
inline vf load_bf16(const uint16_t* p) { return as_float(slli32(widen_u16(p), 16)); }

// float32 lanes rounded to nearest even at bfloat16 precision, as float32 bit patterns whose low 16 bits are
// garbage (finite values: no NaN case)
inline vi bf16_rounded_bits(vf x) {
  const vi bits = as_int(x);
  return iadd(bits, iadd(iand(srli32(bits, 16), iset1(1)), iset1(0x7FFF)));
}
inline void store_bf16(uint16_t* p, vf x) { store_u16(p, srli32(bf16_rounded_bits(x), 16)); }  // rounded
inline vf round_bf16(vf x) { return as_float(iand(bf16_rounded_bits(x), iset1(static_cast<int32_t>(0xFFFF0000u)))); }

// exp(x) for float32 lanes (Cephes' expf: range reduction by ln 2, degree-6 polynomial, ~1 ulp); x <= 0 here.
inline vf exp_ps(vf x) {
  x = max(x, set1(-87.3f));
  const vf n = round_even(mul(x, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), x);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf p = set1(1.9875691500e-4f);
  p = fmadd(p, r, set1(1.3981999507e-3f));
  p = fmadd(p, r, set1(8.3334519073e-3f));
  p = fmadd(p, r, set1(4.1665795894e-2f));
  p = fmadd(p, r, set1(1.6666665459e-1f));
  p = fmadd(p, r, set1(5.0000001201e-1f));
  p = fmadd(p, mul(r, r), add(r, set1(1.0f)));
  return scale_pow2(p, n);  // p * 2^n
}

// The first n (< W) floats at p, the rest 0 (a copy: no read past p + n)
inline vf load_partial(const float* p, int64_t n) {
  alignas(64) float lanes[W] = {};
  for (int64_t i = 0; i < n; ++i) lanes[i] = p[i];
  return load(lanes);
}

}  // namespace kvrag_simd
