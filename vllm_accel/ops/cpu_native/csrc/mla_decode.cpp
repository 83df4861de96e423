// MLA decode for the simulated GCU (the cpu_native provider of reference/mla.py's
// mla_decode): absorbed queries of every head against one request's latent cache rows.
//
// vLLM's latent cache is [num_blocks, block_size, W] with W = kv_lora_rank (L) + rope (R):
// a token's compressed KV c (L values, which are also its "value") then its rotated key
// part. Every head reads the same rows (MQA), so a work item is a block of heads of one
// request: its rows are widened to float32 a chunk of kLanes tokens at a time (in L1),
// and each head makes the chunk's kLanes scores with kLanes independent FMA chains
// (throughput- not latency-bound); then softmax, then the weighted sum of the rows' c
// with each head's accumulators in registers a column block at a time. Float32 math,
// one rounding at the store.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <omp.h>

#include "dtypes.h"
#include "entry_points.h"
#include "vec.h"

namespace {

using namespace accel;

struct Latents {
  const void* cache;
  int64_t block_stride, row_stride;  // elements
  int block_size, lora, rope;
};

// The float32 rows of tokens [t0, t0 + n) of a request (its block ids `blocks`), the
// first `width` values of each, into dst[n][width] (rows past n: zeros up to `rows`).
template <typename T>
void widen_rows(const Latents& lat, const int32_t* blocks, int t0, int n, int rows, int width,
                float* dst) {
  const T* cache = static_cast<const T*>(lat.cache);
  for (int t = 0; t < rows; ++t) {
    float* d = dst + int64_t(t) * width;
    if (t >= n) {
      std::fill(d, d + width, 0.f);
      continue;
    }
    const int pos = t0 + t;
    const T* src = cache + int64_t(blocks[pos / lat.block_size]) * lat.block_stride +
                   int64_t(pos % lat.block_size) * lat.row_stride;
#pragma omp simd
    for (int i = 0; i < width; ++i) d[i] = to_float(src[i]);
  }
}

inline void softmax_inplace(float* s, int n) {
  float m = s[0];
  for (int t = 1; t < n; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  for (int t = 0; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  const float inv = 1.f / sum;
  for (int t = 0; t < n; ++t) s[t] *= inv;
}

#ifdef ACCEL_VEC
constexpr int kLanes = Vec::kLanes;
constexpr int kAcc = kLanes == 16 ? 16 : 8;  // accumulators kept in registers
#else
constexpr int kLanes = 8;
#endif

// Heads [h0, h0 + nh) of one request: q [nh][W] (scaled float32) -> out rows.
template <typename T>
void attend_heads(const Latents& lat, const int32_t* blocks, int seq_len, const float* q,
                  int nh, std::vector<float>& scores, std::vector<float>& rows,
                  std::vector<float>& acc) {
  const int w = lat.lora + lat.rope, lora = lat.lora;
  const int padded = (seq_len + kLanes - 1) / kLanes * kLanes;
  scores.resize(size_t(nh) * padded);
  rows.resize(size_t(kLanes) * w);
  for (int t0 = 0; t0 < seq_len; t0 += kLanes) {
    widen_rows<T>(lat, blocks, t0, std::min(kLanes, seq_len - t0), kLanes, w, rows.data());
    for (int h = 0; h < nh; ++h) {
      const float* qh = q + int64_t(h) * w;
      float* s = &scores[size_t(h) * padded + t0];
#ifdef ACCEL_VEC
      if (w % kLanes == 0) {
        Vec::R a[kLanes];
        for (int t = 0; t < kLanes; ++t) {
          const float* r = rows.data() + int64_t(t) * w;
          Vec::R sum = Vec::mul(Vec::load(qh), Vec::load(r));
          for (int c = kLanes; c < w; c += kLanes)
            sum = Vec::fmadd(Vec::load(qh + c), Vec::load(r + c), sum);
          a[t] = sum;
        }
        Vec::store(Vec::sums(a), s);
        continue;
      }
#endif
      for (int t = 0; t < kLanes; ++t) {
        const float* r = rows.data() + int64_t(t) * w;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int i = 0; i < w; ++i) sum += qh[i] * r[i];
        s[t] = sum;
      }
    }
  }
  for (int h = 0; h < nh; ++h) softmax_inplace(&scores[size_t(h) * padded], seq_len);
  acc.assign(size_t(nh) * lora, 0.f);
  for (int t0 = 0; t0 < seq_len; t0 += kLanes) {
    const int n = std::min(kLanes, seq_len - t0);
    widen_rows<T>(lat, blocks, t0, n, n, lora, rows.data());
    for (int h = 0; h < nh; ++h) {
      const float* p = &scores[size_t(h) * padded + t0];
      float* a_h = &acc[size_t(h) * lora];
#ifdef ACCEL_VEC
      if (lora % kLanes == 0) {
        for (int c0 = 0; c0 < lora; c0 += kAcc * kLanes) {
          const int cb = std::min(kAcc, (lora - c0) / kLanes);
          Vec::R a[kAcc];
          for (int c = 0; c < cb; ++c) a[c] = Vec::load(a_h + c0 + c * kLanes);
          for (int t = 0; t < n; ++t) {
            const Vec::R pw = Vec::set1(p[t]);
            const float* r = rows.data() + int64_t(t) * lora + c0;
            for (int c = 0; c < cb; ++c) a[c] = Vec::fmadd(pw, Vec::load(r + c * kLanes), a[c]);
          }
          for (int c = 0; c < cb; ++c) Vec::store(a[c], a_h + c0 + c * kLanes);
        }
        continue;
      }
#endif
      for (int t = 0; t < n; ++t) {
        const float* r = rows.data() + int64_t(t) * lora;
#pragma omp simd
        for (int i = 0; i < lora; ++i) a_h[i] += p[t] * r[i];
      }
    }
  }
}

template <typename T>
void mla_decode(const T* q_nope, int64_t qn_tok, int64_t qn_head, const T* q_pe,
                int64_t qp_tok, int64_t qp_head, T* out, int64_t o_tok, int64_t o_head,
                const Latents& lat, const int32_t* block_table, int64_t bt_stride,
                const int32_t* seq_lens, int num_reqs, int num_heads, float scale) {
  const int w = lat.lora + lat.rope;
  // heads per work item: all of a request's where the batch keeps every thread busy,
  // else fewer (a batch of one still uses every core; each item rereads the rows)
  const int threads = omp_get_max_threads();
  const int splits = std::max(1, std::min(num_heads, (2 * threads + num_reqs - 1) / num_reqs));
  const int per_item = (num_heads + splits - 1) / splits;
  const int items_per_req = (num_heads + per_item - 1) / per_item;
  const int64_t items = int64_t(num_reqs) * items_per_req;
#pragma omp parallel
  {
    std::vector<float> q, scores, rows, acc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int r = int(item / items_per_req);
      const int h0 = int(item % items_per_req) * per_item;
      const int nh = std::min(per_item, num_heads - h0);
      const int seq_len = seq_lens[r];
      if (seq_len <= 0) {
        for (int h = h0; h < h0 + nh; ++h)
          for (int i = 0; i < lat.lora; ++i) store(0.f, out + r * o_tok + h * o_head + i);
        continue;
      }
      q.resize(size_t(nh) * w);
      for (int h = 0; h < nh; ++h) {
        const T* qn = q_nope + r * qn_tok + (h0 + h) * qn_head;
        const T* qp = q_pe + r * qp_tok + (h0 + h) * qp_head;
        float* qh = &q[size_t(h) * w];
        for (int i = 0; i < lat.lora; ++i) qh[i] = to_float(qn[i]) * scale;
        for (int i = 0; i < lat.rope; ++i) qh[lat.lora + i] = to_float(qp[i]) * scale;
      }
      attend_heads<T>(lat, block_table + r * bt_stride, seq_len, q.data(), nh, scores, rows,
                      acc);
      for (int h = 0; h < nh; ++h)
        for (int i = 0; i < lat.lora; ++i)
          store(acc[size_t(h) * lat.lora + i], out + r * o_tok + (h0 + h) * o_head + i);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, -1 for an unknown dtype code, -2/-3 for a block table that does not cover a
// request or holds ids outside the cache (checked before any read).
int accel_mla_decode(int dtype, const void* q_nope, int64_t qn_tok, int64_t qn_head,
                     const void* q_pe, int64_t qp_tok, int64_t qp_head, void* out, int64_t o_tok,
                     int64_t o_head, const void* cache, int64_t num_blocks, int64_t block_stride,
                     int64_t row_stride, int block_size, int lora, int rope,
                     const int32_t* block_table, int64_t bt_stride, int64_t bt_cols,
                     const int32_t* seq_lens, int num_reqs, int num_heads, float scale) {
  for (int r = 0; r < num_reqs; ++r) {
    const int64_t needed = (int64_t(seq_lens[r]) + block_size - 1) / block_size;
    if (needed > bt_cols) return -2;
    for (int64_t b = 0; b < needed; ++b) {
      const int32_t id = block_table[r * bt_stride + b];
      if (id < 0 || id >= num_blocks) return -3;
    }
  }
  const Latents lat{cache, block_stride, row_stride, block_size, lora, rope};
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    mla_decode(static_cast<const T*>(q_nope), qn_tok, qn_head, static_cast<const T*>(q_pe),
               qp_tok, qp_head, static_cast<T*>(out), o_tok, o_head, lat, block_table,
               bt_stride, seq_lens, num_reqs, num_heads, scale);
  });
}

}  // extern "C"
