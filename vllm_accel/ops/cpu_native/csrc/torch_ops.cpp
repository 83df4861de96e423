// The CPU kernels of vllm_accel's torch.library ops, registered with torch's
// dispatcher, so that a call reaches the C kernel without Python in between (a
// Python kernel behind the dispatcher, its checks and a ctypes call cost 10-20 us
// a call on a 2-core Xeon: the default model's decode step makes 120 linear and 60
// attention calls).
//
// Built against torch's headers into its own library (build.py: torch_ops), which
// links the plain kernel library for the C entry points (entry_points.h).

#include <ATen/core/Tensor.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/add.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/clamp_max.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/linear.h>
#include <ATen/record_function.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <optional>
#include <cstring>
#include <vector>
#include <string_view>
#include <tuple>

#include "entry_points.h"

namespace {

// How often each op reached its C kernel and for how many rows in all (the ops fall
// back to torch silently; the tests read these through accel_torch_ops_kernel_calls).
struct KernelCalls {
  std::atomic<int64_t> calls{0}, rows{0};
  void add(int64_t m) {
    calls.fetch_add(1, std::memory_order_relaxed);
    rows.fetch_add(m, std::memory_order_relaxed);
  }
};
KernelCalls bf16_linear_calls, int4pack_linear_calls, int8_linear_calls, attention_step_calls,
    rms_norm_calls, silu_and_mul_calls, rotary_calls, decoder_layer_calls, moe_experts_calls,
    lora_linear_calls, bf16_bmm_calls;

// The block size (outputs) of torch's int4 layout where accel_int4pack_gemv reads it, 0
// where it does not: torch picks its layout by the CPU capability it runs with, so
// Python checks it once (wint_gemv.py) and says so here; until then the op runs torch's
// kernel.
std::atomic<int> int4pack_block_n{0};
// accel_int4pack_gemv's variant: the best this build has
constexpr int32_t kInt4Best = 0;
// largest bf16 batch the int4 GEMV takes without AMX (wint_gemv.NATIVE_MAX_ROWS)
constexpr int64_t kInt4MaxRows = 64;

// The C ABI's dtype codes (dtypes.h); -1 for a dtype the kernels lack.
int dtype_code(at::ScalarType type) {
  switch (type) {
    case at::kFloat: return 0;
    case at::kBFloat16: return 1;
    case at::kHalf: return 2;
    default: return -1;
  }
}

// vllm_accel::cpu_bf16_bmm: torch.bmm(x, weight.transpose(1, 2), out=out) for a bf16
// weight [B, N, K] whose rows of K are contiguous and x, out of one dtype with
// contiguous rows (any batch and row strides: vLLM writes into a transposed view):
// vLLM's MLA absorbed-weight products, every head in one call. Other inputs go to
// torch's bmm.
void cpu_bf16_bmm(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  static const bool built = accel_bf16_linear_available() != 0;
  const int code = dtype_code(x.scalar_type());
  const bool shapes = x.dim() == 3 && weight.dim() == 3 && out.dim() == 3 &&
                      x.size(0) == weight.size(0) && x.size(2) == weight.size(2) &&
                      out.size(0) == x.size(0) && out.size(1) == x.size(1) &&
                      out.size(2) == weight.size(1);
  TORCH_CHECK(shapes, "cpu_bf16_bmm: x ", x.sizes(), ", weight ", weight.sizes(), ", out ",
              out.sizes(), " are not [B, M, K], [B, N, K], [B, M, N]");
  const bool ours = built && code >= 0 && weight.scalar_type() == at::kBFloat16 &&
                    out.scalar_type() == x.scalar_type() && x.device().is_cpu() &&
                    weight.device().is_cpu() && out.device().is_cpu() && x.stride(2) == 1 &&
                    weight.stride(2) == 1 && out.stride(2) == 1 && x.size(2) > 0;
  if (!ours) {
    at::_ops::bmm_out::call(x, weight.transpose(1, 2).to(x.scalar_type()), out);
    return;
  }
  if (out.numel() == 0) return;
  const int rc = accel_bf16_bmm(x.data_ptr(), x.stride(0), x.stride(1), code, weight.data_ptr(),
                                weight.stride(0), weight.stride(1), out.data_ptr(), out.stride(0),
                                out.stride(1), x.size(0), x.size(1), weight.size(1), x.size(2));
  TORCH_CHECK(rc == 0, "accel_bf16_bmm failed (", rc, ") for x ", x.sizes(), " ",
              x.scalar_type(), ", weight ", weight.sizes());
  bf16_bmm_calls.add(x.size(0) * x.size(1));
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
  // (a 2-D x, what the compiled graph passes, needs no reshape and no view back)
  const bool flat = x.dim() == 2;
  at::Tensor x2 = flat ? x : x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  // a batch oneDNN runs faster on this CPU's bf16 units (bf16_linear.cpp says when)
  static const int64_t onednn_rows_bf16 = accel_bf16_linear_onednn_rows(dtype_code(at::kBFloat16));
  if (code == dtype_code(at::kBFloat16) && onednn_rows_bf16 > 0 && m >= onednn_rows_bf16)
    return at::linear(x, weight, bias);
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
    bf16_linear_calls.add(m);
  }
  if (flat) return y;
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  return y.view(out_sizes);
}

// vllm_accel::int4pack_linear: torch's _weight_int4pack_mm_for_cpu contract; bf16 batches
// of up to 64 rows (any number where the kernel has AMX tiles) and float32 batches of any
// size run the C++ kernel, everything else torch's kernel (as wint_gemv.int4pack_linear,
// the Python kernel, decides).
at::Tensor int4pack_linear(const at::Tensor& x, const at::Tensor& weight, int64_t group_size,
                           const at::Tensor& scales_zeros) {
  static const bool built = accel_int4pack_gemv_available() != 0;
  static const bool any_rows = accel_int4pack_amx_rows() > 0;
  const bool two_d = x.dim() == 2;
  const int64_t m = two_d ? x.size(0) : 0, k = two_d ? x.size(1) : 0;
  const int64_t n = scales_zeros.dim() == 3 ? scales_zeros.size(1) : -1;
  const bool fp32 = x.scalar_type() == at::kFloat;
  const int block_n = int4pack_block_n.load(std::memory_order_relaxed);
  const bool takes =
      built && block_n > 0 && two_d && m > 0 &&
      (m <= kInt4MaxRows || any_rows || fp32) &&
      (x.scalar_type() == at::kBFloat16 || fp32) && x.stride(1) == 1 && x.device().is_cpu() &&
      scales_zeros.scalar_type() == x.scalar_type() && scales_zeros.is_contiguous() &&
      scales_zeros.device().is_cpu() && n > 0 && n % block_n == 0 && group_size > 0 &&
      group_size % 2 == 0 && k % group_size == 0 && scales_zeros.size(0) == k / group_size &&
      scales_zeros.size(2) == 2 && weight.scalar_type() == at::kByte && weight.dim() == 2 &&
      weight.size(0) == n && weight.size(1) == k / 2 && weight.is_contiguous() &&
      weight.device().is_cpu();
  if (!takes) {
    return at::_weight_int4pack_mm_for_cpu(x.contiguous(), weight, group_size, scales_zeros);
  }
  at::Tensor y = at::empty({m, n}, x.options());
  const int rc =
      fp32 ? accel_int4pack_gemv_f32(x.data_ptr<float>(), x.stride(0), weight.data_ptr(),
                                     scales_zeros.data_ptr<float>(), y.data_ptr<float>(),
                                     y.stride(0), static_cast<int32_t>(m), n, k, group_size,
                                     block_n)
           : accel_int4pack_gemv(x.data_ptr(), x.stride(0), weight.data_ptr(),
                                 scales_zeros.data_ptr(), y.data_ptr(), y.stride(0),
                                 static_cast<int32_t>(m), n, k, group_size, block_n, kInt4Best);
  TORCH_CHECK(rc == 0, "accel_int4pack_gemv failed (", rc, ") for x ", x.sizes(), " ",
              x.scalar_type(), ", weight ", weight.sizes(), ", group ", group_size);
  int4pack_linear_calls.add(m);
  return y;
}

