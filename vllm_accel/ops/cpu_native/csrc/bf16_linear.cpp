// bf16 weights x (bf16 | fp16 | fp32) activations in float32 FMAs, for x86 CPUs with
// AVX-512 but without AVX512-BF16 (Ice Lake, or a VM that hides BF16) and for AVX2 + FMA
// ones without AVX-512 (AMD Zen 1-3, Intel Haswell to Comet Lake), compiled at first use
// (see cpu_native/build.py).
//
// Why: there, oneDNN's bf16 matmul (what vLLM's CPU linears call) emulates bf16 dot
// products at ~30 GFLOP/s a core, 4-5x below its own float32 GEMM, while a bf16
// weight widens to float32 exactly with two integer instructions. Decode of one
// request reads each weight once (bandwidth); a batch reuses each widened weight
// across rows (FMA throughput).
//
// y[M, N] = x[M, K] @ W[N, K].T (+ bias[N]) on the checkpoint's own layout (W row-major,
// no repack). x is converted to float32 once per block of kBlockM rows (zero-padded to
// a multiple of 16 columns; W's last columns are loaded masked). Per block of kRowsW
// weight rows and kRowsX rows of x: kRowsW * kRowsX accumulators of 16 (AVX2: 8) lanes, summed
// across lanes at the end. With more rows of x than one tile, the weight rows are
// widened once into a per-thread float32 buffer (L1/L2) and every tile reads that.
// Where the CPU has AVX512-BF16 (dp:: below), batches of bf16 x run its dot products
// instead, and where it has AMX (dp::amx), batches of 4 to 639 rows run tiles.
#include <algorithm>
#include <cstring>
#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"
#include "tiles.h"
#include "vec.h"

