"""ACCEL_KV_SCALES: static per-layer INT8 KV scales, and clear errors for bad files."""

import json

import pytest

from vllm_accel.ops.kv_scales import load_kv_scales


def _write(tmp_path, content) -> str:
    path = tmp_path / "int8_kv_cache.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


def test_valid_file_loads(tmp_path):
    path = _write(tmp_path, {"0": {"k_scale": 0.02, "v_scale": 0.01},
                             "1": {"k_scale": 1, "v_scale": 0.5, "k_zero": 0, "v_zero": 0.0}})
    assert load_kv_scales(path, 2) == {0: (0.02, 0.01), 1: (1.0, 0.5)}


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ([1, 2], "must hold a JSON object"),
    ({"0": {"k_scale": 0.1}}, "layer 0 needs k_scale and v_scale"),
    ({"0": {"k_scale": 0.1, "v_scale": -1}, "1": {"k_scale": 1, "v_scale": 1}}, "v_scale must be a positive number"),
    ({"0": {"k_scale": "big", "v_scale": 1}}, "k_scale must be a positive number"),
    ({"0": {"k_scale": 1, "v_scale": 1}}, r"no scales for layers \[1\]"),
    ({"0": {"k_scale": 1, "v_scale": 1}, "7": {"k_scale": 1, "v_scale": 1}}, "'7' is not a layer index"),
    ({"0": {"k_scale": 1, "v_scale": 1, "k_zero": 3}, "1": {"k_scale": 1, "v_scale": 1}}, "zero points must be 0"),
])
def test_malformed_files_name_the_problem_and_the_fix(tmp_path, content, message):
    path = _write(tmp_path, content)
    with pytest.raises(ValueError, match=message) as exc:
        load_kv_scales(path, 2)
    assert path in str(exc.value)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load_kv_scales(str(tmp_path / "nope.json"), 2)


def test_impl_uses_static_scales_for_its_layer(tmp_path, monkeypatch):
    """do_kv_cache_update passes the layer's constants to the INT8 writer."""
    from types import SimpleNamespace

    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_accel.ops import attention

    path = _write(tmp_path, {str(i): {"k_scale": 0.1 * (i + 1), "v_scale": 0.01 * (i + 1)}
                             for i in range(3)})
    monkeypatch.setenv("ACCEL_KV_SCALES", path)
    config = VllmConfig()
    config.model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=3))
    with set_current_vllm_config(config):
        impl = attention.AccelAttentionImpl(4, 8, 0.3, 2, None, None, attention.INT8_KV)
    calls = []
    impl._cache_write = lambda *args: calls.append(args[4:])
    layer = SimpleNamespace(layer_name="model.layers.2.self_attn.attn")
    import torch

    impl.do_kv_cache_update(layer, torch.zeros(1, 2, 8), torch.zeros(1, 2, 8), None,
                            torch.zeros(1, dtype=torch.long))
    assert calls == [pytest.approx((0.3, 0.03))]
