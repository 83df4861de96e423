"""Triton MLA decode (contract: ``reference/mla.py``'s ``mla_decode``): the absorbed
queries of every head of a request against its latent rows in vLLM's cache
``[num_blocks, block_size, L + R]``.

One program per (request, tile of up to ``BLOCK_H`` heads, split of the context): the
heads of a request share each latent tile they load (MQA), the logits are two dot
products (``q_nope . c`` and ``q_pe . k_pe``), the softmax is online in float32 and
the output accumulates ``p @ c`` over the latent width. A context longer than one
split is cut into ``num_splits`` parts whose partial results (output, max, sum) a
second kernel merges, so that a batch-1 decode still fills the GPU. A request of
length 0 (a padded slot) gets zeros.
"""

import torch
import triton
import triton.language as tl

from vllm_accel.ops.triton.paged_attention import interpreted

#: keys per tile (a power of two, at least 16 for tl.dot)
BLOCK_N = 32
#: most heads per program (each program reads its request's latent rows once)
BLOCK_H = 64
#: keys per split of a request's context (a multiple of BLOCK_N): the short split
#: while the batch's programs would not fill the GPU, else the long one
SPLIT_KEYS = 256
SPLIT_KEYS_LONG = 1024
#: decode programs below which the short split is used (~ twice an H100/H200's SMs)
FEW_PROGRAMS = 256
#: warps and pipeline stages per decode program (swept on an H200)
NUM_WARPS = 8
NUM_STAGES = 2


