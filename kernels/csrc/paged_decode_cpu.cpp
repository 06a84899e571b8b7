// Paged decode attention on the CPU, reading K and V in place from the block pool (no gather copy).
//
// One pass over the context, flash-decoding style: the context of a sequence is cut into partitions of at most
// kPartitionTokens tokens, and one work item is one (sequence, partition), all of its KV heads. An item walks its
// blocks in order; for each block and KV head it scores the block's tokens for the G query heads sharing that KV
// head, updates a running (max, sum, weighted values) softmax state, and reads the block's values while the
// block is hot in the cache, prefetching the next block head by head meanwhile (the blocks of a sequence are scattered
// over the pool, which defeats the hardware prefetchers at block boundaries). Sequences cut into several partitions are
// merged at the end (log-sum-exp). Items are handed out dynamically to the threads, longest first.
//
// With AVX-512 (F, BW, VL) a block's scores are 16 token-wise vector FMA chains over head_dim, summed across
// lanes by one transposing reduction for the 16 tokens at once; values are accumulated with broadcast FMAs.
// head_dim is walked 32 elements at a time; a bf16 chunk is widened with a shift and a mask (even and odd
// elements), the query and output rows being kept in that permuted order. Everything accumulates in fp32 from fp32
// queries (bf16/fp16 K and V are widened on load), except that with AVX512-BF16 a bf16 query scores bf16 keys with
// vdpbf16ps (exact bf16 products summed in fp32, the scale applied to the sums). Without AVX-512 but with AVX2 (+FMA,
// F16C) the same algorithm runs on 8-lane vectors in natural element order; without either, a portable scalar
// version of it. Softmax is computed in base 2, with the query pre-multiplied by scale * log2(e).
//
// paged_decode reads as these steps: check_and_normalise, partition_work (the work items), decode_items (per item
// start_item, run_item's block loop and finish_item), merge_partitions. The two vector paths share their loops over
// query heads (heads_simd), each supplying its kernel for a group of them (group_simd, one per path).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "cpu_simd.h"
#include "simd_math.h"

#if FERRY_AVX512 && defined(__AVX512BF16__)
#define FERRY_BF16_DOT 1   // bf16 queries score bf16 keys with vdpbf16ps
#else
#define FERRY_BF16_DOT 0
#endif

namespace {

#if FERRY_AVX512 || FERRY_AVX2
using ferry::exp2_ps;
#endif

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kPartitionTokens = 512;
// How far ahead blocks are prefetched. Measured on a Zen 5 VM (batch 64 and 32, contexts 66-600): one block ahead
// reads faster than two (prefetches further ahead crowd out the loads).
constexpr int64_t kPrefetchBlocks = 1;
constexpr int64_t kGroupTokens = 16;     // tokens scored together (one AVX-512 vector of scores)
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegBig = -1e30f;        // "minus infinity" that stays finite under -ffast-math

struct Layout {
  int64_t num_heads, num_kv_heads, head_dim, padded_dim, group, block_size;
  int64_t k_block, k_token, k_head;      // strides of the K pool, in elements
  int64_t v_block, v_token, v_head;
  int64_t kv_element;                    // bytes per K/V element
  float qk_scale;                        // softmax scale * log2(e)
  bool bf16_dot;                         // bf16 query and keys: scores by vdpbf16ps from State::q_bf16
};

struct Item {
  int32_t seq, first_block, end_block, partial;   // partial: slot in the partial buffers, -1 = write the output
};

// Running softmax state of one work item: per query head a max, a sum and the unnormalised output.
struct State {
  float* m;
  float* l;
  float* acc;   // [num_heads, padded_dim]
  float* q;           // [num_heads, padded_dim], scaled, zero padded
  uint16_t* q_bf16;   // [num_heads, padded_dim]: the bf16 query as given (natural order, unscaled), when bf16_dot
};

inline float to_float(const void* base, at::ScalarType type, int64_t i) {
  switch (type) {
    case at::kFloat: return static_cast<const float*>(base)[i];
    case at::kBFloat16: return static_cast<float>(static_cast<const at::BFloat16*>(base)[i]);
    case at::kHalf: return static_cast<float>(static_cast<const at::Half*>(base)[i]);
    case at::kDouble: return static_cast<float>(static_cast<const double*>(base)[i]);
    default: TORCH_CHECK(false, "unsupported query dtype");
  }
}

inline void from_float(void* base, at::ScalarType type, int64_t i, float x) {
  switch (type) {
    case at::kFloat: static_cast<float*>(base)[i] = x; break;
    case at::kBFloat16: static_cast<at::BFloat16*>(base)[i] = static_cast<at::BFloat16>(x); break;
    case at::kHalf: static_cast<at::Half*>(base)[i] = static_cast<at::Half>(x); break;
    case at::kDouble: static_cast<double*>(base)[i] = x; break;
    default: TORCH_CHECK(false, "unsupported query dtype");
  }
}

template <typename T>
inline float widen(T x) { return static_cast<float>(x); }
template <>
inline float widen<at::BFloat16>(at::BFloat16 x) { return ferry::bf16_bits_to_float(x.x); }

inline void prefetch_rows(const char* base, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(base + r * row_stride + offset);
}

// ---------------------------------------------------------------------------------------------------------------
// Portable path: the same one-pass algorithm with scalar loops (left to the compiler to vectorise).
template <typename T>
void group_portable(const T* k, const T* v, int64_t k_token, int64_t v_token, int64_t n, const Layout& lay,
                    int64_t first_head, int64_t heads, State& st) {
  const int64_t dim = lay.head_dim;
  float scores[kGroupTokens];
  for (int64_t g = 0; g < heads; ++g) {
    const int64_t head = first_head + g;
    const float* q = st.q + head * lay.padded_dim;
    float peak = kNegBig;
    for (int64_t t = 0; t < n; ++t) {
      const T* row = k + t * k_token;
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[d] * widen<T>(row[d]);
      scores[t] = dot;
      peak = std::max(peak, dot);
    }
    const float m_new = std::max(st.m[head], peak);
    const float correction = std::exp2(st.m[head] - m_new);
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) total += (scores[t] = std::exp2(scores[t] - m_new));
    st.m[head] = m_new;
    st.l[head] = st.l[head] * correction + total;
    float* acc = st.acc + head * lay.padded_dim;
    for (int64_t d = 0; d < dim; ++d) acc[d] *= correction;
    for (int64_t t = 0; t < n; ++t) {
      const T* row = v + t * v_token;
      const float p = scores[t];
      for (int64_t d = 0; d < dim; ++d) acc[d] += p * widen<T>(row[d]);
    }
  }
}

