// Causal attention of query rows at any sorted absolute positions, for x86-64 CPUs with AVX-512 or AVX2 (float32;
// simd.h's W-lane vectors).
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
// Keys are laid out per block of 64 so that W keys (16 on AVX-512, 8 on AVX2) load as one vector, values as
// float32 rows:
//   kt   [Hkv, S_pad / 64, D, 64]  float32 keys transposed per block, or for bfloat16 queries [Hkv, S_pad / 64,
//                                   D / 2, 64] 32-bit pairs of bf16 keys (the AVX-512 build alone: AVX512_BF16)
//   vt   [Hkv, S_pad, D]           float32 values per head
// in workspaces the caller allocates, which a first pass fills (in parallel, by key block) where many row blocks
// read each key block; or (pack 0: a few rows, as a prefix hit's tail or a repeat's last row) each key block is
// transposed into a thread's 16 KB panel as its rows reach it and the values are read where they lie, so nothing
// is written out. Both give the same numbers to the same products, so the same bits. S_pad rounds S up to a
// multiple of 64; padded keys and values are zero (a masked key's weight is 0, but 0 * NaN is not).
// D must be a multiple of 64. Each KV head's `group` query heads are stacked as rows (row r, head j of the
// group is virtual row r * group + j), so one pass over a key block serves every query head that reads it.

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

namespace simd = kvrag_simd;
using simd::vf;
using simd::W;

constexpr int kTileRows = 4;    // virtual rows per register tile
constexpr int kBlockRows = 32;  // virtual rows per work item: they share each key block while it is in cache
constexpr int kKeyVecs = 64 / W;  // vectors a key block (kKeyBlock, asserted below)
// Vectors of keys (score_tile) or of value columns (P @ V) one pass takes for the tile's 4 rows: 4 x 4 accumulators
// in AVX-512's 32 registers; in AVX2's 16, 4 x 2 (8 accumulators, 2 loaded vectors, a broadcast), so an AVX2 pass
// covers a quarter of a key block or 16 value columns and the next passes the rest
constexpr int kPassVecs = W == 16 ? 4 : 2;
static_assert(kKeyVecs * W == 64 && kKeyVecs % kPassVecs == 0 && 64 % (kPassVecs * W) == 0, "whole passes");
using kvrag_rows::kKeyBlock;
static_assert(kKeyBlock == 64, "kKeyVecs");
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
// float32 panels (every build). Bf16PairDot (the AVX-512 build, on CPUs with AVX512_BF16): queries and keys that are
// bfloat16 values go in pairs of dimensions, and vdpbf16ps multiplies both pairs and adds them in float32, twice the
// work per instruction. The products of bfloat16 values are exact in float32, so only the order of the float32 sums
// differs. AVX2 has no such instruction: the Python side never asks its builds for pairs, and the entry point refuses.
#if KVRAG_AVX512
#pragma GCC push_options
#pragma GCC target("avx512bf16")  // for Bf16PairDot's instruction alone: the rest runs on any AVX-512 CPU
#endif
struct Fp32Dot {
  using Elem = float;  // one dimension
  static constexpr int kDims = 1;
  static vf load(const float* p) { return simd::load(p); }
  static vf broadcast(const float* q) { return simd::set1(*q); }
  static vf madd(vf acc, vf q, vf k) { return simd::fmadd(q, k, acc); }
};
#if KVRAG_AVX512
struct Bf16PairDot {
  using Elem = uint32_t;  // two bfloat16 dimensions
  static constexpr int kDims = 2;
  static __m512i load(const uint32_t* p) { return _mm512_load_si512(p); }
  static __m512i broadcast(const uint32_t* q) { return _mm512_set1_epi32(static_cast<int32_t>(*q)); }
  static __m512 madd(__m512 acc, __m512i q, __m512i k) { return _mm512_dpbf16_ps(acc, (__m512bh)q, (__m512bh)k); }
};
#endif

