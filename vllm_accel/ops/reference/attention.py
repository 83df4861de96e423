"""The ``reference`` provider of paged attention: written for obviousness, not speed.

One request at a time, its pages read with plain indexing, K/V dequantized to
float32 (INT8 codes times their scales; float8 values times the layer's scales),
heads expanded for GQA, softmax over an explicit causal mask. The tests hold every
other provider (``torch_fast``, ``cpu_native``, ``triton``, a vendor's) to the same
float64 oracle, and ``ACCEL_KERNEL_PROVIDER=reference`` runs it in the engine. Page
layout: see ``paged_layout``.

The model features every provider's readers take as keyword arguments (absent:
plain causal attention), in this order on the logits ``s = q.k * scale`` of a query
at position ``i`` and a key at position ``j <= i``:

- ``logits_soft_cap`` ``c``: ``s = c * tanh(s / c)`` (Gemma 2);
- ``alibi_slopes`` ``[H]`` float32: ``s += slope[h] * (j - i)`` (Bloom, MPT);
- ``sliding_window`` ``W``: only keys with ``i - j < W`` (Mistral, Gemma, Phi-3);
  the blocks before the window may be vLLM's null block (freed), never read;
- ``sinks`` ``[H]`` float32: a learned logit per head that joins the softmax's
  denominator and adds no value (gpt-oss).

Only this provider's ``paged_attention`` also takes ``two_way_ranges`` (per request,
inclusive ``(first, last)`` positions): within a range, every token sees every other,
later ones too (Gemma 3's image tokens; vLLM's ``mm_req_doc_ranges``). The attention
backend recomputes the few prefill requests that have them through it.
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
                    k_scale: float = 1.0, v_scale: float = 1.0, *,
                    sliding_window: int | None = None, logits_soft_cap: float | None = None,
                    alibi_slopes: torch.Tensor | None = None,
                    sinks: torch.Tensor | None = None,
                    two_way_ranges: list[list[tuple[int, int]]] | None = None):
    """Causal attention of each request's newest ``q_len`` tokens over its cache
    (``k_scale``/``v_scale``: a float8 cache's per-layer scales; the features and
    ``two_way_ranges``: the module docstring)."""
    out = torch.zeros_like(query)
    h = query.shape[1]
    block_size = kv_cache.shape[2]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        key_pos = torch.arange(seq_len)
        # the blocks the window reaches: those before it may be freed
        first = 0 if sliding_window is None else max(0, int(q_pos[0]) - sliding_window + 1)
        first_block = first // block_size
        k, v = _request_kv(kv_cache, block_table[i, first_block: -(-seq_len // block_size)],
                           seq_len - first_block * block_size)
        key_pos = key_pos[first_block * block_size:]
        k, v = k * k_scale, v * v_scale
        k = k.repeat_interleave(h // k.shape[0], dim=0)  # [H, S, D]
        v = v.repeat_interleave(h // v.shape[0], dim=0)
        q = query[start:end].float().transpose(0, 1)  # [H, q_len, D]
        scores = q @ k.transpose(1, 2) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        distance = (key_pos[None, :] - q_pos[:, None]).float()  # j - i
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().view(h, 1, 1) * distance
        hidden = distance > 0
        for first, last in two_way_ranges[i] if two_way_ranges else ():
            hidden &= ~(((q_pos >= first) & (q_pos <= last))[:, None]
                        & ((key_pos >= first) & (key_pos <= last))[None, :])
        if sliding_window is not None:
            hidden |= distance <= -sliding_window
        scores.masked_fill_(hidden.to(scores.device), float("-inf"))
        if sinks is not None:  # one more logit per head, with no value
            sink = sinks.float().view(h, 1, 1).expand(h, end - start, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out


def paged_decode(query, kv_cache, block_table, seq_lens, scale, k_scale=1.0, v_scale=1.0,
                 **features):
    """Decode is prefill with one query token per request."""
    query_start_loc = torch.arange(query.shape[0] + 1, dtype=torch.int32)
    return paged_attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                           k_scale, v_scale, **features)


for _suffix in ("", "_int8", "_fp8"):  # the page reader handles every cache dtype
    register_kernel("paged_prefill" + _suffix)(paged_attention)
    register_kernel("paged_decode" + _suffix)(paged_decode)


@register_kernel("varlen_attention")
def varlen_attention(query, key, value, query_start_loc, scale, *, causal: bool = False,
                     key_start_loc: torch.Tensor | None = None,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None):
    """Attention within each sequence of a packed batch, no cache (encoder-only models,
    vision towers, MLA prefill over decompressed keys): ``query`` ``[T, H, D]``,
    ``key`` ``[S, Hkv, D]``, ``value`` ``[S, Hkv, Dv]``; sequence ``i`` has the query
    rows ``query_start_loc[i]:query_start_loc[i+1]`` and the key rows
    ``key_start_loc[i]:key_start_loc[i+1]`` (default: the query rows), its queries
    the last positions of its keys. Bidirectional unless ``causal``; the features as
    for the paged readers, bidirectionally: the window keeps keys with
    ``|i - j| < W``, ALiBi adds ``-slope * |i - j|``. Returns ``[T, H, Dv]``, rows
    past the last sequence zeros."""
    h, hkv = query.shape[1], key.shape[1]
    out = query.new_zeros(query.shape[0], h, value.shape[2])
    starts = query_start_loc.tolist()
    key_starts = starts if key_start_loc is None else key_start_loc.tolist()
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end == start:
            continue
        k0, k1 = key_starts[i], key_starts[i + 1]
        q = query[start:end].float().transpose(0, 1)  # [H, L, D]
        k = key[k0:k1].float().transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        v = value[k0:k1].float().transpose(0, 1).repeat_interleave(h // hkv, dim=0)
        scores = q @ k.transpose(1, 2) * scale
        if logits_soft_cap:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        q_pos = torch.arange(k1 - k0 - (end - start), k1 - k0)
        distance = (torch.arange(k1 - k0)[None, :] - q_pos[:, None]).float()  # j - i
        if alibi_slopes is not None:
            scores = scores + alibi_slopes.float().view(h, 1, 1) * (
                distance if causal else -distance.abs())
        hidden = (distance > 0) if causal else torch.zeros_like(distance, dtype=torch.bool)
        if sliding_window is not None:
            hidden |= distance.abs() >= sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(h, 1, 1).expand(h, end - start, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = (probs @ v).transpose(0, 1).to(query.dtype)
    return out
