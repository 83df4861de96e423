// AVX-512 and AMX tile helpers shared by the bf16 and int8 GEMMs (bf16_linear.cpp,
// int8_linear.cpp).
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

}  // namespace amx
#endif  // __AMX_TILE__

}  // namespace accel
