// A decode step's two memory-bound pieces for x86-64 CPUs: a bfloat16 matrix times a few vectors (every weight
// matrix of a layer, and the LM head, for each new row of a batch), and one query row's attention over bf16 keys
// and values read in place (a contiguous decode cache, or a paged pool through block tables). One source for every
// build (kernels/simd.h: W float lanes a vector, 16 on AVX-512, 8 on AVX2); the ISA sets the tiles' widths.
//
// A decode step reads every weight once (270 MB for a 135M model) and does two multiply-adds a weight and row,
// so with few rows its speed is the memory's. torch's bf16 matmul with one row reaches 5-25 GB/s here and pays
// a thread barrier per call; these stream each matrix row by row, split over the threads, and a batch's rows
// share each weight read; the attention reads bf16 keys and values as they are, without a float32 copy.
//
// Numerics: bf16 inputs widen exactly to float32, products and sums are float32 (as torch's kernels), outputs
// round to nearest even. Only the order of the sums differs from torch (and between ISAs: W lanes a sum).

#include <immintrin.h>

#include "quant.h"
#include "simd.h"

#include <linux/futex.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <thread>
#include <vector>

namespace {

using namespace kvrag_simd;

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

// A tile's NI x R sums (input j, row i at j * R + i) handed to store(input, row, sum): where they are W, in one
// transposed fold (on a copy: the caller's sums then stay in registers). transpose_sum and reduce_add fold in one
// tree, so a sum's bits are the same either way: a row's result does not depend on the tile it was in.
template <int R, int NI, class Store>
inline void store_tile(const vf* acc, int64_t r, int64_t b0, Store& store) {
  if constexpr (NI * R == W) {
    vf folded[W];
    for (int i = 0; i < W; ++i) folded[i] = acc[i];
    alignas(64) float sums[W];
    kvrag_simd::store(sums, transpose_sum(folded));
    for (int i = 0; i < W; ++i) store(b0 + i / R, r + i % R, sums[i]);
  } else {
    for (int i = 0; i < NI * R; ++i) store(b0 + i / R, r + i % R, reduce_add(acc[i]));
  }
}

// Rows r0..r1-1 of y_b = W x_b for n inputs: W [N, K] bf16 row-major, x [n, K] float32 (K a multiple of 16);
// store(b, r, sum) takes each float32 sum. Four rows at a time, so independent sums hide the multiply-add
// latency while the rows (contiguous) stream in order, and each 4-row block meets every input while it is in
// L1: a batch reads each weight from memory once. Row r's sum for input b runs over K in one order whatever n
// is, so a row's result does not depend on the batch it came in.
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4
#endif

// Inputs a tile at most: its R x NI sums and R weight vectors stay in registers (AVX-512's 32: 16 sums and 4
// weight vectors for R = 4; AVX2's 16: 8 sums and 4 weight vectors).
constexpr int TILE_INPUTS = KVRAG_AVX512 ? 4 : 2;

// R rows from r times NI inputs from b0: R * NI independent sums, each over K in order. `ahead` (or null):
// the rows PREFETCH_BLOCKS blocks on, a cache line of each fetched into L2 every 32 columns.
template <int R, int NI, class Store>
inline void dot_tile(const uint16_t* w, const float* x, int64_t k, int64_t r, int64_t b0, const uint16_t* ahead,
                     Store& store) {
  vf acc[NI * R];  // input j, row i at j * R + i
  for (int i = 0; i < NI * R; ++i) acc[i] = zero();
  for (int64_t e = 0; e < k; e += W) {
    if (ahead && e % 32 == 0) {
      for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * k + e), _MM_HINT_T1);
    }
    vf wv[R];  // widened once, used by every input of the tile
    for (int i = 0; i < R; ++i) wv[i] = load_bf16(w + (r + i) * k + e);
    for (int j = 0; j < NI; ++j) {
      const vf xv = loadu(x + (b0 + j) * k + e);
      for (int i = 0; i < R; ++i) acc[j * R + i] = fmadd(wv[i], xv, acc[j * R + i]);
    }
  }
  store_tile<R, NI>(acc, r, b0, store);
}

#if KVRAG_AVX512
// 32 bf16 values, those outside `live` zero. A masked load only where needed: GCC cannot see what the masked
// load's builtin reads, so a loop of them keeps its sums in memory (a store each) instead of registers.
inline __m512i load32(__mmask32 live, const uint16_t* p) {
  return live == 0xFFFFFFFFu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(live, p);
}

