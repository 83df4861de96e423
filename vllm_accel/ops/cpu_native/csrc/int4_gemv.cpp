// Int4 weight x bf16 activations on torch's CPU int4 weight layout (the one
// torch.ops.aten._convert_weight_to_int4pack_for_cpu makes on AVX-512 and the
// torch_fast provider keeps resident), compiled at first use (see cpu_native/build.py):
// decode-sized batches (1-64 rows of x) by AVX-512, and, where the CPU has AMX, any
// batch from 12 rows on the tiles (the last section).
//
// Why: torch's _weight_int4pack_mm_for_cpu reads 12-17 GB/s at one row on a core
// that reads 35-40 GB/s, and decode of one request is this GEMV. Same layout and
// result formula, so the prepared weight is shared with torch's kernel, which
// keeps prefill-sized batches on CPUs without AMX. Up to 4 rows of x stream each weight
// block once (gemv: their sums stay in registers); more go through 16-output slabs of a
// block (gemm_slabs).
//
// Layout (rows in blocks of 64): packed[N/64][K][32] bytes, byte i of (block, k)
// holds row 64*block+i in its low nibble and row 64*block+32+i in its high one.
// scales_zeros[K/group][N][2] bf16: W[n,k] = (q - 8) * s + z.
//
// Per pair of columns (k, k+1), one 64-byte load, and 16 rows, three ways to the
// row's sum (a Madd policy below, chosen at run time by what was built):
// - Bf16Dot (AVX512-BF16): the two codes of a row become one 32-bit lane of two bf16
//   values 128+q (0x4300 | q: exact; one VPERMB for 16 rows), and one VDPBF16PS adds
//   x[k]*(128+q[k]) + x[k+1]*(128+q[k+1]) (bf16 products are exact in float32).
// - I16Dot (AVX512-VNNI without BF16: Ice Lake, Sapphire Rapids VMs that hide BF16): x
//   in int16 fixed point (one scale per block of up to 128 columns), the two codes of a
//   row one lane of two int16 (one VPERMB for 16 rows), and one VPDPWSSD adds
//   X[k]*q[k] + X[k+1]*q[k+1] into exact int32 sums (half Fp32Fma's instructions;
//   rounding x costs at most 1/65534 of the block's largest |x| an element, ~128x below
//   that element's own bf16 rounding).
// - Fp32Fma (AVX-512F and VBMI only): each column's codes become float32 128+q
//   (0x43000000 | q << 16: exact; one VPERMB for 16 rows), and one FMA per column adds
//   x*(128+q) (exact products as well).
// Per group the sum gives sum_k x*(q-8) (the float policies take 136 * sum_k x off, the
// int16 one 8 * sum_k X before its scale), then y += s*that + z*sum_k x.
#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"
#include "tiles.h"

#if defined(__AVX512F__) && defined(__AVX512VBMI__)
#define ACCEL_INT4_GEMV 1
#include <immintrin.h>

namespace {

constexpr int kBlockN = 64;
constexpr int kMaxBatch = 64;  // x rows the slab kernel takes
// How far ahead of the streaming GEMV's loads (1-4 rows of x; the slabs reread each
// block from L1/L2) the weight stream is prefetched (blocks are contiguous, so
// past a block's end this is the next block's first lines): into L1 a little ahead, and
// into L2 further ahead. One level (4 KiB into L1) left a core at ~11 GB/s on weights
// it reads at ~15; the L2 level adds requests in flight beyond L1's fill buffers (the
// 120 int4 GEMVs of a W4A16 decode step: 8-15% faster, Intel Xeon, measured).
constexpr int kPrefetchL1Bytes = 2048;
constexpr int kPrefetchL2Bytes = 8192;

inline __m512 bf16_lanes_low(__m512i pairs) { return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16)); }
inline __m512 bf16_lanes_high(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, _mm512_set1_epi32(int(0xffff0000u))));
}

// VPERMB's table for 16 rows (rows first..first+15 of the 32 in a load, whose bytes
// hold column k's codes at 0-31 and column k+1's at 32-63): byte `k_at` of row r's
// 32-bit lane takes column k's code, byte `k1_at` column k+1's (-1: neither).
inline __m512i code_index(int first, int k_at, int k1_at) {
  alignas(64) uint8_t idx[64] = {};
  for (int r = 0; r < 16; ++r) {
    if (k_at >= 0) idx[4 * r + k_at] = uint8_t(first + r);
    if (k1_at >= 0) idx[4 * r + k1_at] = uint8_t(32 + first + r);
  }
  return _mm512_load_si512(idx);
}

