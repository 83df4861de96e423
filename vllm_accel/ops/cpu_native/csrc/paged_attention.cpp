// Paged attention for the simulated GCU, compiled at first use (see cpu_native/build.py).
//
// Plain C ABI (no torch headers, so it compiles in seconds) called through ctypes
// with raw pointers and element strides. OpenMP parallel regions run on the
// libgomp that torch already loaded, so torch and these kernels share one pool.
//
// Page layout (ops/paged_layout.py): the (block, kv head) page of a
// bf16/fp16/fp32 cache is K [BS, D] then V [BS, D]; of an INT8 cache it is
// K int8 [BS, D], V int8 [BS, D], then float32 [BS, 2] (k_scale, v_scale).
// `block_stride` / `head_stride` locate a page, in elements of the cache dtype.
//
// Decode reads each key and value once per (request, kv head), for all the query
// heads of its group, keeps scores, softmax and the weighted sum in float32 and
// rounds once when storing the output.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"
#include "int8_codes.h"
#include "vec.h"

namespace {

using namespace accel;

template <typename T>
inline void load_row(const T* src, float* dst, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float alpha, const float* x, float* y, int n) {
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// In place: s[0..n) -> softmax(s) (float32, max-subtracted).
inline void softmax(float* s, int n) {
  float m = s[0];
  for (int t = 1; t < n; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
#pragma omp simd
  for (int t = 0; t < n; ++t) s[t] *= inv;
}

// What a model adds to plain causal attention (reference/attention.py's features):
// a sliding window of `window` keys (0: none), a logit soft-cap (0: none), ALiBi
// slopes and attention-sink logits per query head (null: none).
struct Features {
  int window = 0;
  float soft_cap = 0.f;
  const float* alibi = nullptr;
  const float* sinks = nullptr;
  bool plain() const { return window <= 0 && soft_cap <= 0.f && !alibi && !sinks; }
};

// The keys one query row reads: its window's blocks from `first_block` on, `keys` of
// them in all (from that block's first token), the first `skip` before the window;
// the row's own position `query_pos` and `pos0`, the first key's.
struct KeyRange {
  int first_block = 0, keys = 0, skip = 0, pos0 = 0, query_pos = 0;
  KeyRange() = default;
  KeyRange(int visible, int block_size, int window) {
    const int first = window > 0 ? std::max(0, visible - window) : 0;
    first_block = first / block_size;
    pos0 = first_block * block_size;
    keys = visible - pos0;
    skip = first - pos0;
    query_pos = visible - 1;
  }
};

// A query row's features: applied to its scores before the softmax.
struct RowFeatures {
  const Features* features = nullptr;  // null: plain causal attention
  KeyRange range;
  int head0 = 0;  // the first query head of the group
};

// s[0..n), the logits of query head head0 + g: the row's features, then softmax
// (with the head's sink logit in the denominator, where it has one).
inline void softmax_row(float* s, int n, const RowFeatures& row, int g) {
  if (!row.features || row.features->plain()) {
    softmax(s, n);
    return;
  }
  // (no infinities: the readers build with -ffast-math; the keys before the window
  // are left out of the max and the sum, and get probability 0)
  const Features& f = *row.features;
  const int h = row.head0 + g, skip = row.range.skip;
  if (f.soft_cap > 0.f) {
    const float inv = 1.f / f.soft_cap;
    for (int t = skip; t < n; ++t) s[t] = f.soft_cap * std::tanh(s[t] * inv);
  }
  if (f.alibi) {
    const float slope = f.alibi[h];
    const int d0 = row.range.pos0 - row.range.query_pos;  // j - i of s[0]
    for (int t = skip; t < n; ++t) s[t] += slope * float(d0 + t);
  }
  float m = f.sinks ? f.sinks[h] : s[skip];
  for (int t = skip; t < n; ++t) m = std::max(m, s[t]);
  float sum = f.sinks ? std::exp(f.sinks[h] - m) : 0.f;
  for (int t = 0; t < skip; ++t) s[t] = 0.f;
  for (int t = skip; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int t = skip; t < n; ++t) s[t] *= inv;
}

// The (block, kv head) pages of a cache whose elements are E (the model dtype, or
// int8_t with per-token scales after K and V): where K and V rows and scales are.
template <typename E>
struct Pages {
  static constexpr bool kInt8 = std::is_same_v<E, int8_t>;
  const E* cache;
  int64_t block_stride, head_stride;
  int block_size, head_size;
  const E* page(int64_t block, int head) const {
    return cache + block * block_stride + head * head_stride;
  }
  const E* keys(const E* p) const { return p; }
  const E* values(const E* p) const { return p + int64_t(block_size) * head_size; }
  // (k_scale, v_scale) per token of an INT8 page
  const float* scales(const E* p) const {
    return reinterpret_cast<const float*>(p + 2 * int64_t(block_size) * head_size);
  }
  float scale(const E* p, int t, int which) const {  // which: 0 = K, 1 = V
    if constexpr (kInt8) return scales(p)[2 * t + which];
    return 1.f;
  }
  // K, V (and an INT8 page's scales): the bytes a work item reads from a page
  int64_t page_bytes() const {
    return int64_t(block_size) * (2 * head_size * int64_t(sizeof(E)) + (kInt8 ? 8 : 0));
  }
  float key_scale(const E* p, int t) const { return scale(p, t, 0); }
  float value_scale(const E* p, int t) const { return scale(p, t, 1); }
};

// The pages (K and V of one kv head) of the work item a thread runs next, asked for
// into L2 by the item running now: ``pace(calls)`` spreads their lines over the calls
// to ``ask()`` that item will make.
template <typename P>
struct NextItem {
  const P* pages = nullptr;
  const int32_t* blocks = nullptr;
  int count = 0, head = 0, page = 0, per_call = 0;
  int64_t at = 0, page_bytes = 0;
  const char* base = nullptr;

  NextItem() = default;
  NextItem(const P& p, const int32_t* b, int visible, int h)
      : pages(&p), blocks(b), count(visible > 0 ? (visible + p.block_size - 1) / p.block_size : 0),
        head(h) {
    page_bytes = p.page_bytes();
    base = count ? reinterpret_cast<const char*>(p.page(blocks[0], head)) : nullptr;
  }
  void pace(int calls) {
    const int64_t lines = int64_t(count) * page_bytes / 64;
    per_call = calls > 0 ? int((lines + calls - 1) / calls) : 0;
  }
  void ask() {
    for (int i = 0; i < per_call && base; ++i) {
      __builtin_prefetch(base + at, 0, 2);  // prefetcht1 on x86; any target builds it
      if ((at += 64) >= page_bytes) {
        at = 0;
        base = ++page < count ? reinterpret_cast<const char*>(pages->page(blocks[page], head))
                              : nullptr;
      }
    }
  }
};

// Attention of `num_q` query heads (one kv-head group) of one query token over
// the first `seq_len` cached tokens. Scratch: scores [G, seq_len], row [D].
template <typename QT, typename Pages>
void attend_one(const QT* query, int64_t q_head_stride, QT* out, int64_t o_head_stride,
                const Pages& pages, const int32_t* blocks, int kv_head, int seq_len,
                int group, float scale, const RowFeatures& row_features,
                std::vector<float>& qf, std::vector<float>& acc,
                std::vector<float>& scores, std::vector<float>& row) {
  const int d = pages.head_size, bs = pages.block_size;
  if (seq_len <= 0) {
    for (int g = 0; g < group; ++g)
      for (int i = 0; i < d; ++i) store(0.f, out + g * o_head_stride + i);
    return;
  }
  qf.resize(size_t(group) * d);
  acc.assign(size_t(group) * d, 0.f);
  scores.resize(size_t(group) * seq_len);
  row.resize(d);
  for (int g = 0; g < group; ++g) {
    load_row(query + g * q_head_stride, &qf[size_t(g) * d], d);
    for (int i = 0; i < d; ++i) qf[size_t(g) * d + i] *= scale;
  }
  // Every cached K (value = false) or V row as float32 in `row`, with its
  // position and (INT8) scale.
  auto for_each_row = [&](bool value, auto&& visit) {
    for (int j = 0; j * bs < seq_len; ++j) {
      const auto* p = pages.page(blocks[j], kv_head);
      const auto* rows = value ? pages.values(p) : pages.keys(p);
      for (int t = 0; t < std::min(bs, seq_len - j * bs); ++t) {
        load_row(rows + int64_t(t) * d, row.data(), d);
        visit(j * bs + t, value ? pages.value_scale(p, t) : pages.key_scale(p, t));
      }
    }
  };
  for_each_row(false, [&](int pos, float k_scale) {
    for (int g = 0; g < group; ++g)
      scores[size_t(g) * seq_len + pos] = dot(&qf[size_t(g) * d], row.data(), d) * k_scale;
  });
  for (int g = 0; g < group; ++g) softmax_row(&scores[size_t(g) * seq_len], seq_len, row_features, g);
  for_each_row(true, [&](int pos, float v_scale) {
    for (int g = 0; g < group; ++g)
      axpy(scores[size_t(g) * seq_len + pos] * v_scale, row.data(), &acc[size_t(g) * d], d);
  });
  for (int g = 0; g < group; ++g) {
    QT* o = out + g * o_head_stride;
    for (int i = 0; i < d; ++i) store(acc[size_t(g) * d + i], o + i);
  }
}


#ifdef ACCEL_VEC
// The vector path (AVX-512, or AVX2 + FMA: vec.h) for the head sizes it is instantiated
// for (C = D / Vec::kLanes vectors per row). Per page: the K (then V) rows are converted
// to float32 once into an L1 buffer (INT8: times their per-token scale), then every
// query head of the group makes kLanes scores at a time with kLanes independent FMA
// chains, reduced together, and adds the page's weighted V rows with its accumulators
// in registers (at most kAcc at a time: AVX2 has 16 registers, AVX-512 32).

using V = Vec;
constexpr int kLanes = V::kLanes;
constexpr int kAcc = kLanes == 16 ? 16 : 8;

// Pages are scattered over the cache: ask for the next one while this one is
// being used (the hardware prefetchers stop at 4 KiB boundaries).
template <typename E>
inline void prefetch(const E* p, int64_t count) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < count * int64_t(sizeof(E)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// `n` rows of a K or V section into float32 rows (times the row's scale).
template <int C, typename T, typename Pages, typename P>
inline void rows_to_float(const T* src, const Pages& pages, const P* page, bool value, int n,
                          float* dst) {
  constexpr int D = kLanes * C;
  for (int t = 0; t < n; ++t) {
    float s = 1.f;
    if constexpr (Pages::kInt8) s = value ? pages.value_scale(page, t) : pages.key_scale(page, t);
    const V::R sv = V::set1(s);
    for (int c = 0; c < C; ++c) {
      V::R x = V::load(src + t * D + kLanes * c);
      if constexpr (Pages::kInt8) x = V::mul(x, sv);
      V::store(x, dst + t * D + kLanes * c);
    }
  }
}

template <int C, typename QT, typename Pages>
void attend_one_vec(const QT* query, int64_t q_head_stride, QT* out, int64_t o_head_stride,
                    const Pages& pages, const int32_t* blocks, int kv_head, int seq_len,
                    int group, float scale, const RowFeatures& row_features,
                    std::vector<float>& qf, std::vector<float>& acc,
                    std::vector<float>& scores, std::vector<float>& rows) {
  constexpr int D = kLanes * C;
  const int bs = pages.block_size;
  const int padded = (seq_len + kLanes - 1) / kLanes * kLanes;
  qf.resize(size_t(group) * D);
  scores.resize(size_t(group) * padded);
  rows.resize(size_t(bs + kLanes) * D);
  for (int g = 0; g < group; ++g)
    for (int i = 0; i < D; ++i) qf[g * D + i] = to_float(query[g * q_head_stride + i]) * scale;
  const int num_blocks = (seq_len + bs - 1) / bs;
  for (int j = 0; j < num_blocks; ++j) {
    const auto* p = pages.page(blocks[j], kv_head);
    const int n = std::min(bs, seq_len - j * bs);
    if (j + 1 < num_blocks) prefetch(pages.keys(pages.page(blocks[j + 1], kv_head)), int64_t(bs) * D);
    else prefetch(pages.values(pages.page(blocks[0], kv_head)), int64_t(bs) * D);
    rows_to_float<C>(pages.keys(p), pages, p, false, n, rows.data());
    const int nv = (n + kLanes - 1) / kLanes * kLanes;  // rows past n are read but their scores unused
    for (int g = 0; g < group; ++g) {
      const float* q = &qf[g * D];
      for (int t0 = 0; t0 < nv; t0 += kLanes) {
        V::R a[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          const float* k = rows.data() + size_t(t0 + t) * D;
          V::R sum = V::mul(V::load(q), V::load(k));
          for (int c = 1; c < C; ++c) sum = V::fmadd(V::load(q + kLanes * c), V::load(k + kLanes * c), sum);
          a[t] = sum;
        }
        V::store(V::sums(a), &scores[size_t(g) * padded + j * bs + t0]);
      }
    }
  }
  for (int g = 0; g < group; ++g) softmax_row(&scores[size_t(g) * padded], seq_len, row_features, g);
  acc.assign(size_t(group) * D, 0.f);
  for (int j = 0; j < num_blocks; ++j) {
    const auto* p = pages.page(blocks[j], kv_head);
    const int n = std::min(bs, seq_len - j * bs);
    if (j + 1 < num_blocks) prefetch(pages.values(pages.page(blocks[j + 1], kv_head)), int64_t(bs) * D);
    rows_to_float<C>(pages.values(p), pages, p, true, n, rows.data());
    for (int g = 0; g < group; ++g) {
      const float* w = &scores[size_t(g) * padded + j * bs];
      for (int c0 = 0; c0 < C; c0 += kAcc) {  // kAcc columns' sums stay in registers over the page
        constexpr int CB = C < kAcc ? C : kAcc;
        const int cb = std::min(CB, C - c0);
        V::R a[CB];
        for (int c = 0; c < cb; ++c) a[c] = V::load(&acc[g * D + kLanes * (c0 + c)]);
        for (int t = 0; t < n; ++t) {
          const V::R pw = V::set1(w[t]);
          const float* v = rows.data() + size_t(t) * D + kLanes * c0;
          for (int c = 0; c < cb; ++c) a[c] = V::fmadd(pw, V::load(v + kLanes * c), a[c]);
        }
        for (int c = 0; c < cb; ++c) V::store(a[c], &acc[g * D + kLanes * (c0 + c)]);
      }
    }
  }
  for (int g = 0; g < group; ++g)
    for (int i = 0; i < D; ++i) store(acc[g * D + i], out + g * o_head_stride + i);
}
#endif  // ACCEL_VEC

#ifdef __AVX512F__
// One head's V sums from the pair-of-tokens loops, times `scale`, into its D output
// columns: accumulator 2r (2r+1) holds, in lane 4l + i, column 32r + 8l + i (+ 4).
template <int C, typename T>
inline void store_pair_sums(const float* lanes, float scale, T* out) {
  for (int c = 0; c < C; ++c)
    for (int l = 0; l < 4; ++l)
      for (int i = 0; i < 4; ++i)
        store(lanes[16 * c + 4 * l + i] * scale, out + 32 * (c / 2) + 8 * l + 4 * (c % 2) + i);
}

#ifdef __AVX512BF16__
// bf16 model and cache on a CPU with AVX512_BF16: dot products in bf16 (exact
// products, float32 sums), reading the cache in place. The probabilities are
// rounded to bf16 for the V sum (each pair of tokens is one bf16 dot), as matmul
// kernels do; the V pass reads each pair of V rows once for up to GB query heads.
// Decode of a batch walks pages scattered over the cache, which the hardware
// prefetchers do not follow: ``next`` asks for the next work item's pages into L2 a few
// lines at a time from inside this item's loops, so that stream overlaps this item's
// arithmetic. (A burst of a page's 128 lines one page ahead stalled the pass that
// issued it and left the memory idle in the others: 64 requests x 192 tokens, the
// default model's 30 layers, one AMD EPYC Zen 4 core: 34.5 ms, 8 GB/s of ~26.)
template <int C>
void attend_one_bf16(const bf16* query, int64_t q_head_stride, bf16* out, int64_t o_head_stride,
                     const Pages<bf16>& pages, const int32_t* blocks, int kv_head, int seq_len,
                     int group, float scale, const RowFeatures& row_features,
                     std::vector<float>& acc, std::vector<float>& scores,
                     std::vector<bf16>& probs, NextItem<Pages<bf16>>& next) {
  constexpr int D = 16 * C, R = C / 2;  // R: 32-element bf16 vectors per row
  constexpr int GB = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // heads per V pass: GB * C accumulators
  const int bs = pages.block_size;
  const int padded = (seq_len + 15) / 16 * 16;
  const int num_blocks = (seq_len + bs - 1) / bs;
  const int v_passes = (group + GB - 1) / GB;
  // the calls to next.ask below: a 16-row chunk per head, a pair of rows per V pass
  next.pace(group * (padded / 16) + v_passes * ((seq_len + 1) / 2 + num_blocks));
  scores.resize(size_t(group) * padded);
  const __m512 scale_v = _mm512_set1_ps(scale);
  for (int j = 0; j < num_blocks; ++j) {
    const bf16* k = pages.keys(pages.page(blocks[j], kv_head));
    const int n16 = (std::min(bs, seq_len - j * bs) + 15) / 16 * 16;  // extra rows: unused
    for (int g = 0; g < group; ++g) {
      __m512bh q[R];
      for (int r = 0; r < R; ++r) q[r] = (__m512bh)_mm512_loadu_si512(query + g * q_head_stride + 32 * r);
      for (int t0 = 0; t0 < n16; t0 += 16) {
        next.ask();
        __m512 a[16];
        for (int t = 0; t < 16; ++t) {
          const bf16* row = k + size_t(t0 + t) * D;
          __m512 sum = _mm512_setzero_ps();
          for (int r = 0; r < R; ++r)
            sum = _mm512_dpbf16_ps(sum, q[r], (__m512bh)_mm512_loadu_si512(row + 32 * r));
          a[t] = sum;
        }
        _mm512_storeu_ps(&scores[size_t(g) * padded + j * bs + t0], _mm512_mul_ps(V::sums(a), scale_v));
      }
    }
  }
  // softmax; probabilities in bf16, a 0 after the last
  probs.resize(size_t(group) * (padded + 2));
  for (int g = 0; g < group; ++g) {
    float* s = &scores[size_t(g) * padded];
    softmax_row(s, seq_len, row_features, g);
    bf16* pg = &probs[size_t(g) * (padded + 2)];
    for (int t = 0; t < seq_len; ++t) store(s[t], pg + t);
    pg[seq_len].bits = 0;
  }
  acc.assign(size_t(group) * D, 0.f);
  for (int g0 = 0; g0 < group; g0 += GB) {
    const int heads = std::min(GB, group - g0);
    for (int j = 0; j < num_blocks; ++j) {
      const int n = std::min(bs, seq_len - j * bs);
      const bf16* v = pages.values(pages.page(blocks[j], kv_head));
      // Summed over pairs of tokens (unpacklo/hi of rows t, t+1): see store_pair_sums.
      __m512 a[GB][C];
      for (int g = 0; g < GB; ++g)
        for (int c = 0; c < C; ++c)
          a[g][c] = g < heads ? _mm512_loadu_ps(&acc[(g0 + g) * D + 16 * c]) : _mm512_setzero_ps();
      next.ask();
      for (int t = 0; t < n; t += 2) {
        next.ask();
        __m512i u[C];
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_loadu_si512(v + size_t(t) * D + 32 * r);
          const __m512i y = t + 1 < n ? _mm512_loadu_si512(v + size_t(t + 1) * D + 32 * r)
                                      : _mm512_setzero_si512();
          u[2 * r] = _mm512_unpacklo_epi16(x, y);
          u[2 * r + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GB; ++g) {
          if (g >= heads) break;
          uint32_t pair;  // (p[t], p[t+1]); p past the end is 0
          std::memcpy(&pair, &probs[size_t(g0 + g) * (padded + 2) + j * bs + t], 4);
          if (t + 1 == n) pair &= 0xffffu;
          const __m512bh w = (__m512bh)_mm512_set1_epi32(int(pair));
          for (int c = 0; c < C; ++c) a[g][c] = _mm512_dpbf16_ps(a[g][c], w, (__m512bh)u[c]);
        }
      }
      for (int g = 0; g < heads; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(&acc[(g0 + g) * D + 16 * c], a[g][c]);
    }
  }
  for (int g = 0; g < group; ++g) store_pair_sums<C>(&acc[g * D], 1.f, out + g * o_head_stride);
}
#endif  // __AVX512BF16__

#ifdef __AVX512VNNI__
// INT8 cache, head size a multiple of 32, bf16 query: integer dot products read from
// the cache in place. Q.K^T: each query head is rounded to int16 (scale: its max
// |element| / 32767) and split into a signed high byte and an unsigned low byte
// (q = 256 hi + lo); a key row's codes meet the low bytes as they are and the high
// bytes flipped to unsigned (+128, one xor), in two vpdpbusd (64 products each) whose
// sums add as 256 x high + low, less 32768 x sum(hi) for the flip. int32 arithmetic
// wraps, and the final dot is below 2^31, so the score is the exact integer dot of the
// int16 query and the codes, times (query scale x K scale). P.V: the probabilities
// times their token's V scale are rounded to int16 per head the same way and summed
// over pairs of tokens with vpdpwssd, in int32 within a page (at most 256 tokens x
// 32767 x 127 < 2^31), then in float32; a pair of V rows is widened to int16 once for
// up to GB query heads. Before (K and V widened to int16 page by page into a buffer,
// vpdpwssd, one head per V pass): 1.3-1.5x the bf16 kernel's time on 64 requests x
// 192 tokens, the default model's 30 layers, one AMD EPYC Zen 4 core.

inline __mmask16 first(int n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1); }

// x[0..n) -> round(x / s) in int16 with s = max |x| / 32767 (1 if all are 0); returns s.
inline float quantize16(const float* x, int n, int16_t* dst) {
  __m512 m = _mm512_setzero_ps();
  for (int i = 0; i < n; i += 16)
    m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps(first(n - i), x + i)));
  const float top = _mm512_reduce_max_ps(m);
  const float s = top > 0.f ? top / 32767.f : 1.f;
  const __m512 inv = _mm512_set1_ps(1.f / s);
  for (int i = 0; i < n; i += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(first(n - i), x + i), inv));
    _mm256_mask_storeu_epi16(dst + i, first(n - i), _mm512_cvtepi32_epi16(q));
  }
  return s;
}

