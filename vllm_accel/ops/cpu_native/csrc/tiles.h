// AVX-512 and AMX tile helpers shared by the bf16 and int8 GEMMs (bf16_linear.cpp,
// int8_linear.cpp): the dword transpose, the tile state, and the tile GEMM's loop.
#pragma once

#ifdef __x86_64__
#include <immintrin.h>
#endif
#include <sys/syscall.h>
#include <unistd.h>

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

// Where the tile GEMM below builds: the AVX-512 it packs with, AMX's int8 and bf16 units.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define ACCEL_AMX_TILES 1
#endif

namespace accel {

#ifdef __AVX512F__
// The transpose of 16 rows of 16 dwords (in place): r[i][j] <- r[j][i].
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  _Pragma("GCC unroll 16") for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // per 128-bit lane L, r[4q + c] holds column 4L + c of rows 4q..4q+3
  _Pragma("GCC unroll 16") for (int q = 0; q < 16; q += 4) {
    r[q] = _mm512_unpacklo_epi64(t[q], t[q + 2]);
    r[q + 1] = _mm512_unpackhi_epi64(t[q], t[q + 2]);
    r[q + 2] = _mm512_unpacklo_epi64(t[q + 1], t[q + 3]);
    r[q + 3] = _mm512_unpackhi_epi64(t[q + 1], t[q + 3]);
  }
  _Pragma("GCC unroll 16") for (int c = 0; c < 4; ++c) {
    t[c] = _mm512_shuffle_i32x4(r[c], r[c + 4], 0x88);
    t[c + 4] = _mm512_shuffle_i32x4(r[c], r[c + 4], 0xdd);
    t[c + 8] = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0x88);
    t[c + 12] = _mm512_shuffle_i32x4(r[c + 8], r[c + 12], 0xdd);
  }
  _Pragma("GCC unroll 16") for (int c = 0; c < 4; ++c) {
    r[c] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0x88);
    r[c + 4] = _mm512_shuffle_i32x4(t[c + 4], t[c + 12], 0x88);
    r[c + 8] = _mm512_shuffle_i32x4(t[c], t[c + 8], 0xdd);
    r[c + 12] = _mm512_shuffle_i32x4(t[c + 4], t[c + 12], 0xdd);
  }
}

#endif  // __AVX512F__

#if defined(__AMX_TILE__)
namespace amx {

// Linux gives a process AMX tile state only when it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM, kernel 5.16+); torch asks the same way once oneDNN runs AMX.
inline bool ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// The tile shapes of the GEMMs here: every one of tmm0-7 16 rows of 64 bytes (tmm0-3
// the 32-bit sums, tmm4-5 the weight, tmm6-7 x).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

#ifdef ACCEL_AMX_TILES
// The loop both GEMMs run on the tiles: sums of x[M, K] @ W[N, K].T for E = int8_t
// (TDPBSSD, int32 sums, quads of columns) or E = bf16 (TDPBF16PS, float32 sums, pairs;
// any 2-byte type). The weight is the A operand, read in place: 16 of its rows by 64
// bytes of columns is a tile loaded with the row stride (no repack); x, packed once per
// 256 rows into the B layout (a dword of columns of 16 rows per 64 bytes), is what every
// weight tile multiplies. 2 x 2 tiles of 16 x 16 sums. `out` takes each sums tile:
// out.store(sums, row, rows_left, n0) for x rows row.. and weight rows n0.., and
// out.prefetch(row, rows, n0): the output lines of 32 x 32 sums.
template <typename E>
struct TileGemm {
  static constexpr int kTile = 16;
  static constexpr int kTileK = 64 / int(sizeof(E));  // columns of an A tile
  static constexpr int64_t kBlockM = 256;             // rows of x packed at a time
  static constexpr int64_t kChunk = 8;  // weight blocks whose outputs a pair of x tiles writes

  // Tile b of the x rows row0.. (rows of them) into the B layout: dword j of the step
  // kk of row 16b + i at xp[(b * dwords + kk / per_dword + j) * 16 + i], zero past the
  // rows and past k.
  static void pack(const E* x, int64_t x_stride, int64_t row0, int64_t rows, int64_t k,
                   int64_t kp, int64_t b, uint32_t* xp) {
    const int64_t dwords = kp * int64_t(sizeof(E)) / 4;
    for (int64_t kk = 0; kk < kp; kk += kTileK) {
      const int64_t left = (k - kk) * int64_t(sizeof(E));
      const __mmask64 mask = left >= 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
      __m512i r[16];
      _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) {
        const int64_t row = b * kTile + i;
        r[i] = row < rows ? _mm512_maskz_loadu_epi8(mask, x + (row0 + row) * x_stride + kk)
                          : _mm512_setzero_si512();
      }
      transpose16(r);  // r[j] = dword j of this step for the 16 rows
      const int64_t d0 = kk * int64_t(sizeof(E)) / 4;
      _Pragma("GCC unroll 16") for (int j = 0; j < 16; ++j)
        _mm512_storeu_si512(xp + (b * dwords + d0 + j) * kTile, r[j]);
    }
  }