// x as a policy reads it: per row, the elements (`rows`, row stride `stride`) and, per
// block of `step` columns, what finishing that block needs (Policy::Block).
template <class Policy>
struct XRows {
  const typename Policy::XElem* rows;
  int64_t stride;
  int64_t step;
  std::vector<typename Policy::XElem> storage;
  std::vector<typename Policy::Block> blocks;  // [m][K / step]
};

// What the float policies share: a block is a whole group, summed into float32 lanes
// of 128+q codes; finishing it needs the sum of x over it (the code bias 128 + zero 8 =
// 136 times that comes off).
struct FloatPolicy {
  using Acc = __m512;
  struct Block { float sum; };
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512 centered(Acc acc, const Block& b) {
    return _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), _mm512_set1_ps(b.sum), acc);
  }
  template <class Policy, class T>
  static void sum_blocks(XRows<Policy>& xr, const T* x, int64_t x_stride, int m, int64_t k) {
    const int64_t blocks = k / xr.step;
    xr.blocks.resize(size_t(m) * blocks);
    for (int r = 0; r < m; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        float s = 0.f;
        for (int64_t i = b * xr.step; i < (b + 1) * xr.step; ++i) s += accel::to_float(x[r * x_stride + i]);
        xr.blocks[r * blocks + b] = {s};
      }
  }
};

#ifdef __AVX512BF16__
struct Bf16Dot : FloatPolicy {
  using XElem = accel::bf16;  // x as the kernel reads it: bf16 pairs as they are
  struct Index { __m512i pairs; };
  struct Weights { __m512bh pairs; };
  struct X { __m512bh pair; };
  static XRows<Bf16Dot> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                int64_t group) {
    XRows<Bf16Dot> xr{x, x_stride, group, {}, {}};
    sum_blocks(xr, x, x_stride, m, k);
    return xr;
  }
  // row r's codes at bytes 4r and 4r+2; the masked-off odd bytes take 0x43
  static Index index(int first) { return {code_index(first, 0, 2)}; }
  static Weights weights(__m512i codes, const Index& index) {
    return {(__m512bh)_mm512_mask_permutexvar_epi8(_mm512_set1_epi8(0x43), 0x5555555555555555ull,
                                                   index.pairs, codes)};
  }
  static X x(const accel::bf16* row, int64_t kk) {
    uint32_t pair;
    std::memcpy(&pair, row + kk, 4);
    return {(__m512bh)_mm512_set1_epi32(int(pair))};
  }
  static Acc madd(Acc acc, const Weights& w, const X& x) { return _mm512_dpbf16_ps(acc, w.pairs, x.pair); }
};
#endif

struct Fp32Fma : FloatPolicy {
  using XElem = float;  // x converted once per call: broadcasts straight from memory
  struct Index { __m512i k0, k1; };
  struct Weights { __m512 k0, k1; };
  struct X { __m512 k0, k1; };
  static XRows<Fp32Fma> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                int64_t group) {
    XRows<Fp32Fma> xr{nullptr, k, group, std::vector<float>(size_t(m) * k), {}};
    for (int r = 0; r < m; ++r)
      for (int64_t i = 0; i < k; ++i) xr.storage[r * k + i] = accel::to_float(x[r * x_stride + i]);
    xr.rows = xr.storage.data();
    sum_blocks(xr, x, x_stride, m, k);
    return xr;
  }
  // row r's code at byte 4r+2 of its lane; the other bytes keep 0x43000000's
  static Index index(int first) { return {code_index(first, 2, -1), code_index(first, -1, 2)}; }
  static __m512 column(__m512i codes, __m512i index) {
    return _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(
        _mm512_set1_epi32(0x43000000), 0x4444444444444444ull, index, codes));
  }
  static Weights weights(__m512i codes, const Index& index) {
    return {column(codes, index.k0), column(codes, index.k1)};
  }
  static X x(const float* row, int64_t kk) { return {_mm512_set1_ps(row[kk]), _mm512_set1_ps(row[kk + 1])}; }
  static Acc madd(Acc acc, const Weights& w, const X& x) {
    return _mm512_fmadd_ps(w.k1, x.k1, _mm512_fmadd_ps(w.k0, x.k0, acc));
  }
};

