// Where the row kernel's keys lie and how it lays a key block out (row_attention.cpp).

#pragma once

#include <cstdint>

#include "simd.h"

namespace kvrag_rows {

constexpr int kKeyBlock = 64;  // keys per block: 64 / W vectors (four on AVX-512, eight on AVX2)
static_assert(kKeyBlock % kvrag_simd::W == 0, "a key block is whole vectors");

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bf16) {  // bfloat16 is the top half of a float32
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

// Where the keys are: the first n_head in a paged pool (hk, hv [slots, Hkv, D], key i at row slots[i]: a cached
// prefix read where it lies), the rest contiguous in k, v [S - n_head, Hkv, D].
template <typename T>
struct KeyRows {
  const T *hk, *hv;
  const int64_t* slots;
  int64_t n_head;
  const T *k, *v;
  int64_t n_kv_heads, d;
  int64_t at(int64_t key, int64_t h) const { return ((key < n_head ? slots[key] : key - n_head) * n_kv_heads + h) * d; }
  const T* key_row(int64_t key, int64_t h) const { return (key < n_head ? hk : k) + at(key, h); }
  const T* value_row(int64_t key, int64_t h) const { return (key < n_head ? hv : v) + at(key, h); }
};

// Key block b of KV head h laid out as score_tile reads it: [D, 64] float32, or with key_pairs (bf16 keys) [D / 2,
// 64] 32-bit pairs of dimensions as they lie. Keys past n_keys are zero.
template <typename T>
void pack_key_block(const KeyRows<T>& keys, int64_t n_keys, int64_t h, int64_t b, bool key_pairs, void* out) {
  const int64_t d = keys.d, lanes = key_pairs ? d / 2 : d;  // 32-bit lanes a key
  float* panel = static_cast<float*>(out);
  uint32_t* pairs = static_cast<uint32_t*>(out);
  // W keys at a time by simd.h's W x W transpose where their lanes are 32-bit as they lie (bf16 pairs, float32
  // keys); lanes is a multiple of W (D is of 64)
  constexpr int W = kvrag_simd::W;
  const bool as_lanes = key_pairs || sizeof(T) == 4;
  for (int64_t j0 = 0; j0 < kKeyBlock; j0 += W) {
    const int64_t key0 = b * kKeyBlock + j0;
    if (as_lanes && key0 + W <= n_keys) {
      const uint32_t* row[W];
      for (int i = 0; i < W; ++i) row[i] = reinterpret_cast<const uint32_t*>(keys.key_row(key0 + i, h));
      for (int64_t e0 = 0; e0 < lanes; e0 += W) {
        kvrag_simd::vi rows[W];
        for (int i = 0; i < W; ++i) rows[i] = kvrag_simd::iloadu(row[i] + e0);
        kvrag_simd::transpose(rows, pairs + e0 * kKeyBlock + j0, kKeyBlock);
      }
      continue;
    }
    for (int64_t j = j0; j < j0 + W; ++j) {  // the block's last keys, or bf16 keys widened to float32
      const int64_t key = b * kKeyBlock + j;
      if (key >= n_keys) {
        for (int64_t e = 0; e < lanes; ++e) pairs[e * kKeyBlock + j] = 0;  // 0.0f's bits too
        continue;
      }
      const T* krow = keys.key_row(key, h);
      if (key_pairs) {
        uint32_t pair;
        for (int64_t e = 0; e < lanes; ++e) {
          __builtin_memcpy(&pair, krow + 2 * e, sizeof pair);
          pairs[e * kKeyBlock + j] = pair;
        }
      } else {
        for (int64_t e = 0; e < d; ++e) panel[e * kKeyBlock + j] = to_float(krow[e]);
      }
    }
  }
}

// Values of key block b, head h, as float32 rows into vt (zero past n_keys).
template <typename T>
void pack_value_block(const KeyRows<T>& keys, int64_t n_keys, int64_t s_pad, int64_t h, int64_t b, float* vt) {
  const int64_t d = keys.d;
  for (int64_t key = b * kKeyBlock; key < (b + 1) * kKeyBlock; ++key) {
    float* out = vt + (h * s_pad + key) * d;
    const T* vrow = key < n_keys ? keys.value_row(key, h) : nullptr;
    for (int64_t e = 0; e < d; ++e) out[e] = vrow ? to_float(vrow[e]) : 0.0f;  // contiguous: vectorised
  }
}

}  // namespace kvrag_rows
