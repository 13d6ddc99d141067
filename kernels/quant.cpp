// Weight-only quantized matrix x rows: int8 or int4 weights in groups of 32 inputs, each group with a float16 scale
// (and, for int4, a float16 minimum), times activations quantized to int8 per group of 32 on the fly (as llama.cpp
// multiplies Q8_0 activations by Q8_0 or Q4_1 weights). A decode step reads every weight once: int8 reads about a
// quarter of float32's bytes, int4 a sixth. One source for every build (kernels/simd.h); the integer product per
// ISA:
// - AVX-512 (with AVX512-VNNI, checked by quant.py): VPDPBUSD on 64-byte vectors, a tile's 16 outputs at once.
// - AVX2 + AVX-VNNI: VPDPBUSD's 256-bit VEX form on the same unsigned weights, the tile in two halves of 8 outputs.
// - AVX2: VPMADDUBSW then VPMADDWD (llama.cpp's AVX2 path), in halves of 8 outputs. VPMADDUBSW saturates its int16
//   pair sums, so int8 weights go back to signed q (q + 128 xor 0x80) and take llama.cpp's sign trick, |q| times
//   sign(x, q) (|q|, |x| <= 127: a pair is at most 32258, exact), with no offset to take off; int4's q in [0, 15] times int8
//   activations cannot saturate (a pair 3810, a group's eight pairs 30480 < 2^15: they add in int16 before one
//   VPMADDWD).
//
// Layout (kernels/quant.py packs it): output rows in tiles of 16. For each 4 inputs of a tile, the 16 rows' 4
// bytes lie side by side in one 64-byte vector, so that VPDPBUSD's 16 lanes are the tile's 16 outputs and one
// broadcast of 4 activation bytes serves them all (on AVX2, each 32-byte half serves 8). int8 (w = d q, q in
// [-127, 127]) stores q + 128, VPDPBUSD's unsigned side; int4 (w = d q + m, q in [0, 15]) packs two such vectors
// into one, the even 4 inputs in the low nibbles, the odd in the high. Scales and minimums: [tiles][groups][16].
//
// Numerics: a group's integer dot is exact on every ISA (int8's offset comes off in integers); its sum times
// (weight scale x activation scale), plus int4's minimum x (activation scale x the activations' integer sum), is
// added in float32, group after group, without fused multiply-adds, which the torch twin (kernels/quant.py `twin`)
// repeats bit for bit.

#include "quant.h"

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

#if KVRAG_AVX512
#define KVRAG_QUANT_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#else
#define KVRAG_QUANT_TARGET
#endif

