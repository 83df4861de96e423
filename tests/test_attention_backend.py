"""ACCEL_ATTN selection and its startup errors for features it lacks."""

import pytest
import torch


@pytest.fixture
def selector():
    from vllm.v1.attention.selector import AttentionSelectorConfig

    def make(**kw):
        return AttentionSelectorConfig(head_size=64, dtype=torch.bfloat16,
                                       kv_cache_dtype="auto", block_size=None, **kw)
    return make


def test_platform_selects_gcu_attn(selector):
    from vllm.platforms import current_platform

    path = current_platform.get_attn_backend_cls(None, selector())
    assert path == "vllm_accel.ops.attention.AccelAttentionBackend"


@pytest.mark.parametrize("flag, feature", [("use_sparse", "sparse attention")])
def test_unsupported_features_fail_with_a_clear_error(selector, flag, feature):
    from vllm.platforms import current_platform

    with pytest.raises(NotImplementedError, match=f"needs {feature}, which vllm_accel's ACCEL_ATTN"):
        current_platform.get_attn_backend_cls(None, selector(**{flag: True}))


@pytest.mark.parametrize("flag", ["has_sink", "has_sliding_window"])
def test_windows_and_sinks_select_gcu_attn(selector, flag):
    from vllm.platforms import current_platform

    path = current_platform.get_attn_backend_cls(None, selector(**{flag: True}))
    assert path == "vllm_accel.ops.attention.AccelAttentionBackend"


def test_mla_selects_accel_mla(selector):
    from vllm.platforms import current_platform

    path = current_platform.get_attn_backend_cls(None, selector(use_mla=True))
    assert path == "vllm_accel.ops.mla.AccelMLABackend"


def test_impl_takes_the_features_and_rejects_what_it_cannot_serve():
    from vllm_accel.ops.attention import AccelAttentionImpl

    impl = AccelAttentionImpl(8, 64, 0.125, 2, [0.5] * 8, 4096, "auto", logits_soft_cap=30.0,
                              sinks=torch.zeros(8))
    assert impl.features["sliding_window"] == 4096 and impl.features["logits_soft_cap"] == 30.0
    assert impl.features["alibi_slopes"].dtype == torch.float32
    assert set(impl.features) == {"sliding_window", "logits_soft_cap", "alibi_slopes", "sinks"}
    assert AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto").features == {}
    assert AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto",
                              attn_type="encoder_only").attn_type == "encoder_only"
    with pytest.raises(NotImplementedError, match="encoder attention"):
        AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto", attn_type="encoder")
    with pytest.raises(NotImplementedError, match="attention sinks of shape"):
        AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto", sinks=torch.zeros(4))


def test_mla_impl_refuses_what_it_cannot_serve():
    """An fp8 e5m2 latent cache (vLLM views MLA caches as e4m3) or a window with MLA fail
    naming the feature; INT8 and fp8 e4m3 are served."""
    from vllm_accel.ops.mla import AccelMLAImpl

    kv_b_proj = torch.nn.Linear(256, 4 * 64)
    args = dict(q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=32, qk_rope_head_dim=64,
                qk_head_dim=96, v_head_dim=32, kv_b_proj=kv_b_proj)
    with pytest.raises(NotImplementedError, match="latent cache in fp8_e5m2"):
        AccelMLAImpl(4, 320, 0.1, 1, None, None, "fp8_e5m2", None, "decoder", None, **args)
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):
        assert AccelMLAImpl(4, 320, 0.1, 1, None, None, "int8_per_token_head", None,
                            "decoder", None, **args)._suffix == "_int8"
        for fp8 in ("fp8", "fp8_e4m3"):
            assert AccelMLAImpl(4, 320, 0.1, 1, None, None, fp8, None, "decoder", None,
                                **args)._suffix == "_fp8"
    with pytest.raises(NotImplementedError, match="MLA with a sliding window"):
        AccelMLAImpl(4, 320, 0.1, 1, None, 128, "auto", None, "decoder", None, **args)


def test_two_way_ranges_kept_for_the_prefills_whose_queries_they_cover():
    """vLLM's multimodal prefix ranges reach the impl only for prefill requests whose
    queries this step fall in them: never for decodes, not for a range wholly in the
    cached context, clipped to nothing past the sequence."""
    from types import SimpleNamespace

    from vllm_accel.ops.attention import _two_way_ranges

    # request 0 decodes; 1 prefills positions 40..59; 2 prefills 0..9
    cm = SimpleNamespace(query_start_loc_cpu=torch.tensor([0, 1, 21, 31]),
                         seq_lens=torch.tensor([70, 60, 10]),
                         mm_req_doc_ranges={0: [(5, 9)], 1: [(2, 8), (35, 44), (50, 52)],
                                            2: [(12, 20)]})
    assert _two_way_ranges(cm, num_decodes=1) == {1: [(35, 44), (50, 52)]}
    assert _two_way_ranges(SimpleNamespace(mm_req_doc_ranges=None), 0) is None