#if FERRY_AVX512
// ---------------------------------------------------------------------------------------------------------------
// AVX-512 path. head_dim is walked in chunks of 32 elements, each widened to two fp32 vectors (a, b). For bf16
// the pair is (even elements, odd elements) of the chunk: one 64-byte load, then a shift and a mask, no lane
// crossing; the query and the accumulated output are kept in that same permuted order (see slot_in_chunk).
constexpr int64_t kSimdChunk = 32;   // head_dim elements a chunk
template <typename T>
inline void load32(const T* p, __mmask32 mask, __m512& a, __m512& b);
template <>
inline void load32<float>(const float* p, __mmask32 mask, __m512& a, __m512& b) {
  a = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask), p);
  b = _mm512_maskz_loadu_ps(static_cast<__mmask16>(mask >> 16), p + 16);
}
template <>
inline void load32<at::BFloat16>(const at::BFloat16* p, __mmask32 mask, __m512& a, __m512& b) {
  const __m512i raw = _mm512_maskz_loadu_epi16(mask, p);
  a = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  b = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
template <>
inline void load32<at::Half>(const at::Half* p, __mmask32 mask, __m512& a, __m512& b) {
  const __m512i raw = _mm512_maskz_loadu_epi16(mask, p);
  a = _mm512_cvtph_ps(_mm512_castsi512_si256(raw));
  b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(raw, 1));
}

