"""Paged-attention kernels in plain torch: the KV-cache writers (the only
implementation, provider ``reference``) and the batched readers the simulated GCU
runs (provider ``torch_fast``; ``attention_reference`` holds the obvious version
that tests compare them with, besides the float64 oracle).

KV cache of one layer: logical ``[num_blocks, num_kv_heads, block_size, width]``
(what vLLM hands the backend), each (block, head) page contiguous, pages in
block-major (``LBHNC``) or head-major (``LHBNC``) order. ``_page_table`` views the
cache storage as a table of equal rows (whole pages or fixed parts of them), so
gathering a batch's pages is one ``index_select`` of whole rows -- a contiguous 2-D
source, the fast path (advanced indexing and strided sources are much slower).

bf16/fp32 cache (``width = 2 * head_size``): a page holds the block's K rows first,
then its V rows, i.e. two contiguous "half pages" ``[block_size, head_size]``;
gathering half pages directly yields a contiguous ``[S, head_size]`` K or V matrix
per (request, head), ready for one batched matmul.

INT8 cache (``width = 2 * head_size + 8``, dtype int8), page bytes:
``[0, BS*D)`` K int8 ``[BS, D]``; ``[BS*D, 2*BS*D)`` V int8 ``[BS, D]``;
``[2*BS*D, 2*BS*D + 8*BS)`` float32 ``[BS, 2]`` = (k_scale, v_scale) per token.
Quantization is symmetric per (token, head): ``x ~= q * scale``, ``|q| <= 127``.
Readers gather whole pages and dequantize into the query's dtype in one pass.

A token's slot is ``block_id * block_size + offset``; block tables list physical
block ids in position order (not necessarily contiguous or sorted). Scores and
softmax run in float32; the matmuls in the model dtype (fp32 accumulation).
"""

import functools

import torch

from vllm_accel.ops.registry import register_kernel

#: provider name of the batched readers
FAST = "torch_fast"
#: query rows per matmul in prefill, bounding the float32 score matrix
PREFILL_QUERY_CHUNK = 256
#: bytes per token for the INT8 cache's float32 (k_scale, v_scale) pair
INT8_SCALE_BYTES = 8
#: floor for dynamic INT8 scales, so an all-zero (token, head) row quantizes to 0
INT8_MIN_SCALE = 1e-8
#: vLLM's fp8 KV cache dtypes -> the float8 format the cache stores (vLLM's
#: CPU and CUDA paths read plain "fp8" as e4m3)
FP8_KV_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                  "fp8_e5m2": torch.float8_e5m2}


def _page_table(kv_cache: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, int, int]:
    """``[NB, Hkv, BS, W]`` -> (rows ``[R, BS * W // parts]``, block step, head step).

    Each (block b, head h) page is ``parts`` consecutive rows, the first at
    ``b * block_step + h * head_step``, whatever the order of pages. A view, never
    a copy: writes land in the cache, and ``index_select`` gathers whole rows.
    """
    num_blocks, num_kv_heads, block_size, width = kv_cache.shape
    row = block_size * width // parts
    block_stride, head_stride, token_stride, elem_stride = kv_cache.stride()
    if (elem_stride, token_stride) != (1, width) or block_stride % row or head_stride % row:
        raise ValueError(f"KV cache pages are not contiguous (strides {kv_cache.stride()})")
    block_step, head_step = block_stride // row, head_stride // row
    rows = (num_blocks - 1) * block_step + (num_kv_heads - 1) * head_step + parts
    return kv_cache.as_strided((rows, row), (row, 1)), block_step, head_step


