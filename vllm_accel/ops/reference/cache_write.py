"""The KV-cache writers (provider ``reference``; ``cpu_native`` has bit-identical
C++ ones): new K/V scattered into their slots of the paged cache
(:mod:`~vllm_accel.ops.paged_layout`), quantized for INT8 and float8 caches."""

import torch

from vllm_accel.ops.paged_layout import (
    INT8_MIN_SCALE,
    half_pages,
    int8_sections,
    page_table,
    slot_index,
)
from vllm_accel.ops.registry import register_kernel


@register_kernel("cache_write")
def cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V ``[T, Hkv, D]`` into their slots; slot < 0 marks padding.

    Rows of ``key`` beyond ``len(slot_mapping)`` (a padded batch) are ignored.
    """
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = half_pages(kv_cache)
    valid, k_rows, offsets = slot_index(slot_mapping, num_kv_heads, block_size,
                                         block_step, head_step)
    n = slot_mapping.shape[0]
    pages[k_rows, offsets] = key[:n][valid].to(kv_cache.dtype)
    pages[k_rows + 1, offsets] = value[:n][valid].to(kv_cache.dtype)


def _to_fp8(x: torch.Tensor, scale: float, fp8: torch.dtype) -> torch.Tensor:
    """``x / scale`` rounded to ``fp8``, saturating at its largest finite value."""
    top = torch.finfo(fp8).max
    return x.to(torch.float32, copy=True).div_(scale).clamp_(-top, top).to(fp8)


@register_kernel("cache_write_fp8")
def cache_write_fp8(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> None:
    """Scatter new K/V ``[T, Hkv, D]`` into a float8 cache (``kv_cache`` is a
    ``float8_e4m3fn``/``float8_e5m2`` view) as ``K / k_scale``, ``V / v_scale``:
    vLLM's per-layer scales (1.0 unless the checkpoint has some)."""
    n = slot_mapping.shape[0]
    cache_write(_to_fp8(key[:n], k_scale, kv_cache.dtype),
                _to_fp8(value[:n], v_scale, kv_cache.dtype), kv_cache, slot_mapping)


def _quantize(x: torch.Tensor, static_scale: float | None):
    """``[T, Hkv, D]`` -> (int8 ``[T, Hkv, D]``, float32 scales ``[T, Hkv]``).

    Symmetric: ``scale = max|x| / 127`` per (token, head) unless a per-layer
    ``static_scale`` is given (values beyond ``127 * scale`` then clip).
    """
    if static_scale is None:  # amax is exact in x's dtype; no float32 copy of x
        scale = x.abs().amax(-1).float().div_(127).clamp_min_(INT8_MIN_SCALE)
    else:
        scale = torch.full(x.shape[:-1], static_scale, dtype=torch.float32, device=x.device)
    # A float32 copy, then in place: a mixed bf16/float32 division is slower on CPU.
    q = x.to(torch.float32, copy=True).div_(scale[..., None]).round_().clamp_(-127, 127)
    return q.to(torch.int8), scale


@register_kernel("cache_write_int8")
def cache_write_int8(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> None:
    """Quantize new K/V ``[T, Hkv, D]`` and scatter them into an INT8 cache.

    Every written token also gets its (k_scale, v_scale) stored -- static scales
    included -- so the readers never need to know which mode wrote the cache.
    Slot < 0 marks padding; rows beyond ``len(slot_mapping)`` are ignored.
    """
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = page_table(kv_cache)
    valid, rows, offsets = slot_index(slot_mapping, num_kv_heads, block_size,
                                       block_step, head_step)
    n = slot_mapping.shape[0]
    k_q, k_s = _quantize(key[:n][valid], k_scale)
    v_q, v_s = _quantize(value[:n][valid], v_scale)
    kv, scale_bytes = int8_sections(pages, block_size)
    kv[rows, 0, offsets] = k_q
    kv[rows, 1, offsets] = v_q
    scale_bytes[rows, offsets] = torch.stack((k_s, v_s), dim=-1).view(torch.int8)