// vllm_accel::int8_linear_dynamic: W8A8 with symmetric dynamic per-token activations,
// quant/w8a8.py int8_linear's result bit for bit: the rows quantized in C++
// (int8_linear.cpp), the int8 GEMM with its epilogue on AMX tiles there, or torch's GEMM
// and the epilogue in C++. The Python kernel
// (int8_linear.py) sends only inputs it takes: x float32/bf16/fp16 [..., K] on the
// CPU, weight int8 [N, K], weight_scale float32 [N], bias [N].
at::Tensor int8_linear_dynamic(const at::Tensor& x, const at::Tensor& weight,
                               const at::Tensor& weight_scale,
                               const std::optional<at::Tensor>& bias) {
  const int code = dtype_code(x.scalar_type());
  TORCH_CHECK(code >= 0 && x.device().is_cpu() && weight.dim() == 2 &&
                  weight.scalar_type() == at::kChar && x.size(-1) == weight.size(1) &&
                  weight_scale.numel() == weight.size(0),
              "int8_linear_dynamic: unsupported inputs x ", x.sizes(), " ", x.scalar_type(),
              ", weight ", weight.sizes(), " ", weight.scalar_type());
  const int64_t n = weight.size(0), k = weight.size(1);
  at::Tensor x2 = x.reshape({-1, k});
  if (x2.stride(1) != 1) x2 = x2.contiguous();
  const int64_t m = x2.size(0);
  std::vector<int64_t> out_sizes = x.sizes().vec();
  out_sizes.back() = n;
  at::Tensor y = at::empty({m, n}, x.options());
  if (m) {
    at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
    at::Tensor row_scales = at::empty({m}, x.options().dtype(at::kFloat));
    accel_int8_quant_rows(code, x2.data_ptr(), x2.stride(0), m, k, q.data_ptr<int8_t>(),
                          row_scales.data_ptr<float>());
    const at::Tensor col_scales = weight_scale.to(at::kFloat).contiguous();
    at::Tensor b;
    if (bias.has_value()) b = bias->to(at::kFloat).contiguous();
    const float* bias_ptr = b.defined() ? b.data_ptr<float>() : nullptr;
    // AMX tiles with the epilogue inside where the CPU has them (the same bytes); else
    // the int32 sums of the library's AVX2 GEMM (torch's is inexact there) or torch's,
    // and the epilogue on them
    if (weight.stride(1) != 1 ||
        accel_int8_linear_amx(q.data_ptr<int8_t>(), k, weight.data_ptr<int8_t>(),
                              weight.stride(0), m, n, k, row_scales.data_ptr<float>(),
                              col_scales.data_ptr<float>(), bias_ptr, code, y.data_ptr(),
                              y.stride(0)) != 0) {
      at::Tensor acc;
      if (accel_int8_gemm_available() && weight.stride(1) == 1) {
        acc = at::empty({m, n}, x.options().dtype(at::kInt));
        accel_int8_gemm(q.data_ptr<int8_t>(), k, weight.data_ptr<int8_t>(), weight.stride(0), m,
                        n, k, acc.data_ptr<int32_t>(), n);
      } else {
        acc = at::_int_mm(q, weight.t());
      }
      accel_int8_dequant(acc.data_ptr<int32_t>(), acc.stride(0), m, n,
                         row_scales.data_ptr<float>(), col_scales.data_ptr<float>(), bias_ptr,
                         code, y.data_ptr(), y.stride(0));
    }
  }
  int8_linear_calls.add(m);
  return y.view(out_sizes);
}

// vllm_accel::int8_gemm: a[M, K] @ w[N, K].T in exact int32 (torch._int_mm's contract)
// on the library's own GEMM, for CPUs where torch's is not exact (int8_linear.cpp).
at::Tensor int8_gemm(const at::Tensor& a, const at::Tensor& w) {
  TORCH_CHECK(a.dim() == 2 && w.dim() == 2 && a.scalar_type() == at::kChar &&
                  w.scalar_type() == at::kChar && a.size(1) == w.size(1) && a.device().is_cpu() &&
                  w.device().is_cpu(),
              "int8_gemm: unsupported inputs a ", a.sizes(), " ", a.scalar_type(), ", w ",
              w.sizes(), " ", w.scalar_type());
  TORCH_CHECK(accel_int8_gemm_available(), "int8_gemm: this build has no int8 GEMM of its own");
  const at::Tensor a2 = a.stride(1) == 1 ? a : a.contiguous();
  const at::Tensor w2 = w.stride(1) == 1 ? w : w.contiguous();
  const int64_t m = a2.size(0), n = w2.size(0), k = a2.size(1);
  at::Tensor acc = at::empty({m, n}, a.options().dtype(at::kInt));
  if (m && n)
    accel_int8_gemm(a2.data_ptr<int8_t>(), a2.stride(0), w2.data_ptr<int8_t>(), w2.stride(0), m, n,
                    k, acc.data_ptr<int32_t>(), n);
  return acc;
}

// Bytes of float32 (k_scale, v_scale) after each token's codes in an INT8 page
// (ops/paged_layout.py: INT8_SCALE_BYTES).
constexpr int64_t kInt8ScaleBytes = 8;

// Whether the kernels can read the paged cache: [blocks, kv heads, block size, width]
// on the CPU with every (block, head) page's rows contiguous.
bool pages_ok(const at::Tensor& kv_cache) {
  return kv_cache.dim() == 4 && kv_cache.device().is_cpu() && kv_cache.stride(3) == 1 &&
         kv_cache.stride(2) == kv_cache.size(3);
}

// The head size of a cache pages_ok takes: a page row holds K then V (then, INT8,
// their scales).
int64_t head_size(const at::Tensor& kv_cache) {
  const int64_t width = kv_cache.size(3);
  return kv_cache.scalar_type() == at::kChar ? (width - kInt8ScaleBytes) / 2 : width / 2;
}

bool cpu_of(const at::Tensor& t, at::ScalarType type) {
  return t.device().is_cpu() && t.scalar_type() == type;
}

bool int32_cpu(const at::Tensor& t) { return cpu_of(t, at::kInt); }

// The C entry points' errors (csrc/paged_attention.cpp): they check every block id
// and slot before touching the cache, since a bad one would read or write outside it.
void check_rc(int rc, const char* entry) {
  TORCH_CHECK_VALUE(rc != -2, entry, ": a seq_len needs more blocks than the block table has "
                    "columns");
  TORCH_CHECK_VALUE(rc != -3, entry, ": the block table holds ids outside the cache in the "
                    "blocks a request reads");
  TORCH_CHECK_VALUE(rc != -4, entry, ": a slot is outside the cache");
  TORCH_CHECK(rc == 0, entry, " failed (", rc, ")");
}

