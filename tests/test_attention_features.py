"""Attention features (sliding window, logit soft-cap, ALiBi, sinks) of every paged
reader, and the cache-less ``varlen_attention`` of encoder-only layers (bidirectional),
against the float64 oracle (``paged_cases.reference``, written from the
features' definitions), over the readers' paths: decode, prefill, prefill after cached
context (chunked prefill crossing the window), mixed batches; block sizes 16/64;
GQA 1/3/8 and MQA; head sizes 64/128/256 and 72 (no vector instantiation).

Blocks that no query of a request can see any more point at a NaN "null block", as
vLLM's sliding-window KV manager frees them: a kernel that reads one returns NaN.
"""

import pytest
import torch

from vllm_accel.ops.cpu_native import attention as cpu_native
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.torch_fast import attention as _torch_fast  # noqa: F401  (registers)
from vllm_accel.ops.registry import get_kernel

from paged_cases import (TOL, alibi_slopes, assert_within_int8_bound, batch_mix, build,
                         free_before_window, kernel_args, make_case, reference)

PROVIDERS = ["reference", "torch_fast", "cpu_native"]

#: name -> the features given to the kernels, as functions of (block size, heads); the
#: windows sit exactly on a block boundary, across one, and past every context
FEATURES = {
    "window=bs": lambda bs, h: {"sliding_window": bs},
    "window=bs+5,soft_cap": lambda bs, h: {"sliding_window": bs + 5, "logits_soft_cap": 5.0},
    "window>context": lambda bs, h: {"sliding_window": 10_000},
    "window=1": lambda bs, h: {"sliding_window": 1},
    "soft_cap": lambda bs, h: {"logits_soft_cap": 5.0},
    "alibi": lambda bs, h: {"alibi_slopes": alibi_slopes(h)},
    "sinks": lambda bs, h: {"sinks": _sinks(h)},
    "sinks,window=2bs-3": lambda bs, h: {"sinks": _sinks(h), "sliding_window": 2 * bs - 3},
    "alibi,window=bs+1,soft_cap": lambda bs, h: {"alibi_slopes": alibi_slopes(h),
                                                 "sliding_window": bs + 1,
                                                 "logits_soft_cap": 30.0},
}
#: (kv heads, query heads per kv head): MQA, MHA, GQA 3 and 8
HEADS = [(1, 8), (2, 1), (2, 3), (2, 8)]


def _sinks(h: int) -> torch.Tensor:
    return torch.randn(h, generator=torch.Generator().manual_seed(h)) * 2


def _run(provider, features, mix, bs, hkv, ratio, d, dtype, seed, query_scale=1.0):
    """(output, float64 expected) of one provider's reader on one batch mix, with the
    blocks before each request's window freed to a NaN null block."""
    reqs = batch_mix(mix, bs)
    h = hkv * ratio
    f = FEATURES[features](bs, h)
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, h, hkv, d, dtype, seed=seed)
    qs = [q * query_scale for q in qs]
    if "sliding_window" in f:
        free_before_window(kv_cache, block_table, reqs, f["sliding_window"])
    scale = d ** -0.5
    query_start_loc, seq_lens = kernel_args(reqs)
    if mix == "decode":
        out = get_kernel("paged_decode", provider)(torch.cat(qs), kv_cache, block_table,
                                                   seq_lens, scale, **f)
    else:
        out = get_kernel("paged_prefill", provider)(torch.cat(qs), kv_cache, block_table,
                                                    query_start_loc, seq_lens, scale, **f)
    expected = torch.cat([reference(q, k, v, scale, **f) for q, k, v in zip(qs, ks, vs)])
    return out, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mix", ["decode", "prefill", "prefill_ctx", "mixed"])