#ifdef ACCEL_VEC
#define ACCEL_BF16_LINEAR 1
namespace {

using V = accel::Vec;

// Tiles unrolled before GCC decides where the accumulators live: left to itself it
// kept the 24 of a 6 x 4 tile on the stack, a store after every FMA (x4 slower)
#define ACCEL_UNROLL _Pragma("GCC unroll 8")

constexpr int kLanes = V::kLanes;
constexpr int kRowsW = 4;         // weight rows per block (outputs per tile)
// rows of x per tile: 24 accumulators of AVX-512's 32 registers, 12 of AVX2's 16
constexpr int kRowsX = kLanes == 16 ? 6 : 3;
constexpr int64_t kBlockM = 64;   // rows of x in float32 at a time (64 x K x 4 bytes: L2)
constexpr int64_t kDpMinRows = 3;  // rows of bf16 x from which dp:: below runs (if built)
// Threads only from 2**18 weights: below that a pass is a few microseconds, about what
// waking the OpenMP team costs.
constexpr int64_t kParallelMinWork = int64_t(1) << 18;

// Calls f(std::integral_constant<int, R>{}) for R = rows, 1 <= rows <= kMax.
template <int kMax, int R = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {
  if constexpr (R <= kMax) {
    if (rows == R) f(std::integral_constant<int, R>{});
    else with_rows<kMax, R + 1>(rows, f);
  }
}

// out[j] = the sum of acc[j]'s lanes
template <int NB>
inline void sum_lanes(const V::R acc[NB], float out[NB]) {
  if constexpr (NB == 4) {
    V::sums4(acc, out);
  } else {
    ACCEL_UNROLL for (int j = 0; j < NB; ++j) out[j] = V::sum(acc[j]);
  }
}

// kLanes weights from w widened to float32, of which the `left` first are W's (zeros
// after: nothing past them is read)
inline V::R widen(const accel::bf16* w, int64_t left) {
  return left >= kLanes ? V::load(w) : left > 0 ? V::load_first(w, int(left)) : V::zero();
}

// One tile: NB weight rows (widened from bf16 as read, or float32 from the buffer) by
// MR rows of x (float32, padded), full K.
template <int NB, int MR, bool kBuffered>
void tile(const float* xf, int64_t kp, const accel::bf16* w, int64_t w_stride,
          const float* wbuf, int64_t k, float out[MR][NB]) {
  V::R acc[MR][NB];
  ACCEL_UNROLL for (int m = 0; m < MR; ++m)
    ACCEL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::zero();
  for (int64_t kk = 0; kk < k; kk += kLanes) {
    V::R wv[NB];
    if constexpr (kBuffered) {
      ACCEL_UNROLL for (int j = 0; j < NB; ++j) wv[j] = V::load(wbuf + j * kp + kk);
    } else {
      ACCEL_UNROLL for (int j = 0; j < NB; ++j) {
        // the next block's rows (right after this one's in memory) into L1 one pass
        // ahead, and the block after into L2, every 32 bytes: the hardware prefetcher
        // alone kept one core at 9-11 GB/s of its 13, the L1 level alone at ~13 of the
        // ~14 it reads (the L2 level: 5-7% faster over a decode step's GEMVs, Intel
        // Xeon, measured)
        if (kk % 16 == 0) {
          _mm_prefetch((const char*)(w + (j + NB) * w_stride + kk), _MM_HINT_T0);
          _mm_prefetch((const char*)(w + (j + 2 * NB) * w_stride + kk), _MM_HINT_T1);
        }
        wv[j] = widen(w + j * w_stride + kk, k - kk);
      }
    }
    ACCEL_UNROLL for (int m = 0; m < MR; ++m) {
      const V::R xv = V::load(xf + m * kp + kk);
      ACCEL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = V::fmadd(wv[j], xv, acc[m][j]);
    }
  }
  ACCEL_UNROLL for (int m = 0; m < MR; ++m)
    sum_lanes<NB>(acc[m], out[m]);
}

template <class Out>
struct Target {
  Out* y;
  int64_t y_stride;
  const float* bias;  // float32 copy, or nullptr
};

// A tile's sums (+ bias) into y's rows row.. and columns n0..
template <int NB, int MR, class Out>
void store_tile(const float out[MR][NB], const Target<Out>& t, int64_t row, int64_t n0) {
  ACCEL_UNROLL for (int m = 0; m < MR; ++m)
    ACCEL_UNROLL for (int j = 0; j < NB; ++j)
      accel::store(out[m][j] + (t.bias ? t.bias[n0 + j] : 0.f), t.y + (row + m) * t.y_stride + n0 + j);
}

template <int NB, int MR, bool kBuffered, class Out>
void tile_store(const float* xf, int64_t kp, const accel::bf16* w, int64_t w_stride,
                const float* wbuf, int64_t k, const Target<Out>& t, int64_t row, int64_t n0) {
  float out[MR][NB];
  tile<NB, MR, kBuffered>(xf, kp, w, w_stride, wbuf, k, out);
  store_tile<NB, MR>(out, t, row, n0);
}

// All rows of the x block against NB weight rows starting at n0.
template <int NB, class Out>
void weight_rows(const float* xf, int64_t kp, int64_t rows, int64_t row0, const accel::bf16* w,
                 int64_t w_stride, float* wbuf, int64_t k, const Target<Out>& t, int64_t n0) {
  const accel::bf16* wn = w + n0 * w_stride;
  if (rows <= kRowsX) {  // one tile: stream the weight straight from memory
    with_rows<kRowsX>(rows, [&](auto R) {
      tile_store<NB, decltype(R)::value, false>(xf, kp, wn, w_stride, nullptr, k, t, row0, n0);
    });
    return;
  }
  ACCEL_UNROLL for (int j = 0; j < NB; ++j)
    for (int64_t kk = 0; kk < kp; kk += kLanes)
      V::store(widen(wn + j * w_stride + kk, k - kk), wbuf + j * kp + kk);
  int64_t r = 0;
  for (; r + kRowsX <= rows; r += kRowsX)
    tile_store<NB, kRowsX, true>(xf + r * kp, kp, nullptr, 0, wbuf, k, t, row0 + r, n0);
  with_rows<kRowsX - 1>(rows - r, [&](auto R) {
    tile_store<NB, decltype(R)::value, true>(xf + r * kp, kp, nullptr, 0, wbuf, k, t, row0 + r, n0);
  });
}

template <class In, class Out>
void linear(const In* x, int64_t x_stride, const accel::bf16* w, int64_t w_stride,
            const float* bias, Out* y, int64_t y_stride, int64_t m, int64_t n, int64_t k) {
  const int64_t kp = (k + 15) / 16 * 16;
  const Target<Out> t{y, y_stride, bias};
  std::vector<float> xf(size_t(std::min(m, kBlockM)) * kp);
  const int64_t blocks = (n + kRowsW - 1) / kRowsW;
  for (int64_t row0 = 0; row0 < m; row0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, m - row0);
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = xf.data() + r * kp;
      const In* src = x + (row0 + r) * x_stride;
      for (int64_t i = 0; i < k; ++i) dst[i] = accel::to_float(src[i]);
      std::fill(dst + k, dst + kp, 0.f);
    }
#pragma omp parallel if (rows * n * k >= kParallelMinWork)
    {
      std::vector<float> wbuf(rows > kRowsX ? size_t(kRowsW) * kp : 0);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t n0 = b * kRowsW;
        if (n0 + kRowsW <= n)
          weight_rows<kRowsW>(xf.data(), kp, rows, row0, w, w_stride, wbuf.data(), k, t, n0);
        else
          for (int64_t j = n0; j < n; ++j)
            weight_rows<1>(xf.data(), kp, rows, row0, w, w_stride, wbuf.data(), k, t, j);
      }
    }
  }
}

