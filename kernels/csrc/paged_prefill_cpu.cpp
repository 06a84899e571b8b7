// Paged prefill attention on the CPU: the causal attention of the chunks that bring several new tokens of a
// sequence, reading K and V in place from the block pool.
//
// Flash-attention style. One work item is one (sequence, KV head, tile of query tokens); its rows are the tile's
// tokens times the G query heads that share the KV head, so that every key read serves all of them (the rows of a
// small GEMM). The item walks the keys its tile may see, kKeys at a time: it widens them to fp32 (keys transposed,
// [head_dim][kKeys]; values [kKeys][head_dim]), scores them for all rows (register blocks of rows x kKeys),
// masks what a row may not see (later positions; with a sliding window, positions before it), updates each row's
// running softmax (base 2, the query pre-multiplied by scale * log2(e)), and accumulates the values (register
// blocks of rows x 2 vectors of head_dim). Keys after the tile's last token are never read, so the causal triangle
// costs its own area, not the square's; positions no row of the tile may see are not read either (a window's
// blocks may already be freed). Everything in fp32, K and V widened on load. Items are handed out dynamically to
// the threads, the costliest first.
//
// Vector paths only (AVX-512, else AVX2 with FMA): a build with neither says so (vector_isa() == "portable") and
// prefill chunks then go to the decode kernel, one query row at a time.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_simd.h"
#include "simd_math.h"