// float32 x (float32 models): Fp32Fma's FMAs on x read in place, with each code centered
// first (128+q less 136 is q-8, exact), so no 136 * sum_k x comes off the sums
// afterwards: summing x*(128+q) and then cancelling most of it would leave the result
// ~7 bits short of float32 math, which the float32 outputs would show.
struct Fp32Centered : Fp32Fma {
  static XRows<Fp32Centered> prepare(const float* x, int64_t x_stride, int m, int64_t k,
                                     int64_t group) {
    XRows<Fp32Centered> xr{x, x_stride, group, {}, {}};
    sum_blocks(xr, x, x_stride, m, k);
    return xr;
  }
  static Weights weights(__m512i codes, const Index& index) {
    const __m512 bias = _mm512_set1_ps(136.0f);
    return {_mm512_sub_ps(column(codes, index.k0), bias),
            _mm512_sub_ps(column(codes, index.k1), bias)};
  }
  static __m512 centered(Acc acc, const Block&) { return acc; }
};

#ifdef __AVX512VNNI__
// x in int16 fixed point, one scale per block of at most 128 columns of a group
// (see the top of this file).
struct I16Dot {
  static constexpr float kNaN = __builtin_nanf("");  // a block with NaN or inf: NaN outputs
  using XElem = int16_t;
  using Acc = __m512i;
  struct Block { float scale, sum; int32_t offset; };  // sum = scale*sum X, offset = 8*sum X
  struct Index { __m512i pairs; };
  struct Weights { __m512i pairs; };
  struct X { __m512i pair; };
  static constexpr int64_t kMaxStep = 128;  // 128 * 15 * 32767 < 2**31: int32 sums cannot wrap
  static XRows<I16Dot> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                               int64_t group) {
    int64_t step = std::min(group, kMaxStep);
    while (group % step || step % 2) --step;  // blocks tile the group (even: column pairs)
    XRows<I16Dot> xr{nullptr, k, step, std::vector<int16_t>(size_t(m) * k), {}};
    const int64_t blocks = k / step;
    xr.blocks.resize(size_t(m) * blocks);
    for (int r = 0; r < m; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const accel::bf16* src = x + r * x_stride + b * step;
        int16_t* dst = xr.storage.data() + r * k + b * step;
        // the largest |x| by its bits (NaN and inf above every finite value, which a
        // float max under -ffast-math would not promise)
        uint16_t peak_bits = 0;
        for (int64_t i = 0; i < step; ++i) peak_bits = std::max<uint16_t>(peak_bits, src[i].bits & 0x7fff);
        if (peak_bits >= 0x7f80) {  // NaN or inf: no codes, NaN out of the block's scale
          std::fill(dst, dst + step, int16_t(0));
          xr.blocks[r * blocks + b] = {kNaN, kNaN, 0};
          continue;
        }
        const float peak = accel::to_float(accel::bf16{peak_bits});
        const float scale = peak_bits ? peak / 32767.f : 1.f;
        int32_t total = 0;
        for (int64_t i = 0; i < step; ++i) {
          // (clamped: a subnormal scale is inexact, and the peak could round to 32768)
          const long code = std::lrintf(accel::to_float(src[i]) / scale);
          dst[i] = int16_t(std::clamp(code, -32767L, 32767L));
          total += dst[i];
        }
        xr.blocks[r * blocks + b] = {scale, scale * float(total), 8 * total};
      }
    xr.rows = xr.storage.data();
    return xr;
  }
  static Acc zero() { return _mm512_setzero_si512(); }
  // row r's codes as the int16 pair (q[k], q[k+1]) of its lane; the other bytes zero
  static Index index(int first) { return {code_index(first, 0, 2)}; }
  static Weights weights(__m512i codes, const Index& index) {
    return {_mm512_maskz_permutexvar_epi8(0x5555555555555555ull, index.pairs, codes)};
  }
  static X x(const int16_t* row, int64_t kk) {
    uint32_t pair;
    std::memcpy(&pair, row + kk, 4);
    return {_mm512_set1_epi32(int(pair))};
  }
  static Acc madd(Acc acc, const Weights& w, const X& x) { return _mm512_dpwssd_epi32(acc, w.pairs, x.pair); }
  // scale * sum X (q - 8): exact in int32, one rounding to float32 (|sum| < 2**26), one
  // for the scale
  static __m512 centered(Acc acc, const Block& b) {
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, _mm512_set1_epi32(b.offset))),
                         _mm512_set1_ps(b.scale));
  }
};
#endif

