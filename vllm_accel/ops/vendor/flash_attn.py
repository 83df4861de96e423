"""``flash_attn``: Enflame's FlashAttention build as a kernel-registry provider.

vllm-gcu's V1 engine runs non-MLA attention through vLLM's ``FlashAttentionBackend``
on Enflame's closed-source ``flash_attn.vllm_flash_attn`` build (FA version 3). Its
``flash_attn_varlen_func`` reads a paged cache as K and V ``[num_blocks, block_size,
num_kv_heads, head_size]`` through their strides: vLLM relies on this for its HND
layout, and vllm-gcu's own V0 backend hands it ``as_strided`` views of a head-major
``[num_blocks, num_kv_heads, block_size, head_size]`` cache
(``vllm_gcu/attention/backends/flash_attn.py``). Our cache is such a pair of strided
views (:func:`flash_views`): the K and V half pages of every (block, head), so
prefill and decode read it in place.

Whether a build honours those strides, and each feature, is only known by running
it: :func:`probe_flash_attn` runs small cases on the device (both page orders, the
FA versions the function takes) against the float64 oracle, and the adapter serves
only what matched -- plain causal attention, sliding windows (``window_size``), soft
caps (``softcap``), ALiBi (``alibi_slopes``, FA2 only). float32, sinks, head sizes
and block sizes outside FlashAttention's contract go to the next provider.
"""

import importlib
import inspect
from collections.abc import Callable

import torch

from vllm_accel.ops.paged_layout import half_pages
from vllm_accel.ops.registry import fallback_kernel
from vllm_accel.ops.vendor.oracle_probe import PROBE_TOLERANCE
from vllm_accel.ops.triton.provider import first_line

FLASH_ATTN = "flash_attn"
#: the module Enflame's vLLM imports the build from
FLASH_ATTN_MODULE = "flash_attn.vllm_flash_attn"
#: FlashAttention's paged-KV contract: half precision, head sizes up to 256 in steps of
#: 8, pages in multiples of 16 tokens
FLASH_DTYPES = (torch.bfloat16, torch.float16)
#: the features a probe case checks: (name, value) given to the kernels
PROBED_FEATURES = {"sliding_window": 5, "logits_soft_cap": 3.0,
                   "alibi_slopes": torch.tensor([0.5, 0.25, 0.125, 0.0625])}


def flash_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Our ``[NB, Hkv, BS, 2D]`` cache as FlashAttention's K and V ``[NB, BS, Hkv, D]``:
    strided views of the half pages, no copy."""
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    d = width // 2
    pages, block_step, head_step = half_pages(kv_cache)
    page = block_size * d
    shape = (num_blocks, block_size, num_kv_heads, d)
    stride = (block_step * page, d, head_step * page, 1)
    k = pages.as_strided(shape, stride, pages.storage_offset())
    v = pages.as_strided(shape, stride, pages.storage_offset() + page)
    return k, v


def serves_shape(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Within FlashAttention's paged contract (dtype, head size, page size)."""
    d, block_size = query.shape[-1], kv_cache.shape[2]
    return (query.dtype in FLASH_DTYPES and kv_cache.dtype == query.dtype and d <= 256
            and d % 8 == 0 and block_size % 16 == 0)


def make_kernels(varlen: Callable, fa_version: int | None,
                 features: frozenset[str]) -> tuple[Callable, Callable]:
    """``paged_prefill`` and ``paged_decode`` on ``varlen`` for ``features``."""
    version = {} if fa_version is None else {"fa_version": fa_version}

    def attend(query, kv_cache, block_table, query_start_loc, seq_lens, max_query_len, scale,
               sliding_window=None, logits_soft_cap=None, alibi_slopes=None):
        k, v = flash_views(kv_cache)
        out = torch.zeros_like(query)  # rows past the last request stay zeros
        lens = seq_lens.to(device=query.device, dtype=torch.int32)
        varlen(q=query, k=k, v=v, out=out, max_seqlen_q=max_query_len,
               cu_seqlens_q=query_start_loc.to(device=query.device, dtype=torch.int32),
               max_seqlen_k=int(lens.max()), seqused_k=lens, softmax_scale=scale,
               causal=True, block_table=block_table.to(torch.int32),
               window_size=None if sliding_window is None else [sliding_window - 1, 0],
               softcap=logits_soft_cap or 0.0, alibi_slopes=alibi_slopes, **version)
        return out

    def flash_paged_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                            **feats):
        if set(feats) - features or not serves_shape(query, kv_cache) or not len(seq_lens):
            return fallback_kernel("paged_prefill", FLASH_ATTN)(
                query, kv_cache, block_table, query_start_loc, seq_lens, scale, **feats)
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
        return attend(query, kv_cache, block_table, query_start_loc, seq_lens, max_query_len,
                      scale, **feats)

    def flash_paged_decode(query, kv_cache, block_table, seq_lens, scale, **feats):
        if set(feats) - features or not serves_shape(query, kv_cache) or not len(query):
            return fallback_kernel("paged_decode", FLASH_ATTN)(
                query, kv_cache, block_table, seq_lens, scale, **feats)
        starts = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        out = attend(query, kv_cache, block_table, starts, seq_lens, 1, scale, **feats)
        # requests without cached tokens (batch padding) read nothing: zeros
        return out.masked_fill_((seq_lens == 0).to(out.device).view(-1, 1, 1), 0)

    return flash_paged_prefill, flash_paged_decode


