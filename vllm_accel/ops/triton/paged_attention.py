"""Paged attention in Triton over this project's KV-cache pages (torch + triton only).

Cache of one layer: logical ``[num_blocks, num_kv_heads, block_size, width]``, each
(block, head) page contiguous, pages in any order (the strides say where).
bf16/fp16/fp32 page: K ``[BS, D]`` then V ``[BS, D]``. INT8 page (bytes): K int8
``[BS, D]``, V int8 ``[BS, D]``, then float32 ``[BS, 2]`` = (k_scale, v_scale) per
token, whichever mode (dynamic or static scales) wrote it.

One program attends one KV head's query rows -- all ``G = H / Hkv`` query heads that
share it, for ``BLOCK_Q`` tokens -- so K and V are read once per group (GQA/MQA).
Keys are streamed in tiles of ``TILE_N`` tokens that may span pages (the block table
is read per key), with an online softmax in float32. INT8 codes enter the dot
products as exact integers in the query's dtype; their scales multiply the scores
(K) and the probabilities (V), the same sums as dequantizing every element.

INT8 decode with a 16-bit query goes further, because converting every code to a
float costs more issue slots than reading it (59% of an H100's copy bandwidth):
each query row is quantized to int8 (symmetric, one scale per head) and Q.K^T runs
as an int8 tensor-core dot with int32 sums; V's codes become fp16 for P.V, each row
of probabilities x ``v_scale`` divided by its largest entry (so it lies in [0, 1],
and a small V cannot underflow fp16) and the product multiplied back. The query
rounding adds about as much logit error as K's own (both <= max|x| / 254 per
element); an fp32 query and prefill keep the exact-integer path.

Decode splits long contexts into partitions of ``PARTITION`` keys run by separate
programs (more programs than SMs at small batch) and merges their partial softmax
states in a second kernel.
"""

import torch
import triton
import triton.language as tl

def interpreted(kernel) -> bool:
    """Whether ``kernel`` runs in Triton's interpreter (``TRITON_INTERPRET=1`` when
    it was defined), which computes bf16 dot products wrong."""
    return type(kernel).__name__ == "InterpretedFunction"


#: keys per decode partition (one program each); a multiple of the tiles
PARTITION = 1024
#: key tokens per inner step (bf16 and INT8 pages; tuned on an H100)
TILE_N = 128
TILE_N_INT8 = 128
#: keys per INT8 decode partition (int8 Q.K^T: fewer, longer programs win)
PARTITION_INT8 = 2048
#: warps and pipeline stages per decode program (bf16 / INT8 pages)
DECODE_WARPS = 4
DECODE_WARPS_INT8 = 4
DECODE_STAGES = 3
#: query rows per prefill program (tokens x padded query heads of one KV head)
PREFILL_ROWS = 64
#: the window the kernels get for "none": longer than any context
NO_WINDOW = 2**30


