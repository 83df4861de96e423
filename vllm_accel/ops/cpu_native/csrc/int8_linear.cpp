// W8A8 with dynamic per-token activations around torch's int8 GEMM
// (torch_ops.cpp: vllm_accel::int8_linear_dynamic): the activation quantizer before
// it and the dequantizing epilogue after it, each one pass in C++.
//
// Traced as torch ops, these elementwise steps are what inductor generates C++ for in
// a compiled W8A8 engine (120 linears of the default model: ~1200 generated kernels,
// most of its 110-122 s first start); as one opaque op they cost no compile time.
//
// Both must give the bytes the torch path gives (quant/w8a8.py int8_quant_act and
// int8_linear): s = max|x| / 127 per row (1 for an all-zero row), q = round half even
// (x / s) clipped to [-127, 127]; y = ((float(acc) * s_row) * s_col) (+ bias), each
// product rounded to float32 on its own, then once to the output dtype. So no
// fast-math and no contraction into FMAs here.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtypes.h"
#include "entry_points.h"
#include "int8_codes.h"

#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "fp-contract=off")

namespace {

using namespace accel;

#ifdef __AVX512F__
inline void store16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }
inline void store16(__m512 v, bf16* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}
inline void store16(__m512 v, _Float16* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// One row: its scale, its codes into q.
template <typename T>
float quantize_row(const T* x, int64_t k, int8_t* q) {
  float s = abs_max(x, k) / 127.f;
  if (s == 0.f) s = 1.f;
  int8_codes(x, k, s, q);
  return s;
}

template <typename T>
void dequantize_row(const int32_t* acc, int64_t n, float row_scale, const float* col_scales,
                    const float* bias, T* y) {
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512 rs = _mm512_set1_ps(row_scale);
  for (; j + 16 <= n; j += 16) {
    __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(acc + j)), rs);
    v = _mm512_mul_ps(v, _mm512_loadu_ps(col_scales + j));
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + j));
    store16(v, y + j);
  }
#endif
  for (; j < n; ++j) {
    float v = float(acc[j]) * row_scale;
    v = v * col_scales[j];
    if (bias) v = v + bias[j];
    store(v, y + j);
  }
}

}  // namespace

extern "C" {

int accel_int8_quant_rows(int32_t dtype, const void* x, int64_t x_stride, int64_t m, int64_t k,
                          int8_t* q, float* scales) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* rows = static_cast<const T*>(x);
    for (int64_t r = 0; r < m; ++r) scales[r] = quantize_row(rows + r * x_stride, k, q + r * k);
  });
}

int accel_int8_dequant(const int32_t* acc, int64_t acc_stride, int64_t m, int64_t n,
                       const float* row_scales, const float* col_scales, const float* bias,
                       int32_t y_dtype, void* y, int64_t y_stride) {
  return dispatch(y_dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(y);
    for (int64_t r = 0; r < m; ++r)
      dequantize_row(acc + r * acc_stride, n, row_scales[r], col_scales, bias, out + r * y_stride);
  });
}

}  // extern "C"

#pragma GCC pop_options