// scores [4 rows][64 keys] of virtual rows vrow against one key block of one KV head, laid out in `keys` [steps, 64]:
// kKeyVecs / kPassVecs passes (one on AVX-512, four on AVX2), each over every step for kPassVecs vectors of keys.
// Each score is the same sum in the same order however the passes split the block. The accumulators are a small
// constant array, every loop over it fully unrolled, so GCC keeps them in registers (an array indexed in loops it
// did not unroll went to the stack on each step).
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
  const Elem *q0 = qrow[0], *q1 = qrow[1], *q2 = qrow[2], *q3 = qrow[3];
  for (int c0 = 0; c0 < kKeyVecs; c0 += kPassVecs) {
    const Elem* panel = static_cast<const Elem*>(keys) + c0 * W;  // [steps, 64]: this pass's keys
    vf a0[kPassVecs], a1[kPassVecs], a2[kPassVecs], a3[kPassVecs];
#pragma GCC unroll 8
    for (int c = 0; c < kPassVecs; ++c) a0[c] = a1[c] = a2[c] = a3[c] = simd::zero();
    for (int64_t e = 0; e < steps; ++e) {
      const Elem* kcol = panel + e * kKeyBlock;
      decltype(Dot::load(kcol)) kv[kPassVecs];
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) kv[c] = Dot::load(kcol + c * W);
      auto qv = Dot::broadcast(q0 + e);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) a0[c] = Dot::madd(a0[c], qv, kv[c]);
      qv = Dot::broadcast(q1 + e);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) a1[c] = Dot::madd(a1[c], qv, kv[c]);
      qv = Dot::broadcast(q2 + e);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) a2[c] = Dot::madd(a2[c], qv, kv[c]);
      qv = Dot::broadcast(q3 + e);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) a3[c] = Dot::madd(a3[c], qv, kv[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < kPassVecs; ++c) {
      const int key = (c0 + c) * W;
      simd::store(&scores[0][key], a0[c]);
      simd::store(&scores[1][key], a1[c]);
      simd::store(&scores[2][key], a2[c]);
      simd::store(&scores[3][key], a3[c]);
    }
  }
}
#if KVRAG_AVX512
#pragma GCC pop_options
#endif

inline vf load_values(const float* p) { return simd::loadu(p); }
inline vf load_values(const uint16_t* p) { return simd::load_bf16(p); }  // W bfloat16 values, exactly as float32