// The first min(64, n) bytes at p, zeros after.
inline __m512i load_bytes(const int8_t* p, int n) {
  return n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
}

template <int C>
void attend_one_int8(const bf16* query, int64_t q_head_stride, bf16* out, int64_t o_head_stride,
                     const Pages<int8_t>& pages, const int32_t* blocks, int kv_head, int seq_len,
                     int group, float scale, const RowFeatures& row_features,
                     std::vector<float>& qf, std::vector<float>& acc,
                     std::vector<float>& scores, std::vector<int16_t>& codes,
                     NextItem<Pages<int8_t>>& next) {
  constexpr int D = 16 * C, R = C / 2;  // R: 32-code halves of a row, widened to int16
  constexpr int Z = (D + 63) / 64;       // 64-code vectors per row (the last one partial)
  constexpr int GB = C <= 4 ? 4 : C <= 8 ? 2 : 1;  // heads per V pass: GB * C accumulators
  const int bs = pages.block_size;
  const int padded = (seq_len + 15) / 16 * 16;
  const int num_blocks = (seq_len + bs - 1) / bs;
  const int v_passes = (group + GB - 1) / GB;
  // the calls to next.ask below: a 16-row chunk per head, a pair of rows per V pass
  next.pace(group * (padded / 16) + v_passes * ((seq_len + 1) / 2 + num_blocks));
  // qf: the query heads in float32, then per head its score factor, weight scale and
  // the dot's offset 32768 x sum(hi) (int32 bits)
  qf.resize(size_t(group) * (D + 3));
  float* score_scale = &qf[size_t(group) * D];
  float* w_scale = score_scale + group;
  float* offset = w_scale + group;
  // codes: per head its weights (+ a 0 after the last), then the query heads' high
  // and low bytes (Z x 64 each, zero-padded)
  codes.resize(size_t(group) * (padded + 2) + size_t(group) * Z * 64 + D);
  int16_t* w16 = codes.data();
  int8_t* q_hi = reinterpret_cast<int8_t*>(w16 + size_t(group) * (padded + 2));
  int16_t* q16 = reinterpret_cast<int16_t*>(q_hi + size_t(group) * Z * 128);
  for (int g = 0; g < group; ++g) {
    for (int i = 0; i < D; ++i) qf[g * D + i] = to_float(query[g * q_head_stride + i]);
    score_scale[g] = quantize16(&qf[g * D], D, q16) * scale;
    int8_t* hi = q_hi + size_t(g) * Z * 128;
    uint8_t* lo = reinterpret_cast<uint8_t*>(hi + Z * 64);
    int sum_hi = 0;
    for (int i = 0; i < Z * 64; ++i) {
      const int c = i < D ? q16[i] : 0;
      hi[i] = int8_t(c >> 8);  // floor: c = 256 hi + lo, lo in [0, 255]
      lo[i] = uint8_t(c & 0xff);
      sum_hi += c >> 8;
    }
    const int32_t off = 32768 * sum_hi;
    std::memcpy(&offset[g], &off, 4);
  }
  scores.resize(size_t(group) * padded);
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i flip = _mm512_set1_epi8(char(0x80));
  const auto add_int = [](__m512 x, __m512 y) {
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(x), _mm512_castps_si512(y)));
  };
  for (int j = 0; j < num_blocks; ++j) {
    const int8_t* page = pages.page(blocks[j], kv_head);
    const int8_t* k = pages.keys(page);
    const int n16 = (std::min(bs, seq_len - j * bs) + 15) / 16 * 16;  // extra rows: unused
    for (int g = 0; g < group; ++g) {
      __m512i hi[Z], lo[Z];
      for (int z = 0; z < Z; ++z) {
        hi[z] = _mm512_loadu_si512(q_hi + (g * Z * 2 + z) * 64);
        lo[z] = _mm512_loadu_si512(q_hi + (g * Z * 2 + Z + z) * 64);
      }
      const __m512 qs = _mm512_set1_ps(score_scale[g]);
      int32_t offset_g;
      std::memcpy(&offset_g, &offset[g], 4);
      const __m512i off = _mm512_set1_epi32(offset_g);
      for (int t0 = 0; t0 < n16; t0 += 16) {
        next.ask();
        __m512 a[16];
        for (int t = 0; t < 16; ++t) {
          const int8_t* row = k + size_t(t0 + t) * D;
          __m512i codes_z[Z], sum = _mm512_setzero_si512();
          for (int z = 0; z < Z; ++z) {
            codes_z[z] = load_bytes(row + 64 * z, D - 64 * z);
            sum = _mm512_dpbusd_epi32(sum, _mm512_xor_si512(codes_z[z], flip), hi[z]);
          }
          sum = _mm512_slli_epi32(sum, 8);
          for (int z = 0; z < Z; ++z) sum = _mm512_dpbusd_epi32(sum, lo[z], codes_z[z]);
          a[t] = _mm512_castsi512_ps(sum);
        }
        const float* ks = &pages.scales(page)[2 * t0];  // (k_scale, v_scale) pairs
        const __m512 k_scale = _mm512_permutex2var_ps(_mm512_loadu_ps(ks), evens, _mm512_loadu_ps(ks + 16));
        const __m512i dots = _mm512_sub_epi32(_mm512_castps_si512(reduce16(a, add_int)), off);
        _mm512_storeu_ps(&scores[size_t(g) * padded + j * bs + t0],
                         _mm512_mul_ps(_mm512_cvtepi32_ps(dots), _mm512_mul_ps(qs, k_scale)));
      }
    }
  }
  for (int g = 0; g < group; ++g) {
    float* s = &scores[size_t(g) * padded];
    softmax_row(s, seq_len, row_features, g);
    for (int j = 0; j < num_blocks; ++j) {
      const float* sc = pages.scales(pages.page(blocks[j], kv_head));
      const int n = std::min(bs, seq_len - j * bs);
      for (int t = 0; t < n; ++t) s[j * bs + t] *= sc[2 * t + 1];
    }
    int16_t* wg = w16 + size_t(g) * (padded + 2);
    w_scale[g] = quantize16(s, seq_len, wg);
    wg[seq_len] = 0;
  }
  acc.assign(size_t(group) * D, 0.f);
  for (int g0 = 0; g0 < group; g0 += GB) {
    const int heads = std::min(GB, group - g0);
    for (int j = 0; j < num_blocks; ++j) {
      const int n = std::min(bs, seq_len - j * bs);
      const int8_t* v = pages.values(pages.page(blocks[j], kv_head));
      // Summed over pairs of tokens (unpacklo/hi of rows t, t+1): see store_pair_sums.
      __m512i a[GB][C];
      for (int g = 0; g < GB; ++g)
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_si512();
      next.ask();
      for (int t = 0; t < n; t += 2) {
        next.ask();
        __m512i u[C];
        for (int r = 0; r < R; ++r) {
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(v + size_t(t) * D + 32 * r)));
          const __m512i y = t + 1 < n ? _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)(v + size_t(t + 1) * D + 32 * r)))
                                      : _mm512_setzero_si512();
          u[2 * r] = _mm512_unpacklo_epi16(x, y);
          u[2 * r + 1] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < GB; ++g) {
          if (g >= heads) break;
          uint32_t pair;  // (w[t], w[t+1]); w past the page's end is 0
          std::memcpy(&pair, w16 + size_t(g0 + g) * (padded + 2) + j * bs + t, 4);
          if (t + 1 == n) pair &= 0xffffu;
          const __m512i w = _mm512_set1_epi32(int(pair));
          for (int c = 0; c < C; ++c) a[g][c] = _mm512_dpwssd_epi32(a[g][c], u[c], w);
        }
      }
      for (int g = 0; g < heads; ++g)
        for (int c = 0; c < C; ++c) {
          float* lanes = &acc[(g0 + g) * D + 16 * c];
          _mm512_storeu_ps(lanes, _mm512_add_ps(_mm512_loadu_ps(lanes), _mm512_cvtepi32_ps(a[g][c])));
        }
    }
  }
  for (int g = 0; g < group; ++g) store_pair_sums<C>(&acc[g * D], w_scale[g], out + g * o_head_stride);
}
#endif  // __AVX512VNNI__
#endif  // __AVX512F__