// rows[r] holds the 16 lane-wise partial sums of row r; returns the vector of the 16 row totals, in the order
// given by kTransposeRow: row 4 * (t % 4) + t / 4 lands in lane t.
inline __m512 sum_rows16(const float* rows) {
  __m512 r[8];
  for (int j = 0; j < 8; ++j) {
    const __m512 x = _mm512_load_ps(rows + (2 * j) * 16), y = _mm512_load_ps(rows + (2 * j + 1) * 16);
    r[j] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
  }
  __m512 u[4];
  for (int j = 0; j < 4; ++j)
    u[j] = _mm512_add_ps(_mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(r[2 * j], r[2 * j + 1], 0xDD));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(u[0], u[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_ps(u[2], u[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
}
constexpr int kTransposeRow[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};

inline __mmask32 chunk_mask(int64_t chunk, int64_t chunks, int64_t tail) {
  return chunk == chunks - 1 && tail < 32 ? static_cast<__mmask32>((1u << tail) - 1u) : ~__mmask32(0);
}

// Lane-wise partial dot products of n tokens' keys with TG query heads (q: fp32, scaled, permuted), each token's
// 16 partial sums stored at its transposed row of partial[g] (see sum_rows16).
template <typename T, int TG, int CHUNKS>
inline void score_tokens(const T* k, int64_t k_token, int64_t n, const Layout& lay, const float* q,
                         float (*partial)[16 * 16]) {
  const int64_t pd = lay.padded_dim;
  const int64_t chunks = CHUNKS ? CHUNKS : pd / 32;
  const int64_t tail = lay.head_dim - (chunks - 1) * 32;
  for (int64_t t = 0; t < n; ++t) {
    const T* row = k + t * k_token;
    __m512 da[TG], db[TG];
    for (int g = 0; g < TG; ++g) da[g] = db[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      __m512 ka, kb;
      load32<T>(row + c * 32, chunk_mask(c, chunks, tail), ka, kb);
      for (int g = 0; g < TG; ++g) {
        da[g] = _mm512_fmadd_ps(_mm512_load_ps(q + g * pd + c * 32), ka, da[g]);
        db[g] = _mm512_fmadd_ps(_mm512_load_ps(q + g * pd + c * 32 + 16), kb, db[g]);
      }
    }
    for (int g = 0; g < TG; ++g) _mm512_store_ps(partial[g] + kTransposeRow[t] * 16, _mm512_add_ps(da[g], db[g]));
  }
}

#if FERRY_BF16_DOT
// One head's output row from its accumulator (bf16 SIMD order: even then odd elements of each 32) times inv:
// rounded to bf16 and put back in natural order, 32 elements at a time.
inline void store_output_bf16(const float* acc, float inv, at::BFloat16* out, int64_t head_dim) {
  static const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                     23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512 scale = _mm512_set1_ps(inv);
  for (int64_t c = 0; c * 32 < head_dim; ++c) {
    const __m512 even = _mm512_mul_ps(_mm512_load_ps(acc + c * 32), scale);
    const __m512 odd = _mm512_mul_ps(_mm512_load_ps(acc + c * 32 + 16), scale);
    const __m512i packed = _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
    const int64_t n = std::min<int64_t>(32, head_dim - c * 32);
    _mm512_mask_storeu_epi16(out + c * 32, static_cast<__mmask32>(n == 32 ? ~0u : (1u << n) - 1u), packed);
  }
}

// The same for bf16 keys and a bf16 query (q: as given, natural order): vdpbf16ps multiplies 32 bf16 pairs exactly
// and sums them in fp32, with no widening; the scale is applied to the sums. 2 instructions a token and head where
// the fp32 path spends 4 FMAs, plus 4 widening ops a token (measured: the decode kernel ~5% faster).
template <int TG, int CHUNKS>
inline void score_tokens_bf16_dot(const at::BFloat16* k, int64_t k_token, int64_t n, const Layout& lay,
                                  const uint16_t* q, float (*partial)[16 * 16]) {
  const int64_t pd = lay.padded_dim;
  const int64_t chunks = CHUNKS ? CHUNKS : pd / 32;
  const int64_t tail = lay.head_dim - (chunks - 1) * 32;
  const __m512 scale = _mm512_set1_ps(lay.qk_scale);
  for (int64_t t = 0; t < n; ++t) {
    const at::BFloat16* row = k + t * k_token;
    __m512 dot[TG];
    for (int g = 0; g < TG; ++g) dot[g] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512bh keys = (__m512bh)_mm512_maskz_loadu_epi16(chunk_mask(c, chunks, tail), row + c * 32);
      for (int g = 0; g < TG; ++g)
        dot[g] = _mm512_dpbf16_ps(dot[g], (__m512bh)_mm512_load_si512(q + g * pd + c * 32), keys);
    }
    for (int g = 0; g < TG; ++g) _mm512_store_ps(partial[g] + kTransposeRow[t] * 16, _mm512_mul_ps(dot[g], scale));
  }
}
#endif

template <typename T, int TG, int CHUNKS>
inline void score_block(const T* k, int64_t k_token, int64_t n, const Layout& lay, const State& st,
                        int64_t first_head, float (*partial)[16 * 16]) {
#if FERRY_BF16_DOT
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (lay.bf16_dot) {
      score_tokens_bf16_dot<TG, CHUNKS>(k, k_token, n, lay, st.q_bf16 + first_head * lay.padded_dim, partial);
      return;
    }
  }
#endif
  score_tokens<T, TG, CHUNKS>(k, k_token, n, lay, st.q + first_head * lay.padded_dim, partial);
}

// n (1..16) tokens of one KV head, TG query heads; CHUNKS = head_dim / 32 when fixed at compile time, else 0.
template <typename T, int TG, int CHUNKS>
void group_simd(const T* k, const T* v, int64_t k_token, int64_t v_token, int64_t n, const Layout& lay,
                int64_t first_head, State& st) {
  const int64_t pd = lay.padded_dim;
  const int64_t chunks = CHUNKS ? CHUNKS : pd / 32;
  const int64_t tail = lay.head_dim - (chunks - 1) * 32;
  alignas(64) float partial[TG][16 * 16];
  alignas(64) float probs[TG][16];

  // scores: per token, a lane-wise partial dot product per query head
  score_block<T, TG, CHUNKS>(k, k_token, n, lay, st, first_head, partial);
  for (int64_t t = n; t < 16; ++t)
    for (int g = 0; g < TG; ++g) _mm512_store_ps(partial[g] + kTransposeRow[t] * 16, _mm512_setzero_ps());
  const __mmask16 valid = static_cast<__mmask16>((1u << n) - 1u);
  alignas(64) float m_old[16] = {0}, m_new[16] = {0}, correction[16];
  float block_sum[TG];
  for (int g = 0; g < TG; ++g) {
    const int64_t head = first_head + g;
    const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegBig), sum_rows16(partial[g]));
    m_old[g] = st.m[head];
    m_new[g] = std::max(m_old[g], _mm512_reduce_max_ps(s));
    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_ps(_mm512_sub_ps(s, _mm512_set1_ps(m_new[g]))));
    st.m[head] = m_new[g];
    block_sum[g] = _mm512_reduce_add_ps(p);
    _mm512_store_ps(probs[g], p);
  }
  _mm512_store_ps(correction, exp2_ps(_mm512_sub_ps(_mm512_load_ps(m_old), _mm512_load_ps(m_new))));
  for (int g = 0; g < TG; ++g) st.l[first_head + g] = st.l[first_head + g] * correction[g] + block_sum[g];
  // values: acc = acc * correction + sum_t p_t v_t, 32 elements of head_dim at a time; even and odd tokens go
  // to separate accumulators (shorter dependency chains)
  float* acc = st.acc + first_head * pd;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask32 mask = chunk_mask(c, chunks, tail);
    __m512 oa[TG], ob[TG], ea[TG], eb[TG];
    for (int g = 0; g < TG; ++g) {
      const __m512 cg = _mm512_set1_ps(correction[g]);
      oa[g] = _mm512_mul_ps(_mm512_load_ps(acc + g * pd + c * 32), cg);
      ob[g] = _mm512_mul_ps(_mm512_load_ps(acc + g * pd + c * 32 + 16), cg);
      ea[g] = eb[g] = _mm512_setzero_ps();
    }
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      __m512 va, vb, wa, wb;
      load32<T>(v + t * v_token + c * 32, mask, va, vb);
      load32<T>(v + (t + 1) * v_token + c * 32, mask, wa, wb);
      for (int g = 0; g < TG; ++g) {
        const __m512 p0 = _mm512_set1_ps(probs[g][t]), p1 = _mm512_set1_ps(probs[g][t + 1]);
        oa[g] = _mm512_fmadd_ps(p0, va, oa[g]);
        ob[g] = _mm512_fmadd_ps(p0, vb, ob[g]);
        ea[g] = _mm512_fmadd_ps(p1, wa, ea[g]);
        eb[g] = _mm512_fmadd_ps(p1, wb, eb[g]);
      }
    }
    if (t < n) {
      __m512 va, vb;
      load32<T>(v + t * v_token + c * 32, mask, va, vb);
      for (int g = 0; g < TG; ++g) {
        const __m512 p0 = _mm512_set1_ps(probs[g][t]);
        oa[g] = _mm512_fmadd_ps(p0, va, oa[g]);
        ob[g] = _mm512_fmadd_ps(p0, vb, ob[g]);
      }
    }
    for (int g = 0; g < TG; ++g) {
      _mm512_store_ps(acc + g * pd + c * 32, _mm512_add_ps(oa[g], ea[g]));
      _mm512_store_ps(acc + g * pd + c * 32 + 16, _mm512_add_ps(ob[g], eb[g]));
    }
  }
}
#endif  // FERRY_AVX512

