"""The ``reference`` provider of multi-head latent attention (MLA: DeepSeek-V2/V3,
Kimi, MiniCPM3), written for obviousness: the oracle the other providers are held to.

The latent cache of one layer is vLLM's ``[num_blocks, block_size, L + R]``: per token
the compressed KV ``c`` (``kv_lora_rank`` L values) then the rotated key part ``k_pe``
(R values), shared by every head. Decode runs with the weights absorbed (vLLM's
``MLAAttention`` multiplies the query's no-rope part by ``W_UK`` first): query head
``h`` is ``(q_nope[h] [L], q_pe[h] [R])``, its logits ``q_nope . c + q_pe . k_pe``
times ``scale``, its output ``softmax . c`` (``[L]``, which vLLM then multiplies by
``W_UV``). Prefill decompresses the cached latents instead (``mla_gather``).
"""

import torch

from vllm_accel.ops.registry import register_kernel


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


@register_kernel("mla_decode")
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Absorbed decode: ``q_nope`` ``[B, N, L]``, ``q_pe`` ``[B, N, R]`` over each request's
    ``seq_len`` cached latents; returns ``[B, N, L]`` (zeros for ``seq_len`` 0)."""
    b, n, lora = q_nope.shape
    out = q_nope.new_zeros(b, n, lora)
    rows = latent_rows(kv_cache)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        latent = rows[request_slots(block_table[i], kv_cache.shape[1], seq_len)].double()
        c, k_pe = latent[:, :lora], latent[:, lora:]
        scores = (q_nope[i].double() @ c.T + q_pe[i].double() @ k_pe.T) * scale  # [N, S]
        out[i] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return out


@register_kernel("mla_gather")
def mla_gather(kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: list[int]) -> torch.Tensor:
    """Every request's first ``seq_len`` cached latents, packed: ``[sum(seq_lens), L + R]``
    (request ``i``'s block ids in ``block_table[i]``)."""
    rows = latent_rows(kv_cache)
    return torch.cat([rows[request_slots(block_table[i], kv_cache.shape[1], s)]
                      for i, s in enumerate(seq_lens)])
