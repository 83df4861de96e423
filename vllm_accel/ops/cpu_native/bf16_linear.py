"""bf16 Linear layers on the checkpoint's own layout (``csrc/bf16_linear.cpp``): the
simulator's kernel for vLLM's unquantized bf16 linears on x86 CPUs with AVX-512 or with
AVX2 + FMA + F16C.

vLLM's CPU linears call oneDNN on a weight it prepacks. On a CPU without AVX512-BF16
and AMX (Ice Lake, or a VM that hides BF16) oneDNN emulates bf16 dot products: ~30
GFLOP/s a core at any batch, 4-5x below its own float32 GEMM, and a single-request
decode reads weights at ~10 GB/s of a 13 GB/s core. There the kernel widens each bf16
weight to float32 exactly (two integer instructions) and runs float32 FMAs: per layer
of the default model on an Intel Xeon without BF16, one core, weights cold: 1.2-1.7x
oneDNN at 1 row, 2.4-3.6x at 4, 16, 64 and 256 rows. Without AVX-512 (AMD Zen 1-3) the
same tiles run on AVX2, where oneDNN has no bf16 matmul at all and stock vLLM calls
torch's linear: 1.6x it at 1 row (12 GB/s of the core's 13), 2.4-4.4x at 2-64 rows (an
Intel Xeon held to AVX2, ``benchmarks/as_cpu.py avx2``, one core, the 30 layers,
``benchmarks/bf16_linear_rows.py``). Where the CPU has AVX512-BF16,
batches of 3 rows or more run VDPBF16PS tiles instead (a packed-panel GEMM from 24
rows); where it has AMX, batches of 4 rows or more run AMX tiles on the weight in
place, and from the rows ``onednn_rows`` gives (640 with AMX, where oneDNN's K-blocked
AMX GEMM wins) the op calls torch's linear. AMD EPYC Zen 4, one core, the default
model's 30 layers: 1 row 10.6-10.8 ms vs 17-20 ms in vLLM's prepacked oneDNN, 4 rows
10.1-10.5 vs 15-17 ms, 64 rows 71-72 vs 71-74 ms; an Intel Xeon with AMX: 8-16 rows
19.6-19.7 vs 22-24 ms (torch's linear 33-41), 64 rows 28.7-32.0 vs 29-30 (torch's
linear 49-50) (README, "How it is built").

The simulator routes vLLM's unquantized CPU linears here (``patches.py``, "bf16
linears on the simulator's kernel"); ``ACCEL_BF16_LINEAR`` says when. It is the
``torch.library`` op ``vllm_accel::bf16_linear``, so torch.compile keeps it as one
call.
"""

import functools

import torch

from vllm_accel import envs
from vllm_accel.ops.cpu_native import build as native

#: activation dtypes the kernel takes (the output has x's dtype)
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.cache
def available() -> bool:
    """Whether the library has the kernel (built on a CPU with AVX-512 F/BW/VL, or
    AVX2 + FMA + F16C)."""
    lib = native.library()
    return lib is not None and bool(lib.accel_bf16_linear_available())


def cpu_has_bf16_units() -> bool:
    """Whether oneDNN runs bf16 natively here (AVX512-BF16 or AMX)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def wanted() -> bool:
    """Whether the simulator's bf16 linears go to this kernel (``ACCEL_BF16_LINEAR``:
    ``auto`` and ``on`` wherever it is built, ``off`` never)."""
    return envs.ACCEL_BF16_LINEAR != "off" and available()


@functools.cache
def onednn_rows(dtype: torch.dtype) -> int:
    """Rows of x from which the op hands a batch to torch's linear (oneDNN), 0 for
    never: with AMX, oneDNN's AMX GEMM wins once a batch is compute-bound
    (``csrc/bf16_linear.cpp`` has the numbers)."""
    code = native.dtype_code(dtype)
    return native.library().accel_bf16_linear_onednn_rows(code) if available() and code is not None else 0


@functools.cache
def amx_rows() -> int:
    """Rows of bf16 x from which the kernel's AMX tiles run, 0 where this CPU (or the
    kernel's permission to use them) lacks them (``csrc/bf16_linear.cpp``)."""
    return native.library().accel_bf16_linear_amx_rows() if available() else 0


@functools.cache
def dp_rows() -> int:
    """Rows of bf16 x from which the kernel's AVX512-BF16 tiles run, 0 where this
    CPU lacks them (``csrc/bf16_linear.cpp``)."""
    return native.library().accel_bf16_linear_dp_rows() if available() else 0


def takes_weight(weight: torch.Tensor) -> bool:
    """Whether a layer's weight is one the kernel reads in place."""
    return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.device.type == "cpu"
            and weight.stride(1) == 1 and not weight.is_meta)


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight, bias)`` for a bf16 ``weight``, in x's dtype."""
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if (x.dtype not in X_DTYPES or not takes_weight(weight) or x.shape[-1] != k or k == 0
            or (bias is not None and (tuple(bias.shape) != (n,) or bias.device.type != "cpu"))
            or not available()):
        return torch.nn.functional.linear(x, weight.to(x.dtype), bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if 0 < onednn_rows(x.dtype) <= m:
        return torch.nn.functional.linear(x, weight, bias)
    y = x2.new_empty((m, n))
    if m:
        b = None if bias is None else bias.to(torch.float32).contiguous()
        rc = native.library().accel_bf16_linear(
            x2.data_ptr(), x2.stride(0), native.dtype_code(x2.dtype), weight.data_ptr(),
            weight.stride(0), None if b is None else b.data_ptr(), y.data_ptr(), y.stride(0),
            m, n, k)
        if rc:
            raise RuntimeError(f"accel_bf16_linear failed ({rc}) for x {tuple(x.shape)} "
                               f"{x.dtype}, weight {tuple(weight.shape)}")
    return y.reshape(*lead, n)


# torch.library.Library rather than @custom_op, for the dispatcher's lower per-call
# cost (as vllm_accel::int4pack_linear, wint_gemv.py).
_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("bf16_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
#: whether the op's CPU kernel is the C++ one (csrc/torch_ops.cpp: no Python per
#: call) or, where that library cannot be built, ``bf16_linear`` above
NATIVE_DISPATCH = native.torch_ops() is not None
if not NATIVE_DISPATCH:
    _LIB.impl("bf16_linear", bf16_linear, "CPU")


@torch.library.register_fake("vllm_accel::bf16_linear", lib=_LIB)
def _bf16_linear_shape(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What a routed layer's ``cpu_linear`` is (vLLM's CPU linear calls it with the
    layer's own weight and bias)."""
    return torch.ops.vllm_accel.bf16_linear(x, weight, bias)
