"""The xformers attention provider: probe and layout adapter.

PyPI xformers (installed by setup, beside CPU torch) imports but has no CPU
kernels, so the probe must find it importable yet unusable, and nothing may
register. The adapter (our paged cache -> xformers' grouped ``[B, M, G, H, K]``
call) is checked by swapping ``memory_efficient_attention`` for a float64
implementation of xformers' documented semantics (bottom-right causal mask,
``scale``), against the float64 oracle of the kernel tests.
"""

import pytest
import torch

from paged_cases import free_before_window, make_case, reference

from vllm_accel.ops import registry
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.vendor.kernels import probe_xformers, xformers_paged_prefill


def test_probe_finds_pypi_xformers_without_cpu_kernels():
    import xformers  # setup installs it: the probe must meet the real package

    usable, why = probe_xformers(torch.device("cpu"))
    assert not usable
    assert why.startswith("xformers not usable on cpu: no kernel for it"), why
    assert xformers.__version__
    assert "xformers" not in registry.providers_of("paged_prefill")


def _float64_memory_efficient_attention(q, k, v, attn_bias=None, scale=None):
    """xformers' BMGHK semantics in float64: the mask lets query i (of M) see keys
    up to ``i + (N - M)`` (bottom-right aligned), and with a local mask of window
    ``w`` only the ``w`` keys ending there (xformers' documented ``window_left``)."""
    from xformers.ops.fmha.attn_bias import (
        LowerTriangularFromBottomRightLocalAttentionMask,
        LowerTriangularFromBottomRightMask,
    )

    assert isinstance(attn_bias, LowerTriangularFromBottomRightMask)
    m, n = q.shape[1], k.shape[1]
    scores = torch.einsum("bmghk,bnghk->bghmn", q.double(), k.double()) * scale
    last = torch.arange(m)[:, None] + (n - m)
    visible = torch.arange(n)[None, :] <= last
    if isinstance(attn_bias, LowerTriangularFromBottomRightLocalAttentionMask):
        visible &= torch.arange(n)[None, :] > last - attn_bias._window_size
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bghmn,bnghk->bmghk", torch.softmax(scores, dim=-1), v.double())
    return out.to(q.dtype)


@pytest.mark.parametrize("ratio", [1, 3])
@pytest.mark.parametrize("bs", [16, 64])
def test_adapter_matches_float64_oracle(monkeypatch, ratio, bs):
    import xformers.ops

    monkeypatch.setattr(xformers.ops, "memory_efficient_attention",
                        _float64_memory_efficient_attention)
    hkv, d = 2, 64
    reqs = [(17, 2 * bs), (bs, bs), (1, bs + 5), (23, 23)]
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, ratio * hkv, hkv, d,
                                                  torch.float32, seed=ratio * bs)
    query = torch.cat(qs)
    starts = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    scale = d ** -0.5
    out = xformers_paged_prefill(query, kv_cache, block_table, starts, seq_lens, scale)
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_adapter_with_a_window_reads_only_the_window(monkeypatch):
    """A sliding window through xformers' local mask; the blocks before each
    request's window are freed (NaN): the adapter gathers from the window on."""
    import xformers.ops

    monkeypatch.setattr(xformers.ops, "memory_efficient_attention",
                        _float64_memory_efficient_attention)
    bs, hkv, d, window = 16, 2, 64, 21
    reqs = [(17, 2 * bs), (bs, 3 * bs), (1, 3 * bs + 5), (23, 23)]
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, 3 * hkv, hkv, d, torch.float32,
                                                  seed=2)
    free_before_window(kv_cache, block_table, reqs, window)
    starts = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    out = xformers_paged_prefill(torch.cat(qs), kv_cache, block_table, starts, seq_lens,
                                 d ** -0.5, sliding_window=window)
    expected = torch.cat([reference(q, k, v, d ** -0.5, sliding_window=window)
                          for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_adapter_hands_other_features_to_the_next_provider():
    """Soft-cap, ALiBi and sinks are not xformers' masks: the next provider runs them."""
    bs, hkv, d = 16, 2, 64
    reqs = [(17, 2 * bs), (1, bs + 5)]
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, hkv, hkv, d, torch.float32, seed=3)
    starts = torch.tensor([0, 17, 18], dtype=torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    out = xformers_paged_prefill(torch.cat(qs), kv_cache, block_table, starts, seq_lens,
                                 d ** -0.5, logits_soft_cap=5.0)
    expected = torch.cat([reference(q, k, v, d ** -0.5, logits_soft_cap=5.0)
                          for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
