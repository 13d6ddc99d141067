// Causal attention of query rows at any sorted absolute positions, for x86-64 CPUs with AVX-512 (float32).
//
// A CacheBlend prompt recomputes a few hundred rows scattered over thousands of keys; each row at position p
// must see exactly the keys 0..p. SDPA's CPU flash kernel either reads every key up to a call's last row (a
// mask skips no work) or needs one call per key segment merged by log-sum-exp. This kernel walks each block
// of rows through the key blocks its last row sees, masking only the blocks that hold some row's position:
// no wasted keys beyond a 64-key block, one call a layer, no merging. With positions 0..R-1 it is plain causal
// attention.
//
// Layouts (contiguous):
//   q    [R, Hq, D]        queries, rotated, float32 or (with bfloat16 keys) bfloat16; Hq = Hkv * group, query
//                          head h reads KV head h / group
//   pos  [R]               int64 absolute positions, non-decreasing, each < the number of keys
//   k, v [S, Hkv, D]        rotated keys and values, float32 or bfloat16 (the decode cache's own tensors); or,
//                          where a cached prefix stays in the paged pool, its n_head keys there (hk, hv [slots,
//                          Hkv, D] through slots [n_head]) and the other S - n_head here: the first pass reads
//                          each key where it lies, so a prefix hit is never copied out of the pool
//   out  [R, Hq, D]        float32
// Keys are laid out per block of 64 so that 16 keys load as one vector, values as float32 rows:
//   kt   [Hkv, S_pad / 64, D, 64]  float32 keys transposed per block, or for bfloat16 queries [Hkv, S_pad / 64,
//                                   D / 2, 64] 32-bit pairs of bf16 keys
//   vt   [Hkv, S_pad, D]           float32 values per head
// in workspaces the caller allocates, which a first pass fills (in parallel, by key block) where many row blocks
// read each key block; or (pack 0: a few rows, as a prefix hit's tail or a repeat's last row) each key block is
// transposed into a thread's 16 KB panel as its rows reach it and the values are read where they lie, so nothing
// is written out. Both give the same numbers to the same products, so the same bits. S_pad rounds S up to a
// multiple of 64; padded keys and values are zero (a masked key's weight is 0, but 0 * NaN is not).
// D must be a multiple of 64. Each KV head's `group` query heads are stacked as rows (row r, head j of the
// group is virtual row r * group + j), so one pass over a key block serves every query head that reads it.

#include <immintrin.h>

#include "row_keys.h"
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <thread>
#include <vector>

