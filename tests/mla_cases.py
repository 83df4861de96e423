"""MLA kernel cases shared by test_mla_kernels.py and the Triton cases (no vLLM import:
the Triton cases also run on a GPU host with only torch and triton): vLLM's latent
cache ``[num_blocks, block_size, L + R]`` filled with garbage, shuffled block tables
with garbage columns past each request's blocks, and the float64 oracle over the
original latents."""

import math

import torch

from vllm_accel.ops.reference.mla import mla_cache_write

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def latent_case(seq_lens, block_size, lora, rope, dtype, seed):
    """(latents per request [S, L+R], block table, cache written by the reference)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g)
    table = torch.randint(0, num_blocks, (len(seq_lens), max(need) + 2), generator=g,
                          dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    latents = [torch.randn(s, lora + rope, generator=g).to(dtype) for s in seq_lens]
    cache = (torch.rand(num_blocks, block_size, lora + rope, generator=g) * 2e4 - 1e4).to(dtype)
    slots = torch.cat([table[i, torch.arange(s) // block_size].long() * block_size
                       + torch.arange(s) % block_size for i, s in enumerate(seq_lens)])
    mla_cache_write(
        torch.cat(latents)[:, :lora], torch.cat(latents)[:, lora:], cache, slots)
    return latents, table, cache


def absorbed_oracle(q_nope, q_pe, latents, lora, scale):
    """float64 absorbed decode over the original latents."""
    out = []
    for i, lat in enumerate(latents):
        lat = lat.double()
        scores = (q_nope[i].double() @ lat[:, :lora].T + q_pe[i].double() @ lat[:, lora:].T)
        out.append(torch.softmax(scores * scale, dim=-1) @ lat[:, :lora])
    return torch.stack(out)