def _probe_error(kernels: tuple[Callable, Callable], device: torch.device, layout: str,
                 features: dict) -> float:
    """Largest error of prefill (with cached context) and decode against the float64
    oracle on a small bf16 case: 4 query heads over 2 KV heads, pages of 16."""
    from vllm_accel.ops.reference.attention import paged_attention, paged_decode

    g = torch.Generator().manual_seed(0)
    shape = (2, 6, 16, 128) if layout == "head-major" else (6, 2, 16, 128)
    cache = torch.randn(shape, generator=g).bfloat16()
    cache = cache.transpose(0, 1) if layout == "head-major" else cache
    table = torch.tensor([[4, 1, 3], [0, 5, 2]], dtype=torch.int32)
    seq_lens = torch.tensor([37, 20], dtype=torch.int32)
    starts = torch.tensor([0, 9, 12], dtype=torch.int32)
    query = torch.randn(12, 4, 64, generator=g).bfloat16()
    want_prefill = paged_attention(query.double(), cache.double(), table, starts, seq_lens,
                                   0.125, **features)
    want_decode = paged_decode(query[:2].double(), cache.double(), table, seq_lens, 0.125,
                               **features)
    on = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in features.items()}
    prefill, decode = kernels
    got_prefill = prefill(query.to(device), cache.to(device), table.to(device), starts,
                          seq_lens.to(device), 0.125, **on)
    got_decode = decode(query[:2].to(device), cache.to(device), table.to(device),
                        seq_lens.to(device), 0.125, **on)
    return max(float((got_prefill.cpu().double() - want_prefill).abs().max()),
               float((got_decode.cpu().double() - want_decode).abs().max()))


def probe_flash_attn(device: torch.device) -> tuple[tuple[Callable, Callable] | None, str]:
    """The (prefill, decode) kernels of the flash-attention build that runs and matches
    the oracle on ``device``, serving the features that matched, or None; and why."""
    try:
        varlen = importlib.import_module(FLASH_ATTN_MODULE).flash_attn_varlen_func
    except Exception as exc:  # ImportError, or a build that fails to import
        return None, (f"{FLASH_ATTN_MODULE} not usable on {device.type}: not importable "
                      f"({first_line(exc)})")
    try:
        params = inspect.signature(varlen).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        params = {}
    # vllm-gcu's V1 patch asks for FA version 3, its other backends for 2; upstream's FA3
    # has no ALiBi
    versions = (3, 2) if "fa_version" in params else (None,)
    failures = []
    for version in versions:
        plain = make_kernels(varlen, version, frozenset())
        try:
            error = max(_probe_error(plain, device, layout, {})
                        for layout in ("block-major", "head-major"))
        except Exception as exc:
            failures.append(f"FA{version or ''} fails: {first_line(exc)}")
            continue
        if not error <= PROBE_TOLERANCE:
            failures.append(f"FA{version or ''} is wrong (max error {error:.3g}, e.g. a build "
                            "that ignores the cache's strides)")
            continue
        served = []
        for name, value in PROBED_FEATURES.items():
            one = make_kernels(varlen, version, frozenset({name}))
            try:
                if _probe_error(one, device, "block-major", {name: value}) <= PROBE_TOLERANCE:
                    served.append(name)
            except Exception:  # e.g. FA3 refuses ALiBi: the next provider serves it
                pass
        kernels = make_kernels(varlen, version, frozenset(served))
        return kernels, (f"{FLASH_ATTN_MODULE} (FA{version or '?'}) matched the oracle on "
                         f"{device.type}; serves causal attention"
                         + "".join(f", {name}" for name in served))
    return None, f"{FLASH_ATTN_MODULE} not usable on {device.type}: " + "; ".join(failures)