namespace {

constexpr int kTileRows = 4;    // virtual rows per register tile (4 x 4 accumulators)
constexpr int kBlockRows = 32;  // virtual rows per work item: they share each key block while it is in cache

using kvrag_simd::exp_ps;
using kvrag_rows::kKeyBlock;
using kvrag_rows::KeyRows;
using kvrag_rows::to_float;

struct Problem {
  const void* q;  // float32 [R, Hq, D], or bfloat16 pairs [R, Hq, D / 2] with bf16_pairs
  const int64_t* pos;
  const void* kt;  // float32 [Hkv, S_pad / 64, D, 64], or bfloat16 pairs [Hkv, S_pad / 64, D / 2, 64]; null: none
  const float* vt;  // [Hkv, S_pad, D], with kt
  float* out;
  int64_t n_rows, n_q_heads, n_kv_heads, head_dim, s_pad, n_keys;
  float scale;
  bool bf16_pairs;  // queries and keys are bfloat16 values, taken two dimensions at a time
  int64_t group() const { return n_q_heads / n_kv_heads; }
  int64_t virtual_rows() const { return n_rows * group(); }
};

// Softmax state and output sums of one work item's rows, in the running (flash) form.
struct RowBlockState {
  alignas(64) float acc[kBlockRows * 128];  // [rows, D] (D <= 128 here; larger D uses `wide`)
  std::vector<float> wide;
  float max[kBlockRows];
  float sum[kBlockRows];
  float* rows(int64_t d) {
    if (d <= 128) return acc;
    wide.resize(kBlockRows * d);
    return wide.data();
  }
};

// Dot products of 4 rows' queries with one key block's 64 keys, two ways. Fp32Dot: one dimension per FMA over
// float32 panels. Bf16PairDot (CPUs with AVX512_BF16): queries and keys that are bfloat16 values go in pairs of
// dimensions, and vdpbf16ps multiplies both pairs and adds them in float32, twice the work per instruction. The
// products of bfloat16 values are exact in float32, so only the order of the float32 sums differs.
#pragma GCC push_options
#pragma GCC target("avx512bf16")  // for Bf16PairDot's instruction alone: the rest runs on any AVX-512 CPU
struct Fp32Dot {
  using Elem = float;  // one dimension
  static constexpr int kDims = 1;
  static __m512 load(const float* p) { return _mm512_load_ps(p); }
  static __m512 broadcast(const float* q) { return _mm512_set1_ps(*q); }
  static __m512 madd(__m512 acc, __m512 q, __m512 k) { return _mm512_fmadd_ps(q, k, acc); }
};
struct Bf16PairDot {
  using Elem = uint32_t;  // two bfloat16 dimensions
  static constexpr int kDims = 2;
  static __m512i load(const uint32_t* p) { return _mm512_load_si512(p); }
  static __m512i broadcast(const uint32_t* q) { return _mm512_set1_epi32(static_cast<int32_t>(*q)); }
  static __m512 madd(__m512 acc, __m512i q, __m512i k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
};

// scores [4 rows][64 keys] of virtual rows vrow against one key block of one KV head, laid out in `keys` [steps, 64].
// 16 named accumulators: an array indexed later in loops made GCC store every accumulator to the stack on each step.
template <class Dot>
__attribute__((noinline)) void score_tile(const Problem& pb, int64_t kv_head, const int64_t* vrow, const void* keys,
                                          float (*scores)[kKeyBlock]) {
  using Elem = typename Dot::Elem;
  const int64_t steps = pb.head_dim / Dot::kDims, g = pb.group();
  const Elem* qrow[kTileRows];
  for (int t = 0; t < kTileRows; ++t) {
    const int64_t r = vrow[t] / g, j = vrow[t] % g;
    qrow[t] = static_cast<const Elem*>(pb.q) + (r * pb.n_q_heads + kv_head * g + j) * steps;
  }
  const Elem* panel = static_cast<const Elem*>(keys);  // [steps, 64]
  const Elem *q0 = qrow[0], *q1 = qrow[1], *q2 = qrow[2], *q3 = qrow[3];
  __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00, a10 = a00, a11 = a00, a12 = a00, a13 = a00;
  __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00, a30 = a00, a31 = a00, a32 = a00, a33 = a00;
  for (int64_t e = 0; e < steps; ++e) {
    const Elem* kcol = panel + e * kKeyBlock;
    const auto k0v = Dot::load(kcol), k1v = Dot::load(kcol + 16), k2v = Dot::load(kcol + 32);
    const auto k3v = Dot::load(kcol + 48);
    auto qv = Dot::broadcast(q0 + e);
    a00 = Dot::madd(a00, qv, k0v); a01 = Dot::madd(a01, qv, k1v); a02 = Dot::madd(a02, qv, k2v); a03 = Dot::madd(a03, qv, k3v);
    qv = Dot::broadcast(q1 + e);
    a10 = Dot::madd(a10, qv, k0v); a11 = Dot::madd(a11, qv, k1v); a12 = Dot::madd(a12, qv, k2v); a13 = Dot::madd(a13, qv, k3v);
    qv = Dot::broadcast(q2 + e);
    a20 = Dot::madd(a20, qv, k0v); a21 = Dot::madd(a21, qv, k1v); a22 = Dot::madd(a22, qv, k2v); a23 = Dot::madd(a23, qv, k3v);
    qv = Dot::broadcast(q3 + e);
    a30 = Dot::madd(a30, qv, k0v); a31 = Dot::madd(a31, qv, k1v); a32 = Dot::madd(a32, qv, k2v); a33 = Dot::madd(a33, qv, k3v);
  }
  _mm512_store_ps(&scores[0][0], a00); _mm512_store_ps(&scores[0][16], a01);
  _mm512_store_ps(&scores[0][32], a02); _mm512_store_ps(&scores[0][48], a03);
  _mm512_store_ps(&scores[1][0], a10); _mm512_store_ps(&scores[1][16], a11);
  _mm512_store_ps(&scores[1][32], a12); _mm512_store_ps(&scores[1][48], a13);
  _mm512_store_ps(&scores[2][0], a20); _mm512_store_ps(&scores[2][16], a21);
  _mm512_store_ps(&scores[2][32], a22); _mm512_store_ps(&scores[2][48], a23);
  _mm512_store_ps(&scores[3][0], a30); _mm512_store_ps(&scores[3][16], a31);
  _mm512_store_ps(&scores[3][32], a32); _mm512_store_ps(&scores[3][48], a33);
}
#pragma GCC pop_options

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 values widened (exactly) to float32
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// One tile of 4 virtual rows against one key block (its keys laid out in `panel`, its 64 value rows at `values`):
// scores, online softmax, and P @ V into the row sums.
template <typename T>
inline void tile_step(const Problem& pb, int64_t kv_head, const int64_t* vrow, const int64_t* rpos, int64_t k0,
                      bool masked, const void* panel, const T* const* values, float* acc, float* row_max,
                      float* row_sum) {
  const int64_t d = pb.head_dim;
  alignas(64) float scores[kTileRows][kKeyBlock];
  if (pb.bf16_pairs)
    score_tile<Bf16PairDot>(pb, kv_head, vrow, panel, scores);
  else
    score_tile<Fp32Dot>(pb, kv_head, vrow, panel, scores);
  alignas(64) float p[kTileRows][kKeyBlock];
  float alpha[kTileRows];
  const __m512 scale = _mm512_set1_ps(pb.scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int t = 0; t < kTileRows; ++t) {
    __mmask16 seen[4] = {0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF};
    if (masked) {  // key k0 + 16c + lane is seen by a row at position >= it (positions < 2^31 here)
      const __m512i last = _mm512_set1_epi32(static_cast<int32_t>(rpos[t] - k0));
      for (int c = 0; c < 4; ++c)
        seen[c] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * c)), last);
    }
    __m512 sv[4];
    __m512 m = neg_inf;
    for (int c = 0; c < 4; ++c) {
      sv[c] = _mm512_mask_mov_ps(neg_inf, seen[c], _mm512_mul_ps(_mm512_load_ps(&scores[t][16 * c]), scale));
      m = _mm512_max_ps(m, sv[c]);
    }
    const float block_max = _mm512_reduce_max_ps(m);
    const float new_max = std::max(row_max[t], block_max);
    if (new_max == -std::numeric_limits<float>::infinity()) {  // the row sees no key yet
      alpha[t] = 1.0f;
      for (int c = 0; c < 4; ++c) _mm512_store_ps(&p[t][16 * c], _mm512_setzero_ps());
      continue;
    }
    alpha[t] = std::exp(row_max[t] - new_max);  // 0 on the row's first seen block
    row_max[t] = new_max;
    const __m512 mv = _mm512_set1_ps(new_max);
    __m512 total = _mm512_setzero_ps();
    for (int c = 0; c < 4; ++c) {
      const __m512 e = _mm512_maskz_mov_ps(seen[c], exp_ps(_mm512_sub_ps(sv[c], mv)));
      total = _mm512_add_ps(total, e);
      _mm512_store_ps(&p[t][16 * c], e);
    }
    row_sum[t] = row_sum[t] * alpha[t] + _mm512_reduce_add_ps(total);
  }
  // acc[t] = acc[t] * alpha[t] + p[t] @ V[k0 : k0 + 64], in column chunks of 64 (named accumulators, as above)
  for (int64_t c0 = 0; c0 < d; c0 += 64) {
    float* r0 = acc + c0;
    float* r1 = acc + d + c0;
    float* r2 = acc + 2 * d + c0;
    float* r3 = acc + 3 * d + c0;
    __m512 w = _mm512_set1_ps(alpha[0]);
    __m512 o00 = _mm512_mul_ps(w, _mm512_loadu_ps(r0)), o01 = _mm512_mul_ps(w, _mm512_loadu_ps(r0 + 16));
    __m512 o02 = _mm512_mul_ps(w, _mm512_loadu_ps(r0 + 32)), o03 = _mm512_mul_ps(w, _mm512_loadu_ps(r0 + 48));
    w = _mm512_set1_ps(alpha[1]);
    __m512 o10 = _mm512_mul_ps(w, _mm512_loadu_ps(r1)), o11 = _mm512_mul_ps(w, _mm512_loadu_ps(r1 + 16));
    __m512 o12 = _mm512_mul_ps(w, _mm512_loadu_ps(r1 + 32)), o13 = _mm512_mul_ps(w, _mm512_loadu_ps(r1 + 48));
    w = _mm512_set1_ps(alpha[2]);
    __m512 o20 = _mm512_mul_ps(w, _mm512_loadu_ps(r2)), o21 = _mm512_mul_ps(w, _mm512_loadu_ps(r2 + 16));
    __m512 o22 = _mm512_mul_ps(w, _mm512_loadu_ps(r2 + 32)), o23 = _mm512_mul_ps(w, _mm512_loadu_ps(r2 + 48));
    w = _mm512_set1_ps(alpha[3]);
    __m512 o30 = _mm512_mul_ps(w, _mm512_loadu_ps(r3)), o31 = _mm512_mul_ps(w, _mm512_loadu_ps(r3 + 16));
    __m512 o32 = _mm512_mul_ps(w, _mm512_loadu_ps(r3 + 32)), o33 = _mm512_mul_ps(w, _mm512_loadu_ps(r3 + 48));
    for (int k = 0; k < kKeyBlock; ++k) {
      const T* vrow_k = values[k] + c0;
      const __m512 v0 = load16(vrow_k), v1 = load16(vrow_k + 16), v2 = load16(vrow_k + 32), v3 = load16(vrow_k + 48);
      __m512 pv = _mm512_set1_ps(p[0][k]);
      o00 = _mm512_fmadd_ps(pv, v0, o00); o01 = _mm512_fmadd_ps(pv, v1, o01);
      o02 = _mm512_fmadd_ps(pv, v2, o02); o03 = _mm512_fmadd_ps(pv, v3, o03);
      pv = _mm512_set1_ps(p[1][k]);
      o10 = _mm512_fmadd_ps(pv, v0, o10); o11 = _mm512_fmadd_ps(pv, v1, o11);
      o12 = _mm512_fmadd_ps(pv, v2, o12); o13 = _mm512_fmadd_ps(pv, v3, o13);
      pv = _mm512_set1_ps(p[2][k]);
      o20 = _mm512_fmadd_ps(pv, v0, o20); o21 = _mm512_fmadd_ps(pv, v1, o21);
      o22 = _mm512_fmadd_ps(pv, v2, o22); o23 = _mm512_fmadd_ps(pv, v3, o23);
      pv = _mm512_set1_ps(p[3][k]);
      o30 = _mm512_fmadd_ps(pv, v0, o30); o31 = _mm512_fmadd_ps(pv, v1, o31);
      o32 = _mm512_fmadd_ps(pv, v2, o32); o33 = _mm512_fmadd_ps(pv, v3, o33);
    }
    _mm512_storeu_ps(r0, o00); _mm512_storeu_ps(r0 + 16, o01); _mm512_storeu_ps(r0 + 32, o02); _mm512_storeu_ps(r0 + 48, o03);
    _mm512_storeu_ps(r1, o10); _mm512_storeu_ps(r1 + 16, o11); _mm512_storeu_ps(r1 + 32, o12); _mm512_storeu_ps(r1 + 48, o13);
    _mm512_storeu_ps(r2, o20); _mm512_storeu_ps(r2 + 16, o21); _mm512_storeu_ps(r2 + 32, o22); _mm512_storeu_ps(r2 + 48, o23);
    _mm512_storeu_ps(r3, o30); _mm512_storeu_ps(r3 + 16, o31); _mm512_storeu_ps(r3 + 32, o32); _mm512_storeu_ps(r3 + 48, o33);
  }
}