@pytest.mark.parametrize("bs", [16, 64])
@pytest.mark.parametrize("features", list(FEATURES))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_features_match_the_float64_oracle(provider, features, bs, mix, dtype):
    hkv, ratio = HEADS[(bs // 16 + len(mix)) % len(HEADS)]
    out, expected = _run(provider, features, mix, bs, hkv, ratio, 64, dtype, seed=bs + len(mix))
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("d", [64, 128, 256, 72])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"hkv{h[0]}x{h[1]}")
@pytest.mark.parametrize("provider", PROVIDERS)
def test_head_sizes_and_groups(provider, heads, d):
    """Every head size and grouping through the readers' vector and scalar paths, with
    a window across a block boundary, a soft-cap and sinks at once."""
    for mix, dtype in (("mixed", torch.bfloat16), ("decode", torch.float32)):
        out, expected = _run(provider, "sinks,window=2bs-3", mix, 16, *heads, d, dtype,
                             seed=d + heads[1])
        torch.testing.assert_close(out.double(), expected, **TOL[dtype])
        out, expected = _run(provider, "window=bs+5,soft_cap", mix, 16, *heads, d, dtype,
                             seed=d)
        torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("provider", PROVIDERS)
def test_soft_cap_with_large_logits(provider):
    """Logits ~40x the cap: the capped scores saturate, and only exact tanh keeps them
    ordered (a clamp or a first-order cap would not)."""
    for mix in ("decode", "prefill_ctx"):
        out, expected = _run(provider, "soft_cap", mix, 16, 2, 3, 64, torch.float32, seed=5,
                             query_scale=25.0)
        torch.testing.assert_close(out.double(), expected, **TOL[torch.float32])


def test_chunked_prefill_crossing_the_window():
    """Chunks of one long prompt, each after the cached ones, with a window shorter than
    a chunk and longer: every provider gives the oracle's rows and frees nothing it
    reads."""
    bs, d, hkv, ratio = 16, 64, 2, 3
    for window in (11, 40):
        for provider in PROVIDERS:
            for start in (0, 24, 48, 72):  # 24-token chunks of a 96-token prompt
                reqs = [(24, start + 24)]
                f = {"sliding_window": window}
                qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, hkv * ratio, hkv, d,
                                                              torch.float32, seed=start)
                free_before_window(kv_cache, block_table, reqs, window)
                query_start_loc, seq_lens = kernel_args(reqs)
                out = get_kernel("paged_prefill", provider)(
                    qs[0], kv_cache, block_table, query_start_loc, seq_lens, d ** -0.5, **f)
                torch.testing.assert_close(out.double(), reference(qs[0], ks[0], vs[0],
                                                                   d ** -0.5, **f),
                                           **TOL[torch.float32])