// Whether the reader takes these inputs: query [T, H, D] (head dim contiguous) in a
// dtype the kernels have, a cache it can read in that dtype (or INT8), block sizes of
// 16k (its AVX-512 paths read 16 rows of a page at a time) and int32 CPU tables.
bool read_ok(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_table,
             const at::Tensor& query_start_loc, const at::Tensor& seq_lens) {
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  return pages_ok(kv_cache) && dtype_code(query.scalar_type()) >= 0 &&
         query.dim() == 3 && query.device().is_cpu() &&
         (int8 || kv_cache.scalar_type() == query.scalar_type()) && query.stride(2) == 1 &&
         kv_cache.size(2) % 16 == 0 && query.size(2) == head_size(kv_cache) &&
         query.size(1) % kv_cache.size(1) == 0 && block_table.dim() == 2 &&
         int32_cpu(block_table) && int32_cpu(seq_lens) && int32_cpu(query_start_loc) &&
         seq_lens.dim() == 1 && block_table.size(0) >= seq_lens.size(0) &&
         query_start_loc.dim() == 1 && query_start_loc.size(0) == seq_lens.size(0) + 1;
}

// Whether the writer takes these inputs: K/V [>= T, Hkv, D] for the T slots of
// slot_mapping, in a dtype the kernels have, into a cache of that dtype (or INT8).
bool write_ok(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
              const at::Tensor& slot_mapping) {
  const bool int8 = kv_cache.scalar_type() == at::kChar;
  const int64_t n = slot_mapping.dim() == 1 ? slot_mapping.size(0) : -1;
  return pages_ok(kv_cache) && dtype_code(key.scalar_type()) >= 0 && n >= 0 &&
         key.dim() == 3 && value.dim() == 3 && key.size(0) >= n && value.size(0) >= n &&
         key.device().is_cpu() && value.device().is_cpu() && slot_mapping.device().is_cpu() &&
         (int8 || kv_cache.scalar_type() == key.scalar_type()) &&
         value.scalar_type() == key.scalar_type() && key.stride(2) == 1 &&
         value.stride(2) == 1 && key.size(1) == kv_cache.size(1) &&
         key.size(2) == head_size(kv_cache) && value.size(1) == key.size(1) &&
         value.size(2) == key.size(2);
}

// A model's attention features (reference/attention.py): the window, the soft-cap and
// per-query-head ALiBi slopes and sink logits, each float32 [num_heads] on the CPU.
struct AttentionFeatures {
  int64_t sliding_window = 0;
  double soft_cap = 0.;
  std::optional<at::Tensor> alibi_slopes, sinks;

  // whether the kernels take them for `num_heads` query heads
  bool ok(int64_t num_heads) const {
    const auto per_head = [&](const std::optional<at::Tensor>& t) {
      return !t.has_value() || (cpu_of(*t, at::kFloat) && t->dim() == 1 &&
                                t->size(0) == num_heads && t->is_contiguous());
    };
    return sliding_window >= 0 && soft_cap >= 0. && per_head(alibi_slopes) && per_head(sinks);
  }
  static const float* data(const std::optional<at::Tensor>& t) {
    return t.has_value() ? t->data_ptr<float>() : nullptr;
  }
};

// Attention for the query rows of each request (query_start_loc) into `out` (same
// shape as query, head dim contiguous): rows [0, query_start_loc[-1]), the rest untouched.
void attend(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& table,
            const at::Tensor& starts, const at::Tensor& lens, const at::Tensor& out,
            double scale, const AttentionFeatures& features) {
  const int rc = accel_paged_attention(
      dtype_code(query.scalar_type()), query.data_ptr(), query.stride(0), query.stride(1),
      out.data_ptr(), out.stride(0), out.stride(1), kv_cache.data_ptr(),
      kv_cache.scalar_type() == at::kChar, kv_cache.stride(0), kv_cache.stride(1),
      static_cast<int>(kv_cache.size(2)), static_cast<int>(head_size(kv_cache)),
      kv_cache.size(0), table.data_ptr<int32_t>(), table.stride(0), table.size(1),
      starts.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), static_cast<int>(lens.size(0)),
      static_cast<int>(query.size(1)), static_cast<int>(kv_cache.size(1)),
      static_cast<float>(scale), static_cast<int>(features.sliding_window),
      static_cast<float>(features.soft_cap), AttentionFeatures::data(features.alibi_slopes),
      AttentionFeatures::data(features.sinks));
  check_rc(rc, "accel_paged_attention");
}

// Scatter the first len(slot_mapping) rows of K/V into their slots (quantizing, for
// an INT8 cache: k_scale/v_scale 0 for dynamic per-token scales).
void write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
           const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int rc = accel_cache_write(
      dtype_code(key.scalar_type()), key.data_ptr(), value.data_ptr(), key.stride(0),
      key.stride(1), value.stride(0), value.stride(1), kv_cache.data_ptr(),
      kv_cache.scalar_type() == at::kChar, kv_cache.stride(0), kv_cache.stride(1),
      slots.data_ptr<int64_t>(), slot_mapping.size(0), static_cast<int>(kv_cache.size(1)),
      static_cast<int>(kv_cache.size(2)), static_cast<int>(head_size(kv_cache)),
      kv_cache.size(0), static_cast<float>(k_scale), static_cast<float>(v_scale));
  check_rc(rc, "accel_cache_write");
}

at::Tensor contiguous_rows(const at::Tensor& t) {
  return t.stride(-1) == 1 ? t : t.contiguous();
}

// vllm_accel::cpu_paged_attention: causal attention over the paged cache for the
// query rows of each request (query_start_loc), as attention.py's ctypes path. Returns
// the output [T, H, D], or an empty 1-D tensor when the kernel does not take these
// inputs (the caller then falls back to the next provider).
at::Tensor cpu_paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                               const at::Tensor& block_table,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               double scale, bool zero_tail, int64_t sliding_window,
                               double soft_cap, const std::optional<at::Tensor>& alibi_slopes,
                               const std::optional<at::Tensor>& sinks) {
  const AttentionFeatures features{sliding_window, soft_cap, alibi_slopes, sinks};
  if (!read_ok(query, kv_cache, block_table, query_start_loc, seq_lens) ||
      !features.ok(query.size(1))) {
    return at::empty({0}, query.options());
  }
  const at::Tensor starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int64_t rows = starts.data_ptr<int32_t>()[starts.size(0) - 1];
  if (rows > query.size(0)) return at::empty({0}, query.options());
  at::Tensor out = at::empty_like(query);
  attend(query, kv_cache, contiguous_rows(block_table), starts, lens, out, scale, features);
  if (zero_tail && rows < out.size(0)) out.narrow(0, rows, out.size(0) - rows).zero_();
  return out;
}