#if FERRY_AVX2
// ---------------------------------------------------------------------------------------------------------------
// AVX2 path (+FMA, F16C): the same one-pass algorithm with 8-lane vectors, head_dim a multiple of 8, in natural
// element order (a bf16 chunk of 8 is widened in place). A block's scores are per token two FMA chains over
// head_dim, then 8 tokens' lane sums are reduced at once by a horizontal-add transpose.
constexpr int64_t kSimdChunk = 8;   // head_dim elements a chunk
template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) { return _mm256_loadu_ps(p); }
template <>
inline __m256 load8<at::BFloat16>(const at::BFloat16* p) {
  return ferry::load8_bf16(reinterpret_cast<const uint16_t*>(p));
}
template <>
inline __m256 load8<at::Half>(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// rows[j] holds the 8 lane-wise partial sums of token j: returns the 8 token totals, in token order.
inline __m256 sum_rows8(const __m256* rows) {
  const __m256 r01 = _mm256_hadd_ps(rows[0], rows[1]), r23 = _mm256_hadd_ps(rows[2], rows[3]);
  const __m256 r45 = _mm256_hadd_ps(rows[4], rows[5]), r67 = _mm256_hadd_ps(rows[6], rows[7]);
  const __m256 low = _mm256_hadd_ps(r01, r23), high = _mm256_hadd_ps(r45, r67);
  return _mm256_add_ps(_mm256_permute2f128_ps(low, high, 0x20), _mm256_permute2f128_ps(low, high, 0x31));
}

inline float reduce_max8(__m256 x) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

inline float reduce_add8(__m256 x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}

// Scores of n (1..16) tokens' keys against TG query heads (q: fp32, scaled), in exp2 units, into scores[g][t];
// tokens n..15 get kNegBig.
template <typename T, int TG, int CHUNKS>
inline void score_tokens_avx2(const T* k, int64_t k_token, int64_t n, const Layout& lay, const float* q,
                              float (*scores)[16]) {
  const int64_t pd = lay.padded_dim;
  const int64_t chunks = CHUNKS ? CHUNKS : lay.head_dim / 8;
  const int64_t halves = n > 8 ? 2 : 1;
  for (int64_t t0 = 0; t0 < halves * 8; t0 += 8) {
    __m256 lanes[TG][8];
    for (int64_t j = 0; j < 8; ++j) {
      __m256 da[TG], db[TG];
      for (int g = 0; g < TG; ++g) da[g] = db[g] = _mm256_setzero_ps();
      const T* row = k + std::min(t0 + j, n - 1) * k_token;   // past n: a valid row, masked below
      int64_t c = 0;
      for (; c + 1 < chunks; c += 2) {
        const __m256 ka = load8<T>(row + c * 8), kb = load8<T>(row + c * 8 + 8);
        for (int g = 0; g < TG; ++g) {
          da[g] = _mm256_fmadd_ps(_mm256_load_ps(q + g * pd + c * 8), ka, da[g]);
          db[g] = _mm256_fmadd_ps(_mm256_load_ps(q + g * pd + c * 8 + 8), kb, db[g]);
        }
      }
      if (c < chunks) {
        const __m256 ka = load8<T>(row + c * 8);
        for (int g = 0; g < TG; ++g) da[g] = _mm256_fmadd_ps(_mm256_load_ps(q + g * pd + c * 8), ka, da[g]);
      }
      for (int g = 0; g < TG; ++g) lanes[g][j] = _mm256_add_ps(da[g], db[g]);
    }
    const __m256i index = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(t0));
    const __m256 valid = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), index));
    for (int g = 0; g < TG; ++g)
      _mm256_store_ps(scores[g] + t0, _mm256_blendv_ps(_mm256_set1_ps(kNegBig), sum_rows8(lanes[g]), valid));
  }
  if (halves == 1)
    for (int g = 0; g < TG; ++g) _mm256_store_ps(scores[g] + 8, _mm256_set1_ps(kNegBig));
}