// The same tile with VDPBF16PS (CPUs with AVX512-BF16; the AVX-512 build only): x [n, K] bf16, and each
// instruction adds to lane i of a sum the products of columns 2i and 2i+1 of 32 (exact in float32), so the weights
// are read as they are and a row's sum takes half the instructions. A K that is an odd multiple of 16 ends on 16
// zero pairs (adding +0). Its sums run in another order than dot_tile's (so other bits), but again in one order
// whatever n is.
template <int R, int NI, class Store>
__attribute__((target("avx512bf16"))) void dot_tile_bf16(const uint16_t* w, const uint16_t* x, int64_t k, int64_t r,
                                                         int64_t b0, const uint16_t* ahead, Store& store) {
  __m512 acc[NI * R];  // input j, row i at j * R + i
  for (int i = 0; i < NI * R; ++i) acc[i] = _mm512_setzero_ps();
  // 32 columns from e (the last 16 alone where K is an odd multiple of 16: `live` masks the rest to zeros)
  auto columns = [&](int64_t e, __mmask32 live) __attribute__((always_inline, target("avx512bf16"))) {
    if (ahead) {
      for (int i = 0; i < R; ++i) _mm_prefetch(reinterpret_cast<const char*>(ahead + i * k + e), _MM_HINT_T1);
    }
    __m512bh wv[R];  // 32 weights of each row, read once for every input of the tile
    for (int i = 0; i < R; ++i) wv[i] = (__m512bh)load32(live, w + (r + i) * k + e);
    for (int j = 0; j < NI; ++j) {
      const __m512bh xv = (__m512bh)load32(live, x + (b0 + j) * k + e);
      for (int i = 0; i < R; ++i) acc[j * R + i] = _mm512_dpbf16_ps(acc[j * R + i], wv[i], xv);
    }
  };
  int64_t e = 0;
  for (; e + 32 <= k; e += 32) columns(e, 0xFFFFFFFFu);
  if (e < k) columns(e, 0xFFFFu);
  store_tile<R, NI>(acc, r, b0, store);
}
#endif

// Whether this build multiplies with VDPBF16PS where asked (the step refuses the request elsewhere).
constexpr bool BF16_DOT = KVRAG_AVX512;

// A product's n input rows of K values: as float32, and as bf16 where the step multiplies with VDPBF16PS (the
// same values: every input is bf16-rounded); bf16 null: the float32 path.
struct Inputs {
  const float* f32;
  const uint16_t* bf16;
};

template <int R, int NI, class Store>
inline void tile(const uint16_t* w, Inputs x, int64_t k, int64_t r, int64_t b0, const uint16_t* ahead,
                 Store& store) {
#if KVRAG_AVX512
  if (x.bf16) {
    dot_tile_bf16<R, NI>(w, x.bf16, k, r, b0, ahead, store);
    return;
  }
#endif
  dot_tile<R, NI>(w, x.f32, k, r, b0, ahead, store);
}

// Rows r..r+R-1 against all n inputs, TILE_INPUTS at a time, then the rest in one smaller tile.
template <int R, class Store>
inline void dot_rows(const uint16_t* w, Inputs x, int64_t n, int64_t k, int64_t r, const uint16_t* ahead,
                     Store& store) {
  int64_t b = 0;
  for (; b + TILE_INPUTS <= n; b += TILE_INPUTS, ahead = nullptr) {
    tile<R, TILE_INPUTS>(w, x, k, r, b, ahead, store);  // prefetch once
  }
  if constexpr (TILE_INPUTS > 3) {
    if (n - b == 3) tile<R, 3>(w, x, k, r, b, ahead, store);
  }
  if constexpr (TILE_INPUTS > 2) {
    if (n - b == 2) tile<R, 2>(w, x, k, r, b, ahead, store);
  }
  if (n - b == 1) tile<R, 1>(w, x, k, r, b, ahead, store);
}

template <class Store>
void gemv_rows(const uint16_t* w, Inputs x, int64_t n, int64_t k, int64_t r0, int64_t r1, Store store) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) {
    const bool far = r + 4 * (PREFETCH_BLOCKS + 1) <= r1;
    dot_rows<4>(w, x, n, k, r, far ? w + (r + 4 * PREFETCH_BLOCKS) * k : nullptr, store);
  }
  for (; r < r1; ++r) dot_rows<1>(w, x, n, k, r, nullptr, store);
}

// x [count] float32 holding bf16 values (count % 16 == 0) as bf16 in buf, exactly (their top halves): the
// products' inputs where the step uses VDPBF16PS; null (the float32 path) where it does not, or cannot (a build
// without it).
Inputs inputs(const float* x, int64_t count, bool bf16, std::vector<uint16_t>& buf) {
  if (!bf16 || !BF16_DOT) return {x, nullptr};
  buf.resize(count);
  for (int64_t e = 0; e < count; e += W) store_u16(buf.data() + e, srli32(as_int(loadu(x + e)), 16));
  return {x, buf.data()};
}

inline float round_bf16(float f) { return from_bf16(to_bf16(f)); }  // a float32 holding bf16's value