// vllm_accel::cpu_mla_decode: reference/mla.py's mla_decode through csrc/mla_decode.cpp:
// absorbed queries q_nope [B, N, L] and q_pe [B, N, R] (head dim contiguous, any other
// strides) over each request's latent rows of vLLM's cache [num_blocks, block_size, L + R]
// (rows contiguous), in the queries' dtype. Returns [B, N, L], or an empty 1-D tensor
// where the kernel does not take these inputs (the caller runs the next provider).
at::Tensor cpu_mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe,
                          const at::Tensor& kv_cache, const at::Tensor& block_table,
                          const at::Tensor& seq_lens, double scale) {
  const auto type = q_nope.scalar_type();
  const bool ok = dtype_code(type) >= 0 && q_nope.dim() == 3 && q_pe.dim() == 3 &&
                  kv_cache.dim() == 3 && q_nope.device().is_cpu() && q_pe.device().is_cpu() &&
                  kv_cache.device().is_cpu() && q_pe.scalar_type() == type &&
                  kv_cache.scalar_type() == type && q_nope.stride(2) == 1 &&
                  q_pe.stride(2) == 1 && kv_cache.stride(2) == 1 &&
                  q_pe.size(0) == q_nope.size(0) && q_pe.size(1) == q_nope.size(1) &&
                  kv_cache.size(2) == q_nope.size(2) + q_pe.size(2) &&
                  block_table.dim() == 2 && int32_cpu(block_table) && int32_cpu(seq_lens) &&
                  seq_lens.dim() == 1 && seq_lens.size(0) == q_nope.size(0) &&
                  block_table.size(0) >= seq_lens.size(0);
  if (!ok) return at::empty({0}, q_nope.options());
  const at::Tensor table = contiguous_rows(block_table), lens = seq_lens.contiguous();
  at::Tensor out = at::empty({q_nope.size(0), q_nope.size(1), q_nope.size(2)}, q_nope.options());
  const int rc = accel_mla_decode(
      dtype_code(type), q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_pe.data_ptr(),
      q_pe.stride(0), q_pe.stride(1), out.data_ptr(), out.stride(0), out.stride(1),
      kv_cache.data_ptr(), kv_cache.size(0), kv_cache.stride(0), kv_cache.stride(1),
      static_cast<int>(kv_cache.size(1)), static_cast<int>(q_nope.size(2)),
      static_cast<int>(q_pe.size(2)), table.data_ptr<int32_t>(), table.stride(0), table.size(1),
      lens.data_ptr<int32_t>(), static_cast<int>(lens.size(0)), static_cast<int>(q_nope.size(1)),
      static_cast<float>(scale));
  check_rc(rc, "accel_mla_decode");
  return out;
}

// vllm_accel::cpu_lora_linear: every adapter slice of one LoRA linear layer for the batch
// (csrc/lora.cpp): y[:, slice i] += B_i[slot] @ (scale * A_i[slot] @ x) per token of a
// slot >= 0. lora_a[i] is vLLM's [slots, 1, rank, in] (or [slots, rank, in]), lora_b_t[i]
// B transposed, [slots, rank, >= n_i], contiguous, all in x's dtype; y [T, >= sum n_i] and x
// [T, in] with contiguous rows. False, with nothing done, for inputs the kernel does not
// take (the caller runs the slice-by-slice kernels).
bool cpu_lora_linear(const at::Tensor& y, const at::Tensor& x, at::TensorList lora_a,
                     at::TensorList lora_b_t, const at::Tensor& slots_of, double scale,
                     at::IntArrayRef out_sizes) {
  const auto type = x.scalar_type();
  const int code = dtype_code(type);
  const int64_t n = static_cast<int64_t>(lora_a.size());
  bool ok = code >= 0 && n > 0 && static_cast<int64_t>(lora_b_t.size()) == n &&
            static_cast<int64_t>(out_sizes.size()) == n && x.dim() == 2 && y.dim() == 2 &&
            x.device().is_cpu() && y.device().is_cpu() && y.scalar_type() == type &&
            x.stride(1) == 1 && y.stride(1) == 1 && y.size(0) == x.size(0) &&
            slots_of.scalar_type() == at::kLong && slots_of.device().is_cpu() &&
            slots_of.dim() == 1 && slots_of.is_contiguous() && slots_of.size(0) >= x.size(0);
  const int64_t rank = ok ? lora_a[0].size(-2) : 0;
  const int64_t num_slots = ok ? lora_a[0].size(0) : 0;
  int64_t width = 0;
  for (int64_t i = 0; ok && i < n; ++i) {
    const at::Tensor& a = lora_a[i];
    const at::Tensor& b = lora_b_t[i];
    ok = (a.dim() == 3 || (a.dim() == 4 && a.size(1) == 1)) && b.dim() == 3 &&
         a.is_contiguous() && b.is_contiguous() && a.scalar_type() == type &&
         b.scalar_type() == type && a.device().is_cpu() && b.device().is_cpu() &&
         a.size(0) == num_slots && b.size(0) == num_slots && a.size(-2) == rank &&
         a.size(-1) == x.size(1) && b.size(1) == rank && b.size(2) >= out_sizes[i] &&
         out_sizes[i] >= 0;
    width += out_sizes[i];
  }
  if (!ok || width > y.size(1) || rank == 0) return false;
  std::vector<const void*> a_ptrs(n), b_ptrs(n);
  std::vector<int64_t> a_strides(n), b_strides(n), b_rows(n),
      sizes(out_sizes.begin(), out_sizes.end());
  for (int64_t i = 0; i < n; ++i) {
    a_ptrs[i] = lora_a[i].data_ptr();
    b_ptrs[i] = lora_b_t[i].data_ptr();
    a_strides[i] = lora_a[i].stride(0);
    b_strides[i] = lora_b_t[i].stride(0);
    b_rows[i] = lora_b_t[i].stride(1);
  }
  const int rc = accel_lora_linear(
      code, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), x.size(0),
      static_cast<int>(x.size(1)), slots_of.data_ptr<int64_t>(), static_cast<int>(num_slots),
      static_cast<int>(n), a_ptrs.data(), a_strides.data(), b_ptrs.data(), b_strides.data(),
      b_rows.data(), sizes.data(), static_cast<int>(rank), static_cast<float>(scale));
  check_rc(rc, "accel_lora_linear");
  lora_linear_calls.add(x.size(0));
  return true;
}

// vllm_accel::cpu_cache_write: scatter (quantizing, for an INT8 cache) new K/V
// [T, Hkv, D] into the slots of slot_mapping; false when the kernel does not take
// these inputs (the caller then falls back to the next provider).
bool cpu_cache_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& kv_cache,
                     const at::Tensor& slot_mapping, double k_scale, double v_scale) {
  if (!write_ok(key, value, kv_cache, slot_mapping)) return false;
  write(key, value, kv_cache, slot_mapping, k_scale, v_scale);
  return true;
}

// The keys the q newest rows of a request of `len` tokens see in all (window: at most
// that many each; 0: none), as attention.py's _prefill_pairs.
int64_t prefill_row_keys(int64_t q, int64_t len, int64_t window) {
  int64_t keys = 0;
  if (window <= 0) return q * (len - q) + q * (q + 1) / 2;
  for (int64_t row = len - q + 1; row <= len; ++row) keys += std::min(row, window);
  return keys;
}

// vllm_accel::cpu_attention_step: an attention layer's whole forward in one call: the
// new K/V into their slots, then attention for every query row of the batch
// (decodes and prefills alike) written into `output`'s rows. The same kernels as
// cpu_cache_write then cpu_paged_attention, without Python between them, the
// batch's decode/prefill slices and the copy of the result (~25 us a layer on a
// 2-core Xeon, a tenth of a small model's decode step). False, with nothing done,
// when either kernel does not take these inputs or the prefill rows' causal work
// (query rows x keys they see) is above max_prefill_pairs, where the torch
// matmuls win: the caller then runs the kernels one by one.
bool cpu_attention_step(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                        const at::Tensor& block_table, const at::Tensor& query_start_loc,
                        const at::Tensor& seq_lens, const at::Tensor& output, double scale,
                        double k_scale, double v_scale, int64_t max_prefill_pairs,
                        int64_t sliding_window, double soft_cap,
                        const std::optional<at::Tensor>& alibi_slopes,
                        const std::optional<at::Tensor>& sinks) {
  const AttentionFeatures features{sliding_window, soft_cap, alibi_slopes, sinks};
  if (!write_ok(key, value, kv_cache, slot_mapping) ||
      !read_ok(query, kv_cache, block_table, query_start_loc, seq_lens) ||
      !features.ok(query.size(1)) ||
      output.sizes() != query.sizes() || output.scalar_type() != query.scalar_type() ||
      !output.device().is_cpu() || output.stride(2) != 1) {
    return false;
  }
  const at::Tensor starts = query_start_loc.contiguous(), lens = seq_lens.contiguous();
  const int32_t* start = starts.data_ptr<int32_t>();
  const int32_t* len = lens.data_ptr<int32_t>();
  const int64_t reqs = lens.size(0);
  if (start[reqs] > query.size(0)) return false;
  // the prefill rows' causal work, as attention.py's _prefill_pairs (decodes always
  // run here, as they do one by one)
  int64_t prefill_pairs = 0;
  for (int64_t i = 0; i < reqs; ++i) {
    const int64_t q = start[i + 1] - start[i];
    if (q > 1) prefill_pairs += prefill_row_keys(q, len[i], sliding_window);
  }
  if (prefill_pairs > max_prefill_pairs) return false;
  write(key, value, kv_cache, slot_mapping, k_scale, v_scale);
  attend(query, kv_cache, contiguous_rows(block_table), starts, lens, output, scale, features);
  attention_step_calls.add(start[reqs]);
  return true;
}

