// RMSNorm (optionally fused with the residual add), SiluAndMul and rotary embedding for the
// simulated GCU, built with paged_attention.cpp into one library (cpu_native/build.py).
//
// Each computes in float32 and rounds to the model dtype once, at the output (the
// residual of the fused add is an output too), as vLLM's CPU kernels do. The
// reference kernels (ops/custom_ops.py) follow vLLM's forward_native instead,
// which rounds after several steps, so the two may differ by one ulp of the
// model dtype. Every operand is widened to float before any arithmetic: with
// native half-precision units (AVX512-FP16), -ffast-math could otherwise narrow
// the arithmetic to _Float16 and fuse it, which rounds differently by CPU.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"

namespace {

using namespace accel;

template <typename T>
void rms_norm(const T* x, int64_t x_stride, const T* residual, int64_t r_stride, const T* weight,
              T* out, int64_t o_stride, T* new_residual, int64_t nr_stride, int64_t rows, int n,
              float eps) {
#pragma omp parallel if (rows >= 16)
  {
    std::vector<float> h(n);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * x_stride;
#pragma omp simd
      for (int i = 0; i < n; ++i) h[i] = to_float(xr[i]);
      if (residual) {
        const T* rr = residual + r * r_stride;
        T* nr = new_residual + r * nr_stride;
#pragma omp simd
        for (int i = 0; i < n; ++i) {
          h[i] += to_float(rr[i]);
          store(h[i], nr + i);
        }
      }
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int i = 0; i < n; ++i) sum += h[i] * h[i];
      const float inv = 1.f / std::sqrt(sum / float(n) + eps);
      T* o = out + r * o_stride;
      if (weight) {
#pragma omp simd
        for (int i = 0; i < n; ++i) store(h[i] * inv * to_float(weight[i]), o + i);
      } else {
#pragma omp simd
        for (int i = 0; i < n; ++i) store(h[i] * inv, o + i);
      }
    }
  }
}

template <typename T>
void silu_and_mul(const T* x, int64_t x_stride, T* out, int64_t o_stride, int64_t rows, int d) {
#pragma omp parallel for if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const T* a = x + r * x_stride;
    const T* b = a + d;
    T* o = out + r * o_stride;
#pragma omp simd
    for (int i = 0; i < d; ++i) {
      const float v = to_float(a[i]);
      store(v / (1.f + std::exp(-v)) * to_float(b[i]), o + i);
    }
  }
}

// Rotates the first rot_dim channels of every head. out may alias x. The products
// of two T values are exact in float32, so a fused multiply-add gives the same
// float32 result as separate steps, on every CPU.
template <typename T>
void rotary(const int64_t* positions, int64_t num_tokens, const T* x, int64_t x_stride, T* out,
            int64_t o_stride, int num_heads, int head_size, int rot_dim, bool neox,
            const T* cos_sin, int64_t cs_stride) {
  const int half = rot_dim / 2;
#pragma omp parallel for if (num_tokens >= 64)
  for (int64_t t = 0; t < num_tokens; ++t) {
    const T* cos = cos_sin + positions[t] * cs_stride;
    const T* sin = cos + half;
    for (int h = 0; h < num_heads; ++h) {
      const T* src = x + t * x_stride + int64_t(h) * head_size;
      T* dst = out + t * o_stride + int64_t(h) * head_size;
      // neox pairs (i, i + half); GPT-J pairs (2i, 2i + 1)
      const int step = neox ? 1 : 2, partner = neox ? half : 1;
#pragma omp simd
      for (int i = 0; i < half; ++i) {
        const float x1 = to_float(src[i * step]), x2 = to_float(src[i * step + partner]);
        const float c = to_float(cos[i]), s = to_float(sin[i]);
        store(x1 * c - x2 * s, dst + i * step);
        store(x2 * c + x1 * s, dst + i * step + partner);
      }
      if (dst != src)
        for (int i = rot_dim; i < head_size; ++i) dst[i] = src[i];
    }
  }
}

}  // namespace

extern "C" {

// Rows of `n` elements (row strides in elements, unit element stride).
// residual/new_residual/weight may be null (no residual add, no weight).
int accel_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual,
                   int64_t r_stride, const void* weight, void* out, int64_t o_stride,
                   void* new_residual, int64_t nr_stride, int64_t rows, int n, float eps) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    rms_norm(static_cast<const T*>(x), x_stride, static_cast<const T*>(residual), r_stride,
             static_cast<const T*>(weight), static_cast<T*>(out), o_stride,
             static_cast<T*>(new_residual), nr_stride, rows, n, eps);
  });
}

// out[r, :d] = silu(x[r, :d]) * x[r, d:2d].
int accel_silu_and_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t o_stride,
                       int64_t rows, int d) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul(static_cast<const T*>(x), x_stride, static_cast<T*>(out), o_stride, rows, d);
  });
}

// Rotary embedding of x [num_tokens, num_heads * head_size] (row strides in
// elements) into out; cos_sin rows [cos (rot_dim / 2), sin (rot_dim / 2)].
// Returns 0, -1 for an unknown dtype code, or -2 (nothing written) if a position
// is outside the cos/sin cache's num_positions rows.
int accel_rotary(int dtype, const int64_t* positions, int64_t num_tokens, const void* x,
                 int64_t x_stride, void* out, int64_t o_stride, int num_heads, int head_size,
                 int rot_dim, int neox, const void* cos_sin, int64_t cs_stride,
                 int64_t num_positions) {
  for (int64_t t = 0; t < num_tokens; ++t)
    if (positions[t] < 0 || positions[t] >= num_positions) return -2;
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    rotary(positions, num_tokens, static_cast<const T*>(x), x_stride, static_cast<T*>(out),
           o_stride, num_heads, head_size, rot_dim, neox != 0, static_cast<const T*>(cos_sin),
           cs_stride);
  });
}

}  // extern "C"