namespace {

constexpr int64_t kKeys = 16;          // keys scored together
constexpr int64_t kDimPad = 32;        // head_dim is padded to a multiple of this (two vectors of either path)
constexpr int64_t kTileRows = 96;      // rows (tokens x query heads of one KV head) an item aims at
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;      // "minus infinity" that stays finite under -ffast-math

#if FERRY_AVX512 || FERRY_AVX2
#if FERRY_AVX512
using V = ferry::F32x16;
constexpr int kLanes = 16;
constexpr int kScoreRows = 12;   // 12 accumulators (of 32 registers)
constexpr int kValueRows = 12;   // 12 x 2 accumulators
#else
using V = ferry::F32x8;
constexpr int kLanes = 8;
constexpr int kScoreRows = 6;    // 6 x 2 accumulators, the keys' 2 vectors and a broadcast: 15 of 16 registers
constexpr int kValueRows = 6;
#endif
constexpr int kKeyVectors = kKeys / kLanes;
constexpr int kValueVectors = 2;

struct Shape {
  int64_t heads, kv_heads, group, dim, padded, block_size, window;
  int64_t k_block, k_token, k_head, v_block, v_token, v_head;
  float qk_scale;
};

struct Seq {
  int64_t q_start, q_len, context;
  const int32_t* table;
};

struct Item {
  int64_t seq, kv_head, first_token, tokens, cost;
};

// The rows' scores for kKeys keys: s[r][j] = q[r] . key j, with kt the keys transposed ([dim][kKeys]).
template <int R>
inline void score_rows(const float* q, int64_t q_stride, const float* kt, int64_t dim, float* s) {
  typename V::Vec acc[R][kKeyVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = V::zero();
  for (int64_t d = 0; d < dim; ++d) {
    typename V::Vec k[kKeyVectors];
    for (int v = 0; v < kKeyVectors; ++v) k[v] = V::load(kt + d * kKeys + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const typename V::Vec b = V::set1(q[r * q_stride + d]);
      for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = V::fmadd(b, k[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kKeyVectors; ++v) V::store(s + r * kKeys + v * kLanes, acc[r][v]);
}

// o[r] = o[r] * correction[r] + sum_j p[r][j] * value j, with vp the values ([kKeys][padded]).
template <int R>
inline void accumulate_rows(const float* p, const float* correction, const float* vp, int64_t padded, float* o) {
  constexpr int64_t kChunk = kValueVectors * kLanes;
  for (int64_t c0 = 0; c0 < padded; c0 += kChunk) {
    typename V::Vec acc[R][kValueVectors];
    for (int r = 0; r < R; ++r) {
      const typename V::Vec scale = V::set1(correction[r]);
      for (int c = 0; c < kValueVectors; ++c) acc[r][c] = V::mul(V::load(o + r * padded + c0 + c * kLanes), scale);
    }
    for (int64_t j = 0; j < kKeys; ++j) {
      typename V::Vec value[kValueVectors];
      for (int c = 0; c < kValueVectors; ++c) value[c] = V::load(vp + j * padded + c0 + c * kLanes);
      for (int r = 0; r < R; ++r) {
        const typename V::Vec b = V::set1(p[r * kKeys + j]);
        for (int c = 0; c < kValueVectors; ++c) acc[r][c] = V::fmadd(b, value[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kValueVectors; ++c) V::store(o + r * padded + c0 + c * kLanes, acc[r][c]);
  }
}

void score_all(const float* q, int64_t rows, const Shape& shape, const float* kt, float* s) {
  int64_t r = 0;
  for (; r + kScoreRows <= rows; r += kScoreRows)
    score_rows<kScoreRows>(q + r * shape.padded, shape.padded, kt, shape.dim, s + r * kKeys);
  for (; r < rows; ++r) score_rows<1>(q + r * shape.padded, shape.padded, kt, shape.dim, s + r * kKeys);
}

void accumulate_all(const float* p, const float* correction, int64_t rows, const Shape& shape, const float* vp,
                    float* o) {
  int64_t r = 0;
  for (; r + kValueRows <= rows; r += kValueRows)
    accumulate_rows<kValueRows>(p + r * kKeys, correction + r, vp, shape.padded, o + r * shape.padded);
  for (; r < rows; ++r) accumulate_rows<1>(p + r * kKeys, correction + r, vp, shape.padded, o + r * shape.padded);
}

// Per-thread buffers of one item.
struct Scratch {
  std::vector<float> q, o, kt, vp, s, m, l, correction;

  void fit(int64_t rows, const Shape& shape) {
    q.resize(rows * shape.padded);
    o.resize(rows * shape.padded);
    kt.resize(shape.dim * kKeys);
    vp.resize(kKeys * shape.padded);
    s.resize(rows * kKeys);
    m.resize(rows);
    l.resize(rows);
    correction.resize(rows);
  }
};

// The keys and values of positions [first, end) of a group starting at `start` (kKeys positions), widened; the
// group's other positions are zero (never read from the pool).
template <typename T>
void load_keys(const T* k_pool, const T* v_pool, const Seq& seq, int64_t kv_head, int64_t start, int64_t first,
               int64_t end, const Shape& shape, Scratch& sc) {
  if (first > start || end < start + kKeys) {
    std::fill(sc.kt.begin(), sc.kt.end(), 0.f);
    std::fill(sc.vp.begin(), sc.vp.end(), 0.f);
  }
  for (int64_t pos = first; pos < end; ++pos) {
    const int64_t j = pos - start;
    const int64_t block = seq.table[pos / shape.block_size], offset = pos % shape.block_size;
    const T* key = k_pool + block * shape.k_block + offset * shape.k_token + kv_head * shape.k_head;
    const T* value = v_pool + block * shape.v_block + offset * shape.v_token + kv_head * shape.v_head;
    float* vrow = sc.vp.data() + j * shape.padded;
    for (int64_t d = 0; d < shape.dim; ++d) {
      sc.kt[d * kKeys + j] = static_cast<float>(key[d]);
      vrow[d] = static_cast<float>(value[d]);
    }
    std::fill(vrow + shape.dim, vrow + shape.padded, 0.f);
  }
}

// Row r's query: its position and the positions it may see, [lowest, position].
struct RowSpan {
  int64_t lowest, position;
};

inline RowSpan row_span(const Seq& seq, const Item& item, int64_t r, const Shape& shape) {
  const int64_t position = seq.context - seq.q_len + item.first_token + r / shape.group;
  const int64_t lowest = shape.window ? std::max<int64_t>(0, position - shape.window + 1) : 0;
  return {lowest, position};
}

// The running softmax of every row over the group of keys at `start`: scores masked to what each row may see,
// turned into weights (in sc.s) and the factor each row's accumulated output is to be scaled by.
void update_softmax(const Seq& seq, const Item& item, int64_t rows, int64_t start, const Shape& shape,
                    Scratch& sc) {
  for (int64_t r = 0; r < rows; ++r) {
    const RowSpan span = row_span(seq, item, r, shape);
    const int64_t lo = std::max<int64_t>(0, span.lowest - start);
    const int64_t hi = std::min<int64_t>(kKeys, span.position - start + 1);
    float* s = sc.s.data() + r * kKeys;
    if (hi <= lo) {
      std::fill(s, s + kKeys, 0.f);
      sc.correction[r] = 1.f;
      continue;
    }
    const bool whole = lo == 0 && hi == kKeys;   // most groups: fixed bounds, which the compiler vectorises
    float peak = kNegBig;
    if (whole) {
      for (int64_t j = 0; j < kKeys; ++j) peak = std::max(peak, s[j]);
    } else {
      for (int64_t j = lo; j < hi; ++j) peak = std::max(peak, s[j]);
    }
    const float m_new = std::max(sc.m[r], peak);
    const float correction = sc.m[r] == kNegBig ? 0.f : std::exp2(sc.m[r] - m_new);
    const typename V::Vec shift = V::set1(m_new);
    for (int v = 0; v < kKeyVectors; ++v)
      V::store(s + v * kLanes, ferry::exp2_of<V>(V::sub(V::load(s + v * kLanes), shift)));
    float total = 0.f;
    if (whole) {
      for (int64_t j = 0; j < kKeys; ++j) total += s[j];
    } else {
      std::fill(s, s + lo, 0.f);
      std::fill(s + hi, s + kKeys, 0.f);
      for (int64_t j = lo; j < hi; ++j) total += s[j];
    }
    sc.m[r] = m_new;
    sc.l[r] = sc.l[r] * correction + total;
    sc.correction[r] = correction;
  }
}

template <typename Q>
void read_row(const Q* row, int64_t dim, float scale, float* dst) {
  for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(row[d]) * scale;
}

template <typename Q>
void write_row(const float* values, int64_t dim, float scale, Q* row) {
  for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<Q>(values[d] * scale);
}

// fn(pointer) with the query's (or output's) data as a pointer to its element type.
template <typename Fn>
void with_rows(const torch::Tensor& tensor, Fn fn) {
  switch (tensor.scalar_type()) {
    case at::kFloat: fn(tensor.data_ptr<float>()); break;
    case at::kBFloat16: fn(tensor.data_ptr<at::BFloat16>()); break;
    case at::kHalf: fn(tensor.data_ptr<at::Half>()); break;
    default: TORCH_CHECK(false, "query must be float32, bfloat16 or float16");
  }
}

// Query row r of the item (token r / G, head kv_head * G + r % G) in its pool offset.
inline int64_t row_offset(const Seq& seq, const Item& item, int64_t r, const Shape& shape) {
  const int64_t token = seq.q_start + item.first_token + r / shape.group;
  return (token * shape.heads + item.kv_head * shape.group + r % shape.group) * shape.dim;
}

void start_item(const Seq& seq, const Item& item, int64_t rows, const Shape& shape, const torch::Tensor& query,
                Scratch& sc) {
  std::fill(sc.q.begin(), sc.q.end(), 0.f);
  std::fill(sc.o.begin(), sc.o.end(), 0.f);
  std::fill(sc.m.begin(), sc.m.end(), kNegBig);
  std::fill(sc.l.begin(), sc.l.end(), 0.f);
  with_rows(query, [&](const auto* base) {
    for (int64_t r = 0; r < rows; ++r)
      read_row(base + row_offset(seq, item, r, shape), shape.dim, shape.qk_scale, sc.q.data() + r * shape.padded);
  });
}

void finish_item(const Seq& seq, const Item& item, int64_t rows, const Shape& shape, torch::Tensor& out,
                 const Scratch& sc) {
  with_rows(out, [&](auto* base) {
    for (int64_t r = 0; r < rows; ++r) {
      const float inv = sc.l[r] > 0.f ? 1.f / sc.l[r] : 0.f;
      write_row(sc.o.data() + r * shape.padded, shape.dim, inv, base + row_offset(seq, item, r, shape));
    }
  });
}

template <typename T>
void run_item(const Seq& seq, const Item& item, const Shape& shape, const T* k_pool, const T* v_pool,
              const torch::Tensor& query, torch::Tensor& out, Scratch& sc) {
  const int64_t rows = item.tokens * shape.group;
  sc.fit(rows, shape);
  start_item(seq, item, rows, shape, query, sc);
  const int64_t lowest = row_span(seq, item, 0, shape).lowest;
  const int64_t end = row_span(seq, item, rows - 1, shape).position + 1;
  for (int64_t start = lowest / kKeys * kKeys; start < end; start += kKeys) {
    load_keys<T>(k_pool, v_pool, seq, item.kv_head, start, std::max(start, lowest), std::min(start + kKeys, end),
                 shape, sc);
    score_all(sc.q.data(), rows, shape, sc.kt.data(), sc.s.data());
    update_softmax(seq, item, rows, start, shape, sc);
    accumulate_all(sc.s.data(), sc.correction.data(), rows, shape, sc.vp.data(), sc.o.data());
  }
  finish_item(seq, item, rows, shape, out, sc);
}

std::vector<Item> plan_items(const std::vector<Seq>& seqs, const Shape& shape) {
  const int64_t tile = std::max<int64_t>(1, kTileRows / shape.group);
  std::vector<Item> items;
  for (int64_t s = 0; s < static_cast<int64_t>(seqs.size()); ++s) {
    const Seq& seq = seqs[s];
    for (int64_t first = 0; first < seq.q_len; first += tile) {
      const int64_t tokens = std::min(tile, seq.q_len - first);
      const int64_t keys = seq.context - seq.q_len + first + tokens;
      const int64_t seen = shape.window ? std::min(keys, shape.window + tokens) : keys;
      for (int64_t h = 0; h < shape.kv_heads; ++h) items.push_back({s, h, first, tokens, seen * tokens});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  return items;
}

template <typename T>
void run_items(const std::vector<Seq>& seqs, const std::vector<Item>& items, const Shape& shape,
               const torch::Tensor& k_cache, const torch::Tensor& v_cache, const torch::Tensor& query,
               torch::Tensor& out) {
  const T* k_pool = k_cache.data_ptr<T>();
  const T* v_pool = v_cache.data_ptr<T>();
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    for (int64_t w = begin; w < end; ++w)
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1))
        run_item<T>(seqs[items[i].seq], items[i], shape, k_pool, v_pool, query, out, scratch);
  });
}

Shape make_shape(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 double scale, int64_t window) {
  Shape shape;
  shape.heads = query.size(1);
  shape.kv_heads = k_cache.size(2);
  shape.group = shape.heads / shape.kv_heads;
  shape.dim = query.size(2);
  shape.padded = (shape.dim + kDimPad - 1) / kDimPad * kDimPad;
  shape.block_size = k_cache.size(1);
  shape.window = window;
  shape.k_block = k_cache.stride(0), shape.k_token = k_cache.stride(1), shape.k_head = k_cache.stride(2);
  shape.v_block = v_cache.stride(0), shape.v_token = v_cache.stride(1), shape.v_head = v_cache.stride(2);
  shape.qk_scale = static_cast<float>(scale) * kLog2e;
  return shape;
}

std::vector<Seq> read_seqs(const torch::Tensor& block_tables, const torch::Tensor& query_starts,
                           const torch::Tensor& query_lens, const torch::Tensor& context_lens, int64_t num_rows,
                           int64_t block_size) {
  const int64_t num_seqs = query_starts.numel();
  const int64_t* starts = query_starts.data_ptr<int64_t>();
  const int64_t* lens = query_lens.data_ptr<int64_t>();
  const int64_t* contexts = context_lens.data_ptr<int64_t>();
  const int64_t width = block_tables.size(1);
  std::vector<Seq> seqs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= contexts[s], "each query length must be in [1, its context length]");
    TORCH_CHECK(starts[s] >= 0 && starts[s] + lens[s] <= num_rows, "query rows out of range");
    TORCH_CHECK(contexts[s] <= width * block_size, "a context length past its block table's blocks");
    seqs.push_back({starts[s], lens[s], contexts[s], block_tables.data_ptr<int32_t>() + s * width});
  }
  return seqs;
}
#endif  // FERRY_AVX512 || FERRY_AVX2

}  // namespace

// Writes the attention of the given sequences' query rows into out (the other rows of out are left as they are).
void paged_prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                   torch::Tensor query_starts, torch::Tensor query_lens, torch::Tensor context_lens, double scale,
                   int64_t window, torch::Tensor out) {
#if FERRY_AVX512 || FERRY_AVX2
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "query [T, H, D], pools [N, B, KV, D]");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.sizes() == v_cache.sizes(),
              "K and V pools must share a dtype and a shape");
  TORCH_CHECK(out.sizes() == query.sizes() && out.scalar_type() == query.scalar_type() && out.is_contiguous(),
              "out must be a contiguous tensor like query");
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "query heads must be a multiple of KV heads, with the pool's head_dim");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  if (k_cache.stride(3) != 1) k_cache = k_cache.contiguous();
  if (v_cache.stride(3) != 1) v_cache = v_cache.contiguous();
  query = query.contiguous();
  block_tables = block_tables.to(torch::kInt32).contiguous();
  query_starts = query_starts.to(torch::kInt64).contiguous();
  query_lens = query_lens.to(torch::kInt64).contiguous();
  context_lens = context_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(block_tables.size(0) == query_starts.numel() && query_lens.numel() == query_starts.numel() &&
              context_lens.numel() == query_starts.numel(), "one table, start and length a sequence");
  const Shape shape = make_shape(query, k_cache, v_cache, scale, window);
  const std::vector<Seq> seqs = read_seqs(block_tables, query_starts, query_lens, context_lens, query.size(0),
                                             k_cache.size(1));
  const std::vector<Item> items = plan_items(seqs, shape);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_prefill", [&] {
    run_items<scalar_t>(seqs, items, shape, k_cache, v_cache, query, out);
  });
#else
  TORCH_CHECK(false, "this build has no vector path for the prefill kernel (vector_isa() is portable)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill", &paged_prefill, "paged causal attention of prefill chunks over the KV block pool (CPU)",
        py::arg("query"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_starts"),
        py::arg("query_lens"), py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("out"));
  m.def("vector_isa", &ferry::vector_isa, "the vector path compiled in: avx512, avx2 or portable");
}
