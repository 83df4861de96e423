"""Reference paged-attention kernels in plain torch.

KV cache layout: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` -- K in
the first half of the last dim, V in the second, so one block gather fetches both.
A token's slot is ``block_id * block_size + offset``; a request's block table lists
its physical block ids in position order (blocks need not be contiguous or sorted).
"""

import torch
import torch.nn.functional as F

from vllm_accel.ops.registry import register_kernel


@register_kernel("cache_write")
def cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V ``[T, Hkv, D]`` into their slots; slot < 0 marks padding.

    ``key`` may have more rows than ``slot_mapping`` (padded batch): extra rows are
    ignored. One index_put per half, no per-token loop.
    """
    block_size = kv_cache.shape[2]
    d = key.shape[-1]
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    # Advanced indices around a slice -> indexed shape [n_valid, Hkv, D].
    kv_cache[blocks, :, offsets, :d] = key[:n][valid].to(kv_cache.dtype)
    kv_cache[blocks, :, offsets, d:] = value[:n][valid].to(kv_cache.dtype)


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks ``[..., nblk]`` -> contiguous per-head K|V ``[..., Hkv, nblk*BS, 2D]``."""
    blocks = kv_cache[block_ids.long()]  # [..., nblk, Hkv, BS, 2D]
    *lead, nblk, hkv, bs, d2 = blocks.shape
    return blocks.transpose(-4, -3).reshape(*lead, hkv, nblk * bs, d2)


@register_kernel("paged_decode")
def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request ``[B, H, D]``, batched over all requests at once.

    Every request is padded to the longest sequence; keys past ``seq_len`` (tail of
    the last block, or blocks the request does not own) are masked out, and their V
    zeroed so stale or uninitialised cache memory (even NaN) cannot leak in. Scores,
    softmax and the V product run in float32. A request with ``seq_len == 0``
    (padded batch slot) returns zeros.
    """
    b, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    nblk = -(-int(seq_lens.max()) // block_size)
    kv = _gather_kv(kv_cache, block_table[:, :nblk])  # [B, Hkv, L, 2D]
    k, v = kv[..., :d].float(), kv[..., d:].float()
    pad = torch.arange(kv.shape[2], device=kv.device) >= seq_lens[:, None]  # [B, L]
    q = query.reshape(b, hkv, h // hkv, d).float()  # head h -> kv head h // group
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)  # all-masked row -> 0
    v = v.masked_fill(pad[:, None, :, None], 0.0)
    return torch.matmul(probs, v).reshape(b, h, d).to(query.dtype)


@register_kernel("paged_prefill")
def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for the newest ``q_len`` tokens of each request ``[T, H, D]``.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the
    last positions of its ``seq_len`` tokens; the first ``seq_len - q_len`` (chunked
    prefill / prefix cache) are only in the cache. Loops over requests (lengths
    differ), gathering exactly ``seq_len`` keys each. ``is_causal`` aligns the mask
    top-left, which is only right without context, hence the explicit mask
    otherwise. Rows past ``query_start_loc[-1]`` (padding) are returned as zeros.
    """
    d = query.shape[-1]
    block_size = kv_cache.shape[2]
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        nblk = -(-seq_len // block_size)
        kv = _gather_kv(kv_cache, block_table[i, :nblk])[:, :seq_len]  # [Hkv, S, 2D]
        k, v = kv[..., :d].to(query.dtype), kv[..., d:].to(query.dtype)
        context = seq_len - q_len
        mask = None
        if context > 0:
            q_pos = torch.arange(context, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, S], True = attend
        o = F.scaled_dot_product_attention(
            query[start:end].transpose(0, 1),  # [H, q_len, D]
            k,
            v,
            attn_mask=mask,
            is_causal=context == 0,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = o.transpose(0, 1)
    return out
