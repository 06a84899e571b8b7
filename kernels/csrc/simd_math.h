// The vector math both CPU extensions use, defined once for AVX-512 and AVX2: the arithmetic of one vector type
// (F32x16, F32x8), e^x and 2^x written once against it, and the widening load of 8 bf16 values. Each extension
// compiles these with its own flags (the decode with -ffast-math, the layer ops with contraction off); the
// intrinsics fix the arithmetic either way.
#pragma once

#include <cstdint>

#include "cpu_simd.h"

namespace ferry {

#if FERRY_AVX512 || FERRY_AVX2
// The operations AVX-512 and AVX2 spell alike but for their prefix (_mm512, _mm256), on vectors of type VEC.
#define FERRY_VECTOR_OPS(VEC, PREFIX)                                                       \
  using Vec = VEC;                                                                          \
  static Vec set1(float x) { return PREFIX##_set1_ps(x); }                                  \
  static Vec zero() { return PREFIX##_setzero_ps(); }                                       \
  static Vec add(Vec a, Vec b) { return PREFIX##_add_ps(a, b); }                            \
  static Vec sub(Vec a, Vec b) { return PREFIX##_sub_ps(a, b); }                            \
  static Vec mul(Vec a, Vec b) { return PREFIX##_mul_ps(a, b); }                            \
  static Vec div(Vec a, Vec b) { return PREFIX##_div_ps(a, b); }                            \
  static Vec min(Vec a, Vec b) { return PREFIX##_min_ps(a, b); }                            \
  static Vec max(Vec a, Vec b) { return PREFIX##_max_ps(a, b); }                            \
  static Vec fmadd(Vec a, Vec b, Vec c) { return PREFIX##_fmadd_ps(a, b, c); }   /* a b + c */ \
  static Vec fnmadd(Vec a, Vec b, Vec c) { return PREFIX##_fnmadd_ps(a, b, c); } /* c - a b */ \
  static Vec load(const float* p) { return PREFIX##_loadu_ps(p); }                         \
  static void store(float* p, Vec a) { PREFIX##_storeu_ps(p, a); }
#endif

#if FERRY_AVX512
struct F32x16 {
  FERRY_VECTOR_OPS(__m512, _mm512)
  static Vec round(Vec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y * 2^n for whole n, rounded once
  static Vec scale(Vec y, Vec n) { return _mm512_scalef_ps(y, n); }
  static Vec scale_normal(Vec y, Vec n) { return _mm512_scalef_ps(y, n); }
};
#endif  // FERRY_AVX512

#if FERRY_AVX2
struct F32x8 {
  FERRY_VECTOR_OPS(__m256, _mm256)
  static Vec round(Vec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y * 2^n for whole n in [-150, 128], as two exact power-of-two products (scalef's single rounding: the first
  // product stays in the normal range, only the second can round)
  static Vec scale(Vec y, Vec n) {
    const __m256i whole = _mm256_cvtps_epi32(n);
    const __m256i first = _mm256_srai_epi32(whole, 1), second = _mm256_sub_epi32(whole, first);
    return _mm256_mul_ps(_mm256_mul_ps(y, pow2(first)), pow2(second));
  }
  // y * 2^n for whole n in [-126, 127], where 2^n is a normal float: one product
  static Vec scale_normal(Vec y, Vec n) { return _mm256_mul_ps(y, pow2(_mm256_cvtps_epi32(n))); }
  // 2^n for whole n in [-126, 127], built in the exponent bits
  static Vec pow2(__m256i n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23));
  }
};

// 8 bf16 values (their bits) widened to fp32: each is the top half of its float.
inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
#endif  // FERRY_AVX2

#if FERRY_AVX512 || FERRY_AVX2
#undef FERRY_VECTOR_OPS

// e^x to about 1 ulp (Cephes' expf: Cody-Waite reduction by ln 2, degree-5 polynomial); overflows to inf and
// underflows to 0 as expf does.
template <typename V>
inline typename V::Vec exp_of(typename V::Vec x) {
  x = V::min(V::max(x, V::set1(-104.f)), V::set1(89.f));
  const typename V::Vec n = V::round(V::mul(x, V::set1(1.44269504088896341f)));
  typename V::Vec r = V::fnmadd(n, V::set1(0.693359375f), x);
  r = V::fnmadd(n, V::set1(-2.12194440e-4f), r);
  typename V::Vec p = V::set1(1.9875691500e-4f);
  p = V::fmadd(p, r, V::set1(1.3981999507e-3f));
  p = V::fmadd(p, r, V::set1(8.3334519073e-3f));
  p = V::fmadd(p, r, V::set1(4.1665795894e-2f));
  p = V::fmadd(p, r, V::set1(1.6666665459e-1f));
  p = V::fmadd(p, r, V::set1(5.0000001201e-1f));
  return V::scale(V::add(V::fmadd(p, V::mul(r, r), r), V::set1(1.f)), n);
}

// 2^x for -126 <= x <= 0 (smaller x is clamped): 2^round(x) times a polynomial of the fraction.
template <typename V>
inline typename V::Vec exp2_of(typename V::Vec x) {
  x = V::max(x, V::set1(-126.f));
  const typename V::Vec n = V::round(x);
  const typename V::Vec f = V::sub(x, n);   // [-0.5, 0.5]
  typename V::Vec p = V::set1(1.525273380405984e-05f);   // Taylor series of e^(f ln 2), error < 1e-8
  p = V::fmadd(p, f, V::set1(1.5403530393381608e-04f));
  p = V::fmadd(p, f, V::set1(1.3333558146428443e-03f));
  p = V::fmadd(p, f, V::set1(9.618129107628477e-03f));
  p = V::fmadd(p, f, V::set1(5.550410866482158e-02f));
  p = V::fmadd(p, f, V::set1(2.402265069591007e-01f));
  p = V::fmadd(p, f, V::set1(6.931471805599453e-01f));
  p = V::fmadd(p, f, V::set1(1.f));
  return V::scale_normal(p, n);
}
#endif

#if FERRY_AVX512
inline __m512 exp_ps(__m512 x) { return exp_of<F32x16>(x); }
inline __m512 exp2_ps(__m512 x) { return exp2_of<F32x16>(x); }
#endif
#if FERRY_AVX2
inline __m256 exp_ps(__m256 x) { return exp_of<F32x8>(x); }
inline __m256 exp2_ps(__m256 x) { return exp2_of<F32x8>(x); }
#endif

}  // namespace ferry
