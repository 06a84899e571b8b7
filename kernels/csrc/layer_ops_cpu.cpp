// A decoder layer's elementwise work on the CPU, fused: RMSNorm (with the residual add before it), rotary
// embedding of q and k together with the store of k and v into the paged pool, and SiLU(gate) * up; and the
// greedy pick over the LM head's rows (torch's argmax over bf16 is slower than widening the logits first).
//
// In eager torch these are ~40 small operator calls per layer, each a pass over memory and a dispatch; at decode
// batch sizes the calls cost more than the arithmetic. Each function here is one pass.
//
// Rounding is that of the eager ops they replace (gpu_worker/model.py's reference versions, which are those of
// Hugging Face transformers): every eager bf16/fp16 op computes in fp32 and rounds its result, so the same
// intermediate roundings are applied here, and floating-point contraction is off (built with -ffp-contract=off).
// The RMS sum is added in torch's own order, so RMSNorm is bit-exact; only the exponential (SiLU's, vectorised
// here) can differ from torch, by about an ulp of fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_simd.h"
#include "simd_math.h"

namespace {

using ferry::bf16_bits_to_float;
#if FERRY_AVX512
using V = ferry::F32x16;   // the build's float vector: the vector loops below are written once against it
#elif FERRY_AVX2
using V = ferry::F32x8;
#endif
#if FERRY_AVX512 || FERRY_AVX2
using ferry::exp_ps;
constexpr int64_t kLanes = sizeof(V::Vec) / sizeof(float);
#endif

// fp32 -> bf16 with round-to-nearest-even, written as integer ops so that loops over it vectorise.
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return std::isnan(f) ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

// Element access per storage type: load widens to fp32, store narrows with rounding, round = store then load.
template <typename T>
struct Elem;

template <>
struct Elem<float> {
  using Storage = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
  static float round(float x) { return x; }
};

template <>
struct Elem<at::BFloat16> {
  using Storage = uint16_t;
  static float load(uint16_t x) { return bf16_bits_to_float(x); }
  static uint16_t store(float x) { return float_to_bf16(x); }
  static float round(float x) { return bf16_bits_to_float(float_to_bf16(x)); }
};

template <>
struct Elem<at::Half> {
  using Storage = at::Half;
  static float load(at::Half x) { return static_cast<float>(x); }
  static at::Half store(float x) { return static_cast<at::Half>(x); }
  static float round(float x) { return static_cast<float>(static_cast<at::Half>(x)); }
};

template <typename T>
using Storage = typename Elem<T>::Storage;

template <typename T>
Storage<T>* data(torch::Tensor& t) {
  return reinterpret_cast<Storage<T>*>(t.data_ptr());
}

constexpr int64_t kRowGrain = 16;   // rows per thread task: tiny batches stay on one thread

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": expected rows [T, N] with contiguous rows");
}

// Under AVX-512 or AVX2, fp32 and bf16 rows take the vector loops; fp16 rows the scalar ones
template <typename T>
constexpr bool kVectorised = !std::is_same_v<T, at::Half>;

// Loads widen a vector's worth of fp32 or bf16 elements; stores narrow them again; round_lanes rounds as a store
// then load would.
#if FERRY_AVX512
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_lanes(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// fp32 → bf16 bits (round to nearest even, NaN kept a NaN) in the low half of each 32-bit lane
inline __m512i bf16_bits(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

inline __m512 round_lanes(__m512 x, float) { return x; }
inline __m512 round_lanes(__m512 x, uint16_t) { return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(x), 16)); }

inline void store_lanes(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store_lanes(uint16_t* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(x)));
}
#endif

#if FERRY_AVX2
// The same helpers on 8-lane AVX2 vectors
inline __m256 load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_lanes(const uint16_t* p) { return ferry::load8_bf16(p); }

// fp32 → bf16 bits (round to nearest even, NaN kept a NaN) in the low half of each 32-bit lane
inline __m256i bf16_bits(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

inline __m256 round_lanes(__m256 x, float) { return x; }
inline __m256 round_lanes(__m256 x, uint16_t) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16)); }

inline void store_lanes(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store_lanes(uint16_t* p, __m256 x) {
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(x), _mm256_setzero_si256()), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// CeilLog2 of ATen/native/cpu/utils.h
inline int64_t ceil_log2(int64_t x) {
  return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1));
}

