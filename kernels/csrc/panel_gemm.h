// The fp32 multiply both the mixture-of-experts and the quantized linears run: a block of up to kRowBlock rows times
// one panel of 16 output columns, packed [K, 16] so that each k's 16 weights sit side by side.
#pragma once

#include <cstdint>

#include "cpu_simd.h"

#if defined(__AVX2__) && defined(__FMA__) && !defined(FERRY_PORTABLE)
#define FERRY_PANEL_FMA 1
#include <immintrin.h>
#else
#define FERRY_PANEL_FMA 0
#endif

namespace ferry {
// Internal linkage: GCC inlines and unrolls these into each caller's loop (as ferry:: templates with external
// linkage they ran 1.9x slower in the MoE kernel).
namespace {

constexpr int64_t kPanel = 16;     // output columns per packed panel
constexpr int64_t kRowBlock = 4;   // rows that share one pass over a panel

// Where a block of rows reads and writes: row r reads x_rows[r] and writes scale[r] * its result to y_rows[r].
template <int R>
struct RowBlock {
  const float* x_rows[R];
  float* y_rows[R];
  float scale[R];
};

#if FERRY_PANEL_FMA
// 16 output columns of R rows: each k loads the panel's 16 weights once and multiplies them into every row.
template <int R>
void panel_rows(const RowBlock<R>& block, const float* panel, int64_t k_size) {
  __m256 low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; ++k) {
    const __m256 w_low = _mm256_loadu_ps(panel + k * kPanel), w_high = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xk = _mm256_broadcast_ss(block.x_rows[r] + k);
      low[r] = _mm256_fmadd_ps(xk, w_low, low[r]);
      high[r] = _mm256_fmadd_ps(xk, w_high, high[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const __m256 scale = _mm256_set1_ps(block.scale[r]);
    _mm256_storeu_ps(block.y_rows[r], _mm256_mul_ps(low[r], scale));
    _mm256_storeu_ps(block.y_rows[r] + 8, _mm256_mul_ps(high[r], scale));
  }
}
#else
template <int R>
void panel_rows(const RowBlock<R>& block, const float* panel, int64_t k_size) {
  for (int r = 0; r < R; ++r) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < k_size; ++k)
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += block.x_rows[r][k] * panel[k * kPanel + c];
    for (int64_t c = 0; c < kPanel; ++c) block.y_rows[r][c] = acc[c] * block.scale[r];
  }
}
#endif


// The rows' addresses in x and y: x row source[r] (or r), y row destination[r] (or r), from column `column` on.
struct RowMap {
  const float* x;
  int64_t x_stride;
  float* y;
  int64_t y_stride;
  const int64_t* source;        // nullptr: row r of x
  const int64_t* destination;   // nullptr: row r of y
  const float* scale;           // nullptr: 1

  template <int R>
  RowBlock<R> block(int64_t first_row, int64_t column) const {
    RowBlock<R> rows;
    for (int r = 0; r < R; ++r) {
      const int64_t row = first_row + r;
      rows.x_rows[r] = x + (source ? source[row] : row) * x_stride;
      rows.y_rows[r] = y + (destination ? destination[row] : row) * y_stride + column;
      rows.scale[r] = scale ? scale[row] : 1.f;
    }
    return rows;
  }
};

// Rows [first_row, end_row) of map times one panel, kRowBlock rows at a time, into columns [column, column + 16).
inline void panel_row_range(const RowMap& map, int64_t first_row, int64_t end_row, const float* panel,
                            int64_t k_size, int64_t column) {
  int64_t row = first_row;
  for (; row + kRowBlock <= end_row; row += kRowBlock) panel_rows(map.block<kRowBlock>(row, column), panel, k_size);
  switch (end_row - row) {
    case 3: panel_rows(map.block<3>(row, column), panel, k_size); break;
    case 2: panel_rows(map.block<2>(row, column), panel, k_size); break;
    case 1: panel_rows(map.block<1>(row, column), panel, k_size); break;
    default: break;
  }
}

}  // namespace
}  // namespace ferry
