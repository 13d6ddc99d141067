// Stored fp16 KV straight to bfloat16, in one pass (x86-64: AVX-512 or AVX2 + F16C, kernels/simd.h).
//
// A stored 16-bit value is either in natural little-endian order or split into two byte planes (all low
// bytes, then all high bytes; see store/codec.py). numpy took four passes to rebuild the fp16 array and torch
// a fifth to cast it to bf16 (≈5 ms a layer for a 6.3k-token prompt, on the critical path of every blended
// layer); this reads each byte once and writes bf16, rounding to nearest even as torch's cast does.
//
// The rotated variant also turns the keys (before rotary, as stored) to their absolute positions in the prompt
// on the way, rounding each step as model/rotary.py's bf16 torch ops do (the same bits): the loader then hands
// out keys ready for the decode cache, and the blend's compute rotates only the rows it recomputes.

#include "simd.h"

#include <cstdint>
#include <cstring>

namespace {

using namespace kvrag_simd;

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

// stored values i .. i+W-1 as float32: byte planes interleaved back into fp16 (W low bytes, W high bytes)
inline vf load_stored(const uint8_t* body, int64_t i, int64_t count, bool planes) {
  if (!planes) return load_fp16(reinterpret_cast<const uint16_t*>(body + 2 * i));
#if KVRAG_AVX512
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + i));
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + count + i));
  return fp16_lanes(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
#else
  const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(body + i));
  const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(body + count + i));
  return fp16_lanes(_mm_unpacklo_epi8(lo, hi));
#endif
}

// values begin .. end-1 of `body` as bf16 into out[0 .. end-begin-1]
void convert_run(const uint8_t* body, int64_t count, bool planes, int64_t begin, int64_t end, uint16_t* out) {
  int64_t i = begin;
  for (; i + W <= end; i += W) store_bf16(out + (i - begin), load_stored(body, i, count, planes));
  for (; i < end; ++i) out[i - begin] = to_bf16(_cvtsh_ss(fp16_at(body, i, count, planes)));
}

// One head's key (dim values from stored index `at`) rotated by bf16 cos/sin [dim] (halves repeat) into out:
// x1' = x1*c - x2*s, x2' = x2*c + x1*s, with x, each product and each sum rounded to bf16 as torch's ops round.
void rotate_head(const uint8_t* body, int64_t count, bool planes, int64_t at, int64_t dim, const uint16_t* cos,
                 const uint16_t* sin, uint16_t* out) {
  const int64_t half = dim / 2;
  int64_t j = 0;
  for (; j + W <= half; j += W) {
    const vf x1 = kvrag_simd::round_bf16(load_stored(body, at + j, count, planes));
    const vf x2 = kvrag_simd::round_bf16(load_stored(body, at + half + j, count, planes));
    const vf c = load_bf16(cos + j), s = load_bf16(sin + j);
    const vf o1 = sub(kvrag_simd::round_bf16(mul(x1, c)), kvrag_simd::round_bf16(mul(x2, s)));
    const vf o2 = add(kvrag_simd::round_bf16(mul(x2, c)), kvrag_simd::round_bf16(mul(x1, s)));
    store_bf16(out + j, o1);
    store_bf16(out + half + j, o2);
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
