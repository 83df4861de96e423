"""The ``triton`` provider's kernels vs. float64 oracles (collected through
``test_triton_kernels.py``, which says where they run).

Attention cases come from ``paged_cases`` (shuffled block tables with garbage
columns, garbage-filled caches, padded slot mappings; both physical layouts) and
are written on the host by the reference writers, then moved to the device. The
cross product is trimmed to a list of cases that still covers every block size
(16..128), GQA ratio (1, 3, 8), head size (64, 128 and 80/96 beyond the powers of
two), dtype, the INT8 cache (dynamic and static scales) and multi-partition decode.
"""

import math
import os

import pytest
import torch

from mla_cases import TOL as MLA_TOL, absorbed_oracle, latent_case
from paged_cases import (HKV, INT8_ERR, TOL, alibi_slopes, assert_within_int8_bound,
                         batch_mix, build, free_before_window, kernel_args, make_case,
                         reference)

from vllm_accel.ops.reference import moe as reference_moe
from vllm_accel.ops.triton import int8_gemm, mla, moe, paged_attention, wint_gemm

DEVICE = os.environ.get("ACCEL_TEST_DEVICE", "cpu")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: (mix, block size, GQA ratio, head size, layout): every value of each axis at least twice
ATTENTION_CASES = [
    ("prefill", 16, 1, 64, "LHBNC"), ("prefill_ctx", 16, 8, 128, "LBHNC"),
    ("mixed", 32, 3, 64, "LHBNC"), ("prefill_ctx", 64, 3, 128, "LHBNC"),
    ("mixed", 128, 8, 64, "LBHNC"), ("prefill", 128, 1, 128, "LHBNC"),
    ("mixed", 64, 1, 80, "LHBNC"), ("prefill_ctx", 32, 8, 96, "LBHNC"),
]


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


def _check(out, expected, dtype):
    assert out.dtype == dtype and out.shape == expected.shape
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mix,bs,ratio,d,layout", ATTENTION_CASES)
def test_paged_prefill(mix, bs, ratio, d, layout, dtype):
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                               seed=bs * ratio + d, layout=layout)
    qsl, seq_lens = kernel_args(reqs)
    query = torch.cat(qs + [torch.full((3, ratio * HKV, d), 7.0).to(dtype)])  # padded rows
    query, cache, block_table, seq_lens = on_device(query, cache, block_table, seq_lens)
    out = paged_attention.paged_prefill(query, cache, block_table, qsl, seq_lens, d**-0.5)
    expected = torch.cat([reference(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs)])
    _check(out[:-3], expected, dtype)
    assert (out[-3:] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bs,ratio,d,layout", [(16, 3, 64, "LBHNC"), (64, 8, 128, "LHBNC"),
                                               (128, 1, 96, "LHBNC"), (32, 1, 128, "LBHNC")])