// n (1..16) tokens of one KV head, TG query heads; CHUNKS = head_dim / 8 when fixed at compile time, else 0.
template <typename T, int TG, int CHUNKS>
void group_simd(const T* k, const T* v, int64_t k_token, int64_t v_token, int64_t n, const Layout& lay,
                int64_t first_head, State& st) {
  const int64_t pd = lay.padded_dim;
  const int64_t chunks = CHUNKS ? CHUNKS : lay.head_dim / 8;
  alignas(32) float probs[TG][16];
  score_tokens_avx2<T, TG, CHUNKS>(k, k_token, n, lay, st.q + first_head * pd, probs);
  float correction[TG];
  for (int g = 0; g < TG; ++g) {
    const int64_t head = first_head + g;
    const __m256 s0 = _mm256_load_ps(probs[g]), s1 = _mm256_load_ps(probs[g] + 8);
    const float m_new = std::max(st.m[head], reduce_max8(_mm256_max_ps(s0, s1)));
    const __m256 m = _mm256_set1_ps(m_new);
    // tokens past n score kNegBig: exp2 clamps them to 2^-126 times the polynomial, so they are zeroed here
    const __m256 p0 = exp2_ps(_mm256_sub_ps(s0, m)), p1 = exp2_ps(_mm256_sub_ps(s1, m));
    const __m256 keep0 = _mm256_cmp_ps(s0, _mm256_set1_ps(kNegBig), _CMP_GT_OQ);
    const __m256 keep1 = _mm256_cmp_ps(s1, _mm256_set1_ps(kNegBig), _CMP_GT_OQ);
    _mm256_store_ps(probs[g], _mm256_and_ps(p0, keep0));
    _mm256_store_ps(probs[g] + 8, _mm256_and_ps(p1, keep1));
    correction[g] = std::exp2(st.m[head] - m_new);
    st.m[head] = m_new;
    st.l[head] = st.l[head] * correction[g] +
                 reduce_add8(_mm256_add_ps(_mm256_load_ps(probs[g]), _mm256_load_ps(probs[g] + 8)));
  }
  // values: acc = acc * correction + sum_t p_t v_t, 8 elements of head_dim at a time; even and odd tokens go to
  // separate accumulators (shorter dependency chains)
  float* acc = st.acc + first_head * pd;
  for (int64_t c = 0; c < chunks; ++c) {
    __m256 odd[TG], even[TG];
    for (int g = 0; g < TG; ++g) {
      odd[g] = _mm256_mul_ps(_mm256_load_ps(acc + g * pd + c * 8), _mm256_set1_ps(correction[g]));
      even[g] = _mm256_setzero_ps();
    }
    int64_t t = 0;
    for (; t + 1 < n; t += 2) {
      const __m256 va = load8<T>(v + t * v_token + c * 8), vb = load8<T>(v + (t + 1) * v_token + c * 8);
      for (int g = 0; g < TG; ++g) {
        odd[g] = _mm256_fmadd_ps(_mm256_set1_ps(probs[g][t]), va, odd[g]);
        even[g] = _mm256_fmadd_ps(_mm256_set1_ps(probs[g][t + 1]), vb, even[g]);
      }
    }
    if (t < n) {
      const __m256 va = load8<T>(v + t * v_token + c * 8);
      for (int g = 0; g < TG; ++g) odd[g] = _mm256_fmadd_ps(_mm256_set1_ps(probs[g][t]), va, odd[g]);
    }
    for (int g = 0; g < TG; ++g) _mm256_store_ps(acc + g * pd + c * 8, _mm256_add_ps(odd[g], even[g]));
  }
}
#endif  // FERRY_AVX2

template <typename T>
using HeadsFn = void (*)(const T*, const T*, int64_t, int64_t, int64_t, const Layout&, int64_t, State&);

template <typename T>
void heads_portable(const T* k, const T* v, int64_t k_token, int64_t v_token, int64_t n, const Layout& lay,
                    int64_t first_head, State& st) {
  group_portable<T>(k, v, k_token, v_token, n, lay, first_head, lay.group, st);
}

#if FERRY_AVX512 || FERRY_AVX2
// One block's n tokens of one KV head for its lay.group query heads, the build's group_simd (AVX-512's or AVX2's)
// taking up to four at a time.
template <typename T, int CHUNKS>
void heads_simd(const T* k, const T* v, int64_t k_token, int64_t v_token, int64_t n, const Layout& lay,
                int64_t first_head, State& st) {
  for (int64_t g = 0; g < lay.group; g += 4) {
    switch (std::min<int64_t>(4, lay.group - g)) {
      case 1: group_simd<T, 1, CHUNKS>(k, v, k_token, v_token, n, lay, first_head + g, st); break;
      case 2: group_simd<T, 2, CHUNKS>(k, v, k_token, v_token, n, lay, first_head + g, st); break;
      case 3: group_simd<T, 3, CHUNKS>(k, v, k_token, v_token, n, lay, first_head + g, st); break;
      default: group_simd<T, 4, CHUNKS>(k, v, k_token, v_token, n, lay, first_head + g, st); break;
    }
  }
}

// The common head_dims get their chunk count fixed at compile time.
template <typename T>
HeadsFn<T> pick_simd_heads(const Layout& lay) {
  if (lay.head_dim == 64) return heads_simd<T, 64 / kSimdChunk>;
  if (lay.head_dim == 128) return heads_simd<T, 128 / kSimdChunk>;
  return heads_simd<T, 0>;
}
#endif

template <typename T>
HeadsFn<T> pick_heads(const Layout& lay, bool portable) {
#if FERRY_AVX512
  if (!portable) return pick_simd_heads<T>(lay);
#elif FERRY_AVX2
  if (!portable && lay.head_dim % kSimdChunk == 0) return pick_simd_heads<T>(lay);
#endif
  (void)lay;
  (void)portable;
  return heads_portable<T>;
}
#if FERRY_AVX512 || FERRY_AVX2
template <>
HeadsFn<double> pick_heads<double>(const Layout&, bool) { return heads_portable<double>; }
#endif