#ifdef ACCEL_VEC
// Calls f(std::integral_constant<int, C>{}) if c is one of the instantiated Cs
// (vectors per head row); returns whether it did.
template <int... Cs, typename F>
inline bool with_vectors(int c, F&& f) {
  return ((c == Cs && (f(std::integral_constant<int, Cs>{}), true)) || ...);
}

// Runs a vector path if one has an instantiation for this head size: on AVX-512 the
// BF16 / VNNI kernels where the CPU has them, else (and on AVX2) the float32 one.
template <typename QT, typename Pages>
bool attend_one_fast(const QT* query, int64_t q_head_stride, QT* out, int64_t o_head_stride,
                     const Pages& pages, const int32_t* blocks, int kv_head, int seq_len,
                     int group, float scale, const RowFeatures& row_features,
                     std::vector<float>& qf, std::vector<float>& acc,
                     std::vector<float>& scores, std::vector<float>& rows,
                     std::vector<bf16>& probs, std::vector<int16_t>& codes,
                     NextItem<Pages>& next) {
  if (seq_len <= 0 || pages.head_size % 16) return false;
  [[maybe_unused]] const int c16 = pages.head_size / 16;
#ifdef __AVX512VNNI__
  // bf16 models only: fp32/fp16 ones keep float32 probabilities (the float path)
  if constexpr (Pages::kInt8 && std::is_same_v<QT, bf16>) {
    if (pages.block_size <= 256  // the int32 page sums' bound
        && with_vectors<2, 4, 6, 8, 16>(c16, [&](auto C) {
             attend_one_int8<decltype(C)::value>(query, q_head_stride, out, o_head_stride,
                                                 pages, blocks, kv_head, seq_len, group, scale,
                                                 row_features, qf, acc, scores, codes, next);
           }))
      return true;
  }
#endif
#ifdef __AVX512BF16__
  if constexpr (std::is_same_v<QT, bf16> && !Pages::kInt8) {
    if (with_vectors<2, 4, 6, 8, 16>(c16, [&](auto C) {
          attend_one_bf16<decltype(C)::value>(query, q_head_stride, out, o_head_stride, pages,
                                              blocks, kv_head, seq_len, group, scale,
                                              row_features, acc, scores, probs, next);
        }))
      return true;
  }
#endif
  (void)probs, (void)codes, (void)next;
  // head sizes 32, 64, 80, 96, 128, 256
  constexpr int k = 16 / kLanes;
  return with_vectors<2 * k, 4 * k, 5 * k, 6 * k, 8 * k, 16 * k>(pages.head_size / kLanes, [&](auto C) {
    attend_one_vec<decltype(C)::value>(query, q_head_stride, out, o_head_stride, pages, blocks,
                                       kv_head, seq_len, group, scale, row_features, qf, acc,
                                       scores, rows);
  });
}
#endif  // ACCEL_VEC