def test_gemma4_clears_the_two_way_ranges_of_its_global_layers(monkeypatch):
    """Gemma 4 keeps images two-way on its windowed layers only: before each step vLLM's
    model sets ``mm_prefix_range`` to None in the metadata of its global layers' KV cache
    group. Run on the plugin's metadata, that leaves the windowed group's ranges and
    drops the global group's, whose layers then attend causally (no recompute)."""
    from types import SimpleNamespace

    import vllm.forward_context
    from vllm.model_executor.models.gemma4_mm import Gemma4ForConditionalGeneration

    from vllm_accel.ops.attention import AccelAttentionMetadata

    def metadata():
        return AccelAttentionMetadata(
            num_actual_tokens=10, num_decodes=0, num_decode_tokens=0, max_seq_len=10,
            query_start_loc_cpu=torch.tensor([0, 10]), seq_lens=torch.tensor([10]),
            block_table=torch.zeros(1, 1, dtype=torch.int32),
            slot_mapping=torch.arange(10), mm_prefix_range={0: [(2, 8)]})

    windowed, global_ = metadata(), metadata()
    layers = {"language_model.model.layers.0.self_attn.attn": windowed,
              "language_model.model.layers.1.self_attn.attn": global_}
    monkeypatch.setattr(vllm.forward_context, "get_forward_context",
                        lambda: SimpleNamespace(attn_metadata=layers))
    Gemma4ForConditionalGeneration._clear_mm_prefix_for_full_attn_layers(
        SimpleNamespace(_full_attn_layer_idxs={1}))
    assert windowed.mm_prefix_range == {0: [(2, 8)]}
    assert global_.mm_prefix_range is None


@pytest.mark.parametrize("dtype, kv_cache_dtype, tol", [
    (torch.float32, "auto", 1e-5), (torch.bfloat16, "auto", 2e-2),
    (torch.float32, "fp8_e4m3", 0.15)])  # (e4m3: 3 mantissa bits a K/V element)
def test_cross_attention_reads_each_requests_whole_encoder_output(dtype, kv_cache_dtype, tol):
    """Encoder-decoder layers: every decoder token attends to all of its request's
    encoder output, nothing masked. A step with one decode (its encoder K/V cached by
    an earlier step) beside two prefills of 3 and 5 tokens whose encoder K/V this step
    writes through the cross slot mapping, then a step of three decodes writing
    nothing; vs float64 attention over the original K/V. The cache holds garbage
    (1e4; fp8: 448, its largest) wherever no request wrote, so reading a slot a request
    does not own fails; the block table and lengths have a spare row past the batch."""
    from types import SimpleNamespace

    from vllm_accel.ops.attention import AccelAttentionImpl, AccelAttentionMetadata

    heads, kv_heads, d, bs = 4, 2, 64, 16
    enc_lens, q_lens = [37, 20, 50], [1, 3, 5]
    gen = torch.Generator().manual_seed(0)
    keys = [torch.randn(n, kv_heads, d, generator=gen) for n in enc_lens]
    values = [torch.randn(n, kv_heads, d, generator=gen) for n in enc_lens]
    blocks = [-(-n // bs) for n in enc_lens]
    order = torch.randperm(sum(blocks) + 3, generator=gen)
    table = torch.full((4, max(blocks) + 1), int(order[-1]), dtype=torch.int32)  # (unused)
    for r, start in enumerate([0, blocks[0], blocks[0] + blocks[1]]):
        table[r, :blocks[r]] = order[start:start + blocks[r]]
    slots = [table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
             for r, n in enumerate(enc_lens)]
    fp8 = kv_cache_dtype != "auto"
    cache = torch.full((len(order), kv_heads, bs, 2 * d), 448.0 if fp8 else 1e4,
                       dtype=torch.float8_e4m3fn if fp8 else dtype)
    cache = cache.view(torch.uint8) if fp8 else cache  # (vLLM allocates fp8 caches as uint8)
    impl = AccelAttentionImpl(heads, d, d ** -0.5, kv_heads, None, None, kv_cache_dtype,
                              attn_type="encoder_decoder")
    layer = SimpleNamespace(_k_scale_float=1.0, _v_scale_float=1.0,
                            layer_name="model.decoder.layers.0.encoder_attn.attn")
    impl.do_kv_cache_update(layer, keys[0].to(dtype), values[0].to(dtype), cache, slots[0])

    def step(q_lens, new):
        """One forward: ``q_lens`` query tokens per request, the requests in ``new``
        writing their encoder K/V; returns (output, float64 oracle)."""
        n = sum(q_lens)
        query = torch.randn(n, heads, d, generator=gen)
        starts = torch.tensor([0, *q_lens]).cumsum(0).to(torch.int32)
        md = AccelAttentionMetadata(
            num_actual_tokens=n, num_decodes=sum(q == 1 for q in q_lens),
            num_decode_tokens=sum(q == 1 for q in q_lens), max_seq_len=max(enc_lens),
            query_start_loc_cpu=starts,
            seq_lens=torch.tensor([*enc_lens, 7], dtype=torch.int32),
            block_table=table, causal=False,
            slot_mapping=torch.cat([slots[r] for r in new]) if new else torch.empty(0).long())
        key = torch.cat([keys[r] for r in new]).to(dtype) if new else None
        value = torch.cat([values[r] for r in new]).to(dtype) if new else None
        output = torch.empty(n, heads * d, dtype=dtype)
        impl.forward(layer, query.to(dtype), key, value, cache, md, output)
        expected = []
        for r, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist())):
            k = keys[r].double().repeat_interleave(heads // kv_heads, dim=1)
            v = values[r].double().repeat_interleave(heads // kv_heads, dim=1)
            p = torch.einsum("qhd,khd->hqk", query[a:b].double(), k).mul(d ** -0.5).softmax(-1)
            expected.append(torch.einsum("hqk,khd->qhd", p, v))
        return output.view(n, heads, d).double(), torch.cat(expected)

    out, expected = step(q_lens, new=[1, 2])
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    out, expected = step([1, 1, 1], new=[])
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