// Virtual rows v0 .. v1-1 of one KV head, through every key block their last row sees: each block's keys and values
// from the workspaces, or its keys packed into `panel` as the rows reach it and its values read where they lie
// (`zero`: D zeros for the padded keys).
template <typename T>
void row_block(const Problem& pb, const KeyRows<T>& keys, const T* zero, int64_t kv_head, int64_t v0, int64_t v1,
               RowBlockState& st, std::vector<uint32_t>& panel) {
  const int64_t d = pb.head_dim, g = pb.group();
  float* acc = st.rows(d);
  const int64_t n = v1 - v0;
  const int64_t tiles = (n + kTileRows - 1) / kTileRows;
  std::fill(acc, acc + tiles * kTileRows * d, 0.0f);
  std::fill(st.max, st.max + kBlockRows, -std::numeric_limits<float>::infinity());
  std::fill(st.sum, st.sum + kBlockRows, 0.0f);
  // a tile's missing rows repeat its last real row (computed, never written)
  int64_t vrow[kBlockRows], rpos[kBlockRows];
  for (int64_t i = 0; i < tiles * kTileRows; ++i) {
    vrow[i] = v0 + std::min(i, n - 1);
    rpos[i] = pb.pos[vrow[i] / g];
  }
  const int64_t keys_seen = rpos[n - 1] + 1;  // the block's last row sees keys 0 .. keys_seen-1
  const int64_t steps = pb.bf16_pairs ? d / 2 : d;  // a panel's 32-bit lanes a key
  const T* values[kKeyBlock];
  const float* packed[kKeyBlock];
  for (int64_t k0 = 0; k0 < keys_seen; k0 += kKeyBlock) {
    const void* block = static_cast<const uint32_t*>(pb.kt) + (kv_head * pb.s_pad + k0) * steps;
    if (pb.kt == nullptr) {  // score_tile's loads are aligned: the panel starts on a 64-byte line
      panel.resize(steps * kKeyBlock + 16);
      void* line = panel.data() + (16 - reinterpret_cast<uintptr_t>(panel.data()) / 4 % 16) % 16;
      pack_key_block(keys, pb.n_keys, kv_head, k0 / kKeyBlock, pb.bf16_pairs, line);
      block = line;
    }
    for (int64_t j = 0; j < kKeyBlock; ++j) {
      const int64_t key = k0 + j;
      if (pb.kt)
        packed[j] = pb.vt + (kv_head * pb.s_pad + key) * d;
      else
        values[j] = key < pb.n_keys ? keys.value_row(key, kv_head) : zero;
    }
    auto tiles_through = [&](const auto* rows) {  // the block's value rows: float32 from vt, or the pool's own
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t* tp = rpos + t * kTileRows;
        if (tp[kTileRows - 1] < k0) continue;  // every row of the tile lies before this key block
        const bool masked = tp[0] < k0 + kKeyBlock - 1;
        tile_step(pb, kv_head, vrow + t * kTileRows, tp, k0, masked, block, rows, acc + t * kTileRows * d,
                  st.max + t * kTileRows, st.sum + t * kTileRows);
      }
    };
    if (pb.kt)
      tiles_through(packed);
    else
      tiles_through(values);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = vrow[i] / g, j = vrow[i] % g;
    float* dst = pb.out + (r * pb.n_q_heads + kv_head * g + j) * d;
    const float inv = 1.0f / st.sum[i];
    for (int64_t e = 0; e < d; ++e) dst[e] = acc[i * d + e] * inv;
  }
}