// The elementwise ops (elementwise.py's cpu_native kernels, eager mode only): the
// Python kernels' checks and ctypes calls cost 10-20 us a call, and a decode step
// makes ~150 of them. An undefined result (None in Python) means declined, nothing
// done: Python then runs the next provider, as for every input the C ABI does not take.

// t viewed as `sizes`, or undefined where its strides do not allow that view.
at::Tensor view_or_undefined(const at::Tensor& t, at::IntArrayRef sizes) {
  try {
    return t.view(sizes);
  } catch (const c10::Error&) {
    return {};
  }
}

// t as a [rows, last] view with unit element stride, or undefined.
at::Tensor as_rows(const at::Tensor& t) {
  if (t.dim() == 0 || t.stride(-1) != 1) return {};
  return view_or_undefined(t, {-1, t.size(-1)});
}

// vllm_accel::cpu_rms_norm: (out, new_residual or undefined) of RMSNorm over the last
// dimension, with the residual added first where given.
std::tuple<at::Tensor, at::Tensor> cpu_rms_norm(const at::Tensor& x,
                                                const std::optional<at::Tensor>& weight,
                                                double eps,
                                                const std::optional<at::Tensor>& residual) {
  const at::ScalarType type = x.scalar_type();
  const int code = dtype_code(type);
  const at::Tensor x2 = code < 0 || !x.device().is_cpu() ? at::Tensor() : as_rows(x);
  if (!x2.defined() || x2.size(0) == 0) return {};
  if (weight.has_value() && (!cpu_of(*weight, type) || weight->dim() != 1 ||
                             weight->size(0) != x2.size(1) || weight->stride(0) != 1))
    return {};
  at::Tensor r2;
  if (residual.has_value()) {
    if (!cpu_of(*residual, type) || residual->sizes() != x.sizes()) return {};
    r2 = as_rows(*residual);
    if (!r2.defined()) return {};
  }
  const int64_t rows = x2.size(0), n = x2.size(1);
  at::Tensor out = at::empty(x.sizes(), x.options());
  at::Tensor new_residual = r2.defined() ? at::empty(x.sizes(), x.options()) : at::Tensor();
  const int rc = accel_rms_norm(
      code, x2.data_ptr(), x2.stride(0), r2.defined() ? r2.data_ptr() : nullptr,
      r2.defined() ? r2.stride(0) : 0, weight.has_value() ? weight->data_ptr() : nullptr,
      out.data_ptr(), n, new_residual.defined() ? new_residual.data_ptr() : nullptr, n, rows,
      int(n), float(eps));
  TORCH_CHECK(rc == 0, "accel_rms_norm failed (", rc, ")");
  rms_norm_calls.add(rows);
  return {out, new_residual};
}

// vllm_accel::cpu_silu_and_mul: silu(x[..., :d]) * x[..., d:].
at::Tensor cpu_silu_and_mul(const at::Tensor& x) {
  const int code = dtype_code(x.scalar_type());
  const at::Tensor x2 = code < 0 || !x.device().is_cpu() ? at::Tensor() : as_rows(x);
  if (!x2.defined() || x2.size(0) == 0 || x2.size(1) % 2) return {};
  const int64_t d = x2.size(1) / 2;
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = d;
  at::Tensor out = at::empty(sizes, x.options());
  const int rc = accel_silu_and_mul(code, x2.data_ptr(), x2.stride(0), out.data_ptr(), d,
                                    x2.size(0), int(d));
  TORCH_CHECK(rc == 0, "accel_silu_and_mul failed (", rc, ")");
  silu_and_mul_calls.add(x2.size(0));
  return out;
}

// t as [num_tokens, heads * head_size] rows, or undefined.
at::Tensor rotary_rows(const at::Tensor& t, at::ScalarType type, int64_t num_tokens,
                       int64_t head_size) {
  if (!cpu_of(t, type) || t.dim() < 2 || t.size(0) != num_tokens || t.stride(-1) != 1) return {};
  const at::Tensor rows = view_or_undefined(t, {num_tokens, -1});
  return rows.defined() && rows.size(1) % head_size == 0 && rows.stride(1) == 1 ? rows
                                                                                 : at::Tensor();
}

// One tensor's rotary embedding into a new tensor of its shape; undefined (nothing
// written) if a position is outside the cos/sin cache.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& rows, int code,
                  const at::Tensor& positions, const at::Tensor& cos_sin_cache,
                  int64_t head_size, int64_t rotary_dim, bool is_neox) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t width = rows.size(1);
  const int rc = accel_rotary(code, positions.data_ptr<int64_t>(), rows.size(0), rows.data_ptr(),
                              rows.stride(0), out.data_ptr(), width, int(width / head_size),
                              int(head_size), int(rotary_dim), int(is_neox),
                              cos_sin_cache.data_ptr(), cos_sin_cache.stride(0),
                              cos_sin_cache.size(0));
  if (rc == -2) return {};
  TORCH_CHECK(rc == 0, "accel_rotary failed (", rc, ")");
  return out;
}

// vllm_accel::cpu_rotary_embedding: (query, key or undefined) rotated, as new tensors.
std::tuple<at::Tensor, at::Tensor> cpu_rotary_embedding(
    const at::Tensor& positions, const at::Tensor& query, const std::optional<at::Tensor>& key,
    const at::Tensor& cos_sin_cache, int64_t head_size, int64_t rotary_dim, bool is_neox) {
  const at::ScalarType type = query.scalar_type();
  const int code = dtype_code(type);
  const at::Tensor flat = positions.flatten();
  const int64_t num_tokens = flat.size(0);
  if (code < 0 || head_size <= 0 || rotary_dim > head_size || rotary_dim % 2 ||
      flat.scalar_type() != at::kLong || !flat.device().is_cpu() || num_tokens == 0 ||
      !cpu_of(cos_sin_cache, type) || cos_sin_cache.dim() != 2 ||
      cos_sin_cache.size(1) != rotary_dim || cos_sin_cache.stride(1) != 1)
    return {};
  const at::Tensor q_rows = rotary_rows(query, type, num_tokens, head_size);
  const at::Tensor k_rows =
      key.has_value() ? rotary_rows(*key, type, num_tokens, head_size) : at::Tensor();
  if (!q_rows.defined() || (key.has_value() && !k_rows.defined())) return {};
  const at::Tensor pos = flat.contiguous();
  at::Tensor q_out = rotate(query, q_rows, code, pos, cos_sin_cache, head_size, rotary_dim, is_neox);
  if (!q_out.defined()) return {};  // a position outside the cache: the next provider raises
  at::Tensor k_out = key.has_value() ? rotate(*key, k_rows, code, pos, cos_sin_cache, head_size,
                                              rotary_dim, is_neox)
                                     : at::Tensor();
  if (key.has_value() && !k_out.defined()) return {};  // declined for the key: for both
  rotary_calls.add(num_tokens);
  return {q_out, k_out};
}


