// Int4 weight x bf16 activations for decode-sized batches (1-64 rows of x) on
// torch's CPU int4 weight layout (the one
// torch.ops.aten._convert_weight_to_int4pack_for_cpu makes on AVX-512 and the
// torch_fast provider keeps resident), compiled at first use (see cpu_native/build.py).
//
// Why: torch's _weight_int4pack_mm_for_cpu reads 12-17 GB/s at one row on a core
// that reads 35-40 GB/s, and decode of one request is this GEMV. Same layout and
// result formula, so the prepared weight is shared with torch's kernel, which
// keeps prefill-sized batches. Up to 4 rows of x stream each weight block once
// (gemv: their sums stay in registers); more go through 16-output slabs of a block
// (gemm_slabs).
//
// Layout (rows in blocks of 64): packed[N/64][K][32] bytes, byte i of (block, k)
// holds row 64*block+i in its low nibble and row 64*block+32+i in its high one.
// scales_zeros[K/group][N][2] bf16: W[n,k] = (q - 8) * s + z.
//
// Per pair of columns (k, k+1), one 64-byte load, and 16 rows: the two codes of a
// row become one 32-bit lane of two bf16 values 128+q (0x4300 | q: exact; one VPERMB
// for 16 rows), and one VDPBF16PS adds
// x[k]*(128+q[k]) + x[k+1]*(128+q[k+1]) into the row's float32 sum (bf16 products
// are exact in float32). Per group the sum gives
//   sum_k x*(q-8) = acc - 136*sum_k x,  then  y += s*that + z*sum_k x.
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

#include "dtypes.h"

#if defined(__AVX512BF16__) && defined(__AVX512VBMI__)
#define ACCEL_INT4_GEMV 1
#include <immintrin.h>

namespace {

constexpr int kBlockN = 64;
constexpr int kMaxBatch = 64;  // x rows the slab kernel takes
// how far ahead of the loads the weight stream is prefetched (the next block's
// first lines once a block ends: blocks are contiguous)
constexpr int kPrefetchBytes = 4096;

inline __m512 bf16_lanes_low(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 bf16_lanes_high(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))));
}

// Byte lanes of one 64-byte load, columns (k, k+1) of 32 rows (k's 32 codes, then
// k+1's), to 16 rows' bf16 pairs 0x43q: VPERMB puts row r's codes at bytes 4r and
// 4r+2 and the masked-off odd bytes take 0x43 (rows 0-15 with first=0, 16-31 with 16).
inline __m512i pair_index(int first) {
  alignas(64) uint8_t idx[64];
  for (int r = 0; r < 16; ++r) {
    idx[4 * r] = uint8_t(first + r);
    idx[4 * r + 2] = uint8_t(32 + first + r);
    idx[4 * r + 1] = idx[4 * r + 3] = 0;
  }
  return _mm512_load_si512(idx);
}

inline __m512bh code_pairs(__m512i codes, __m512i index) {
  return (__m512bh)_mm512_mask_permutexvar_epi8(_mm512_set1_epi8(0x43), 0x5555555555555555ull,
                                                index, codes);
}