// One work item: blocks [first_block, end_block) of one sequence, every head, from token `start` of the sequence
// on (a sliding window: the tokens before it in its first block are skipped, the blocks before it never read).
// The next block is prefetched one KV head at a time, its keys just before and its values just after the same head
// of the current block is computed:
// spread out like this the prefetches overlap the arithmetic, where one burst for the whole next block stalls on
// the core's miss buffers (measured: 1.7 → 0.9 ms per layer at batch 64, contexts 66-600).
template <typename T>
void run_item(const Item& item, HeadsFn<T> heads, const T* k_pool, const T* v_pool, const int32_t* table,
              int64_t context_len, int64_t start, const Layout& lay, State& st) {
  const int64_t bs = lay.block_size;
  const int64_t head_bytes = lay.head_dim * lay.kv_element;
  for (int64_t b = item.first_block; b < item.end_block; ++b) {
    const bool ahead = b + kPrefetchBlocks < item.end_block;
    const int64_t next = ahead ? table[b + kPrefetchBlocks] : 0;
    const int64_t next_rows = ahead ? std::min(bs, context_len - (b + kPrefetchBlocks) * bs) : 0;
    const int64_t block = table[b];
    const int64_t in_block = std::min(bs, context_len - b * bs);
    const int64_t first_token = std::max<int64_t>(0, start - b * bs);
    for (int64_t t0 = first_token; t0 < in_block; t0 += kGroupTokens) {
      const int64_t n = std::min(kGroupTokens, in_block - t0);
      for (int64_t h = 0; h < lay.num_kv_heads; ++h) {
        if (t0 == first_token)
          prefetch_rows(reinterpret_cast<const char*>(k_pool + next * lay.k_block + h * lay.k_head), next_rows,
                        lay.k_token * lay.kv_element, head_bytes);
        const T* k = k_pool + block * lay.k_block + t0 * lay.k_token + h * lay.k_head;
        const T* v = v_pool + block * lay.v_block + t0 * lay.v_token + h * lay.v_head;
        heads(k, v, lay.k_token, lay.v_token, n, lay, h * lay.group, st);
        if (t0 == first_token)
          prefetch_rows(reinterpret_cast<const char*>(v_pool + next * lay.v_block + h * lay.v_head), next_rows,
                        lay.v_token * lay.kv_element, head_bytes);
      }
    }
  }
}

// Per-thread scratch, reused across calls.
struct Scratch {
  std::vector<float> buffer;
  State state(const Layout& lay) {
    const size_t per_head = static_cast<size_t>(lay.padded_dim);
    // q, acc, m and l in fp32, then q_bf16 (half a float per element), each part 64-byte aligned
    const size_t need = static_cast<size_t>(lay.num_heads) * (2 * per_head + 2 + per_head / 2) + 32;
    if (buffer.size() < need) buffer.assign(need, 0.f);
    float* base = buffer.data();
    base += (16 - (reinterpret_cast<uintptr_t>(base) / sizeof(float)) % 16) % 16;   // 64-byte aligned
    State st;
    st.q = base;
    st.acc = st.q + lay.num_heads * per_head;
    st.m = st.acc + lay.num_heads * per_head;
    st.l = st.m + lay.num_heads;
    float* rest = st.l + lay.num_heads;
    rest += (16 - (reinterpret_cast<uintptr_t>(rest) / sizeof(float)) % 16) % 16;
    st.q_bf16 = reinterpret_cast<uint16_t*>(rest);
    return st;
  }
};

// The sequences' context lengths, and the first token each one's window lets it see (0: the whole context).
struct Contexts {
  std::vector<int64_t> lens, starts;
};

// The work items, longest first, and per sequence cut into several partitions their slots in the partial buffers.
struct WorkPlan {
  std::vector<Item> items;
  std::vector<int64_t> first_partial, num_parts;
  int64_t num_partials = 0;
};

// The partitions' results: [num_partials, num_heads, head_dim] unnormalised outputs, then (max, sum) per head.
struct Partials {
  float* acc;
  float* ml;
};

// Where the queries are read and the outputs written.
struct QueryIO {
  const void* q;
  void* out;
  at::ScalarType type;
  bool in_pool_dtype;          // the output has the pool's dtype: written with no per-element dtype switch
  std::vector<int64_t> slot;   // where element d of a head lives in the kernel's query and output rows
};

// Checks the arguments and converts only what the kernel cannot read as it is.
void check_and_normalise(torch::Tensor& query, torch::Tensor& k_cache, torch::Tensor& v_cache,
                         torch::Tensor& block_tables, torch::Tensor& context_lens, int64_t window) {
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "query [S, H, D], pools [N, B, KV, D]");
  TORCH_CHECK(query.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V pools must share a dtype");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "K and V pools must have the same shape");
  if (k_cache.stride(3) != 1) k_cache = k_cache.contiguous();
  if (v_cache.stride(3) != 1) v_cache = v_cache.contiguous();
  if (!query.is_contiguous()) query = query.contiguous();
  if (block_tables.scalar_type() != torch::kInt32) block_tables = block_tables.to(torch::kInt32);
  if (!block_tables.is_contiguous()) block_tables = block_tables.contiguous();
  if (context_lens.scalar_type() != torch::kInt64 && context_lens.scalar_type() != torch::kInt32)
    context_lens = context_lens.to(torch::kInt64);
  context_lens = context_lens.contiguous();

  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(head_dim == k_cache.size(3), "query and pool head_dim differ");
  TORCH_CHECK(head_dim >= 1 && head_dim <= kMaxHeadDim, "head_dim above ", kMaxHeadDim, " is not supported");
  TORCH_CHECK(num_heads % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.size(0) >= num_seqs && context_lens.numel() >= num_seqs, "one table and length a sequence");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
}

Layout make_layout(const torch::Tensor& query, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                   double scale, bool portable) {
  Layout lay;
  lay.num_heads = query.size(1);
  lay.num_kv_heads = k_cache.size(2);
  lay.head_dim = query.size(2);
  lay.padded_dim = (lay.head_dim + 31) / 32 * 32;
  lay.group = lay.num_heads / lay.num_kv_heads;
  lay.block_size = k_cache.size(1);
  lay.k_block = k_cache.stride(0), lay.k_token = k_cache.stride(1), lay.k_head = k_cache.stride(2);
  lay.v_block = v_cache.stride(0), lay.v_token = v_cache.stride(1), lay.v_head = v_cache.stride(2);
  lay.kv_element = k_cache.element_size();
  lay.qk_scale = static_cast<float>(scale) * kLog2e;
  lay.bf16_dot = FERRY_BF16_DOT && !portable && query.scalar_type() == torch::kBFloat16 &&
                 k_cache.scalar_type() == torch::kBFloat16;
  return lay;
}

