"""``torch_fast`` multi-head latent attention: what a card without vendor MLA kernels
runs (contract and cache layout: ``reference/mla.py``). One ``index_select`` of the
batch's latent rows, batched matmuls in the model dtype, float32 softmax."""

import torch

from vllm_accel.ops.reference.mla import (
    dequantized,
    int8_latents,
    latent_rows,
    mla_cache_write_fp8,
    mla_cache_write_int8,
)
from vllm_accel.ops.registry import register_kernel
from vllm_accel.ops.torch_fast.attention import FAST


@register_kernel("mla_cache_write", FAST)
def mla_cache_write(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """One ``index_copy_`` of the rows with a slot (padding rows have ``-1``)."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    rows = torch.cat((kv_c[keep], k_pe[keep]), dim=-1).to(kv_cache.dtype)
    latent_rows(kv_cache).index_copy_(0, slots, rows)


def _batch_rows(kv_cache, block_table, seq_lens):
    """The cache rows of every request padded to the longest (``[B, S]``, the padding
    repeating a row of the request's own) and the keys' validity ``[B, S]``."""
    block_size = kv_cache.shape[1]
    seq_lens = seq_lens.long()
    longest = int(seq_lens.max())
    pos = torch.arange(longest, device=block_table.device)
    clamped = torch.minimum(pos[None, :], (seq_lens - 1).clamp(min=0)[:, None])
    blocks = block_table.gather(1, (clamped // block_size).to(torch.int64)).long()
    return blocks * block_size + clamped % block_size, pos[None, :] < seq_lens[:, None]


def _decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale, read_rows):
    """Absorbed decode of the whole batch at once; ``read_rows(slots)`` gives the latent
    rows ``[len(slots), L + R]`` in the queries' dtype."""
    b, n, lora = q_nope.shape
    if b == 0 or int(seq_lens.max()) == 0:
        return q_nope.new_zeros(b, n, lora)
    slots, valid = _batch_rows(kv_cache, block_table, seq_lens)
    latent = read_rows(slots.reshape(-1)).view(b, -1, lora + q_pe.shape[-1])
    q = torch.cat((q_nope, q_pe), dim=-1)  # [B, N, L + R]
    scores = torch.bmm(q, latent.transpose(1, 2)).float().mul_(scale)  # [B, N, S]
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num_(0.0)
    return torch.bmm(probs.to(latent.dtype), latent[..., :lora]).to(q_nope.dtype)


@register_kernel("mla_decode", FAST)
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed decode of the whole batch at once: the latents of every request
    gathered once and read by all heads (MQA)."""
    rows = latent_rows(kv_cache)
    return _decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
                   lambda slots: rows.index_select(0, slots).to(q_nope.dtype))


@register_kernel("mla_decode_int8", FAST)
def mla_decode_int8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                    block_table: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``mla_decode`` over an INT8 latent cache, dequantized to the queries' dtype."""
    codes, scales = int8_latents(kv_cache, q_nope.shape[-1])
    return _decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
                   lambda slots: dequantized(codes.index_select(0, slots),
                                             scales.index_select(0, slots),
                                             q_nope.shape[-1], q_nope.dtype))


def _gather_slots(kv_cache, block_table, seq_lens) -> torch.Tensor:
    block_size = kv_cache.shape[1]
    slots = []
    for i, s in enumerate(seq_lens):
        pos = torch.arange(s, device=block_table.device)
        slots.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(slots)


@register_kernel("mla_gather", FAST)
def mla_gather(kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: list[int]) -> torch.Tensor:
    """One ``index_select`` of every request's latent rows."""
    return latent_rows(kv_cache).index_select(0, _gather_slots(kv_cache, block_table, seq_lens))


@register_kernel("mla_gather_int8", FAST)
def mla_gather_int8(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                    lora: int) -> torch.Tensor:
    """``mla_gather`` of an INT8 latent cache, dequantized to float32."""
    codes, scales = int8_latents(kv_cache, lora)
    slots = _gather_slots(kv_cache, block_table, seq_lens)
    return dequantized(codes.index_select(0, slots), scales.index_select(0, slots), lora)


@register_kernel("mla_decode_fp8", FAST)
def mla_decode_fp8(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                   block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                   kv_scale) -> torch.Tensor:
    """``mla_decode`` over an fp8 latent cache, dequantized to the queries' dtype."""
    rows = latent_rows(kv_cache)
    return _decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale,
                   lambda slots: (rows.index_select(0, slots).float() * kv_scale)
                   .to(q_nope.dtype))


@register_kernel("mla_gather_fp8", FAST)
def mla_gather_fp8(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: list[int],
                   kv_scale) -> torch.Tensor:
    """``mla_gather`` of an fp8 latent cache, dequantized to float32."""
    return mla_gather(kv_cache, block_table, seq_lens).float() * kv_scale


# (the reference writers are already one vectorized scatter)
register_kernel("mla_cache_write_int8", FAST)(mla_cache_write_int8)
register_kernel("mla_cache_write_fp8", FAST)(mla_cache_write_fp8)