// Runs fn(i) for i in 0 .. n-1 on n_threads threads (the caller's included), taking items in order.
template <typename Fn>
void parallel_items(int64_t n, int n_threads, Fn fn) {
  std::atomic<int64_t> next{0};
  auto worker = [&]() {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  const int t = std::max(1, static_cast<int>(std::min<int64_t>(n_threads, n)));
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
}

// Both passes for keys and values of type T (float32 or bf16): the workspaces filled first where `pack`, then every
// (row block, KV head) item.
template <typename T>
void attend_rows(const Problem& pb, const KeyRows<T>& keys, bool pack, int n_threads) {
  const int64_t key_blocks = pb.s_pad / kKeyBlock, steps = pb.bf16_pairs ? pb.head_dim / 2 : pb.head_dim;
  if (pack) {
    const int64_t per_item = 8;  // key blocks packed per work item
    parallel_items((key_blocks + per_item - 1) / per_item, n_threads, [&](int64_t i) {
      for (int64_t b = i * per_item; b < std::min((i + 1) * per_item, key_blocks); ++b) {
        for (int64_t h = 0; h < pb.n_kv_heads; ++h) {
          pack_key_block(keys, pb.n_keys, h, b, pb.bf16_pairs,
                         static_cast<uint32_t*>(const_cast<void*>(pb.kt)) + (h * pb.s_pad + b * kKeyBlock) * steps);
          pack_value_block(keys, pb.n_keys, pb.s_pad, h, b, const_cast<float*>(pb.vt));
        }
      }
    });
  }
  Problem run = pb;
  if (!pack) run.kt = nullptr, run.vt = nullptr;
  const std::vector<T> zero(pb.head_dim, T{});
  const int64_t blocks = (pb.virtual_rows() + kBlockRows - 1) / kBlockRows;
  parallel_items(blocks * pb.n_kv_heads, n_threads, [&](int64_t i) {
    thread_local RowBlockState st;
    thread_local std::vector<uint32_t> panel;
    // latest rows first: they see the most keys, so the threads end together
    const int64_t b = blocks - 1 - i / pb.n_kv_heads, h = i % pb.n_kv_heads;
    row_block(run, keys, zero.data(), h, b * kBlockRows, std::min((b + 1) * kBlockRows, pb.virtual_rows()), st,
              panel);
  });
}

}  // namespace

