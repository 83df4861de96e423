"""The ``reference`` provider of paged attention: written for obviousness, not speed.

One request at a time, its pages read with plain indexing, K/V dequantized to
float32 (INT8 codes times their scales; float8 values times the layer's scales), heads expanded for GQA, softmax over an explicit causal mask. The tests
hold every other provider (``torch_fast``, ``cpu_native``, ``triton``, a vendor's) to
the same float64 oracle, and ``ACCEL_KERNEL_PROVIDER=reference`` runs it in the
engine. Page layout: see ``paged_layout``.
"""

import torch

from vllm_accel.ops.paged_layout import INT8_SCALE_BYTES
from vllm_accel.ops.registry import register_kernel


def _request_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int):
    """K, V ``[Hkv, seq_len, D]`` in float32 for one request's blocks."""
    pages = kv_cache[block_ids.long()]  # [n, Hkv, BS, W], a copy
    n, hkv, bs, width = pages.shape
    flat = pages.reshape(n, hkv, bs * width)
    int8 = kv_cache.dtype == torch.int8
    d = (width - INT8_SCALE_BYTES) // 2 if int8 else width // 2
    k = flat[..., : bs * d].reshape(n, hkv, bs, d).float()
    v = flat[..., bs * d : 2 * bs * d].reshape(n, hkv, bs, d).float()
    if int8:
        scales = flat[..., 2 * bs * d :].contiguous().view(torch.float32).reshape(n, hkv, bs, 2)
        k, v = k * scales[..., :1], v * scales[..., 1:]
    k = k.transpose(0, 1).reshape(hkv, n * bs, d)[:, :seq_len]
    v = v.transpose(0, 1).reshape(hkv, n * bs, d)[:, :seq_len]
    return k, v


def paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                    k_scale: float = 1.0, v_scale: float = 1.0):
    """Causal attention of each request's newest ``q_len`` tokens over its cache
    (``k_scale``/``v_scale``: a float8 cache's per-layer scales)."""
    out = torch.zeros_like(query)
    h = query.shape[1]
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k, v = _request_kv(kv_cache, block_table[i, : -(-seq_len // block_size)], seq_len)
        k, v = k * k_scale, v * v_scale
        k = k.repeat_interleave(h // k.shape[0], dim=0)  # [H, S, D]
        v = v.repeat_interleave(h // v.shape[0], dim=0)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        scores = q @ k.transpose(1, 2) * scale
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        scores.masked_fill_(torch.arange(seq_len)[None, :] > q_pos[:, None], float("-inf"))
        out[start:end] = (torch.softmax(scores, dim=-1) @ v).transpose(0, 1).to(query.dtype)
    return out


def paged_decode(query, kv_cache, block_table, seq_lens, scale, k_scale=1.0, v_scale=1.0):
    """Decode is prefill with one query token per request."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                           k_scale, v_scale)


for _suffix in ("", "_int8", "_fp8"):  # the page reader handles every cache dtype
    register_kernel("paged_prefill" + _suffix)(paged_attention)
    register_kernel("paged_decode" + _suffix)(paged_decode)
