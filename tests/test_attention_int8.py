"""INT8 KV-cache kernels vs. the float64 oracle of ``test_attention_kernels``.

The oracle runs on the UNQUANTIZED K/V, so the kernels are held to an explicit
quantization-error bound (``INT8_ERR``). Cases reuse the bf16 tests' batch mixes,
shuffled block tables with garbage columns and padded, shuffled slot mappings;
the int8 cache is pre-filled with garbage bytes whose scale slots hold finite
garbage up to 100, i.e. dequantized garbage up to ~1e4: any read of a slot a
request does not own is far outside the bound, and a masked key contributes
exactly 0 (same convention as the bf16 tests).

Page layout under test (``[NB, Hkv, BS, 2D + 8]`` int8, each page contiguous):
K int8 ``[BS, D]``, V int8 ``[BS, D]``, float32 ``[BS, 2]`` (k_scale, v_scale).
"""

import math

import pytest
import torch
# tests/ has no __init__: pytest's default (prepend) import mode puts it on sys.path.
from test_attention_kernels import GQA, HKV, TOL, batch_mix, make_case, reference

from vllm_accel.ops import attention_kernels, attention_native  # noqa: F401  (register)
from vllm_accel.ops.registry import get_kernel

cache_write_int8 = get_kernel("cache_write_int8", "reference")

#: every provider of the readers is held to the same oracle
PROVIDERS = ["reference", "torch_fast", "cpu_native"]


@pytest.fixture(autouse=True, params=PROVIDERS)
def provider(request):
    """Points this module's reader names at one provider's kernels."""
    for name in ['paged_decode_int8', 'paged_prefill_int8', 'paged_prefill']:
        globals()[name] = get_kernel(name, request.param)
    return request.param

#: Bound: |out - ref| <= INT8_ERR * max|V of the request| + TOL[dtype] (the bf16/fp32
#: tolerance of the unquantized kernels). Measured worst over the full cross product
#: below (4 mixes x bs 16..128 x GQA 1/3/8 x D 64/128 x fp32/bf16 x both layouts,
#: decode + prefill): 0.0093 (fp32); bf16 0.0107 raw, 0.0024 beyond the bf16
#: tolerance. Theory: V rounding alone is <= max|V| / 254 = 0.0039; K rounding
#: perturbs the logits by ~0.007 std. 0.02 leaves ~2x margin.
INT8_ERR = 0.02
SENTINEL = 0x5A  # byte pre-filled in the write tests: must survive where nothing was written

MIXES = ["decode", "prefill", "prefill_ctx", "mixed"]
BLOCK_SIZES = [16, 32, 64, 128]
HEAD_SIZES = [64, 128]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["LBHNC", "LHBNC"]


def int8_cache(num_blocks, bs, d, layout, g=None, fill=None):
    """A logical [NB, Hkv, BS, 2D+8] int8 cache; ``fill`` byte, else finite garbage."""
    width = 2 * d + 8
    shape = (HKV, num_blocks, bs, width) if layout == "LHBNC" else (num_blocks, HKV, bs, width)
    if fill is not None:
        phys = torch.full(shape, fill, dtype=torch.int8)
    else:
        phys = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        pages = phys.view(-1, bs * width)
        garbage_scales = torch.rand(pages.shape[0], 2 * bs, generator=g) * 100
        pages[:, 2 * bs * d :].view(torch.float32).copy_(garbage_scales)
    return phys.transpose(0, 1) if layout == "LHBNC" else phys


def write_shuffled(cache, block_table, ks, vs, g, **scales):
    """cache_write_int8 of all requests' K/V plus 4 padding rows, in shuffled order."""
    bs = cache.shape[2]
    slots = []
    for i, k in enumerate(ks):
        pos = torch.arange(len(k))
        slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
    slot_mapping = torch.cat(slots + [torch.full((4,), -1, dtype=torch.long)])
    pad = torch.randn(4, *ks[0].shape[1:], generator=g).to(ks[0].dtype) * 1e3
    key, value = torch.cat(ks + [pad]), torch.cat(vs + [pad])
    order = torch.randperm(len(slot_mapping), generator=g)
    cache_write_int8(key[order], value[order], cache, slot_mapping[order], **scales)