// 16 (s, z) pairs at sz (x's element type: bf16 or float32) as 16 scales and 16 zeros
inline void load_pairs(const accel::bf16* sz, __m512& s, __m512& z) {
  const __m512i pairs = _mm512_loadu_si512((const void*)sz);
  s = bf16_lanes_low(pairs);
  z = bf16_lanes_high(pairs);
}
inline void load_pairs(const float* sz, __m512& s, __m512& z) {
  const __m512 a = _mm512_loadu_ps(sz), b = _mm512_loadu_ps(sz + 16);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  s = _mm512_permutex2var_ps(a, even, b);
  z = _mm512_permutex2var_ps(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
}

// out += s * centered + z * x_sum for 16 outputs, (s, z) pairs at sz
template <class T>
inline __m512 finish_block(__m512 out, __m512 centered, const T* sz, float x_sum) {
  __m512 s, z;
  load_pairs(sz, s, z);
  return _mm512_fmadd_ps(s, centered, _mm512_fmadd_ps(z, _mm512_set1_ps(x_sum), out));
}

inline void store16(__m512 v, accel::bf16* dst) {
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) accel::store(tmp[i], dst + i);
}
inline void store16(__m512 v, float* dst) { _mm512_storeu_ps(dst, v); }

template <class Madd, int M, class T>
void gemv_block(const XRows<Madd>& xr, const uint8_t* packed, const T* sz, T* y,
                int64_t y_stride, int64_t n0, int64_t n, int64_t k, int64_t group) {
  const uint8_t* block = packed + (n0 / kBlockN) * k * 32;
  const int64_t step = xr.step, blocks = k / step;
  __m512 out[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) out[m][j] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const typename Madd::Index first16 = Madd::index(0), second16 = Madd::index(16);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t g = b * step / group;
    typename Madd::Acc acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = Madd::zero();
    if ((b + 1) * step % group == 0 && g + 1 < k / group)  // the next group's 64 (s, z) pairs: 4-8 lines away from the stream
      for (int64_t line = 0; line < 128 * int64_t(sizeof(T)); line += 64)
        _mm_prefetch((const char*)(sz + 2 * ((g + 1) * n + n0)) + line, _MM_HINT_T0);
    for (int64_t kk = b * step; kk < (b + 1) * step; kk += 2) {
      _mm_prefetch((const char*)(block + kk * 32) + kPrefetchL1Bytes, _MM_HINT_T0);
      _mm_prefetch((const char*)(block + kk * 32) + kPrefetchL2Bytes, _MM_HINT_T1);
      const __m512i both = _mm512_loadu_si512((const void*)(block + kk * 32));  // k, k+1
      const __m512i lo = _mm512_and_si512(both, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(both, 4), nibble);
      typename Madd::X xk[M];
      for (int m = 0; m < M; ++m) xk[m] = Madd::x(xr.rows + m * xr.stride, kk);
      for (int j = 0; j < 4; ++j) {  // rows 0-15, 16-31 (low nibbles), 32-47, 48-63
        const typename Madd::Weights w = Madd::weights(j < 2 ? lo : hi, j % 2 ? second16 : first16);
        for (int m = 0; m < M; ++m) acc[m][j] = Madd::madd(acc[m][j], w, xk[m]);
      }
    }
    const T* gsz = sz + 2 * (g * n + n0);  // 64 (s, z) pairs
    for (int m = 0; m < M; ++m) {
      const typename Madd::Block& xb = xr.blocks[m * blocks + b];
      for (int j = 0; j < 4; ++j)
        out[m][j] = finish_block(out[m][j], Madd::centered(acc[m][j], xb), gsz + 32 * j, xb.sum);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) store16(out[m][j], y + m * y_stride + n0 + 16 * j);
}

// Threads only for weights of 2**20 codes and more: below that one pass is a few
// microseconds, about what waking the OpenMP team costs.
constexpr int64_t kParallelMinWeights = int64_t(1) << 20;

template <class Madd, int M, class T>
void gemv(const T* x, int64_t x_stride, const uint8_t* packed, const T* sz, T* y,
          int64_t y_stride, int64_t n, int64_t k, int64_t group) {
  const XRows<Madd> xr = Madd::prepare(x, x_stride, M, k, group);
#pragma omp parallel for schedule(static) if (n * k >= kParallelMinWeights)
  for (int64_t n0 = 0; n0 < n; n0 += kBlockN)
    gemv_block<Madd, M>(xr, packed, sz, y, y_stride, n0, n, k, group);
}

