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
from covering import case_id, covering
from paged_cases import (GQA, HKV, INT8_ERR, TOL, assert_within_int8_bound, batch_mix, build,
                         int8_cache, kernel_args, make_case, read_slots, reference,
                         request_slots, write_shuffled)

from vllm_accel.ops import paged_layout
from vllm_accel.ops.cpu_native import attention as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.reference import cache_write as writers
from vllm_accel.ops.torch_fast import attention as torch_fast
from vllm_accel.ops.registry import get_kernel


#: every provider of the readers is held to the same oracle
PROVIDERS = ["reference", "torch_fast", "cpu_native"]


@pytest.fixture(autouse=True, params=PROVIDERS)
def provider(request):
    """Points this module's reader names at one provider's kernels."""
    for name in ['paged_decode_int8', 'paged_prefill_int8', 'paged_prefill']:
        globals()[name] = get_kernel(name, request.param)
    return request.param

SENTINEL = 0x5A  # byte pre-filled in the write tests: must survive where nothing was written

MIXES = ["decode", "prefill", "prefill_ctx", "mixed"]
BLOCK_SIZES = [16, 32, 64, 128]
HEAD_SIZES = [64, 128]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["LBHNC", "LHBNC"]


@pytest.mark.parametrize("mix,bs,ratio,d,dtype,layout",
                         covering(3, mix=MIXES, bs=BLOCK_SIZES, ratio=GQA, d=HEAD_SIZES,
                                  dtype=DTYPES, layout=LAYOUTS), ids=case_id)
def test_int8_attention_vs_unquantized(mix, bs, ratio, d, dtype, layout):
    """Any three parameters' values meet in some case (a 3-wise covering array: 48 of
    the 384 combinations per provider)."""
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
            want = (x.abs().amax(-1) / 127).clamp_min(paged_layout.INT8_MIN_SCALE)
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
    assert get_kernel("cache_write_int8", "reference") is writers.cache_write_int8
    for name in ("paged_decode_int8", "paged_prefill_int8"):
        assert get_kernel(name, "torch_fast") is getattr(torch_fast, name)
        assert get_kernel(name, "reference").__module__ == "vllm_accel.ops.reference.attention"