// Causal attention of every request's newest q_len tokens (decode: q_len 1), with the
// model's features (null: none). Query/output rows of request r: query_start_loc[r] ..
// query_start_loc[r+1]. Work items are (request, kv head, query row): all independent.
// A row reads only its window's blocks (those before it may be vLLM's freed null block).
template <typename QT, typename Pages>
void paged_attention(const QT* query, int64_t q_tok_stride, int64_t q_head_stride, QT* out,
                     int64_t o_tok_stride, int64_t o_head_stride, const Pages& pages,
                     const int32_t* block_table, int64_t bt_stride, const int32_t* query_start_loc,
                     const int32_t* seq_lens, int num_reqs, int num_heads, int num_kv_heads,
                     float scale, const Features* features) {
  const int group = num_heads / num_kv_heads;
  const int window = features ? features->window : 0;
  const int64_t num_rows = query_start_loc[num_reqs];
  std::vector<int32_t> row_req(num_rows);
  for (int r = 0; r < num_reqs; ++r)
    for (int32_t i = query_start_loc[r]; i < query_start_loc[r + 1]; ++i) row_req[i] = r;
  // Row i is position seq_len - q_len + (i - start): it sees keys up to itself.
  const auto visible_of = [&](int64_t i) {
    const int r = row_req[i];
    return seq_lens[r] - (query_start_loc[r + 1] - query_start_loc[r]) +
           int(i - query_start_loc[r]) + 1;
  };
  const int64_t items = num_rows * num_kv_heads;
#pragma omp parallel
  {
    std::vector<float> qf, acc, scores, row;
    std::vector<bf16> probs;
    std::vector<int16_t> codes;
#pragma omp for schedule(dynamic, 4)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t i = item / num_kv_heads;
      const int kv_head = int(item % num_kv_heads);
      const int r = row_req[i];
      const int h0 = kv_head * group;
      const RowFeatures rf{features, KeyRange(visible_of(i), pages.block_size, window), h0};
      const int32_t* blocks = block_table + r * bt_stride + rf.range.first_block;
      const int keys = rf.range.keys;
#ifdef ACCEL_VEC
      // this thread's next item (but at the end of a chunk of the schedule), when it is
      // a decode row: a prefill's rows reread their request's pages, which stay cached
      NextItem<Pages> next;
      if (item + 1 < items) {
        const int64_t i2 = (item + 1) / num_kv_heads;
        const int r2 = row_req[i2];
        if (query_start_loc[r2 + 1] - query_start_loc[r2] == 1) {
          const KeyRange next_range(visible_of(i2), pages.block_size, window);
          next = NextItem<Pages>(pages, block_table + r2 * bt_stride + next_range.first_block,
                                 next_range.keys, int((item + 1) % num_kv_heads));
        }
      }
      if (attend_one_fast(query + i * q_tok_stride + h0 * q_head_stride, q_head_stride,
                          out + i * o_tok_stride + h0 * o_head_stride, o_head_stride, pages,
                          blocks, kv_head, keys, group, scale, rf, qf, acc, scores, row, probs,
                          codes, next))
        continue;
#endif
      attend_one(query + i * q_tok_stride + h0 * q_head_stride, q_head_stride,
                 out + i * o_tok_stride + h0 * o_head_stride, o_head_stride, pages, blocks,
                 kv_head, keys, group, scale, rf, qf, acc, scores, row);
    }
  }
}