#ifdef __AVX512BF16__
// bf16 x of kDpMinRows rows or more where the CPU has AVX512-BF16 (AMD Zen 4/5, Intel
// Cooper Lake and later): VDPBF16PS multiplies 32 bf16 pairs of a weight row and a row
// of x exactly and adds them into 16 float32 sums, twice the work of an FMA and no
// widening. Same tiles as above on 32 columns a step, the weight read in place (no
// buffer: nothing to widen); x is copied per block into rows padded with zeros to a
// multiple of 32 (the weight's last columns are loaded masked to zero). Inputs that are
// float32 subnormals are read as zero (the instruction's DAZ), as in oneDNN's bf16
// kernels. One and two rows stream faster through the widening tile above (AMD EPYC
// Zen 4, the default model's 30 layers, alternated in one process: 2 rows 8.7-9.5 vs
// 10.2-10.5 ms), so that keeps them.
namespace dp {

constexpr int64_t kStep = 32;

inline __mmask32 tail_mask32(int64_t k, int64_t kk) {
  const int64_t left = k - kk;
  return left >= kStep ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1);
}

// Whether tiles prefetch far (kFar below): on AMD CPUs. AMD EPYC Zen 4, the default
// model's 30 layers, one core, the two patterns alternated in one process: far 1.13-1.45x
// at 3-4 rows, 0.97-1.15x at 5-64; an Intel Xeon with AMX, the same way: 0.96-1.01x at
// 3-4 rows, 0.89-0.95x at 6-16 (it keeps the near pattern).
inline bool prefetch_far() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

template <int NB, int MR, bool kFar>
void tile(const accel::bf16* xb, int64_t kp, const accel::bf16* w, int64_t w_stride, int64_t k,
          float out[MR][NB]) {
  __m512 acc[MR][NB];
  ACCEL_UNROLL for (int m = 0; m < MR; ++m)
    ACCEL_UNROLL for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k; kk += kStep) {
    const __mmask32 mask = tail_mask32(k, kk);
    __m512i wv[NB];
    ACCEL_UNROLL for (int j = 0; j < NB; ++j) {
      const char* here = (const char*)(w + j * w_stride + kk);
      const int64_t block_bytes = NB * w_stride * int64_t(sizeof(accel::bf16));
      if constexpr (kFar) {
        // two blocks ahead into L1 and four into L2, each line asked for twice (at both
        // halves, as the float32 tile's 32-byte steps do): with the near pattern an AMD
        // EPYC Zen 4 core streamed 15-19 GB/s of the ~30 it reads, with this 22-27
        _mm_prefetch(here + 2 * block_bytes, _MM_HINT_T0);
        _mm_prefetch(here + 2 * block_bytes + 32, _MM_HINT_T0);
        _mm_prefetch(here + 4 * block_bytes, _MM_HINT_T1);
        _mm_prefetch(here + 4 * block_bytes + 32, _MM_HINT_T1);
      } else {  // the next block into L1 and the one after into L2, as the float32 tile
        _mm_prefetch(here + block_bytes, _MM_HINT_T0);
        _mm_prefetch(here + 2 * block_bytes, _MM_HINT_T1);
      }
      wv[j] = _mm512_maskz_loadu_epi16(mask, w + j * w_stride + kk);
    }
    ACCEL_UNROLL for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(xb + m * kp + kk);
      ACCEL_UNROLL for (int j = 0; j < NB; ++j)
        acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv[j], xv);
    }
  }
  ACCEL_UNROLL for (int m = 0; m < MR; ++m)
    sum_lanes<NB>(acc[m], out[m]);
}