// Larger batches (up to kMaxBatch rows of x): one 16-output slab of a 64-output block
// at a time against MR rows of x (from row r0), so the accumulators fit in registers
// (2*MR + a few); the block's bytes are read once per slab and row chunk, from L1/L2
// after the first.
template <class Madd, int MR, class T>
void slab_rows(const XRows<Madd>& xr, int r0, const uint8_t* block, const T* sz, T* y,
               int64_t y_stride, int64_t n0, int64_t n, int64_t k, int64_t group, int slab) {
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const typename Madd::Index index = Madd::index(slab % 2 ? 16 : 0);
  const bool high = slab >= 2;
  const int64_t step = xr.step, blocks = k / step;
  const typename Madd::XElem* x = xr.rows + r0 * xr.stride;
  __m512 out[MR];
  for (int m = 0; m < MR; ++m) out[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    typename Madd::Acc acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = Madd::zero();
    for (int64_t kk = b * step; kk < (b + 1) * step; kk += 2) {
      const __m512i both = _mm512_loadu_si512((const void*)(block + kk * 32));  // k, k+1
      const __m512i codes = _mm512_and_si512(high ? _mm512_srli_epi16(both, 4) : both, nibble);
      const typename Madd::Weights w = Madd::weights(codes, index);
      for (int m = 0; m < MR; ++m) acc[m] = Madd::madd(acc[m], w, Madd::x(x + m * xr.stride, kk));
    }
    const T* gsz = sz + 2 * ((b * step / group) * n + n0 + 16 * slab);
    for (int m = 0; m < MR; ++m) {
      const typename Madd::Block& xb = xr.blocks[(r0 + m) * blocks + b];
      out[m] = finish_block(out[m], Madd::centered(acc[m], xb), gsz, xb.sum);
    }
  }
  for (int m = 0; m < MR; ++m) store16(out[m], y + (r0 + m) * y_stride + n0 + 16 * slab);
}

template <class Madd, int MR, class T>
void slab_chunk(const XRows<Madd>& xr, int r0, const uint8_t* block, const T* sz, T* y,
                int64_t y_stride, int64_t n0, int64_t n, int64_t k, int64_t group, int slab,
                int rows) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      slab_chunk<Madd, MR - 1>(xr, r0, block, sz, y, y_stride, n0, n, k, group, slab, rows);
      return;
    }
  }
  slab_rows<Madd, MR>(xr, r0, block, sz, y, y_stride, n0, n, k, group, slab);
}

template <class Madd, class T>
void gemm_slabs(const T* x, int64_t x_stride, const uint8_t* packed, const T* sz, T* y,
                int64_t y_stride, int m, int64_t n, int64_t k, int64_t group) {
  constexpr int kChunk = 8;
  const XRows<Madd> xr = Madd::prepare(x, x_stride, m, k, group);
  // (each weight costs a slab pass per 8-row chunk: threads pay off 8x sooner)
#pragma omp parallel for schedule(static) if (n * k >= kParallelMinWeights / 8)
  for (int64_t n0 = 0; n0 < n; n0 += kBlockN) {
    const uint8_t* block = packed + (n0 / kBlockN) * k * 32;
    for (int slab = 0; slab < 4; ++slab)
      for (int r0 = 0; r0 < m; r0 += kChunk)
        slab_chunk<Madd, kChunk>(xr, r0, block, sz, y, y_stride, n0, n, k, group, slab,
                                 std::min(kChunk, m - r0));
  }
}

template <class Madd, class T>
void run(const T* x, int64_t x_stride, const uint8_t* packed, const T* sz, T* y,
         int64_t y_stride, int m, int64_t n, int64_t k, int64_t group) {
  switch (m) {
    case 1: gemv<Madd, 1>(x, x_stride, packed, sz, y, y_stride, n, k, group); break;
    case 2: gemv<Madd, 2>(x, x_stride, packed, sz, y, y_stride, n, k, group); break;
    case 3: gemv<Madd, 3>(x, x_stride, packed, sz, y, y_stride, n, k, group); break;
    case 4: gemv<Madd, 4>(x, x_stride, packed, sz, y, y_stride, n, k, group); break;
    default: gemm_slabs<Madd>(x, x_stride, packed, sz, y, y_stride, m, n, k, group); break;
  }
}

