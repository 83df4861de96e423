// Symmetric int8 codes of a row, rounded as torch rounds them: the two int8 writers
// (paged_attention.cpp's INT8 KV cache, int8_linear.cpp's W8A8 activations) pick the
// scale, these make the codes. AVX-512 (AVX2) for whole vectors of 16 (8) (the same IEEE division
// and round-half-even, max/min operand orders that treat NaN as std::max/min do),
// scalar for the rest; never fast-math, whatever the including file is built with
// (scalar nearbyint calls took 10.5 ms of a 64-token decode step's KV writes over 30
// layers; the bf16 cache's copy 0.9 ms; AMD EPYC Zen 4).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtypes.h"

#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

namespace accel {

// max |x[i]| over the row (a NaN is skipped)
template <typename T>
inline float abs_max(const T* x, int64_t n) {
  float amax = 0.f;
  int64_t i = 0;
#ifdef __AVX512F__
  __m512 m = _mm512_setzero_ps();  // (|x| > m ? |x| : m)
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(_mm512_abs_ps(load16(x + i)), m);
  amax = _mm512_reduce_max_ps(m);
#elif defined(ACCEL_AVX2)
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 m = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_and_ps(load8(x + i), magnitude), m);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; i < n; ++i) amax = std::max(amax, std::fabs(to_float(x[i])));
  return amax;
}

// q[i] = round half even (x[i] / s), clipped to [-127, 127] (a NaN becomes -127)
template <typename T>
inline void int8_codes(const T* x, int64_t n, float s, int8_t* q) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_roundscale_ps(_mm512_div_ps(load16(x + i), sv),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
  }
#elif defined(ACCEL_AVX2)
  const __m256 sv = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  for (; i + 8 <= n; i += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(load8(x + i), sv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
    const __m256i codes = _mm256_cvtps_epi32(v);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
  }
#endif
  for (; i < n; ++i) q[i] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(to_float(x[i]) / s))));
}

}  // namespace accel

#pragma GCC pop_options
