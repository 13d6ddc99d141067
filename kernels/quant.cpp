// Weight-only quantized matrix x rows, for x86-64 CPUs with AVX512-VNNI: int8 or int4 weights in groups of 32
// inputs, each group with a float16 scale (and, for int4, a float16 minimum), times activations quantized to int8
// per group of 32 on the fly (as llama.cpp multiplies Q8_0 activations by Q8_0 or Q4_1 weights). A decode step
// reads every weight once: int8 reads about a quarter of float32's bytes, int4 a sixth.
//
// Layout (kernels/quant.py packs it): output rows in tiles of 16. For each 4 inputs of a tile, the 16 rows' 4
// bytes lie side by side in one 64-byte vector, so that VPDPBUSD's 16 lanes are the tile's 16 outputs and one
// broadcast of 4 activation bytes serves them all. int8 (w = d q, q in [-127, 127]) stores q + 128, VPDPBUSD's
// unsigned side; int4 (w = d q + m, q in [0, 15]) packs two such vectors into one, the even 4 inputs in the low
// nibbles, the odd in the high. Scales and minimums: [tiles][groups][16].
//
// Numerics: a group's integer dot is exact (int8's offset comes off in integers); its sum times (weight scale x
// activation scale), plus int4's minimum x (activation scale x the activations' integer sum), is added in float32,
// group after group, without fused multiply-adds, which the torch twin (kernels/quant.py `twin`) repeats bit
// for bit.

#include "quant.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace kvrag_quant {
namespace {

constexpr int BLOCK = 8;  // rows a pass over a tile's weights (8 accumulators and 8 weight vectors in registers)
// Weight bytes fetched into L2 ahead of the products: a tile's stream outruns the hardware prefetcher, most of all
// int4's (docs/quantized.md, "Speed against the memory floor")
constexpr int64_t AHEAD = 4096;

// Each row's activations quantized per group: q = round(x / d) with d = max |x| / 127, and the sum of q.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int32_t* sums) {
  const int64_t groups = k / GROUP;
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* p = x + i * GROUP;
    const __m512 lo = _mm512_loadu_ps(p), hi = _mm512_loadu_ps(p + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float dg = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(dg > 0.0f ? 1.0f / dg : 0.0f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv));  // round to nearest even: torch.round's
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * GROUP), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * GROUP + 16), _mm512_cvtepi32_epi8(qhi));
    d[i] = dg;
    sums[i] = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
  }
}

struct Tile {  // one tile's weights (its groups in order), float16 scales and minimums (int4) [G][16]
  const uint8_t* w;
  const uint16_t* scales;
  const uint16_t* mins;
};

inline __m512 load_half(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// out[r][0..16) for RB rows of one tile.
template <int BITS, int RB>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tile_rows(Tile t, Rows x, float* out, int64_t ldo) {
  constexpr int VECTORS = BITS == 8 ? 8 : 4;  // 64-byte weight vectors a group
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < x.groups; ++g) {
    __m512i wv[8];  // the group's 8 quads of inputs, unsigned
    const uint8_t* wg = t.w + g * VECTORS * 64;
    for (int j = 0; j < VECTORS; ++j) _mm_prefetch(reinterpret_cast<const char*>(wg + AHEAD + j * 64), _MM_HINT_T1);
    if (g % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(t.scales + g * TILE + AHEAD / 16), _MM_HINT_T1);
    for (int j = 0; j < VECTORS; ++j) {
      const __m512i v = _mm512_loadu_si512(wg + j * 64);
      if (BITS == 8) {
        wv[j] = v;
      } else {
        wv[2 * j] = _mm512_and_si512(v, nibble);
        wv[2 * j + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      }
    }
    const __m512 sw = load_half(t.scales + g * TILE);
    const __m512 mw = BITS == 4 ? load_half(t.mins + g * TILE) : _mm512_setzero_ps();
    for (int r = 0; r < RB; ++r) {
      const int8_t* xg = x.q + r * x.k + g * GROUP;
      __m512i dot = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        int32_t quad;
        std::memcpy(&quad, xg + 4 * j, 4);
        dot = _mm512_dpbusd_epi32(dot, wv[j], _mm512_set1_epi32(quad));
      }
      const int64_t i = r * x.groups + g;
      if (BITS == 8) dot = _mm512_sub_epi32(dot, _mm512_set1_epi32(128 * x.sum[i]));  // (q + 128) . xq - 128 sum(xq)
      __m512 term = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sw, _mm512_set1_ps(x.d[i])));
      asm("" : "+v"(term));  // keeps each product apart from its sum (no fused multiply-add: the twin's bits)
      if (BITS == 4) {
        __m512 shift = _mm512_mul_ps(mw, _mm512_set1_ps(x.d[i] * static_cast<float>(x.sum[i])));
        asm("" : "+v"(shift));
        term = _mm512_add_ps(term, shift);
      }
      acc[r] = _mm512_add_ps(acc[r], term);
    }
  }
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

