"""``torch_fast``: the batched paged-attention readers the simulated GCU's torch path
runs (one ``index_select`` of whole pages per batch, batched matmuls; layout in
:mod:`~vllm_accel.ops.paged_layout`). ``reference/attention.py`` holds the obvious
version tests compare them with, besides the float64 oracle.

Scores and softmax run in float32; the matmuls in the model dtype (fp32
accumulation).
"""

import functools

import torch

from vllm_accel.ops.paged_layout import half_pages, int8_sections, page_rows, page_table
from vllm_accel.ops.registry import register_kernel

#: provider name of the batched readers
FAST = "torch_fast"
#: query rows per matmul in prefill, bounding the float32 score matrix
PREFILL_QUERY_CHUNK = 256


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor):
    """Blocks ``[R, nblk]`` -> K, V as contiguous ``[Hkv * R, nblk * BS, D]``."""
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = half_pages(kv_cache)
    k_rows = page_rows(block_ids, num_kv_heads, block_step, head_step)
    # One index_select for K and V: one allocation, whole half pages per row.
    kv = torch.index_select(pages, 0, torch.stack((k_rows, k_rows + 1)).reshape(-1))
    n_req, nblk = block_ids.shape
    k, v = kv.view(2, num_kv_heads * n_req, nblk * block_size, -1).unbind(0)
    return k, v, None


def _gather_kv_int8(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype):
    """Blocks ``[R, nblk]`` -> int8 codes of K, V as ``dtype`` ``[Hkv * R, nblk * BS, D]``
    and their float32 scales ``[2, Hkv * R, nblk * BS]``.

    One ``index_select`` of whole pages, then one conversion of the codes; the
    scales are applied to the (much smaller) scores and probabilities in
    ``_attend`` instead of to every K/V element. Viewing the scale bytes as
    float32 needs 4-byte aligned pages: any even block size.
    """
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = page_table(kv_cache)
    rows = page_rows(block_ids, num_kv_heads, block_step, head_step).reshape(-1)
    kv_q, scale_bytes = int8_sections(torch.index_select(pages, 0, rows), block_size)
    # Reorder as int8 first, then convert contiguously: a converting copy from the
    # strided view is ~2.5x slower than the two passes.
    kv = kv_q.transpose(0, 1).contiguous().to(dtype)  # [2, n, BS, D]
    n_req, nblk = block_ids.shape
    scales = scale_bytes.view(torch.float32).permute(2, 0, 1)  # [2, n, BS]
    k, v = kv.view(2, num_kv_heads * n_req, nblk * block_size, -1).unbind(0)
    return k, v, scales.reshape(2, num_kv_heads * n_req, nblk * block_size)


def _gather_kv_fp8(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
                   k_scale: float, v_scale: float):
    """Blocks ``[R, nblk]`` of a float8 cache -> K, V as ``dtype`` (exact: every
    float8 value is a bf16/fp16 value) and the per-layer scales, broadcast as
    ``_attend``'s per-key scales ``[2, Hkv * R, nblk * BS]``."""
    k, v, _ = _gather_kv(kv_cache, block_ids)
    scales = torch.tensor((k_scale, v_scale), dtype=torch.float32, device=k.device)
    return k.to(dtype), v.to(dtype), scales.view(2, 1, 1).expand(2, *k.shape[:2])


