"""Paged-attention kernels vs. a float64 softmax-attention oracle on unpaged K/V.

Each case builds per-request K/V, scatters them with ``cache_write`` into a cache
pre-filled with garbage through a shuffled (non-contiguous) block table whose unused
columns hold garbage block ids, then checks the kernels against plain attention
over the original tensors. Any read of a slot a request does not own shows up as
a mismatch (garbage is +/-1e4, far outside the tolerances). Caches come in both
physical layouts vLLM may hand the backend: block-major (LBHNC) and head-major
(LHBNC, what the backend asks for), the latter as a strided view.
"""

import math

import pytest
import torch

from vllm_accel.ops import (  # noqa: F401  (register)
    attention_kernels,
    attention_native,
    attention_reference,
)
from vllm_accel.ops.registry import get_kernel

cache_write = get_kernel("cache_write", "reference")

#: every provider of the readers is held to the same oracle
PROVIDERS = ["reference", "torch_fast", "cpu_native"]


@pytest.fixture(autouse=True, params=PROVIDERS)
def provider(request):
    """Points this module's reader names at one provider's kernels."""
    for name in ['paged_decode', 'paged_prefill']:
        globals()[name] = get_kernel(name, request.param)
    return request.param

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
HKV = 2
GQA = [1, 3, 8]  # H = ratio * HKV
PAD_COLS = 2  # extra block-table columns per request, filled with garbage ids


