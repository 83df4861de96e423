"""Paged-attention kernels vs. a float64 softmax-attention oracle on unpaged K/V.

Each case builds per-request K/V, scatters them with ``cache_write`` into a cache
pre-filled with garbage through a shuffled (non-contiguous) block table whose unused
columns hold garbage block ids, then checks the kernels against plain attention
over the original tensors. Any read of a slot a request does not own shows up as
a mismatch (garbage is +/-1e4, far outside the tolerances). Caches come in both
physical layouts vLLM may hand the backend: block-major (LBHNC) and head-major
(LHBNC, what the backend asks for), the latter as a strided view.
"""

import itertools
import math

import pytest
import torch

from vllm_accel.ops.cpu_native import attention as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.reference import cache_write as writers
from vllm_accel.ops.torch_fast import attention as torch_fast
from vllm_accel.ops.registry import get_kernel

from covering import case_id, covering
from paged_cases import GQA, HKV, TOL, batch_mix, make_case, read_kv, reference


#: every provider of the readers is held to the same oracle
PROVIDERS = ["reference", "torch_fast", "cpu_native"]


@pytest.fixture(autouse=True, params=PROVIDERS)
def provider(request):
    """Points this module's reader names at one provider's kernels."""
    for name in ['paged_decode', 'paged_prefill']:
        globals()[name] = get_kernel(name, request.param)
    return request.param

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


MIXES = ["decode", "prefill", "prefill_ctx", "mixed"]
BLOCK_SIZES = [16, 32, 64, 128]
HEAD_SIZES = [64, 128]
DTYPES = [torch.float32, torch.bfloat16]
LAYOUTS = ["LBHNC", "LHBNC"]


def test_covering_rows_hold_every_combination_of_three():
    """The reader cases below are a 3-wise covering array of their parameters (48 of
    the 384 combinations per provider for prefill): any three parameters' values meet
    in some case."""
    dims = dict(mix=MIXES, bs=BLOCK_SIZES, ratio=GQA, d=HEAD_SIZES, dtype=DTYPES,
                layout=LAYOUTS)
    rows = covering(3, **dims)
    assert len(rows) < math.prod(map(len, dims.values())) // 4
    for g in itertools.combinations(range(len(dims)), 3):
        want = set(itertools.product(*(list(dims.values())[i] for i in g)))
        assert {tuple(row[i] for i in g) for row in rows} == want, g


@pytest.mark.parametrize("mix,bs,ratio,d,dtype,layout",
                         covering(3, mix=MIXES, bs=BLOCK_SIZES, ratio=GQA, d=HEAD_SIZES,
                                  dtype=DTYPES, layout=LAYOUTS), ids=case_id)
def test_paged_prefill(mix, bs, ratio, d, dtype, layout):
    reqs = batch_mix(mix, bs)
    h = ratio * HKV
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, h, HKV, d, dtype,
                                                  seed=bs * ratio + d, layout=layout)
    scale = d**-0.5
    query_start_loc = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    out = paged_prefill(torch.cat(qs), kv_cache, block_table, query_start_loc, seq_lens, scale)
    assert out.dtype == dtype and out.shape == torch.cat(qs).shape
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("bs,ratio,d,dtype,layout",
                         covering(3, bs=BLOCK_SIZES, ratio=GQA, d=HEAD_SIZES, dtype=DTYPES,
                                  layout=LAYOUTS), ids=case_id)
def test_paged_decode(bs, ratio, d, dtype, layout):
    reqs = batch_mix("decode", bs)
    h = ratio * HKV
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
    assert get_kernel("cache_write", "reference") is writers.cache_write
    for name in ("paged_decode", "paged_prefill"):
        assert get_kernel(name, "torch_fast") is getattr(torch_fast, name)
        assert get_kernel(name, "reference").__module__ == "vllm_accel.ops.reference.attention"