  // Sums tile I (0-3) += weight tile 4 + I / 2 times x tile 6 + I % 2 (the instructions
  // spell their tile numbers: literals).
  template <int I>
  static void dp() {
    if constexpr (sizeof(E) == 1) {
      if constexpr (I == 0) _tile_dpbssd(0, 4, 6);
      else if constexpr (I == 1) _tile_dpbssd(1, 4, 7);
      else if constexpr (I == 2) _tile_dpbssd(2, 5, 6);
      else _tile_dpbssd(3, 5, 7);
    } else {
      if constexpr (I == 0) _tile_dpbf16ps(0, 4, 6);
      else if constexpr (I == 1) _tile_dpbf16ps(1, 4, 7);
      else if constexpr (I == 2) _tile_dpbf16ps(2, 5, 6);
      else _tile_dpbf16ps(3, 5, 7);
    }
  }

  // NA (1-2) weight tiles from `a` by NB (1-2) tiles of x from `xb` over kp columns:
  // the sums of tile (i, j) in tmm(2i + j). `next` (null: none): rows to prefetch into
  // L2, a line of each a step, which covers them by the end.
  template <int NA, int NB>
  static void tiles(const E* a, int64_t a_stride, const uint32_t* xb, int64_t dwords,
                    int64_t kp, const E* next, int64_t next_rows, int64_t next_stride) {
    _tile_zero(0);
    if constexpr (NB > 1) _tile_zero(1);
    if constexpr (NA > 1) _tile_zero(2);
    if constexpr (NA > 1 && NB > 1) _tile_zero(3);
    const int64_t a_bytes = a_stride * int64_t(sizeof(E));
    for (int64_t kk = 0; kk < kp; kk += kTileK) {
      if (next)
        for (int64_t r = 0; r < next_rows; ++r) _mm_prefetch(next + r * next_stride + kk, _MM_HINT_T1);
      const int64_t d = kk * int64_t(sizeof(E)) / 4;
      _tile_loadd(4, a + kk, a_bytes);
      if constexpr (NA > 1) _tile_loadd(5, a + kTile * a_stride + kk, a_bytes);
      _tile_loadd(6, xb + d * kTile, 64);
      if constexpr (NB > 1) _tile_loadd(7, xb + (dwords + d) * kTile, 64);
      dp<0>();
      if constexpr (NB > 1) dp<1>();
      if constexpr (NA > 1) dp<2>();
      if constexpr (NA > 1 && NB > 1) dp<3>();
    }
  }

