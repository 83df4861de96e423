"""Registers the Triton kernels with the kernel registry when Triton runs on the device.

Card backends list ``triton`` after their vendor ops and before the torch kernels;
the card worker calls :func:`install_triton_kernels` with its device, which first
compiles and runs a probe (a small paged decode compared with the torch kernel, and
a one-row 4-bit GEMV, whose dequantization relies on float32 subnormals, compared
with a float64 matmul):
a vendor whose Triton backend is missing or broken keeps the torch kernels, and the
log says why. The simulator runs them only when ``ACCEL_KERNEL_PROVIDER=triton``
forces it, which needs ``TRITON_INTERPRET=1`` (Triton has no CPU backend).
"""

import torch

from vllm_accel.ops.registry import fallback_kernel, register_kernel

TRITON = "triton"


def first_line(exc: Exception) -> str:
    """An exception as one short line for a probe's report."""
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def probe_triton(device: torch.device) -> tuple[bool, str]:
    """Whether the Triton kernels compile and give the torch kernel's answer on
    ``device``, and why not."""
    import os

    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return False, ("Triton has no CPU backend; set TRITON_INTERPRET=1 to run its "
                       "interpreter (slow: for tests)")
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton

        if not interpreting:  # no GPU driver: stop before defining (compiling) kernels
            triton.runtime.driver.active.get_current_target()
    except Exception as exc:  # triton missing, a broken build, or no driver
        return False, f"Triton kernels do not run on {device.type} ({first_line(exc)})"
    from vllm_accel.ops.torch_fast.attention import paged_decode as torch_decode
    from vllm_accel.ops.triton import paged_attention
    try:
        g = torch.Generator().manual_seed(0)
        cache = torch.randn(3, 2, 16, 2 * 64, generator=g).to(device)
        query = torch.randn(2, 4, 64, generator=g).to(device)
        block_table = torch.tensor([[2, 0], [1, 2]], dtype=torch.int32, device=device)
        seq_lens = torch.tensor([20, 7], dtype=torch.int32, device=device)
        got = paged_attention.paged_decode(query, cache, block_table, seq_lens, 0.125)
        want = torch_decode(query, cache, block_table, seq_lens, 0.125)
        error = float((got - want).abs().max())
    except Exception as exc:
        return False, f"Triton kernels do not run on {device.type} ({first_line(exc)})"
    if not error <= 1e-3:
        return False, f"Triton probe on {device.type} is wrong (max error {error:g})"
    try:
        error = _wint_probe_error(device)
    except Exception as exc:  # e.g. a backend without the split-K atomics
        return False, f"Triton wint_linear does not run on {device.type} ({first_line(exc)})"
    if not error <= 1e-4:
        return False, (f"Triton wint_linear probe on {device.type} is wrong (relative error "
                       f"{error:g}; e.g. a device that flushes float32 subnormals to zero, "
                       f"which its dequantization relies on)")
    return True, f"probe kernels compiled and matched their references on {device.type}"


def _wint_probe_error(device: torch.device) -> float:
    """Largest relative error of two calls of the Triton batch-1 4-bit GEMV (K split
    in two, so the second call also checks the workspace the first left) against a
    float64 matmul."""
    from vllm_accel.ops.triton import wint_gemm

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (16, 512), generator=g, dtype=torch.uint8)
    scales = torch.rand(16, 4, generator=g) * 0.01 + 1e-3
    weight = (codes.double() - 8) * scales.double().repeat_interleave(128, 1)
    qweight = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(device)
    error = 0.0
    for _ in range(2):
        x = torch.randn(1, 512, generator=g)
        want = x.double() @ weight.T
        got = wint_gemm.wint_linear(x.to(device), qweight, scales.to(device), None, bits=4,
                                    group_size=128)
        error = max(error, float((got.cpu().double() - want).abs().max() / want.abs().max()))
    return error


def _keep_generic_layout(res, act_dtype):
    """The Triton GEMM reads the generic resident layout: no prepared copy."""
    return None


def _int8_linear(x, weight, weight_scale, *, input_scale=None, input_zero_point=None,
                 input_symmetric=True, weight_col_sums=None, bias=None, mm_method="auto"):
    """Triton's W8A8 GEMM; dynamic asymmetric activations go to the next provider."""
    from vllm_accel.ops.triton import int8_gemm

    if input_scale is None and not input_symmetric:
        return fallback_kernel("int8_linear", TRITON)(
            x, weight, weight_scale, input_scale=input_scale,
            input_zero_point=input_zero_point, input_symmetric=input_symmetric,
            weight_col_sums=weight_col_sums, bias=bias, mm_method=mm_method)
    return int8_gemm.int8_linear(x, weight, weight_scale, input_scale=input_scale,
                                 input_zero_point=input_zero_point,
                                 weight_col_sums=weight_col_sums, bias=bias)


def install_triton_kernels(device: torch.device) -> tuple[bool, str]:
    """Probe, then register the Triton kernels: (registered, why)."""
    usable, why = probe_triton(device)
    if not usable:
        return False, why
    from vllm_accel.ops.triton import mla, moe, paged_attention, wint_gemm

    register_kernel("mla_decode", TRITON)(mla.mla_decode)
    register_kernel("moe_experts", TRITON)(moe.moe_experts)
    register_kernel("moe_quant_experts", TRITON)(moe.moe_quant_experts)
    for name in ("paged_decode", "paged_decode_int8"):
        register_kernel(name, TRITON)(paged_attention.paged_decode)
    for name in ("paged_prefill", "paged_prefill_int8"):
        register_kernel(name, TRITON)(paged_attention.paged_prefill)
    register_kernel("wint_linear", TRITON)(wint_gemm.wint_linear)
    register_kernel("wint_prepare", TRITON)(_keep_generic_layout)
    register_kernel("int8_linear", TRITON)(_int8_linear)
    return True, ("registered paged_decode, paged_prefill (bf16/fp16/fp32 and int8 KV), "
                  f"mla_decode, moe_experts, moe_quant_experts, wint_linear, int8_linear "
                  f"({why})")
