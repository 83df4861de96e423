"""When the MLA layer (``vllm_accel/ops/mla_layer.py``) takes the whole-layer path:
only where a provider other than the oracle serves ``mla_latent_attention`` (or the
oracle is forced), never for what that kernel's contract leaves out, and not where the
kernel's own check at the layer's shapes fails, nor with LoRA or multimodal RoPE.
vLLM registers the layer for every
MLA model. (The path itself: ``test_attention_models.py``'s latent-layer engines and
``test_backend_faithful.py``'s Sophgo adapter.)"""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding

from vllm_accel.ops import mla_layer
from vllm_accel.ops.mla_layer import AccelMultiHeadLatentAttention


def _layer(checks_out=True, **changes):
    """A stand-in with the attributes the decision reads (a DeepSeek-V3-like layer)."""
    linear = SimpleNamespace(quant_method=UnquantizedLinearMethod(),
                             weight=torch.empty(8, 4))
    layer = SimpleNamespace(
        rotary_emb=SimpleNamespace(is_neox_style=False, rotary_dim=4), q_lora_rank=4,
        q_b_proj=linear, q_proj=None, kv_b_proj=linear, qk_rope_head_dim=4,
        is_sparse=False, indexer=None, g_proj=None, dcp_q_replicate=False,
        mla_attn=SimpleNamespace(kv_cache_dtype="auto"), fused_qkv_a_proj=object(),
        _kernel_checks_out=lambda w_uq: checks_out)
    for name, value in changes.items():
        setattr(layer, name, value)
    layer._q_proj_layer = lambda: AccelMultiHeadLatentAttention._q_proj_layer(layer)
    return layer


def _decide(layer):
    return AccelMultiHeadLatentAttention._whole_layer_provider(layer)


def _mrope():
    """A multimodal RoPE of DeepSeek's pair order and the rope dims (as bailing_moe_v3
    builds one)."""
    rope = object.__new__(MRotaryEmbedding)
    rope.__dict__.update(is_neox_style=False, rotary_dim=4)
    return rope


@pytest.fixture(autouse=True)
def _no_lora(monkeypatch):
    monkeypatch.setattr(mla_layer, "get_current_vllm_config",
                        lambda: SimpleNamespace(lora_config=None))


def test_registered_for_vllms_mla_layer():
    import vllm_accel.ops.custom_ops  # noqa: F401  (the general plugin's registrations)

    assert op_registry_oot["MultiHeadLatentAttentionWrapper"] is AccelMultiHeadLatentAttention


def test_only_a_card_kernel_or_the_forced_oracle_takes_the_layer(monkeypatch):
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    assert mla_layer.resolve_provider(mla_layer.KERNEL) == "reference"
    assert _decide(_layer()) is None  # the simulator, the virtual card: vLLM's layer
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "reference")
    assert _decide(_layer()) == "reference"
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER")
    monkeypatch.setattr(mla_layer, "resolve_provider", lambda name: "sophgo_vendor")
    assert _decide(_layer()) == "sophgo_vendor"
    assert _decide(_layer(checks_out=False)) is None


@pytest.mark.parametrize("change", [
    {"rotary_emb": SimpleNamespace(is_neox_style=True, rotary_dim=4)},
    {"rotary_emb": None},
    {"rotary_emb": SimpleNamespace(is_neox_style=False, rotary_dim=2)},
    {"is_sparse": True}, {"indexer": object()}, {"g_proj": object()},
    {"dcp_q_replicate": True}, {"mla_attn": SimpleNamespace(kv_cache_dtype="fp8")},
    {"fused_qkv_a_proj": None},
    {"q_b_proj": SimpleNamespace(quant_method=object(), weight=torch.empty(8, 4))},
    {"kv_b_proj": SimpleNamespace(quant_method=object(), weight=torch.empty(8, 4))},
])
def test_what_the_kernel_leaves_out_keeps_vllms_layer(change, monkeypatch):
    monkeypatch.setattr(mla_layer, "resolve_provider", lambda name: "sophgo_vendor")
    assert _decide(_layer(**change)) is None


def test_lora_and_multimodal_rope_keep_vllms_layer(monkeypatch):
    monkeypatch.setattr(mla_layer, "resolve_provider", lambda name: "sophgo_vendor")
    assert _decide(_layer(rotary_emb=_mrope())) is None
    monkeypatch.setattr(mla_layer, "get_current_vllm_config",
                        lambda: SimpleNamespace(lora_config=object()))
    assert _decide(_layer()) is None