// Calls write(i, block, offset, h) for every token i with a slot (>= 0) and every
// kv head: the writers' shared walk.
template <typename F>
inline void for_each_slot(const int64_t* slots, int64_t num_tokens, int num_kv_heads,
                          int block_size, F&& write) {
#pragma omp parallel for if (num_tokens >= 64)
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    for (int h = 0; h < num_kv_heads; ++h) write(i, slot / block_size, slot % block_size, h);
  }
}

// Where token i, head h of the new K and V rows start (K and V may be views of
// one fused QKV output with other strides than a separate key tensor).
struct Strides {
  int64_t k_tok, k_head, v_tok, v_head;
  int64_t key(int64_t i, int h) const { return i * k_tok + h * k_head; }
  int64_t value(int64_t i, int h) const { return i * v_tok + h * v_head; }
};

template <typename T>
void write_float(const T* key, const T* value, const Strides& src, T* cache,
                 int64_t block_stride, int64_t cache_head_stride, const int64_t* slots,
                 int64_t num_tokens, int num_kv_heads, int block_size, int head_size) {
  for_each_slot(slots, num_tokens, num_kv_heads, block_size,
                [&](int64_t i, int64_t block, int64_t offset, int h) {
    T* page = cache + block * block_stride + h * cache_head_stride;
    std::memcpy(page + offset * head_size, key + src.key(i, h), sizeof(T) * head_size);
    std::memcpy(page + (int64_t(block_size) + offset) * head_size, value + src.value(i, h),
                sizeof(T) * head_size);
  });
}

