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


@pytest.mark.parametrize("flag, feature", [
    ("use_mla", "MLA"), ("has_sink", "attention sinks"),
    ("has_sliding_window", "sliding-window attention"), ("use_sparse", "sparse attention"),
])
def test_unsupported_features_fail_with_a_clear_error(selector, flag, feature):
    from vllm.platforms import current_platform

    with pytest.raises(NotImplementedError, match=f"needs {feature}, which vllm_accel's ACCEL_ATTN"):
        current_platform.get_attn_backend_cls(None, selector(**{flag: True}))


def test_impl_rejects_soft_cap_and_encoder_attention():
    from vllm_accel.ops.attention import AccelAttentionImpl

    with pytest.raises(NotImplementedError, match="logits soft-cap"):
        AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto", logits_soft_cap=30.0)
    with pytest.raises(NotImplementedError, match="encoder_only attention"):
        AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto", attn_type="encoder_only")
    AccelAttentionImpl(8, 64, 0.125, 2, None, None, "auto")
