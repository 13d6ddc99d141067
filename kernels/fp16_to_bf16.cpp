// Stored fp16 KV straight to bfloat16, in one pass (x86-64 AVX-512).
//
// A stored 16-bit value is either in natural little-endian order or split into two byte planes (all low
// bytes, then all high bytes; see store/codec.py). numpy took four passes to rebuild the fp16 array and torch
// a fifth to cast it to bf16 (≈5 ms a layer for a 6.3k-token prompt, on the critical path of every blended
// layer); this reads each byte once and writes bf16, rounding to nearest even as torch's cast does.

#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// 16 float32 lanes -> 16 bfloat16 (round to nearest even; the values are finite fp16, so no NaN case)
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return static_cast<uint16_t>((bits + ((bits >> 16) & 1) + 0x7FFF) >> 16);
}

inline uint16_t fp16_at(const uint8_t* body, int64_t i, int64_t count, bool planes) {
  if (planes) return static_cast<uint16_t>(body[i] | (body[count + i] << 8));
  uint16_t v;
  std::memcpy(&v, body + 2 * i, sizeof v);
  return v;
}

}  // namespace

// Values 0 .. count-1 of `body` (fp16, byte planes when `planes`), the first `split` into `first`, the rest
// into `second` (K and V of one stored layer), as bfloat16 bits.
extern "C" void kvrag_fp16_to_bf16(const uint8_t* body, int64_t count, int planes, int64_t split, uint16_t* first,
                                   uint16_t* second) {
  auto out = [&](int64_t i) { return i < split ? first + i : second + (i - split); };
  int64_t i = 0;
  for (; i < count; ) {
    // a run of 16 that stays on one side of the split goes through the vector path
    const int64_t run_end = i < split ? split : count;
    for (; i + 16 <= run_end; i += 16) {
      __m256i halves;
      if (planes) {
        const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + i));
        const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(body + count + i));
        halves = _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
      } else {
        halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(body + 2 * i));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out(i)), to_bf16(_mm512_cvtph_ps(halves)));
    }
    for (; i < run_end; ++i) *out(i) = to_bf16(_cvtsh_ss(fp16_at(body, i, count, planes)));
  }
}