// The writers must match the torch writers bit for bit: no fast-math here.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")

// Symmetric per-(token, head) quantization, the same arithmetic as the torch
// writer (reference/cache_write.py _quantize): scale = max|x| / 127 (floored), or a
// static scale; the codes as int8_codes.h makes them.
template <typename T>
float quantize_row(const T* x, int8_t* q, int n, float static_scale) {
  const float scale = static_scale > 0.f ? static_scale : std::max(abs_max(x, n) / 127.f, 1e-8f);
  int8_codes(x, n, scale, q);
  return scale;
}

template <typename T>
void write_int8(const T* key, const T* value, const Strides& src, int8_t* cache,
                int64_t block_stride, int64_t cache_head_stride, const int64_t* slots, int64_t num_tokens, int num_kv_heads, int block_size,
                int head_size, float k_scale, float v_scale) {
  for_each_slot(slots, num_tokens, num_kv_heads, block_size,
                [&](int64_t i, int64_t block, int64_t offset, int h) {
    int8_t* page = cache + block * block_stride + h * cache_head_stride;
    float* scales = reinterpret_cast<float*>(page + 2 * int64_t(block_size) * head_size);
    scales[2 * offset] =
        quantize_row(key + src.key(i, h), page + offset * head_size, head_size, k_scale);
    scales[2 * offset + 1] = quantize_row(value + src.value(i, h),
                                          page + (int64_t(block_size) + offset) * head_size,
                                          head_size, v_scale);
  });
}