// A decoder layer's linear: a bf16 weight [N, K] (bf16_linear), or with `quant` a
// quantized one: a uint8 weight [N, K/2] in torch's CPU int4 layout with its
// scales-and-zeros [K/group, N, 2] (int4pack_linear, then the bias as the quantized
// methods add it), or an int8 weight [N, K] with its float32 per-channel scales [N],
// W8A8 with dynamic per-token activations (int8_linear_dynamic).
int64_t layer_linear_in(const at::Tensor& weight, const std::optional<at::Tensor>& quant) {
  if (weight.dim() != 2) return -1;
  if (!quant.has_value()) return weight.size(1);
  const at::Tensor& q = *quant;
  if (weight.scalar_type() == at::kChar)
    return q.dim() == 1 && q.size(0) == weight.size(0) && q.scalar_type() == at::kFloat &&
                   weight.stride(1) == 1
               ? weight.size(1)
               : -1;
  const int64_t k = 2 * weight.size(1);
  return q.dim() == 3 && q.size(0) > 0 && k % q.size(0) == 0 && q.size(1) == weight.size(0) &&
                 q.size(2) == 2 && weight.scalar_type() == at::kByte
             ? k
             : -1;
}

at::Tensor layer_linear(const at::Tensor& x, const at::Tensor& weight,
                        const std::optional<at::Tensor>& quant,
                        const std::optional<at::Tensor>& bias) {
  if (!quant.has_value()) return bf16_linear(x, weight, bias);
  if (weight.scalar_type() == at::kChar) return int8_linear_dynamic(x, weight, *quant, bias);
  const at::Tensor y = int4pack_linear(x, weight, x.size(1) / quant->size(0), *quant);
  return bias.has_value() ? at::add(y, *bias) : y;
}

// act(h[:, :I]) * h[:, I:] for the gated activations of moe.py and the decoder
// layer (0 silu, 1 gelu, 2 gelu_tanh); 3 is gpt-oss's swigluoai (MoE experts only),
// gate and up interleaved: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7).
at::Tensor gated_activation(const at::Tensor& h, int64_t activation) {
  if (activation == 3) {
    const at::Tensor gate = at::clamp_max(h.slice(1, 0, std::nullopt, 2), at::Scalar(7.0));
    const at::Tensor up =
        at::clamp(h.slice(1, 1, std::nullopt, 2), at::Scalar(-7.0), at::Scalar(7.0));
    return at::mul(at::add(up, 1.0), at::mul(gate, at::sigmoid(at::mul(gate, 1.702))));
  }
  if (activation == 0) {
    at::Tensor out = cpu_silu_and_mul(h);
    if (out.defined()) return out;
  }
  const int64_t d = h.size(1) / 2;
  const at::Tensor gate = h.narrow(1, 0, d), up = h.narrow(1, d, d);
  if (activation == 0) return at::mul(at::mul(gate, at::sigmoid(gate)), up);
  return at::mul(at::gelu(gate, activation == 2 ? "tanh" : "none"), up);
}

// The current phase of a decoder layer op as a torch.profiler range (a child of the
// op's own event), so benchmarks/step_profile.py can split the op by kernel; with no
// profiler running, each phase costs a flag check.
class LayerPhases {
 public:
  void next(const char* name) {
    current_.reset();
    current_.emplace(at::RecordScope::USER_SCOPE);
    current_->before(std::string_view(name), c10::ArrayRef<const c10::IValue>{});
  }

 private:
  std::optional<at::RecordFunction> current_;
};