namespace kvrag_quant {
namespace {

using namespace kvrag_simd;

// The integer product's form: VPDPBUSD (AVX-512, AVX-VNNI) or VPMADDUBSW + VPMADDWD (plain AVX2)
#if KVRAG_AVX512 || defined(__AVXVNNI__)
constexpr bool DPBUSD = true;
#else
constexpr bool DPBUSD = false;
#endif
constexpr int HALVES = TILE / W;  // a 64-byte weight vector's parts of W outputs (1 on AVX-512, 2 on AVX2)
constexpr int HALF_BYTES = 4 * W;  // weight bytes of a part
// Rows a pass over a tile's weights: AVX-512's 32 registers hold 8 accumulators and 8 weight vectors. AVX2's 16 hold
// a part's 8 weight vectors (plain AVX2 also |q|'s 8, from L1 when spilled) and a few accumulators: of 2 to 8 rows,
// 4 (AVX-VNNI) and 6 (AVX2) were the fastest at 64 rows on this project's 2-core test machine, within ~5 % of the others.
constexpr int BLOCK = KVRAG_AVX512 ? 8 : DPBUSD ? 4 : 6;
// Weight bytes fetched into L2 ahead of the products: a tile's stream outruns the hardware prefetcher, most of all
// int4's (docs/quantized.md, "Speed against the memory floor")
constexpr int64_t AHEAD = 4096;
// Parts x rows at most for which a tile's parts take each group in turn (tile_rows): ~20 % faster for 1-2 rows
// (each weight line read once), slower past these (measured as BLOCK was)
constexpr int PARTS_TOGETHER = KVRAG_AVX512 ? 8 : DPBUSD ? 6 : 4;

// Each row's activations quantized per group: q = round(x / d) with d = max |x| / 127, and the sum of q.
void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, int32_t* sums) {
  constexpr int PARTS = GROUP / W;
  const int64_t groups = k / GROUP;
  for (int64_t i = 0; i < rows * groups; ++i) {
    const float* p = x + i * GROUP;
    vf v[PARTS], top = zero();
    for (int c = 0; c < PARTS; ++c) {
      v[c] = loadu(p + c * W);
      top = max(top, abs(v[c]));
    }
    const float amax = reduce_max(top);
    const float dg = amax / 127.0f;
    const vf inv = set1(dg > 0.0f ? 1.0f / dg : 0.0f);
    vi total = izero();
    for (int c = 0; c < PARTS; ++c) {
      const vi qc = to_int(mul(v[c], inv));  // round to nearest even: torch.round's
      store_i8(q + i * GROUP + c * W, qc);
      total = iadd(total, qc);
    }
    d[i] = dg;
    sums[i] = ireduce_add(total);
  }
}

struct Tile {  // one tile's weights (its groups in order), float16 scales and minimums (int4) [G][16]
  const uint8_t* w;
  const uint16_t* scales;
  const uint16_t* mins;
};

// The group's 8 weight vectors of one part, as the dot below takes them: int8 unsigned (q + 128) where VPDPBUSD
// runs, else signed q at wv[0..8) and |q| at wv[8..16); int4's nibbles (q in [0, 15])
template <int BITS>
KVRAG_QUANT_TARGET inline void group_weights(const uint8_t* wg, vi* wv) {
  if (BITS == 8) {
    for (int j = 0; j < 8; ++j) {
      const vi v = iloadu(wg + j * 64);
      wv[j] = DPBUSD ? v : ixor(v, ibyte(static_cast<int8_t>(0x80)));
#if !KVRAG_AVX512 && !defined(__AVXVNNI__)
      wv[8 + j] = _mm256_abs_epi8(wv[j]);  // shared by the rows (sign(x, q) is each row's)
#endif
    }
  } else {
    const vi nibble = ibyte(0x0F);
    for (int j = 0; j < 4; ++j) {
      const vi v = iloadu(wg + j * 64);
      wv[2 * j] = iand(v, nibble);
      wv[2 * j + 1] = iand(srli16(v, 4), nibble);
    }
  }
}

// The exact integer dot of one group's 32 activations xg with the part's weights: W int32 lanes (int8 on a
// VPDPBUSD: with the 128 offset still in, taken off by the caller)
template <int BITS>
KVRAG_QUANT_TARGET inline vi group_dot(const vi* wv, const int8_t* xg) {
  vi dot = izero();
#if KVRAG_AVX512
  for (int j = 0; j < 8; ++j) {
    int32_t quad;
    std::memcpy(&quad, xg + 4 * j, 4);
    dot = _mm512_dpbusd_epi32(dot, wv[j], _mm512_set1_epi32(quad));
  }
#elif defined(__AVXVNNI__)
  for (int j = 0; j < 8; ++j) {
    int32_t quad;
    std::memcpy(&quad, xg + 4 * j, 4);
    dot = _mm256_dpbusd_avx_epi32(dot, wv[j], _mm256_set1_epi32(quad));
  }
#else
  const vi ones = _mm256_set1_epi16(1);
  if (BITS == 8) {
    for (int j = 0; j < 8; ++j) {
      int32_t quad;
      std::memcpy(&quad, xg + 4 * j, 4);
      const vi xb = _mm256_set1_epi32(quad);
      // |q| . sign(x, q) = q . x, each pair at most 2 x 127 x 127 in magnitude: no saturation
      const vi pairs = _mm256_maddubs_epi16(wv[8 + j], _mm256_sign_epi8(xb, wv[j]));
      dot = iadd(dot, _mm256_madd_epi16(pairs, ones));
    }
  } else {
    vi pairs = izero();  // int16 sums of 16 products each: at most 16 x 15 x 127 = 30480 in magnitude
    for (int j = 0; j < 8; ++j) {
      int32_t quad;
      std::memcpy(&quad, xg + 4 * j, 4);
      pairs = _mm256_add_epi16(pairs, _mm256_maddubs_epi16(wv[j], _mm256_set1_epi32(quad)));
    }
    dot = _mm256_madd_epi16(pairs, ones);
  }
#endif
  return dot;
}

// One group's products for part h of a tile (outputs h W .. h W + W - 1) added to acc[0..RB), the RB rows'.
template <int BITS, int RB>
KVRAG_QUANT_TARGET __attribute__((always_inline)) inline void group_part(Tile t, Rows x, int64_t g, int h, vf* acc) {
  constexpr int VECTORS = BITS == 8 ? 8 : 4;  // 64-byte weight vectors a group
  constexpr bool OFFSET = BITS == 8 && DPBUSD;  // the dot has int8's 128 x sum(xq) in it
  vi wv[16];
  group_weights<BITS>(t.w + g * VECTORS * 64 + h * HALF_BYTES, wv);
  const vf sw = load_fp16(t.scales + g * TILE + h * W);
  const vf mw = BITS == 4 ? load_fp16(t.mins + g * TILE + h * W) : zero();
  for (int r = 0; r < RB; ++r) {
    const int64_t i = r * x.groups + g;
    vi dot = group_dot<BITS>(wv, x.q + r * x.k + g * GROUP);
    if (OFFSET) dot = isub(dot, iset1(128 * x.sum[i]));  // (q + 128) . xq - 128 sum(xq)
    vf term = mul(to_float(dot), mul(sw, set1(x.d[i])));
    asm("" : "+v"(term));  // keeps each product apart from its sum (no fused multiply-add: the twin's bits)
    if (BITS == 4) {
      vf shift = mul(mw, set1(x.d[i] * static_cast<float>(x.sum[i])));
      asm("" : "+v"(shift));
      term = add(term, shift);
    }
    acc[r] = add(acc[r], term);
  }
}

// out[r][0..16) for RB rows of one tile. Each output's sum runs group after group whichever way the parts go:
// few rows take both parts of a group in turn (each weight line read once, all accumulators in registers), more
// rows one part over all groups, then the other (their accumulators and a part's weights fill AVX2's registers).
template <int BITS, int RB>
KVRAG_QUANT_TARGET void tile_rows(Tile t, Rows x, float* out, int64_t ldo) {
  constexpr int VECTORS = BITS == 8 ? 8 : 4;
  auto prefetch = [&](int64_t g) __attribute__((always_inline)) {
    const uint8_t* wg = t.w + g * VECTORS * 64;
    for (int j = 0; j < VECTORS; ++j) _mm_prefetch(reinterpret_cast<const char*>(wg + AHEAD + j * 64), _MM_HINT_T1);
    if (g % 2 == 0) _mm_prefetch(reinterpret_cast<const char*>(t.scales + g * TILE + AHEAD / 16), _MM_HINT_T1);
  };
  if constexpr (HALVES * RB <= PARTS_TOGETHER) {
    vf acc[HALVES * RB];
    for (int a = 0; a < HALVES * RB; ++a) acc[a] = zero();
    for (int64_t g = 0; g < x.groups; ++g) {
      prefetch(g);
      for (int h = 0; h < HALVES; ++h) group_part<BITS, RB>(t, x, g, h, acc + h * RB);
    }
    for (int h = 0; h < HALVES; ++h)
      for (int r = 0; r < RB; ++r) storeu(out + r * ldo + h * W, acc[h * RB + r]);
  } else {
    for (int h = 0; h < HALVES; ++h) {
      vf acc[RB];
      for (int r = 0; r < RB; ++r) acc[r] = zero();
      for (int64_t g = 0; g < x.groups; ++g) {
        if (h == 0) prefetch(g);  // a later part reads the lines the first brought in
        group_part<BITS, RB>(t, x, g, h, acc);
      }
      for (int r = 0; r < RB; ++r) storeu(out + r * ldo + h * W, acc[r]);
    }
  }
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
      case 4: tile_rows<BITS, (BLOCK >= 4 ? 4 : 1)>(t, part, o, ldo); break;
      case 5: tile_rows<BITS, (BLOCK >= 5 ? 5 : 1)>(t, part, o, ldo); break;
      case 6: tile_rows<BITS, (BLOCK >= 6 ? 6 : 1)>(t, part, o, ldo); break;
      case 7: tile_rows<BITS, (BLOCK >= 7 ? 7 : 1)>(t, part, o, ldo); break;
      default: tile_rows<BITS, BLOCK>(t, part, o, ldo); break;
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
// rows' values of 4 inputs, so an input's 16 values come out side by side (W at a time); the tiles are walked
// input by input, so that each row of W^T is written in order (writes 16 rows apart were 5-10x slower).
extern "C" int kvrag_quant_dequantize_t(const uint8_t* w, const uint16_t* scales, const uint16_t* mins, int bits,
                                        int64_t n, int64_t k, uint16_t* out, int n_threads) {
  using namespace kvrag_quant;
  using namespace kvrag_simd;
  if (n % TILE || k % GROUP || k <= 0 || (bits != 8 && bits != 4) || (bits == 4 && !mins)) return 1;
  const int64_t groups = k / GROUP, tiles_n = n / TILE, tile_bytes = groups * bits * GROUP * TILE / 8;
  const int t = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, groups)));
  const vi mask = iset1(bits == 8 ? 0xFF : 0x0F);
