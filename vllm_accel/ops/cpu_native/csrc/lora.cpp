// LoRA of one linear layer for a batch of tokens in one call (cpu_native/lora.py's
// lora_linear, contract: reference/lora.py): for each output slice i of the layer
// (q, k, v or gate, up: vLLM's stacked adapters, one pair per slice) and each token t
// whose request has an adapter in slot s >= 0,
//   y[t, off_i : off_i + n_i] += B_i[s] @ (scale * A_i[s] @ x[t])
// in float32, rounded to y's dtype once. Tokens of slot -1 (no adapter) are untouched.
// A_i[s] is [rank, in] (vLLM's layout) and B_i[s] transposed, [rank, >= n_i] (rows
// `b_row_stride` apart, so that the expand runs along the outputs in vector lanes), slots
// `slot stride` apart.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"

namespace {

using namespace accel;

template <typename T>
float dot(const T* a, const float* x, int n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int k = 0; k < n; ++k) acc += to_float(a[k]) * x[k];
  return acc;
}

template <typename T>
void lora_linear(const T* x, int64_t x_stride, T* y, int64_t y_stride, int64_t rows, int in,
                 const int64_t* slots_of, int num_slots, int num_slices,
                 const void* const* a_slices, const int64_t* a_slot_stride,
                 const void* const* b_slices, const int64_t* b_slot_stride,
                 const int64_t* b_row_stride, const int64_t* out_sizes, int rank,
                 float scale) {
  int64_t macs = 0;
  for (int i = 0; i < num_slices; ++i) macs += int64_t(rank) * (in + out_sizes[i]);
#pragma omp parallel if (rows * macs >= (int64_t(1) << 20))
  {
    int64_t widest = 0;
    for (int i = 0; i < num_slices; ++i) widest = std::max(widest, out_sizes[i]);
    std::vector<float> xf(in), h(rank), acc(widest);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t s = slots_of[t];
      if (s < 0 || s >= num_slots) continue;
      const T* xt = x + t * x_stride;
      for (int k = 0; k < in; ++k) xf[k] = to_float(xt[k]);
      T* yt = y + t * y_stride;
      for (int i = 0; i < num_slices; ++i) {
        const T* a = static_cast<const T*>(a_slices[i]) + s * a_slot_stride[i];
        const T* b = static_cast<const T*>(b_slices[i]) + s * b_slot_stride[i];
        for (int r = 0; r < rank; ++r) h[r] = scale * dot(a + int64_t(r) * in, xf.data(), in);
        const int64_t n = out_sizes[i];
        float* ac = acc.data();
#pragma omp simd
        for (int64_t o = 0; o < n; ++o) ac[o] = to_float(yt[o]);
        for (int r = 0; r < rank; ++r) {
          const T* br = b + r * b_row_stride[i];
          const float hr = h[r];
#pragma omp simd
          for (int64_t o = 0; o < n; ++o) ac[o] += hr * to_float(br[o]);
        }
#pragma omp simd
        for (int64_t o = 0; o < n; ++o) store(ac[o], yt + o);
        yt += out_sizes[i];
      }
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for an unknown dtype code.
int accel_lora_linear(int dtype, const void* x, int64_t x_stride, void* y, int64_t y_stride,
                      int64_t rows, int in, const int64_t* slots_of, int num_slots,
                      int num_slices, const void* const* a_slices, const int64_t* a_slot_stride,
                      const void* const* b_slices, const int64_t* b_slot_stride,
                      const int64_t* b_row_stride, const int64_t* out_sizes, int rank,
                      float scale) {
  return dispatch(dtype, [&](auto tag) {
    using T = decltype(tag);
    lora_linear(static_cast<const T*>(x), x_stride, static_cast<T*>(y), y_stride, rows, in,
                slots_of, num_slots, num_slices, a_slices, a_slot_stride, b_slices,
                b_slot_stride, b_row_stride, out_sizes, rank, scale);
  });
}

}  // extern "C"
