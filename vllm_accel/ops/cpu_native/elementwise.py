"""The ``cpu_native`` provider of ``rms_norm``, ``silu_and_mul`` and
``rotary_embedding`` (C++, see
``csrc/elementwise.cpp``): one pass over each row instead of the reference's
chain of torch ops, in float32 with one rounding to the model dtype per output
(as vLLM's CPU kernels; the reference rounds after several steps like vLLM's
forward_native, so the two may differ by one ulp). The same on every CPU.

Each kernel is a C++ dispatcher op (``csrc/torch_ops.cpp``: ``cpu_rms_norm``,
``cpu_silu_and_mul``, ``cpu_rotary_embedding``) that checks its inputs and calls the C
kernel, where the Python checks, allocations and ctypes call below cost 10-20 us a
call (the default model's eager decode step makes ~150); the ctypes path remains
where that library cannot be built. Eager mode only: under ``torch.compile``
(inductor fuses the reference's ops itself) and for inputs the C ABI does not take,
each kernel hands over to the next provider (``fallback_kernel``).
"""

import ctypes

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"
#: whether the C++ ops are registered (csrc/torch_ops.cpp built); else the ctypes calls
NATIVE_DISPATCH = native.torch_ops() is not None
if NATIVE_DISPATCH:
    _RMS_NORM = torch.ops.vllm_accel.cpu_rms_norm.default
    _SILU_AND_MUL = torch.ops.vllm_accel.cpu_silu_and_mul.default
    _ROTARY = torch.ops.vllm_accel.cpu_rotary_embedding.default


def _dispatch_ok() -> bool:
    """Whether to call the C++ ops: in eager mode, with the kernels not switched off
    since (the library is looked up per call, as on the ctypes path)."""
    return not torch.compiler.is_compiling() and native.library() is not None


def _rows(t: torch.Tensor) -> torch.Tensor | None:
    """``t`` as a 2-D view ``[rows, last]`` with unit element stride, or ``None``."""
    if t.dim() == 0 or t.stride(-1) != 1:
        return None
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # not viewable as rows
        return None


def _native_ok(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return (
        not torch.compiler.is_compiling()
        and native.dtype_code(dtype) is not None
        and all(t.device.type == "cpu" and t.dtype == dtype for t in tensors)
        and native.library() is not None
    )


@register_kernel("rms_norm", NATIVE)
def rms_norm(x, weight, eps, residual=None, variance_size=None):
    """Same contract as the reference ``rms_norm`` (``custom_ops``)."""
    if NATIVE_DISPATCH:
        if variance_size is None and _dispatch_ok():
            out, new_residual = _RMS_NORM(x, weight, eps, residual)
            if out is not None:
                return out if residual is None else (out, new_residual)
        return fallback_kernel("rms_norm", NATIVE)(x, weight, eps, residual, variance_size)
    tensors = [t for t in (x, weight, residual) if t is not None]
    x2 = _rows(x)
    r2 = None if residual is None else _rows(residual)
    if (variance_size is not None or not _native_ok(*tensors) or x2 is None
            or (residual is not None and (r2 is None or residual.shape != x.shape))
            or (weight is not None and (weight.shape != x.shape[-1:] or weight.stride(-1) != 1))
            or x2.shape[0] == 0):
        return fallback_kernel("rms_norm", NATIVE)(x, weight, eps, residual, variance_size)
    out = torch.empty(x.shape, dtype=x.dtype)
    new_residual = None if residual is None else torch.empty(x.shape, dtype=x.dtype)
    rows, n = x2.shape
    rc = native.library().accel_rms_norm(
        native.dtype_code(x.dtype), x2.data_ptr(), x2.stride(0),
        None if r2 is None else r2.data_ptr(), 0 if r2 is None else r2.stride(0),
        None if weight is None else weight.data_ptr(), out.data_ptr(), n,
        None if new_residual is None else new_residual.data_ptr(), n, rows, n,
        ctypes.c_float(eps),
    )
    if rc:
        raise RuntimeError(f"accel_rms_norm failed ({rc})")
    return out if new_residual is None else (out, new_residual)


@register_kernel("silu_and_mul", NATIVE)
def silu_and_mul(x):
    """Same contract as the reference ``silu_and_mul`` (``custom_ops``)."""
    if NATIVE_DISPATCH:
        out = _SILU_AND_MUL(x) if _dispatch_ok() else None
        return fallback_kernel("silu_and_mul", NATIVE)(x) if out is None else out
    x2 = _rows(x)
    if not _native_ok(x) or x2 is None or x.shape[-1] % 2 or x2.shape[0] == 0:
        return fallback_kernel("silu_and_mul", NATIVE)(x)
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    rc = native.library().accel_silu_and_mul(
        native.dtype_code(x.dtype), x2.data_ptr(), x2.stride(0), out.data_ptr(), d,
        x2.shape[0], d,
    )
    if rc:
        raise RuntimeError(f"accel_silu_and_mul failed ({rc})")
    return out


def _rotate(x, positions, cos_sin_cache, head_size, rotary_dim, is_neox_style):
    """One tensor's rotary embedding into a new tensor of its shape; ``None`` (nothing
    computed) if a position is outside the cos/sin cache."""
    rows = x.view(x.shape[0], -1)
    out = torch.empty(x.shape, dtype=x.dtype)
    num_tokens, width = rows.shape
    rc = native.library().accel_rotary(
        native.dtype_code(x.dtype), positions.data_ptr(), num_tokens, rows.data_ptr(),
        rows.stride(0), out.data_ptr(), width, width // head_size, head_size, rotary_dim,
        int(is_neox_style), cos_sin_cache.data_ptr(), cos_sin_cache.stride(0),
        cos_sin_cache.shape[0],
    )
    if rc == -2:
        return None
    if rc:
        raise RuntimeError(f"accel_rotary failed ({rc})")
    return out


def _rotary_rows_ok(x, num_tokens, head_size):
    if x.dim() < 2 or x.shape[0] != num_tokens or x.stride(-1) != 1:
        return False
    try:
        rows = x.view(num_tokens, -1)
    except RuntimeError:
        return False
    return rows.shape[1] % head_size == 0 and rows.stride(-1) == 1


@register_kernel("rotary_embedding", NATIVE)
def rotary_embedding(positions, query, key, cos_sin_cache, head_size, rotary_dim,
                     is_neox_style):
    """Same contract as the reference ``rotary_embedding`` (``custom_ops``)."""
    if NATIVE_DISPATCH:
        if _dispatch_ok():
            query_out, key_out = _ROTARY(positions, query, key, cos_sin_cache, head_size,
                                         rotary_dim, is_neox_style)
            if query_out is not None:
                return query_out, key_out
        return fallback_kernel("rotary_embedding", NATIVE)(
            positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    tensors = [query, cos_sin_cache] + ([] if key is None else [key])
    if (not _native_ok(*tensors) or rotary_dim > head_size or rotary_dim % 2
            or positions.dtype != torch.int64 or num_tokens == 0
            or cos_sin_cache.shape[-1] != rotary_dim or cos_sin_cache.stride(-1) != 1
            or not all(_rotary_rows_ok(t, num_tokens, head_size) for t in tensors[:1] + tensors[2:])):
        return fallback_kernel("rotary_embedding", NATIVE)(
            positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    positions = positions.contiguous()
    args = (positions, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    query_out = _rotate(query, *args)
    if query_out is None:  # a position outside the cache: the next provider raises
        return fallback_kernel("rotary_embedding", NATIVE)(
            positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)
    return query_out, None if key is None else _rotate(key, *args)
