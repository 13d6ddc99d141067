// Stored fp16 KV straight to bfloat16, in one pass (x86-64 AVX-512).
//
// A stored 16-bit value is either in natural little-endian order or split into two byte planes (all low
// bytes, then all high bytes; see store/codec.py). numpy took four passes to rebuild the fp16 array and torch
// a fifth to cast it to bf16 (≈5 ms a layer for a 6.3k-token prompt, on the critical path of every blended
// layer); this reads each byte once and writes bf16, rounding to nearest even as torch's cast does.
//
// The rotated variant also turns the keys (before rotary, as stored) to their absolute positions in the prompt
// on the way, rounding each step as model/rotary.py's bf16 torch ops do (the same bits): the loader then hands
// out keys ready for the decode cache, and the blend's compute rotates only the rows it recomputes.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// 16 float32 lanes rounded to nearest even at bfloat16 precision, as float32 bit patterns whose low 16 bits are
// garbage (the values are finite, so no NaN case)
inline __m512i rounded_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
}

// 16 float32 lanes -> 16 bfloat16
inline __m256i to_bf16(__m512 x) { return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded_bits(x), 16)); }

// 16 float32 lanes rounded to bfloat16 precision (the float32 a bf16 tensor element reads as)
inline __m512 round_bf16(__m512 x) {
  return _mm512_castsi512_ps(_mm512_and_si512(rounded_bits(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
}

inline float bf16_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

inline float round_bf16(float x) { return bf16_float(to_bf16(x)); }

inline uint16_t fp16_at(const uint8_t* body, int64_t i, int64_t count, bool planes) {
  if (planes) return static_cast<uint16_t>(body[i] | (body[count + i] << 8));
  uint16_t v;
  std::memcpy(&v, body + 2 * i, sizeof v);
  return v;
}

// stored values i .. i+15 as float32
inline __m512 load16(const uint8_t* body, int64_t i, int64_t count, bool planes) {
  __m256i halves;
  if (planes) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + count + i));
    halves = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
  } else {
    halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 2 * i));
  }
  return _mm512_cvtph_ps(halves);
}

// 16 bfloat16 at p as float32
inline __m512 load_bf16(const uint16_t* p) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// values begin .. end-1 of `body` as bf16 into out[0 .. end-begin-1]
void convert_run(const uint8_t* body, int64_t count, bool planes, int64_t begin, int64_t end, uint16_t* out) {
  int64_t i = begin;
  for (; i + 16 <= end; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (i - begin)), to_bf16(load16(body, i, count, planes)));
  for (; i < end; ++i) out[i - begin] = to_bf16(_cvtsh_ss(fp16_at(body, i, count, planes)));
}

// One head's key (dim values from stored index `at`) rotated by bf16 cos/sin [dim] (halves repeat) into out:
// x1' = x1*c - x2*s, x2' = x2*c + x1*s, with x, each product and each sum rounded to bf16 as torch's ops round.
void rotate_head(const uint8_t* body, int64_t count, bool planes, int64_t at, int64_t dim, const uint16_t* cos,
                 const uint16_t* sin, uint16_t* out) {
  const int64_t half = dim / 2;
  int64_t j = 0;
  for (; j + 16 <= half; j += 16) {
    const __m512 x1 = round_bf16(load16(body, at + j, count, planes));
    const __m512 x2 = round_bf16(load16(body, at + half + j, count, planes));
    const __m512 c = load_bf16(cos + j), s = load_bf16(sin + j);
    const __m512 o1 = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s)));
    const __m512 o2 = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), to_bf16(o1));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + half + j), to_bf16(o2));
  }
  for (; j < half; ++j) {
    const float x1 = round_bf16(_cvtsh_ss(fp16_at(body, at + j, count, planes)));
    const float x2 = round_bf16(_cvtsh_ss(fp16_at(body, at + half + j, count, planes)));
    const float c = bf16_float(cos[j]), s = bf16_float(sin[j]);
    out[j] = to_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
    out[half + j] = to_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
  }
}

}  // namespace

// Values 0 .. count-1 of `body` (fp16, byte planes when `planes`), the first `split` into `first`, the rest
// into `second` (K and V of one stored layer), as bfloat16 bits.
extern "C" void kvrag_fp16_to_bf16(const uint8_t* body, int64_t count, int planes, int64_t split, uint16_t* first,
                                   uint16_t* second) {
  convert_run(body, count, planes, 0, split, first);
  convert_run(body, count, planes, split, count, second);
}

// As kvrag_fp16_to_bf16 for one stored layer of `rows` tokens, K [rows, heads, dim] then V, with each key row t
// rotated by cos[t], sin[t] (bfloat16 bits, [rows, dim] each, row stride `rope_stride`) on the way.
extern "C" void kvrag_fp16_to_bf16_rotated(const uint8_t* body, int64_t rows, int64_t heads, int64_t dim, int planes,
                                           const uint16_t* cos, const uint16_t* sin, int64_t rope_stride,
                                           uint16_t* k_out, uint16_t* v_out) {
  const int64_t split = rows * heads * dim, count = 2 * split;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (t * heads + h) * dim;
      rotate_head(body, count, planes, at, dim, cos + t * rope_stride, sin + t * rope_stride, k_out + at);
    }
  convert_run(body, count, planes, split, count, v_out);
}