template <int NB, int MR, bool kFar>
void tile_store(const accel::bf16* xb, int64_t kp, const accel::bf16* w, int64_t w_stride,
                int64_t k, const Target<accel::bf16>& t, int64_t row, int64_t n0) {
  float out[MR][NB];
  tile<NB, MR, kFar>(xb, kp, w, w_stride, k, out);
  store_tile<NB, MR>(out, t, row, n0);
}

// All rows of the x block against NB weight rows starting at n0 (from memory in the
// first tile, from L1 in the others).
template <int NB, bool kFar>
void weight_rows(const accel::bf16* xb, int64_t kp, int64_t rows, int64_t row0,
                 const accel::bf16* w, int64_t w_stride, int64_t k,
                 const Target<accel::bf16>& t, int64_t n0) {
  const accel::bf16* wn = w + n0 * w_stride;
  int64_t r = 0;
  for (; r + kRowsX <= rows; r += kRowsX)
    tile_store<NB, kRowsX, kFar>(xb + r * kp, kp, wn, w_stride, k, t, row0 + r, n0);
  switch (rows - r) {
#define ACCEL_TILE(R) \
  case R: tile_store<NB, R, kFar>(xb + r * kp, kp, wn, w_stride, k, t, row0 + r, n0); break;
    ACCEL_TILE(1) ACCEL_TILE(2) ACCEL_TILE(3) ACCEL_TILE(4) ACCEL_TILE(5)
#undef ACCEL_TILE
  }
}

// Rows row0.. of x into dst, each padded with zeros from k to kp columns.
inline void copy_rows(const accel::bf16* x, int64_t x_stride, int64_t row0, int64_t rows,
                      int64_t k, int64_t kp, accel::bf16* dst) {
  for (int64_t r = 0; r < rows; ++r, dst += kp) {
    std::memcpy(dst, x + (row0 + r) * x_stride, size_t(k) * sizeof(accel::bf16));
    std::fill(dst + k, dst + kp, accel::bf16{0});
  }
}

template <bool kFar>
void linear_with(const accel::bf16* x, int64_t x_stride, const accel::bf16* w, int64_t w_stride,
                 const float* bias, accel::bf16* y, int64_t y_stride, int64_t m, int64_t n,
                 int64_t k) {
  const int64_t kp = (k + kStep - 1) / kStep * kStep;
  const Target<accel::bf16> t{y, y_stride, bias};
  std::vector<accel::bf16> xb(size_t(std::min(m, kBlockM)) * kp);
  const int64_t blocks = (n + kRowsW - 1) / kRowsW;
  for (int64_t row0 = 0; row0 < m; row0 += kBlockM) {
    const int64_t rows = std::min(kBlockM, m - row0);
    copy_rows(x, x_stride, row0, rows, k, kp, xb.data());
#pragma omp parallel for schedule(static) if (rows * n * k >= kParallelMinWork)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * kRowsW;
      if (n0 + kRowsW <= n)
        weight_rows<kRowsW, kFar>(xb.data(), kp, rows, row0, w, w_stride, k, t, n0);
      else
        for (int64_t j = n0; j < n; ++j)
          weight_rows<1, kFar>(xb.data(), kp, rows, row0, w, w_stride, k, t, j);
    }
  }
}

// Batches of kGemmMinRows rows or more are compute-bound: the tiles above spend a fifth
// of their instructions summing lanes and read x once per 4 outputs. Here 32 weight rows
// at a time are transposed into a panel of K/2 x 32 bf16 pairs (per thread, L2), the
// layout VDPBF16PS multiplies against one broadcast pair of x: 12 rows of x by those 32
// outputs are 24 accumulators that need no lane sums, 2 panel loads and 12 broadcasts a
// pair step. The weight stays in the checkpoint's layout; each call packs what it reads
// while the previous panel's FMAs run. AMD EPYC Zen 4, one core, the default model's 30
// layers (benchmarks/bf16_linear_rows.py; ms, this vs the tiles above vs torch's linear
// vs vLLM's oneDNN on its prepacked copy): 24 rows 31 / 33 / 47, 64 rows 71-72 / 87-90 /
// 85-89 / 71-74, 512 rows 510 / - / 538-551 / 505-523.
constexpr int kPanel = 32;           // outputs per panel: two 16-lane accumulators a row
constexpr int kGemmRows = 12;        // rows of x per tile: 24 accumulators
constexpr int64_t kGemmMinRows = 24;  // (16 rows: 0.97x the tiles above, 24: 1.08x)
constexpr int64_t kGemmBlockM = 256;  // rows of x per panel pass (512 rows: 1.07x 64)