def _half_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """bf16/fp32 cache -> (half pages ``[R, BS, D]``, block step, head step).

    The K half page of (block b, head h) is row ``b * block_step + h * head_step``;
    its V half page is the next row.
    """
    rows, block_step, head_step = _page_table(kv_cache, parts=2)
    block_size, width = kv_cache.shape[2:]
    return rows.unflatten(1, (block_size, width // 2)), block_step, head_step


def _page_rows(block_ids: torch.Tensor, num_kv_heads: int, block_step: int, head_step: int):
    """First page-table rows ``[Hkv, n]`` of blocks ``[n]`` for every KV head."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)
    return heads[:, None] * head_step + block_ids.reshape(1, -1).long() * block_step


def _slot_index(slot_mapping: torch.Tensor, num_kv_heads: int, block_size: int,
                block_step: int, head_step: int):
    """Slots ``[n]`` -> (valid mask ``[n]``, page rows ``[T, Hkv]``, offsets ``[T, 1]``).

    ``T`` counts the valid (``>= 0``) slots; padding slots are dropped here so the
    writers never touch them.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    rows = _page_rows(blocks, num_kv_heads, block_step, head_step).T
    return valid, rows, offsets[:, None]


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor):
    """Blocks ``[R, nblk]`` -> K, V as contiguous ``[Hkv * R, nblk * BS, D]``."""
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = _half_pages(kv_cache)
    k_rows = _page_rows(block_ids, num_kv_heads, block_step, head_step)
    # One index_select for K and V: one allocation, whole half pages per row.
    kv = torch.index_select(pages, 0, torch.stack((k_rows, k_rows + 1)).reshape(-1))
    n_req, nblk = block_ids.shape
    k, v = kv.view(2, num_kv_heads * n_req, nblk * block_size, -1).unbind(0)
    return k, v, None


def _int8_sections(pages: torch.Tensor, block_size: int):
    """Int8 pages ``[n, page]`` -> views K+V ``[n, 2, BS, D]``, scale bytes ``[n, BS, 8]``."""
    head_size = (pages.shape[1] // block_size - INT8_SCALE_BYTES) // 2
    kv_bytes = 2 * block_size * head_size
    kv = pages[:, :kv_bytes].unflatten(1, (2, block_size, head_size))
    scales = pages[:, kv_bytes:].unflatten(1, (block_size, INT8_SCALE_BYTES))
    return kv, scales


def _gather_kv_int8(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype):
    """Blocks ``[R, nblk]`` -> int8 codes of K, V as ``dtype`` ``[Hkv * R, nblk * BS, D]``
    and their float32 scales ``[2, Hkv * R, nblk * BS]``.

    One ``index_select`` of whole pages, then one conversion of the codes; the
    scales are applied to the (much smaller) scores and probabilities in
    ``_attend`` instead of to every K/V element. Viewing the scale bytes as
    float32 needs 4-byte aligned pages: any even block size.
    """
    num_kv_heads, block_size = kv_cache.shape[1], kv_cache.shape[2]
    pages, block_step, head_step = _page_table(kv_cache)
    rows = _page_rows(block_ids, num_kv_heads, block_step, head_step).reshape(-1)
    kv_q, scale_bytes = _int8_sections(torch.index_select(pages, 0, rows), block_size)
    # Reorder as int8 first, then convert contiguously: a converting copy from the
    # strided view is ~2.5x slower than the two passes.
    kv = kv_q.transpose(0, 1).contiguous().to(dtype)  # [2, n, BS, D]
    n_req, nblk = block_ids.shape
    scales = scale_bytes.view(torch.float32).permute(2, 0, 1)  # [2, n, BS]
    k, v = kv.view(2, num_kv_heads * n_req, nblk * block_size, -1).unbind(0)
    return k, v, scales.reshape(2, num_kv_heads * n_req, nblk * block_size)


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
    pages, block_step, head_step = _half_pages(kv_cache)
    valid, k_rows, offsets = _slot_index(slot_mapping, num_kv_heads, block_size,
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


def _gather_kv_fp8(kv_cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype,
                   k_scale: float, v_scale: float):
    """Blocks ``[R, nblk]`` of a float8 cache -> K, V as ``dtype`` (exact: every
    float8 value is a bf16/fp16 value) and the per-layer scales, broadcast as
    ``_attend``'s per-key scales ``[2, Hkv * R, nblk * BS]``."""
    k, v, _ = _gather_kv(kv_cache, block_ids)
    scales = torch.tensor((k_scale, v_scale), dtype=torch.float32, device=k.device)
    return k.to(dtype), v.to(dtype), scales.view(2, 1, 1).expand(2, *k.shape[:2])


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
    pages, block_step, head_step = _page_table(kv_cache)
    valid, rows, offsets = _slot_index(slot_mapping, num_kv_heads, block_size,
                                       block_step, head_step)
    n = slot_mapping.shape[0]
    k_q, k_s = _quantize(key[:n][valid], k_scale)
    v_q, v_s = _quantize(value[:n][valid], v_scale)
    kv, scale_bytes = _int8_sections(pages, block_size)
    kv[rows, 0, offsets] = k_q
    kv[rows, 1, offsets] = v_q
    scale_bytes[rows, offsets] = torch.stack((k_s, v_s), dim=-1).view(torch.int8)


def _attend(q, k, v, valid, scale, kv_scales=None):
    """softmax(q k^T * scale, masked by ``valid``) v for batched ``[N, M, D]`` q.

    ``valid`` broadcasts against the ``[N, M, S]`` scores. Keys outside ``valid``
    get probability 0; an all-masked row gives 0 rather than NaN. ``kv_scales``
    ``[2, N, S]`` (INT8 cache): per-key dequantization scales of K and V, applied
    to the scores and the probabilities -- the same sums as scaling K and V.
    """
    scores = torch.bmm(q, k.transpose(1, 2)).float().mul_(scale)
    if kv_scales is not None:
        scores.mul_(kv_scales[0][:, None, :])
    scores.masked_fill_(~valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    if kv_scales is not None:
        probs.mul_(kv_scales[1][:, None, :])
    return torch.bmm(probs.to(v.dtype), v)


def _decode(query, kv_cache, block_table, seq_lens, scale, gather):
    """Batched decode attention; ``gather(kv_cache, block_ids)`` reads the K/V.

    Every request is padded to the longest one's blocks; keys past its
    ``seq_len`` are masked. Query head ``h`` reads KV head ``h // (H // Hkv)``.
    A request with ``seq_len == 0`` (padded batch slot) returns zeros.
    """
    b, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    nblk = -(-int(seq_lens.max()) // block_size)
    length = nblk * block_size
    k, v, kv_scales = gather(kv_cache, block_table[:, :nblk])  # [Hkv*B, L, D]
    q = query.view(b, hkv, h // hkv, d).transpose(0, 1).reshape(hkv * b, h // hkv, d)
    valid = torch.arange(length, device=query.device) < seq_lens[:, None]  # [B, L]
    valid = valid.repeat(hkv, 1)[:, None, :]  # [Hkv*B, 1, L]
    out = _attend(q.to(k.dtype), k, v, valid, scale, kv_scales)  # [Hkv*B, G, D]
    return out.view(hkv, b, h // hkv, d).transpose(0, 1).reshape(b, h, d).to(query.dtype)


def _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather):
    """Causal attention per request; ``gather(kv_cache, block_ids)`` reads the K/V.

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
        k, v, kv_scales = gather(kv_cache, block_table[i : i + 1, : -(-seq_len // block_size)])
        k, v = k[:, :seq_len], v[:, :seq_len]  # [Hkv, S, D]
        key_pos = torch.arange(seq_len, device=query.device)
        context = seq_len - (end - start)
        for c0 in range(start, end, PREFILL_QUERY_CHUNK):
            c1 = min(c0 + PREFILL_QUERY_CHUNK, end)
            q = query[c0:c1].view(c1 - c0, hkv, group, d).permute(1, 2, 0, 3)
            q = q.reshape(hkv, group * (c1 - c0), d).to(k.dtype)  # rows: (g, token)
            key_end = c1 - start + context  # keys after the chunk's last query: all masked
            q_pos = torch.arange(c0 - start + context, key_end, device=query.device)
            valid = (key_pos[None, :key_end] <= q_pos[:, None]).repeat(group, 1)[None]
            o = _attend(q, k[:, :key_end], v[:, :key_end], valid, scale,
                        None if kv_scales is None else kv_scales[..., :key_end])
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
) -> torch.Tensor:
    """One query token per request ``[B, H, D]``, batched over all requests (see ``_decode``)."""
    return _decode(query, kv_cache, block_table, seq_lens, scale, _gather_kv)


@register_kernel("paged_prefill", FAST)
def paged_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for the newest ``q_len`` tokens of each request ``[T, H, D]``."""
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                    _gather_kv)


@register_kernel("paged_decode_int8", FAST)
def paged_decode_int8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_decode`` over an INT8 cache; K/V dequantized to the query's dtype."""
    gather = functools.partial(_gather_kv_int8, dtype=query.dtype)
    return _decode(query, kv_cache, block_table, seq_lens, scale, gather)


@register_kernel("paged_prefill_int8", FAST)
def paged_prefill_int8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``paged_prefill`` over an INT8 cache; K/V dequantized to the query's dtype."""
    gather = functools.partial(_gather_kv_int8, dtype=query.dtype)
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather)


@register_kernel("paged_decode_fp8", FAST)
def paged_decode_fp8(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """``paged_decode`` over a float8 cache (a float8 view) with per-layer scales."""
    gather = functools.partial(_gather_kv_fp8, dtype=query.dtype, k_scale=k_scale,
                               v_scale=v_scale)
    return _decode(query, kv_cache, block_table, seq_lens, scale, gather)


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
) -> torch.Tensor:
    """``paged_prefill`` over a float8 cache (a float8 view) with per-layer scales."""
    gather = functools.partial(_gather_kv_fp8, dtype=query.dtype, k_scale=k_scale,
                               v_scale=v_scale)
    return _prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale, gather)