#pragma GCC pop_options

// Index errors the entry points return instead of reading or writing outside the
// cache (they check before touching it).
constexpr int kTooFewColumns = -2;  // a seq_len needs more blocks than a table row has
constexpr int kBadBlockId = -3;     // a block id a request reads is outside the cache
constexpr int kBadSlot = -4;        // a slot is outside the cache

// (With a sliding window, the blocks before a request's first query row's window are
// not read: vLLM may have freed them.)
int check_block_table(const int32_t* block_table, int64_t bt_stride, int64_t bt_cols,
                      const int32_t* query_start_loc, const int32_t* seq_lens, int num_reqs,
                      int block_size, int64_t num_blocks, int window) {
  for (int r = 0; r < num_reqs; ++r) {
    const int64_t needed = (int64_t(seq_lens[r]) + block_size - 1) / block_size;
    if (needed > bt_cols) return kTooFewColumns;
    const int32_t* row = block_table + r * bt_stride;
    const int first_visible = seq_lens[r] - (query_start_loc[r + 1] - query_start_loc[r]) + 1;
    for (int64_t b = KeyRange(first_visible, block_size, window).first_block; b < needed; ++b)
      if (row[b] < 0 || row[b] >= num_blocks) return kBadBlockId;
  }
  return 0;
}

}  // namespace

