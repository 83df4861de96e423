// Element types of the C ABI (cpu_native/build.py DTYPE_CODES) and float32 conversions
// that round like torch (to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

namespace accel {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

struct bf16 { uint16_t bits; };

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) {
  uint32_t u = uint32_t(x.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_float(_Float16 x) { return float(x); }
inline float to_float(int8_t x) { return float(x); }

inline void store(float x, float* dst) { *dst = x; }
inline void store(float x, _Float16* dst) { *dst = _Float16(x); }
inline void store(float x, bf16* dst) {  // branch-free, so loops vectorize
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  dst->bits = uint16_t((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}

// Calls f(T{}) for the dtype code; returns 0, or -1 for an unknown code.
template <typename F>
int dispatch(int dtype, F&& f) {
  switch (dtype) {
    case kFloat32: f(float{}); return 0;
    case kBFloat16: f(bf16{}); return 0;
    case kFloat16: f(_Float16{}); return 0;
  }
  return -1;
}

}  // namespace accel
