"""The ``reference`` provider of multi-head latent attention (MLA: DeepSeek-V2/V3,
Kimi, MiniCPM3), written for obviousness: the oracle the other providers are held to.

The latent cache of one layer is vLLM's ``[num_blocks, block_size, L + R]``: per token
the compressed KV ``c`` (``kv_lora_rank`` L values) then the rotated key part ``k_pe``
(R values), shared by every head. Decode runs with the weights absorbed (vLLM's
``MLAAttention`` multiplies the query's no-rope part by ``W_UK`` first): query head
``h`` is ``(q_nope[h] [L], q_pe[h] [R])``, its logits ``q_nope . c + q_pe . k_pe``
times ``scale``, its output ``softmax . c`` (``[L]``, which vLLM then multiplies by
``W_UV``). Prefill decompresses the cached latents instead (``mla_gather``).
``mla_latent_attention`` is a whole layer's attention from its latents (the query
up-projection and RoPE included), the contract of cards whose MLA kernel takes the
layer (``mla_layer.py``).

The INT8 latent cache (``--kv-cache-dtype int8``, the ``_int8`` kernels) stores per token
``c`` and ``k_pe`` as int8 codes, then two float32 scales, one for each part (vLLM's
per-token-head layout for MLA: ``L + R`` bytes, then 8): symmetric, ``max|x| / 127``,
rounded as the INT8 KV writers round (``reference/cache_write.py``).

The fp8 latent cache (``--kv-cache-dtype fp8`` / ``fp8_e4m3``, the ``_fp8`` kernels)
stores each row as float8 e4m3 of ``x / kv_scale`` (the layer's per-tensor ``k_scale``,
1 unless the checkpoint gives one), saturated at e4m3's largest value: vLLM's MLA
layer views the cache in its fp8 dtype. ``kv_scale`` is a float or a one-element
tensor (so a card never synchronises to read it).
"""

import torch

from vllm_accel.ops.reference.cache_write import _quantize
from vllm_accel.ops.reference.elementwise import rotate
from vllm_accel.ops.registry import register_kernel

#: an INT8 latent row's bytes after its codes: the float32 scales of c and of k_pe
LATENT_SCALE_BYTES = 8