// The sum of a row's squares in the order eager torch adds them: x.float().pow(2) rounds each square to fp32 (no
// fused multiply-add), and .mean() on the CPU is cascade_sum (ATen/native/cpu/SumKernel.cpp): vectors of
// `Lanes` floats, 4 interleaved accumulators over groups of 4 vectors, cascaded into levels every 16 groups,
// then the scalar tail, then the lanes one by one. Rows shorter than a vector are summed as vectors of 1. An
// RMSNorm that differs from transformers' by an ulp of its sum rounds some bf16 outputs the other way, and over
// 30 layers that can change the greedy answer.
template <typename T, int Lanes>
float torch_order_sum_of_squares(const Storage<T>* x, int64_t n) {
  constexpr int kIlp = 4, kLevels = 4;
  const int64_t vectors = n / Lanes;
  const int64_t groups = vectors / kIlp;
  float acc[kLevels][kIlp][Lanes] = {};
  auto square = [x](int64_t i) {
    const float v = Elem<T>::load(x[i]);
    return v * v;
  };
  auto add_group = [&](int64_t g) {
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += square((g * kIlp + k) * Lanes + l);
  };
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(groups) / kLevels);
  const int64_t level_step = int64_t{1} << level_power, level_mask = level_step - 1;
  int64_t g = 0;
  while (g + level_step <= groups) {
    for (int64_t j = 0; j < level_step; ++j, ++g) add_group(g);
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < kIlp; ++k)
        for (int l = 0; l < Lanes; ++l) acc[j][k][l] += acc[j - 1][k][l], acc[j - 1][k][l] = 0.f;
      if ((g & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; g < groups; ++g) add_group(g);
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < kIlp; ++k)
      for (int l = 0; l < Lanes; ++l) acc[0][k][l] += acc[j][k][l];
  for (int64_t v = groups * kIlp; v < vectors; ++v)
    for (int l = 0; l < Lanes; ++l) acc[0][0][l] += square(v * Lanes + l);
  for (int k = 1; k < kIlp; ++k)
    for (int l = 0; l < Lanes; ++l) acc[0][0][l] += acc[0][k][l];
  float sum = 0.f;
  for (int64_t i = vectors * Lanes; i < n; ++i) sum += square(i);
  for (int l = 0; l < Lanes; ++l) sum += acc[0][0][l];
  return sum;
}

// The width of the vectors torch's sum kernel adds fp32 in, whatever ATen's CPU capability or this build's: 8.
// ATen registers sum_stub with REGISTER_DISPATCH, which leaves the AVX-512 slot empty ("slower with AVX512",
// SumKernel.cpp), so where torch reports AVX512 it sums with its AVX2 kernel; AVX2's and the DEFAULT kernel's
// Vectorized<float> are 256 bits. Taking 16 on AVX-512 CPUs was an ulp off there (issue 32).
constexpr int kTorchSumLanes = 8;

template <typename T>
void rms_norm_row(const Storage<T>* x, const Storage<T>* weight, Storage<T>* out, int64_t n, float eps) {
  const float sum = n < kTorchSumLanes ? torch_order_sum_of_squares<T, 1>(x, n)
                                       : torch_order_sum_of_squares<T, kTorchSumLanes>(x, n);
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  int64_t i = 0;
#if FERRY_AVX512 || FERRY_AVX2
  if constexpr (kVectorised<T>) {
    const V::Vec scale = V::set1(inv_rms);
    for (; i + kLanes <= n; i += kLanes) {
      const V::Vec normed = round_lanes(V::mul(load_lanes(x + i), scale), Storage<T>{});
      store_lanes(out + i, V::mul(load_lanes(weight + i), normed));
    }
  }
#endif
  for (; i < n; ++i) {
    // eager: weight * (x.float() * rsqrt(...)).to(dtype), the product rounded again
    const float normed = Elem<T>::round(Elem<T>::load(x[i]) * inv_rms);
    out[i] = Elem<T>::store(Elem<T>::load(weight[i]) * normed);
  }
}

