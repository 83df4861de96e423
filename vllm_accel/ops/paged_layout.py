"""The paged KV-cache layout every attention provider reads and writes.

KV cache of one layer: logical ``[num_blocks, num_kv_heads, block_size, width]``
(what vLLM hands the backend), each (block, head) page contiguous, pages in
block-major (``LBHNC``) or head-major (``LHBNC``) order. ``page_table`` views the
cache storage as a table of equal rows (whole pages or fixed parts of them), so
gathering a batch's pages is one ``index_select`` of whole rows -- a contiguous 2-D
source, the fast path (advanced indexing and strided sources are much slower).

bf16/fp32 cache (``width = 2 * head_size``): a page holds the block's K rows first,
then its V rows, i.e. two contiguous "half pages" ``[block_size, head_size]``.

INT8 cache (``width = 2 * head_size + 8``, dtype int8), page bytes:
``[0, BS*D)`` K int8 ``[BS, D]``; ``[BS*D, 2*BS*D)`` V int8 ``[BS, D]``;
``[2*BS*D, 2*BS*D + 8*BS)`` float32 ``[BS, 2]`` = (k_scale, v_scale) per token.
Quantization is symmetric per (token, head): ``x ~= q * scale``, ``|q| <= 127``.

float8 cache: the bf16 layout in a float8 view, scaled by the layer's
``k_scale``/``v_scale``.

A token's slot is ``block_id * block_size + offset``; block tables list physical
block ids in position order (not necessarily contiguous or sorted).
"""

import torch

#: bytes per token for the INT8 cache's float32 (k_scale, v_scale) pair
INT8_SCALE_BYTES = 8
#: floor for dynamic INT8 scales, so an all-zero (token, head) row quantizes to 0
INT8_MIN_SCALE = 1e-8
#: vLLM's fp8 KV cache dtypes -> the float8 format the cache stores (vLLM's
#: CPU and CUDA paths read plain "fp8" as e4m3)
FP8_KV_FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                  "fp8_e5m2": torch.float8_e5m2}


def page_table(kv_cache: torch.Tensor, parts: int = 1) -> tuple[torch.Tensor, int, int]:
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


def half_pages(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """bf16/fp32 cache -> (half pages ``[R, BS, D]``, block step, head step).

    The K half page of (block b, head h) is row ``b * block_step + h * head_step``;
    its V half page is the next row.
    """
    rows, block_step, head_step = page_table(kv_cache, parts=2)
    block_size, width = kv_cache.shape[2:]
    return rows.unflatten(1, (block_size, width // 2)), block_step, head_step


def page_rows(block_ids: torch.Tensor, num_kv_heads: int, block_step: int, head_step: int):
    """First page-table rows ``[Hkv, n]`` of blocks ``[n]`` for every KV head."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)
    return heads[:, None] * head_step + block_ids.reshape(1, -1).long() * block_step


def gather_request_pages(kv_cache: torch.Tensor, block_table: torch.Tensor,
                         lens: torch.Tensor, num_blocks: int):
    """The blocks each request reads (its first ``ceil(len / bs)`` table columns, never
    the stale ones after) -> K and V pages ``[n, Hkv, BS, D]`` (contiguous, n the blocks
    read) and a compact table ``[B, num_blocks]`` over them (0 past a request's own)."""
    _, num_kv_heads, block_size, width = kv_cache.shape
    ids, compact = request_blocks(block_table, lens, block_size, num_blocks)
    pages, block_step, head_step = half_pages(kv_cache)
    k_rows = page_rows(ids, num_kv_heads, block_step, head_step).t()  # [n, Hkv]
    kv = torch.index_select(pages, 0, torch.stack((k_rows, k_rows + 1)).reshape(-1))
    k, v = kv.view(2, ids.numel(), num_kv_heads, block_size, width // 2).unbind(0)
    return k, v, compact


def request_blocks(block_table: torch.Tensor, lens: torch.Tensor, block_size: int,
                   num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The block ids each request reads (its first ``ceil(len / block_size)`` table
    columns), request after request ``[n]``, and a compact int32 table ``[B,
    num_blocks]`` numbering them 0..n-1 (0 past a request's own)."""
    counts = (lens.long() + block_size - 1) // block_size
    cols = torch.arange(num_blocks, device=lens.device)
    valid = cols[None, :] < counts[:, None]
    ids = block_table[:, :num_blocks][valid.to(block_table.device)]
    compact = torch.where(valid, (counts.cumsum(0) - counts)[:, None] + cols[None, :], 0)
    return ids, compact.to(torch.int32)


def new_token_slots(compact: torch.Tensor, seq_lens: torch.Tensor, q_lens: torch.Tensor,
                    block_size: int) -> torch.Tensor:
    """The slots of each request's newest ``q_len`` tokens (host ``q_lens``/``seq_lens``)
    in pages gathered by :func:`gather_request_pages` (its ``compact`` table), request
    after request: int32 ``[sum(q_lens)]``, ``block * block_size + offset``."""
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    first = (seq_lens - q_lens).repeat_interleave(q_lens)
    pos = first + torch.arange(len(req)) - (q_lens.cumsum(0) - q_lens).repeat_interleave(q_lens)
    blocks = compact.cpu()[req, pos // block_size].long()
    return (blocks * block_size + pos % block_size).to(torch.int32)


def slot_index(slot_mapping: torch.Tensor, num_kv_heads: int, block_size: int,
                block_step: int, head_step: int):
    """Slots ``[n]`` -> (valid mask ``[n]``, page rows ``[T, Hkv]``, offsets ``[T, 1]``).

    ``T`` counts the valid (``>= 0``) slots; padding slots are dropped here so the
    writers never touch them.
    """
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    blocks, offsets = slots // block_size, slots % block_size
    rows = page_rows(blocks, num_kv_heads, block_step, head_step).T
    return valid, rows, offsets[:, None]


def int8_sections(pages: torch.Tensor, block_size: int):
    """Int8 pages ``[n, page]`` -> views K+V ``[n, 2, BS, D]``, scale bytes ``[n, BS, 8]``."""
    head_size = (pages.shape[1] // block_size - INT8_SCALE_BYTES) // 2
    kv_bytes = 2 * block_size * head_size
    kv = pages[:, :kv_bytes].unflatten(1, (2, block_size, head_size))
    scales = pages[:, kv_bytes:].unflatten(1, (block_size, INT8_SCALE_BYTES))
    return kv, scales