@pytest.mark.parametrize("features", ["window=bs+5,soft_cap", "alibi", "sinks,window=2bs-3"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_int8_cache_with_features(provider, features):
    """The INT8 readers (on AVX-512 VNNI, cpu_native's integer path for bf16) take the
    features too, within the INT8 cache's bound of the unquantized oracle."""
    bs, hkv, ratio, d = 16, 2, 3, 64
    for mix, dtype in (("decode", torch.bfloat16), ("mixed", torch.bfloat16),
                       ("prefill_ctx", torch.float32)):
        reqs = batch_mix(mix, bs)
        f = FEATURES[features](bs, hkv * ratio)
        qs, ks, vs, block_table, cache, _ = build(reqs, bs, ratio, d, dtype, "LHBNC", seed=3)
        if "sliding_window" in f:
            free_before_window(cache, block_table, reqs, f["sliding_window"])
        query_start_loc, seq_lens = kernel_args(reqs)
        if mix == "decode":
            out = get_kernel("paged_decode_int8", provider)(torch.cat(qs), cache, block_table,
                                                            seq_lens, d ** -0.5, **f)
        else:
            out = get_kernel("paged_prefill_int8", provider)(
                torch.cat(qs), cache, block_table, query_start_loc, seq_lens, d ** -0.5, **f)
        expected = torch.cat([reference(q, k, v, d ** -0.5, **f) for q, k, v in zip(qs, ks, vs)])
        vmax = torch.cat([v.double().abs().amax().expand(len(q)) for q, v in zip(qs, vs)])
        assert_within_int8_bound(out, expected, vmax[:, None, None], dtype)


@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_fp8_cache_with_features(provider):
    """The float8 readers take the features (their values times the layer's scales)."""
    bs, hkv, ratio, d = 16, 2, 3, 64
    f = {"sliding_window": bs + 5, "logits_soft_cap": 5.0, "sinks": _sinks(6)}
    for mix in ("decode", "mixed"):
        reqs = batch_mix(mix, bs)
        qs, ks, vs, block_table, cache = make_case(reqs, bs, hkv * ratio, hkv, d,
                                                   torch.float32, seed=4)
        free_before_window(cache, block_table, reqs, f["sliding_window"])
        # float8 values: K/V rounded to e4m3 (what the cache holds), scale 0.5
        fp8 = (cache / 0.5).to(torch.float8_e4m3fn)
        ks = [(k / 0.5).to(torch.float8_e4m3fn).double() * 0.5 for k in ks]
        vs = [(v / 0.5).to(torch.float8_e4m3fn).double() * 0.5 for v in vs]
        query_start_loc, seq_lens = kernel_args(reqs)
        if mix == "decode":
            out = get_kernel("paged_decode_fp8", provider)(torch.cat(qs), fp8, block_table,
                                                           seq_lens, d ** -0.5, 0.5, 0.5, **f)
        else:
            out = get_kernel("paged_prefill_fp8", provider)(
                torch.cat(qs), fp8, block_table, query_start_loc, seq_lens, d ** -0.5, 0.5,
                0.5, **f)
        expected = torch.cat([reference(q, k, v, d ** -0.5, **f) for q, k, v in zip(qs, ks, vs)])
        torch.testing.assert_close(out.double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not cpu_native._dispatched(), reason="the C++ op library did not build")
def test_attention_step_with_features_writes_and_attends():
    """``cpu_attention_step`` (the layer's one call: cache write, then attention) with a
    window, a soft-cap and sinks gives the oracle's rows; a prefill whose windowed work
    is small runs there even where its full causal work would not."""
    bs, hkv, ratio, d = 16, 2, 3, 64
    h = hkv * ratio
    f = {"sliding_window": 20, "logits_soft_cap": 5.0, "sinks": _sinks(h)}
    reqs = batch_mix("mixed", bs)
    qs, ks, vs, block_table, cache = make_case(reqs, bs, h, hkv, d, torch.bfloat16, seed=9)
    # the new tokens' K/V go in through the step itself: blank their slots first
    query_start_loc, seq_lens = kernel_args(reqs)
    slots = torch.cat([block_table[i, torch.arange(s - q, s) // bs].long() * bs
                       + torch.arange(s - q, s) % bs for i, (q, s) in enumerate(reqs)])
    new_k = torch.cat([k[-q:] for k, (q, _) in zip(ks, reqs)])
    new_v = torch.cat([v[-q:] for v, (q, _) in zip(vs, reqs)])
    for slot in slots.tolist():
        for kv_head in range(hkv):
            cache[slot // bs, kv_head].view(2, bs, d)[:, slot % bs] = 0
    query = torch.cat(qs)
    output = torch.empty_like(query)
    step = get_kernel("attention_step", "cpu_native")
    assert step(query, new_k, new_v, cache, slots, block_table, query_start_loc, seq_lens,
                output, d ** -0.5, **f)
    expected = torch.cat([reference(q, k, v, d ** -0.5, **f) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(output.double(), expected, **TOL[torch.bfloat16])
    # 600 rows see at most 20 keys each: 12k pairs, far under the step's bound
    assert cpu_native._prefill_pairs(torch.tensor([0, 600], dtype=torch.int32),
                                     torch.tensor([600], dtype=torch.int32), 20) == sum(
        min(i + 1, 20) for i in range(600))


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("features", ["none", "window=bs+5,soft_cap", "alibi", "sinks",
                                      "alibi,window=bs+1,soft_cap"])
@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_varlen_attention_matches_the_float64_oracle(provider, features, causal):
    """Packed sequences of 1-300 tokens (past the torch kernel's 256-row query chunk),
    GQA 3, with padding rows after the last (zeros)."""
    hkv, ratio, d = 2, 3, 64
    h = hkv * ratio
    f = {} if features == "none" else FEATURES[features](16, h)
    g = torch.Generator().manual_seed(len(features))
    lengths = [1, 37, 300, 16]
    q, k, v = (torch.randn(sum(lengths) + 3, n, d, generator=g) for n in (h, hkv, hkv))
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    out = get_kernel("varlen_attention", provider)(q, k, v, starts, d ** -0.5, causal=causal,
                                                   **f)
    expected = torch.cat([reference(q[a:b], k[a:b], v[a:b], d ** -0.5, causal=causal, **f)
                          for a, b in zip(starts[:-1].tolist(), starts[1:].tolist())])
    torch.testing.assert_close(out[:-3].double(), expected, **TOL[torch.float32])
    assert (out[-3:] == 0).all()


@pytest.mark.parametrize("window", [None, 9])
def test_two_way_ranges_match_the_float64_oracle(window):
    """The reference reader with multimodal prefix ranges (Gemma 3's images: their
    tokens see each other both ways): a prompt whose image lies wholly in this step,
    one after cached context whose image starts in the context, one without; with and
    without a window (HF: the window AND (causal OR the range))."""
    reqs = [(30, 30), (20, 50), (12, 12)]
    ranges = [[(3, 10), (15, 20)], [(28, 37)], []]
    d, hkv, ratio = 32, 2, 2
    qs, ks, vs, block_table, kv_cache = make_case(reqs, 16, hkv * ratio, hkv, d,
                                                  torch.float32, seed=5)
    query_start_loc, seq_lens = kernel_args(reqs)
    f = {} if window is None else {"sliding_window": window}
    out = _reference.paged_attention(torch.cat(qs), kv_cache, block_table, query_start_loc,
                                     seq_lens, d ** -0.5, two_way_ranges=ranges, **f)
    starts = query_start_loc.tolist()
    for i in range(len(reqs)):
        want = reference(qs[i], ks[i], vs[i], d ** -0.5, two_way_ranges=ranges[i], **f)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]].double(), want,
                                   **TOL[torch.float32])
    causal = reference(qs[0], ks[0], vs[0], d ** -0.5, **f)
    assert (out[:30].double() - causal).abs().max() > 1e-2  # (the ranges change the rows)