// Rows s..s1-1 (each d bf16 at base + at[s]) fetched into L2: the rows of one KV head are a strided
// (or, paged, scattered) walk that the hardware prefetcher does not run far enough ahead of: without these
// the attention waits on its loads about half of its time.
constexpr int64_t KEYS_AHEAD = 128;  // keys ahead of the first query's dot products (64 and 256: slower)

inline void fetch_rows(const uint16_t* base, const int64_t* at, int64_t s, int64_t s1, int64_t d) {
  for (; s < s1; ++s) {
    for (int64_t e = 0; e < d; e += 32) _mm_prefetch(reinterpret_cast<const char*>(base + at[s] + e), _MM_HINT_T1);
  }
}

constexpr int64_t MAX_HEAD_DIM = 256;

// One KV head's `group` query rows q [group, D] (float32) over keys s0..s1-1 of k, v (that head's columns; key
// s's row at k + at[s] and v + at[s], so a paged cache reads in place), unnormalised: per query j, m[j] the
// largest scaled score, l[j] the sum of p = exp(score - m[j]) and acc [group, D] the sum of p v. No keys:
// m = -inf, l = 0, acc = 0, a part that adds nothing to a merge. W keys a pass: their dot products, then one
// transposed sum.
void attend_part(const float* q, const uint16_t* k, const uint16_t* v, const int64_t* at, int64_t s0, int64_t s1,
                 int64_t group, int64_t d, float scale, std::vector<float>& scores, float* m, float* l, float* acc) {
  const int64_t n = std::max<int64_t>(s1 - s0, 0), s_pad = (n + W - 1) / W * W, nv = d / W;
  scores.resize(s_pad);
  fetch_rows(k, at, s0, std::min(s1, s0 + KEYS_AHEAD), d);
  for (int64_t j = 0; j < group; ++j) {
    vf qv[MAX_HEAD_DIM / W];
    for (int64_t c = 0; c < nv; ++c) qv[c] = loadu(q + j * d + W * c);
    vf best = set1(-INFINITY);
    for (int64_t b = 0; b < n; b += W) {  // W keys' dot products, then one transposed sum
      if (j == 0) {  // the first query's pass brings the keys ahead and these keys' values into L2
        fetch_rows(k, at, s0 + b + KEYS_AHEAD, std::min(s1, s0 + b + KEYS_AHEAD + W), d);
        fetch_rows(v, at, s0 + b, std::min(s1, s0 + b + W), d);
      }
      vf dots[W];
      for (int i = 0; i < W; ++i) {
        dots[i] = zero();
        if (b + i < n) {
          const uint16_t* kr = k + at[s0 + b + i];
          for (int64_t c = 0; c < nv; ++c) dots[i] = fmadd(qv[c], load_bf16(kr + W * c), dots[i]);
        }
      }
      const vf s = mul(transpose_sum(dots), set1(scale));
      storeu(scores.data() + b, s);
      best = select(lanes_below(n - b), max(best, s), best);
    }
    m[j] = reduce_max(best);
    vf total = zero();
    for (int64_t b = 0; b < n; b += W) {
      const vf p = keep(lanes_below(n - b), exp_ps(sub(loadu(scores.data() + b), set1(m[j]))));
      storeu(scores.data() + b, p);
      total = add(total, p);
    }
    l[j] = reduce_add(total);
    vf sum[MAX_HEAD_DIM / W];
    for (int64_t c = 0; c < nv; ++c) sum[c] = zero();
    for (int64_t s = 0; s < n; ++s) {  // the value rows are hot in cache after the group's first query
      const uint16_t* vr = v + at[s0 + s];
      const vf p = set1(scores[s]);
      for (int64_t c = 0; c < nv; ++c) sum[c] = fmadd(p, load_bf16(vr + W * c), sum[c]);
    }
    for (int64_t c = 0; c < nv; ++c) storeu(acc + j * d + W * c, sum[c]);
  }
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
  const bool wide = f32_out != 0;
  auto rows = [=, xs = xf.data()](int64_t r0, int64_t r1) {
    gemv_rows(w, Inputs{xs, nullptr}, 1, k, r0, r1, [&](int64_t, int64_t r, float s) {
      if (wide)
        static_cast<float*>(y)[r] = round_bf16(s);  // bf16's value, widened: what .float() gives
      else
        static_cast<uint16_t*>(y)[r] = to_bf16(s);
    });
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < t; ++i) pool.emplace_back(rows, n * i / t, n * (i + 1) / t);
  rows(0, n / t);
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
  const int64_t group = n_q_heads / n_kv_heads, row = n_kv_heads * head_dim;
  if (group > 8) return 2;
  std::vector<float> qf(n_q_heads * head_dim), acc(group * head_dim), scores;
  for (size_t e = 0; e < qf.size(); ++e) qf[e] = from_bf16(q[e]);
  std::vector<int64_t> at(n_keys);  // key s's row
  for (int64_t s = 0; s < n_keys; ++s) at[s] = s * row;
  float m[8], l[8];
  for (int64_t h = 0; h < n_kv_heads; ++h) {
    attend_part(qf.data() + h * group * head_dim, k + h * head_dim, v + h * head_dim, at.data(), 0, n_keys, group,
                head_dim, scale, scores, m, l, acc.data());
    for (int64_t e = 0; e < group * head_dim; ++e) out[h * group * head_dim + e] = to_bf16(acc[e] / l[e / head_dim]);
  }
  return 0;
}

