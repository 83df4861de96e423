"""fp8 KV-cache kernels (``--kv-cache-dtype fp8 / fp8_e4m3 / fp8_e5m2``) vs. the
float64 oracle of ``test_attention_kernels``.

The cache is uint8 (as vLLM allocates it) seen by the kernels through a float8
view. Writes must store exactly ``fp8(K / k_scale)``, saturating, and leave every
slot they do not own untouched. Readers are held to the float64 oracle on the
dequantized K/V (``fp8 value * scale``) with the unquantized kernels' tolerance:
the kernels may add no error beyond the format's rounding. The rounding itself is
bounded against the unquantized oracle (``FP8_ERR``), and the engine test checks
the default model's answers teacher-forced.
"""

import pytest
import torch
from paged_cases import GQA, HKV, TOL, batch_mix, make_case, read_kv, reference

from vllm_accel.ops.paged_layout import FP8_KV_FORMATS
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.reference import cache_write as _writers  # noqa: F401  (registers)
from vllm_accel.ops.torch_fast import attention as _torch_fast  # noqa: F401  (registers)
from vllm_accel.ops.registry import get_kernel

cache_write_fp8 = get_kernel("cache_write_fp8", "reference")
PROVIDERS = ["reference", "torch_fast"]
FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: |out - unquantized oracle| <= FP8_ERR * max|V| + TOL: e4m3 keeps 3 mantissa
#: bits (relative rounding <= 1/16), e5m2 2 (<= 1/8); measured worst over the
#: cases below: 0.024 (e4m3), 0.050 (e5m2), so ~2x margin.
FP8_ERR = {"e4m3": 0.05, "e5m2": 0.1}
SENTINEL = 0x5A


def fp8_case(mix, bs, ratio, d, dtype, fmt, seed, k_scale, v_scale, fill=None):
    """make_case's data written into a uint8 cache through cache_write_fp8."""
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, float_cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                                     seed=seed, fill=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    shape = (HKV, float_cache.shape[0], bs, 2 * d)  # head-major, as the backend asks
    if fill is None:
        top = torch.finfo(FORMATS[fmt]).max  # finite garbage up to the format's largest
        cache = (torch.rand(shape, generator=g) * 2 * top - top).to(FORMATS[fmt]).view(torch.uint8)
    else:
        cache = torch.full(shape, fill, dtype=torch.uint8)
    cache = cache.transpose(0, 1)
    slots = []
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s)
        slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
    slot_mapping = torch.cat(slots + [torch.full((3,), -1, dtype=torch.long)])
    pad = torch.randn(3, HKV, d, generator=g).to(dtype)
    order = torch.randperm(len(slot_mapping), generator=g)
    key, value = torch.cat(ks + [pad]), torch.cat(vs + [pad])
    cache_write_fp8(key[order], value[order], cache.view(FORMATS[fmt]), slot_mapping[order],
                    k_scale, v_scale)
    return reqs, qs, ks, vs, block_table, cache


def dequantized(x, fmt, scale):
    top = torch.finfo(FORMATS[fmt]).max
    return (x.double() / scale).clamp(-top, top).to(FORMATS[fmt]).double() * scale


def test_vllm_cache_dtypes_map_to_their_formats():
    assert FP8_KV_FORMATS == {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                              "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_write_stores_scaled_saturated_fp8(fmt, dtype):
    bs, d = 16, 64
    # k_scale small enough that some |K| / k_scale pass the format's largest value
    k_scale = 2.5 / torch.finfo(FORMATS[fmt]).max
    reqs, _, ks, vs, block_table, cache = fp8_case("mixed", bs, 1, d, dtype, fmt, seed=3,
                                                   k_scale=k_scale, v_scale=0.5,
                                                   fill=SENTINEL)
    view = cache.view(FORMATS[fmt])
    written = torch.zeros(cache.shape[0], bs, dtype=torch.bool)
    saturated = 0
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s)
        blk, off = block_table[i, pos // bs].long(), pos % bs
        k, v = read_kv(view, blk, off, d)
        assert torch.equal(k.double() * k_scale, dequantized(ks[i], fmt, k_scale))
        assert torch.equal(v.double() * 0.5, dequantized(vs[i], fmt, 0.5))
        saturated += int((k.float().abs() == torch.finfo(FORMATS[fmt]).max).sum())
        written[blk, off] = True
    assert saturated > 0  # the case exercises saturation (no inf, no NaN)
    untouched = cache.reshape(-1, HKV, 2, bs, d).permute(0, 3, 1, 2, 4)[~written]
    assert (untouched == SENTINEL).all()


@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix,bs,ratio,d", [("decode", 16, 3, 64), ("prefill_ctx", 32, 1, 128),
                                            ("mixed", 64, 8, 64)])
def test_fp8_attention_vs_float64(provider, fmt, dtype, mix, bs, ratio, d):
    k_scale, v_scale = 0.02, 0.05
    reqs, qs, ks, vs, block_table, cache = fp8_case(mix, bs, ratio, d, dtype, fmt,
                                                    seed=bs + ratio + d, k_scale=k_scale,
                                                    v_scale=v_scale)
    view, scale = cache.view(FORMATS[fmt]), d**-0.5
    query_start_loc = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    prefill = get_kernel("paged_prefill_fp8", provider)
    out = prefill(torch.cat(qs), view, block_table, query_start_loc, seq_lens, scale,
                  k_scale, v_scale)
    assert out.dtype == dtype
    exact = torch.cat([reference(q, dequantized(k, fmt, k_scale), dequantized(v, fmt, v_scale),
                                 scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), exact, **TOL[dtype])
    unquantized = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    vmax = max(v.abs().max().item() for v in vs)
    assert ((out.double() - unquantized).abs().max() / vmax).item() <= FP8_ERR[fmt]
    if mix == "decode":
        decode = get_kernel("paged_decode_fp8", provider)
        out = decode(torch.cat(qs), view, block_table, seq_lens, scale, k_scale, v_scale)
        torch.testing.assert_close(out.double(), exact, **TOL[dtype])
