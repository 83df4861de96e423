// Int4 weight x bf16 activations on torch's CPU int4 weight layouts (the ones
// torch.ops.aten._convert_weight_to_int4pack_for_cpu makes on AVX-512 and on AVX2, and
// the torch_fast provider keeps resident), compiled at first use (see
// cpu_native/build.py): decode-sized batches (1-64 rows of x) by AVX-512 (with VBMI),
// and, where the CPU has AMX, any batch from 12 rows on the tiles; on CPUs with AVX2 +
// FMA but not AVX-512 VBMI, by AVX2 (the last section).
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

namespace {

// x as a policy reads it: per row, the elements (`rows`, row stride `stride`) and, per
// block of `step` columns, what finishing that block needs (a Block).
template <class XElem, class Block>
struct XRows {
  const XElem* rows;
  int64_t stride;
  int64_t step;
  std::vector<XElem> storage;
  std::vector<Block> blocks;  // [m][K / step]
};

// The float policies' block: a whole group, summed into float32 lanes of codes;
// finishing it needs the sum of x over it (the codes' bias times that comes off).
struct FloatBlock { float sum; };

template <class XElem, class T>
void sum_blocks(XRows<XElem, FloatBlock>& xr, const T* x, int64_t x_stride, int m, int64_t k) {
  const int64_t blocks = k / xr.step;
  xr.blocks.resize(size_t(m) * blocks);
  for (int r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      float s = 0.f;
      for (int64_t i = b * xr.step; i < (b + 1) * xr.step; ++i) s += accel::to_float(x[r * x_stride + i]);
      xr.blocks[r * blocks + b] = {s};
    }
}

// x converted to float32 once per call (the float policies broadcast it straight from
// memory), with its sums per group.
inline XRows<float, FloatBlock> float_rows(const accel::bf16* x, int64_t x_stride, int m,
                                           int64_t k, int64_t group) {
  XRows<float, FloatBlock> xr{nullptr, k, group, std::vector<float>(size_t(m) * k), {}};
  for (int r = 0; r < m; ++r)
    for (int64_t i = 0; i < k; ++i) xr.storage[r * k + i] = accel::to_float(x[r * x_stride + i]);
  xr.rows = xr.storage.data();
  sum_blocks(xr, x, x_stride, m, k);
  return xr;
}

// x in int16 fixed point, one scale per block of at most max_step columns of a group
// (the int16 dot policies: see the top of this file). sum = scale * sum X, offset =
// 8 * sum X (the codes' zero point 8 times the integer sum).
struct I16Block { float scale, sum; int32_t offset; };

XRows<int16_t, I16Block> quantize16(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                    int64_t group, int64_t max_step) {
  constexpr float kNaN = __builtin_nanf("");  // a block with NaN or inf: NaN outputs
  int64_t step = std::min(group, max_step);
  while (group % step || step % 2) --step;  // blocks tile the group (even: column pairs)
  XRows<int16_t, I16Block> xr{nullptr, k, step, std::vector<int16_t>(size_t(m) * k), {}};
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

}  // namespace

#if defined(__AVX512F__) && defined(__AVX512VBMI__)
#define ACCEL_INT4_GEMV 1

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

template <class Policy>
using XRowsOf = XRows<typename Policy::XElem, typename Policy::Block>;

// What the float policies share: a block is a whole group, summed into float32 lanes
// of 128+q codes; finishing it needs the sum of x over it (the code bias 128 + zero 8 =
// 136 times that comes off).
struct FloatPolicy {
  using Acc = __m512;
  using Block = FloatBlock;
  static Acc zero() { return _mm512_setzero_ps(); }
  static __m512 centered(Acc acc, const Block& b) {
    return _mm512_fnmadd_ps(_mm512_set1_ps(136.0f), _mm512_set1_ps(b.sum), acc);
  }
};

#ifdef __AVX512BF16__
struct Bf16Dot : FloatPolicy {
  using XElem = accel::bf16;  // x as the kernel reads it: bf16 pairs as they are
  struct Index { __m512i pairs; };
  struct Weights { __m512bh pairs; };
  struct X { __m512bh pair; };
  static XRowsOf<Bf16Dot> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                int64_t group) {
    XRowsOf<Bf16Dot> xr{x, x_stride, group, {}, {}};
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
  static XRowsOf<Fp32Fma> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                int64_t group) {
    return float_rows(x, x_stride, m, k, group);
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
  static XRowsOf<Fp32Centered> prepare(const float* x, int64_t x_stride, int m, int64_t k,
                                     int64_t group) {
    XRowsOf<Fp32Centered> xr{x, x_stride, group, {}, {}};
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
  using XElem = int16_t;
  using Acc = __m512i;
  using Block = I16Block;
  struct Index { __m512i pairs; };
  struct Weights { __m512i pairs; };
  struct X { __m512i pair; };
  static constexpr int64_t kMaxStep = 128;  // 128 * 15 * 32767 < 2**31: int32 sums cannot wrap
  static XRowsOf<I16Dot> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                 int64_t group) {
    return quantize16(x, x_stride, m, k, group, kMaxStep);
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
void gemv_block(const XRowsOf<Madd>& xr, const uint8_t* packed, const T* sz, T* y,
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
  const XRowsOf<Madd> xr = Madd::prepare(x, x_stride, M, k, group);
#pragma omp parallel for schedule(static) if (n * k >= kParallelMinWeights)
  for (int64_t n0 = 0; n0 < n; n0 += kBlockN)
    gemv_block<Madd, M>(xr, packed, sz, y, y_stride, n0, n, k, group);
}

// Larger batches (up to kMaxBatch rows of x): one 16-output slab of a 64-output block
// at a time against MR rows of x (from row r0), so the accumulators fit in registers
// (2*MR + a few); the block's bytes are read once per slab and row chunk, from L1/L2
// after the first.
template <class Madd, int MR, class T>
void slab_rows(const XRowsOf<Madd>& xr, int r0, const uint8_t* block, const T* sz, T* y,
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
void slab_chunk(const XRowsOf<Madd>& xr, int r0, const uint8_t* block, const T* sz, T* y,
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
  const XRowsOf<Madd> xr = Madd::prepare(x, x_stride, m, k, group);
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

#elif defined(ACCEL_AVX2)
// AVX2 + FMA (CPUs without AVX-512, or without AVX512-VBMI): torch's AVX2 int4 layout
// (blocks of 32 outputs: packed[N/32][K][16], byte i of (block, k) holding output
// 32*block+i in its low nibble and 32*block+16+i in its high one) or its AVX-512 one
// (above), both read in units of 32 outputs: 16 bytes of each column, whose low nibbles
// hold 16 consecutive outputs and whose high nibbles the 16 `high` outputs after them.
// Two policies, per pair of columns (k, k+1) and unit:
// - I16Madd (bf16 x): x in int16 fixed point per block of up to 128 columns, as I16Dot
//   above; an output's two codes one int16 pair, one VPMADDWD + VPADDD per 8 outputs:
//   exact int32 sums.
// - F32Centered (float32 x; bf16 x as a variant): each code widened to float32 q - 8
//   (exact), one FMA per 8 outputs and column: float32 math's rounding.
#define ACCEL_INT4_GEMV 1

namespace {

constexpr int kMaxBatch = 64;
constexpr int64_t kPrefetchL1Bytes = 2048, kPrefetchL2Bytes = 8192;  // as the AVX-512 GEMV

template <class Policy>
using XRowsOf = XRows<typename Policy::XElem, typename Policy::Block>;

// Unit u of 32 outputs in a layout of blocks of block_n (32 or 64) outputs.
struct Unit {
  const uint8_t* codes;  // column 0's 16 bytes
  int64_t col_stride;    // bytes from a column to the next
  int64_t row0, high;    // outputs row0 + i (low nibbles) and row0 + high + i (high)
  Unit(const uint8_t* packed, int block_n, int64_t u, int64_t k)
      : col_stride(block_n / 2), high(block_n / 2) {
    const int64_t block = u * 32 / block_n, half = u % (block_n / 32);
    codes = packed + block * k * col_stride + 16 * half;
    row0 = block * block_n + 16 * half;
  }
  // the first output of accumulator j (0-3: 8 outputs each, in order)
  int64_t row(int j) const { return row0 + (j >= 2 ? high : 0) + 8 * (j % 2); }
};

struct I16Madd {
  using XElem = int16_t;
  using Acc = __m256i;
  using Block = I16Block;
  static constexpr int64_t kMaxStep = 128;  // 128 * 15 * 32767 < 2**31: int32 sums cannot wrap
  static XRowsOf<I16Madd> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                  int64_t group) {
    return quantize16(x, x_stride, m, k, group, kMaxStep);
  }
  // int16 pairs (code k, code k+1) of outputs 0-3 and 8-11 (w[0]), 4-7 and 12-15 (w[1]),
  // the same for the high nibbles (w[2], w[3])
  struct Weights { __m256i w[4]; };
  static Weights weights(const uint8_t* ck, const uint8_t* ck1) {
    const __m256i both = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ck))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(ck1)), 1);
    const __m256i nibble = _mm256_set1_epi8(0x0f), zero = _mm256_setzero_si256();
    // [k 0-7, k+1 0-7 | k 8-15, k+1 8-15], then byte pairs (k i, k+1 i) per 128-bit lane
    const __m256i pairs = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    const __m256i lo = _mm256_shuffle_epi8(
        _mm256_permute4x64_epi64(_mm256_and_si256(both, nibble), 0xD8), pairs);
    const __m256i hi = _mm256_shuffle_epi8(
        _mm256_permute4x64_epi64(_mm256_and_si256(_mm256_srli_epi16(both, 4), nibble), 0xD8),
        pairs);
    return {{_mm256_unpacklo_epi8(lo, zero), _mm256_unpackhi_epi8(lo, zero),
             _mm256_unpacklo_epi8(hi, zero), _mm256_unpackhi_epi8(hi, zero)}};
  }
  struct X { __m256i pair; };
  static X x(const int16_t* row, int64_t kk) {
    uint32_t pair;
    std::memcpy(&pair, row + kk, 4);
    return {_mm256_set1_epi32(int(pair))};
  }
  static void madd(Acc acc[4], const Weights& w, const X& x) {
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(w.w[j], x.pair));
  }
  static Acc zero() { return _mm256_setzero_si256(); }
  // scale * sum X (q - 8) of the 4 x 8 outputs in order: exact in int32, one rounding
  // to float32 (|sum| < 2**26), one for the scale
  static void centered(const Acc acc[4], const Block& b, __m256 out[4]) {
    const __m256i offset = _mm256_set1_epi32(b.offset);
    const __m256 scale = _mm256_set1_ps(b.scale);
    for (int h = 0; h < 2; ++h) {
      const __m256i first = _mm256_permute2x128_si256(acc[2 * h], acc[2 * h + 1], 0x20);
      const __m256i second = _mm256_permute2x128_si256(acc[2 * h], acc[2 * h + 1], 0x31);
      out[2 * h] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(first, offset)), scale);
      out[2 * h + 1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(second, offset)), scale);
    }
  }
};

