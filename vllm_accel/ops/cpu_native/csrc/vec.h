// float32 vectors of the widest x86 ISA a build has, for the kernels written once for
// AVX-512 (16 lanes; F, BW, VL) and for AVX2 + FMA + F16C (8 lanes): `Vec` is F32x16 in
// an AVX-512 build, F32x8 in an AVX2 one, and absent otherwise (the scalar paths run).
// Loads widen bf16/fp16/int8 elements to float32 exactly.
#pragma once

#include <cstdint>
#include <cstring>

#include "dtypes.h"

namespace accel {

#ifdef __AVX512F__
// v[t] = the sum of a[t]'s 16 lanes, for 16 vectors at once; `add` adds two vectors of
// float32 (or, bit-cast, int32) lanes.
template <typename Add>
inline __m512 reduce16(const __m512 a[16], Add add) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // 128-bit lanes 0,1: vector 2i; 2,3: vector 2i+1
    b[i] = add(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
               _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // lane l: vector 4i + l
    c[i] = add(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
               _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  const __m512 d0 = add(_mm512_unpacklo_ps(c[0], c[1]), _mm512_unpackhi_ps(c[0], c[1]));
  const __m512 d1 = add(_mm512_unpacklo_ps(c[2], c[3]), _mm512_unpackhi_ps(c[2], c[3]));
  // element 4l + m holds vector 4m + l
  const __m512 r = add(_mm512_shuffle_ps(d0, d1, 0x44), _mm512_shuffle_ps(d0, d1, 0xEE));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
struct F32x16 {
  using R = __m512;
  static constexpr int kLanes = 16;
  static R zero() { return _mm512_setzero_ps(); }
  static R set1(float x) { return _mm512_set1_ps(x); }
  template <typename T>
  static R load(const T* p) { return load16(p); }
  // the first n (0 < n < 16) bf16 at p, zeros after (nothing past them is read)
  static R load_first(const bf16* p, int n) {
    const __m256i raw = _mm256_maskz_loadu_epi16(__mmask16((1u << n) - 1), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
  static void store(R v, float* p) { _mm512_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm512_add_ps(a, b); }
  static R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  // lane t = the sum of a[t]'s lanes
  static R sums(const R a[16]) {
    return reduce16(a, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  }
  // out[j] = the sum of a[j]'s lanes, four at once (shared shuffles: 14 instructions
  // instead of 4 x 8)
  static void sums4(const R a[4], float out[4]) {
    const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    // per 128-bit lane: partial sums of a[0..3]
    const __m512 u = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
    const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u),
                                   _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(u), 1)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
  }
  static float sum(R a) { return _mm512_reduce_add_ps(a); }
};
using Vec = F32x16;
#define ACCEL_VEC 1

#elif defined(ACCEL_AVX2)
struct F32x8 {
  using R = __m256;
  static constexpr int kLanes = 8;
  static R zero() { return _mm256_setzero_ps(); }
  static R set1(float x) { return _mm256_set1_ps(x); }
  template <typename T>
  static R load(const T* p) { return load8(p); }
  // the first n (0 < n < 8) bf16 at p, zeros after (nothing past them is read)
  static R load_first(const bf16* p, int n) {
    bf16 part[8] = {};
    std::memcpy(part, p, size_t(n) * sizeof(bf16));
    return load8(part);
  }
  static void store(R v, float* p) { _mm256_storeu_ps(p, v); }
  static R add(R a, R b) { return _mm256_add_ps(a, b); }
  static R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static R fmadd(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  // lane t = the sum of a[t]'s lanes
  static R sums(const R a[8]) {
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    // per 128-bit half h: lane i of u0 = half h's sum of a[i] (u1: a[4 + i])
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  // out[j] = the sum of a[j]'s lanes, four at once
  static void sums4(const R a[4], float out[4]) {
    const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1)));
  }
  static float sum(R a) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
  }
};
using Vec = F32x8;
#define ACCEL_VEC 1
#endif

}  // namespace accel