// ---- the whole decode step: every layer of a batch of new rows in one call -------------------------------------
//
// Row b is one sequence's new token at its own slot (its row in the sequence's KV) and rotary position (the
// slot, or past it where a reduced KV dropped earlier rows); its keys and values are addressed through its block
// table, so a paged pool and a contiguous cache (one block) are both read in place. One OpenMP parallel region
// a step (OpenMP is torch's own thread pool here, so no thread is made a call): each matrix's rows split over
// the threads, every row block against all B inputs, a barrier after each product whose whole output the next
// step reads. Every rounding is the torch path's (RowStep): bf16 after each linear, norm, rotary op, residual
// add and the MLP's products; float32 sums, norms and softmax. Each row's numbers are those of the same row
// stepped alone, whatever B and the thread count: its sums run in one order and its keys split in fixed parts.

namespace {

// Mirrored field by field by kernels/decode_step.py's StepModel.
struct StepModel {
  int64_t n_layers, hidden, n_heads, n_kv_heads, head_dim, inter, vocab;
  // key (layer l, block b, slot s) at k_base + l * layer_stride + b * block_stride + s * Hkv * hd (v_base alike)
  int64_t n_blocks, block_size, layer_stride, block_stride;
  int64_t max_pos;   // rows of cos and sin: rotary positions 0..max_pos-1
  int64_t dot_bf16;  // non-zero: the products with VDPBF16PS (the AVX-512 build on a CPU with AVX512-BF16 only)
  float eps, scale;
  const uint64_t* layers;  // [L, 7] addresses: attn_norm, wqkv, bqkv (0: none), wo, mlp_norm, w_gate_up, w_down
  uint16_t* k_base;        // rotated keys
  uint16_t* v_base;
  const uint16_t* cos;  // [max_pos, hd] (the halves repeat)
  const uint16_t* sin;
  const uint16_t* final_norm;  // [D]
  const uint16_t* lm_head;     // [V, D] bf16, or packed as quant.cpp's matrices
  int64_t packed;              // 0: bf16 matrices; 1: every layer's matrices and the head packed (kernels/quant.py)
  const uint64_t* quant;       // packed: [4 L + 1, 3] each matrix's scales, minimums and bits (the head last)
};

// The threads of a step meet here after each product whose whole output the next stage reads. A waiter spins
// a short while (an even split of a product arrives within microseconds), then sleeps on a futex: on a busy
// CPU a descheduled partner then gets the core instead of a spinning waiter (OpenMP's own barrier spins for
// up to milliseconds, which made a step 20-40x slower than one thread when the 2 cores had a third job).
class Barrier {
 public:
  void size(int n) { n_ = n; }  // before any thread waits
  void wait() {
    const int gen = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {  // the last one opens the next round
      arrived_.store(0, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
      if (sleepers_.load(std::memory_order_acquire)) futex(FUTEX_WAKE_PRIVATE, INT_MAX);
      return;
    }
    for (const uint64_t start = __rdtsc(); __rdtsc() - start < SPIN_TICKS;) {
      if (generation_.load(std::memory_order_acquire) != gen) return;
      _mm_pause();
    }
    sleepers_.fetch_add(1, std::memory_order_acq_rel);
    while (generation_.load(std::memory_order_acquire) == gen) futex(FUTEX_WAIT_PRIVATE, gen);
    sleepers_.fetch_sub(1, std::memory_order_acq_rel);
  }

 private:
  static constexpr uint64_t SPIN_TICKS = 100000;  // 30-50 microseconds at a 2-3 GHz time-stamp counter
  void futex(int op, int value) {
    syscall(SYS_futex, reinterpret_cast<int*>(&generation_), op, value, nullptr, nullptr, 0);
  }
  int n_ = 1;
  std::atomic<int> arrived_{0}, generation_{0}, sleepers_{0};
};

struct Span {
  int64_t begin, end;
};

// Thread t's share of n items, in whole units of `align` (so that the 4-row blocks stay whole).
Span share(int64_t n, int t, int n_threads, int64_t align) {
  const int64_t units = (n + align - 1) / align;
  return {std::min(n, units * t / n_threads * align), std::min(n, units * (t + 1) / n_threads * align)};
}

// out [D] = bf16(w * bf16(x / rms(x))): torch's rms_norm(x.float()).to(bf16) times the weight.
void rms_norm(const float* x, const uint16_t* w, int64_t d, float eps, float* out) {
  vf sq = zero();
  for (int64_t e = 0; e < d; e += W) sq = fmadd(loadu(x + e), loadu(x + e), sq);
  const float r = 1.0f / std::sqrt(reduce_add(sq) / static_cast<float>(d) + eps);
  for (int64_t e = 0; e < d; ++e) out[e] = round_bf16(from_bf16(w[e]) * round_bf16(x[e] * r));
}

void rms_norm_rows(const float* x, const uint16_t* w, int64_t n, int64_t d, float eps, float* out) {
  for (int64_t b = 0; b < n; ++b) rms_norm(x + b * d, w, d, eps, out + b * d);
}

// The rotary op of rotary.rotate on one head x [hd] (bf16 values), each product and sum rounded as torch's.
void rotate(const float* x, const uint16_t* cos, const uint16_t* sin, int64_t hd, float* out) {
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < half; ++j) {
    const float c = from_bf16(cos[j]), s = from_bf16(sin[j]), x1 = x[j], x2 = x[j + half];
    out[j] = round_bf16(round_bf16(x1 * c) - round_bf16(x2 * s));
    out[j + half] = round_bf16(round_bf16(x2 * c) + round_bf16(x1 * s));
  }
}

// The keys 0..pos of each (row, KV head) are cut into KEY_PARTS fixed parts, whatever the batch and the number
// of threads, so that a row's numbers do not depend on them: the items are shared out, and merged in one order.
constexpr int KEY_PARTS = 2;

// The buffers every thread reads (the batch's plan, q, the attention parts, the MLP activation) and each
// thread's own. Rows are the batch's B new tokens.
struct Shared {
  int64_t rows;
  const int64_t* pos;                       // [B] each row's slot: its keys are 0..pos, its K/V go to pos
  const int64_t* rot;                       // [B] each row's rotary position (past pos where rows were dropped)
  std::vector<int64_t> key_at, key_first;   // row b's key s at key_at[key_first[b] + s] (elements into a layer)
  std::vector<int64_t> order;               // the rows, most keys first: the attention items' order
  std::vector<std::atomic<int64_t>> taken;  // [L] attention items taken so far, a counter per layer
  std::vector<float> h, q, part_m, part_l, part_acc, act;  // [B, D], [B, Hq hd]; [B, parts, Hq (, hd)]; [B, I]
};
struct Own {
  std::vector<float> x, head, rotated, attn, gate, up, scores;  // x [B, D], head [B, hd], attn [B, Hq hd]
  std::vector<uint16_t> x_bf16;  // the current product's inputs as bf16 (the VDPBF16PS path)
  kvrag_quant::Quantized quantized;  // the current product's inputs quantized (packed matrices)
  std::vector<float> sums;           // a packed product's outputs, before they are stored
};

// A product's inputs [B, K]: as the bf16 path reads them, and quantized where the matrices are packed (by each
// thread for itself: B x K values, cheaper than the barrier a shared copy would need).
struct Act {
  Inputs x;
  kvrag_quant::Rows q;
};

Act act(const StepModel& m, const float* x, int64_t n, int64_t k, Own& o) {
  if (m.packed) return {{x, nullptr}, o.quantized.of(x, n, k)};
  return {inputs(x, n * k, m.dot_bf16 != 0, o.x_bf16), {}};
}

// Matrix `which` of a layer (0 wqkv, 1 wo, 2 w_gate_up, 3 w_down), or the LM head (layer n_layers).
struct Weights {
  const void* w;
  const uint16_t* scales;  // packed: float16 scales and minimums (int4), and the bits (8, 4)
  const uint16_t* mins;
  int bits;  // 16: bf16
};

Weights matrix(const StepModel& m, int64_t layer, int which) {
  static constexpr int COLUMN[4] = {1, 3, 5, 6};  // in a layer's 7 addresses
  const void* w = layer == m.n_layers ? static_cast<const void*>(m.lm_head)
                                      : reinterpret_cast<const void*>(m.layers[7 * layer + COLUMN[which]]);
  if (!m.packed) return {w, nullptr, nullptr, 16};
  const uint64_t* q = m.quant + 3 * (4 * layer + which);
  return {w, reinterpret_cast<const uint16_t*>(q[0]), reinterpret_cast<const uint16_t*>(q[1]), static_cast<int>(q[2])};
}

// store(b, r, sum) for the outputs r0..r1 of W [N, K] and every input row b: gemv_rows for bf16 matrices, quant.cpp's
// tiles for packed ones (r0 and r1 then multiples of 16).
template <class Store>
void product(const StepModel& m, const Weights& w, const Act& a, int64_t n, int64_t k, int64_t r0, int64_t r1, Own& o,
             Store store) {
  if (w.bits == 16) {
    gemv_rows(static_cast<const uint16_t*>(w.w), a.x, n, k, r0, r1, store);
    return;
  }
  const int64_t width = r1 - r0;
  o.sums.resize(n * width);
  const kvrag_quant::Matrix packed{static_cast<const uint8_t*>(w.w), w.scales, w.mins, w.bits, k};
  kvrag_quant::tiles(packed, a.q, n, r0 / kvrag_quant::TILE, r1 / kvrag_quant::TILE, o.sums.data(), width);
  for (int64_t b = 0; b < n; ++b)
    for (int64_t r = 0; r < width; ++r) store(b, r0 + r, o.sums[b * width + r]);
}

// Every key's place (block from the row's table, slot in it), and the rows longest first so that the
// attention items taken last are short.
void plan(const StepModel& m, const int64_t* tables, int64_t max_blocks, Shared& s) {
  const int64_t row = m.n_kv_heads * m.head_dim, bs = m.block_size;
  s.key_first.assign(s.rows + 1, 0);
  for (int64_t b = 0; b < s.rows; ++b) s.key_first[b + 1] = s.key_first[b] + s.pos[b] + 1;
  s.key_at.resize(s.key_first[s.rows]);
  for (int64_t b = 0; b < s.rows; ++b) {
    int64_t* at = s.key_at.data() + s.key_first[b];
    for (int64_t p0 = 0; p0 <= s.pos[b]; p0 += bs) {
      const int64_t block = tables[b * max_blocks + p0 / bs] * m.block_stride;
      for (int64_t p = p0; p < std::min(p0 + bs, s.pos[b] + 1); ++p) at[p] = block + (p - p0) * row;
    }
  }
  s.order.resize(s.rows);
  for (int64_t b = 0; b < s.rows; ++b) s.order[b] = b;
  std::stable_sort(s.order.begin(), s.order.end(), [&](int64_t a, int64_t b) { return s.pos[a] > s.pos[b]; });
}

// q, k, v of layer `layer` for thread t's heads, every row: k and v into the cache at each row's slot, q and k
// rotated to the row's rotary position, q into s.q.
void qkv_heads(const StepModel& m, int64_t layer, Shared& s, Own& o, const Act& x, Span heads) {
  const int64_t hd = m.head_dim, d = m.hidden, nq = m.n_heads * hd;
  const Weights wqkv = matrix(m, layer, 0);
  const auto* bias = reinterpret_cast<const uint16_t*>(m.layers[7 * layer + 2]);
  uint16_t *k = m.k_base + layer * m.layer_stride, *v = m.v_base + layer * m.layer_stride;
  for (int64_t head = heads.begin; head < heads.end; ++head) {
    product(m, wqkv, x, s.rows, d, head * hd, (head + 1) * hd, o, [&](int64_t b, int64_t r, float sum) {
      o.head[b * hd + r - head * hd] = round_bf16(bias ? sum + from_bf16(bias[r]) : sum);
    });
    const int64_t kv = head - m.n_heads;  // a key head from 0, then a value head from n_kv_heads
    for (int64_t b = 0; b < s.rows; ++b) {
      const int64_t at = s.key_at[s.key_first[b] + s.pos[b]], r = s.rot[b];
      const float* x = o.head.data() + b * hd;
      if (kv < 0) {
        rotate(x, m.cos + r * hd, m.sin + r * hd, hd, s.q.data() + b * nq + head * hd);
      } else if (kv < m.n_kv_heads) {
        rotate(x, m.cos + r * hd, m.sin + r * hd, hd, o.rotated.data());
        for (int64_t e = 0; e < hd; ++e) k[at + kv * hd + e] = to_bf16(o.rotated[e]);
      } else {
        for (int64_t e = 0; e < hd; ++e) v[at + (kv - m.n_kv_heads) * hd + e] = to_bf16(x[e]);
      }
    }
  }
}

// (row, KV head, key part) items, taken one at a time by whichever thread is free (rows differ in length):
// each part's unnormalised softmax for the head's query rows.
void attention_items(const StepModel& m, int64_t layer, Shared& s, Own& o) {
  const int64_t hd = m.head_dim, group = m.n_heads / m.n_kv_heads, nq = m.n_heads * hd;
  const int64_t per_row = m.n_kv_heads * KEY_PARTS, n_items = s.rows * per_row;
  const uint16_t *k = m.k_base + layer * m.layer_stride, *v = m.v_base + layer * m.layer_stride;
  for (int64_t item; (item = s.taken[layer].fetch_add(1, std::memory_order_relaxed)) < n_items;) {
    const int64_t b = s.order[item / per_row], h = item % per_row / KEY_PARTS, part = item % KEY_PARTS;
    const int64_t q0 = (b * KEY_PARTS + part) * m.n_heads + h * group;
    const Span keys = share(s.pos[b] + 1, static_cast<int>(part), KEY_PARTS, 16);
    attend_part(s.q.data() + b * nq + h * group * hd, k + h * hd, v + h * hd, s.key_at.data() + s.key_first[b],
                keys.begin, keys.end, group, hd, m.scale, o.scores, s.part_m.data() + q0, s.part_l.data() + q0,
                s.part_acc.data() + q0 * hd);
  }
}

// Row b's key parts merged into one softmax's weighted values, rounded to bf16 as the torch path's output.
void merge_parts(const StepModel& m, const Shared& s, int64_t b, float* attn) {
  const int64_t hd = m.head_dim, first = b * KEY_PARTS * m.n_heads;
  for (int64_t qh = 0; qh < m.n_heads; ++qh) {
    float top = -INFINITY, total = 0.0f;
    for (int p = 0; p < KEY_PARTS; ++p) top = std::max(top, s.part_m[first + p * m.n_heads + qh]);
    float* out = attn + qh * hd;
    std::fill(out, out + hd, 0.0f);
    for (int p = 0; p < KEY_PARTS; ++p) {
      const int64_t i = first + p * m.n_heads + qh;
      if (s.part_l[i] == 0.0f) continue;  // no keys
      const float f = std::exp(s.part_m[i] - top);
      total += f * s.part_l[i];
      for (int64_t e = 0; e < hd; ++e) out[e] += f * s.part_acc[i * hd + e];
    }
    for (int64_t e = 0; e < hd; ++e) out[e] = round_bf16(out[e] / total);
  }
}

// h[b, r] += bf16(W x_b)[r] for thread t's rows and every row b, in bf16 as the torch path's residual add.
void residual_gemv(const StepModel& m, const Weights& w, const Act& x, int64_t n, int64_t k, Span rows, Own& o,
                   float* h) {
  const int64_t d = m.hidden;
  product(m, w, x, n, k, rows.begin, rows.end, o, [&](int64_t b, int64_t r, float sum) {
    h[b * d + r] = round_bf16(h[b * d + r] + round_bf16(sum));
  });
}

// act = bf16(bf16(silu(gate)) * up) for thread t's share of the intermediate rows, every row b.
void gate_up(const StepModel& m, const Weights& w, Shared& s, Own& o, const Act& x, Span rows) {
  const int64_t d = m.hidden, inter = m.inter, len = rows.end - rows.begin;
  product(m, w, x, s.rows, d, rows.begin, rows.end, o,
          [&](int64_t b, int64_t r, float sum) { o.gate[b * len + r - rows.begin] = round_bf16(sum); });
  product(m, w, x, s.rows, d, inter + rows.begin, inter + rows.end, o,
          [&](int64_t b, int64_t r, float sum) { o.up[b * len + r - inter - rows.begin] = round_bf16(sum); });
  for (int64_t b = 0; b < s.rows; ++b) {
    const float *gate = o.gate.data() + b * len, *up = o.up.data() + b * len;
    float* act = s.act.data() + b * inter + rows.begin;
    for (int64_t i = 0; i < len; i += W) {
      const vf g = len - i >= W ? loadu(gate + i) : load_partial(gate + i, len - i);
      // silu(g) = g / (1 + exp(-g)); exp's argument at most 89, whose exp overflows to inf as any past 88.73
      // does (AVX2's scale_pow2 takes exponents up to 127 only), so that g < -89 gives -0 on every ISA
      const vf silu = div(g, add(set1(1.0f), exp_ps(sub(zero(), kvrag_simd::max(g, set1(-89.0f))))));
      alignas(64) float lanes[W];
      kvrag_simd::store(lanes, silu);
      for (int64_t e = 0; e < W && i + e < len; ++e) act[i + e] = round_bf16(round_bf16(lanes[e]) * up[i + e]);
    }
  }
}

// Every layer, then the LM head, on thread t of n_threads (all of them run this, between barriers).
void step_thread(const StepModel& m, Shared& s, Barrier& barrier, float* logits, int t, int n_threads) {
  const int64_t d = m.hidden, hd = m.head_dim, nq = m.n_heads * hd, n = s.rows;
  // shares in whole 16s: a packed matrix's tiles (the bf16 path's 4-row blocks stay whole too)
  const Span heads = share(m.n_heads + 2 * m.n_kv_heads, t, n_threads, 1), out_rows = share(d, t, n_threads, 16);
  const Span mlp_rows = share(m.inter, t, n_threads, 16), vocab = share(m.vocab, t, n_threads, 16);
  Own o;
  o.x.resize(n * d), o.head.resize(n * hd), o.rotated.resize(hd), o.attn.resize(n * nq);
  o.gate.resize(n * (mlp_rows.end - mlp_rows.begin)), o.up.resize(o.gate.size());
  for (int64_t layer = 0; layer < m.n_layers; ++layer) {
    const uint64_t* w = m.layers + 7 * layer;
    rms_norm_rows(s.h.data(), reinterpret_cast<const uint16_t*>(w[0]), n, d, m.eps, o.x.data());  // each its own
    qkv_heads(m, layer, s, o, act(m, o.x.data(), n, d, o), heads);
    barrier.wait();
    attention_items(m, layer, s, o);
    barrier.wait();
    for (int64_t b = 0; b < n; ++b) merge_parts(m, s, b, o.attn.data() + b * nq);
    residual_gemv(m, matrix(m, layer, 1), act(m, o.attn.data(), n, nq, o), n, nq, out_rows, o, s.h.data());
    barrier.wait();
    rms_norm_rows(s.h.data(), reinterpret_cast<const uint16_t*>(w[4]), n, d, m.eps, o.x.data());
    gate_up(m, matrix(m, layer, 2), s, o, act(m, o.x.data(), n, d, o), mlp_rows);
    barrier.wait();
    residual_gemv(m, matrix(m, layer, 3), act(m, s.act.data(), n, m.inter, o), n, m.inter, out_rows, o, s.h.data());
    barrier.wait();
  }
  rms_norm_rows(s.h.data(), m.final_norm, n, d, m.eps, o.x.data());
  product(m, matrix(m, m.n_layers, 0), act(m, o.x.data(), n, d, o), n, d, vocab.begin, vocab.end, o,
          [&](int64_t b, int64_t r, float sum) { logits[b * m.vocab + r] = round_bf16(sum); });
}

// 0 when every row's slot has a table entry, every block up to it is in the pool, and every rotary position
// has angles; 4 for VDPBF16PS products asked of a build without them (AVX2).
int check_batch(const StepModel& m, int64_t n, const int64_t* positions, const int64_t* rotary,
                const int64_t* tables, int64_t max_blocks) {
  if (n <= 0 || max_blocks <= 0) return 1;
  if (m.dot_bf16 && !BF16_DOT) return 4;
  for (int64_t b = 0; b < n; ++b) {
    const int64_t p = positions[b];
    if (p < 0 || p / m.block_size >= max_blocks || rotary[b] < 0 || rotary[b] >= m.max_pos) return 2;
    for (int64_t j = 0; j <= p / m.block_size; ++j) {
      if (tables[b * max_blocks + j] < 0 || tables[b * max_blocks + j] >= m.n_blocks) return 3;
    }
  }
  return 0;
}

}  // namespace