extern "C" {

// float32 lanes of the vector path this build has (paged attention, the bf16 linear,
// the INT8 KV writer): 16 on AVX-512, 8 on AVX2 + FMA + F16C, 0 where only the scalar
// paths are built.
int accel_vector_lanes() {
#ifdef ACCEL_VEC
  return kLanes;
#else
  return 0;
#endif
}

// Returns 0, -1 for an unknown dtype code, or an index error below.
int accel_paged_attention(int dtype, const void* query, int64_t q_tok_stride,
                          int64_t q_head_stride, void* out, int64_t o_tok_stride,
                          int64_t o_head_stride, const void* cache, int cache_int8,
                          int64_t block_stride, int64_t head_stride, int block_size, int head_size,
                          int64_t num_blocks, const int32_t* block_table, int64_t bt_stride,
                          int64_t bt_cols, const int32_t* query_start_loc,
                          const int32_t* seq_lens, int num_reqs, int num_heads,
                          int num_kv_heads, float scale, int sliding_window, float soft_cap,
                          const float* alibi_slopes, const float* sinks) {
  if (const int rc = check_block_table(block_table, bt_stride, bt_cols, query_start_loc,
                                       seq_lens, num_reqs, block_size, num_blocks,
                                       sliding_window))
    return rc;
  const Features features{sliding_window, soft_cap, alibi_slopes, sinks};
  const Features* f = features.plain() ? nullptr : &features;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* q = static_cast<const T*>(query);
    T* o = static_cast<T*>(out);
    if (cache_int8) {
      Pages<int8_t> pages{static_cast<const int8_t*>(cache), block_stride, head_stride,
                          block_size, head_size};
      paged_attention(q, q_tok_stride, q_head_stride, o, o_tok_stride, o_head_stride, pages,
                      block_table, bt_stride, query_start_loc, seq_lens, num_reqs, num_heads,
                      num_kv_heads, scale, f);
    } else {
      Pages<T> pages{static_cast<const T*>(cache), block_stride, head_stride, block_size,
                     head_size};
      paged_attention(q, q_tok_stride, q_head_stride, o, o_tok_stride, o_head_stride, pages,
                      block_table, bt_stride, query_start_loc, seq_lens, num_reqs, num_heads,
                      num_kv_heads, scale, f);
    }
  });
}

// K/V rows [num_tokens, num_kv_heads, head_size] (token and head strides in
// elements, contiguous rows) into their slots; slot < 0 is padding. The cache
// has the K/V dtype, or is INT8 (cache_int8) with k_scale/v_scale <= 0 meaning
// dynamic scales.
int accel_cache_write(int dtype, const void* key, const void* value, int64_t k_tok_stride,
                      int64_t k_head_stride, int64_t v_tok_stride, int64_t v_head_stride,
                      void* cache, int cache_int8, int64_t block_stride,
                      int64_t cache_head_stride, const int64_t* slots, int64_t num_tokens,
                      int num_kv_heads, int block_size, int head_size, int64_t num_blocks,
                      float k_scale, float v_scale) {
  for (int64_t i = 0; i < num_tokens; ++i)
    if (slots[i] >= num_blocks * block_size) return kBadSlot;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* k = static_cast<const T*>(key);
    const T* v = static_cast<const T*>(value);
    const Strides src{k_tok_stride, k_head_stride, v_tok_stride, v_head_stride};
    if (cache_int8)
      write_int8(k, v, src, static_cast<int8_t*>(cache), block_stride,
                 cache_head_stride, slots, num_tokens, num_kv_heads, block_size, head_size,
                 k_scale, v_scale);
    else
      write_float(k, v, src, static_cast<T*>(cache), block_stride,
                  cache_head_stride, slots, num_tokens, num_kv_heads, block_size, head_size);
  });
}

}  // extern "C"