// panel[p * 32 + c] = the bf16 pair W[n0 + c, 2p..2p+1] (zero past n and k), p < kp / 2.
void pack_panel(const accel::bf16* w, int64_t w_stride, int64_t n0, int64_t n, int64_t k,
                int64_t kp, uint32_t* panel) {
  for (int half = 0; half < kPanel / 16; ++half) {
    const int64_t c0 = n0 + half * 16;
    for (int64_t kk = 0; kk < kp; kk += kStep) {
      const __mmask32 mask = tail_mask32(k, kk);
      __m512i r[16];
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
        r[i] = c0 + i < n ? _mm512_maskz_loadu_epi16(mask, w + (c0 + i) * w_stride + kk)
                          : _mm512_setzero_si512();
      accel::transpose16(r);
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i)
        _mm512_storeu_si512(panel + (kk / 2 + i) * kPanel + half * 16, r[i]);
    }
  }
}

// MR rows of x (bf16 pairs, row stride kp / 2 pairs) against one panel: y[row.., n0..].
// With ``next`` (the next panel's weight rows, ``next_rows`` of them), the tile also
// prefetches those into L2, two lines a pair step: what packing that panel will read
// (a panel is K lines, the steps K / 2), so the weight's stream overlaps the FMAs.
template <int MR>
void gemm_tile(const uint32_t* xp, int64_t pairs, const uint32_t* panel,
               const Target<accel::bf16>& t, int64_t row, int64_t n0, int64_t n,
               const accel::bf16* next, int64_t next_rows, int64_t w_stride, int64_t k) {
  __m512 acc[MR][2];
  _Pragma("GCC unroll 16") for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t row_bytes = k * int64_t(sizeof(accel::bf16));
  const char* pf = reinterpret_cast<const char*>(next);
  int64_t pf_row = next ? 0 : next_rows, pf_at = 0;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int line = 0; line < 2 && pf_row < next_rows; ++line) {
      _mm_prefetch(pf + pf_row * w_stride * int64_t(sizeof(accel::bf16)) + pf_at, _MM_HINT_T1);
      pf_at += 64;
      if (pf_at >= row_bytes) pf_at = 0, ++pf_row;
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * kPanel);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + p * kPanel + 16);
    _Pragma("GCC unroll 16") for (int m = 0; m < MR; ++m) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(int(xp[m * pairs + p]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], a, b0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], a, b1);
    }
  }
  ACCEL_UNROLL for (int j = 0; j < 2; ++j) {
    const int64_t c0 = n0 + j * 16;
    if (c0 >= n) break;
    const __mmask16 mask = n - c0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - c0)) - 1);
    const __m512 b = t.bias ? _mm512_maskz_loadu_ps(mask, t.bias + c0) : _mm512_setzero_ps();
    _Pragma("GCC unroll 16") for (int m = 0; m < MR; ++m)
      _mm256_mask_storeu_epi16(t.y + (row + m) * t.y_stride + c0, mask,
                               accel::to_bf16(_mm512_add_ps(acc[m][j], b)));
  }
}