def latent_rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as ``[num_blocks * block_size, L + R]`` rows (a view)."""
    return kv_cache.reshape(-1, kv_cache.shape[-1])


def request_slots(block_ids: torch.Tensor, block_size: int, seq_len: int) -> torch.Tensor:
    """The cache rows of a request's first ``seq_len`` tokens."""
    pos = torch.arange(seq_len, device=block_ids.device)
    return block_ids[pos // block_size].long() * block_size + pos % block_size


@register_kernel("mla_cache_write")
def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """Row ``slot_mapping[i]`` of the cache <- ``(kv_c[i], k_pe[i])`` for every
    ``slot >= 0`` (``kv_c`` ``[T, L]``, ``k_pe`` ``[T, R]``)."""
    rows = latent_rows(kv_cache)
    lora = kv_c.shape[-1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            rows[slot, :lora] = kv_c[i]
            rows[slot, lora:] = k_pe[i]


def decode_rows(q_nope: torch.Tensor, q_pe: torch.Tensor, block_table: torch.Tensor,
                seq_lens: torch.Tensor, scale: float, block_size: int,
                read_rows) -> torch.Tensor:
    """Absorbed decode, one request at a time in float64; ``read_rows(slots)`` gives
    those cache rows as float64 ``[len(slots), L + R]``."""
    b, n, lora = q_nope.shape
    out = q_nope.new_zeros(b, n, lora)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        latent = read_rows(request_slots(block_table[i], block_size, seq_len))
        c, k_pe = latent[:, :lora], latent[:, lora:]
        scores = (q_nope[i].double() @ c.T + q_pe[i].double() @ k_pe.T) * scale  # [N, S]
        out[i] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return out


@register_kernel("mla_decode")
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed decode: ``q_nope`` ``[B, N, L]``, ``q_pe`` ``[B, N, R]`` over each request's
    ``seq_len`` cached latents; returns ``[B, N, L]`` (zeros for ``seq_len`` 0)."""
    rows = latent_rows(kv_cache)
    return decode_rows(q_nope, q_pe, block_table, seq_lens, scale, kv_cache.shape[1],
                       lambda slots: rows[slots].double())


@register_kernel("mla_gather")
def mla_gather(kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: list[int]) -> torch.Tensor:
    """Every request's first ``seq_len`` cached latents, packed: ``[sum(seq_lens), L + R]``
    (request ``i``'s block ids in ``block_table[i]``)."""
    rows = latent_rows(kv_cache)
    return torch.cat([rows[request_slots(block_table[i], kv_cache.shape[1], s)]
                      for i, s in enumerate(seq_lens)])


@register_kernel("mla_latent_attention")
def mla_latent_attention(q_c: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, w_uq: torch.Tensor,
                         w_ukv: torch.Tensor, kv_cache: torch.Tensor,
                         block_table: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                         qk_nope_head_dim: int, v_head_dim: int, scale: float) -> torch.Tensor:
    """An MLA layer's attention from its latents, for cards whose kernel takes the whole
    layer (Sophgo's ``paged_latent_attention``): the new tokens' ``kv_c_normed``
    ``[T, L]`` and rotated ``k_pe`` ``[T, R]`` written at ``slot_mapping``; queries
    ``q_c @ w_uq.T`` (``q_c`` the latent query ``[T, Lq]``, or the hidden states of a
    model without q-LoRA; ``w_uq`` ``[H * (P + R), Lq]``), their last ``R`` per head
    rotated; keys and values decompressed from each request's cached latents by
    ``w_ukv`` ``[H * (P + V), L]``; causal over context + new tokens. ``cos``/``sin``
    ``[T, R/2]`` at the tokens' positions (DeepSeek's interleaved RoPE). Returns
    ``[T, H, V]`` in ``q_c``'s dtype; float64 inside."""
    t, heads, nope, lora = q_c.shape[0], num_heads, qk_nope_head_dim, kv_c_normed.shape[-1]
    rope = k_pe.shape[-1]
    # DeepSeek's RoPE: interleaved pairs (vLLM's is_neox_style=False)
    k_rot = rotate(k_pe.double(), cos.double(), sin.double(), t, rope, rope, False)
    mla_cache_write(kv_c_normed, k_rot.to(kv_cache.dtype), kv_cache, slot_mapping)
    q = (q_c.double() @ w_uq.double().T).view(t, heads, nope + rope)
    q_nope = q[..., :nope]
    q_pe = rotate(q[..., nope:], cos.double(), sin.double(), t, rope, rope, False)
    w = w_ukv.double().view(heads, nope + v_head_dim, lora)
    rows = latent_rows(kv_cache)
    out = q.new_zeros(t, heads, v_head_dim)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        first, last = starts[i], starts[i + 1]
        if last == first:
            continue
        latent = rows[request_slots(block_table[i], kv_cache.shape[1], seq_len)].double()
        c, k_pe_cached = latent[:, :lora], latent[:, lora:]
        k_nope = torch.einsum("sl,hpl->hsp", c, w[:, :nope])
        v = torch.einsum("sl,hvl->hsv", c, w[:, nope:])
        scores = (torch.einsum("qhp,hsp->hqs", q_nope[first:last], k_nope)
                  + torch.einsum("qhr,sr->hqs", q_pe[first:last], k_pe_cached)) * scale
        context = seq_len - (last - first)
        query_pos = context + torch.arange(last - first, device=scores.device)[:, None]
        keys = torch.arange(seq_len, device=scores.device)
        scores = scores.masked_fill(keys[None, :] > query_pos, float("-inf"))
        out[first:last] = torch.einsum("hqs,hsv->qhv", torch.softmax(scores, dim=-1), v)
    return out.to(q_c.dtype)


def int8_latents(kv_cache: torch.Tensor, lora: int):
    """An INT8 latent cache as (codes ``[rows, W]`` int8, scales ``[rows, 2]`` float32),
    views of the cache, ``W = L + R``."""
    rows = kv_cache.view(torch.int8).reshape(-1, kv_cache.shape[-1])
    width = rows.shape[1] - LATENT_SCALE_BYTES
    return rows[:, :width], rows[:, width:].view(torch.float32)


def dequantized(codes: torch.Tensor, scales: torch.Tensor, lora: int,
                dtype=torch.float32) -> torch.Tensor:
    """INT8 latent rows as ``dtype``: ``c`` times its scale, ``k_pe`` times its own."""
    out = codes.to(dtype)
    out[:, :lora] *= scales[:, :1].to(dtype)
    out[:, lora:] *= scales[:, 1:].to(dtype)
    return out


@register_kernel("mla_cache_write_int8")
def mla_cache_write_int8(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """``mla_cache_write`` into an INT8 latent cache (each part quantized per token)."""
    lora = kv_c.shape[-1]
    codes, scales = int8_latents(kv_cache, lora)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    c_q, c_s = _quantize(kv_c[keep][:, None, :], None)
    pe_q, pe_s = _quantize(k_pe[keep][:, None, :], None)
    codes[slots] = torch.cat((c_q[:, 0], pe_q[:, 0]), dim=-1)
    scales[slots] = torch.cat((c_s, pe_s), dim=-1)


@register_kernel("mla_decode_int8")
def mla_decode_int8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``mla_decode`` over an INT8 latent cache (its rows dequantized in float64)."""
    lora = q_nope.shape[-1]
    codes, scales = int8_latents(kv_cache, lora)
    return decode_rows(q_nope, q_pe, block_table, seq_lens, scale, kv_cache.shape[1],
                       lambda slots: dequantized(codes[slots], scales[slots], lora,
                                                 torch.float64))


@register_kernel("mla_gather_int8")
def mla_gather_int8(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                    lora: int) -> torch.Tensor:
    """``mla_gather`` of an INT8 latent cache, dequantized to float32."""
    codes, scales = int8_latents(kv_cache, lora)
    slots = torch.cat([request_slots(block_table[i], kv_cache.shape[1], s)
                       for i, s in enumerate(seq_lens)])
    return dequantized(codes[slots], scales[slots], lora)


def fp8_codes(x: torch.Tensor, dtype: torch.dtype, kv_scale) -> torch.Tensor:
    """``x / kv_scale`` in the fp8 ``dtype``, saturated at its largest finite value."""
    finfo = torch.finfo(dtype)
    return (x.float() / kv_scale).clamp(finfo.min, finfo.max).to(dtype)


@register_kernel("mla_cache_write_fp8")
def mla_cache_write_fp8(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                        slot_mapping: torch.Tensor, kv_scale) -> None:
    """``mla_cache_write`` into an fp8 latent cache (``kv_cache`` in its fp8 dtype)."""
    keep = slot_mapping >= 0
    latent_rows(kv_cache)[slot_mapping[keep].long()] = fp8_codes(
        torch.cat((kv_c[keep], k_pe[keep]), dim=-1), kv_cache.dtype, kv_scale)


@register_kernel("mla_decode_fp8")
def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   kv_scale) -> torch.Tensor:
    """``mla_decode`` over an fp8 latent cache (its rows times ``kv_scale`` in float64)."""
    rows = latent_rows(kv_cache)
    return decode_rows(q_nope, q_pe, block_table, seq_lens, scale, kv_cache.shape[1],
                       lambda slots: rows[slots].double() * kv_scale)


@register_kernel("mla_gather_fp8")
def mla_gather_fp8(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                   kv_scale) -> torch.Tensor:
    """``mla_gather`` of an fp8 latent cache, dequantized to float32."""
    return mla_gather(kv_cache, block_table, seq_lens).float() * kv_scale