// vllm_accel::cpu_decoder_layer: a pre-norm decoder layer (Llama's: RMSNorm, QKV, rotary,
// cache write + attention, O, add + RMSNorm, gate/up, SiLU * up, down) in one call, with
// the kernels of the ops above and no Python between them: a decode step of the default
// model makes ~300 op calls through vLLM's layers otherwise (~4.3 ms of a 26.4 ms eager
// step on a 2-core Xeon). Returns (hidden, residual) as new tensors; undefined ones,
// with nothing written, where a kernel declines these inputs (the caller then runs the
// layer op by op). The first layer passes no residual: its input is the residual.
// A linear whose `*_quant` is given has a quantized weight (layer_linear). The attention
// takes a sliding window and a logits soft-cap (Mistral's, Gemma's: 0 for none); with
// q_norm and k_norm, each head's q and k get an RMSNorm before the rotary (Qwen3's,
// Gemma 3's). Gemma's "sandwich" norms: attn_out_norm normalizes the attention's
// output before it joins the residual, mlp_out_norm the MLP's output; `activation`
// is gated_activation's code (Gemma: 2, GELU tanh).
std::tuple<at::Tensor, at::Tensor> cpu_decoder_layer(
    const at::Tensor& hidden, const std::optional<at::Tensor>& residual,
    const at::Tensor& positions, const at::Tensor& input_norm, const at::Tensor& qkv_weight,
    const std::optional<at::Tensor>& qkv_bias, const at::Tensor& o_weight,
    const std::optional<at::Tensor>& o_bias, const at::Tensor& post_norm,
    const at::Tensor& gate_up_weight, const at::Tensor& down_weight, double eps,
    const at::Tensor& cos_sin_cache, int64_t rotary_dim, bool is_neox, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_size, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, const at::Tensor& block_table,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale, double k_scale,
    double v_scale, int64_t max_prefill_pairs, const std::optional<at::Tensor>& qkv_quant,
    const std::optional<at::Tensor>& o_quant, const std::optional<at::Tensor>& gate_up_quant,
    const std::optional<at::Tensor>& down_quant, int64_t sliding_window, double soft_cap,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
    const std::optional<at::Tensor>& attn_out_norm,
    const std::optional<at::Tensor>& mlp_out_norm, int64_t activation) {
  // Everything after the attention step must run once it has written the cache, so
  // what the later kernels check is checked here first.
  const int64_t q_size = num_heads * head_size, kv_size = num_kv_heads * head_size;
  const bool shapes_ok =
      hidden.dim() == 2 && hidden.size(0) > 0 && head_size > 0 && num_heads > 0 &&
      num_kv_heads > 0 && layer_linear_in(qkv_weight, qkv_quant) == hidden.size(1) &&
      qkv_weight.size(0) == q_size + 2 * kv_size &&
      layer_linear_in(o_weight, o_quant) == q_size && o_weight.size(0) == hidden.size(1) &&
      layer_linear_in(gate_up_weight, gate_up_quant) == hidden.size(1) &&
      gate_up_weight.size(0) % 2 == 0 && down_weight.size(0) == hidden.size(1) &&
      layer_linear_in(down_weight, down_quant) == gate_up_weight.size(0) / 2 &&
      post_norm.dim() == 1 &&
      post_norm.size(0) == hidden.size(1) && post_norm.stride(0) == 1 &&
      cpu_of(post_norm, hidden.scalar_type());
  const auto head_norm_ok = [&](const std::optional<at::Tensor>& w) {
    return !w.has_value() || (w->dim() == 1 && w->size(0) == head_size &&
                              w->stride(0) == 1 && cpu_of(*w, hidden.scalar_type()));
  };
  const auto hidden_norm_ok = [&](const std::optional<at::Tensor>& w) {
    return !w.has_value() || (w->dim() == 1 && w->size(0) == hidden.size(1) &&
                              w->stride(0) == 1 && cpu_of(*w, hidden.scalar_type()));
  };
  if (!shapes_ok || !head_norm_ok(q_norm) || !head_norm_ok(k_norm) ||
      q_norm.has_value() != k_norm.has_value() || !hidden_norm_ok(attn_out_norm) ||
      !hidden_norm_ok(mlp_out_norm) || activation < 0 || activation > 2)
    return {};
  const int64_t tokens = hidden.size(0);
  LayerPhases phase;
  phase.next("accel_layer::norm");
  auto [h, new_residual] = cpu_rms_norm(hidden, input_norm, eps, residual);
  if (!h.defined()) return {};
  const at::Tensor res = residual.has_value() ? new_residual : hidden;
  phase.next("accel_layer::qkv_proj");
  const at::Tensor qkv = layer_linear(h, qkv_weight, qkv_quant, qkv_bias);
  at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
  if (q_norm.has_value()) {  // Qwen3's RMSNorm of each head's q and k before the rotary
    phase.next("accel_layer::qk_norm");
    auto [qn, unused_q] = cpu_rms_norm(q.reshape({tokens * num_heads, head_size}), q_norm, eps,
                                       std::nullopt);
    auto [kn, unused_k] = cpu_rms_norm(k.reshape({tokens * num_kv_heads, head_size}), k_norm,
                                       eps, std::nullopt);
    if (!qn.defined() || !kn.defined()) return {};
    q = qn.view({tokens, q_size});
    k = kn.view({tokens, kv_size});
  }
  phase.next("accel_layer::rotary");
  auto [q_rot, k_rot] =
      cpu_rotary_embedding(positions, q, k, cos_sin_cache, head_size, rotary_dim, is_neox);
  if (!q_rot.defined()) return {};
  phase.next("accel_layer::attention");
  at::Tensor attn = at::empty({tokens, num_heads, head_size}, hidden.options());
  if (!cpu_attention_step(q_rot.view({tokens, num_heads, head_size}),
                          k_rot.view({tokens, num_kv_heads, head_size}),
                          v.view({tokens, num_kv_heads, head_size}), kv_cache, slot_mapping,
                          block_table, query_start_loc, seq_lens, attn, scale, k_scale, v_scale,
                          max_prefill_pairs, sliding_window, soft_cap, std::nullopt,
                          std::nullopt)) {
    return {};
  }
  phase.next("accel_layer::o_proj");
  at::Tensor o = layer_linear(attn.view({tokens, q_size}), o_weight, o_quant, o_bias);
  phase.next("accel_layer::norm");
  if (attn_out_norm.has_value()) {
    o = std::get<0>(cpu_rms_norm(o, attn_out_norm, eps, std::nullopt));
    TORCH_CHECK(o.defined(), "cpu_decoder_layer: the attention-output RMSNorm declined");
  }
  auto [h2, residual_out] = cpu_rms_norm(o, post_norm, eps, res);
  TORCH_CHECK(h2.defined(), "cpu_decoder_layer: the post-attention RMSNorm declined");
  phase.next("accel_layer::gate_up_proj");
  const at::Tensor gate_up = layer_linear(h2, gate_up_weight, gate_up_quant, std::nullopt);
  phase.next("accel_layer::act_and_mul");
  const at::Tensor act = gated_activation(gate_up, activation);
  decoder_layer_calls.add(tokens);
  phase.next("accel_layer::down_proj");
  at::Tensor out = layer_linear(act, down_weight, down_quant, std::nullopt);
  if (mlp_out_norm.has_value()) {
    phase.next("accel_layer::norm");
    out = std::get<0>(cpu_rms_norm(out, mlp_out_norm, eps, std::nullopt));
    TORCH_CHECK(out.defined(), "cpu_decoder_layer: the MLP-output RMSNorm declined");
  }
  return {out, residual_out};
}

// Expert `e`'s slice of a per-expert tensor, or nothing.
std::optional<at::Tensor> expert_slice(const std::optional<at::Tensor>& t, int64_t e) {
  if (!t.has_value()) return std::nullopt;
  return t->select(0, e);
}

template <typename T>
void moe_accumulate(float* acc, const at::Tensor& y, const std::vector<int64_t>& rows,
                    const std::vector<float>& weights, int64_t h) {
  const T* src = y.data_ptr<T>();
  for (size_t r = 0; r < rows.size(); ++r) {
    float* dst = acc + rows[r] * h;
    const T* row = src + int64_t(r) * h;
    const float w = weights[r];
    for (int64_t c = 0; c < h; ++c) dst[c] += w * static_cast<float>(row[c]);
  }
}

// vllm_accel::cpu_moe_experts: moe.py's experts contract (reference/moe.py) for
// 2-D contiguous CPU x. The (token, choice) pairs are bucketed by this rank's expert
// slot (expert_map: global id -> slot, -1 elsewhere); each expert held here runs its
// tokens through layer_linear twice (the bf16 kernel, or with w13_quant / w2_quant
// the int4 or int8 one, as the decoder layer's linears) and its weighted rows are
// summed into a float32 accumulator.
at::Tensor cpu_moe_experts(const at::Tensor& x, const at::Tensor& w13, const at::Tensor& w2,
                           const at::Tensor& topk_weights, const at::Tensor& topk_ids,
                           const std::optional<at::Tensor>& expert_map,
                           const std::optional<at::Tensor>& w13_quant,
                           const std::optional<at::Tensor>& w2_quant,
                           const std::optional<at::Tensor>& w13_bias,
                           const std::optional<at::Tensor>& w2_bias, int64_t activation,
                           bool apply_router_weight_on_input) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu(), "cpu_moe_experts: x must be 2-D on the CPU");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == x.size(0) &&
                  topk_weights.sizes() == topk_ids.sizes(),
              "cpu_moe_experts: topk_ids/topk_weights must be [tokens, k]");
  TORCH_CHECK(activation >= 0 && activation <= 3, "cpu_moe_experts: unknown activation ",
              activation);
  const int64_t m = x.size(0), top_k = topk_ids.size(1), hidden = w2.size(1);
  const int64_t num_local = w13.size(0);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous();
  const at::Tensor weights = topk_weights.to(at::kFloat).contiguous();
  at::Tensor map;
  if (expert_map.has_value()) map = expert_map->to(at::kLong).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  const int64_t num_global = map.defined() ? map.size(0) : num_local;
  std::vector<std::vector<int64_t>> rows(num_local);
  std::vector<std::vector<float>> row_weights(num_local);
  for (int64_t p = 0; p < m * top_k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_global, "cpu_moe_experts: expert id ", id[p],
                " outside [0, ", num_global, ")");
    const int64_t e = map.defined() ? map.data_ptr<int64_t>()[id[p]] : id[p];
    if (e < 0) continue;
    rows[e].push_back(p / top_k);
    row_weights[e].push_back(wt[p]);
  }
  const at::Tensor xc = x.contiguous();
  at::Tensor acc = at::zeros({m, hidden}, x.options().dtype(at::kFloat));
  const int64_t row_bytes = xc.size(1) * xc.element_size();
  int64_t touched = 0;
  for (int64_t e = 0; e < num_local; ++e) {
    const std::vector<int64_t>& r = rows[e];
    if (r.empty()) continue;
    ++touched;
    const int64_t n = int64_t(r.size());
    at::Tensor xe = at::empty({n, xc.size(1)}, xc.options());
    auto* dst = static_cast<char*>(xe.data_ptr());
    const auto* src = static_cast<const char*>(xc.data_ptr());
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * row_bytes, src + r[i] * row_bytes, row_bytes);
    if (apply_router_weight_on_input) {
      const at::Tensor w = at::from_blob(const_cast<float*>(row_weights[e].data()), {n, 1},
                                         at::TensorOptions().dtype(at::kFloat));
      xe = at::mul(xe.to(at::kFloat), w).to(xc.scalar_type());
    }
    const at::Tensor h = layer_linear(xe, w13.select(0, e), expert_slice(w13_quant, e),
                                      expert_slice(w13_bias, e));
    const at::Tensor y =
        layer_linear(gated_activation(h, activation), w2.select(0, e),
                     expert_slice(w2_quant, e), expert_slice(w2_bias, e))
            .contiguous();
    const std::vector<float> ones(apply_router_weight_on_input ? r.size() : 0, 1.0f);
    const std::vector<float>& scale = apply_router_weight_on_input ? ones : row_weights[e];
    switch (y.scalar_type()) {
      case at::kFloat: moe_accumulate<float>(acc.data_ptr<float>(), y, r, scale, hidden); break;
      case at::kBFloat16:
        moe_accumulate<at::BFloat16>(acc.data_ptr<float>(), y, r, scale, hidden);
        break;
      case at::kHalf: moe_accumulate<at::Half>(acc.data_ptr<float>(), y, r, scale, hidden); break;
      default: TORCH_CHECK(false, "cpu_moe_experts: unsupported dtype ", y.scalar_type());
    }
  }
  moe_experts_calls.add(touched);
  return x.scalar_type() == at::kFloat ? acc : acc.to(x.scalar_type());
}

}  // namespace