#if defined(ACCEL_AMX_TILES) && defined(__AVX512BF16__)
// Batches of kAmxMinRows rows or more where the CPU has AMX: the weight dequantized to
// bf16 (W = (q - 8) * s + z in float32, one rounding to bf16) a chunk of 32-output
// blocks at a time, straight into the B operand's pair layout, and the rows of x as A
// tiles read in place; TDPBF16PS sums in float32, one rounding to bf16 at the store.
// The tiles' sums are 16 rows of x by 16 outputs, so they go out as rows (no
// transpose). Against the paths above, each weight is rounded to bf16 once (at most
// 2^-9 of it, the size of x's own rounding); the dequantization costs a pass over the
// weights per call, which a batch of kAmxMinRows rows outweighs (an Intel Xeon with
// AMX, one core, the default model's 30 layers, below).
// torch's kernel, which took batches above 64 rows, runs float32 FMAs: a compiled
// W4A16 engine ran W1 (64 x 128 in / 128 out) at 142 tok/s against the bf16 engine's
// 463 (460 with these tiles).
namespace amx4 {

constexpr int kTile = 16;
constexpr int64_t kStepK = 32;  // columns of an x tile (16 pairs of a weight tile)
constexpr int64_t kChunk = 8;   // 32-output blocks dequantized at a time (K = 1536: 768 KiB)
// (the 30 layers, one core, this path vs the BF16 dot products: 8 rows 30.1 vs 29.9 ms,
// 12 rows 32.7 vs 42.3, 64 rows 39.8 vs 196; 1 row 30.5 vs 5.7)
constexpr int64_t kAmxMinRows = 12;

// Outputs 16t..16t+15 of 32-output block c at column kk, dequantized with their
// group's scales s and zeros z: byte i of a 64-output block's column holds its output i
// (low nibble) and 32 + i (high).
inline __m512 column(const uint8_t* packed, int64_t k, int64_t c, int t, int64_t kk, __m512 s,
                     __m512 z) {
  const uint8_t* bytes = packed + ((c / 2) * k + kk) * 32 + 16 * t;
  __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  q = _mm512_and_si512(_mm512_srli_epi32(q, (c % 2) * 4), _mm512_set1_epi32(15));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(8))), s, z);
}

// Block c in the B layout: for column step st and output half t, wb[((st * 2 + t) * 16
// + p) * 16 + j] = the bf16 pair (W[32c + 16t + j][32st + 2p], W[..][32st + 2p + 1]),
// zero past k (k is even: a multiple of the even group).
void dequantize_block(const uint8_t* packed, const uint32_t* sz, int64_t n, int64_t k,
                      int64_t group, int64_t c, int64_t steps, uint32_t* wb) {
  for (int t = 0; t < 2; ++t) {
    int64_t g = -1;  // the group whose scales and zeros s, z hold
    __m512 s = _mm512_setzero_ps(), z = s;
    for (int64_t st = 0; st < steps; ++st)
      for (int p = 0; p < 16; ++p) {
        const int64_t kk = st * kStepK + 2 * p;
        __m512i pair = _mm512_setzero_si512();
        if (kk < k) {
          if (kk / group != g) {  // (kk and kk + 1 share a group: it is even)
            g = kk / group;
            const __m512i sz16 = _mm512_loadu_si512(sz + g * n + c * 32 + 16 * t);
            s = _mm512_castsi512_ps(_mm512_slli_epi32(sz16, 16));
            z = _mm512_castsi512_ps(_mm512_and_si512(sz16, _mm512_set1_epi32(int(0xffff0000u))));
          }
          const __m256i lo = (__m256i)_mm512_cvtneps_pbh(column(packed, k, c, t, kk, s, z));
          const __m256i hi = (__m256i)_mm512_cvtneps_pbh(column(packed, k, c, t, kk + 1, s, z));
          pair = _mm512_or_si512(_mm512_cvtepu16_epi32(lo),
                                 _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
        }
        _mm512_store_si512(wb + ((st * 2 + t) * 16 + p) * 16, pair);
      }
  }
}

// The sums of x tiles (NX: 1-2, from `a`) by the two weight tiles of one block (wb).
template <int NX>
void tiles(const accel::bf16* a, int64_t a_stride, const uint32_t* wb, int64_t steps) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NX > 1) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t a_bytes = a_stride * 2;
  for (int64_t st = 0; st < steps; ++st) {
    _tile_loadd(4, a + st * kStepK, a_bytes);
    if constexpr (NX > 1) _tile_loadd(5, a + kTile * a_stride + st * kStepK, a_bytes);
    _tile_loadd(6, wb + st * 2 * 256, 64);
    _tile_loadd(7, wb + (st * 2 + 1) * 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (NX > 1) {
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// A sums tile (16 rows of x by 16 outputs) into y's rows row.. (rows of them).
void store_rows(const float* sums, accel::bf16* y, int64_t y_stride, int64_t row, int64_t rows,
                int64_t n0) {
  for (int64_t j = 0; j < rows; ++j)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (row + j) * y_stride + n0),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sums + j * kTile)));
}