struct F32Centered {
  using XElem = float;
  using Acc = __m256;
  using Block = FloatBlock;
  static XRowsOf<F32Centered> prepare(const float* x, int64_t x_stride, int m, int64_t k,
                                      int64_t group) {
    XRowsOf<F32Centered> xr{x, x_stride, group, {}, {}};
    sum_blocks(xr, x, x_stride, m, k);
    return xr;
  }
  static XRowsOf<F32Centered> prepare(const accel::bf16* x, int64_t x_stride, int m, int64_t k,
                                      int64_t group) {
    return float_rows(x, x_stride, m, k, group);
  }
  // float32 q - 8 of outputs 0-7, 8-15 (low nibbles), 0-7, 8-15 (high) of columns k, k+1
  struct Weights { __m256 k0[4], k1[4]; };
  static void column(const uint8_t* c, __m256 w[4]) {
    const __m256i eight = _mm256_set1_epi32(8), nibble = _mm256_set1_epi32(15);
    for (int half = 0; half < 2; ++half) {
      const __m256i bytes =
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + 8 * half)));
      w[half] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(bytes, nibble), eight));
      w[2 + half] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight));
    }
  }
  static Weights weights(const uint8_t* ck, const uint8_t* ck1) {
    Weights w;
    column(ck, w.k0);
    column(ck1, w.k1);
    return w;
  }
  struct X { __m256 k0, k1; };
  static X x(const float* row, int64_t kk) { return {_mm256_set1_ps(row[kk]), _mm256_set1_ps(row[kk + 1])}; }
  static void madd(Acc acc[4], const Weights& w, const X& x) {
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(w.k1[j], x.k1, _mm256_fmadd_ps(w.k0[j], x.k0, acc[j]));
  }
  static Acc zero() { return _mm256_setzero_ps(); }
  static void centered(const Acc acc[4], const Block&, __m256 out[4]) {
    for (int j = 0; j < 4; ++j) out[j] = acc[j];
  }
};

