"""Kernel registry: provider preference, forcing, and clear errors."""

import pytest
import torch

from vllm_accel.ops import registry


@pytest.fixture
def fresh_kernel(monkeypatch):
    monkeypatch.setattr(registry, "_KERNELS", {})
    monkeypatch.setattr(registry, "_preferred_providers", (registry.REFERENCE,))
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    registry.register_kernel("k")(lambda: "ref")
    registry.register_kernel("k", "vendor")(lambda: "vendor")
    registry.register_kernel("k", "fast")(lambda: "fast")


def test_reference_is_used_unless_the_backend_prefers_another(fresh_kernel):
    assert registry.get_kernel("k")() == "ref"
    registry.set_preferred_providers(("missing", "fast", "vendor"))
    assert registry.get_kernel("k")() == "fast"
    assert registry.providers_of("k") == ["fast", "reference", "vendor"]


def test_env_forces_a_provider_and_explicit_provider_wins(fresh_kernel, monkeypatch):
    registry.set_preferred_providers(("vendor",))
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "reference")
    assert registry.get_kernel("k")() == "ref"
    assert registry.get_kernel("k", provider="fast")() == "fast"


def test_fallback_goes_to_the_next_provider_in_the_order(fresh_kernel):
    """Two vendor providers that each hand some calls on (flash_attn and gcu_vendor on
    the GCU) never hand a call back and forth: the next one is always later."""
    registry.register_kernel("k", "other")(
        lambda: registry.fallback_kernel("k", "other")())
    registry.register_kernel("k", "vendor")(
        lambda: registry.fallback_kernel("k", "vendor")())
    registry.set_preferred_providers(("other", "vendor", "fast"))
    assert registry.get_kernel("k")() == "fast"
    registry.set_preferred_providers(("other", "vendor"))
    assert registry.get_kernel("k")() == "ref"
    assert registry.fallback_kernel("k", "not-in-order")() == "ref"  # first in the order


def test_unknown_names_are_clear_errors(fresh_kernel):
    with pytest.raises(KeyError, match="no kernel named 'nope'"):
        registry.get_kernel("nope")
    with pytest.raises(KeyError, match="has no provider 'x'; it has"):
        registry.get_kernel("k", provider="x")


def test_builtin_kernels_have_reference_providers():
    import vllm_accel.ops.reference.attention  # noqa: F401
    import vllm_accel.ops.reference.cache_write  # noqa: F401
    import vllm_accel.ops.torch_fast.attention  # noqa: F401
    import vllm_accel.ops.custom_ops  # noqa: F401

    for name in ("cache_write", "paged_decode", "paged_prefill", "rms_norm",
                 "silu_and_mul", "rotary_embedding"):
        assert registry.REFERENCE in registry.providers_of(name), name


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    """Forcing the Triton provider on the simulator without the interpreter fails
    with the fix (the sim worker raises this as a startup error)."""
    from vllm_accel.ops.triton.provider import probe_triton

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    usable, why = probe_triton(torch.device("cpu"))
    assert not usable and "TRITON_INTERPRET=1" in why


def test_resolved_kernels_follow_env_order_and_registrations(fresh_kernel, monkeypatch):
    """get_kernel caches its answer per kernel; the cache must never go stale."""
    assert registry.get_kernel("k")() == "ref"
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "fast")
    assert registry.get_kernel("k")() == "fast"
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER")
    assert registry.get_kernel("k")() == "ref"
    registry.set_preferred_providers(("vendor",))
    assert registry.get_kernel("k")() == "vendor"
    registry.register_kernel("k", "vendor")(lambda: "vendor v2")
    assert registry.get_kernel("k")() == "vendor v2"


def test_a_kernel_asked_for_inside_a_compiled_function_leaves_no_side_effect(fresh_kernel):
    """A kernel that asks the registry per call (W8A8's activation quantizer) is traced
    by torch.compile. Memoizing the answer there made dynamo replay the dict write in
    the compiled code, keyed by this process's id(): vLLM's compile cache then failed
    to load in the next process (KeyError). The registry answers without memoizing
    while tracing, so the compiled code has nothing to replay."""
    registry.register_kernel("twice")(lambda x: 2 * x)
    registry._resolved.clear()

    def uses_the_kernel(x):
        return registry.get_kernel("twice")(x) + 1

    torch._dynamo.reset()
    compiled = torch.compile(uses_the_kernel, backend="eager", fullgraph=True)
    x = torch.arange(4.0)
    assert torch.equal(compiled(x), 2 * x + 1)
    assert registry._resolved == {}  # the traced call wrote nothing
    assert torch.equal(uses_the_kernel(x), 2 * x + 1)  # an eager call still memoizes
    assert list(registry._resolved) == [("twice", None, id(registry._KERNELS["twice"]), 1)]
    torch._dynamo.reset()