template <int BITS>
void tile(Tile t, Rows x, int64_t rows, float* out, int64_t ldo) {
  for (int64_t r0 = 0; r0 < rows; r0 += BLOCK) {
    Rows part = x;
    part.q += r0 * x.k;
    part.d += r0 * x.groups;
    part.sum += r0 * x.groups;
    float* o = out + r0 * ldo;
    switch (std::min<int64_t>(BLOCK, rows - r0)) {
      case 1: tile_rows<BITS, 1>(t, part, o, ldo); break;
      case 2: tile_rows<BITS, 2>(t, part, o, ldo); break;
      case 3: tile_rows<BITS, 3>(t, part, o, ldo); break;
      case 4: tile_rows<BITS, 4>(t, part, o, ldo); break;
      case 5: tile_rows<BITS, 5>(t, part, o, ldo); break;
      case 6: tile_rows<BITS, 6>(t, part, o, ldo); break;
      case 7: tile_rows<BITS, 7>(t, part, o, ldo); break;
      default: tile_rows<BITS, 8>(t, part, o, ldo); break;
    }
  }
}

}  // namespace

Rows Quantized::of(const float* x, int64_t rows, int64_t k) {
  const int64_t groups = k / GROUP;
  q.resize(rows * k);
  d.resize(rows * groups);
  sum.resize(rows * groups);
  quantize_rows(x, rows, k, q.data(), d.data(), sum.data());
  return {q.data(), d.data(), sum.data(), k, groups};
}

void tiles(const Matrix& m, const Rows& x, int64_t rows, int64_t tile0, int64_t tile1, float* out, int64_t ldo) {
  const int64_t groups = m.k / GROUP, tile_bytes = groups * m.bits * GROUP * TILE / 8, tile_scales = groups * TILE;
  for (int64_t i = tile0; i < tile1; ++i) {
    const Tile t{m.w + i * tile_bytes, m.scales + i * tile_scales, m.bits == 4 ? m.mins + i * tile_scales : nullptr};
    float* o = out + (i - tile0) * TILE;
    if (m.bits == 8)
      tile<8>(t, x, rows, o, ldo);
    else
      tile<4>(t, x, rows, o, ldo);
  }
}

}  // namespace kvrag_quant

// out [R, N] = x [R, K] @ W^T for W [N, K] packed as above (bits 8 or 4; mins: int4's, else null), in float32.
// N % 16 == 0, K % 32 == 0. The tiles split over up to n_threads OpenMP threads; each output's sums run in one
// order whatever the split.
extern "C" int kvrag_quant_matmul(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int bits,
                                  int64_t n, int64_t k, const float* x, int64_t rows, float* out, int n_threads) {
  using namespace kvrag_quant;
  if (n % TILE || k % GROUP || k <= 0 || rows <= 0 || (bits != 8 && bits != 4) || (bits == 4 && !mins)) return 1;
  thread_local Quantized q;
  const Rows xr = q.of(x, rows, k);
  const Matrix m{w, scales, mins, bits, k};
  const int64_t tiles_n = n / TILE;
  // a thread for at least 16 tiles' worth of rows (256 outputs of one row): less is not worth waking one
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, tiles_n * rows / 16)));
#pragma omp parallel num_threads(t)
  {
    const int me = omp_get_thread_num(), all = omp_get_num_threads();
    tiles(m, xr, rows, tiles_n * me / all, tiles_n * (me + 1) / all, out + tiles_n * me / all * TILE, n);
  }
  return 0;
}

// W^T [K, N] in bf16 (rounded to nearest even) from W [N, K] packed as above: what a dense matmul of many rows
// reads (a prefill on a CPU whose bf16 matmul is faster than these products). Each 64-byte vector holds the 16
// rows' values of 4 inputs, so an input's 16 values come out side by side; the tiles are walked input by input,
// so that each row of W^T is written in order (writes 16 rows apart were 5-10x slower).
extern "C" int kvrag_quant_dequantize_t(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int bits,
                                        int64_t n, int64_t k, uint16_t* out, int n_threads) {
  using namespace kvrag_quant;
  if (n % TILE || k % GROUP || k <= 0 || (bits != 8 && bits != 4) || (bits == 4 && !mins)) return 1;
  const int64_t groups = k / GROUP, tiles_n = n / TILE, tile_bytes = groups * bits * GROUP * TILE / 8;
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, groups)));
  const __m512i mask = _mm512_set1_epi32(bits == 8 ? 0xFF : 0x0F);
#pragma omp parallel for num_threads(t) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    for (int quad = 0; quad < 8; ++quad) {  // 4 inputs: 16 rows x 4 bytes, or the nibbles of a shared vector
      const int64_t vector = bits == 8 ? g * 8 + quad : g * 4 + quad / 2;
      for (int b = 0; b < 4; ++b) {
        uint16_t* row = out + (g * GROUP + 4 * quad + b) * n;  // input g * 32 + 4 quad + b
        for (int64_t i = 0; i < tiles_n; ++i) {
          const int64_t at = (i * groups + g) * TILE;
          const __m512i v = _mm512_srli_epi32(_mm512_loadu_si512(w + i * tile_bytes + vector * 64),
                                              bits == 8 ? 8 * b : 4 * (quad % 2) + 8 * b);
          __m512i q = _mm512_and_si512(v, mask);
          if (bits == 8) q = _mm512_sub_epi32(q, _mm512_set1_epi32(128));
          __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(q), load_half(scales + at));
          if (bits == 4) value = _mm512_add_ps(value, load_half(mins + at));
          // round to nearest even into bf16 (finite values): the top half of value + 0x7FFF + its lowest kept bit
          const __m512i raw = _mm512_castps_si512(value);
          const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(raw, 16), _mm512_set1_epi32(1));
          const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(raw, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + i * TILE), _mm512_cvtepi32_epi16(rounded));
        }
      }
    }
  }
  return 0;
}
