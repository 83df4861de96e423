// The CPU kernels of vllm_accel's torch.library ops, registered with torch's
// dispatcher, so that a call from a compiled graph reaches the C kernel without
// Python in between (a Python kernel behind the dispatcher costs ~10 us a call: at
// ~210 linears a decode step of the default model, ~2-3 ms).
//
// Built against torch's headers into its own library (build.py: torch_ops), which
// links the plain kernel library for the C entry points; the schemas are defined
// in Python (bf16_linear.py) before this library is loaded.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <string_view>

extern "C" {
int accel_bf16_linear_available();
int accel_bf16_linear(const void* x, int64_t x_stride, int32_t x_dtype, const void* w,
                      int64_t w_stride, const float* bias, void* y, int64_t y_stride, int64_t m,
                      int64_t n, int64_t k);
}

namespace {

// How often each op reached its C kernel (the ops fall back to torch silently;
// the tests read these through accel_torch_ops_kernel_calls).
std::atomic<int64_t> bf16_linear_calls{0};

// The C ABI's dtype codes (dtypes.h); -1 for a dtype the kernels lack.
int dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

// vllm_accel::bf16_linear: F.linear(x, weight, bias) for a bf16 weight [N, K], in
// x's dtype. Inputs the kernel does not take go to torch's linear, as in the
// Python kernel (bf16_linear.py).
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias) {
  static const bool built = accel_bf16_linear_available() != 0;
  const int code = dtype_code(x.scalar_type());
  const bool two_d = weight.dim() == 2;
  const int64_t n = two_d ? weight.size(0) : 0;
  const int64_t k = two_d ? weight.size(1) : 0;
  const bool weight_ok = two_d && weight.scalar_type() == at::kBFloat16 &&
                         weight.device().is_cpu() && weight.stride(1) == 1;
  const bool bias_ok = !bias.has_value() ||
                       (bias->dim() == 1 && bias->size(0) == n && bias->device().is_cpu());
  if (!built || code < 0 || !weight_ok || x.dim() == 0 || !x.device().is_cpu() ||
      x.size(-1) != k || k == 0 || !bias_ok) {
    return at::linear(x, weight.to(x.scalar_type()), bias);
  }
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m) {
    at::Tensor b;
    if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
    const int rc = accel_bf16_linear(x2.data_ptr(), x2.stride(0), code, weight.data_ptr(),
                                     weight.stride(0),
                                     b.defined() ? b.data_ptr<float>() : nullptr,
                                     y.data_ptr(), y.stride(0), m, n, k);
    TORCH_CHECK(rc == 0, "accel_bf16_linear failed (", rc, ") for x ", x.sizes(), " ",
                x.scalar_type(), ", weight ", weight.sizes());
    bf16_linear_calls.fetch_add(1, std::memory_order_relaxed);
  }
  return y.view(out_sizes);
}

}  // namespace

extern "C" int64_t accel_torch_ops_kernel_calls(const char* op) {
  return std::string_view(op) == "bf16_linear" ? bf16_linear_calls.load() : -1;
}

TORCH_LIBRARY_IMPL(vllm_accel, CPU, m) { m.impl("bf16_linear", &bf16_linear); }
