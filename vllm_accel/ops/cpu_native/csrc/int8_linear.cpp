// W8A8 with dynamic per-token activations (torch_ops.cpp: vllm_accel::int8_linear_dynamic):
// the activation quantizer, the int8 GEMM where the CPU has AMX or only AVX2 (torch's
// otherwise), and the dequantizing epilogue, each one pass in C++.
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
inline void store16(__m512 v, accel::half* p) {
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
inline void store16(__m512 v, __mmask16 mask, accel::half* p) {
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

#if defined(ACCEL_AVX2) && !defined(__AVX512F__)
// The int8 GEMM for CPUs with AVX2 but no AVX-512 (AMD Zen 1-3): oneDNN's AVX2 int8 GEMM,
// what torch._int_mm runs there, adds pairs of products in saturating int16
// (VPMADDUBSW) and is wrong wherever two large products meet. Here both operands are
// widened to int16 and VPMADDWD adds each pair into int32: the exact sums. Tiles of
// kRowsW weight rows by kRowsX rows of x (8 accumulators, 4 weight vectors of the 16
// registers), 16 columns a step, the last k % 16 columns in scalar code; the rows of x
// in blocks of kBlockM (kept in L2) against every weight block.
#define ACCEL_INT8_GEMM 1
namespace avx2_int8 {

constexpr int kRowsW = 4, kRowsX = 2;
constexpr int64_t kBlockM = 64;
constexpr int64_t kParallelMinWork = int64_t(1) << 18;  // as the epilogue's threads

inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t sum_lanes(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// acc[m][j] = q row m . w row j over k, for MR rows of q and NB rows of w
template <int NB, int MR>
void tile(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride, int64_t k,
          int32_t* acc, int64_t acc_stride) {
  __m256i sums[MR][NB];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) sums[m][j] = _mm256_setzero_si256();
  int64_t kk = 0;
  for (; kk + 16 <= k; kk += 16) {
    __m256i wv[NB];
    for (int j = 0; j < NB; ++j) wv[j] = widen(w + j * w_stride + kk);
    for (int m = 0; m < MR; ++m) {
      const __m256i xv = widen(q + m * q_stride + kk);
      for (int j = 0; j < NB; ++j)
        sums[m][j] = _mm256_add_epi32(sums[m][j], _mm256_madd_epi16(xv, wv[j]));
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NB; ++j) {
      int32_t s = sum_lanes(sums[m][j]);
      for (int64_t t = kk; t < k; ++t) s += int32_t(q[m * q_stride + t]) * w[j * w_stride + t];
      acc[m * acc_stride + j] = s;
    }
}

template <int NB>
void weight_block(const int8_t* q, int64_t q_stride, int64_t rows, const int8_t* w,
                  int64_t w_stride, int64_t k, int32_t* acc, int64_t acc_stride) {
  int64_t r = 0;
  for (; r + kRowsX <= rows; r += kRowsX)
    tile<NB, kRowsX>(q + r * q_stride, q_stride, w, w_stride, k, acc + r * acc_stride, acc_stride);
  for (; r < rows; ++r)
    tile<NB, 1>(q + r * q_stride, q_stride, w, w_stride, k, acc + r * acc_stride, acc_stride);
}

void gemm(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride, int64_t m,
          int64_t n, int64_t k, int32_t* acc, int64_t acc_stride) {
  const int64_t blocks = (n + kRowsW - 1) / kRowsW;
  for (int64_t row0 = 0; row0 < m; row0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, m - row0);
    const int8_t* qb = q + row0 * q_stride;
    int32_t* ab = acc + row0 * acc_stride;
#pragma omp parallel for schedule(static) if (rows * n * k >= kParallelMinWork)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kRowsW;
      if (n0 + kRowsW <= n)
        weight_block<kRowsW>(qb, q_stride, rows, w + n0 * w_stride, w_stride, k, ab + n0,
                             acc_stride);
      else
        for (int64_t j = n0; j < n; ++j)
          weight_block<1>(qb, q_stride, rows, w + j * w_stride, w_stride, k, ab + j, acc_stride);
    }
  }
}

}  // namespace avx2_int8
#endif  // AVX2 without AVX-512

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

// 1 where this build has an int8 GEMM of its own (accel_int8_gemm: AVX2 without
// AVX-512, where torch's is inexact), else 0.
int accel_int8_gemm_available() {
#ifdef ACCEL_INT8_GEMM
  return 1;
#else
  return 0;
#endif
}

// acc[M, N] (int32, row stride acc_stride) = q[M, K] @ w[N, K].T, exact; -5 where not
// built (accel_int8_gemm_available).
int accel_int8_gemm(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride,
                    int64_t m, int64_t n, int64_t k, int32_t* acc, int64_t acc_stride) {
#ifdef ACCEL_INT8_GEMM
  avx2_int8::gemm(q, q_stride, w, w_stride, m, n, k, acc, acc_stride);
  return 0;
#else
  (void)q, (void)q_stride, (void)w, (void)w_stride, (void)m, (void)n, (void)k, (void)acc,
      (void)acc_stride;
  return -5;
#endif
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