// One tile of 4 virtual rows against one key block (its keys laid out in `panel`, its 64 value rows at `values`):
// scores, online softmax, and P @ V into the row sums.
template <typename T>
inline void tile_step(const Problem& pb, int64_t kv_head, const int64_t* vrow, const int64_t* rpos, int64_t k0,
                      bool masked, const void* panel, const T* const* values, float* acc, float* row_max,
                      float* row_sum) {
  const int64_t d = pb.head_dim;
  alignas(64) float scores[kTileRows][kKeyBlock];
#if KVRAG_AVX512
  if (pb.bf16_pairs)
    score_tile<Bf16PairDot>(pb, kv_head, vrow, panel, scores);
  else
#endif
    score_tile<Fp32Dot>(pb, kv_head, vrow, panel, scores);
  alignas(64) float p[kTileRows][kKeyBlock];
  float alpha[kTileRows];
  const vf scale = simd::set1(pb.scale);
  const vf neg_inf = simd::set1(-std::numeric_limits<float>::infinity());
  for (int t = 0; t < kTileRows; ++t) {
    simd::vmask seen[kKeyVecs];
    for (int c = 0; c < kKeyVecs; ++c)  // key k0 + W c + lane is seen by a row at position >= it (< 2^31 here)
      seen[c] = masked ? simd::lanes_upto(W * c, static_cast<int32_t>(rpos[t] - k0)) : simd::lanes_below(W);
    vf sv[kKeyVecs];
    vf m = neg_inf;
    for (int c = 0; c < kKeyVecs; ++c) {
      sv[c] = simd::select(seen[c], simd::mul(simd::load(&scores[t][W * c]), scale), neg_inf);
      m = simd::max(m, sv[c]);
    }
    const float block_max = simd::reduce_max(m);
    const float new_max = std::max(row_max[t], block_max);
    if (new_max == -std::numeric_limits<float>::infinity()) {  // the row sees no key yet
      alpha[t] = 1.0f;
      for (int c = 0; c < kKeyVecs; ++c) simd::store(&p[t][W * c], simd::zero());
      continue;
    }
    alpha[t] = std::exp(row_max[t] - new_max);  // 0 on the row's first seen block
    row_max[t] = new_max;
    const vf mv = simd::set1(new_max);
    vf total = simd::zero();
    for (int c = 0; c < kKeyVecs; ++c) {
      const vf e = simd::keep(seen[c], simd::exp_ps(simd::sub(sv[c], mv)));
      total = simd::add(total, e);
      simd::store(&p[t][W * c], e);
    }
    row_sum[t] = row_sum[t] * alpha[t] + simd::reduce_add(total);
  }
  // acc[t] = acc[t] * alpha[t] + p[t] @ V[k0 : k0 + 64], in passes of kPassVecs * W columns (64 on AVX-512, 16 on
  // AVX2), the accumulators in registers as in score_tile; each column's sum runs over the keys in order either way
  constexpr int kCols = kPassVecs * W;
  const vf w0 = simd::set1(alpha[0]), w1 = simd::set1(alpha[1]), w2 = simd::set1(alpha[2]), w3 = simd::set1(alpha[3]);
  for (int64_t c0 = 0; c0 < d; c0 += kCols) {
    float* r0 = acc + c0;
    float* r1 = acc + d + c0;
    float* r2 = acc + 2 * d + c0;
    float* r3 = acc + 3 * d + c0;
    vf o0[kPassVecs], o1[kPassVecs], o2[kPassVecs], o3[kPassVecs];
#pragma GCC unroll 8
    for (int c = 0; c < kPassVecs; ++c) {
      o0[c] = simd::mul(w0, simd::loadu(r0 + c * W));
      o1[c] = simd::mul(w1, simd::loadu(r1 + c * W));
      o2[c] = simd::mul(w2, simd::loadu(r2 + c * W));
      o3[c] = simd::mul(w3, simd::loadu(r3 + c * W));
    }
    for (int k = 0; k < kKeyBlock; ++k) {
      const T* vrow_k = values[k] + c0;
      vf vv[kPassVecs];
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) vv[c] = load_values(vrow_k + c * W);
      vf pv = simd::set1(p[0][k]);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) o0[c] = simd::fmadd(pv, vv[c], o0[c]);
      pv = simd::set1(p[1][k]);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) o1[c] = simd::fmadd(pv, vv[c], o1[c]);
      pv = simd::set1(p[2][k]);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) o2[c] = simd::fmadd(pv, vv[c], o2[c]);
      pv = simd::set1(p[3][k]);
#pragma GCC unroll 8
      for (int c = 0; c < kPassVecs; ++c) o3[c] = simd::fmadd(pv, vv[c], o3[c]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < kPassVecs; ++c) {
      simd::storeu(r0 + c * W, o0[c]);
      simd::storeu(r1 + c * W, o1[c]);
      simd::storeu(r2 + c * W, o2[c]);
      simd::storeu(r3 + c * W, o3[c]);
    }
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

// qk_bf16: q holds bfloat16 values (as k does) and the CPU has AVX512_BF16, so kt is the pair layout (see score_tile);
// the AVX-512 build alone (4 from the AVX2 builds).
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
  if (qk_bf16 && !KVRAG_AVX512) return 4;  // no bfloat16 pair products in AVX2
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