Contexts read_contexts(const torch::Tensor& context_lens, int64_t num_seqs, int64_t table_width, int64_t block_size,
                       int64_t window) {
  Contexts contexts{std::vector<int64_t>(num_seqs), std::vector<int64_t>(num_seqs, 0)};
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t len = context_lens.scalar_type() == torch::kInt64 ? context_lens.data_ptr<int64_t>()[s]
                                                                    : context_lens.data_ptr<int32_t>()[s];
    TORCH_CHECK(len >= 0 && len <= table_width * block_size, "context longer than its block table");
    contexts.lens[s] = len;
    if (window > 0) contexts.starts[s] = std::max<int64_t>(0, len - window);
  }
  return contexts;
}

// Cuts each sequence's blocks, from its window's first on, into work items of at most kPartitionTokens tokens
// (whole blocks); the items of a sequence cut into several get consecutive slots in the partial buffers.
WorkPlan partition_work(const Contexts& contexts, int64_t block_size) {
  const int64_t num_seqs = static_cast<int64_t>(contexts.lens.size());
  const int64_t part_blocks = std::max<int64_t>(1, kPartitionTokens / block_size);
  WorkPlan plan{{}, std::vector<int64_t>(num_seqs, -1), std::vector<int64_t>(num_seqs, 0), 0};
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t blocks = (contexts.lens[s] + block_size - 1) / block_size;
    const int64_t first = contexts.starts[s] / block_size;
    const int64_t parts = std::max<int64_t>(1, (blocks - first + part_blocks - 1) / part_blocks);
    plan.num_parts[s] = parts;
    if (parts > 1) plan.first_partial[s] = plan.num_partials;
    for (int64_t p = 0; p < parts; ++p) {
      const int64_t begin = first + p * part_blocks, end = std::min(blocks, begin + part_blocks);
      plan.items.push_back({static_cast<int32_t>(s), static_cast<int32_t>(begin), static_cast<int32_t>(end),
                            static_cast<int32_t>(parts > 1 ? plan.num_partials + p : -1)});
    }
    if (parts > 1) plan.num_partials += parts;
  }
  std::stable_sort(plan.items.begin(), plan.items.end(), [](const Item& a, const Item& b) {
    return a.end_block - a.first_block > b.end_block - b.first_block;
  });
  return plan;
}

// The partial buffers, kept by the calling thread across calls (no page faults every call).
Partials partial_buffers(int64_t num_partials, const Layout& lay) {
  thread_local std::vector<float> buffer;
  const int64_t heads = num_partials * lay.num_heads;
  buffer.resize(std::max(buffer.size(), static_cast<size_t>(heads * (lay.head_dim + 2))));
  return {buffer.data(), buffer.data() + heads * lay.head_dim};
}

// On the AVX-512 path a bf16 head's elements are kept as the even then the odd ones of each 32 (see load32).
QueryIO query_io(const torch::Tensor& query, const torch::Tensor& k_cache, torch::Tensor& out, bool portable) {
  const bool simd = FERRY_AVX512 && !portable && k_cache.scalar_type() != torch::kDouble;
  const bool even_then_odd = simd && k_cache.scalar_type() == torch::kBFloat16;
  const int64_t head_dim = query.size(2);
  QueryIO io{query.data_ptr(), out.data_ptr(), query.scalar_type(), query.scalar_type() == k_cache.scalar_type(),
             std::vector<int64_t>(head_dim)};
  for (int64_t d = 0; d < head_dim; ++d) io.slot[d] = even_then_odd ? d / 32 * 32 + (d % 2) * 16 + d % 32 / 2 : d;
  return io;
}

// Every head of sequence s: its query loaded (scaled, zero padded, in the kernel's element order), its running
// softmax reset.
void start_item(int64_t s, const Layout& lay, const QueryIO& io, State& st) {
  const int64_t* slot = io.slot.data();
  for (int64_t h = 0; h < lay.num_heads; ++h) {
    const int64_t q_offset = (s * lay.num_heads + h) * lay.head_dim;
    if (lay.bf16_dot) {   // the only query the scores read
      uint16_t* q_bf16 = st.q_bf16 + h * lay.padded_dim;
      std::fill(q_bf16 + lay.head_dim, q_bf16 + lay.padded_dim, uint16_t{0});
      std::memcpy(q_bf16, static_cast<const at::BFloat16*>(io.q) + q_offset, lay.head_dim * sizeof(uint16_t));
    } else {
      float* q = st.q + h * lay.padded_dim;
      std::fill(q, q + lay.padded_dim, 0.f);
      for (int64_t d = 0; d < lay.head_dim; ++d) q[slot[d]] = to_float(io.q, io.type, q_offset + d) * lay.qk_scale;
    }
    std::fill(st.acc + h * lay.padded_dim, st.acc + (h + 1) * lay.padded_dim, 0.f);
    st.m[h] = kNegBig;
    st.l[h] = 0.f;
  }
}

// One head's normalised output row, from its accumulator times inv = 1 / sum.
template <typename T>
void write_output(const float* acc, float inv, int64_t o_offset, const Layout& lay, const QueryIO& io) {
#if FERRY_BF16_DOT
  if (lay.bf16_dot) {
    store_output_bf16(acc, inv, static_cast<at::BFloat16*>(io.out) + o_offset, lay.head_dim);
    return;
  }
#endif
  const int64_t* slot = io.slot.data();
  if (io.in_pool_dtype) {
    T* o = static_cast<T*>(io.out) + o_offset;
    for (int64_t d = 0; d < lay.head_dim; ++d) o[d] = static_cast<T>(acc[slot[d]] * inv);
  } else {
    for (int64_t d = 0; d < lay.head_dim; ++d) from_float(io.out, io.type, o_offset + d, acc[slot[d]] * inv);
  }
}