template <typename T>
void add_row(Storage<T>* residual, const Storage<T>* x, int64_t n) {
  int64_t i = 0;
#if FERRY_AVX512 || FERRY_AVX2
  if constexpr (kVectorised<T>) {
    for (; i + kLanes <= n; i += kLanes)
      store_lanes(residual + i, V::add(load_lanes(residual + i), load_lanes(x + i)));
  }
#endif
  for (; i < n; ++i) residual[i] = Elem<T>::store(Elem<T>::load(residual[i]) + Elem<T>::load(x[i]));
}

template <typename T>
void rms_norm_rows(torch::Tensor x, torch::Tensor weight, torch::Tensor out, torch::Tensor* residual, double eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      Storage<T>* row = data<T>(x) + r * x.stride(0);
      if (residual != nullptr) {
        Storage<T>* res = data<T>(*residual) + r * residual->stride(0);
        add_row<T>(res, row, n);
        row = res;
      }
      rms_norm_row<T>(row, data<T>(weight), data<T>(out) + r * out.stride(0), n, static_cast<float>(eps));
    }
  });
}

#define FERRY_DISPATCH(dtype, NAME, ...)                                                           \
  switch (dtype) {                                                                                 \
    case at::kFloat: { using scalar = float; __VA_ARGS__; break; }                               \
    case at::kBFloat16: { using scalar = at::BFloat16; __VA_ARGS__; break; }                     \
    case at::kHalf: { using scalar = at::Half; __VA_ARGS__; break; }                             \
    default: TORCH_CHECK(false, NAME, ": unsupported dtype ", dtype);                              \
  }

// rotated[j] = x[j] * cos[j] + (j < half ? -x[j + half] : x[j - half]) * sin[j], each product and the sum rounded
template <typename T>
void rotate_head(const Storage<T>* x, const Storage<T>* cos, const Storage<T>* sin, Storage<T>* out, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t j = 0; j < dim; ++j) {
    const float partner = j < half ? -Elem<T>::load(x[j + half]) : Elem<T>::load(x[j - half]);
    const float a = Elem<T>::round(Elem<T>::load(x[j]) * Elem<T>::load(cos[j]));
    const float b = Elem<T>::round(partner * Elem<T>::load(sin[j]));
    out[j] = Elem<T>::store(a + b);
  }
}

// A head whose first rotary_dim dims rotate (partial rotary embeddings: Phi-4-mini) and whose others pass as they are.
template <typename T>
void rotate_head_part(const Storage<T>* x, const Storage<T>* cos, const Storage<T>* sin, Storage<T>* out,
                      int64_t rotary_dim, int64_t head_dim) {
  rotate_head<T>(x, cos, sin, out, rotary_dim);
  if (rotary_dim < head_dim) std::memcpy(out + rotary_dim, x + rotary_dim, (head_dim - rotary_dim) * sizeof(Storage<T>));
}

template <typename T>
void rotary_store_rows(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                       torch::Tensor v_cache, torch::Tensor slots, torch::Tensor q_out, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim) {
  const int64_t rows = qkv.size(0), rotary_dim = cos.size(1);
  const int64_t k_offset = num_heads * head_dim, v_offset = k_offset + num_kv_heads * head_dim;
  // the pools are [N, B, KV, D] views, any strides with a contiguous head_dim (Ferry's pool is head-major)
  const int64_t block_size = k_cache.size(1);
  const int64_t block_stride = k_cache.stride(0), token_stride = k_cache.stride(1), head_stride = k_cache.stride(2);
  const int64_t* slot = slots.data_ptr<int64_t>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Storage<T>* row = data<T>(qkv) + r * qkv.stride(0);
      const Storage<T>* c = data<T>(cos) + r * cos.stride(0);
      const Storage<T>* s = data<T>(sin) + r * sin.stride(0);
      Storage<T>* q = data<T>(q_out) + r * k_offset;
      for (int64_t h = 0; h < num_heads; ++h)
        rotate_head_part<T>(row + h * head_dim, c, s, q + h * head_dim, rotary_dim, head_dim);
      if (slot[r] < 0) continue;   // already in a shared block
      const int64_t dst = slot[r] / block_size * block_stride + slot[r] % block_size * token_stride;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        rotate_head_part<T>(row + k_offset + h * head_dim, c, s, data<T>(k_cache) + dst + h * head_stride,
                            rotary_dim, head_dim);
        std::memcpy(data<T>(v_cache) + dst + h * head_stride, row + v_offset + h * head_dim,
                    head_dim * sizeof(Storage<T>));
      }
    }
  });
}

