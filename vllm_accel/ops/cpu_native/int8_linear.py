"""The ``cpu_native`` provider of ``int8_linear`` (W8A8): symmetric dynamic per-token
activations run as one dispatcher op, ``vllm_accel::int8_linear_dynamic``
(``csrc/torch_ops.cpp``): the rows quantized in C++, the int8 GEMM (AMX tiles where
the CPU has them, ``csrc/int8_linear.cpp``: the same int32 sums, 1.5-2.1x torch's on an
Intel Xeon with AMX at 1-256 rows; on CPUs with AVX2 but no AVX-512 the library's own
exact GEMM, as torch's is not exact there; torch's otherwise), the dequantizing epilogue
in C++, the same bytes as the torch kernel (``quant/w8a8.py``).

Why one op: traced as torch ops, the quantizer and the epilogue are elementwise
code that inductor generates and compiles C++ for, per linear; a compiled W8A8
engine of the default model (120 linears) took 110-122 s to start, most of it
there, against stock vLLM's 70-81 s for the bf16 model. Opaque to the compiler,
the op costs no compile time and one dispatcher call per linear.

Static or asymmetric activations, an ``mm_method`` other than torch's int8 GEMM (but
where the library has a GEMM of its own), and a build without the dispatcher library go
to the next provider.
"""

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"

_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("int8_linear_dynamic(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias)"
            " -> Tensor")
#: whether the op has its C++ kernel (no Python kernel: without the library the
#: provider declines)
NATIVE_DISPATCH = native.torch_ops() is not None


def own_gemm() -> bool:
    """Whether the library has an exact int8 GEMM of its own (AVX2 without AVX-512,
    where torch's is not exact): ``vllm_accel::int8_gemm``, which the W8A8 method
    then picks (``mm_method`` "native") and this op runs."""
    return NATIVE_DISPATCH and bool(native.library().accel_int8_gemm_available())


def takes_mm_method(mm_method: str) -> bool:
    """Whether the op computes what ``mm_method`` would (the same exact int32 sums):
    torch's int8 GEMM or the library's."""
    return mm_method in ("int_mm", "native")


_LIB.define("int8_gemm(Tensor a, Tensor w) -> Tensor")


@torch.library.register_fake("vllm_accel::int8_gemm", lib=_LIB)
def _int8_gemm_shape(a, w):
    return a.new_empty((a.shape[0], w.shape[0]), dtype=torch.int32)


@torch.library.register_fake("vllm_accel::int8_linear_dynamic", lib=_LIB)
def _int8_linear_dynamic_shape(x, weight, weight_scale, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@register_kernel("int8_linear", NATIVE)
def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                input_scale: torch.Tensor | None = None,
                input_zero_point: torch.Tensor | None = None,
                input_symmetric: bool = True,
                weight_col_sums: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, mm_method: str = "auto") -> torch.Tensor:
    """``quant/w8a8.py int8_linear``'s contract and result."""
    if (NATIVE_DISPATCH and input_scale is None and input_symmetric
            and x.device.type == "cpu" and native.dtype_code(x.dtype) is not None
            and weight.dtype == torch.int8 and weight.dim() == 2
            and weight_scale.dtype == torch.float32
            and takes_mm_method(mm_method)):  # (the method resolves "auto" at load)
        return torch.ops.vllm_accel.int8_linear_dynamic(x, weight, weight_scale, bias)
    return fallback_kernel("int8_linear", NATIVE)(
        x, weight, weight_scale, input_scale=input_scale, input_zero_point=input_zero_point,
        input_symmetric=input_symmetric, weight_col_sums=weight_col_sums, bias=bias,
        mm_method=mm_method)