def build(reqs, bs, ratio, d, dtype, layout, seed, fill=None, **scales):
    """make_case's data and block table, written into an int8 cache."""
    qs, ks, vs, block_table, bf16_cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                                    seed=seed, layout=layout, fill=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    num_blocks = sum(math.ceil(s / bs) for _, s in reqs) + 3  # as make_case
    cache = int8_cache(num_blocks, bs, d, layout, g, fill)
    write_shuffled(cache, block_table, ks, vs, g, **scales)
    return qs, ks, vs, block_table, cache, bf16_cache


def read_slots(cache, blk, off):
    """(K int8, V int8 [n, Hkv, D], scales float32 [n, Hkv, 2]) at (block, offset) pairs."""
    n, (_, hkv, bs, width) = len(blk), cache.shape
    d = (width - 8) // 2
    page = cache[blk].reshape(n, hkv, bs * width)
    rows = torch.arange(n)
    k = page[..., : bs * d].reshape(n, hkv, bs, d)[rows, :, off]
    v = page[..., bs * d : 2 * bs * d].reshape(n, hkv, bs, d)[rows, :, off]
    s = page[..., 2 * bs * d :].reshape(n, hkv, bs, 8).contiguous().view(torch.float32)
    return k, v, s[rows, :, off]


def request_slots(block_table, i, seq_len, bs):
    pos = torch.arange(seq_len)
    return block_table[i, pos // bs].long(), pos % bs


def kernel_args(reqs):
    query_start_loc = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    return query_start_loc, seq_lens


def assert_within_int8_bound(out, expected, vmax, dtype):
    """|out - expected| <= INT8_ERR * vmax (per row) + TOL[dtype], reporting the worst."""
    tol = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * expected.abs()
    excess = ((out.double() - expected).abs() - tol) / vmax
    assert excess.max() <= INT8_ERR, f"error {excess.max():.4f} * max|V| > {INT8_ERR}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_SIZES)
@pytest.mark.parametrize("ratio", GQA)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
@pytest.mark.parametrize("mix", MIXES)
def test_int8_attention_vs_unquantized(mix, bs, ratio, d, dtype, layout):
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, ratio, d, dtype, layout,
                                              seed=bs * ratio + d)
    scale = d**-0.5
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    vmax = torch.cat([v.abs().max().double().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    query_start_loc, seq_lens = kernel_args(reqs)
    out = paged_prefill_int8(torch.cat(qs), cache, block_table, query_start_loc, seq_lens, scale)
    assert out.dtype == dtype and out.shape == expected.shape
    assert_within_int8_bound(out, expected, vmax, dtype)
    if mix == "decode":
        # Non-contiguous query, as sliced out of a fused qkv projection.
        query = torch.cat([torch.cat(qs), torch.zeros_like(torch.cat(qs))], dim=-1)[..., :d]
        out = paged_decode_int8(query, cache, block_table, seq_lens, scale)
        assert out.dtype == dtype and out.shape == expected.shape
        assert_within_int8_bound(out, expected, vmax, dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", HEAD_SIZES)
@pytest.mark.parametrize("bs", BLOCK_SIZES)
def test_cache_write_int8_roundtrip(bs, d, dtype, layout):
    """Stored scales are max|x|/127, dequantized K/V within scale/2; rest untouched."""
    reqs = batch_mix("mixed", bs)
    seed = bs + d
    qs, ks, vs, block_table, _ = make_case(reqs, bs, HKV, HKV, d, dtype, seed=seed, fill=0.0)
    ks[0][0, 1] = 0  # an all-zero (token, head) row: the scale floor, dequantized to 0
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(math.ceil(s / bs) for _, s in reqs) + 3
    cache = int8_cache(num_blocks, bs, d, layout, fill=SENTINEL)
    write_shuffled(cache, block_table, ks, vs, g)
    written = torch.zeros(num_blocks, bs, dtype=torch.bool)
    for i, (_, s) in enumerate(reqs):
        blk, off = request_slots(block_table, i, s, bs)
        k_q, v_q, scales = read_slots(cache, blk, off)
        for q, x, sc in ((k_q, ks[i], scales[..., 0]), (v_q, vs[i], scales[..., 1])):
            x = x.double()
            want = (x.abs().amax(-1) / 127).clamp_min(attention_kernels.INT8_MIN_SCALE)
            torch.testing.assert_close(sc.double(), want, atol=0, rtol=1e-6)
            assert q.abs().max() <= 127
            err = (q.double() * sc.double()[..., None] - x).abs()
            assert (err <= sc.double()[..., None] * (0.5 + 1e-5)).all()
        written[blk, off] = True
    k_q0, _, s0 = read_slots(cache, *request_slots(block_table, 0, 1, bs))
    assert (k_q0[0, 1] == 0).all() and s0[0, 1, 0] == torch.tensor(1e-8, dtype=torch.float32)
    # Every byte of a slot nobody wrote (padding rows, unowned slots) keeps the sentinel.
    width = 2 * d + 8
    owner = torch.cat([torch.arange(bs).repeat_interleave(d)] * 2
                      + [torch.arange(bs).repeat_interleave(8)])  # page byte -> offset
    page_bytes = cache.reshape(num_blocks, HKV, bs * width)
    untouched = ~written[:, owner][:, None, :].expand_as(page_bytes)
    assert untouched.any() and (page_bytes[untouched] == SENTINEL).all()


def test_static_scales_are_stored_and_used():
    """Given per-layer scales are stored per token, clip, and drive the readers."""
    bs, d, ratio, k_scale, v_scale = 32, 64, 3, 0.02, 0.03  # |x| > 127 * scale clips
    reqs = batch_mix("mixed", bs)
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, ratio, d, torch.float32, "LHBNC",
                                              seed=5, k_scale=k_scale, v_scale=v_scale)
    deq_k, deq_v = [], []
    for i, (_, s) in enumerate(reqs):
        k_q, v_q, scales = read_slots(cache, *request_slots(block_table, i, s, bs))
        assert (scales[..., 0] == torch.tensor(k_scale)).all()
        assert (scales[..., 1] == torch.tensor(v_scale)).all()
        for q, x, sc, deq in ((k_q, ks[i], k_scale, deq_k), (v_q, vs[i], v_scale, deq_v)):
            want = torch.round(x / torch.tensor(sc)).clamp(-127, 127)
            assert torch.equal(q.float(), want)
            deq.append(q.double() * torch.tensor(sc).double())
    assert (ks[0].abs() > 127 * k_scale).any()  # the clip path is exercised
    # Exact-model oracle: attention over the dequantized K/V, at fp32 tolerance.
    scale = d**-0.5
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, deq_k, deq_v)])
    query_start_loc, seq_lens = kernel_args(reqs)
    out = paged_prefill_int8(torch.cat(qs), cache, block_table, query_start_loc, seq_lens, scale)
    torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])
    decode_q = torch.stack([q[-1] for q in qs])
    decode_ref = torch.cat([reference(q[-1:], k, v, scale)
                            for q, k, v in zip(qs, deq_k, deq_v)])
    out = paged_decode_int8(decode_q, cache, block_table, seq_lens, scale)
    torch.testing.assert_close(out.double(), decode_ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs", [16, 64])
def test_int8_matches_bf16_kernel_up_to_quantization(bs, dtype):
    """Same data through both caches: the outputs differ, by no more than the bound."""
    reqs = batch_mix("mixed", bs)
    qs, ks, vs, block_table, cache, plain = build(reqs, bs, 3, 128, dtype, "LBHNC", seed=bs)
    query_start_loc, seq_lens = kernel_args(reqs)
    args = (block_table, query_start_loc, seq_lens, 128**-0.5)
    out_int8 = paged_prefill_int8(torch.cat(qs), cache, *args)
    out_plain = paged_prefill(torch.cat(qs), plain, *args)
    vmax = torch.cat([v.abs().max().double().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    assert not torch.equal(out_int8, out_plain)  # quantization really happened
    assert_within_int8_bound(out_int8, out_plain.double(), vmax, dtype)


def test_int8_kernels_registered():
    assert get_kernel("cache_write_int8", "reference") is attention_kernels.cache_write_int8
    for name in ("paged_decode_int8", "paged_prefill_int8"):
        assert get_kernel(name, "torch_fast") is getattr(attention_kernels, name)
        assert get_kernel(name, "reference").__module__ == "vllm_accel.ops.attention_reference"
