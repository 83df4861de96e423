"""Fake ``flash_attn.vllm_flash_attn``: ``flash_attn_varlen_func``'s documented paged
semantics in float64 (keyword call, as vLLM makes it): a bottom-right causal mask,
``window_size`` (left, right), ``softcap``, ALiBi's ``-slope * |i + sk - sq - j|``,
FA3 refusing ALiBi. K/V ``[num_blocks, block_size, kv_heads, head_size]`` are read
through their strides, and only the pages inside each request's window, as the CUDA
kernel does. ``CALLS`` logs each call's FA version; with ``FAKE_FLASH_ATTN_REPORT``
set, each call prints how many decode and prefill calls the process has served (the
engine's worker process may end without running exit hooks).
"""

import os
import sys

import torch

CALLS: list[int] = []
#: (decode calls: every query length 1, prefill calls) for the exit report
SHAPES = {"decode": 0, "prefill": 0}


def make_varlen(calls: list, ignore_strides: bool = False, takes_version: bool = True):
    """A ``flash_attn_varlen_func`` logging to ``calls``; ``ignore_strides``: a broken
    build that reads the cache as if contiguous; ``takes_version`` False: an FA2-era
    interface without ``fa_version``."""

    def varlen(*, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None,
               softmax_scale=None, causal=False, window_size=None, softcap=0.0,
               alibi_slopes=None, block_table=None, out=None, fa_version=2):
        calls.append(fa_version)
        SHAPES["decode" if max_seqlen_q == 1 else "prefill"] += 1
        if os.environ.get("FAKE_FLASH_ATTN_REPORT"):
            print(f"FAKE_FLASH_ATTN decode {SHAPES['decode']} prefill {SHAPES['prefill']} "
                  f"version {fa_version}", file=sys.stderr, flush=True)
        assert causal and block_table.dtype == seqused_k.dtype == torch.int32
        assert k.stride(-1) == 1 and k.shape[1] % 16 == 0
        assert q.device == k.device == out.device == block_table.device
        if fa_version == 3 and alibi_slopes is not None:
            raise RuntimeError("This flash attention build does not support alibi")
        if ignore_strides:  # a kernel that assumes a contiguous cache
            k = k.as_strided(k.shape, torch.empty(k.shape).stride(), k.storage_offset())
            v = v.as_strided(v.shape, torch.empty(v.shape).stride(), v.storage_offset())
        block_size, group = k.shape[1], q.shape[1] // k.shape[2]
        left = window_size[0] if window_size is not None else -1
        starts = cu_seqlens_q.tolist()
        for i, sk in enumerate(seqused_k.tolist()):
            q_i = q[starts[i]:starts[i + 1]].cpu().double()
            sq = len(q_i)
            first = max(0, sk - sq - left) if left >= 0 else 0  # pages before: never read
            pos = torch.arange(first, sk)
            blocks = block_table[i].cpu()[pos // block_size].long()
            keys = k[blocks.to(k.device), (pos % block_size).to(k.device)].cpu().double()
            values = v[blocks.to(v.device), (pos % block_size).to(v.device)].cpu().double()
            keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
            s = torch.einsum("qhd,nhd->hqn", q_i, keys) * softmax_scale
            if softcap:
                s = softcap * torch.tanh(s / softcap)
            row = torch.arange(sq)[:, None] + sk - sq  # the query's own key position
            if alibi_slopes is not None:
                s = s - alibi_slopes.cpu().double()[:, None, None] * (row - pos).abs()
            hide = pos > row
            if left >= 0:
                hide |= pos < row - left
            p = torch.softmax(s.masked_fill(hide, float("-inf")), -1)
            o = torch.einsum("hqn,nhd->qhd", p, values)
            out[starts[i]:starts[i + 1]] = o.to(device=out.device, dtype=out.dtype)
        return out

    if takes_version:
        return varlen

    def varlen_fa2(*, q, k, v, max_seqlen_q, cu_seqlens_q, max_seqlen_k, seqused_k=None,
                   softmax_scale=None, causal=False, window_size=None, softcap=0.0,
                   alibi_slopes=None, block_table=None, out=None):
        return varlen(**{n: value for n, value in locals().items() if n != "varlen"})

    return varlen_fa2


flash_attn_varlen_func = make_varlen(CALLS)