// 8 (s, z) pairs at sz as 8 scales and 8 zeros
inline void load_pairs(const accel::bf16* sz, __m256& s, __m256& z) {
  const __m256i pairs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sz));
  s = _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
  z = _mm256_castsi256_ps(_mm256_and_si256(pairs, _mm256_set1_epi32(int(0xffff0000u))));
}
inline void load_pairs(const float* sz, __m256& s, __m256& z) {
  const __m256 a = _mm256_loadu_ps(sz), b = _mm256_loadu_ps(sz + 8);
  // per 128-bit lane: (s0 s1 s4 s5 | s2 s3 s6 s7), then in order
  s = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  z = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

// Rows r0..r0+M-1 of x against one unit over all of K, into y.
template <class P, int M, class T>
void unit_rows(const XRowsOf<P>& xr, int r0, const Unit& unit, const T* sz, T* y,
               int64_t y_stride, int64_t n, int64_t k, int64_t group) {
  const int64_t step = xr.step, blocks = k / step, cs = unit.col_stride;
  __m256 out[M][4];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) out[m][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    typename P::Acc acc[M][4];
    for (int m = 0; m < M; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = P::zero();
    for (int64_t kk = b * step; kk < (b + 1) * step; kk += 2) {
      const uint8_t* ck = unit.codes + kk * cs;
      _mm_prefetch((const char*)ck + kPrefetchL1Bytes, _MM_HINT_T0);
      _mm_prefetch((const char*)ck + kPrefetchL2Bytes, _MM_HINT_T1);
      const typename P::Weights w = P::weights(ck, ck + cs);
      for (int m = 0; m < M; ++m) P::madd(acc[m], w, P::x(xr.rows + (r0 + m) * xr.stride, kk));
    }
    const T* gsz = sz + 2 * ((b * step / group) * n);
    for (int m = 0; m < M; ++m) {
      const typename P::Block& xb = xr.blocks[(r0 + m) * blocks + b];
      __m256 c[4];
      P::centered(acc[m], xb, c);
      const __m256 x_sum = _mm256_set1_ps(xb.sum);
      for (int j = 0; j < 4; ++j) {  // out += s * centered + z * sum(x)
        __m256 s, z;
        load_pairs(gsz + 2 * unit.row(j), s, z);
        out[m][j] = _mm256_fmadd_ps(s, c[j], _mm256_fmadd_ps(z, x_sum, out[m][j]));
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < 4; ++j) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, out[m][j]);
      T* dst = y + (r0 + m) * y_stride + unit.row(j);
      for (int i = 0; i < 8; ++i) accel::store(lanes[i], dst + i);
    }
}

// Rows of x per pass over a unit: 8 accumulators (I16Madd: and 4 weight vectors of the
// 16 registers).
constexpr int kPassRows = 2;
// Threads only for weights of 2**20 codes and more (as the AVX-512 GEMV), 8x sooner
// when each unit is read more than once.
constexpr int64_t kParallelMinWeights = int64_t(1) << 20;

template <class P, class T, class X>
void run(const X* x, int64_t x_stride, const uint8_t* packed, const T* sz, T* y,
         int64_t y_stride, int m, int64_t n, int64_t k, int64_t group, int block_n) {
  const XRowsOf<P> xr = P::prepare(x, x_stride, m, k, group);
  const int64_t units = n / 32;
  const int64_t min_weights = m > kPassRows ? kParallelMinWeights / 8 : kParallelMinWeights;
#pragma omp parallel for schedule(static) if (n * k >= min_weights)
  for (int64_t u = 0; u < units; ++u) {
    const Unit unit(packed, block_n, u, k);
    for (int r0 = 0; r0 < m; r0 += kPassRows) {
      if (m - r0 >= kPassRows) unit_rows<P, kPassRows>(xr, r0, unit, sz, y, y_stride, n, k, group);
      else unit_rows<P, 1>(xr, r0, unit, sz, y, y_stride, n, k, group);
    }
  }
}

}  // namespace
#endif  // AVX-512 + VBMI | AVX2