def batch_mix(name: str, bs: int) -> list[tuple[int, int]]:
    """(q_len, seq_len) per request; lengths straddle block boundaries."""
    return {
        "decode": [(1, 1), (1, bs), (1, bs + 1), (1, 3 * bs - 7), (1, 45)],
        "prefill": [(1, 1), (bs, bs), (2 * bs + 3, 2 * bs + 3), (23, 23)],
        "prefill_ctx": [(17, 2 * bs), (bs, 2 * bs), (5, bs + 9), (40, 40 + bs // 2)],
        "mixed": [(30, 30 + bs + 3), (1, 2 * bs + 5), (19, 19), (1, 1), (1, bs)],
    }[name]


def empty_cache(num_blocks, hkv, bs, d, dtype, layout, fill):
    """A logical [NB, Hkv, BS, 2D] cache in the given physical layout."""
    if layout == "LHBNC":
        return torch.full((hkv, num_blocks, bs, 2 * d), fill, dtype=dtype).transpose(0, 1)
    return torch.full((num_blocks, hkv, bs, 2 * d), fill, dtype=dtype)


def read_kv(kv_cache, blk, off, d):
    """K and V at (block, offset) pairs: a page holds its K rows, then its V rows."""
    nb, hkv, bs, _ = kv_cache.shape
    page = kv_cache[blk]  # [n, Hkv, BS, 2D] -> reinterpret each page as [2, BS, D]
    page = page.reshape(len(blk), hkv, 2, bs, d)
    rows = torch.arange(len(blk))
    return page[rows, :, 0, off], page[rows, :, 1, off]


def make_case(reqs, bs, h, hkv, d, dtype, seed, layout="LHBNC", fill=None):
    """Unpaged per-request Q/K/V, a shuffled block table and the filled cache."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / bs) for _, s in reqs]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + PAD_COLS
    block_table = torch.randint(0, num_blocks, (len(reqs), width), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qs = [rand(q, h, d) for q, _ in reqs]
    ks = [rand(s, hkv, d) for _, s in reqs]
    vs = [rand(s, hkv, d) for _, s in reqs]

    # Slot mapping for every token of every request, plus padding rows, shuffled.
    slots = []
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s)
        slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
    n_pad = 4
    slot_mapping = torch.cat(slots + [torch.full((n_pad,), -1, dtype=torch.long)])
    key = torch.cat(ks + [rand(n_pad, hkv, d)])
    value = torch.cat(vs + [rand(n_pad, hkv, d)])
    order = torch.randperm(len(slot_mapping), generator=g)
    if fill is None:  # finite garbage: a masked key must contribute exactly 0
        kv_cache = empty_cache(num_blocks, hkv, bs, d, dtype, layout, 0.0)
        kv_cache.copy_((torch.rand(kv_cache.shape, generator=g) * 2e4 - 1e4).to(dtype))
    else:
        kv_cache = empty_cache(num_blocks, hkv, bs, d, dtype, layout, fill)
    cache_write(key[order], value[order], kv_cache, slot_mapping[order])
    return qs, ks, vs, block_table, kv_cache


def reference(q, k, v, scale):
    """float64 causal attention; q holds the last len(q) of len(k) positions."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    context = k.shape[0] - q.shape[0]
    q_pos = torch.arange(q.shape[0])[:, None] + context
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > q_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_cache_write_roundtrip(bs, d, dtype, layout):
    reqs = batch_mix("mixed", bs)
    _, ks, vs, block_table, kv_cache = make_case(reqs, bs, HKV, HKV, d, dtype, seed=bs + d,
                                                 layout=layout, fill=float("nan"))
    written = torch.zeros(kv_cache.shape[0], bs, dtype=torch.bool)
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s)
        blk, off = block_table[i, pos // bs].long(), pos % bs
        k, v = read_kv(kv_cache, blk, off, d)
        torch.testing.assert_close(k, ks[i], atol=0, rtol=0)
        torch.testing.assert_close(v, vs[i], atol=0, rtol=0)
        written[blk, off] = True
    # Padding rows (slot -1) and slots nobody owns must still hold the NaN fill.
    assert torch.isnan(kv_cache.reshape(-1, HKV, 2, bs, d).permute(0, 3, 1, 2, 4)[~written]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", GQA)
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
@pytest.mark.parametrize("mix", ["decode", "prefill", "prefill_ctx", "mixed"])
def test_paged_prefill(mix, bs, ratio, d, dtype):
    reqs = batch_mix(mix, bs)
    h = ratio * HKV
    layout = "LBHNC" if (bs + ratio) % 2 else "LHBNC"
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, h, HKV, d, dtype,
                                                  seed=bs * ratio + d, layout=layout)
    scale = d**-0.5
    query_start_loc = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    out = paged_prefill(torch.cat(qs), kv_cache, block_table, query_start_loc, seq_lens, scale)
    assert out.dtype == dtype and out.shape == torch.cat(qs).shape
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("ratio", GQA)
@pytest.mark.parametrize("bs", [16, 32, 64, 128])
def test_paged_decode(bs, ratio, d, dtype):
    reqs = batch_mix("decode", bs)
    h = ratio * HKV
    layout = "LBHNC" if (bs + ratio) % 2 else "LHBNC"
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, h, HKV, d, dtype,
                                                  seed=bs + ratio * d, layout=layout)
    scale = d**-0.5
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    # Non-contiguous query, as sliced out of a fused qkv projection.
    qkv = torch.cat([torch.cat(qs), torch.zeros(len(reqs), h, d, dtype=dtype)], dim=-1)
    query = qkv[..., :d]
    out = paged_decode(query, kv_cache, block_table, seq_lens, scale)
    assert out.dtype == dtype and out.shape == (len(reqs), h, d)
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


def test_paged_decode_padded_request_is_zero():
    """A seq_len 0 batch slot (padding) yields zeros and does not disturb the others."""
    bs, d = 16, 64
    reqs = batch_mix("decode", bs)
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, HKV, HKV, d, torch.float32, seed=7)
    seq_lens = torch.tensor([s for _, s in reqs] + [0], dtype=torch.int32)
    block_table = torch.cat([block_table, block_table[:1]])
    query = torch.cat(qs + [torch.randn(1, HKV, d)])
    out = paged_decode(query, kv_cache, block_table, seq_lens, d**-0.5)
    assert torch.equal(out[-1], torch.zeros(HKV, d))
    expected = torch.cat([reference(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out[:-1].double(), expected, **TOL[torch.float32])


def test_kernels_registered():
    assert get_kernel("cache_write", "reference") is attention_kernels.cache_write
    for name in ("paged_decode", "paged_prefill"):
        assert get_kernel(name, "torch_fast") is getattr(attention_kernels, name)
        assert get_kernel(name, "reference").__module__ == "vllm_accel.ops.attention_reference"