// An item's result: the output when it covers its whole sequence, else its partial state for the merge.
template <typename T>
void finish_item(const Item& item, const Layout& lay, const QueryIO& io, const State& st, const Partials& partials) {
  const int64_t* slot = io.slot.data();
  for (int64_t h = 0; h < lay.num_heads; ++h) {
    const float* acc = st.acc + h * lay.padded_dim;
    if (item.partial < 0) {
      const float inv = st.l[h] > 0.f ? 1.f / st.l[h] : 0.f;
      write_output<T>(acc, inv, (item.seq * lay.num_heads + h) * lay.head_dim, lay, io);
      continue;
    }
    const int64_t row = item.partial * lay.num_heads + h;
    float* dst = partials.acc + row * lay.head_dim;
    for (int64_t d = 0; d < lay.head_dim; ++d) dst[d] = acc[slot[d]];
    partials.ml[2 * row] = st.m[h];
    partials.ml[2 * row + 1] = st.l[h];
  }
}

// The threads take the items one by one, longest first, each into its own scratch state.
template <typename T>
void decode_items(const WorkPlan& plan, const Contexts& contexts, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables, const Layout& lay,
                  const QueryIO& io, const Partials& partials, bool portable) {
  const T* k_pool = k_cache.data_ptr<T>();
  const T* v_pool = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const HeadsFn<T> heads = pick_heads<T>(lay, portable);
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    thread_local Scratch scratch;
    State st = scratch.state(lay);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
        const Item& item = plan.items[i];
        const int64_t s = item.seq;
        start_item(s, lay, io, st);
        run_item<T>(item, heads, k_pool, v_pool, tables + s * table_stride, contexts.lens[s], contexts.starts[s],
                    lay, st);
        finish_item<T>(item, lay, io, st, partials);
      }
    }
  });
}

// One head of a sequence cut into `parts` partitions: their outputs, weighted by 2^(max - the largest max), summed
// into merged; returns the sum of their weighted sums.
float merge_head(int64_t first_partial, int64_t parts, int64_t h, const Layout& lay, const Partials& partials,
                 float* merged) {
  float peak = kNegBig;
  for (int64_t p = 0; p < parts; ++p)
    peak = std::max(peak, partials.ml[2 * ((first_partial + p) * lay.num_heads + h)]);
  std::fill(merged, merged + lay.head_dim, 0.f);
  float total = 0.f;
  for (int64_t p = 0; p < parts; ++p) {
    const int64_t row = (first_partial + p) * lay.num_heads + h;
    const float weight = std::exp2(partials.ml[2 * row] - peak);
    total += weight * partials.ml[2 * row + 1];
    const float* acc = partials.acc + row * lay.head_dim;
    for (int64_t d = 0; d < lay.head_dim; ++d) merged[d] += weight * acc[d];
  }
  return total;
}

// The outputs of the sequences cut into several partitions (log-sum-exp of the partitions' states).
void merge_partitions(const WorkPlan& plan, const Layout& lay, const Partials& partials, const QueryIO& io) {
  const int64_t num_seqs = static_cast<int64_t>(plan.num_parts.size());
  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(lay.head_dim);
    for (int64_t s = begin; s < end; ++s) {
      if (plan.num_parts[s] < 2) continue;
      for (int64_t h = 0; h < lay.num_heads; ++h) {
        const float total = merge_head(plan.first_partial[s], plan.num_parts[s], h, lay, partials, merged.data());
        const float inv = total > 0.f ? 1.f / total : 0.f;
        const int64_t o_offset = (s * lay.num_heads + h) * lay.head_dim;
        for (int64_t d = 0; d < lay.head_dim; ++d) from_float(io.out, io.type, o_offset + d, merged[d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale, bool portable,
                           int64_t window) {
  check_and_normalise(query, k_cache, v_cache, block_tables, context_lens, window);
  const Layout lay = make_layout(query, k_cache, v_cache, scale, portable);
  const int64_t num_seqs = query.size(0);
  const Contexts contexts = read_contexts(context_lens, num_seqs, block_tables.size(1), lay.block_size, window);
  const WorkPlan plan = partition_work(contexts, lay.block_size);
  const Partials partials = partial_buffers(plan.num_partials, lay);
  auto out = torch::empty({num_seqs, lay.num_heads, lay.head_dim}, query.options());
  const QueryIO io = query_io(query, k_cache, out, portable);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode", [&] {
    decode_items<scalar_t>(plan, contexts, k_cache, v_cache, block_tables, lay, io, partials, portable);
  });
  if (plan.num_partials > 0) merge_partitions(plan, lay, partials, io);
  return out;
}

// Back [address, address + bytes) with 2 MiB pages where the kernel allows it (whole huge pages inside the range
// only). Blocks are read in random order, so with 4 KiB pages nearly every block costs TLB misses (page walks are
// dear in a VM). MADV_HUGEPAGE covers future faults, MADV_COLLAPSE (Linux 6.1+) converts pages already there.
// Returns the bytes advised, 0 when nothing could be done; never fails.
int64_t advise_huge_pages(int64_t address, int64_t bytes) {
#ifdef __linux__
  constexpr uintptr_t kHuge = 2u << 20;
  const uintptr_t begin = (static_cast<uintptr_t>(address) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (static_cast<uintptr_t>(address) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end <= begin) return 0;
  void* start = reinterpret_cast<void*>(begin);
  if (madvise(start, end - begin, MADV_HUGEPAGE) != 0) return 0;
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25
#endif
  madvise(start, end - begin, MADV_COLLAPSE);   // best effort: khugepaged gets there eventually otherwise
  return static_cast<int64_t>(end - begin);
#else
  (void)address;
  (void)bytes;
  return 0;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention over the KV block pool (CPU)", py::arg("query"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("portable") = false, py::arg("window") = 0);
  m.def("vector_isa", &ferry::vector_isa, "the vector path compiled in: avx512, avx2 or portable");
  m.def("advise_huge_pages", &advise_huge_pages, "back a memory range with huge pages (best effort)");
}
