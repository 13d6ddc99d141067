// The quantized product's pieces that decode.cpp's whole step shares with quant.cpp (which documents the layout).
#pragma once

#include <cstdint>
#include <vector>

namespace kvrag_quant {

constexpr int64_t GROUP = 32;  // inputs a group
constexpr int64_t TILE = 16;   // outputs a vector

struct Matrix {  // W [N, K] packed: weights, float16 scales and (int4) minimums [N/16][K/32][16]
  const uint8_t* w;
  const uint16_t* scales;
  const uint16_t* mins;
  int bits;  // 8 or 4
  int64_t k;
};

struct Rows {  // activations quantized per row and group
  const int8_t* q;     // [R, K]
  const float* d;      // [R, G]
  const int32_t* sum;  // [R, G]
  int64_t k, groups;
};

// Buffers for one set of quantized rows, reused from product to product.
struct Quantized {
  std::vector<int8_t> q;
  std::vector<float> d;
  std::vector<int32_t> sum;
  Rows of(const float* x, int64_t rows, int64_t k);  // x [R, K] float32 quantized into these buffers
};

// out[r * ldo + n - 16 tile0] for rows r < `rows` and the outputs n of tiles [tile0, tile1), in float32.
void tiles(const Matrix& m, const Rows& x, int64_t rows, int64_t tile0, int64_t tile1, float* out, int64_t ldo);

}  // namespace kvrag_quant