  // Weight blocks of 32 rows c0..c1-1 against the `rows` packed rows of x (row0..): for
  // each pair of x tiles, every block of the chunk, so that the outputs go out a row at
  // a time (kChunk blocks of 32 columns); by whole column strips down 256 rows (a line
  // per row, rows apart) the stores missed the caches: W8A8 at 1024 rows took 3x the
  // GEMM's own time. Blocks with rows past n or columns past k are copied, zero-padded,
  // into `wpad` first. The first pass prefetches each block's successor (`next`,
  // `next_rows` after the chunk) into L2.
  template <class Out>
  static void chunk(const E* w, int64_t w_stride, int64_t c0, int64_t c1, int64_t n,
                    int64_t k, int64_t kp, const uint32_t* xp, int64_t rows, int64_t row0,
                    const Out& out, E* wpad, const E* next, int64_t next_rows) {
    const int64_t dwords = kp * int64_t(sizeof(E)) / 4;
    const E* a[kChunk];
    int64_t a_stride[kChunk];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * 2 * kTile, block_rows = std::min<int64_t>(2 * kTile, n - n0);
      a[c - c0] = w + n0 * w_stride, a_stride[c - c0] = w_stride;
      if (block_rows % kTile || k != kp) {
        E* pad = wpad + (c - c0) * 2 * kTile * kp;
        const int64_t tiles_rows = (block_rows + kTile - 1) / kTile * kTile;
        for (int64_t r = 0; r < tiles_rows; ++r) {
          E* dst = pad + r * kp;
          if (r < block_rows) std::memcpy(dst, a[c - c0] + r * w_stride, size_t(k) * sizeof(E));
          std::memset(dst + (r < block_rows ? k : 0), 0,
                      size_t(kp - (r < block_rows ? k : 0)) * sizeof(E));
        }
        a[c - c0] = pad, a_stride[c - c0] = kp;
      }
    }
    const int64_t x_tiles = (rows + kTile - 1) / kTile;
    for (int64_t b = 0; b < x_tiles; b += 2) {
      const uint32_t* xb = xp + b * dwords * kTile;
      const int64_t row = row0 + b * kTile, left = rows - b * kTile;
      const bool two_x = b + 1 < x_tiles;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t n0 = c * 2 * kTile;
        const bool two = n - n0 > kTile;
        const E* ahead = nullptr;
        int64_t ahead_rows = 0;
        if (b == 0 && c + 1 < c1)
          ahead = w + (n0 + 2 * kTile) * w_stride,
          ahead_rows = std::min<int64_t>(2 * kTile, n - n0 - 2 * kTile);
        else if (b == 0)
          ahead = next, ahead_rows = next_rows;
        out.prefetch(row, std::min<int64_t>(2 * kTile, left), n0);
        const E* ac = a[c - c0];
        const int64_t as = a_stride[c - c0];
        if (two && two_x) tiles<2, 2>(ac, as, xb, dwords, kp, ahead, ahead_rows, w_stride);
        else if (two) tiles<2, 1>(ac, as, xb, dwords, kp, ahead, ahead_rows, w_stride);
        else if (two_x) tiles<1, 2>(ac, as, xb, dwords, kp, ahead, ahead_rows, w_stride);
        else tiles<1, 1>(ac, as, xb, dwords, kp, ahead, ahead_rows, w_stride);
        alignas(64) uint32_t sums[4][kTile * kTile];
        _tile_stored(0, sums[0], 64);
        if (two_x) _tile_stored(1, sums[1], 64);
        if (two) _tile_stored(2, sums[2], 64);
        if (two && two_x) _tile_stored(3, sums[3], 64);
        out.store(sums[0], row, left, n0);
        if (two_x) out.store(sums[1], row + kTile, left - kTile, n0);
        if (two) out.store(sums[2], row, left, n0 + kTile);
        if (two && two_x) out.store(sums[3], row + kTile, left - kTile, n0 + kTile);
      }
    }
  }

  // All of it, on this process's threads (each a contiguous range of weight blocks,
  // from min_work = rows * n * k of one block of rows).
  template <class Out>
  static void gemm(const E* x, int64_t x_stride, const E* w, int64_t w_stride, int64_t m,
                   int64_t n, int64_t k, const Out& out, int64_t min_work) {
    const int64_t kp = (k + kTileK - 1) / kTileK * kTileK;
    const int64_t x_rows = std::min(m, kBlockM);
    std::vector<uint32_t> xp(size_t((x_rows + kTile - 1) / kTile * kTile) *
                             size_t(kp * int64_t(sizeof(E)) / 4));
    const int64_t blocks = (n + 2 * kTile - 1) / (2 * kTile);
#pragma omp parallel if (x_rows * n * k >= min_work)
    {
      configure();
      const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
      const int64_t first = blocks * thread / threads, end = blocks * (thread + 1) / threads;
      std::vector<E> wpad;  // (only where a block has padding: zeroing it costs)
      if (k != kp || n % (2 * kTile)) wpad.resize(size_t(kChunk * 2 * kTile) * size_t(kp));
      for (int64_t row0 = 0; row0 < m; row0 += kBlockM) {
        const int64_t rows = std::min(kBlockM, m - row0);
#pragma omp for schedule(static)
        for (int64_t b = 0; b < (rows + kTile - 1) / kTile; ++b)
          pack(x, x_stride, row0, rows, k, kp, b, xp.data());
        // (every tile packed before any is read)
        for (int64_t c0 = first; c0 < end; c0 += kChunk) {
          const int64_t c1 = std::min(end, c0 + kChunk), next_n0 = c1 * 2 * kTile;
          const int64_t next_rows = c1 < end ? std::min<int64_t>(2 * kTile, n - next_n0) : 0;
          chunk(w, w_stride, c0, c1, n, k, kp, xp.data(), rows, row0, out, wpad.data(),
                next_rows ? w + next_n0 * w_stride : nullptr, next_rows);
        }
#pragma omp barrier
        // (every tile read before the next block of rows overwrites them)
      }
      _tile_release();
    }
  }
};

// Asks for ownership of `rows` output rows' lines of `bytes` from p, `stride` bytes
// apart: a large batch's stores are what its GEMM waits on (W8A8 at 2048 rows: 0.88x
// the time with this before each block's tiles).
inline void prefetch_lines(void* p, int64_t rows, int64_t stride, int64_t bytes) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t off = 0; off < bytes; off += 64)
      _m_prefetchw(static_cast<char*>(p) + j * stride + off);
}
#endif  // ACCEL_AMX_TILES

}  // namespace amx
#endif  // __AMX_TILE__

}  // namespace accel
