// W8A8 with dynamic per-token activations (torch_ops.cpp: vllm_accel::int8_linear_dynamic):
// the activation quantizer, the int8 GEMM where the CPU has AMX (torch's otherwise), and
// the dequantizing epilogue, each one pass in C++.
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
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"
#include "int8_codes.h"
#include "tiles.h"

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


#ifdef ACCEL_AMX_TILES
// The int8 GEMM on AMX tiles (tiles.h TileGemm<int8_t>: TDPBSSD, 16 weight rows x 64
// columns by 64 columns of 16 rows of q) with the dequantizing epilogue: the sums are
// the exact int32 ones torch's _int_mm gives (at most K * 127 * 127), each dequantized
// from its tile as dequantize_row would (so the bytes equal the op's other path), which
// keeps an [M, N] int32 matrix out of memory (at 2048 rows the GEMM, the int32 round
// trip and a one-thread epilogue took twice as long as bf16 oneDNN). torch's _int_mm,
// what the op calls otherwise, on an Intel Xeon with AMX (one core, the default model's
// 30 layers, int8 weights): 16-17 ms at 1-8 rows, 38 ms at 64, 115 ms at 256, slower
// than its bf16 GEMM there.
namespace amx_int8 {

inline void store16(__m512 v, __mmask16 mask, float* p) { _mm512_mask_storeu_ps(p, mask, v); }
inline void store16(__m512 v, __mmask16 mask, bf16* p) {
  _mm256_mask_storeu_epi16(p, mask, to_bf16(v));
}
inline void store16(__m512 v, __mmask16 mask, _Float16* p) {
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The epilogue the GEMM writes through: y[r, j] = ((float(sum) * row_scales[r]) *
// col_scales[j]) (+ bias[j]) in T, as dequantize_row computes it.
template <typename T>
struct Dequant {
  const float* row_scales;
  const float* col_scales;
  const float* bias;
  T* y;
  int64_t y_stride, n;

  // A sums tile (weight rows n0.., rows of q row..), transposed and dequantized.
  void store(const uint32_t* sums, int64_t row, int64_t rows_left, int64_t n0) const {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums + i * 16);
    transpose16(r);  // r[j]: row row + j, columns n0..n0+15
    const __mmask16 mask = n - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - n0)) - 1);
    const __m512 cs = _mm512_maskz_loadu_ps(mask, col_scales + n0);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + n0) : __m512{};
    for (int j = 0; j < 16 && j < rows_left; ++j) {
      __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(r[j]), _mm512_set1_ps(row_scales[row + j]));
      v = _mm512_mul_ps(v, cs);
      if (bias) v = _mm512_add_ps(v, b);  // (no bias: -0.0 stays -0.0)
      store16(v, mask, y + (row + j) * y_stride + n0);
    }
  }

  void prefetch(int64_t row, int64_t rows, int64_t n0) const {
    amx::prefetch_lines(y + row * y_stride + n0, rows, y_stride * int64_t(sizeof(T)),
                        std::min<int64_t>(32, n - n0) * int64_t(sizeof(T)));
  }
};

}  // namespace amx_int8
#endif  // AMX

}  // namespace

extern "C" {

int accel_int8_quant_rows(int32_t dtype, const void* x, int64_t x_stride, int64_t m, int64_t k,
                          int8_t* q, float* scales) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* rows = static_cast<const T*>(x);
#pragma omp parallel for schedule(static) if (m * k >= (int64_t(1) << 16))
    for (int64_t r = 0; r < m; ++r) scales[r] = quantize_row(rows + r * x_stride, k, q + r * k);
  });
}

// y = the dequantized q @ w.T (accel_int8_dequant's bytes) on AMX tiles; -5 where this
// build or this process lacks them (the caller then runs torch's _int_mm and
// accel_int8_dequant).
int accel_int8_linear_amx(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride,
                          int64_t m, int64_t n, int64_t k, const float* row_scales,
                          const float* col_scales, const float* bias, int32_t y_dtype, void* y,
                          int64_t y_stride) {
#ifdef ACCEL_AMX_TILES
  if (amx::ready())
    return dispatch(y_dtype, [&](auto tag) {
      using T = decltype(tag);
      amx::TileGemm<int8_t>::gemm(
          q, q_stride, w, w_stride, m, n, k,
          amx_int8::Dequant<T>{row_scales, col_scales, bias, static_cast<T*>(y), y_stride, n},
          int64_t(1) << 18);
    });
#endif
  (void)q, (void)q_stride, (void)w, (void)w_stride, (void)m, (void)n, (void)k, (void)row_scales,
      (void)col_scales, (void)bias, (void)y_dtype, (void)y, (void)y_stride;
  return -5;
}

int accel_int8_dequant(const int32_t* acc, int64_t acc_stride, int64_t m, int64_t n,
                       const float* row_scales, const float* col_scales, const float* bias,
                       int32_t y_dtype, void* y, int64_t y_stride) {
  return dispatch(y_dtype, [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(y);
#pragma omp parallel for schedule(static) if (m * n >= (int64_t(1) << 16))
    for (int64_t r = 0; r < m; ++r)
      dequantize_row(acc + r * acc_stride, n, row_scales[r], col_scales, bias, out + r * y_stride);
  });
}

}  // extern "C"

#pragma GCC pop_options