@triton.jit
def _mla_decode_kernel(qn_ptr, qp_ptr, cache_ptr, bt_ptr, seq_lens_ptr, part_ptr, stats_ptr,
                       stride_qn_b, stride_qn_h, stride_qp_b, stride_qp_h, stride_blk,
                       stride_row, stride_bt, stride_pb, stride_ph, stride_ps,
                       num_heads, lora, rope, scale, block_size, split_keys,
                       BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    req = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    start = split * split_keys
    end = tl.minimum(start + split_keys, seq_len)

    heads = h0 + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    head_ok = heads < num_heads
    qn = tl.load(qn_ptr + req * stride_qn_b + heads[:, None] * stride_qn_h + offs_l[None, :],
                 mask=head_ok[:, None] & (offs_l[None, :] < lora), other=0.0)
    qp = tl.load(qp_ptr + req * stride_qp_b + heads[:, None] * stride_qp_h + offs_r[None, :],
                 mask=head_ok[:, None] & (offs_r[None, :] < rope), other=0.0)
    if IEEE:  # float32 products (float32 inputs; the interpreter, whose bf16 dot is wrong)
        qn = qn.to(tl.float32)
        qp = qp.to(tl.float32)

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_L), tl.float32)
    for j in range(start, end, BLOCK_N):
        pos = j + tl.arange(0, BLOCK_N)
        key_ok = pos < end
        blk = tl.load(bt_ptr + req * stride_bt + pos // block_size, mask=key_ok, other=0)
        row = blk.to(tl.int64) * stride_blk + (pos % block_size) * stride_row
        # the latent rows twice, in the two layouts the dot products want (the second
        # load hits the cache): transposed for the logits, row-major for p @ c
        c_t = tl.load(cache_ptr + row[None, :] + offs_l[:, None],
                      mask=key_ok[None, :] & (offs_l[:, None] < lora), other=0.0)
        kp_t = tl.load(cache_ptr + row[None, :] + lora + offs_r[:, None],
                       mask=key_ok[None, :] & (offs_r[:, None] < rope), other=0.0)
        c = tl.load(cache_ptr + row[:, None] + offs_l[None, :],
                    mask=key_ok[:, None] & (offs_l[None, :] < lora), other=0.0)
        if IEEE:
            c = c.to(tl.float32)
            s = tl.dot(qn, c_t.to(tl.float32), input_precision="ieee")
            s += tl.dot(qp, kp_t.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(qn, c_t) + tl.dot(qp, kp_t)
        s = tl.where(key_ok[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m_i = m_new

    part = (part_ptr + req * stride_pb + heads[:, None] * stride_ph + split * stride_ps
            + offs_l[None, :])
    tl.store(part, acc, mask=head_ok[:, None] & (offs_l[None, :] < lora))
    stats = stats_ptr + ((req * num_heads + heads) * tl.num_programs(2) + split) * 2
    tl.store(stats, m_i, mask=head_ok)
    tl.store(stats + 1, l_i, mask=head_ok)


@triton.jit
def _mla_merge_kernel(part_ptr, stats_ptr, out_ptr, stride_pb, stride_ph, stride_ps,
                      stride_ob, stride_oh, num_heads, lora, num_splits,
                      BLOCK_L: tl.constexpr):
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_l = tl.arange(0, BLOCK_L)
    stats = stats_ptr + (req * num_heads + head) * num_splits * 2
    m = float("-inf")
    for s in range(num_splits):
        m = tl.maximum(m, tl.load(stats + 2 * s))
    m = tl.where(m == float("-inf"), 0.0, m)  # no keys at all: every weight below is 0
    total = 0.0
    acc = tl.zeros((BLOCK_L,), tl.float32)
    for s in range(num_splits):
        w = tl.exp(tl.load(stats + 2 * s) - m)  # (a split without keys: exp(-inf) = 0)
        total += w * tl.load(stats + 2 * s + 1)
        acc += w * tl.load(part_ptr + req * stride_pb + head * stride_ph + s * stride_ps
                           + offs_l, mask=offs_l < lora, other=0.0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_l,
             out.to(out_ptr.dtype.element_ty), mask=offs_l < lora)


def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    batch, num_heads, lora = q_nope.shape
    rope = q_pe.shape[-1]
    assert kv_cache.shape[-1] == lora + rope and kv_cache.stride(-1) == 1
    q_nope = q_nope if q_nope.stride(-1) == 1 else q_nope.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    block_table = block_table.to(torch.int32)
    seq_lens = seq_lens.to(device=q_nope.device, dtype=torch.int32)
    # splits from the block table's width, not the lengths (no device-to-host sync, as
    # a captured graph needs): programs past a request's length stop at once
    wide = q_nope.dtype == torch.float32  # float32 tiles: a quarter of the heads and keys
    block_h = 16 if wide else min(BLOCK_H, max(16, triton.next_power_of_2(num_heads)))
    block_n = 16 if wide else BLOCK_N
    max_len = block_table.shape[1] * kv_cache.shape[1]
    head_tiles = triton.cdiv(num_heads, block_h)
    split_keys = (SPLIT_KEYS if batch * head_tiles * triton.cdiv(max_len, SPLIT_KEYS_LONG)
                  < FEW_PROGRAMS else SPLIT_KEYS_LONG)
    num_splits = max(1, triton.cdiv(max_len, split_keys))
    part = torch.empty(batch, num_heads, num_splits, lora, dtype=torch.float32,
                       device=q_nope.device)
    stats = torch.empty(batch, num_heads, num_splits, 2, dtype=torch.float32,
                        device=q_nope.device)
    out = torch.empty(batch, num_heads, lora, dtype=q_nope.dtype, device=q_nope.device)
    if batch == 0:
        return out
    block_l = triton.next_power_of_2(lora)
    block_r = max(16, triton.next_power_of_2(rope))
    grid = (batch, head_tiles, num_splits)
    _mla_decode_kernel[grid](
        q_nope, q_pe, kv_cache, block_table, seq_lens, part, stats,
        q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        part.stride(0), part.stride(1), part.stride(2), num_heads, lora, rope, scale,
        kv_cache.shape[1], split_keys, BLOCK_H=block_h, BLOCK_L=block_l, BLOCK_R=block_r,
        BLOCK_N=block_n, IEEE=wide or interpreted(_mla_decode_kernel),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _mla_merge_kernel[(batch, num_heads)](
        part, stats, out, part.stride(0), part.stride(1), part.stride(2), out.stride(0),
        out.stride(1), num_heads, lora, num_splits, BLOCK_L=block_l)
    return out