void gemm(const accel::bf16* x, int64_t x_stride, const uint8_t* packed, const uint32_t* sz,
          accel::bf16* y, int64_t y_stride, int64_t m, int64_t n, int64_t k, int64_t group) {
  const int64_t steps = (k + kStepK - 1) / kStepK, kp = steps * kStepK, blocks = n / 32;
  // x tiles are read in place where k fills whole steps, but for the last rows of a
  // partial pair; those (or, with a partial step, all rows) from a zero-padded copy
  const bool in_place = k == kp;
  const int64_t pad_from = in_place ? m / 32 * 32 : 0;
  std::vector<accel::bf16> xpad(size_t((m - pad_from + 31) / 32 * 32) * size_t(kp));
  for (int64_t r = pad_from; r < m; ++r)
    std::memcpy(xpad.data() + (r - pad_from) * kp, x + r * x_stride, size_t(k) * 2);
#pragma omp parallel
  {
    accel::amx::configure();
    const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t first = blocks * thread / threads, end = blocks * (thread + 1) / threads;
    std::vector<uint32_t> wb(size_t(kChunk * steps * 2 * 256) + 16);
    uint32_t* wba = wb.data() + (16 - reinterpret_cast<uintptr_t>(wb.data()) / 4 % 16) % 16;
    for (int64_t c0 = first; c0 < end; c0 += kChunk) {
      const int64_t c1 = std::min(end, c0 + kChunk);
      for (int64_t c = c0; c < c1; ++c)
        dequantize_block(packed, sz, n, k, group, c, steps, wba + (c - c0) * steps * 512);
      for (int64_t row = 0; row < m; row += 32) {
        const bool padded = row >= pad_from;
        const accel::bf16* a = padded ? xpad.data() + (row - pad_from) * kp : x + row * x_stride;
        const int64_t a_stride = padded ? kp : x_stride, left = m - row;
        for (int64_t c = c0; c < c1; ++c) {
          const uint32_t* block = wba + (c - c0) * steps * 512;
          alignas(64) float sums[4][kTile * kTile];
          if (left > kTile) {
            tiles<2>(a, a_stride, block, steps);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
          } else {
            tiles<1>(a, a_stride, block, steps);
          }
          _tile_stored(0, sums[0], 64);
          _tile_stored(1, sums[1], 64);
          const int64_t first_rows = std::min<int64_t>(kTile, left);
          store_rows(sums[0], y, y_stride, row, first_rows, c * 32);
          store_rows(sums[1], y, y_stride, row, first_rows, c * 32 + 16);
          if (left > kTile) {
            const int64_t second = std::min<int64_t>(kTile, left - kTile);
            store_rows(sums[2], y, y_stride, row + kTile, second, c * 32);
            store_rows(sums[3], y, y_stride, row + kTile, second, c * 32 + 16);
          }
        }
      }
    }
    _tile_release();
  }
}

}  // namespace amx4
#endif  // ACCEL_AMX_TILES && __AVX512BF16__

}  // namespace
#endif  // __AVX512F__ && __AVX512VBMI__

// Variants (accel_int4pack_gemv's `variant`; bits of accel_int4pack_gemv_available())
enum : int { kBest = 0, kFp32Fma = 1, kBf16Dot = 2, kI16Dot = 4, kAmx = 8 };

