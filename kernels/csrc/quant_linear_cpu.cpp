// Linears whose weights stay in a GGUF file's Q4_1 or Q8_0 blocks, multiplied in fp32 on the CPU. At decode batch
// sizes a linear is bound by reading its weight: 4.5 or 8.5 bits a weight instead of fp32's 32. Each panel of 16
// output columns is widened with the arithmetic of gguf's dequantize (d * q, then + m, each rounded to fp32), so
// the weights multiplied are exactly those transformers loads: in registers as they are used for a few rows, into
// an fp32 buffer a chunk of k at a time for more (each row's sum runs over k in the same order either way).
// Packed by kernels/cpu_quant.py: scales and mins [panels, K / 32, 16] fp32; quants [panels, K, 8] uint8 for Q4_1
// (byte c: column c's 4 bits, then column c + 8's) or [panels, K, 16] int8 for Q8_0.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>

#include "panel_gemm.h"

namespace {

using ferry::kPanel;

constexpr int64_t kBlock = 32;   // weights per GGUF block (one scale, one min)

// The widening of one panel's weights, block by block: a block's scales (and mins) once, then each k's 16 weights.
struct Q4_1 {
  const uint8_t* quants;   // [K, 8]
  const float* scales;     // [K / 32, 16]
  const float* mins;
#if FERRY_PANEL_FMA
  __m256 d_low, d_high, m_low, m_high;
  void start_block(int64_t block) {
    d_low = _mm256_loadu_ps(scales + block * kPanel), d_high = _mm256_loadu_ps(scales + block * kPanel + 8);
    m_low = _mm256_loadu_ps(mins + block * kPanel), m_high = _mm256_loadu_ps(mins + block * kPanel + 8);
  }
  void weights(int64_t k, __m256& low, __m256& high) const {   // (d * q) + m, two roundings as numpy's
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(quants + k * 8)));
    low = _mm256_add_ps(_mm256_mul_ps(d_low, _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)))),
                        m_low);
    high = _mm256_add_ps(_mm256_mul_ps(d_high, _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4))), m_high);
  }
#endif
  float weight(int64_t k, int64_t c) const {
    const uint8_t byte = quants[k * 8 + c % 8];
    const float scaled = scales[(k / kBlock) * kPanel + c] * static_cast<float>(c < 8 ? byte & 15 : byte >> 4);
    return scaled + mins[(k / kBlock) * kPanel + c];
  }
};

struct Q8_0 {
  const int8_t* quants;    // [K, 16]
  const float* scales;     // [K / 32, 16]
#if FERRY_PANEL_FMA
  __m256 d_low, d_high;
  void start_block(int64_t block) {
    d_low = _mm256_loadu_ps(scales + block * kPanel), d_high = _mm256_loadu_ps(scales + block * kPanel + 8);
  }
  void weights(int64_t k, __m256& low, __m256& high) const {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(quants + k * kPanel));
    low = _mm256_mul_ps(d_low, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
    high = _mm256_mul_ps(d_high, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8))));
  }
#endif
  float weight(int64_t k, int64_t c) const {
    return scales[(k / kBlock) * kPanel + c] * static_cast<float>(quants[k * kPanel + c]);
  }
};

#if FERRY_PANEL_FMA
// Each of R rows' k-th input times one k's 16 weights, added into the row's sums.
template <int R>
inline __attribute__((always_inline)) void multiply_add_rows(const ferry::RowBlock<R>& block, int64_t k,
                                                             __m256 w_low, __m256 w_high, __m256 (&low)[R],
                                                             __m256 (&high)[R]) {
  for (int r = 0; r < R; ++r) {
    const __m256 xk = _mm256_broadcast_ss(block.x_rows[r] + k);
    low[r] = _mm256_fmadd_ps(xk, w_low, low[r]);
    high[r] = _mm256_fmadd_ps(xk, w_high, high[r]);
  }
}

template <int R>
inline __attribute__((always_inline)) void store_rows(const ferry::RowBlock<R>& block, const __m256 (&low)[R],
                                                      const __m256 (&high)[R]) {
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(block.y_rows[r], low[r]);
    _mm256_storeu_ps(block.y_rows[r] + 8, high[r]);
  }
}