def test_paged_decode(bs, ratio, d, layout, dtype):
    """Includes a padded slot (seq_len 0 -> zeros) and a non-contiguous query."""
    reqs = batch_mix("decode", bs)
    qs, ks, vs, block_table, cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                               seed=bs + ratio * d, layout=layout)
    seq_lens = torch.tensor([s for _, s in reqs] + [0], dtype=torch.int32)
    block_table = torch.cat([block_table, block_table[:1]])
    qkv = torch.cat([torch.cat(qs + [qs[0]]), torch.zeros(len(reqs) + 1, ratio * HKV, d,
                                                           dtype=dtype)], dim=-1)
    qkv, cache, block_table, seq_lens = on_device(qkv, cache, block_table, seq_lens)
    out = paged_attention.paged_decode(qkv[..., :d], cache, block_table, seq_lens, d**-0.5)
    expected = torch.cat([reference(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs)])
    _check(out[:-1], expected, dtype)
    assert (out[-1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_long_context_spans_partitions(dtype):
    """Contexts longer than a partition: the split programs' states are merged."""
    bs, d = 64, 64
    reqs = [(1, paged_attention.PARTITION * 2 + 37), (1, 5), (1, paged_attention.PARTITION)]
    qs, ks, vs, block_table, cache = make_case(reqs, bs, 4 * HKV, HKV, d, dtype, seed=3)
    assert block_table.shape[1] * bs > 2 * paged_attention.PARTITION
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    out = paged_attention.paged_decode(query, cache, block_table, seq_lens, d**-0.5)
    expected = torch.cat([reference(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs)])
    _check(out, expected, dtype)


def _features(name: str, bs: int, h: int) -> dict:
    """The model features of ``reference/attention.py``; windows on and across block
    boundaries (the blocks before them freed to a NaN null block by the cases)."""
    sinks = torch.randn(h, generator=torch.Generator().manual_seed(h)) * 2
    return {"window": {"sliding_window": bs},
            "window,soft_cap": {"sliding_window": bs + 5, "logits_soft_cap": 5.0},
            "alibi": {"alibi_slopes": alibi_slopes(h)},
            "sinks,window": {"sinks": sinks, "sliding_window": 2 * bs - 3},
            "soft_cap": {"logits_soft_cap": 5.0}}[name]


FEATURE_CASES = ["window", "window,soft_cap", "alibi", "sinks,window", "soft_cap"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", ["decode", "prefill_ctx", "mixed"])
@pytest.mark.parametrize("features", FEATURE_CASES)
def test_features(features, mix, dtype):
    bs, ratio, d = 16, 3, 64
    reqs = batch_mix(mix, bs)
    f = _features(features, bs, ratio * HKV)
    qs, ks, vs, block_table, cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype, seed=11)
    if "sliding_window" in f:
        free_before_window(cache, block_table, reqs, f["sliding_window"])
    qsl, seq_lens = kernel_args(reqs)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in f.items()}
    if mix == "decode":
        out = paged_attention.paged_decode(query, cache, block_table, seq_lens, d**-0.5, **dev)
    else:
        out = paged_attention.paged_prefill(query, cache, block_table, qsl, seq_lens, d**-0.5,
                                            **dev)
    _check(out, torch.cat([reference(q, k, v, d**-0.5, **f) for q, k, v in zip(qs, ks, vs)]),
           dtype)


@pytest.mark.parametrize("features", ["sinks,window", "alibi"])
def test_features_across_decode_partitions(features):
    """A window and sinks (or ALiBi) over contexts longer than a partition: the
    partitions start at the window's (the last request's window begins in its second
    partition), the merge adds the sink."""
    bs, d, dtype = 64, 64, torch.float32
    reqs = [(1, paged_attention.PARTITION * 2 + 37), (1, 5), (1, paged_attention.PARTITION),
            (1, paged_attention.PARTITION * 3 + 37)]
    f = _features(features, bs, 4 * HKV)
    if "sliding_window" in f:
        f["sliding_window"] = paged_attention.PARTITION + 100
    qs, ks, vs, block_table, cache = make_case(reqs, bs, 4 * HKV, HKV, d, dtype, seed=3)
    if "sliding_window" in f:
        free_before_window(cache, block_table, reqs, f["sliding_window"])
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in f.items()}
    out = paged_attention.paged_decode(query, cache, block_table, seq_lens, d**-0.5, **dev)
    _check(out, torch.cat([reference(q, k, v, d**-0.5, **f) for q, k, v in zip(qs, ks, vs)]),
           dtype)


@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_int8_cache_with_features(mix):
    bs, ratio, d, dtype = 16, 3, 64, torch.bfloat16
    reqs = batch_mix(mix, bs)
    f = _features("sinks,window", bs, ratio * HKV)
    f["logits_soft_cap"] = 5.0
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, ratio, d, dtype, "LHBNC", seed=5)
    free_before_window(cache, block_table, reqs, f["sliding_window"])
    expected = torch.cat([reference(q, k, v, d**-0.5, **f) for q, k, v in zip(qs, ks, vs)])
    vmax = torch.cat([v.abs().max().double().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    qsl, seq_lens = kernel_args(reqs)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    dev = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in f.items()}
    if mix == "decode":
        out = paged_attention.paged_decode(query, cache, block_table, seq_lens, d**-0.5, **dev)
    else:
        out = paged_attention.paged_prefill(query, cache, block_table, qsl, seq_lens, d**-0.5,
                                            **dev)
    assert_within_int8_bound(out.cpu(), expected, vmax, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix,bs,ratio,d,layout", [
    ("mixed", 16, 3, 128, "LHBNC"), ("prefill_ctx", 128, 8, 64, "LBHNC"),
    ("decode", 64, 1, 128, "LHBNC"), ("decode", 32, 8, 64, "LBHNC")])