#pragma omp parallel for num_threads(t) schedule(static)
  for (int64_t g = 0; g < groups; ++g) {
    for (int quad = 0; quad < 8; ++quad) {  // 4 inputs: 16 rows x 4 bytes, or the nibbles of a shared vector
      const int64_t vector = bits == 8 ? g * 8 + quad : g * 4 + quad / 2;
      const int shift = bits == 8 ? 0 : 4 * (quad % 2);
      for (int b = 0; b < 4; ++b) {
        uint16_t* row = out + (g * GROUP + 4 * quad + b) * n;  // input g * 32 + 4 quad + b
        for (int64_t i = 0; i < tiles_n; ++i) {
          const int64_t at = (i * groups + g) * TILE;
          for (int h = 0; h < HALVES; ++h) {  // outputs h W .. h W + W - 1 of the tile
            vi q = iand(srli32(iloadu(w + i * tile_bytes + vector * 64 + h * HALF_BYTES), shift + 8 * b), mask);
            if (bits == 8) q = isub(q, iset1(128));
            vf value = mul(to_float(q), load_fp16(scales + at + h * W));
            asm("" : "+v"(value));  // the product rounded before the minimum joins it, as `dequantize` does
            if (bits == 4) value = add(value, load_fp16(mins + at + h * W));
            store_bf16(row + i * TILE + h * W, value);  // rounded to nearest even (finite values)
          }
        }
      }
    }
  }
  return 0;
}
