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


#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
// The int8 GEMM on AMX tiles: acc[M, N] = q[M, K] @ W[N, K].T in int32, the same exact
// sums as torch's _int_mm (at most K * 127 * 127 per sum). One TDPBSSD multiplies 16
// weight rows x 64 columns (an A tile read in place with the weight's row stride) by
// 64 columns of 16 rows of q, packed once per call into the B layout (quads of
// columns); 2 x 2 tiles of 16 x 16 sums, the next 32 weight rows prefetched into L2
// while the first 32 rows of q pass. torch's _int_mm, what the op calls otherwise,
// on an Intel Xeon with AMX (one core, the default model's 30 layers, int8 weights):
// 16-17 ms at 1-8 rows, 38 ms at 64, 115 ms at 256, slower than its bf16 GEMM there.
namespace amx_int8 {

constexpr int kTile = 16;
constexpr int kTileK = 64;           // int8 columns of an A tile (16 quads of a B tile)
constexpr int64_t kBlockM = 256;     // rows of q packed at a time

// q rows row0.. into the B layout: qp[(b * quads + j) * 16 + i] = columns 4j..4j+3 of
// row row0 + 16b + i, zero past the rows and past k.
void pack_q(const int8_t* q, int64_t q_stride, int64_t row0, int64_t rows, int64_t k,
            int64_t kp, uint32_t* qp) {
  const int64_t quads = kp / 4, blocks = (rows + kTile - 1) / kTile;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t kk = 0; kk < kp; kk += kTileK) {
      const int64_t left = k - kk;
      const __mmask64 mask = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t row = b * kTile + i;
        r[i] = row < rows ? _mm512_maskz_loadu_epi8(mask, q + (row0 + row) * q_stride + kk)
                          : _mm512_setzero_si512();
      }
      transpose16(r);  // r[j] = quad j of this step for the 16 rows
      for (int j = 0; j < 16; ++j) _mm512_storeu_si512(qp + (b * quads + kk / 4 + j) * kTile, r[j]);
    }
  }
}

// A sums tile stored to `sums` (weight rows n0.., rows of q row..) into acc, transposed.
void store_sums(const int32_t* sums, int32_t* acc, int64_t acc_stride, int64_t row,
                int64_t rows_left, int64_t n0, int64_t n) {
  __m512i r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums + i * kTile);
  transpose16(r);  // r[j]: row row + j of acc, columns n0..n0+15
  const __mmask16 mask = n - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - n0)) - 1);
  for (int j = 0; j < kTile && j < rows_left; ++j)
    _mm512_mask_storeu_epi32(acc + (row + j) * acc_stride + n0, mask, r[j]);
}

// NA (1-2) weight tiles from `a` by NB (1-2) tiles of q from `qb` over kp columns: the
// sums of tile (i, j) in tmm(2i + j); `next` as in bf16_linear.cpp's amx::tiles.
template <int NA, int NB>
void tiles(const int8_t* a, int64_t a_stride, const uint32_t* qb, int64_t quads, int64_t kp,
           const int8_t* next, int64_t next_rows, int64_t next_stride) {
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NA > 1) _tile_zero(2);
  if constexpr (NA > 1 && NB > 1) _tile_zero(3);
  for (int64_t kk = 0; kk < kp; kk += kTileK) {
    if (next)
      for (int64_t r = 0; r < next_rows; ++r) _mm_prefetch(next + r * next_stride + kk, _MM_HINT_T1);
    _tile_loadd(4, a + kk, a_stride);
    if constexpr (NA > 1) _tile_loadd(5, a + kTile * a_stride + kk, a_stride);
    _tile_loadd(6, qb + kk / 4 * kTile, 64);
    if constexpr (NB > 1) _tile_loadd(7, qb + (quads + kk / 4) * kTile, 64);
    _tile_dpbssd(0, 4, 6);
    if constexpr (NB > 1) _tile_dpbssd(1, 4, 7);
    if constexpr (NA > 1) _tile_dpbssd(2, 5, 6);
    if constexpr (NA > 1 && NB > 1) _tile_dpbssd(3, 5, 7);
  }
}

