// Paged decode attention on the CPU, reading K and V in place from the block pool (no gather copy).
// One work item per (sequence, KV head) handles the G query heads sharing that KV head: scores for the whole
// context, a softmax per head, then the weighted sum of values. Accumulation is in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

template <typename scalar_t>
static inline void load_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the top half of an fp32: a shift, which the compiler vectorises.
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* bits = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) bits[i] = static_cast<uint32_t>(raw[i]) << 16;
}

constexpr int64_t kMaxHeadDim = 512;

template <typename scalar_t>
static void decode_one(const float* q, const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* table,
                       int64_t context_len, int64_t block_size, int64_t num_kv_heads, int64_t head_dim,
                       int64_t kv_head, int64_t group, float scale, float* out, std::vector<float>& scores) {
  scores.resize(group * context_len);
  alignas(64) float row[kMaxHeadDim];
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    load_float<scalar_t>(k_cache + slot * token_stride + kv_head * head_dim, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = q + g * head_dim;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
      scores[g * context_len + t] = dot * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * context_len;
    const float peak = *std::max_element(s, s + context_len);
    float total = 0.f;
    for (int64_t t = 0; t < context_len; ++t) total += (s[t] = std::exp(s[t] - peak));
    const float inv = 1.f / total;
    for (int64_t t = 0; t < context_len; ++t) s[t] *= inv;
  }
  std::fill(out, out + group * head_dim, 0.f);
  for (int64_t t = 0; t < context_len; ++t) {
    const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
    load_float<scalar_t>(v_cache + slot * token_stride + kv_head * head_dim, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * context_len + t];
      float* o = out + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) o[d] += p * row[d];
    }
  }
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV pool must be contiguous");
  TORCH_CHECK(query.size(2) <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");
  const auto q = query.to(torch::kFloat32).contiguous();
  const auto tables = block_tables.to(torch::kInt32).contiguous();
  const auto lens = context_lens.to(torch::kInt64).contiguous();
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, table_width = tables.size(1);
  auto out = torch::empty({num_seqs, num_heads, head_dim}, q.options());
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const int32_t* table_ptr = tables.data_ptr<int32_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t item = begin; item < end; ++item) {
        const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
        const int64_t offset = (s * num_heads + h * group) * head_dim;
        decode_one<scalar_t>(q_ptr + offset, k_ptr, v_ptr, table_ptr + s * table_width, len_ptr[s], block_size,
                             num_kv_heads, head_dim, h, group, static_cast<float>(scale), out_ptr + offset, scores);
      }
    });
  });
  return out.to(query.scalar_type());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the KV block pool (CPU)");
}
