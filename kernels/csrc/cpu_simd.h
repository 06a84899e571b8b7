// What Ferry's CPU extensions share: which vector extensions the build targets (AVX-512, else AVX2), and bf16's
// bit layout.
#pragma once

#include <cstdint>
#include <cstring>

// FERRY_PORTABLE: build the scalar paths only (tests of them on machines with vector extensions)
#if !defined(FERRY_PORTABLE) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FERRY_AVX512 1
#include <immintrin.h>
#else
#define FERRY_AVX512 0
#endif

// AVX2 with FMA and F16C (x86-64-v3): the vector paths of machines without AVX-512
#if !defined(FERRY_PORTABLE) && !FERRY_AVX512 && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FERRY_AVX2 1
#include <immintrin.h>
#else
#define FERRY_AVX2 0
#endif

namespace ferry {

// The vector path this build compiled in, as the worker's start line and metrics name it.
inline const char* vector_isa() { return FERRY_AVX512 ? "avx512" : FERRY_AVX2 ? "avx2" : "portable"; }

// bf16 is the top half of an fp32: widening is a shift, exact (written as integer ops so that loops vectorise).
inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t widened = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &widened, sizeof f);
  return f;
}

}  // namespace ferry