// y = x @ W.T (+ bias) for batches of kGemmMinRows rows or more.
void gemm(const accel::bf16* x, int64_t x_stride, const accel::bf16* w, int64_t w_stride,
          const float* bias, accel::bf16* y, int64_t y_stride, int64_t m, int64_t n,
          int64_t k) {
  const int64_t kp = (k + kStep - 1) / kStep * kStep, pairs = kp / 2;
  const Target<accel::bf16> t{y, y_stride, bias};
  std::vector<accel::bf16> xb(size_t(std::min(m, kGemmBlockM)) * kp);
  const int64_t panels = (n + kPanel - 1) / kPanel;
  for (int64_t row0 = 0; row0 < m; row0 += kGemmBlockM) {
    const int64_t rows = std::min(kGemmBlockM, m - row0);
    copy_rows(x, x_stride, row0, rows, k, kp, xb.data());
    const auto* xp = reinterpret_cast<const uint32_t*>(xb.data());
#pragma omp parallel if (rows * n * k >= kParallelMinWork)
    {
      std::vector<uint32_t> panel(size_t(pairs) * kPanel);
#pragma omp for schedule(static)
      for (int64_t b = 0; b < panels; ++b) {
        const int64_t n0 = b * kPanel;
        pack_panel(w, w_stride, n0, n, k, kp, panel.data());
        // the first tile prefetches the panel this thread packs next (schedule(static):
        // its chunk's next panel)
        const int64_t next_rows = std::max<int64_t>(0, std::min<int64_t>(kPanel, n - n0 - kPanel));
        const accel::bf16* next = next_rows ? w + (n0 + kPanel) * w_stride : nullptr;
        int64_t r = 0;
        for (; r + kGemmRows <= rows; r += kGemmRows, next = nullptr)
          gemm_tile<kGemmRows>(xp + r * pairs, pairs, panel.data(), t, row0 + r, n0, n, next,
                               next_rows, w_stride, k);
        switch (rows - r) {
#define ACCEL_TILE(R)                                                              \
  case R:                                                                          \
    gemm_tile<R>(xp + r * pairs, pairs, panel.data(), t, row0 + r, n0, n, next, next_rows, \
                 w_stride, k);                                                     \
    break;
          ACCEL_TILE(1) ACCEL_TILE(2) ACCEL_TILE(3) ACCEL_TILE(4) ACCEL_TILE(5) ACCEL_TILE(6)
          ACCEL_TILE(7) ACCEL_TILE(8) ACCEL_TILE(9) ACCEL_TILE(10) ACCEL_TILE(11)
#undef ACCEL_TILE
        }
      }
    }
  }
}

void linear(const accel::bf16* x, int64_t x_stride, const accel::bf16* w, int64_t w_stride,
            const float* bias, accel::bf16* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k) {
  if (m >= kGemmMinRows) return gemm(x, x_stride, w, w_stride, bias, y, y_stride, m, n, k);
  if (prefetch_far())
    linear_with<true>(x, x_stride, w, w_stride, bias, y, y_stride, m, n, k);
  else
    linear_with<false>(x, x_stride, w, w_stride, bias, y, y_stride, m, n, k);
}

#ifdef ACCEL_AMX_TILES
// AMX tiles (Intel Sapphire Rapids and later) for batches of kAmxMinRows rows or more:
// one TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 float32
// sums, 16x the work of a VDPBF16PS, in tiles.h's TileGemm (the weight read in place
// as the A operand, x packed into the B layout). Each block of 32 weight rows is read
// from memory once, by the first 32 rows of x, while the next block is prefetched into
// L2, and from cache by the rest. Sums are float32 (exact bf16 products; subnormal
// inputs read as zero, as in VDPBF16PS), one rounding to bf16 at the store.
namespace amx {

constexpr int kTile = 16;  // tile rows
// rows of bf16 x from which the tiles run (an Intel Xeon with AMX, the default model's 30
// layers, one core, vs the AVX512-BF16 tiles: 3 rows level, 4 rows 25.5 vs 29.2 ms, 8
// rows 25.4 vs 47.3)
constexpr int64_t kAmxMinRows = 4;

// The output of the tiles (tiles.h TileGemm<bf16>): each sums tile + bias rounded into
// y, transposed, then two rows of y at a time rounded by VCVTNE2PS2BF16 (to nearest
// even; it reads a subnormal sum as zero, as the tiles read subnormal inputs).
struct Store {
  Target<accel::bf16> t;
  int64_t n;

