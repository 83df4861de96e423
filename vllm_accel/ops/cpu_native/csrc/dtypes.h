// Element types of the C ABI (cpu_native/build.py DTYPE_CODES) and float32 conversions
// that round like torch (to nearest even).
#pragma once

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

// The portable vector path: AVX2 with FMA and F16C (x86-64-v3: Intel Haswell and later,
// AMD Zen 1-3), for CPUs without AVX-512.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ACCEL_AVX2 1
#endif

#include <cstdint>
#include <cstring>

namespace accel {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16 { uint16_t bits; };

// IEEE half precision as a storage type (arithmetic is float32's): _Float16 on x86,
// __fp16 on Arm, whose GCC 12 has no _Float16 in C++
#if defined(__aarch64__) || defined(__arm__)
using half = __fp16;
#else
using half = _Float16;
#endif

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(half x) { return float(x); }
inline float to_float(int8_t x) { return float(x); }

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, half* dst) { *dst = half(x); }
inline void store(float x, bf16* dst) {  // branch-free, so loops vectorize
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  dst->bits = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}

#ifdef __AVX512F__
// 16 elements as float32 (exact)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const bf16* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}
inline __m512 load16(const half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// store(x, bf16*) for 16 lanes at once: the same rounding (to nearest even, NaN stays
// NaN), as 16 bf16 in the low 256 bits.
inline __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
}
#endif

#ifdef ACCEL_AVX2
// 8 elements as float32 (exact)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const bf16* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
}
inline __m256 load8(const half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Calls f(T{}) for the dtype code; returns 0, or -1 for an unknown code.
template <typename F>
int dispatch(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(float{}); return 0;
    case kBFloat16: f(bf16{}); return 0;
    case kFloat16: f(half{}); return 0;
  }
  return -1;
}

}  // namespace accel
