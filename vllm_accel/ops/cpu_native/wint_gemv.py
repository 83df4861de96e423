"""The ``cpu_native`` provider of the weight-only GEMM: torch_fast's prepared
layouts, with a C++ kernel (``csrc/int4_gemv.cpp``) for 4-bit decode batches.

torch's ``_weight_int4pack_mm_for_cpu`` reads its int4 layout at 12-17 GB/s at one
row on a core that reads 35-40 GB/s (AMD EPYC Zen 5), and single-request decode is
exactly that call. The C++ kernel reads the same layout (so the weight is prepared
once, by ``torch_fast``, and torch's kernel keeps prefill-sized batches): a
streaming GEMV up to 4 rows, 16-output slabs of the weight against chunks of 8 rows
up to 64 (1.3-2.1x torch's kernel from 1 to 64 rows, measured per layer of the
default model with AVX512-BF16). With AVX512-VBMI it multiplies with AVX512-BF16 dot
products where the CPU has them (exact products), else with AVX512-VNNI int16 dot
products on ``x`` in 16-bit fixed point per block of up to 128 columns (Ice Lake, or
a VM that hides BF16: half the instructions of float32 FMAs, which the rest keep).
CPUs with AVX2 + FMA but not AVX-512 VBMI (AMD Zen 1-3, Intel Haswell to Cascade
Lake) run its AVX2 path: the same int16 fixed point with VPMADDWD, on torch's AVX2
layout (blocks of 32 outputs) or its AVX-512 one. Other CPUs keep torch's kernel.

float32 activations (a float32 model) run its float32 FMAs at any batch: torch's
kernel for them is ~70x slower than for bf16 (a scalar loop).

The GEMV is the ``torch.library`` op ``vllm_accel::int4pack_linear``, so
torch.compile keeps it as one call (a ctypes call would break the graph); larger
bf16 batches go to torch's kernel inside it. fp16 activations, and float32 ones where
the kernel is not built, keep the generic layout (torch's kernel is a scalar loop
for both).
"""

import functools

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import register_kernel
from vllm_accel.ops.torch_fast import wint_gemm as torch_fast

NATIVE = "cpu_native"
#: largest batch the C++ kernel takes (decode batches and short prefills; longer
#: prefills go to torch's kernel) where it has no AMX tiles (with them: any)
NATIVE_MAX_ROWS = 64
#: output features per block of torch's int4 layouts (AVX-512, AVX2)
BLOCK_SIZES = (64, 32)
#: ``accel_int4pack_gemv``'s variants (bits of ``accel_int4pack_gemv_available()``):
#: the best this build has, float32 FMAs, AVX512-BF16 dot products, AVX512-VNNI int16
#: dot products, AMX tiles on the weight dequantized to bf16
BEST, FP32_FMA, BF16_DOT, I16_DOT, AMX = 0, 1, 2, 4, 8