template <int M>
void gemv_block(const accel::bf16* x, int64_t x_stride, const float* x_sums, const uint8_t* packed,
                const uint32_t* sz, accel::bf16* y, int64_t y_stride, int64_t n0, int64_t n,
                int64_t k, int64_t group) {
  const uint8_t* block = packed + (n0 / kBlockN) * k * 32;
  const int64_t groups = k / group;
  __m512 out[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) out[m][j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i first16 = pair_index(0), second16 = pair_index(16);
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    if (g + 1 < groups)  // the next group's 64 (s, z) pairs: 4 lines away from the stream
      for (int j = 0; j < 4; ++j) _mm_prefetch((const char*)(sz + (g + 1) * n + n0 + 16 * j), _MM_HINT_T0);
    for (int64_t kk = g * group; kk < (g + 1) * group; kk += 2) {
      _mm_prefetch((const char*)(block + kk * 32) + kPrefetchBytes, _MM_HINT_T0);
      const __m512i both = _mm512_loadu_si512((const void*)(block + kk * 32));  // k, k+1
      const __m512i lo = _mm512_and_si512(both, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      const __m512bh w[4] = {code_pairs(lo, first16), code_pairs(lo, second16),
                             code_pairs(hi, first16), code_pairs(hi, second16)};
      for (int m = 0; m < M; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * x_stride + kk, 4);
        const __m512bh xp = (__m512bh)_mm512_set1_epi32(int(pair));
        for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], w[j], xp);
      }
    }
    const uint32_t* gsz = sz + (g * n + n0);  // 64 (s, z) bf16 pairs
    for (int j = 0; j < 4; ++j) {
      const __m512i pairs = _mm512_loadu_si512((const void*)(gsz + 16 * j));
      const __m512 s = bf16_lanes_low(pairs), z = bf16_lanes_high(pairs);
      for (int m = 0; m < M; ++m) {
        const __m512 xs = _mm512_set1_ps(x_sums[m * groups + g]);
        const __m512 centered = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), xs, acc[m][j]);
        out[m][j] = _mm512_fmadd_ps(s, centered, _mm512_fmadd_ps(z, xs, out[m][j]));
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    alignas(64) float tmp[kBlockN];
    for (int j = 0; j < 4; ++j) _mm512_store_ps(tmp + 16 * j, out[m][j]);
    accel::bf16* dst = y + m * y_stride + n0;
    for (int i = 0; i < kBlockN; ++i) accel::store(tmp[i], dst + i);
  }
}

// Each x row's sum over each group ([m][K/group]): the zero-point terms.
std::vector<float> group_sums(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                              int64_t group) {
  const int64_t groups = k / group;
  std::vector<float> sums(size_t(m) * groups);
  for (int r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t i = g * group; i < (g + 1) * group; ++i) s += accel::to_float(x[r * x_stride + i]);
      sums[r * groups + g] = s;
    }
  return sums;
}

// Threads only for weights of 2**20 codes and more: below that one pass is a few
// microseconds, about what waking the OpenMP team costs.
constexpr int64_t kParallelMinWeights = int64_t(1) << 20;

template <int M>
void gemv(const accel::bf16* x, int64_t x_stride, const uint8_t* packed, const uint32_t* sz,
          accel::bf16* y, int64_t y_stride, int64_t n, int64_t k, int64_t group) {
  const std::vector<float> x_sums = group_sums(x, x_stride, M, k, group);
#pragma omp parallel for schedule(static) if (n * k >= kParallelMinWeights)
  for (int64_t n0 = 0; n0 < n; n0 += kBlockN)
    gemv_block<M>(x, x_stride, x_sums.data(), packed, sz, y, y_stride, n0, n, k, group);
}

// Larger batches (up to kMaxBatch rows of x): one 16-output slab of a 64-output block
// at a time against MR rows of x, so the accumulators fit in registers (2*MR + a few); the
// block's bytes are read once per slab and row chunk, from L1/L2 after the first.
template <int MR>
void slab_rows(const accel::bf16* x, int64_t x_stride, const float* x_sums, int64_t groups,
               const uint8_t* block, const uint32_t* sz, accel::bf16* y, int64_t y_stride,
               int64_t n0, int64_t n, int64_t group, int slab) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const __m512i index = pair_index(slab % 2 ? 16 : 0);
  const bool high = slab >= 2;
  __m512 out[MR];
  for (int m = 0; m < MR; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t kk = g * group; kk < (g + 1) * group; kk += 2) {
      const __m512i both = _mm512_loadu_si512((const void*)(block + kk * 32));  // k, k+1
      const __m512i codes = _mm512_and_si512(high ? _mm512_srli_epi16(both, 4) : both, nibble);
      const __m512bh w = code_pairs(codes, index);
      for (int m = 0; m < MR; ++m) {
        uint32_t pair;
        std::memcpy(&pair, x + m * x_stride + kk, 4);
        acc[m] = _mm512_dpbf16_ps(acc[m], w, (__m512bh)_mm512_set1_epi32(int(pair)));
      }
    }
    const __m512i pairs = _mm512_loadu_si512((const void*)(sz + g * n + n0 + 16 * slab));
    const __m512 s = bf16_lanes_low(pairs), z = bf16_lanes_high(pairs);
    for (int m = 0; m < MR; ++m) {
      const __m512 xs = _mm512_set1_ps(x_sums[m * groups + g]);
      const __m512 centered = _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), xs, acc[m]);
      out[m] = _mm512_fmadd_ps(s, centered, _mm512_fmadd_ps(z, xs, out[m]));
    }
  }
  for (int m = 0; m < MR; ++m) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, out[m]);
    accel::bf16* dst = y + m * y_stride + n0 + 16 * slab;
    for (int i = 0; i < 16; ++i) accel::store(tmp[i], dst + i);
  }
}