// R rows times one panel, each weight widened in registers as it is used (a pass through an fp32 buffer costs more
// than the widening at the few rows this kernel is for).
template <int R, typename Format>
void rows_from_blocks(Format format, const ferry::RowBlock<R>& block, int64_t k_size) {
  __m256 low[R], high[R];
  for (int r = 0; r < R; ++r) low[r] = high[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < k_size / kBlock; ++b) {
    format.start_block(b);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      __m256 w_low, w_high;
      format.weights(k, w_low, w_high);
      multiply_add_rows(block, k, w_low, w_high, low, high);
    }
  }
  store_rows(block, low, high);
}
#else
template <int R, typename Format>
void rows_from_blocks(Format format, const ferry::RowBlock<R>& block, int64_t k_size) {
  for (int r = 0; r < R; ++r) {
    float acc[kPanel] = {};
    for (int64_t k = 0; k < k_size; ++k)
      for (int64_t c = 0; c < kPanel; ++c) acc[c] += block.x_rows[r][k] * format.weight(k, c);
    for (int64_t c = 0; c < kPanel; ++c) block.y_rows[r][c] = acc[c];
  }
}
#endif

#if FERRY_PANEL_FMA
// Above this many rows a panel is widened once a chunk into a buffer that every row block then reads: in registers,
// the widening (as many vector ops a k as the FMAs of four rows) would be redone for each block of rows.
constexpr int64_t kMostRowsWidenedInRegisters = 4;
constexpr int64_t kChunk = 128;   // k's widened at a time: 8 KB of fp32, which stays in L1 while the rows read it
constexpr int kBufferedRows = 6;  // a pass over the buffer: 12 accumulators, 2 weight vectors, 1 broadcast (16 ymm)

template <typename Format>
void widen_chunk(Format& format, int64_t k_begin, int64_t k_end, float* buffer) {
  for (int64_t b = k_begin / kBlock; b < k_end / kBlock; ++b) {
    format.start_block(b);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      __m256 low, high;
      format.weights(k, low, high);
      _mm256_storeu_ps(buffer + (k - k_begin) * kPanel, low);
      _mm256_storeu_ps(buffer + (k - k_begin) * kPanel + 8, high);
    }
  }
}

// R rows times the widened chunk [k_begin, k_end), the rows' sums carried in y from the chunks before.
template <int R>
void rows_over_chunk(const ferry::RowBlock<R>& block, const float* buffer, int64_t k_begin, int64_t k_end) {
  __m256 low[R], high[R];
  for (int r = 0; r < R; ++r) {
    low[r] = k_begin == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(block.y_rows[r]);
    high[r] = k_begin == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(block.y_rows[r] + 8);
  }
  for (int64_t k = k_begin; k < k_end; ++k) {
    const float* weights = buffer + (k - k_begin) * kPanel;
    multiply_add_rows(block, k, _mm256_loadu_ps(weights), _mm256_loadu_ps(weights + 8), low, high);
  }
  store_rows(block, low, high);
}

// A pass over the buffer with fewer than 5 rows leaves the FMA units waiting on their latency (measured per row on
// the AVX2 EPYC: 4 rows cost 1.6x, 1 or 2 rows 4x what 5 or 6 do, and a 4-row block more than a 2-row one): the
// rows go in blocks of 6 and 5 wherever they sum to them (32 rows: 6,6,5,5,5,5), else in 6s and one block of what
// is left (8 rows: 6 and 2).
void rows_over_chunk(const ferry::RowMap& map, int64_t rows, int64_t column, const float* buffer, int64_t k_begin,
                     int64_t k_end) {
  const int64_t blocks = (rows + kBufferedRows - 1) / kBufferedRows;
  const bool fives_and_sixes = rows >= (kBufferedRows - 1) * blocks;
  for (int64_t i = 0, row = 0; row < rows; ++i) {
    const int64_t size = fives_and_sixes ? rows / blocks + (i < rows % blocks ? 1 : 0)
                                         : std::min<int64_t>(kBufferedRows, rows - row);
    switch (size) {
      case 6: rows_over_chunk(map.block<6>(row, column), buffer, k_begin, k_end); break;
      case 5: rows_over_chunk(map.block<5>(row, column), buffer, k_begin, k_end); break;
      case 4: rows_over_chunk(map.block<4>(row, column), buffer, k_begin, k_end); break;
      case 3: rows_over_chunk(map.block<3>(row, column), buffer, k_begin, k_end); break;
      case 2: rows_over_chunk(map.block<2>(row, column), buffer, k_begin, k_end); break;
      default: rows_over_chunk(map.block<1>(row, column), buffer, k_begin, k_end); break;
    }
    row += size;
  }
}