extern "C" {

// Which variants this build has (the CPU's extensions): bit kFp32Fma with AVX-512F and
// AVX512-VBMI, bit kBf16Dot with AVX512-BF16 as well, bit kI16Dot with AVX512-VNNI as
// well, bit kAmx where this build and this process have AMX tiles; 0 without.
int accel_int4pack_gemv_available() {
  int variants = 0;
#ifdef ACCEL_INT4_GEMV
  variants |= kFp32Fma;
#if defined(ACCEL_AMX_TILES) && defined(__AVX512BF16__)
  if (accel::amx::ready()) variants |= kAmx;
#endif
#ifdef __AVX512BF16__
  variants |= kBf16Dot;
#endif
#ifdef __AVX512VNNI__
  variants |= kI16Dot;
#endif
#endif
  return variants;
}

// Rows of x from which kBest runs the AMX tiles; 0 where this build or this process
// lacks them.
int accel_int4pack_amx_rows() {
#if defined(ACCEL_INT4_GEMV) && defined(ACCEL_AMX_TILES) && defined(__AVX512BF16__)
  return accel::amx::ready() ? int(amx4::kAmxMinRows) : 0;
#else
  return 0;
#endif
}

// y[M, N] (bf16, row stride y_stride) = x[M, K] (bf16, row stride x_stride) @ W.T for
// M in 1..64 (up to 4 streamed, more by 16-output slabs), or any M on the AMX tiles, N
// a multiple of 64, K a multiple of group, group even. `variant`: kBest (the AMX tiles
// from kAmxMinRows rows where built, else BF16 dot products where built, else int16 dot
// products where built, else float32 FMAs) or one of them (the tests run each).
// Returns 0, -1 for shapes it does not take, -5 for a variant this build lacks.
int accel_int4pack_gemv(const void* x, int64_t x_stride, const void* packed,
                        const void* scales_zeros, void* y, int64_t y_stride, int32_t m,
                        int64_t n, int64_t k, int64_t group, int32_t variant) {
  const int built = accel_int4pack_gemv_available();
  if (variant == kBest)
    variant = built & kAmx && m >= accel_int4pack_amx_rows() ? kAmx
              : built & kBf16Dot                              ? kBf16Dot
              : built & kI16Dot                               ? kI16Dot
                                                              : kFp32Fma;
  if (!(built & variant) ||
      (variant != kFp32Fma && variant != kBf16Dot && variant != kI16Dot && variant != kAmx))
    return -5;
#ifdef ACCEL_INT4_GEMV
  if (m < 1 || (m > kMaxBatch && variant != kAmx) || n % kBlockN || group < 2 || group % 2 ||
      k % group)
    return -1;
  const auto* xb = static_cast<const accel::bf16*>(x);
  const auto* pk = static_cast<const uint8_t*>(packed);
  const auto* sz = static_cast<const accel::bf16*>(scales_zeros);
  auto* yb = static_cast<accel::bf16*>(y);
#if defined(ACCEL_AMX_TILES) && defined(__AVX512BF16__)
  if (variant == kAmx) {
    amx4::gemm(xb, x_stride, pk, static_cast<const uint32_t*>(scales_zeros), yb, y_stride, m, n,
               k, group);
    return 0;
  }
#endif
#ifdef __AVX512BF16__
  if (variant == kBf16Dot) {
    run<Bf16Dot>(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group);
    return 0;
  }
#endif
#ifdef __AVX512VNNI__
  if (variant == kI16Dot) {
    run<I16Dot>(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group);
    return 0;
  }
#endif
  run<Fp32Fma>(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group);
  return 0;
#else
  (void)x, (void)x_stride, (void)packed, (void)scales_zeros, (void)y, (void)y_stride, (void)m,
      (void)n, (void)k, (void)group;
  return -5;
#endif
}

// The same product for float32 x, (s, z) pairs and y (a float32 model's layers), any M:
// float32 FMAs on x read in place, each code centered before its product (Fp32Centered),
// so the sums carry float32 math's own rounding. torch's kernel for float32 runs ~70x
// slower than for bf16 (8 rows of a 1536x576 layer: 19.8 vs 0.27 ms, torch 2.13, one
// core). Returns 0, -1 for shapes it does not take, -5 where this build lacks AVX-512F
// and AVX512-VBMI.
int accel_int4pack_gemv_f32(const float* x, int64_t x_stride, const void* packed,
                            const float* scales_zeros, float* y, int64_t y_stride, int32_t m,
                            int64_t n, int64_t k, int64_t group) {
#ifdef ACCEL_INT4_GEMV
  if (m < 1 || n % kBlockN || group < 2 || group % 2 || k % group) return -1;
  run<Fp32Centered>(x, x_stride, static_cast<const uint8_t*>(packed), scales_zeros, y, y_stride,
                    m, n, k, group);
  return 0;
#else
  return -5;  // (unused parameters draw no warning without -Wextra)
#endif
}

}  // extern "C"