template <int MR>
void slab_chunk(const accel::bf16* x, int64_t x_stride, const float* x_sums, int64_t groups,
                const uint8_t* block, const uint32_t* sz, accel::bf16* y, int64_t y_stride,
                int64_t n0, int64_t n, int64_t group, int slab, int rows) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      slab_chunk<MR - 1>(x, x_stride, x_sums, groups, block, sz, y, y_stride, n0, n, group,
                         slab, rows);
      return;
    }
  }
  slab_rows<MR>(x, x_stride, x_sums, groups, block, sz, y, y_stride, n0, n, group, slab);
}

void gemm_slabs(const accel::bf16* x, int64_t x_stride, const uint8_t* packed, const uint32_t* sz,
                accel::bf16* y, int64_t y_stride, int m, int64_t n, int64_t k, int64_t group) {
  constexpr int kChunk = 8;
  const int64_t groups = k / group;
  const std::vector<float> x_sums = group_sums(x, x_stride, m, k, group);
  // (each weight costs a slab pass per 8-row chunk: threads pay off 8x sooner)
#pragma omp parallel for schedule(static) if (n * k >= kParallelMinWeights / 8)
  for (int64_t n0 = 0; n0 < n; n0 += kBlockN) {
    const uint8_t* block = packed + (n0 / kBlockN) * k * 32;
    for (int slab = 0; slab < 4; ++slab)
      for (int r0 = 0; r0 < m; r0 += kChunk)
        slab_chunk<kChunk>(x + r0 * x_stride, x_stride, x_sums.data() + r0 * groups, groups,
                           block, sz, y + r0 * y_stride, y_stride, n0, n, group, slab,
                           std::min(kChunk, m - r0));
  }
}

}  // namespace
#endif  // __AVX512BF16__ && __AVX512VBMI__

extern "C" {

// 1 if this build has the kernel (the CPU has AVX512-BF16 and AVX512-VBMI), else 0.
int accel_int4pack_gemv_available() {
#ifdef ACCEL_INT4_GEMV
  return 1;
#else
  return 0;
#endif
}

// y[M, N] (bf16, row stride y_stride) = x[M, K] (bf16, row stride x_stride) @ W.T for
// M in 1..64 (up to 4 streamed, more by 16-output slabs), N a multiple of 64, K a
// multiple of group, group even.
// Returns 0, -1 for shapes it does not take, -5 without AVX512-BF16 and AVX512-VBMI.
int accel_int4pack_gemv(const void* x, int64_t x_stride, const void* packed,
                        const void* scales_zeros, void* y, int64_t y_stride, int32_t m,
                        int64_t n, int64_t k, int64_t group) {
#ifdef ACCEL_INT4_GEMV
  if (m < 1 || m > kMaxBatch || n % kBlockN || group < 2 || group % 2 || k % group) return -1;
  const auto* xb = static_cast<const accel::bf16*>(x);
  const auto* pk = static_cast<const uint8_t*>(packed);
  const auto* sz = static_cast<const uint32_t*>(scales_zeros);
  auto* yb = static_cast<accel::bf16*>(y);
  switch (m) {
    case 1: gemv<1>(xb, x_stride, pk, sz, yb, y_stride, n, k, group); break;
    case 2: gemv<2>(xb, x_stride, pk, sz, yb, y_stride, n, k, group); break;
    case 3: gemv<3>(xb, x_stride, pk, sz, yb, y_stride, n, k, group); break;
    case 4: gemv<4>(xb, x_stride, pk, sz, yb, y_stride, n, k, group); break;
    default: gemm_slabs(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group); break;
  }
  return 0;
#else
  (void)x, (void)x_stride, (void)packed, (void)scales_zeros, (void)y, (void)y_stride, (void)m,
      (void)n, (void)k, (void)group;
  return -5;
#endif
}

}  // extern "C"