def _attend(q, k, v, valid, scale, kv_scales=None, soft_cap=None, bias=None, sinks=None):
    """softmax(q k^T * scale, masked by ``valid``) v for batched ``[N, M, D]`` q.

    ``valid`` broadcasts against the ``[N, M, S]`` scores. Keys outside ``valid``
    get probability 0; an all-masked row gives 0 rather than NaN. ``kv_scales``
    ``[2, N, S]`` (INT8 cache): per-key dequantization scales of K and V, applied
    to the scores and the probabilities -- the same sums as scaling K and V. The
    model's features (``reference/attention.py``): ``soft_cap``, an ALiBi ``bias``
    broadcasting against the scores, ``sinks`` logits ``[N, M]`` in the denominator.
    """
    scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale)
    if kv_scales is not None:
        scores.mul_(kv_scales[0][:, None, :])
    if soft_cap:
        scores = scores.div_(soft_cap).tanh_().mul_(soft_cap)
    if bias is not None:
        scores.add_(bias)
    scores.masked_fill_(~valid, float("-inf"))
    if sinks is not None:
        # the sink is one more logit with no value: softmax over both, then drop it
        probs = torch.softmax(torch.cat((scores, sinks[..., None].float()), dim=-1), dim=-1)
        probs = probs[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    if kv_scales is not None:
        probs = probs * kv_scales[1][:, None, :]
    return torch.bmm(probs.to(v.dtype), v)


def _per_kv_head(t: torch.Tensor | None, hkv: int, reqs: int) -> torch.Tensor | None:
    """Per-query-head values ``[H]`` (ALiBi slopes, sinks) as ``[Hkv * reqs, G]``, the
    rows ``_attend`` runs (kv head major, then request)."""
    if t is None:
        return None
    t = torch.as_tensor(t, dtype=torch.float32)
    return t.view(hkv, 1, -1).expand(hkv, reqs, t.numel() // hkv).reshape(hkv * reqs, -1)


def _first_blocks(seq_lens, block_size, window):
    """The first block each request's newest token reads (0 without a window): those
    before it may be vLLM's freed null block."""
    if not window:
        return torch.zeros_like(seq_lens)
    return (seq_lens - window).clamp(min=0) // block_size


def _decode(query, kv_cache, block_table, seq_lens, scale, gather, sliding_window=None,
            logits_soft_cap=None, alibi_slopes=None, sinks=None):
    """Batched decode attention; ``gather(kv_cache, block_ids)`` reads the K/V.

    Every request is padded to the longest one's blocks (from its window's first
    block); keys past its ``seq_len`` (or before its window) are masked. Query head
    ``h`` reads KV head ``h // (H // Hkv)``. A request with ``seq_len == 0`` (padded
    batch slot) returns zeros.
    """
    b, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    seq_lens = seq_lens.long()
    first = _first_blocks(seq_lens, block_size, sliding_window)  # [B]
    last = torch.maximum(-(-seq_lens // block_size) - 1, first)
    nblk = int((last - first).max()) + 1
    # a shorter request's padding columns repeat its last block: no other block is read
    cols = torch.minimum(first[:, None] + torch.arange(nblk, device=first.device),
                         last[:, None])
    k, v, kv_scales = gather(kv_cache, block_table.gather(1, cols.to(block_table.device)))
    q = query.view(b, hkv, h // hkv, d).transpose(0, 1).reshape(hkv * b, h // hkv, d)
    key_pos = first[:, None] * block_size + torch.arange(nblk * block_size,
                                                         device=query.device)  # [B, L]
    distance = key_pos - (seq_lens[:, None] - 1)  # j - i
    valid = distance <= 0
    if sliding_window:
        valid &= distance > -sliding_window
    valid = valid.repeat(hkv, 1)[:, None, :]  # [Hkv*B, 1, L]
    bias = None
    if alibi_slopes is not None:  # [Hkv*B, G, 1] x [Hkv*B, 1, L]
        bias = (_per_kv_head(alibi_slopes, hkv, b)[..., None]
                * distance.float().repeat(hkv, 1)[:, None, :])
    out = _attend(q.to(k.dtype), k, v, valid, scale, kv_scales, logits_soft_cap, bias,
                  _per_kv_head(sinks, hkv, b))  # [Hkv*B, G, D]
    return out.view(hkv, b, h // hkv, d).transpose(0, 1).reshape(b, h, d).to(query.dtype)


def _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather,
             sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    """Causal attention per request; ``gather(kv_cache, block_ids)`` reads the K/V.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``, the
    last positions of its ``seq_len`` tokens; the earlier ``seq_len - q_len``
    (chunked prefill, prefix cache) are read from the cache like the new ones, from
    the first query's window on. Loops over requests (lengths differ) and query
    chunks, never over tokens. Rows past ``query_start_loc[-1]`` (padding) are
    returned as zeros.
    """
    t, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = h // hkv
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    slopes = _per_kv_head(alibi_slopes, hkv, 1)  # [Hkv, G]
    sink = _per_kv_head(sinks, hkv, 1)
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        context = seq_len - (end - start)
        first_block = (0 if not sliding_window
                       else max(0, context + 1 - sliding_window) // block_size)
        pos0 = first_block * block_size
        k, v, kv_scales = gather(kv_cache,
                                 block_table[i: i + 1, first_block: -(-seq_len // block_size)])
        k, v = k[:, :seq_len - pos0], v[:, :seq_len - pos0]  # [Hkv, S, D]
        key_pos = torch.arange(pos0, seq_len, device=query.device)
        for c0 in range(start, end, PREFILL_QUERY_CHUNK):
            c1 = min(c0 + PREFILL_QUERY_CHUNK, end)
            q = query[c0:c1].view(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)
            q = q.reshape(hkv, group * (c1 - c0), d).to(k.dtype)  # rows: (g, token)
            # keys after the chunk's last query are all masked, and (window) so are
            # those before its first query's window
            key_end = c1 - start + context - pos0
            key_start = (0 if not sliding_window
                         else max(0, c0 - start + context + 1 - sliding_window - pos0))
            q_pos = torch.arange(c0 - start + context, c1 - start + context, device=query.device)
            distance = key_pos[None, key_start:key_end] - q_pos[:, None]  # [c, S']
            valid = distance <= 0
            if sliding_window:
                valid &= distance > -sliding_window
            valid = valid.repeat(group, 1)[None]
            bias = None
            if slopes is not None:  # [Hkv, G, 1, 1] x [c, S'] -> [Hkv, G*c, S']
                bias = (slopes[:, :, None, None] * distance.float()).reshape(
                    hkv, group * (c1 - c0), -1)
            o = _attend(q, k[:, key_start:key_end], v[:, key_start:key_end], valid, scale,
                        None if kv_scales is None else kv_scales[..., key_start:key_end],
                        logits_soft_cap, bias,
                        None if sink is None else sink.repeat_interleave(c1 - c0, dim=1))
            o = o.view(hkv, group, c1 - c0, d)
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, h, d).to(query.dtype)
    return out


@register_kernel("paged_decode", FAST)
def paged_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    **features,
) -> torch.Tensor:
    """One query token per request ``[B, H, D]``, batched over all requests (see ``_decode``)."""
    return _decode(query, kv_cache, block_table, seq_lens, scale, _gather_kv, **features)


@register_kernel("paged_prefill", FAST)
def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    **features,
) -> torch.Tensor:
    """Causal attention for the newest ``q_len`` tokens of each request ``[T, H, D]``."""
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                    _gather_kv, **features)


@register_kernel("paged_decode_int8", FAST)
def paged_decode_int8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    **features,
) -> torch.Tensor:
    """``paged_decode`` over an INT8 cache; K/V dequantized to the query's dtype."""
    gather = functools.partial(_gather_kv_int8, dtype=query.dtype)
    return _decode(query, kv_cache, block_table, seq_lens, scale, gather, **features)


@register_kernel("paged_prefill_int8", FAST)
def paged_prefill_int8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    **features,
) -> torch.Tensor:
    """``paged_prefill`` over an INT8 cache; K/V dequantized to the query's dtype."""
    gather = functools.partial(_gather_kv_int8, dtype=query.dtype)
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather,
                    **features)


@register_kernel("paged_decode_fp8", FAST)
def paged_decode_fp8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    **features,
) -> torch.Tensor:
    """``paged_decode`` over a float8 cache (a float8 view) with per-layer scales."""
    gather = functools.partial(_gather_kv_fp8, dtype=query.dtype, k_scale=k_scale,
                               v_scale=v_scale)
    return _decode(query, kv_cache, block_table, seq_lens, scale, gather, **features)


@register_kernel("paged_prefill_fp8", FAST)
def paged_prefill_fp8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
    **features,
) -> torch.Tensor:
    """``paged_prefill`` over a float8 cache (a float8 view) with per-layer scales."""
    gather = functools.partial(_gather_kv_fp8, dtype=query.dtype, k_scale=k_scale,
                               v_scale=v_scale)
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather,
                    **features)


