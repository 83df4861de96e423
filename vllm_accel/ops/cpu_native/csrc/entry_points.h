// The C entry points of the cpu_native kernel library that csrc/torch_ops.cpp calls
// (Python reaches them through ctypes: build.py's _SIGNATURES). Included by their
// definitions too, so a changed signature fails to compile instead of mismatching.
#pragma once

#include <cstdint>

extern "C" {

// paged_attention.cpp
int accel_vector_lanes();
int accel_paged_attention(int dtype, const void* query, int64_t q_tok_stride,
                          int64_t q_head_stride, void* out, int64_t o_tok_stride,
                          int64_t o_head_stride, const void* cache, int cache_int8,
                          int64_t block_stride, int64_t head_stride, int block_size, int head_size,
                          int64_t num_blocks, const int32_t* block_table, int64_t bt_stride,
                          int64_t bt_cols, const int32_t* query_start_loc,
                          const int32_t* seq_lens, int num_reqs, int num_heads,
                          int num_kv_heads, float scale, int sliding_window, float soft_cap,
                          const float* alibi_slopes, const float* sinks);
int accel_cache_write(int dtype, const void* key, const void* value, int64_t k_tok_stride,
                      int64_t k_head_stride, int64_t v_tok_stride, int64_t v_head_stride,
                      void* cache, int cache_int8, int64_t block_stride,
                      int64_t cache_head_stride, const int64_t* slots, int64_t num_tokens,
                      int num_kv_heads, int block_size, int head_size, int64_t num_blocks,
                      float k_scale, float v_scale);

// mla_decode.cpp
int accel_mla_decode(int dtype, const void* q_nope, int64_t qn_tok, int64_t qn_head,
                     const void* q_pe, int64_t qp_tok, int64_t qp_head, void* out, int64_t o_tok,
                     int64_t o_head, const void* cache, int64_t num_blocks, int64_t block_stride,
                     int64_t row_stride, int block_size, int lora, int rope,
                     const int32_t* block_table, int64_t bt_stride, int64_t bt_cols,
                     const int32_t* seq_lens, int num_reqs, int num_heads, float scale);

// lora.cpp
int accel_lora_linear(int dtype, const void* x, int64_t x_stride, void* y, int64_t y_stride,
                      int64_t rows, int in, const int64_t* slots_of, int num_slots,
                      int num_slices, const void* const* a_slices, const int64_t* a_slot_stride,
                      const void* const* b_slices, const int64_t* b_slot_stride,
                      const int64_t* b_row_stride, const int64_t* out_sizes, int rank,
                      float scale);

// bf16_linear.cpp
int accel_bf16_linear_available();
int accel_bf16_linear_onednn_rows(int32_t x_dtype);
int accel_bf16_linear_amx_rows();
int accel_bf16_linear_dp_rows();
int accel_bf16_linear(const void* x, int64_t x_stride, int32_t x_dtype, const void* w,
                      int64_t w_stride, const float* bias, void* y, int64_t y_stride, int64_t m,
                      int64_t n, int64_t k);
int accel_bf16_bmm(const void* x, int64_t x_batch_stride, int64_t x_stride, int32_t x_dtype,
                   const void* w, int64_t w_batch_stride, int64_t w_stride, void* y,
                   int64_t y_batch_stride, int64_t y_stride, int64_t batch, int64_t m, int64_t n,
                   int64_t k);

// int4_gemv.cpp
int accel_int4pack_gemv_available();
int accel_int4pack_block_sizes();
int accel_int4pack_amx_rows();
int accel_int4pack_gemv(const void* x, int64_t x_stride, const void* packed,
                        const void* scales_zeros, void* y, int64_t y_stride, int32_t m,
                        int64_t n, int64_t k, int64_t group, int32_t block_n, int32_t variant);
int accel_int4pack_gemv_f32(const float* x, int64_t x_stride, const void* packed,
                            const float* scales_zeros, float* y, int64_t y_stride, int32_t m,
                            int64_t n, int64_t k, int64_t group, int32_t block_n);

// int8_linear.cpp (called by torch_ops.cpp; ctypes only in its test)
int accel_int8_quant_rows(int32_t dtype, const void* x, int64_t x_stride, int64_t m, int64_t k,
                          int8_t* q, float* scales);
int accel_int8_linear_amx(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride,
                          int64_t m, int64_t n, int64_t k, const float* row_scales,
                          const float* col_scales, const float* bias, int32_t y_dtype, void* y,
                          int64_t y_stride);
int accel_int8_gemm_available();
int accel_int8_gemm(const int8_t* q, int64_t q_stride, const int8_t* w, int64_t w_stride,
                    int64_t m, int64_t n, int64_t k, int32_t* acc, int64_t acc_stride);
int accel_int8_dequant(const int32_t* acc, int64_t acc_stride, int64_t m, int64_t n,
                       const float* row_scales, const float* col_scales, const float* bias,
                       int32_t y_dtype, void* y, int64_t y_stride);

// elementwise.cpp
int accel_rms_norm(int dtype, const void* x, int64_t x_stride, const void* residual,
                   int64_t r_stride, const void* weight, void* out, int64_t o_stride,
                   void* new_residual, int64_t nr_stride, int64_t rows, int n, float eps);
int accel_silu_and_mul(int dtype, const void* x, int64_t x_stride, void* out, int64_t o_stride,
                       int64_t rows, int d);
int accel_rotary(int dtype, const int64_t* positions, int64_t num_tokens, const void* x,
                 int64_t x_stride, void* out, int64_t o_stride, int num_heads, int head_size,
                 int rot_dim, int neox, const void* cos_sin, int64_t cs_stride,
                 int64_t num_positions);

}  // extern "C"