// One block of up to 32 weight rows (n0..) against all `rows` packed rows of q; a block
// with rows past n or columns past k is copied, zero-padded, into `wpad` first.
void weight_block(const int8_t* w, int64_t w_stride, int64_t n0, int64_t n, int64_t k,
                  int64_t kp, const uint32_t* qp, int64_t rows, int64_t row0, int32_t* acc,
                  int64_t acc_stride, int8_t* wpad, const int8_t* next, int64_t next_rows) {
  const int64_t block_rows = std::min<int64_t>(2 * kTile, n - n0), quads = kp / 4;
  const int8_t* a = w + n0 * w_stride;
  int64_t a_stride = w_stride;
  if (block_rows % kTile || k != kp) {
    const int64_t tiles_rows = (block_rows + kTile - 1) / kTile * kTile;
    for (int64_t r = 0; r < tiles_rows; ++r) {
      int8_t* dst = wpad + r * kp;
      if (r < block_rows) std::memcpy(dst, a + r * w_stride, size_t(k));
      std::fill(dst + (r < block_rows ? k : 0), dst + kp, int8_t{0});
    }
    a = wpad, a_stride = kp;
  }
  const bool two = block_rows > kTile;
  const int64_t q_tiles = (rows + kTile - 1) / kTile;
  for (int64_t b = 0; b < q_tiles; b += 2, next = nullptr) {
    const uint32_t* qb = qp + b * quads * kTile;
    const int64_t row = row0 + b * kTile, left = rows - b * kTile;
    const bool two_q = b + 1 < q_tiles;
    if (two && two_q) tiles<2, 2>(a, a_stride, qb, quads, kp, next, next_rows, w_stride);
    else if (two) tiles<2, 1>(a, a_stride, qb, quads, kp, next, next_rows, w_stride);
    else if (two_q) tiles<1, 2>(a, a_stride, qb, quads, kp, next, next_rows, w_stride);
    else tiles<1, 1>(a, a_stride, qb, quads, kp, next, next_rows, w_stride);
    // (a tile's number is part of the instruction: literals)
    alignas(64) int32_t sums[4][kTile * kTile];
    _tile_stored(0, sums[0], 64);
    if (two_q) _tile_stored(1, sums[1], 64);
    if (two) _tile_stored(2, sums[2], 64);
    if (two && two_q) _tile_stored(3, sums[3], 64);
    store_sums(sums[0], acc, acc_stride, row, left, n0, n);
    if (two_q) store_sums(sums[1], acc, acc_stride, row + kTile, left - kTile, n0, n);
    if (two) store_sums(sums[2], acc, acc_stride, row, left, n0 + kTile, n);
    if (two && two_q)
      store_sums(sums[3], acc, acc_stride, row + kTile, left - kTile, n0 + kTile, n);
  }
}

void gemm(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride, int32_t* acc,
          int64_t acc_stride, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = (k + kTileK - 1) / kTileK * kTileK;
  const int64_t q_rows = std::min(m, kBlockM);
  std::vector<uint32_t> qp(size_t((q_rows + kTile - 1) / kTile * kTile) * (kp / 4));
  const int64_t blocks = (n + 2 * kTile - 1) / (2 * kTile);
  for (int64_t row0 = 0; row0 < m; row0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, m - row0);
    pack_q(q, q_stride, row0, rows, k, kp, qp.data());
#pragma omp parallel if (rows * n * k >= (int64_t(1) << 18))
    {
      amx::configure();
      std::vector<int8_t> wpad(size_t(2 * kTile) * kp);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * 2 * kTile;
        // the first q tiles prefetch the block this thread runs next (schedule(static))
        const int64_t next_rows =
            std::max<int64_t>(0, std::min<int64_t>(2 * kTile, n - n0 - 2 * kTile));
        const int8_t* next = next_rows ? w + (n0 + 2 * kTile) * w_stride : nullptr;
        weight_block(w, w_stride, n0, n, k, kp, qp.data(), rows, row0, acc, acc_stride,
                     wpad.data(), next, next_rows);
      }
      _tile_release();
    }
  }
}

}  // namespace amx_int8
#endif  // AMX-INT8

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

// acc = q @ w.T in int32 on AMX tiles; -5 where this build or this process lacks them
// (the caller then runs torch's _int_mm).
int accel_int8_gemm(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride,
                    int32_t* acc, int64_t acc_stride, int64_t m, int64_t n, int64_t k) {
#if defined(__AVX512F__) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
  if (amx::ready()) {
    amx_int8::gemm(q, q_stride, w, w_stride, acc, acc_stride, m, n, k);
    return 0;
  }
#endif
  (void)q, (void)q_stride, (void)w, (void)w_stride, (void)acc, (void)acc_stride, (void)m,
      (void)n, (void)k;
  return -5;
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
