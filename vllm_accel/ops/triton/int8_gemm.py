"""W8A8 int8 GEMM in Triton with per-token activation quantization (torch + triton only).

Same contract as the ``reference`` ``int8_linear`` (quant/w8a8.py): activations
quantized per token (dynamic, symmetric: ``s = amax / 127``) by one Triton kernel,
or with the checkpoint's static scalar (and zero point) by the same kernel; codes
multiplied with ``tl.dot`` on int8 into an exact int32 accumulator; the epilogue
subtracts the asymmetric zero-point term ``zp * sum_k W[n, k]``, applies the token
and channel scales and the bias in float32 and rounds once to ``x``'s dtype.
Rounding is half-to-even like ``torch.round``. The entry point is a
``torch.library`` custom op so torch.compile keeps it as one call.
"""

import torch
import triton
import triton.language as tl

INT8_MAX = 127
#: adding and subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to the
#: nearest integer, ties to even (the FPU's rounding mode)
_ROUND_MAGIC = tl.constexpr(12582912.0)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, zp_ptr, static_s_ptr, static_zp_ptr, K,
                       stride_x, stride_q, STATIC: tl.constexpr, HAS_ZP: tl.constexpr,
                       BK: tl.constexpr):
    """One token (row) per program: its scale, then its int8 codes."""
    row = tl.program_id(0)
    if STATIC:
        s = tl.load(static_s_ptr).to(tl.float32)
    else:
        amax = tl.zeros([BK], tl.float32)
        for k0 in range(0, K, BK):
            k = k0 + tl.arange(0, BK)
            xv = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(xv))
        s = tl.max(amax, 0) / 127.0
        s = tl.where(s == 0.0, 1.0, s)
        tl.store(s_ptr + row, s)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xv = tl.load(x_ptr + row * stride_x + k, mask=k < K, other=0.0).to(tl.float32)
        v = xv / s
        v = tl.minimum(tl.maximum(v, -4194304.0), 4194304.0)
        v = (v + _ROUND_MAGIC) - _ROUND_MAGIC
        if HAS_ZP:
            v = v + tl.load(static_zp_ptr).to(tl.float32)
            v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        elif STATIC:
            v = tl.minimum(tl.maximum(v, -128.0), 127.0)
        else:
            v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(q_ptr + row * stride_q + k, v.to(tl.int8), mask=k < K)


@triton.jit
def _int8_gemm_kernel(a_ptr, w_ptr, a_scale_ptr, w_scale_ptr, zp_ptr, col_sums_ptr, bias_ptr,
                      y_ptr, M, N, K, stride_a, stride_w, stride_y,
                      STATIC: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BM, BN], tl.int32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        k_ok = k < K
        a = tl.load(a_ptr + m[:, None] * stride_a + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                    other=0)
        w = tl.load(w_ptr + n[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                    other=0)
        acc += tl.dot(a, tl.trans(w), out_dtype=tl.int32)
    if HAS_ZP:
        zp = tl.load(zp_ptr)
        acc -= zp * tl.load(col_sums_ptr + n, mask=n_ok, other=0)[None, :]
    if STATIC:
        a_scale = tl.load(a_scale_ptr).to(tl.float32)
        y = acc.to(tl.float32) * a_scale
    else:
        y = acc.to(tl.float32) * tl.load(a_scale_ptr + m, mask=m_ok, other=0.0)[:, None]
    y = y * tl.load(w_scale_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_y + n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block_m(m: int) -> int:
    return 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128


@torch.library.custom_op("vllm_accel_triton::int8_mm", mutates_args=())
def int8_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
            input_scale: torch.Tensor | None, input_zero_point: torch.Tensor | None,
            weight_col_sums: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``int8_linear`` for a 2-D ``x`` (see the module doc)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    q = torch.empty(m, k, dtype=torch.int8, device=x.device)
    static = input_scale is not None
    has_zp = input_zero_point is not None
    if has_zp and weight_col_sums is None:
        raise ValueError("int8_linear: asymmetric activations need weight_col_sums")
    row_scale = (input_scale.reshape(1).to(torch.float32) if static else
                 torch.empty(m, dtype=torch.float32, device=x.device))
    zp = input_zero_point.reshape(1).to(torch.int32) if has_zp else row_scale
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    _quant_rows_kernel[(m,)](x, q, row_scale, zp, row_scale, zp, k, x.stride(0), q.stride(0),
                             STATIC=static, HAS_ZP=has_zp, BK=min(1024, triton.next_power_of_2(k)))
    bm, bn, bk = _block_m(m), 128, 128
    w = weight.contiguous()
    _int8_gemm_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        q, w, row_scale, weight_scale.to(torch.float32).contiguous(), zp,
        weight_col_sums if has_zp else zp, bias if bias is not None else row_scale, y,
        m, n, k, q.stride(0), w.stride(0), y.stride(0), STATIC=static, HAS_ZP=has_zp,
        HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk)
    return y


@int8_mm.register_fake
def _int8_mm_shape(x, weight, weight_scale, input_scale, input_zero_point, weight_col_sums,
                   bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                input_scale: torch.Tensor | None = None,
                input_zero_point: torch.Tensor | None = None,
                input_symmetric: bool = True,
                weight_col_sums: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, mm_method: str = "auto") -> torch.Tensor:
    """Same contract as the ``reference`` ``int8_linear``. Dynamic asymmetric
    activations (``input_symmetric=False`` without a static scale) are not a Triton
    path: callers get the reference kernel for them (see provider.py)."""
    if input_scale is None and not input_symmetric:
        raise NotImplementedError("dynamic asymmetric activation quantization")
    n, k = weight.shape
    y = int8_mm(x.reshape(-1, k), weight, weight_scale, input_scale, input_zero_point,
                weight_col_sums, bias)
    return y.reshape(*x.shape[:-1], n)