def test_int8_cache(mix, bs, ratio, d, layout, dtype):
    """Against the unquantized oracle within the INT8 bound the torch kernels meet."""
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, ratio, d, dtype, layout,
                                              seed=bs * ratio + d)
    scale = d**-0.5
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    vmax = torch.cat([v.abs().max().double().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    qsl, seq_lens = kernel_args(reqs)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    if mix == "decode":
        out = paged_attention.paged_decode(query, cache, block_table, seq_lens, scale)
    else:
        out = paged_attention.paged_prefill(query, cache, block_table, qsl, seq_lens, scale)
    assert out.dtype == dtype
    assert_within_int8_bound(out.cpu(), expected, vmax, dtype)


@pytest.mark.parametrize("dtype,v_size", [(torch.bfloat16, 1.0), (torch.float16, 1.0),
                                          (torch.bfloat16, 1e-6)])
def test_int8_decode_quantized_query_spans_partitions(dtype, v_size):
    """16-bit queries on an INT8 cache take the int8 Q.K^T decode (query rounded to
    int8 per head); a context past PARTITION_INT8 is split and merged. V scaled to
    1e-6 (products with the probabilities far below fp16's smallest normal) must
    keep its relative accuracy."""
    bs, d = 64, 128
    reqs = [(1, paged_attention.PARTITION_INT8 + 37), (1, 5), (1, 2 * bs + 3)]
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, 4, d, dtype, "LHBNC", seed=11)
    assert block_table.shape[1] * bs > paged_attention.PARTITION_INT8
    pages = cache.transpose(0, 1).reshape(-1, cache.shape[2] * cache.shape[3])
    pages[:, 2 * bs * d:].view(torch.float32)[:, 1::2] *= v_size  # every v_scale
    vs = [v.double() * v_size for v in vs]
    expected = torch.cat([reference(q, k, v, d**-0.5) for q, k, v in zip(qs, ks, vs)])
    vmax = torch.cat([v.abs().max().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    _, seq_lens = kernel_args(reqs)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    out = paged_attention.paged_decode(query, cache, block_table, seq_lens, d**-0.5)
    assert out.dtype == dtype
    error = ((out.cpu().double() - expected).abs() / vmax).max()
    assert error <= INT8_ERR + TOL[dtype]["rtol"], f"error {error:.4f} * max|V|"


def test_int8_cache_static_scales_exact():
    """Static per-layer scales: exact against attention over the dequantized codes."""
    bs, d, k_scale, v_scale = 32, 64, 0.02, 0.03
    reqs = batch_mix("mixed", bs)
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, 3, d, torch.float32, "LHBNC", seed=5,
                                              k_scale=k_scale, v_scale=v_scale)
    def dequant(x, s):
        return torch.round(x.double() / s).clamp(-127, 127) * s
    expected = torch.cat([reference(q, dequant(k, k_scale), dequant(v, v_scale), d**-0.5)
                          for q, k, v in zip(qs, ks, vs)])
    qsl, seq_lens = kernel_args(reqs)
    query, cache, block_table, seq_lens = on_device(torch.cat(qs), cache, block_table, seq_lens)
    out = paged_attention.paged_prefill(query, cache, block_table, qsl, seq_lens, d**-0.5)
    _check(out, expected, torch.float32)


# ---------------------------------------------------------------------------
# Weight-only integer GEMM on the resident layout
# ---------------------------------------------------------------------------


def resident(out_f, in_f, bits, group_size, asym, act_order, seed):
    """Random resident tensors (quant/packed.py's layout) and the float64 weight
    ``[out, in]`` in checkpoint column order they encode."""
    g = torch.Generator().manual_seed(seed)
    gs = in_f if group_size == -1 else group_size
    codes = torch.randint(0, 2**bits, (out_f, in_f), generator=g)
    scales = (torch.rand(out_f, in_f // gs, generator=g) * 0.02 + 0.001).half()
    zeros = (torch.randint(0, 2**bits, (out_f, in_f // gs), generator=g).half() if asym
             else None)
    perm = torch.randperm(in_f, generator=g) if act_order else None
    g_idx = (perm // gs).to(torch.int32) if act_order else None
    group = g_idx.long() if act_order else torch.arange(in_f) // gs
    z = zeros.double()[:, group] if asym else 2.0 ** (bits - 1)
    w_resident = (codes.double() - z) * scales.double()[:, group]
    w = torch.empty_like(w_resident)
    w[:, perm if act_order else torch.arange(in_f)] = w_resident
    c = codes.to(torch.uint8)
    qweight = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous() if bits == 4 else c
    return dict(qweight=qweight, scales=scales, zeros=zeros, perm=perm, g_idx=g_idx,
                group_size=gs), w


WINT_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("bits,group_size,asym,act_order,dtype,in_f", [
    (4, 32, False, False, torch.float32, 256), (4, 128, True, False, torch.bfloat16, 512),
    (4, 64, False, True, torch.float16, 256), (4, -1, True, True, torch.bfloat16, 256),
    (8, 128, False, False, torch.bfloat16, 256), (8, -1, True, False, torch.float32, 256),
    (8, 32, True, True, torch.float16, 256),
    (4, 128, False, False, torch.float16, 256),  # batch 40: planes interleaved, one dot
    # rows that are not whole int32 words: the byte kernels (GEMV and tl.dot forms)
    (4, -1, True, False, torch.bfloat16, 250), (8, 50, True, True, torch.float32, 250)])
def test_wint_linear(m, bits, group_size, asym, act_order, dtype, in_f):
    out_f = 96
    res, w = resident(out_f, in_f, bits, group_size, asym, act_order, seed=bits + m)
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, in_f, generator=g).to(dtype)
    bias = torch.randn(out_f, generator=g)
    expected = x.double() @ w.T + bias.double()
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    y = wint_gemm.wint_linear(x.to(DEVICE), args.pop("qweight"), args.pop("scales"),
                              args.pop("zeros"), bits=bits, bias=bias.to(DEVICE), **args)
    assert y.dtype == dtype and y.shape == (m, out_f)
    err = ((y.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert err <= WINT_TOL[dtype], err


@pytest.mark.parametrize("bits,group_size,asym,dtype,out_f", [
    (4, 128, True, torch.bfloat16, 96), (8, 64, False, torch.float32, 48),
    (4, 32, False, torch.float16, 200)])  # 200 rows (not a multiple of 16): the tl.dot kernel
def test_wint_gemv_split_k(bits, group_size, asym, dtype, out_f, monkeypatch):
    """Batch 1 over a long K: the word GEMV splits K across programs that meet in a
    float32 workspace; the last one writes the row tile and leaves the workspace at
    zero, so a second call (other x) is exact too."""
    monkeypatch.setattr(wint_gemm, "_SPLIT_WORKSPACE", {})
    in_f = 2048
    res, w = resident(out_f, in_f, bits, group_size, asym, False, seed=bits + out_f)
    args = {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    qweight, scales, zeros = args.pop("qweight"), args.pop("scales"), args.pop("zeros")
    g = torch.Generator().manual_seed(out_f)
    bias = torch.randn(out_f, generator=g)
    for _ in range(2):
        x = torch.randn(1, in_f, generator=g).to(dtype)
        expected = x.double() @ w.T + bias.double()
        y = wint_gemm.wint_linear(x.to(DEVICE), qweight, scales, zeros, bits=bits,
                                  bias=bias.to(DEVICE), **args)
        err = ((y.cpu().double() - expected).abs().max() / expected.abs().max()).item()
        assert y.dtype == dtype and err <= WINT_TOL[dtype], err
    mine = [t for key, ws in wint_gemm._SPLIT_WORKSPACE.items() if key[1] == out_f for t in ws]
    assert bool(mine) == (out_f % 16 == 0) and all(not t.any() for t in mine)


def test_probe_rejects_a_device_whose_gemv_is_wrong(monkeypatch):
    """The card probe runs the batch-1 GEMV too: a device that flushed float32
    subnormals would zero its codes, and one whose Triton backend cannot build the
    kernel must not stop the worker: both keep the torch kernels."""
    from vllm_accel.ops.triton import provider

    usable, why = provider.probe_triton(torch.device(DEVICE))
    assert usable, why
    monkeypatch.setattr(wint_gemm, "wint_linear", lambda x, *a, **k: torch.zeros_like(x[:, :16]))
    usable, why = provider.probe_triton(torch.device(DEVICE))
    assert not usable and "wint_linear" in why and "subnormals" in why

    def no_atomics(*args, **kwargs):
        raise RuntimeError("atomic_add: unsupported\nmore")
    monkeypatch.setattr(wint_gemm, "wint_linear", no_atomics)
    usable, why = provider.probe_triton(torch.device(DEVICE))  # a broken backend: no raise
    assert not usable and why.endswith("(RuntimeError: atomic_add: unsupported)")


# ---------------------------------------------------------------------------
# W8A8 int8 GEMM with per-token activation quantization
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 70])
@pytest.mark.parametrize("mode", ["dynamic", "static", "static_asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear(m, mode, dtype):
    n, k = 80, 160
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    w_scale = torch.rand(n, generator=g) * 0.01 + 1e-4
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g)
    xd = x.double()
    if mode == "dynamic":  # float64 oracle of per-token symmetric quantization
        s = xd.abs().amax(1, keepdim=True) / 127
        xq, s_in, zp = torch.round(xd / s).clamp(-127, 127) * s, None, None
    else:
        s = torch.tensor(0.02)
        zp = torch.tensor(5, dtype=torch.int32) if mode == "static_asym" else None
        q = torch.round(xd / s.double()) + (5 if zp is not None else 0)
        xq = (q.clamp(-128, 127) - (5 if zp is not None else 0)) * s.double()
        s_in = s
    expected = xq @ (w.double() * w_scale.double()[:, None]).T + bias.double()
    col_sums = w.to(torch.int32).sum(1) if zp is not None else None
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y = int8_gemm.int8_linear(x.to(DEVICE), w.to(DEVICE), w_scale.to(DEVICE),
                              input_scale=dev(s_in), input_zero_point=dev(zp),
                              weight_col_sums=dev(col_sums), bias=bias.to(DEVICE))
    assert y.dtype == dtype and y.shape == (m, n)
    # one code of rounding at a tie (fp32 vs float64 scale) moves a product by s * |w|
    bound = 1e-5 if dtype == torch.float32 else 8e-3
    err = ((y.cpu().double() - expected).abs().max() / expected.abs().max()).item()
    assert err <= bound, err
    assert math.isfinite(err)


#: (kv_lora_rank, rope, heads, block size, dtype): DeepSeek-V2/V3's 512 + 64 and
#: smaller latents (448: not a power of two), MQA over 1..128 heads
MLA_CASES = [(512, 64, 16, 16, torch.bfloat16), (256, 64, 1, 64, torch.float32),
             (448, 64, 20, 16, torch.float16), (512, 64, 128, 64, torch.float32)]


@pytest.mark.parametrize("lora,rope,heads,bs,dtype", MLA_CASES)
def test_mla_decode(lora, rope, heads, bs, dtype):
    """Absorbed MLA decode vs float64 over the original latents (test_mla_kernels'
    cases: garbage-filled cache, shuffled block tables, a context past one split, a
    padded request of length 0)."""
    seq_lens = [1, bs + 1, mla.SPLIT_KEYS + 37, 45]
    latents, table, cache = latent_case(seq_lens, bs, lora, rope, dtype, seed=heads + lora)
    table = torch.cat([table, table[:1]])  # a padded request
    g = torch.Generator().manual_seed(3)
    b = len(seq_lens) + 1
    q_nope = torch.randn(b, heads, lora, generator=g).to(dtype)
    q_pe = torch.randn(heads, b, 2 * rope, generator=g).to(dtype).transpose(0, 1)[..., :rope]
    scale = (lora + rope) ** -0.5
    q_nope_d, q_pe_d, cache_d, table_d = on_device(q_nope, q_pe, cache, table)
    out = mla.mla_decode(q_nope_d, q_pe_d, cache_d, table_d,
                         torch.tensor(seq_lens + [0], dtype=torch.int32, device=DEVICE), scale)
    assert out.shape == (b, heads, lora) and out.dtype == dtype
    assert (out[-1] == 0).all()
    tol = MLA_TOL.get(dtype, dict(atol=2e-3, rtol=2e-3))
    torch.testing.assert_close(out[:-1].cpu().double(),
                               absorbed_oracle(q_nope[:-1], q_pe[:-1], latents, lora, scale), **tol)


#: unit roundoff of each dtype (the MoE bound: test_moe_kernels._max_error)
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
#: (tokens, experts, hidden, intermediate, top_k): widths off the 64-wide tiles (48, 24,
#: 80), more pairs than one block per expert, a token count that is not a block's
MOE_SHAPES = [(1, 8, 64, 32, 2), (7, 8, 48, 24, 2), (45, 16, 128, 80, 4), (0, 4, 32, 16, 2)]


def _moe_case(m, e, h, i, k, dtype, seed, bias=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=g) * i ** -0.5).to(dtype)
    b13 = (torch.randn(e, 2 * i, generator=g) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(e, h, generator=g) * 0.1).to(dtype) if bias else None
    weights, ids = reference_moe.route(torch.randn(m, e, generator=g) * 2, k, renormalize=True)
    return x, w13, w2, b13, b2, weights, ids


def _assert_moe_close(got, want, dtype, k):
    assert got.shape == want.shape and got.dtype == dtype
    if got.numel():
        bound = (7 * k + 1) * UNIT[dtype] if dtype != torch.float32 else 1e-5
        scale = want.double().abs().amax(dim=1, keepdim=True)
        err = (got.cpu().double() - want.double()).abs()
        assert bool((err <= bound * scale).all()), float((err / scale).max())


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", MOE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh"])
def test_moe_experts(dtype, shape, activation):
    """The fused experts vs the float64 oracle, within test_moe_kernels' bound."""
    m, e, h, i, k = shape
    x, w13, w2, _, _, weights, ids = _moe_case(m, e, h, i, k, dtype, seed=m + e + h + i)
    got = moe.moe_experts(*on_device(x, w13, w2, weights, ids), activation=activation)
    want = reference_moe.moe_experts(x, w13, w2, weights, ids, activation=activation)
    _assert_moe_close(got, want, dtype, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
def test_moe_expert_map_bias_and_weight_on_input(dtype):
    """Expert parallel (experts 1, 3, 4, 6 of 8 held here: the others' choices add
    nothing), expert biases, and the router weight on the input (Llama 4's top-1)."""
    m, e, h, i = 37, 8, 64, 48
    held = [1, 3, 4, 6]
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(len(held), dtype=torch.int32)
    for k, on_input in ((2, False), (1, True)):
        x, w13, w2, b13, b2, weights, ids = _moe_case(m, e, h, i, k, dtype, seed=k, bias=True)
        got = moe.moe_experts(*on_device(x, w13[held], w2[held], weights, ids),
                              expert_map=expert_map.to(DEVICE),
                              apply_router_weight_on_input=on_input,
                              w13_bias=b13[held].to(DEVICE), w2_bias=b2[held].to(DEVICE))
        mask = torch.isin(ids, torch.tensor(held))
        want = reference_moe.moe_experts(x, w13, w2, weights * mask, ids,
                                         apply_router_weight_on_input=on_input,
                                         w13_bias=b13, w2_bias=b2)
        if on_input:  # a zero-weighted input still passes the biases: drop those rows
            want = torch.where(mask.any(1, keepdim=True), want, torch.zeros_like(want))
        _assert_moe_close(got, want, dtype, 2)


def test_moe_align_pairs_pads_each_expert_and_skips_the_others():
    """Every local pair appears once, in its expert's run of whole blocks; pairs of
    experts held elsewhere nowhere; blocks past the last run have no expert."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 6, (23, 3), generator=g, dtype=torch.int32)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)
    rows, blocks = moe.align_pairs(ids.to(DEVICE), expert_map.to(DEVICE), 4, block_m=4)
    rows, blocks = rows.cpu(), blocks.cpu()
    pairs = ids.numel()
    slot = expert_map.long()[ids.long()].reshape(-1)
    assert sorted(rows[rows < pairs].tolist()) == torch.nonzero(slot >= 0).flatten().tolist()
    for b, expert in enumerate(blocks.tolist()):
        block = rows[4 * b:4 * b + 4]
        real = block[block < pairs].long()
        if expert < 0:
            assert real.numel() == 0
        else:
            assert bool((slot[real] == expert).all())
    assert blocks.tolist() == sorted(blocks.tolist(), key=lambda v: (v < 0, v))


@pytest.mark.parametrize("m,top_k,experts,held,block_m", [
    (1, 8, 128, 128, 16), (23, 3, 6, 4, 4), (45, 4, 16, 16, 16), (7, 2, 64, 20, 32),
    (512, 8, 128, 128, 16)])
def test_moe_align_pairs_in_one_program_matches_the_torch_ops(m, top_k, experts, held,
                                                              block_m):
    """The one-program alignment (decode batches up to ALIGN_MAX_PAIRS pairs) gives the
    torch ops' rows and block experts exactly: the same stable order by expert, with
    and without an expert map (experts held elsewhere dropped)."""
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, experts, (m, top_k), generator=g, dtype=torch.int32)
    cases = [(None, experts)]
    if held < experts:
        slots = torch.full((experts,), -1, dtype=torch.int32)
        slots[torch.randperm(experts, generator=g)[:held]] = torch.arange(held, dtype=torch.int32)
        cases.append((slots, held))
    assert m * top_k <= moe.ALIGN_MAX_PAIRS
    for expert_map, local in cases:
        args = (*on_device(ids), None if expert_map is None else on_device(expert_map)[0], local)
        rows, blocks = moe.align_pairs(*args, block_m=block_m)
        want_rows, want_blocks = moe.align_pairs_torch(*args, block_m=block_m)
        assert torch.equal(blocks.cpu(), want_blocks.cpu())
        assert torch.equal(rows.cpu(), want_rows.cpu())


class _ResidentLinear(torch.nn.Module):
    """A stand-in for the weight-only module of ``quant/packed.py`` (InstalledWInt) in
    its generic layout: codes (4-bit nibbles, even column low, or bytes), scales and
    zero points per group; ``forward`` is the dequantized matmul in float64."""

    def __init__(self, codes, scales, zeros, bits, group_size):
        super().__init__()
        self.provider, self.bits, self.group_size = None, bits, group_size
        self.out_features = codes.shape[0]
        packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)) if bits == 4 else codes
        self.qweight = torch.nn.Parameter(packed.to(torch.uint8).contiguous(),
                                          requires_grad=False)
        self.scales = torch.nn.Parameter(scales, requires_grad=False)
        self.zeros = None if zeros is None else torch.nn.Parameter(zeros, requires_grad=False)
        self.perm = self.g_idx = None
        k = codes.shape[1]  # the last group may be partial
        z = float(2 ** (bits - 1)) if zeros is None else zeros.double().repeat_interleave(
            group_size, 1)[:, :k]
        self.dense = (codes.double() - z) * scales.double().repeat_interleave(
            group_size, 1)[:, :k]

    def forward(self, x, bias=None):
        y = x.double() @ self.dense.T
        return (y if bias is None else y + bias.double()).to(x.dtype)


def _resident_experts(e, n, k, bits, group_size, asym, g):
    mods = []
    for _ in range(e):
        codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.int16)
        groups = -(-k // group_size)
        scales = (torch.rand(n, groups, generator=g) * 0.02 + 0.005).half()
        zeros = (torch.randint(0, 2 ** bits, (n, groups), generator=g).half()
                 if asym else None)
        mods.append(_ResidentLinear(codes, scales, zeros, bits, group_size))
    return torch.nn.ModuleList(mods)


#: (bits, group size, asymmetric) of the weight-only expert cases
QUANT_EXPERTS = [(4, 32, True), (4, 64, False), (4, 128, True), (4, 256, False),
                 (8, 16, False), (8, 128, True)]


def _gemv_calls(monkeypatch) -> list:
    """The matrix-vector launches ``moe._fused`` makes from now on (one entry each)."""
    calls, gemv = [], moe._gemv
    monkeypatch.setattr(moe, "_gemv", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    return calls


def _check_quant_experts(bits, group_size, asym, dtype, m):
    e, h, i, k = 6, 192, 128, 2  # tiled: 2 steps of 128 (the last partial) and 1
    g = torch.Generator().manual_seed(bits + group_size)
    w13 = _resident_experts(e, 2 * i, h, bits, group_size, asym, g)
    w2 = _resident_experts(e, h, i, bits, group_size, asym, g)
    x = torch.randn(m, h, generator=g).to(dtype)
    weights, ids = reference_moe.route(torch.randn(m, e, generator=g) * 2, k, renormalize=True)
    want = reference_moe.moe_quant_experts(x, w13, w2, weights, ids)
    for mod in (*w13, *w2):
        mod.to(DEVICE)
    got = moe.moe_quant_experts(*on_device(x), w13, w2, *on_device(weights, ids))
    _assert_moe_close(got, want.double(), dtype, k)
    stack = w13.__dict__["_accel_triton_stack"]
    assert w13[1].qweight.data_ptr() == stack.weight[1].data_ptr()
    again = moe.moe_quant_experts(*on_device(x), w13, w2, *on_device(weights, ids))
    assert torch.equal(again, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("bits,group_size,asym", QUANT_EXPERTS)
def test_moe_quant_experts(bits, group_size, asym, dtype, monkeypatch):
    """Weight-only experts fused through the tiled kernels, vs the float64 matmuls of
    the dequantized weights, in float32, bf16 and fp16: groups smaller than a reduction
    step (4-bit asym g32, 8-bit sym g16: each weight dequantized as loaded) and groups
    that hold whole steps (4-bit asym g128 with a partial last group, 8-bit asym g128,
    4-bit sym g256 wider than the inputs: products on the codes offset to exact
    bf16/fp16 integers, the zero point and scale applied to each step's sum; 4-bit sym
    g64 is either, by ``BLOCK_K``). The stack is built once and the modules then hold
    views of it."""
    monkeypatch.setattr(moe, "GEMV_MAX_PAIRS", 0)
    _check_quant_experts(bits, group_size, asym, dtype, m=23)


@pytest.mark.parametrize("case", range(len(QUANT_EXPERTS)))
def test_moe_quant_experts_matrix_vector(case, monkeypatch):
    """The same experts in a decode batch (12 pairs), through the matrix-vector
    kernels, each dtype over two of the cases: steps that hold several groups (g16,
    g32, g64; their scales past the inputs masked) or lie in one (g128, g256). (The
    interpreter's launch, ``moe.INTERPRETED_GEMV_TILES``, has 128-input steps over the
    192 and 128 inputs; a GPU's, the steps ``moe.GEMV_TILES`` give.)"""
    bits, group_size, asym = QUANT_EXPERTS[case]
    calls = _gemv_calls(monkeypatch)
    _check_quant_experts(bits, group_size, asym, DTYPES[case % 3], m=6)
    assert len(calls) == 2  # the check's two calls


@pytest.mark.parametrize("gemv", [True, False], ids=["matrix-vector", "tiled"])
def test_moe_quant_experts_expert_map_bias_and_weight_on_input(gemv, monkeypatch):
    """Quantized experts (4-bit asym g32) in a decode batch, held here for experts 1,
    3, 4, 6 of 8 (the others' pairs add nothing), with expert biases, and the router
    weight on the input (top-1) or on the output (top-2): through the matrix-vector
    kernels and the tiled ones, vs the float64 reference on the held modules."""
    if not gemv:
        monkeypatch.setattr(moe, "GEMV_MAX_PAIRS", 0)
    calls = _gemv_calls(monkeypatch)
    m, e, h, i, dtype = 5, 8, 192, 128, torch.bfloat16
    held = [1, 3, 4, 6]
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(len(held), dtype=torch.int32)
    g = torch.Generator().manual_seed(11)
    w13 = _resident_experts(len(held), 2 * i, h, 4, 32, True, g)
    w2 = _resident_experts(len(held), h, i, 4, 32, True, g)
    b13 = (torch.randn(len(held), 2 * i, generator=g) * 0.1).to(dtype)
    b2 = (torch.randn(len(held), h, generator=g) * 0.1).to(dtype)
    cases = []
    for k, on_input in ((2, False), (1, True)):
        x = torch.randn(m, h, generator=g).to(dtype)
        weights, ids = reference_moe.route(torch.randn(m, e, generator=g) * 2, k,
                                           renormalize=k > 1)
        assert not torch.isin(ids, torch.tensor(held)).all()  # some pairs held elsewhere
        rules = dict(apply_router_weight_on_input=on_input)
        want = reference_moe.moe_quant_experts(x, w13, w2, weights, ids, expert_map=expert_map,
                                               w13_bias=b13, w2_bias=b2, **rules)
        cases.append((x, weights, ids, rules, want, k))
    for mod in (*w13, *w2):
        mod.to(DEVICE)
    for x, weights, ids, rules, want, k in cases:
        got = moe.moe_quant_experts(*on_device(x), w13, w2, *on_device(weights, ids),
                                    expert_map=expert_map.to(DEVICE), w13_bias=b13.to(DEVICE),
                                    w2_bias=b2.to(DEVICE), **rules)
        _assert_moe_close(got, want.double(), dtype, k)
    assert len(calls) == (len(cases) if gemv else 0)