  void store(const uint32_t* sums, int64_t row, int64_t rows_left, int64_t n0) const {
    __m512i r[16];
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(sums + i * kTile);
    accel::transpose16(r);  // r[j]: row row + j of y, columns n0..n0+15
    const __mmask16 mask = n - n0 >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - n0)) - 1);
    const __m512 b = t.bias ? _mm512_maskz_loadu_ps(mask, t.bias + n0) : _mm512_setzero_ps();
    const int64_t rows = std::min<int64_t>(kTile, rows_left);
    for (int j = 0; j < rows; j += 2) {
      const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(
          _mm512_add_ps(_mm512_castsi512_ps(r[j + 1]), b), _mm512_add_ps(_mm512_castsi512_ps(r[j]), b));
      accel::bf16* out = t.y + (row + j) * t.y_stride + n0;
      _mm256_mask_storeu_epi16(out, mask, _mm512_castsi512_si256(pair));
      if (j + 1 < rows)
        _mm256_mask_storeu_epi16(out + t.y_stride, mask, _mm512_extracti64x4_epi64(pair, 1));
    }
  }

  void prefetch(int64_t row, int64_t rows, int64_t n0) const {
    accel::amx::prefetch_lines(t.y + row * t.y_stride + n0, rows, t.y_stride * 2,
                               std::min<int64_t>(2 * kTile, n - n0) * 2);
  }
};

// y = x @ W.T (+ bias) for bf16 x of kAmxMinRows rows or more (where ready()).
void linear(const accel::bf16* x, int64_t x_stride, const accel::bf16* w, int64_t w_stride,
            const float* bias, accel::bf16* y, int64_t y_stride, int64_t m, int64_t n,
            int64_t k) {
  accel::amx::TileGemm<accel::bf16>::gemm(x, x_stride, w, w_stride, m, n, k,
                                          Store{{y, y_stride, bias}, n}, kParallelMinWork);
}

}  // namespace amx
#endif  // AMX

}  // namespace dp
#endif  // __AVX512BF16__

}  // namespace
#endif