template <typename Format>
void panel_times_buffered_rows(Format format, const ferry::RowMap& map, int64_t rows, int64_t k_size,
                               int64_t column) {
  alignas(32) float buffer[kChunk * kPanel];
  for (int64_t k_begin = 0; k_begin < k_size; k_begin += kChunk) {
    const int64_t k_end = std::min(k_begin + kChunk, k_size);
    widen_chunk(format, k_begin, k_end, buffer);
    rows_over_chunk(map, rows, column, buffer, k_begin, k_end);
  }
}
#endif

template <typename Format>
void panel_times_rows(Format format, const ferry::RowMap& map, int64_t rows, int64_t k_size, int64_t column) {
#if FERRY_PANEL_FMA
  if (rows > kMostRowsWidenedInRegisters) return panel_times_buffered_rows(format, map, rows, k_size, column);
#endif
  int64_t row = 0;
  for (; row + ferry::kRowBlock <= rows; row += ferry::kRowBlock)
    rows_from_blocks(format, map.block<ferry::kRowBlock>(row, column), k_size);
  switch (rows - row) {
    case 3: rows_from_blocks(format, map.block<3>(row, column), k_size); break;
    case 2: rows_from_blocks(format, map.block<2>(row, column), k_size); break;
    case 1: rows_from_blocks(format, map.block<1>(row, column), k_size); break;
    default: break;
  }
}

void check_inputs(const torch::Tensor& x, const torch::Tensor& scales, const torch::Tensor& mins,
                  const torch::Tensor& quants) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.stride(1) == 1, "x must be [rows, K] fp32");
  const int64_t panels = quants.size(0), k_size = x.size(1);
  TORCH_CHECK(k_size % kBlock == 0 && quants.dim() == 3 && quants.size(1) == k_size && quants.is_contiguous(),
              "quants must be [panels, K, 8 or 16], contiguous, K a multiple of 32");
  TORCH_CHECK(scales.sizes() == torch::IntArrayRef({panels, k_size / kBlock, kPanel}) && scales.is_contiguous() &&
                  scales.scalar_type() == torch::kFloat32, "scales must be [panels, K / 32, 16] fp32, contiguous");
  const bool q4 = quants.scalar_type() == torch::kUInt8 && quants.size(2) == 8;
  const bool q8 = quants.scalar_type() == torch::kInt8 && quants.size(2) == kPanel;
  TORCH_CHECK(q4 || q8, "quants must be uint8 [.., 8] (Q4_1) or int8 [.., 16] (Q8_0)");
  TORCH_CHECK(!q4 || mins.sizes() == scales.sizes(), "Q4_1 needs mins shaped as scales");
}

}  // namespace

// x [rows, K] fp32 → [rows, N]: x times the packed weight's transpose (see the top of this file for the layout).
torch::Tensor quantized_linear(torch::Tensor x, torch::Tensor scales, torch::Tensor mins, torch::Tensor quants) {
  check_inputs(x, scales, mins, quants);
  const int64_t panels = quants.size(0), k_size = x.size(1), rows = x.size(0);
  const bool q4 = quants.scalar_type() == torch::kUInt8;
  torch::Tensor y = torch::empty({rows, panels * kPanel}, x.options());
  const ferry::RowMap map{x.data_ptr<float>(), x.stride(0), y.data_ptr<float>(), y.stride(0),
                          nullptr, nullptr, nullptr};
  const int64_t blocks = k_size / kBlock;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel_scales = scales.data_ptr<float>() + p * blocks * kPanel;
      if (q4) {
        const Q4_1 format{quants.data_ptr<uint8_t>() + p * k_size * 8, panel_scales,
                          mins.data_ptr<float>() + p * blocks * kPanel};
        panel_times_rows(format, map, rows, k_size, p * kPanel);
      } else {
        const Q8_0 format{quants.data_ptr<int8_t>() + p * k_size * kPanel, panel_scales};
        panel_times_rows(format, map, rows, k_size, p * kPanel);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantized_linear", &quantized_linear, "x times a linear's weight kept in Q4_1 or Q8_0 blocks");
  m.def("fused_multiply_add", [] { return FERRY_PANEL_FMA != 0; },
        "whether each product is added to its row's sum in one rounding (an FMA) rather than two");
  m.def("vector_isa", &ferry::vector_isa, "the vector extensions this build targets: avx512, avx2 or portable");
}