@triton.jit
def _int8_to_float(code):
    """int8 codes as exact float32: ``code + 128`` written into the mantissa of
    2**23 (an OR instead of a slow int-to-float conversion), minus ``2**23 + 128``."""
    return ((code.to(tl.int32) + 128) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0


@triton.jit
def _tanh(x):
    """tanh from one exp (no tanh in tl): exact limits +-1 for large |x|."""
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_row_ptr, stride_blk, head_off, j, key_ok,
                 key_first, key_limit, scale, soft_cap, slopes,
                 HEAD: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                 INT8: tl.constexpr, IEEE: tl.constexpr, QK_INT8: tl.constexpr,
                 SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr):
    """One key tile: ``j`` key positions ``[TILE_N]``, ``key_ok`` their validity,
    ``key_first`` / ``key_limit`` ``[M, 1]`` the first (sliding window) and last
    (causal: the query's position) key each row may see. ``QK_INT8``: ``q`` holds
    int8 codes and ``scale`` ``[M, 1]`` folds in their scales. The features
    (``reference/attention.py``): ``SOFT_CAP`` caps the logits at ``soft_cap``;
    ``ALIBI`` adds ``slopes`` ``[M]`` times the distance ``j - key_limit``."""
    d = tl.arange(0, D_PAD)
    blk = tl.load(bt_row_ptr + j // BS, mask=key_ok, other=0).to(tl.int64)
    page = blk * stride_blk + head_off
    k_off = page[:, None] + (j % BS)[:, None] * HEAD + d[None, :]
    kv_mask = key_ok[:, None] & (d < HEAD)[None, :]
    k = tl.load(cache_ptr + k_off, mask=kv_mask, other=0.0)
    v = tl.load(cache_ptr + k_off + BS * HEAD, mask=kv_mask, other=0.0)
    if INT8:
        scale_ptr = (cache_ptr + page + 2 * BS * HEAD + (j % BS) * 8).to(
            tl.pointer_type(tl.float32))
        k_scale = tl.load(scale_ptr, mask=key_ok, other=0.0)
        v_scale = tl.load(scale_ptr + 1, mask=key_ok, other=0.0)
    if QK_INT8:
        v = v.to(tl.float16)
        s = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
    else:
        if INT8:
            k = _int8_to_float(k)
            v = _int8_to_float(v)
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
    s = s * scale
    if INT8:
        s = s * k_scale[None, :]
    if SOFT_CAP:
        s = soft_cap * _tanh(s / soft_cap)
    if ALIBI:
        s += slopes[:, None] * (j[None, :] - key_limit).to(tl.float32)
    s = tl.where(key_ok[None, :] & (j[None, :] <= key_limit) & (j[None, :] >= key_first), s,
                 float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QK_INT8:  # fp16 P.V: each row of p x v_scale over its largest entry, in [0, 1]
        p = p * v_scale[None, :]
        top = tl.max(p, 1)
        top = tl.where(top > 0.0, top, 1.0)
        p = p * (1.0 / top)[:, None]
        return acc * alpha[:, None] + tl.dot(p.to(tl.float16), v) * top[:, None], m_new, l_i
    if INT8:
        p = p * v_scale[None, :]
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _finish(acc, m_i, l_i, sinks):
    """The normalised output of a softmax state, with the rows' sink logits (or
    ``-inf``: none) in the denominator."""
    m = tl.maximum(m_i, sinks)
    m = tl.where(m == float("-inf"), 0.0, m)
    alpha = tl.exp(m_i - m)
    total = l_i * alpha + tl.exp(sinks - m)
    return acc * (alpha / tl.where(total == 0.0, 1.0, total))[:, None]


@triton.jit
def _decode_kernel(q_ptr, cache_ptr, bt_ptr, seq_lens_ptr, out_ptr, part_ptr, stats_ptr,
                   scale, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
                   stride_blk, stride_head, num_heads, window, soft_cap, slopes_ptr, sinks_ptr,
                   GROUP: tl.constexpr, M: tl.constexpr, HEAD: tl.constexpr,
                   D_PAD: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr,
                   PART: tl.constexpr, NUM_PARTS: tl.constexpr, INT8: tl.constexpr,
                   IEEE: tl.constexpr, UPCAST: tl.constexpr, QK_INT8: tl.constexpr,
                   SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, SINKS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    rows = tl.arange(0, M)
    d = tl.arange(0, D_PAD)
    row_ok = rows < GROUP
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d < HEAD)[None, :], other=0.0)
    if QK_INT8:  # symmetric int8 per query head; its scale joins the softmax scale
        qf = q.to(tl.float32)
        q_scale = tl.max(tl.abs(qf), 1) / 127.0
        q_scale = tl.where(q_scale > 0.0, q_scale, 1.0)
        qf = qf / q_scale[:, None]
        q = tl.where(qf >= 0.0, qf + 0.5, qf - 0.5).to(tl.int8)
        scale = scale * q_scale[:, None]
    elif UPCAST:  # Triton's interpreter has no bf16 dot
        q = q.to(tl.float32)
    elif INT8 == 0:
        q = q.to(cache_ptr.dtype.element_ty)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_PAD], tl.float32)
    # keys [first, seq_len): the window's (blocks before it may be freed), then this
    # partition's share of them; the partitions start at the window's partition, so
    # a long context launches only those the window spans
    first = tl.maximum(seq_len - window, 0)
    base = first // PART * PART + part * PART
    start = tl.maximum(base, first)
    end = tl.minimum(seq_len, base + PART)
    limit = tl.full([M, 1], 1, tl.int32) * (seq_len - 1)
    slopes = tl.load(slopes_ptr + heads, mask=row_ok, other=0.0) if ALIBI else 0.0
    head_off = kvh.to(tl.int64) * stride_head
    for j0 in range(start, end, TILE):
        j = j0 + tl.arange(0, TILE)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_ptr + b * stride_bt,
                                     stride_blk, head_off, j, j < end, first, limit, scale,
                                     soft_cap, slopes, HEAD, D_PAD, BS, INT8, IEEE, QK_INT8,
                                     SOFT_CAP, ALIBI)
    if NUM_PARTS == 1:
        if SINKS:
            o = _finish(acc, m_i, l_i, tl.load(sinks_ptr + heads, mask=row_ok, other=0.0))
        else:
            o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD)[None, :])
    else:  # partial state of (b, head, part): acc [D], then (m, l)
        idx = (b * num_heads + heads) * NUM_PARTS + part
        tl.store(part_ptr + idx[:, None] * D_PAD + d[None, :], acc, mask=row_ok[:, None])
        tl.store(stats_ptr + idx * 2, m_i, mask=row_ok)
        tl.store(stats_ptr + idx * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_kernel(part_ptr, stats_ptr, out_ptr, stride_ob, stride_oh, num_heads, sinks_ptr,
                  HEAD: tl.constexpr, D_PAD: tl.constexpr, NUM_PARTS: tl.constexpr,
                  P_PAD: tl.constexpr, SINKS: tl.constexpr):
    """Combine the partitions' softmax states of one (request, head), with the
    head's sink logit in the denominator (``SINKS``)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    idx = (b * num_heads + h) * NUM_PARTS + p
    p_ok = p < NUM_PARTS
    m = tl.load(stats_ptr + idx * 2, mask=p_ok, other=float("-inf"))
    l = tl.load(stats_ptr + idx * 2 + 1, mask=p_ok, other=0.0)
    sink = tl.load(sinks_ptr + h) if SINKS else float("-inf")
    m_max = tl.maximum(tl.max(m, 0), sink)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_max)
    acc = tl.load(part_ptr + idx[:, None] * D_PAD + d[None, :], mask=p_ok[:, None], other=0.0)
    total = tl.sum(l * w, 0) + tl.exp(sink - m_max)
    o = tl.sum(acc * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD)


@triton.jit
def _prefill_kernel(q_ptr, cache_ptr, bt_ptr, qsl_ptr, seq_lens_ptr, tile_req_ptr,
                    tile_tok_ptr, out_ptr, scale, stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_bt, stride_blk, stride_head, window, soft_cap, slopes_ptr,
                    sinks_ptr, GROUP: tl.constexpr, G_PAD: tl.constexpr, M: tl.constexpr,
                    HEAD: tl.constexpr, D_PAD: tl.constexpr, BS: tl.constexpr,
                    TILE: tl.constexpr, INT8: tl.constexpr, IEEE: tl.constexpr,
                    UPCAST: tl.constexpr, SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr,
                    SINKS: tl.constexpr):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(tile_req_ptr + tile)
    tok0 = tl.load(tile_tok_ptr + tile)
    q_start = tl.load(qsl_ptr + req)
    q_len = tl.load(qsl_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len
    rows = tl.arange(0, M)
    tok = tok0 + rows // G_PAD
    g = rows % G_PAD
    row_ok = (tok < q_len) & (g < GROUP)
    d = tl.arange(0, D_PAD)
    heads = kvh * GROUP + g
    io_mask = row_ok[:, None] & (d < HEAD)[None, :]
    q = tl.load(q_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_qt
                + heads[:, None] * stride_qh + d[None, :], mask=io_mask, other=0.0)
    if UPCAST:  # Triton's interpreter has no bf16 dot
        q = q.to(tl.float32)
    elif INT8 == 0:
        q = q.to(cache_ptr.dtype.element_ty)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D_PAD], tl.float32)
    limit = tl.where(row_ok, context + tok, -1)[:, None]  # causal: key <= query position
    end = tl.minimum(seq_len, context + tok0 + M // G_PAD)
    # the window: keys from position - window + 1 (the tile's first row's, for the loop)
    first = limit - window + 1
    start = tl.maximum(context + tok0 - window + 1, 0)
    slopes = tl.load(slopes_ptr + heads, mask=row_ok, other=0.0) if ALIBI else 0.0
    head_off = kvh.to(tl.int64) * stride_head
    for j0 in range(start, end, TILE):
        j = j0 + tl.arange(0, TILE)
        acc, m_i, l_i = _attend_tile(q, acc, m_i, l_i, cache_ptr, bt_ptr + req * stride_bt,
                                     stride_blk, head_off, j, j < end, first, limit, scale,
                                     soft_cap, slopes, HEAD, D_PAD, BS, INT8, IEEE, False,
                                     SOFT_CAP, ALIBI)
    if SINKS:
        o = _finish(acc, m_i, l_i, tl.load(sinks_ptr + heads, mask=row_ok, other=0.0))
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + (q_start + tok)[:, None].to(tl.int64) * stride_ot
             + heads[:, None] * stride_oh + d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=io_mask)


def _cache_geometry(kv_cache: torch.Tensor, int8: bool) -> tuple[int, int, int]:
    """(block stride, head stride, head size) of a cache whose pages are contiguous."""
    _, _, block_size, width = kv_cache.shape
    stride_blk, stride_head, stride_tok, stride_elem = kv_cache.stride()
    page = block_size * width
    if (stride_elem, stride_tok) != (1, width) or stride_blk % page or stride_head % page:
        raise ValueError(f"KV cache pages are not contiguous (strides {kv_cache.stride()})")
    head_size = (width - 8) // 2 if int8 else width // 2
    return stride_blk, stride_head, head_size


def _common(query: torch.Tensor, kv_cache: torch.Tensor):
    int8 = kv_cache.dtype == torch.int8
    stride_blk, stride_head, head_size = _cache_geometry(kv_cache, int8)
    if query.stride(-1) != 1:
        query = query.contiguous()
    group = query.shape[1] // kv_cache.shape[1]
    dot_dtype = query.dtype if int8 else kv_cache.dtype
    # Triton's CPU interpreter computes bf16 dot products wrong: upcast there.
    upcast = dot_dtype == torch.bfloat16 and interpreted(_decode_kernel)
    ieee = dot_dtype == torch.float32 or upcast
    return query, int8, stride_blk, stride_head, head_size, group, ieee, upcast


def _features(query: torch.Tensor, sliding_window=None, logits_soft_cap=None,
              alibi_slopes=None, sinks=None) -> tuple[dict, dict]:
    """The kernels' feature arguments and their constexpr switches."""
    def per_head(t):  # float32 [H] on the query's device, or a dummy pointer
        if t is None:
            return query
        return torch.as_tensor(t).to(query.device, torch.float32).contiguous()

    args = {"window": int(sliding_window or NO_WINDOW), "soft_cap": float(logits_soft_cap or 0.0),
            "slopes_ptr": per_head(alibi_slopes), "sinks_ptr": per_head(sinks)}
    switches = {"SOFT_CAP": bool(logits_soft_cap), "ALIBI": alibi_slopes is not None,
                "SINKS": sinks is not None}
    return args, switches


def paged_decode(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, **features) -> torch.Tensor:
    """One query token per request ``[B, H, D]`` over its ``seq_len`` cached keys
    (``seq_len`` 0: a padded slot, zeros). Same contract as ``torch_fast``, features
    included (``reference/attention.py``)."""
    query, int8, s_blk, s_head, d, group, ieee, upcast = _common(query, kv_cache)
    args, switches = _features(query, **features)
    b, h, _ = query.shape
    out = torch.empty(b, h, d, dtype=query.dtype, device=query.device)
    if b == 0:
        return out
    max_keys = block_table.shape[1] * kv_cache.shape[2]
    qk_int8 = int8 and query.dtype != torch.float32
    partition = PARTITION_INT8 if qk_int8 else PARTITION
    # a window spans at most window + partition - 1 keys of whole partitions
    spanned = min(max_keys, args["window"] + partition - 1)
    num_parts = triton.cdiv(spanned, partition)
    d_pad = max(16, triton.next_power_of_2(d))
    m = max(16, triton.next_power_of_2(group))
    if num_parts > 1:
        part = torch.empty(b * h * num_parts, d_pad, dtype=torch.float32, device=query.device)
        stats = torch.empty(b * h * num_parts, 2, dtype=torch.float32, device=query.device)
    else:
        part = stats = out
    _decode_kernel[(b, kv_cache.shape[1], num_parts)](
        query, kv_cache, block_table, seq_lens, out, part, stats, float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        s_blk, s_head, h, **args, GROUP=group, M=m, HEAD=d, D_PAD=d_pad, BS=kv_cache.shape[2],
        TILE=TILE_N_INT8 if int8 else TILE_N, PART=partition, NUM_PARTS=num_parts, INT8=int8,
        IEEE=ieee, UPCAST=upcast, QK_INT8=qk_int8, **switches,
        num_warps=DECODE_WARPS_INT8 if int8 else DECODE_WARPS, num_stages=DECODE_STAGES)
    if num_parts > 1:
        _merge_kernel[(b, h)](part, stats, out, out.stride(0), out.stride(1), h,
                              args["sinks_ptr"], HEAD=d, D_PAD=d_pad, NUM_PARTS=num_parts,
                              P_PAD=triton.next_power_of_2(num_parts), SINKS=switches["SINKS"])
    return out


def paged_prefill(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  scale: float, **features) -> torch.Tensor:
    """Causal attention of each request's newest ``q_len`` tokens ``[T, H, D]`` over
    its cache (chunked prefill, prefix caching); rows past the last request: zeros.
    ``query_start_loc`` may live on the host (vLLM's ``query_start_loc_cpu``): the
    tile plan is built from it without a device sync."""
    query, int8, s_blk, s_head, d, group, ieee, upcast = _common(query, kv_cache)
    args, switches = _features(query, **features)
    t, h, _ = query.shape
    out = torch.empty(t, h, d, dtype=query.dtype, device=query.device)
    qsl_host = query_start_loc.cpu()
    total = int(qsl_host[-1])
    out[total:] = 0
    g_pad = triton.next_power_of_2(group)
    m = max(PREFILL_ROWS, g_pad)
    tokens_per_tile = m // g_pad
    q_lens = (qsl_host[1:] - qsl_host[:-1]).long()
    tiles = (q_lens + tokens_per_tile - 1) // tokens_per_tile
    if int(tiles.sum()) == 0:
        return out
    tile_req = torch.repeat_interleave(torch.arange(len(q_lens)), tiles)
    first = torch.cumsum(tiles, 0) - tiles
    tile_tok = (torch.arange(len(tile_req)) - first[tile_req]) * tokens_per_tile
    dev = query.device
    tile_req = tile_req.to(torch.int32).to(dev)
    tile_tok = tile_tok.to(torch.int32).to(dev)
    qsl = query_start_loc.to(dev, torch.int32)
    _prefill_kernel[(tile_req.shape[0], kv_cache.shape[1])](
        query, kv_cache, block_table, qsl, seq_lens, tile_req, tile_tok, out, float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        s_blk, s_head, **args, GROUP=group, G_PAD=g_pad, M=m, HEAD=d,
        D_PAD=max(16, triton.next_power_of_2(d)), BS=kv_cache.shape[2], TILE=TILE_N,
        INT8=int8, IEEE=ieee, UPCAST=upcast, **switches)
    return out