// Feeds n new rows through every layer, row b at slot positions[b] [n] (int64) over its blocks tables
// [n, max_blocks] (int64; slot p in block tables[b, p / block_size] at row p % block_size), its q and k rotated
// to rotary[b] [n] (int64; = positions[b] unless earlier rows of the sequence were dropped): h [n, D] bf16 holds
// their embeddings in and the last layer's outputs out; each layer's rotated key and value of row b go to its
// slot, where the caller has a block that no other row of the batch writes; logits [n, V] float32 get the LM
// head's bf16 values (widened). Row b attends to its keys 0..positions[b]. Shapes were checked by the caller
// (decode.py); positions, rotary and tables are checked here, and dot_bf16 against the build (non-zero: refused,
// nothing written).
extern "C" int kvrag_decode_batch(const StepModel* model, int64_t n, const int64_t* positions, const int64_t* rotary,
                                  const int64_t* tables, int64_t max_blocks, uint16_t* h, float* logits,
                                  int n_threads) {
  const StepModel& m = *model;
  if (const int rc = check_batch(m, n, positions, rotary, tables, max_blocks)) return rc;
  Shared s;
  s.rows = n, s.pos = positions, s.rot = rotary;
  plan(m, tables, max_blocks, s);
  s.taken = std::vector<std::atomic<int64_t>>(m.n_layers);  // (value-initialised: zero)
  s.h.resize(n * m.hidden), s.q.resize(n * m.n_heads * m.head_dim), s.act.resize(n * m.inter);
  s.part_m.resize(n * KEY_PARTS * m.n_heads), s.part_l.resize(s.part_m.size());
  s.part_acc.resize(s.part_m.size() * m.head_dim);
  for (int64_t e = 0; e < n * m.hidden; ++e) s.h[e] = from_bf16(h[e]);
  Barrier barrier;
#pragma omp parallel num_threads(std::max(1, n_threads))
  {
#pragma omp single
    barrier.size(omp_get_num_threads());  // what OpenMP gave: fewer where nested or limited
    step_thread(m, s, barrier, logits, omp_get_thread_num(), omp_get_num_threads());
  }
  for (int64_t e = 0; e < n * m.hidden; ++e) h[e] = to_bf16(s.h[e]);
  return 0;
}

// One row at slot `pos` rotated to `rot` over a contiguous cache: the model's one block (block_size = capacity),
// h [D], logits [V].
extern "C" int kvrag_decode_step(const StepModel* model, int64_t pos, int64_t rot, uint16_t* h, float* logits,
                                 int n_threads) {
  const int64_t block = 0;
  return kvrag_decode_batch(model, 1, &pos, &rot, &block, 1, h, logits, n_threads);
}