@register_kernel("varlen_attention", FAST)
def varlen_attention(query, key, value, query_start_loc, scale, *, causal: bool = False,
                     key_start_loc: torch.Tensor | None = None,
                     sliding_window: int | None = None, logits_soft_cap: float | None = None,
                     alibi_slopes: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None):
    """Attention within each sequence of a packed batch, no cache (contract:
    ``reference/attention.py``): each sequence's heads as one batched matmul of its
    query chunks, float32 softmax."""
    t, h, d = query.shape
    hkv = key.shape[1]
    group = h // hkv
    dv = value.shape[2]
    out = query.new_zeros(t, h, dv)
    slopes = _per_kv_head(alibi_slopes, hkv, 1)  # [Hkv, G]
    sink = _per_kv_head(sinks, hkv, 1)
    starts = query_start_loc.tolist()
    key_starts = starts if key_start_loc is None else key_start_loc.tolist()
    for i, (start, end) in enumerate(zip(starts[:-1], starts[1:])):
        if end == start:
            continue
        k0, k1 = key_starts[i], key_starts[i + 1]
        k = key[k0:k1].transpose(0, 1)  # [Hkv, S, D]
        v = value[k0:k1].transpose(0, 1)
        key_pos = torch.arange(k1 - k0, device=query.device)
        first = k1 - k0 - (end - start)  # the first query's position
        for c0 in range(start, end, PREFILL_QUERY_CHUNK):
            c1 = min(c0 + PREFILL_QUERY_CHUNK, end)
            q = query[c0:c1].view(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)
            q = q.reshape(hkv, group * (c1 - c0), d).to(k.dtype)  # rows: (g, token)
            q_pos = key_pos[first + c0 - start:first + c1 - start]
            distance = key_pos[None, :] - q_pos[:, None]  # [c, S]
            valid = distance <= 0 if causal else torch.ones_like(distance, dtype=torch.bool)
            if sliding_window:
                valid &= distance.abs() < sliding_window
            bias = None
            if slopes is not None:
                signed = distance if causal else -distance.abs()
                bias = (slopes[:, :, None, None] * signed.float()).reshape(
                    hkv, group * (c1 - c0), -1)
            o = _attend(q, k, v, valid.repeat(group, 1)[None], scale, None, logits_soft_cap,
                        bias, None if sink is None else sink.repeat_interleave(c1 - c0, dim=1))
            o = o.view(hkv, group, c1 - c0, dv)
            out[c0:c1] = o.permute(2, 0, 1, 3).reshape(c1 - c0, h, dv).to(query.dtype)
    return out