// Variants (accel_int4pack_gemv's `variant`; bits of accel_int4pack_gemv_available())
enum : int { kBest = 0, kFp32Fma = 1, kBf16Dot = 2, kI16Dot = 4, kAmx = 8 };

extern "C" {

// Which variants this build has (the CPU's extensions): on AVX-512 with VBMI bit
// kFp32Fma, kBf16Dot with AVX512-BF16 as well, kI16Dot with AVX512-VNNI as well, kAmx
// where this build and this process have AMX tiles; on AVX2 + FMA (without AVX-512 VBMI)
// kFp32Fma (F32Centered) and kI16Dot (I16Madd); 0 without either.
int accel_int4pack_gemv_available() {
  int variants = 0;
#ifdef ACCEL_INT4_GEMV
  variants |= kFp32Fma;
#if defined(ACCEL_AMX_TILES) && defined(__AVX512BF16__)
  if (accel::amx::ready()) variants |= kAmx;
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512BF16__)
  variants |= kBf16Dot;
#endif
#if !defined(__AVX512VBMI__) || defined(__AVX512VNNI__)
  variants |= kI16Dot;
#endif
#endif
  return variants;
}

// The layouts' block sizes (outputs per block of torch's int4 layout) the kernels read,
// OR-ed: 64 (torch's AVX-512 layout) on AVX-512 with VBMI, 32 | 64 on AVX2; 0 without.
int accel_int4pack_block_sizes() {
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
  return 64;
#elif defined(ACCEL_INT4_GEMV)
  return 32 | 64;
#else
  return 0;
#endif
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
// M in 1..64 (up to 4 streamed, more by 16-output slabs, on AVX-512), or any M on the
// AMX tiles, W in torch's layout of blocks of block_n outputs, N a multiple of block_n,
// K a multiple of group, group even. `variant`: kBest (the AMX tiles from kAmxMinRows
// rows where built, else BF16 dot products where built, else int16 dot products where
// built, else float32 FMAs) or one of them (the tests run each). Returns 0, -1 for
// shapes it does not take, -5 for a variant (or layout) this build lacks.
int accel_int4pack_gemv(const void* x, int64_t x_stride, const void* packed,
                        const void* scales_zeros, void* y, int64_t y_stride, int32_t m,
                        int64_t n, int64_t k, int64_t group, int32_t block_n, int32_t variant) {
  const int built = accel_int4pack_gemv_available();
  if (variant == kBest)
    variant = built & kAmx && m >= accel_int4pack_amx_rows() ? kAmx
              : built & kBf16Dot                              ? kBf16Dot
              : built & kI16Dot                               ? kI16Dot
                                                              : kFp32Fma;
  if (!(built & variant) || !(accel_int4pack_block_sizes() & block_n) ||
      (block_n != 32 && block_n != 64) ||
      (variant != kFp32Fma && variant != kBf16Dot && variant != kI16Dot && variant != kAmx))
    return -5;
#ifdef ACCEL_INT4_GEMV
  if (m < 1 || (m > kMaxBatch && variant != kAmx) || n % block_n || group < 2 || group % 2 ||
      k % group)
    return -1;
  const auto* xb = static_cast<const accel::bf16*>(x);
  const auto* pk = static_cast<const uint8_t*>(packed);
  const auto* sz = static_cast<const accel::bf16*>(scales_zeros);
  auto* yb = static_cast<accel::bf16*>(y);
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
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
#else
  if (variant == kI16Dot) run<I16Madd>(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group, block_n);
  else run<F32Centered>(xb, x_stride, pk, sz, yb, y_stride, m, n, k, group, block_n);
#endif
  return 0;
#else
  (void)x, (void)x_stride, (void)packed, (void)scales_zeros, (void)y, (void)y_stride, (void)m,
      (void)n, (void)k, (void)group;
  return -5;
#endif
}

// The same product for float32 x, (s, z) pairs and y (a float32 model's layers), any M:
// float32 FMAs on x read in place, each code centered before its product (Fp32Centered,
// F32Centered on AVX2), so the sums carry float32 math's own rounding. torch's kernel
// for float32 runs ~70x slower than for bf16 (8 rows of a 1536x576 layer: 19.8 vs 0.27
// ms, torch 2.13, one core). Returns 0, -1 for shapes it does not take, -5 where this
// build lacks the kernel or the layout.
int accel_int4pack_gemv_f32(const float* x, int64_t x_stride, const void* packed,
                            const float* scales_zeros, float* y, int64_t y_stride, int32_t m,
                            int64_t n, int64_t k, int64_t group, int32_t block_n) {
  if (!(accel_int4pack_block_sizes() & block_n) || (block_n != 32 && block_n != 64)) return -5;
#ifdef ACCEL_INT4_GEMV
  if (m < 1 || n % block_n || group < 2 || group % 2 || k % group) return -1;
  const auto* pk = static_cast<const uint8_t*>(packed);
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
  run<Fp32Centered>(x, x_stride, pk, scales_zeros, y, y_stride, m, n, k, group);
#else
  run<F32Centered>(x, x_stride, pk, scales_zeros, y, y_stride, m, n, k, group, block_n);
#endif
  return 0;
#else
  return -5;  // (unused parameters draw no warning without -Wextra)
#endif
}

}  // extern "C"