extern "C" {

// 1 if this build has the kernel (AVX-512 F/BW/VL), else 0.
int accel_bf16_linear_available() {
#ifdef ACCEL_BF16_LINEAR
  return 1;
#else
  return 0;
#endif
}

// Rows of x (dtype code x_dtype) from which torch's linear (oneDNN) beats these kernels,
// 0 where it never does. With AMX, oneDNN's bf16 GEMM runs on tiles too; below these
// rows a batch is weight-bound (or L2-bound in dp::amx) and the kernels here win (an
// Intel Xeon with AMX, one core, the default model's 30 layers, alternated in one
// process, ms, dp::amx vs torch's linear vs vLLM's prepacked oneDNN): 8-16 rows 19.6-19.7
// vs 33-41 vs 22-24, 64 rows 28.7-32.0 vs 49-50 vs 29-30, 256 rows 94-99 vs 118-135 vs
// 78-109, 512 rows 165 vs 190 vs 171, 768 rows 279 vs 269 vs 253, 1024 rows 366 vs 308
// vs 268: from 640 rows oneDNN's K-blocked GEMM wins. A process the OS refuses AMX tile
// state (dp::amx::ready; benchmarks/without_amx.py) refuses oneDNN's too, as on a CPU
// without AMX: the same Intel Xeon, AMX refused, one core, the 30 layers, ms, the
// AVX512-BF16 kernels vs torch's linear vs vLLM's prepacked oneDNN: 1 row 15.2 vs 31.3 vs
// 22.5, 12 rows 39.1 vs 59.0 vs 43.9, 64 rows 170 vs 184 vs 169, 512 rows 1508 vs 1511
// vs 1450: never.
//   AVX512-BF16 alone (AMD EPYC Zen 4, one core, the default model's 30 layers, bf16
//     x): never, with dp::gemm above (1.05-1.26x torch's linear at 64-512 rows).
// Without either oneDNN emulates bf16 at 4-5x below float32: never.
int accel_bf16_linear_onednn_rows(int32_t x_dtype) {
#if defined(ACCEL_BF16_LINEAR) && defined(__AVX512BF16__) && defined(ACCEL_AMX_TILES)
  if (x_dtype == accel::kBFloat16 && accel::amx::ready()) return 640;
#endif
  (void)x_dtype;
  return 0;
}

// Rows of bf16 x from which the AMX tiles (dp::amx above) run; 0 where this build or
// this process (the kernel's permission) lacks them.
int accel_bf16_linear_amx_rows() {
#if defined(ACCEL_BF16_LINEAR) && defined(__AVX512BF16__) && defined(ACCEL_AMX_TILES)
  return accel::amx::ready() ? int(dp::amx::kAmxMinRows) : 0;
#else
  return 0;
#endif
}

// Rows of bf16 x from which the AVX512-BF16 tiles (dp:: above) run; 0 where not built.
int accel_bf16_linear_dp_rows() {
#if defined(ACCEL_BF16_LINEAR) && defined(__AVX512BF16__)
  return kDpMinRows;
#else
  return 0;
#endif
}

// y[M, N] (x's dtype, row stride y_stride) = x[M, K] (dtype x_dtype, row stride
// x_stride) @ W[N, K].T (bf16, row stride w_stride) + bias (float32 [N], or null).
// Returns 0, -1 for an unknown dtype, -5 when this build lacks the kernel.
int accel_bf16_linear(const void* x, int64_t x_stride, int32_t x_dtype, const void* w,
                      int64_t w_stride, const float* bias, void* y, int64_t y_stride, int64_t m,
                      int64_t n, int64_t k) {
#ifdef ACCEL_BF16_LINEAR
  const auto* wb = static_cast<const accel::bf16*>(w);
#if defined(__AVX512BF16__) && defined(ACCEL_AMX_TILES)
  if (x_dtype == accel::kBFloat16 && m >= dp::amx::kAmxMinRows && accel::amx::ready()) {
    dp::amx::linear(static_cast<const accel::bf16*>(x), x_stride, wb, w_stride, bias,
                    static_cast<accel::bf16*>(y), y_stride, m, n, k);
    return 0;
  }
#endif
#ifdef __AVX512BF16__
  if (x_dtype == accel::kBFloat16 && m >= kDpMinRows) {
    dp::linear(static_cast<const accel::bf16*>(x), x_stride, wb, w_stride, bias,
               static_cast<accel::bf16*>(y), y_stride, m, n, k);
    return 0;
  }
#endif
  return accel::dispatch(x_dtype, [&](auto elem) {
    using T = decltype(elem);
    linear<T, T>(static_cast<const T*>(x), x_stride, wb, w_stride, bias, static_cast<T*>(y),
                 y_stride, m, n, k);
  });
#else
  (void)x, (void)x_stride, (void)x_dtype, (void)w, (void)w_stride, (void)bias, (void)y,
      (void)y_stride, (void)m, (void)n, (void)k;
  return -5;
#endif
}

// y[b] = x[b] @ W[b].T for each b < batch, strides in elements: vLLM's MLA multiplies
// each head's query by that head's slice of kv_b_proj (torch.bmm, which torch runs at
// a fifth of the memory speed for the few rows of a decode step). The heads split over
// the threads, each head's product on one thread. Returns as accel_bf16_linear.
int accel_bf16_bmm(const void* x, int64_t x_batch_stride, int64_t x_stride, int32_t x_dtype,
                   const void* w, int64_t w_batch_stride, int64_t w_stride, void* y,
                   int64_t y_batch_stride, int64_t y_stride, int64_t batch, int64_t m, int64_t n,
                   int64_t k) {
#ifdef ACCEL_BF16_LINEAR
  if (x_dtype != accel::kFloat32 && x_dtype != accel::kBFloat16 && x_dtype != accel::kFloat16)
    return -1;
  const int64_t elem = x_dtype == accel::kFloat32 ? 4 : 2;
  const auto* xb = static_cast<const char*>(x);
  const auto* wb = static_cast<const char*>(w);
  auto* yb = static_cast<char*>(y);
  int rc = 0;
#pragma omp parallel for schedule(static) reduction(min : rc) \
    if (batch > 1 && batch * m * n * k >= kParallelMinWork)
  for (int64_t b = 0; b < batch; ++b) {
    const int r = accel_bf16_linear(xb + b * x_batch_stride * elem, x_stride, x_dtype,
                                    wb + b * w_batch_stride * 2, w_stride, nullptr,
                                    yb + b * y_batch_stride * elem, y_stride, m, n, k);
    rc = r < rc ? r : rc;
  }
  return rc;
#else
  (void)x, (void)x_batch_stride, (void)x_stride, (void)x_dtype, (void)w, (void)w_batch_stride,
      (void)w_stride, (void)y, (void)y_batch_stride, (void)y_stride, (void)batch, (void)m,
      (void)n, (void)k;
  return -5;
#endif
}

}  // extern "C"