extern "C" {

// Calls of `op`'s C kernel so far, and their rows summed into *rows; -1 for an
// unknown op.
int64_t accel_torch_ops_kernel_calls(const char* op, int64_t* rows) {
  const std::string_view name(op);
  KernelCalls* counter = name == "bf16_linear"       ? &bf16_linear_calls
                         : name == "int4pack_linear" ? &int4pack_linear_calls
                         : name == "int8_linear_dynamic" ? &int8_linear_calls
                         : name == "cpu_attention_step" ? &attention_step_calls
                         : name == "cpu_rms_norm" ? &rms_norm_calls
                         : name == "cpu_silu_and_mul" ? &silu_and_mul_calls
                         : name == "cpu_rotary_embedding" ? &rotary_calls
                         : name == "cpu_decoder_layer" ? &decoder_layer_calls
                         : name == "cpu_moe_experts" ? &moe_experts_calls
                         : name == "cpu_bf16_bmm" ? &bf16_bmm_calls
                         : name == "cpu_lora_linear" ? &lora_linear_calls
                                                  : nullptr;
  if (counter == nullptr) return -1;
  *rows = counter->rows.load();
  return counter->calls.load();
}

void accel_torch_ops_set_int4pack_layout(int block_n) { int4pack_block_n = block_n; }

}  // extern "C"

// The attention and elementwise ops exist only with this library (attention.py and
// elementwise.py call them when it loaded, else their ctypes paths); called inside
// vLLM's attention op or in eager mode, never traced.
TORCH_LIBRARY_FRAGMENT(vllm_accel, m) {
  m.def("cpu_paged_attention(Tensor query, Tensor kv_cache, Tensor block_table, "
        "Tensor query_start_loc, Tensor seq_lens, float scale, bool zero_tail, "
        "int sliding_window=0, float soft_cap=0., Tensor? alibi_slopes=None, "
        "Tensor? sinks=None) -> Tensor");
  m.def("cpu_mla_decode(Tensor q_nope, Tensor q_pe, Tensor kv_cache, Tensor block_table, "
        "Tensor seq_lens, float scale) -> Tensor");
  m.def("cpu_bf16_bmm(Tensor x, Tensor weight, Tensor(a!) out) -> ()");
  m.def("cpu_lora_linear(Tensor(a!) y, Tensor x, Tensor[] lora_a, Tensor[] lora_b_t, "
        "Tensor slots_of, float scale, int[] out_sizes) -> bool");
  m.def("cpu_cache_write(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, "
        "float k_scale, float v_scale) -> bool");
  m.def("cpu_attention_step(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, Tensor seq_lens, "
        "Tensor(b!) output, float scale, float k_scale, float v_scale, "
        "int max_prefill_pairs, int sliding_window=0, float soft_cap=0., "
        "Tensor? alibi_slopes=None, Tensor? sinks=None) -> bool");
  m.def("cpu_rms_norm(Tensor x, Tensor? weight, float eps, Tensor? residual) -> (Tensor, Tensor)");
  m.def("cpu_silu_and_mul(Tensor x) -> Tensor");
  m.def("cpu_rotary_embedding(Tensor positions, Tensor query, Tensor? key, Tensor cos_sin_cache, "
        "int head_size, int rotary_dim, bool is_neox) -> (Tensor, Tensor)");
  m.def("cpu_decoder_layer(Tensor hidden, Tensor? residual, Tensor positions, Tensor input_norm, "
        "Tensor qkv_weight, Tensor? qkv_bias, Tensor o_weight, Tensor? o_bias, Tensor post_norm, "
        "Tensor gate_up_weight, Tensor down_weight, float eps, Tensor cos_sin_cache, "
        "int rotary_dim, bool is_neox, int num_heads, int num_kv_heads, int head_size, "
        "Tensor(a!) kv_cache, Tensor slot_mapping, Tensor block_table, Tensor query_start_loc, "
        "Tensor seq_lens, float scale, float k_scale, float v_scale, int max_prefill_pairs, "
        "Tensor? qkv_quant=None, Tensor? o_quant=None, Tensor? gate_up_quant=None, "
        "Tensor? down_quant=None, int sliding_window=0, float soft_cap=0., "
        "Tensor? q_norm=None, Tensor? k_norm=None, Tensor? attn_out_norm=None, "
        "Tensor? mlp_out_norm=None, int activation=0) -> (Tensor, Tensor)");
  m.def("cpu_moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
        "Tensor? expert_map, Tensor? w13_quant, Tensor? w2_quant, Tensor? w13_bias, "
        "Tensor? w2_bias, int activation, bool apply_router_weight_on_input) -> Tensor");
}

// Impls for ops whose schemas Python defines (bf16_linear.py, wint_gemv.py,
// int8_linear.py); the
// dispatcher takes an impl before its schema.
TORCH_LIBRARY_IMPL(vllm_accel, CPU, m) {
  m.impl("bf16_linear", &bf16_linear);
  m.impl("int4pack_linear", &int4pack_linear);
  m.impl("int8_linear_dynamic", &int8_linear_dynamic);
  m.impl("int8_gemm", &int8_gemm);
  m.impl("cpu_paged_attention", &cpu_paged_attention);
  m.impl("cpu_mla_decode", &cpu_mla_decode);
  m.impl("cpu_bf16_bmm", &cpu_bf16_bmm);
  m.impl("cpu_cache_write", &cpu_cache_write);
  m.impl("cpu_lora_linear", &cpu_lora_linear);
  m.impl("cpu_attention_step", &cpu_attention_step);
  m.impl("cpu_rms_norm", &cpu_rms_norm);
  m.impl("cpu_silu_and_mul", &cpu_silu_and_mul);
  m.impl("cpu_rotary_embedding", &cpu_rotary_embedding);
  m.impl("cpu_decoder_layer", &cpu_decoder_layer);
  m.impl("cpu_moe_experts", &cpu_moe_experts);
}
