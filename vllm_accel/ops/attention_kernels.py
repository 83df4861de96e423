"""Reference paged-attention kernels in plain torch.

KV cache of one layer: logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
(what vLLM hands the backend), each (block, head) page contiguous. A page holds the
block's K rows first, then its V rows, so every page splits into two contiguous
"half pages" of ``[block_size, head_size]``. ``_half_pages`` views the cache storage
as a table of half pages, whatever the order of pages (block-major ``LBHNC`` or
head-major ``LHBNC``); gathering a batch's K and V is then one ``index_select`` of
whole half pages -- a contiguous ``[S, head_size]`` matrix per (request, head),
ready for one batched matmul.

A token's slot is ``block_id * block_size + offset``; block tables list physical
block ids in position order (not necessarily contiguous or sorted). Scores and
softmax run in float32; the matmuls in the model dtype (fp32 accumulation).
"""

import torch

from vllm_accel.ops.registry import register_kernel

#: query rows per matmul in prefill, bounding the float32 score matrix
PREFILL_QUERY_CHUNK = 256


def _half_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """``[NB, Hkv, BS, 2D]`` -> (half pages ``[R, BS, D]``, block step, head step).

    The K half page of (block b, head h) is row ``b * block_step + h * head_step``;
    its V half page is the next row. A view, never a copy: writes land in the cache.
    """
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    half = block_size * width // 2
    block_stride, head_stride, token_stride, elem_stride = kv_cache.stride()
    if (elem_stride, token_stride) != (1, width) or block_stride % half or head_stride % half:
        raise ValueError(f"KV cache pages are not contiguous (strides {kv_cache.stride()})")
    block_step, head_step = block_stride // half, head_stride // half
    rows = (num_blocks - 1) * block_step + (num_kv_heads - 1) * head_step + 2
    pages = kv_cache.as_strided((rows, half), (half, 1)).unflatten(1, (block_size, width // 2))
    return pages, block_step, head_step


def _k_rows(block_ids: torch.Tensor, num_kv_heads: int, block_step: int, head_step: int):
    """K half-page rows ``[Hkv, n]`` of blocks ``[n]`` for every KV head."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)
    return heads[:, None] * head_step + block_ids.reshape(1, -1).long() * block_step


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor):
    """Blocks ``[R, nblk]`` -> K, V as contiguous ``[Hkv * R, nblk * BS, D]``."""
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = _half_pages(kv_cache)
    k_rows = _k_rows(block_ids, num_kv_heads, block_step, head_step)
    # One index_select for K and V: one allocation, whole half pages per row.
    kv = torch.index_select(pages, 0, torch.stack((k_rows, k_rows + 1)).reshape(-1))
    n_req, nblk = block_ids.shape
    return kv.view(2, num_kv_heads * n_req, nblk * block_size, -1).unbind(0)


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
    n = slot_mapping.shape[0]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    pages, block_step, head_step = _half_pages(kv_cache)
    k_rows = _k_rows(blocks, num_kv_heads, block_step, head_step).T  # [T, Hkv]
    pages[k_rows, offsets[:, None]] = key[:n][valid].to(kv_cache.dtype)
    pages[k_rows + 1, offsets[:, None]] = value[:n][valid].to(kv_cache.dtype)


def _attend(q, k, v, valid, scale):
    """softmax(q k^T * scale, masked by ``valid``) v for batched ``[N, M, D]`` q.

    ``valid`` broadcasts against the ``[N, M, S]`` scores. Keys outside ``valid``
    get probability 0; an all-masked row gives 0 rather than NaN.
    """
    scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale)
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return torch.bmm(probs.to(v.dtype), v)


@register_kernel("paged_decode")
def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per request ``[B, H, D]``, batched over all requests.

    Every request is padded to the longest one's blocks; keys past its
    ``seq_len`` are masked. Query head ``h`` reads KV head ``h // (H // Hkv)``.
    A request with ``seq_len == 0`` (padded batch slot) returns zeros.
    """
    b, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    nblk = -(-int(seq_lens.max()) // block_size)
    length = nblk * block_size
    k, v = _gather_kv(kv_cache, block_table[:, :nblk])  # [Hkv*B, L, D]
    q = query.view(b, hkv, h // hkv, d).transpose(0, 1).reshape(hkv * b, h // hkv, d)
    valid = torch.arange(length, device=query.device) < seq_lens[:, None]  # [B, L]
    valid = valid.repeat(hkv, 1)[:, None, :]  # [Hkv*B, 1, L]
    out = _attend(q.to(k.dtype), k, v, valid, scale)  # [Hkv*B, G, D]
    return out.view(hkv, b, h // hkv, d).transpose(0, 1).reshape(b, h, d).to(query.dtype)


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
    last positions of its ``seq_len`` tokens; the earlier ``seq_len - q_len``
    (chunked prefill, prefix cache) are read from the cache like the new ones.
    Loops over requests (lengths differ) and query chunks, never over tokens.
    Rows past ``query_start_loc[-1]`` (padding) are returned as zeros.
    """
    t, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = h // hkv
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        k, v = _gather_kv(kv_cache, block_table[i : i + 1, : -(-seq_len // block_size)])
        k, v = k[:, :seq_len], v[:, :seq_len]  # [Hkv, S, D]
        key_pos = torch.arange(seq_len, device=query.device)
        context = seq_len - (end - start)
        for c0 in range(start, end, PREFILL_QUERY_CHUNK):
            c1 = min(c0 + PREFILL_QUERY_CHUNK, end)
            q = query[c0:c1].view(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)
            q = q.reshape(hkv, group * (c1 - c0), d).to(k.dtype)  # rows: (g, token)
            q_pos = torch.arange(c0 - start + context, c1 - start + context,
                                 device=query.device)
            valid = (key_pos[None, :] <= q_pos[:, None]).repeat(group, 1)[None]
            o = _attend(q, k, v, valid, scale).view(hkv, group, c1 - c0, d)
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, h, d).to(query.dtype)
    return out