template <typename T>
inline float silu_mul_scalar(float gate, float up) {
  const float silu = Elem<T>::round(gate / (1.f + std::exp(-gate)));
  return silu * up;
}

template <typename T>
void silu_mul_row(const Storage<T>* gate, const Storage<T>* up, Storage<T>* dst, int64_t n) {
  int64_t i = 0;
#if FERRY_AVX512 || FERRY_AVX2
  if constexpr (kVectorised<T>) {
    for (; i + kLanes <= n; i += kLanes) {
      const V::Vec g = load_lanes(gate + i);
      const V::Vec denominator = V::add(V::set1(1.f), exp_ps(V::sub(V::zero(), g)));
      const V::Vec silu = round_lanes(V::div(g, denominator), Storage<T>{});
      store_lanes(dst + i, V::mul(silu, load_lanes(up + i)));
    }
  }
#endif
  for (; i < n; ++i) dst[i] = Elem<T>::store(silu_mul_scalar<T>(Elem<T>::load(gate[i]), Elem<T>::load(up[i])));
}

template <typename T>
void silu_mul_rows(torch::Tensor gate_up, torch::Tensor out) {
  const int64_t rows = gate_up.size(0), n = out.size(1);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Storage<T>* gate = data<T>(gate_up) + r * gate_up.stride(0);
      silu_mul_row<T>(gate, gate + n, data<T>(out) + r * out.stride(0), n);
    }
  });
}

// Index of the largest value of a row, the first one on ties; a NaN counts as the largest (torch.argmax's rule).
// Per lane a running max and where it was first seen, then the lowest such index among the lanes holding the max.
template <typename T>
int64_t argmax_row(const Storage<T>* x, int64_t n) {
  int64_t i = 0, best = 0;
  float best_value = -INFINITY;
  bool nan = false;
#if FERRY_AVX512
  if constexpr (kVectorised<T>) {
    if (n >= 16) {
      __m512 peak = _mm512_set1_ps(-INFINITY);
      const __m512i step = _mm512_set1_epi32(16);
      __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), where = index;
      __mmask16 nans = 0;
      for (; i + 16 <= n; i += 16, index = _mm512_add_epi32(index, step)) {
        const __m512 v = load_lanes(x + i);
        const __mmask16 greater = _mm512_cmp_ps_mask(v, peak, _CMP_GT_OQ);
        peak = _mm512_mask_mov_ps(peak, greater, v);
        where = _mm512_mask_mov_epi32(where, greater, index);
        nans |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
      best_value = _mm512_reduce_max_ps(peak);
      best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(peak, _mm512_set1_ps(best_value), _CMP_EQ_OQ), where);
      nan = nans != 0;
    }
  }
#elif FERRY_AVX2
  if constexpr (kVectorised<T>) {
    if (n >= 8) {
      __m256 peak = _mm256_set1_ps(-INFINITY), nans = _mm256_setzero_ps();
      __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), where = index;
      for (; i + 8 <= n; i += 8, index = _mm256_add_epi32(index, _mm256_set1_epi32(8))) {
        const __m256 v = load_lanes(x + i);
        const __m256 greater = _mm256_cmp_ps(v, peak, _CMP_GT_OQ);
        peak = _mm256_blendv_ps(peak, v, greater);
        where = _mm256_blendv_epi8(where, index, _mm256_castps_si256(greater));
        nans = _mm256_or_ps(nans, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      }
      alignas(32) float peaks[8];
      alignas(32) int32_t wheres[8];
      _mm256_store_ps(peaks, peak);
      _mm256_store_si256(reinterpret_cast<__m256i*>(wheres), where);
      best_value = peaks[0], best = wheres[0];
      for (int lane = 1; lane < 8; ++lane)
        if (peaks[lane] > best_value || (peaks[lane] == best_value && wheres[lane] < best))
          best_value = peaks[lane], best = wheres[lane];
      nan = _mm256_movemask_ps(nans) != 0;
    }
  }