@functools.cache
def torch_layout() -> int:
    """The block size of torch's int4 layout here, 0 if it is neither of the kernel's:
    blocks of ``b`` outputs (64 or 32), byte ``i`` of a block's column holding output
    ``i`` (low nibble) and ``b/2 + i`` (high). torch picks its layout by the CPU
    capability it runs with (64 on AVX-512, 32 on AVX2, another elsewhere;
    ``ATEN_CPU_CAPABILITY`` overrides), so this is checked, not assumed."""
    rows = torch.arange(max(BLOCK_SIZES), dtype=torch.int32)
    codes = torch.stack((rows % 16, (rows // 4) % 16), 1)  # [64 outputs, 2 columns]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1).reshape(-1)
    packed = packed.to(torch.int32)
    for block in BLOCK_SIZES:
        half = block // 2
        expected = torch.cat([(codes[b:b + half, c] | (codes[b + half:b + block, c] << 4))
                              for b in range(0, len(rows), block) for c in (0, 1)])
        if packed.numel() == expected.numel() and torch.equal(packed, expected):
            return block
    return 0


@functools.cache
def gemv_available() -> bool:
    """Whether the library has the kernel (built on a CPU with AVX-512F and
    AVX512-VBMI, or with AVX2 and FMA) for the layout torch packs here."""
    lib = native.library()
    return (lib is not None and bool(lib.accel_int4pack_gemv_available())
            and bool(lib.accel_int4pack_block_sizes() & torch_layout()))


@functools.cache
def amx_rows() -> int:
    """Rows from which the kernel runs the AMX tiles (and takes any batch), 0 without."""
    return int(native.library().accel_int4pack_amx_rows()) if gemv_available() else 0


def _takes(x, weight, group_size, scales_zeros) -> bool:
    """Whether the C++ kernel takes these inputs (it trusts shapes: check them here):
    bf16 up to ``NATIVE_MAX_ROWS`` rows (any number with AMX), float32 any number."""
    m, k = x.shape
    n = scales_zeros.shape[1] if scales_zeros.dim() == 3 else -1
    fp32 = x.dtype == torch.float32
    return (gemv_available() and 0 < m and (m <= NATIVE_MAX_ROWS or amx_rows() > 0 or fp32)
            and x.dtype in (torch.bfloat16, torch.float32) and x.stride(1) == 1
            and scales_zeros.dtype == x.dtype and scales_zeros.is_contiguous()
            and n % torch_layout() == 0 and n > 0 and group_size > 0 and group_size % 2 == 0
            and k % group_size == 0 and tuple(scales_zeros.shape) == (k // group_size, n, 2)
            and weight.dtype == torch.uint8 and tuple(weight.shape) == (n, k // 2)
            and weight.is_contiguous())


def int4pack_linear(x: torch.Tensor, weight: torch.Tensor, group_size: int,
                    scales_zeros: torch.Tensor) -> torch.Tensor:
    """``torch.ops.aten._weight_int4pack_mm_for_cpu``'s contract; up to
    ``NATIVE_MAX_ROWS`` bf16 rows (any number with AMX) and float32 rows run the C++
    kernel."""
    if not _takes(x, weight, group_size, scales_zeros):
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), weight, group_size,
                                                          scales_zeros)
    m, k = x.shape
    n = scales_zeros.shape[1]
    y = x.new_empty((m, n))
    lib = native.library()
    args = (x.data_ptr(), x.stride(0), weight.data_ptr(), scales_zeros.data_ptr(), y.data_ptr(),
            y.stride(0), m, n, k, group_size, torch_layout())
    rc = (lib.accel_int4pack_gemv_f32(*args) if x.dtype == torch.float32
          else lib.accel_int4pack_gemv(*args, BEST))
    if rc:
        raise RuntimeError(f"accel_int4pack_gemv failed ({rc}) for x {tuple(x.shape)} "
                           f"{x.dtype}, weight {tuple(weight.shape)}, group {group_size}")
    return y


# Registered with torch.library.Library rather than @custom_op: a decode step makes
# 4 calls per layer, and the dispatcher reaches a plain CPU kernel in ~2 us where
# custom_op's wrappers take ~7 us (torch 2.13, measured); a C++ kernel behind it
# saves the Python kernel's ~10 us more.
_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("int4pack_linear(Tensor x, Tensor weight, int group_size, Tensor scales_zeros)"
            " -> Tensor")
#: whether the op's CPU kernel is the C++ one (csrc/torch_ops.cpp: no Python per
#: call) or, where that library cannot be built, ``int4pack_linear`` above
NATIVE_DISPATCH = native.torch_ops() is not None
if NATIVE_DISPATCH:
    native.torch_ops().accel_torch_ops_set_int4pack_layout(torch_layout() if gemv_available() else 0)
else:
    _LIB.impl("int4pack_linear", int4pack_linear, "CPU")


@torch.library.register_fake("vllm_accel::int4pack_linear", lib=_LIB)
def _int4pack_linear_shape(x, weight, group_size, scales_zeros):
    return x.new_empty((x.shape[0], scales_zeros.shape[1]))


#: the int4 layout for fp32 activations too where the C++ kernel runs them
register_kernel("wint_prepare", NATIVE)(functools.partial(
    torch_fast.prepare, int4_act_dtypes=(torch.bfloat16, torch.float32) if gemv_available()
    else torch_fast.INT4_ACT_DTYPES))
register_kernel("wint_prepared_linear", NATIVE)(
    functools.partial(torch_fast.prepared_linear,
                      int4_mm=torch.ops.vllm_accel.int4pack_linear.default))