// qk_bf16: q holds bfloat16 values (as k does) and the CPU has AVX512_BF16, so kt is the pair layout (see score_tile).
// The first n_head keys (0: none) are read from a paged pool at hk, hv through slots (see KeyRows); n_keys counts them.
// pack: lay every key block out in kt and vt first (many rows), else each as its rows reach it (kt, vt unused).
extern "C" int kvrag_row_attention(const void* q, int qk_bf16, const int64_t* pos, const void* k, const void* v,
                                   const void* hk, const void* hv, const int64_t* slots, int64_t n_head,
                                   int k_is_bf16, int64_t n_keys, void* kt, float* vt, int pack, float* out,
                                   int64_t n_rows, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                                   float scale, int n_threads) {
  if (head_dim % 64 || n_kv_heads <= 0 || n_q_heads % n_kv_heads) return 1;
  if (n_head < 0 || n_head > n_keys || (n_head > 0 && !slots)) return 3;
  if (qk_bf16 && !k_is_bf16) return 2;
  if (n_rows == 0) return 0;
  const int64_t s_pad = (n_keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const Problem pb{q, pos, kt, vt, out, n_rows, n_q_heads, n_kv_heads, head_dim, s_pad, n_keys, scale, qk_bf16 != 0};
  auto run = [&](auto element) {  // keys and values of this type: bf16 (uint16_t) or float32
    using T = decltype(element);
    const KeyRows<T> keys{static_cast<const T*>(hk), static_cast<const T*>(hv), slots, n_head,
                          static_cast<const T*>(k), static_cast<const T*>(v), n_kv_heads, head_dim};
    attend_rows(pb, keys, pack != 0, n_threads);
  };
  if (k_is_bf16)
    run(uint16_t{});
  else
    run(0.0f);
  return 0;
}