#endif
  for (; i < n; ++i) {
    const float v = Elem<T>::load(x[i]);
    nan |= std::isnan(v);
    if (v > best_value) best_value = v, best = i;
  }
  if (nan)
    for (i = 0; i < n; ++i)
      if (std::isnan(Elem<T>::load(x[i]))) return i;
  return best;
}

template <typename T>
void argmax_rows_of(torch::Tensor x, torch::Tensor out) {
  at::parallel_for(0, x.size(0), kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      out.data_ptr<int64_t>()[r] = argmax_row<T>(data<T>(x) + r * x.stride(0), x.size(1));
  });
}

}  // namespace

// RMSNorm of each row of x: returns weight * normalise(x), as a new tensor.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [N] in x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  FERRY_DISPATCH(x.scalar_type(), "rms_norm", rms_norm_rows<scalar>(x, weight, out, nullptr, eps));
  return out;
}

// residual += x (in place), then returns RMSNorm(residual): the residual stream's add fused with the next norm.
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm");
  check_rows(residual, "add_rms_norm");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "add_rms_norm: x and residual must match");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be contiguous [N] in x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  FERRY_DISPATCH(x.scalar_type(), "add_rms_norm", rms_norm_rows<scalar>(x, weight, out, &residual, eps));
  return out;
}

// qkv [T, (H + 2 KV) * D] → rotated q [T, H, D]; rotated k and v go to the pools at slots (slot < 0: skipped).
torch::Tensor rotary_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                              torch::Tensor v_cache, torch::Tensor slots, int64_t num_heads, int64_t num_kv_heads) {
  check_rows(qkv, "rotary_store_kv");
  check_rows(cos, "rotary_store_kv cos");
  check_rows(sin, "rotary_store_kv sin");
  const int64_t head_dim = qkv.size(1) / (num_heads + 2 * num_kv_heads), rotary_dim = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "rotary_store_kv: qkv width does not match the heads");
  TORCH_CHECK(rotary_dim % 2 == 0 && rotary_dim <= head_dim,
              "rotary_store_kv: cos/sin must be an even width up to the head's (the dims that rotate)");
  TORCH_CHECK(cos.size(0) == qkv.size(0) && sin.sizes() == cos.sizes(), "rotary_store_kv: one cos/sin row a token");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rotary_store_kv: qkv, cos, sin and the pools must share a dtype");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(3) == head_dim && k_cache.size(2) == num_kv_heads &&
                  k_cache.stride(3) == 1 && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.strides() == k_cache.strides(),
              "rotary_store_kv: pools must be [N, B, KV, D] with the same strides and a contiguous head_dim");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == qkv.size(0),
              "rotary_store_kv: slots must be int64 [T]");
  const int64_t pool_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < slots.numel(); ++r)
    TORCH_CHECK(slot[r] < pool_slots, "rotary_store_kv: slot ", slot[r], " outside the pool");
  auto q = torch::empty({qkv.size(0), num_heads, head_dim}, qkv.options());
  FERRY_DISPATCH(qkv.scalar_type(), "rotary_store_kv",
                 rotary_store_rows<scalar>(qkv, cos, sin, k_cache, v_cache, slots, q, num_heads, num_kv_heads,
                                           head_dim));
  return q;
}

// gate_up [T, 2I] → SiLU(gate) * up [T, I]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_mul: gate_up must have an even width");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  FERRY_DISPATCH(gate_up.scalar_type(), "silu_mul", silu_mul_rows<scalar>(gate_up, out));
  return out;
}

// The index of each row's largest value (greedy sampling over the LM head's logits), as torch.argmax(x, 1).
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "argmax_rows");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: rows must not be empty");
  auto out = torch::empty({x.size(0)}, x.options().dtype(torch::kInt64));
  FERRY_DISPATCH(x.scalar_type(), "argmax_rows", argmax_rows_of<scalar>(x, out));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &ferry::vector_isa, "the vector path compiled in: avx512, avx2 or portable");
  m.def("rms_norm", &rms_norm, "RMSNorm of each row");
  m.def("add_rms_norm", &add_rms_norm, "residual += x, then RMSNorm of the residual");
  m.def("rotary_store_kv", &rotary_store_kv, "rotary q and k from a fused qkv row; k and v stored in the pool");
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up");
  m.def("argmax_rows", &argmax_rows, "index of each row's largest value (first on ties, NaN largest)");
}
