"""W8A8 int8 (compressed-tensors ``int-quantized``) through vllm_accel.quant.w8a8.

Oracles:
* kernel: float64 math on the quantized operands (activation codes and scales
  from ``int8_quant_act``, int8 weight codes times scales): the int8 GEMM
  accumulates exactly, so only the final fp32 scaling (a few ulps) and the
  output rounding may differ. Plus a rigorous bound vs the unquantized
  ``x @ W.T`` (half an activation step times ``sum |W|``).
* int8 GEMM: int64 matmul (exact) for both the ``torch._int_mm`` and the chunked
  fp32 path, with K large enough that an unchunked fp32 sum would round.
* checkpoint: compressed-tensors' own ``dequantize`` on the written tensors.
* vLLM layers: merged qkv / gate_up and row-parallel layers loaded through
  vLLM's weight loaders vs the float64 oracle.
* engine: tiny Llama (and the default model) served by vLLM vs HF transformers
  fp32 on the dequantized weights with the same activation fake-quant
  (:func:`quantizer_int8.add_act_fake_quant`, computed in float64
  independently of the library): greedy tokens (>= 90% of positions) and
  teacher-forced log-probs of vLLM's tokens (bounded difference).

Why the oracle fake-quantizes activations: W8A8 changes every activation by up
to half a quantization step (~0.4% of the row's absmax per token), and greedy
decoding amplifies one flipped near-tie into a different continuation. Against
fp32 activations the agreement is reported (printed) but not asserted; against
the same activation quantizer the remaining differences are fp32 rounding and
rare code flips at rounding ties.
"""

import json
import random

import pytest
import torch

from conftest import SharedEngines, build_tiny_model, cpu_has
from quantizer_int8 import (
    hf_oracle,
    quantize_checkpoint_int8,
    quantize_weight_int8,
)

from vllm_accel.ops.registry import get_kernel, providers_of
from vllm_accel.quant import w8a8 as Q

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}


def quantized_oracle(x, w_codes, w_scale, bias=None, *, input_scale=None, input_zp=None,
                     symmetric=True):
    """float64 ``dequant(quant(x)) @ dequant(W).T (+ bias)`` with the activation
    codes produced by the library's quantizer, and ``|x_dq| @ |W|.T``."""
    q, s, zp = Q.int8_quant_act(x.reshape(-1, x.shape[-1]), input_scale, input_zp,
                                symmetric=symmetric)
    xd = (q.double() - (0 if zp is None else zp.double())) * s.double()
    wd = w_codes.double() * w_scale.double().reshape(-1, 1)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        ref = ref + bias.double()
    return ref, mag, (q, s, zp)


def check_quantized(y, ref, mag, dtype, bias=None):
    """Exact int32 accumulation: the only errors are the fp32 scaling of the
    accumulator (3 roundings, <= 2e-7 of ``|acc * s_x * s_w|`` <= ``mag``), the
    bias add, and the output rounding."""
    assert y.dtype == dtype
    err = (y.double().reshape(ref.shape) - ref).abs()
    b = 0 if bias is None else bias.double().abs()
    bound = OUT_REL[dtype] * ref.abs() + 4e-7 * (mag + b) + 1e-30
    assert bool((err <= bound).all()), f"max err {err.max():.3e}, worst {(err / bound).max():.2f}"


# ---------------------------------------------------------------------------
# kernels
# ---------------------------------------------------------------------------


#: the int8 GEMM the W8A8 method resolves "auto" to here: torch's where it is exact (the
#: probe, tested below), else the simulator's own where built, else chunked float32
EXACT_MM = Q.resolve_mm_method(torch.device("cpu"))


# int_mm where torch's is exact here (the probe, tested below), native where the
# simulator has its own
@pytest.mark.parametrize("method", ["auto", "fp32_exact"]
                         + (["int_mm"] if Q._int_mm_works(torch.device("cpu")) else [])
                         + (["native"] if Q._native_int8_gemm(torch.device("cpu")) else []))
def test_int8_mm_exact(method):
    gen = torch.Generator().manual_seed(0)
    # K = 3000 at the extreme code: every product is 2**14, the sum 3000 * 2**14
    # is far above 2**24 (an unchunked fp32 sum would round)
    a = torch.full((3, 3000), -128, dtype=torch.int8)
    w = torch.full((5, 3000), -128, dtype=torch.int8)
    assert torch.equal(Q.int8_mm(a, w, method).long(), a.long() @ w.long().t())
    for m, k, n in [(1, 576, 960), (7, 1536, 576), (64, 33, 17), (2, 2049, 3)]:
        a = torch.randint(-128, 128, (m, k), generator=gen, dtype=torch.int8)
        w = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
        out = Q.int8_mm(a, w, method)
        assert out.dtype == torch.int32
        assert torch.equal(out.long(), a.long() @ w.long().t())


@pytest.mark.parametrize("symmetric", [True, False])
def test_int8_quant_act(symmetric):
    gen = torch.Generator().manual_seed(int(symmetric))
    x = torch.randn(9, 70, generator=gen) * 3
    x[3] = 0  # all-zero token
    x[4] = x[4].abs()  # all-positive token (asym range widened to hold 0)
    q, s, zp = Q.int8_quant_act(x, symmetric=symmetric)
    assert q.dtype == torch.int8 and s.shape == (9, 1)
    xd = (q.double() - (0 if zp is None else zp.double())) * s.double()
    # every activation within half a step (no clipping in dynamic mode)
    assert bool(((xd - x.double()).abs() <= s.double() / 2 * (1 + 1e-6)).all())
    assert bool((xd[3] == 0).all())
    if symmetric:
        assert zp is None and int(q.abs().max()) == 127  # absmax maps to +-127
    else:
        # the full int8 range is used: min -> -128 and max -> 127 (up to rounding)
        assert int(q[0].min()) <= -127 and int(q[0].max()) >= 126
        assert int(zp[4]) == -128
    # static: the checkpoint's scale and zero point, values outside clip
    s_static = torch.tensor([0.01])
    zp_static = None if symmetric else torch.tensor([5], dtype=torch.int32)
    q, s2, zp2 = Q.int8_quant_act(x, s_static, zp_static, symmetric=symmetric)
    expect = torch.round(x / 0.01) + (0 if symmetric else 5)
    assert torch.equal(q.long(), expect.clamp(-128, 127).long())


SHAPES = [(1, 64, 48), (5, 96, 40), (3, 576, 960), (17, 1536, 576), (2, 33, 7)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mode", ["dyn-sym", "dyn-asym", "static-sym", "static-asym"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["auto", "fp32_exact"])
def test_int8_linear_kernel(shape, mode, dtype, method):
    m, k, n = shape
    gen = torch.Generator().manual_seed(hash((shape, mode, str(dtype))) % 2**31)
    w = torch.randn(n, k, generator=gen) * 0.05
    codes, scale = quantize_weight_int8(w, "channel")
    scale = scale.reshape(n)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype).reshape(1, m, k)
    bias = torch.randn(n, generator=gen).to(dtype)
    symmetric = mode.endswith("-sym")
    in_scale = in_zp = None
    if mode.startswith("static"):
        lo, hi = float(x.min()), float(x.max())
        if symmetric:
            in_scale = torch.tensor(max(-lo, hi) / 127.5)
        else:
            in_scale = torch.tensor((hi - lo) / 255)
            in_zp = torch.round(-128 - lo / in_scale).to(torch.int32)
    col_sums = None if symmetric else codes.to(torch.int32).sum(1, dtype=torch.int32)
    y = get_kernel("int8_linear")(x, codes, scale, input_scale=in_scale,
                                  input_zero_point=in_zp, input_symmetric=symmetric,
                                  weight_col_sums=col_sums, bias=bias, mm_method=method)
    assert y.shape == (1, m, n)
    ref, mag, (q, s, zp) = quantized_oracle(x, codes, scale, bias, input_scale=in_scale,
                                            input_zp=in_zp, symmetric=symmetric)
    check_quantized(y, ref, mag, dtype, bias)
    # vs unquantized activations: each activation moves by <= half a step
    # (static: the scale covers x's range, so nothing clips)
    wd = codes.double() * scale.double()[:, None]
    exact = x.reshape(m, k).double() @ wd.t() + bias.double()
    step = s.double().expand(m, 1) if s.dim() else s.double().reshape(1, 1).expand(m, 1)
    act_bound = step / 2 * wd.abs().sum(1)[None, :] * (1 + 1e-5)
    err = (y.double().reshape(m, n) - exact).abs()
    assert bool((err <= act_bound + OUT_REL[dtype] * exact.abs() + 4e-7 * mag + 1e-6).all())


@pytest.mark.parametrize("shape", SHAPES + [(64, 576, 3072), (300, 64, 40), (0, 64, 48)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_cpu_native_int8_linear_is_the_torch_kernel(shape, dtype, with_bias, monkeypatch):
    """cpu_native's W8A8 op (C++ quantizer and epilogue around the int8 GEMM: AMX tiles
    where the CPU has them, torch's otherwise) gives
    the torch kernel's bytes for dynamic symmetric activations (that kernel is held to
    the float64 oracle above), through one op call per linear, and hands everything
    else to it. Exact halves and an all-zero row exercise the rounding and the scale."""
    from conftest import kernel_calls
    from vllm_accel.ops.cpu_native import int8_linear as native_w8a8

    m, k, n = shape
    gen = torch.Generator().manual_seed(m * 7 + k + n)
    codes, scale = quantize_weight_int8(torch.randn(n, k, generator=gen) * 0.05, "channel")
    scale = scale.reshape(n)
    x = (torch.randn(m, k, generator=gen) * 2).to(dtype)
    if m >= 2:
        x[0] = 0  # all-zero row: scale 1
        x[1] = ((torch.arange(k) % 254) - 127 + 0.5) * 0.25  # |x| <= 31.625: halves of s
        x[1, 0] = 31.75  # = 127 * 0.25, so s = 0.25 and (i + 0.5) * 0.25 / s ties
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    assert native_w8a8.NATIVE_DISPATCH  # (the op has no ctypes path to count)
    calls = kernel_calls(monkeypatch, "int8_linear_dynamic", "", 0)
    ours = get_kernel("int8_linear", "cpu_native")(x.reshape(1, m, k), codes, scale, bias=bias,
                                                   mm_method=EXACT_MM)
    theirs = get_kernel("int8_linear", "reference")(x.reshape(1, m, k), codes, scale, bias=bias,
                                                    mm_method=EXACT_MM)
    assert ours.shape == (1, m, n) and ours.dtype == dtype
    assert torch.equal(ours.view(torch.uint8 if dtype != torch.float32 else torch.int32),
                       theirs.view(torch.uint8 if dtype != torch.float32 else torch.int32))
    # (a CPU with neither an exact torch._int_mm nor the library's int8 GEMM, e.g. an
    # SSE2-only x86-64, resolves "fp32_exact", which the op does not compute)
    expected = (1, m) if native_w8a8.takes_mm_method(EXACT_MM) else (0, 0)
    assert calls() == expected
    # static, asymmetric or the fp32 GEMM path: the torch kernel's answer, no op call
    for kwargs in ({"input_scale": torch.tensor(0.05)}, {"input_symmetric": False,
                   "weight_col_sums": codes.to(torch.int32).sum(1, dtype=torch.int32)},
                   {"mm_method": "fp32_exact"}):
        kwargs = {"mm_method": EXACT_MM, **kwargs}
        assert torch.equal(get_kernel("int8_linear", "cpu_native")(x, codes, scale, **kwargs),
                           get_kernel("int8_linear", "reference")(x, codes, scale, **kwargs))
    assert calls() == expected


# (m, k, n): one or two 16-row tiles of q (17: the second nearly empty; 300: two
# 256-row blocks); K whole 64-column steps read in place (64, 576) or a padded copy (7,
# 100); N a block of 32 and one of 16 (48), partial tiles (9, 40)
AMX_SHAPES = [(1, 64, 48), (4, 100, 9), (17, 576, 40), (33, 7, 48), (300, 64, 40),
              (40, 100, 300)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", AMX_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_amx_int8_linear_gives_the_epilogue_of_torchs_int32_sums(shape, dtype):
    """The op's int8 GEMM on AMX tiles (csrc/int8_linear.cpp) runs exactly where the CPU
    has AMX-INT8 (it answers -5 elsewhere) and writes, bit for bit, the epilogue of the
    exact integer sums (torch._int_mm's): ((sum * row scale) * column scale) + bias in
    float32, rounded once to the output dtype; on row-strided operands, with codes at
    both ends of the range, partial and padded tiles, two chunks of weight blocks, two
    blocks of 256 rows, and nothing written past N."""
    import ctypes

    from vllm_accel.ops.cpu_native import build as native

    lib = native.library()
    if lib is None:  # only where there is no compiler: the op keeps torch's GEMM there
        assert native.compiler() is None, "the kernel library failed to build"
        return
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + 3 * k + 7 * n)
    q = torch.randint(-127, 128, (m, k + 3), generator=gen, dtype=torch.int8)[:, 1:k + 1]
    w = torch.randint(-127, 128, (n, k + 5), generator=gen, dtype=torch.int8)[:, 2:k + 2]
    q[0, :] = 127
    w[0, :] = -127
    row_scales = torch.rand(m, generator=gen) * 1e-2
    col_scales = torch.rand(n, generator=gen) * 1e-2
    bias = torch.randn(n, generator=gen)
    y = torch.full((m, n + 2), 7, dtype=dtype)
    linear = lib.accel_int8_linear_amx
    linear.argtypes = ([ctypes.c_void_p, ctypes.c_int64] * 2 + [ctypes.c_int64] * 3
                       + [ctypes.c_void_p] * 3 + [ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64])
    rc = linear(q.data_ptr(), q.stride(0), w.data_ptr(), w.stride(0), m, n, k,
                row_scales.data_ptr(), col_scales.data_ptr(), bias.data_ptr(),
                native.DTYPE_CODES[dtype], y.data_ptr(), y.stride(0))
    assert rc == (0 if cpu_has("amx_tile", "amx_int8", "avx512f") else -5)
    if rc == 0:
        sums = (q.long() @ w.long().T).float()  # exact: below 2**24
        expected = ((sums * row_scales[:, None]) * col_scales[None, :] + bias).to(dtype)
        assert torch.equal(y[:, :n], expected)
        assert bool((y[:, n:] == 7).all())  # nothing written past n


# (m, k, n): one row and pairs of rows, k whole 16-column steps (64, 1536) or with a
# scalar tail (7, 100), n whole 4-row blocks or not (9, 3)
INT8_GEMM_SHAPES = [(1, 64, 8), (2, 100, 9), (5, 1536, 64), (64, 7, 3), (130, 100, 40)]


@pytest.mark.parametrize("shape", INT8_GEMM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_own_int8_gemm_is_exact_where_built(shape):
    """The library's int8 GEMM (csrc/int8_linear.cpp, CPUs with AVX2 but no AVX-512,
    where torch's is not exact) gives the exact int32 sums, on row-strided operands,
    with every pair of a row at the extreme codes (where int16 pair sums would
    saturate), called directly and as the dispatcher op ``vllm_accel::int8_gemm``
    (what the W8A8 method's ``native`` GEMM calls); it is built exactly there (-5
    elsewhere)."""
    from vllm_accel.ops.cpu_native import build as native
    from vllm_accel.ops.cpu_native import int8_linear as native_w8a8

    lib = native.library()
    avx2_only = cpu_has("avx2", "fma", "f16c") and not cpu_has("avx512f")
    assert native_w8a8.own_gemm() == (lib is not None and avx2_only)
    if lib is None:
        assert native.compiler() is None, "the kernel library failed to build"
        return
    m, k, n = shape
    gen = torch.Generator().manual_seed(m + k + n)
    q = torch.randint(-128, 128, (m, k + 3), generator=gen, dtype=torch.int8)[:, 1:k + 1]
    w = torch.randint(-128, 128, (n, k + 5), generator=gen, dtype=torch.int8)[:, 2:k + 2]
    q[0, :], w[0, :] = -128, -128  # 2 * 128 * 128 per pair: past int16
    if n > 1:
        w[1, :] = 127
    acc = torch.full((m, n + 1), 7, dtype=torch.int32)
    rc = lib.accel_int8_gemm(q.data_ptr(), q.stride(0), w.data_ptr(), w.stride(0), m, n, k,
                             acc.data_ptr(), acc.stride(0))
    assert rc == (0 if avx2_only else -5)
    if rc == 0:
        exact = q.long() @ w.long().T
        assert torch.equal(acc[:, :n].long(), exact)
        assert bool((acc[:, n] == 7).all())  # nothing written past n
        assert torch.equal(torch.ops.vllm_accel.int8_gemm(q, w).long(), exact)


def _int_mm_exact_on_random_codes() -> bool:
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(-128, 128, (16, 256), generator=gen, dtype=torch.int8)
    w = torch.randint(-128, 128, (32, 256), generator=gen, dtype=torch.int8)
    return torch.equal(torch._int_mm(a, w.t()).long(), a.long() @ w.long().t())


def test_kernel_registry_and_int_mm_probe():
    """torch >= 2.3 has a CPU _int_mm; the probe says whether it is exact here, as
    random full-range codes show (oneDNN's AVX2 int8 GEMM saturates int16 pair sums:
    CPUs without AVX-512 or AVX-VNNI)."""
    assert "reference" in providers_of("int8_linear")
    assert "reference" in providers_of("int8_quant_act")
    assert Q._int_mm_works(torch.device("cpu")) == _int_mm_exact_on_random_codes()
    if cpu_has("avx512f") or cpu_has("avx_vnni"):
        assert Q._int_mm_works(torch.device("cpu"))


# ---------------------------------------------------------------------------
# resident layout
# ---------------------------------------------------------------------------


def test_resident_per_tensor_merged_shards_kept_exact():
    """Per-tensor scales of merged shards expand per channel: codes unchanged."""
    gen = torch.Generator().manual_seed(5)
    widths = [64, 32, 32]
    ws = [torch.randn(wd, 96, generator=gen) * f for wd, f in zip(widths, (0.01, 0.1, 1.0))]
    parts = [quantize_weight_int8(w, "tensor") for w in ws]
    codes = torch.cat([c for c, _ in parts])
    scales = torch.cat([s for _, s in parts])
    res = Q.w8a8_to_resident(codes, scales, widths, strategy="tensor")
    assert torch.equal(res.weight, codes) and res.weight.dtype == torch.int8
    assert res.weight_scale.shape == (128,)
    assert torch.equal(res.weight_scale, torch.repeat_interleave(scales.float(),
                                                                 torch.tensor(widths)))
    assert res.nbytes()["total"] == 128 * 96 + 128 * 4
    x = torch.randn(4, 96, generator=gen)
    y = Q.int8_linear(x, res.weight, res.weight_scale)
    ref, mag, _ = quantized_oracle(x, codes, res.weight_scale)
    check_quantized(y, ref, mag, torch.float32)


def test_resident_errors_name_layer():
    codes = torch.zeros(8, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="model.layers.2.self_attn.qkv_proj.*weight_scale "
                                         "is missing.*Fix:"):
        Q.w8a8_to_resident(codes, torch.tensor([0.1, float("nan")]), [4, 4],
                           strategy="tensor", prefix="model.layers.2.self_attn.qkv_proj")
    with pytest.raises(ValueError, match="layer 'x'.*not int8.*Fix:"):
        Q.w8a8_to_resident(codes.float(), torch.ones(8, 1), [8], strategy="channel",
                           prefix="x")
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.*strategy 'group'.*Fix:"):
        Q.AccelW8A8LinearMethod("group", True, True, "model.layers.0.mlp.down_proj")


def test_static_input_scales_of_merged_shards():
    codes = torch.ones(8, 16, dtype=torch.int8)
    res = Q.w8a8_to_resident(codes, torch.ones(8, 1), [4, 4], strategy="channel",
                             input_scale=torch.tensor([0.02, 0.02]))
    assert float(res.input_scale) == pytest.approx(0.02) and res.input_zero_point is None
    res = Q.w8a8_to_resident(codes, torch.ones(8, 1), [4, 4], strategy="channel",
                             input_scale=torch.tensor([0.02, 0.03]))
    assert float(res.input_scale) == pytest.approx(0.03)  # the max clips no shard
    # asym: union of the ranges [s * (-128 - zp), s * (127 - zp)]
    res = Q.w8a8_to_resident(codes, torch.ones(8, 1), [4, 4], strategy="channel",
                             input_scale=torch.tensor([0.01, 0.01]),
                             input_zero_point=torch.tensor([-28, 72], dtype=torch.int32),
                             input_symmetric=False)
    lo, hi = 0.01 * (-128 - 72), 0.01 * (127 + 28)
    assert float(res.input_scale) == pytest.approx((hi - lo) / 255)
    assert int(res.input_zero_point) == round(-128 - lo / ((hi - lo) / 255))
    assert torch.equal(res.weight_col_sums, torch.full((8,), 16, dtype=torch.int32))


# ---------------------------------------------------------------------------
# checkpoint format and vLLM config
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_w8a8(tmp_path_factory):
    """Tiny Llama (hidden 128, head_dim 32, 4 heads / 2 kv heads, 2 layers),
    W8A8 per-channel dynamic and per-tensor static (asym) variants."""
    root = tmp_path_factory.mktemp("w8a8")
    src = build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    rng = random.Random(0)
    calib = [[rng.randrange(3, 512) for _ in range(40)] for _ in range(4)]
    dyn = quantize_checkpoint_int8(src, root / "dyn", strategy="channel",
                                   dequant_dst=root / "dyn-dq")
    sta = quantize_checkpoint_int8(src, root / "static-asym", strategy="tensor", static=True,
                                   act_symmetric=False, calib_prompts=calib)
    return root, dyn, sta


def test_checkpoint_files(tiny_w8a8):
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    root, dyn, sta = tiny_w8a8
    cfg = json.loads((root / "dyn" / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "int-quantized"
    assert cfg["ignore"][0] == "lm_head" and cfg["quantization_status"] == "compressed"
    g = cfg["config_groups"]["group_0"]
    assert g["targets"] == ["Linear"]
    assert {k: g["weights"][k] for k in ("num_bits", "type", "symmetric", "strategy",
                                         "dynamic")} == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
        "dynamic": False}
    assert {k: g["input_activations"][k] for k in ("num_bits", "type", "symmetric",
                                                   "strategy", "dynamic")} == {
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    st = load_file(root / "dyn" / "model.safetensors")
    q = "model.layers.0.self_attn.q_proj"
    assert st[f"{q}.weight"].dtype == torch.int8 and st[f"{q}.weight"].shape == (128, 128)
    assert st[f"{q}.weight_scale"].shape == (128, 1)
    assert f"{q}.input_scale" not in st and f"{q}.weight_zero_point" not in st
    assert st["lm_head.weight"].dtype == torch.float32
    # compressed-tensors' own dequantization of the written tensors = the oracle's weights
    dq = load_file(root / "dyn-dq" / "model.safetensors")
    ct = dequantize(st[f"{q}.weight"], st[f"{q}.weight_scale"])
    assert torch.equal(ct.float(), dq[f"{q}.weight"])
    sa = load_file(root / "static-asym" / "model.safetensors")
    assert sa[f"{q}.weight_scale"].shape == (1,) and sa[f"{q}.input_scale"].shape == (1,)
    assert sa[f"{q}.input_zero_point"].dtype == torch.int8
    # q/k/v read the same input: identical calibrated activation quantizers
    k = "model.layers.0.self_attn.k_proj"
    assert torch.equal(sa[f"{q}.input_scale"], sa[f"{k}.input_scale"])
    assert sta[q].input_zero_point is not None


def test_smoothquant_keeps_the_float_model(tmp_path):
    """The test quantizer's SmoothQuant folding changes weights, not the function:
    HF logits of the smoothed float model equal the original's (fp32 rounding)."""
    from quantizer import _load_state_dict
    from quantizer_int8 import channel_absmax, smooth_state
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    rng = random.Random(3)
    calib = [[rng.randrange(3, 512) for _ in range(30)] for _ in range(3)]
    state = _load_state_dict(src)
    before = {k: v.clone() for k, v in state.items()}
    smooth_state(state, channel_absmax(src, calib, ("q_proj", "gate_proj", "down_proj")), 0.8)
    changed = [k for k in state if not torch.equal(state[k], before[k])]
    assert "model.layers.0.input_layernorm.weight" in changed
    assert "model.layers.1.mlp.down_proj.weight" in changed
    (tmp_path / "sm").mkdir()
    save_file(state, str(tmp_path / "sm" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "sm" / "config.json").write_text((src / "config.json").read_text())
    ids = torch.tensor([[rng.randrange(3, 512) for _ in range(25)]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(ids).logits
        b = AutoModelForCausalLM.from_pretrained(tmp_path / "sm", dtype=torch.float32)(ids).logits
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), (a - b).abs().max()


def test_model_config_dispatches_to_w8a8(tiny_w8a8):
    from vllm.config import ModelConfig
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_accel.quant.compressed_tensors import AccelCompressedTensorsConfig

    root, _, _ = tiny_w8a8
    for variant, strategy, dynamic, sym in (("dyn", "channel", True, True),
                                            ("static-asym", "tensor", False, False)):
        mc = ModelConfig(model=str(root / variant), skip_tokenizer_init=True,
                         dtype="float32")
        assert mc.quantization == "gcu_compressed_tensors"
        cfg = AccelCompressedTensorsConfig.from_config(mc.hf_config.quantization_config)

        class FakeLinear(LinearBase):  # only the type matters for dispatch
            def __init__(self):
                torch.nn.Module.__init__(self)

        method = cfg.get_quant_method(FakeLinear(), "model.layers.0.mlp.down_proj")
        assert type(method) is Q.AccelW8A8LinearMethod, variant
        assert (method.weight_strategy, method.input_dynamic, method.input_symmetric) == (
            strategy, dynamic, sym)


# ---------------------------------------------------------------------------
# vLLM layers (no engine)
# ---------------------------------------------------------------------------


@pytest.fixture
def tp1(monkeypatch):
    """vLLM linear layers outside an engine: a single rank, no process groups."""
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.parameter as P
    from vllm.config import VllmConfig, set_current_vllm_config

    for mod in (L, P):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
    with set_current_vllm_config(VllmConfig()):
        yield L


@pytest.mark.parametrize("variant", ["dyn", "static-asym"])
def test_vllm_layers_load_merged_shards(tp1, tiny_w8a8, variant):
    """qkv (q/k/v of different widths), gate_up and down through vLLM's weight
    loaders from the tiny checkpoint's layer 0, vs the float64 oracle."""
    from safetensors.torch import load_file

    L = tp1
    root, dyn, sta = tiny_w8a8
    state = load_file(root / variant / "model.safetensors")
    strategy, dynamic, sym = (("channel", True, True) if variant == "dyn"
                              else ("tensor", False, False))

    from vllm_accel.quant.compressed_tensors import AccelCompressedTensorsConfig

    qcfg = json.loads((root / variant / "config.json").read_text())["quantization_config"]
    cfg = AccelCompressedTensorsConfig.from_config(qcfg)

    pre = "model.layers.0"
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 128, generator=gen)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix=f"{pre}.self_attn.qkv_proj", params_dtype=torch.float32),
         [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")], x),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=False, quant_config=cfg,
                                      prefix=f"{pre}.mlp.gate_up_proj",
                                      params_dtype=torch.float32),
         [("mlp.gate_proj", 0), ("mlp.up_proj", 1)], x),
        (L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                             prefix=f"{pre}.mlp.down_proj", params_dtype=torch.float32),
         [("mlp.down_proj", None)], torch.randn(5, 256, generator=gen)),
    ]
    for layer, shards, inp in cases:
        assert type(layer.quant_method) is Q.AccelW8A8LinearMethod
        m = layer.quant_method
        assert (m.weight_strategy, m.input_dynamic, m.input_symmetric) == (strategy, dynamic, sym)
        for name, sid in shards:
            for suffix in ("weight", "weight_scale", "input_scale", "input_zero_point"):
                key = f"{pre}.{name}.{suffix}"
                if key not in state:
                    continue
                p = getattr(layer, suffix)
                if sid is None:
                    p.weight_loader(p, state[key])
                else:
                    p.weight_loader(p, state[key], sid)
        layer.quant_method.process_weights_after_loading(layer)
        params = {n.removeprefix("w8a8."): p for n, p in layer.named_parameters()}
        expect = {"weight", "weight_scale"} | (set() if dynamic else {"input_scale"}) | (
            set() if sym else {"input_zero_point", "weight_col_sums"})
        assert set(params) == expect, set(params)
        assert params["weight"].dtype == torch.int8
        codes = torch.cat([state[f"{pre}.{n}.weight"] for n, _ in shards])
        wscale = torch.cat([state[f"{pre}.{n}.weight_scale"].float().reshape(-1, 1)
                            .expand(state[f"{pre}.{n}.weight"].shape[0], 1)
                            for n, _ in shards]).reshape(-1)
        assert torch.equal(layer.w8a8.weight, codes)  # no requantization
        in_scale = in_zp = None
        if not dynamic:
            first = shards[0][0]
            in_scale = state[f"{pre}.{first}.input_scale"].float().reshape(())
            in_zp = state[f"{pre}.{first}.input_zero_point"].to(torch.int32).reshape(())
            assert float(layer.w8a8.input_scale) == float(in_scale)
            assert int(layer.w8a8.input_zero_point) == int(in_zp)
        y = layer(inp)[0]
        ref, mag, _ = quantized_oracle(inp, codes, wscale, input_scale=in_scale,
                                       input_zp=in_zp, symmetric=sym)
        check_quantized(y, ref, mag, torch.float32)


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

ENGINE_CASES = {
    # name: quantize kwargs
    "channel-dynamic": dict(strategy="channel"),
    "tensor-static": dict(strategy="tensor", static=True),
    "channel-static-asym": dict(strategy="channel", static=True, act_symmetric=False),
}
#: teacher-forced log-prob of vLLM's tokens, vLLM vs the fake-quant HF oracle:
#: (mean, max) of |difference| over all positions. Not ~1e-6 everywhere: fp32
#: differences of ~1e-7 between vLLM's and HF's layers (RMSNorm, attention)
#: occasionally move an activation across a rounding boundary, which changes its
#: int8 code by one step (seen: 1 flip in layer 0's o_proj input of a 60-token
#: prompt, max |d logprob| 0.1); its effect then spreads through later layers.
#: The mean stays small; the max bounds the worst such cascade.
TINY_LOGPROB_BOUND = (0.01, 0.25)


def _agreement(got, expected):
    pairs = [(a, b) for g, e in zip(got, expected) for a, b in zip(g, e)]
    return sum(a == b for a, b in pairs) / len(pairs), len(pairs)


def _engine_spec(model, prompts, new_tokens, extra_llm=None):
    return {"llm": {"model": str(model), "dtype": "float32", "enforce_eager": True,
                    "skip_tokenizer_init": True, "max_model_len": 512, "seed": 0,
                    **(extra_llm or {})},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True,
                         "detokenize": False, "logprobs": 1}}


def _engine_vs_oracle(name, engine, dequant, layers, prompts, new_tokens, dynamic,
                      symmetric):
    """Engine ``name``'s tokens and log-probs vs the fake-quant HF oracle on the
    dequantized weights (and vs HF with fp32 activations)."""
    results, log = engine
    assert results["platform"] == "AccelPlatform"
    assert "quantization=gcu_compressed_tensors" in log
    assert "AccelW8A8LinearMethod serves" in log
    assert "W8A8 int8 qkv_proj" in log and "W8A8 int8 down_proj" in log
    got = [o["token_ids"] for o in results["outputs"]]
    vllm_lp = [[step[str(t)] for t, step in zip(o["token_ids"], o["logprobs"])]
               for o in results["outputs"]]
    expected, hf_lp, tf = hf_oracle(dequant, prompts, new_tokens, layers, dynamic,
                                    symmetric, score=got)
    plain, _, tf_plain = hf_oracle(dequant, prompts, new_tokens, score=got)
    agree, n = _agreement(got, expected)
    agree_plain, _ = _agreement(got, plain)
    agree_tf, _ = _agreement(got, tf)
    agree_tf_plain, _ = _agreement(got, tf_plain)
    diffs = [abs(a - b) for va, ha in zip(vllm_lp, hf_lp) for a, b in zip(va, ha)]
    lp_mean, lp_max = sum(diffs) / len(diffs), max(diffs)
    print(f"{name}: {agree:.1%} of {n} positions agree with HF (act fake-quant), "
          f"{agree_plain:.1%} with HF (fp32 activations); exact sequences "
          f"{sum(g == e for g, e in zip(got, expected))}/{len(got)}; teacher-forced next-token "
          f"agreement {agree_tf:.1%} (act fake-quant), {agree_tf_plain:.1%} (fp32 "
          f"activations); |d logprob| mean {lp_mean:.2e} max {lp_max:.2e}")
    return {"free": agree, "tf": agree_tf, "tf_plain": agree_tf_plain}, (lp_mean, lp_max)


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model):
    """The checkpoints (each tiny case's, and the default model's W8A8) and their
    engines, which run one after another in one process: ``(SharedEngines, {name:
    (dequantized checkpoint, quantized layers, prompts)})``."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("w8a8")
    specs, cases = {}, {}
    for case, qkw in ENGINE_CASES.items():
        src = build_tiny_model(root / case / "float", num_heads=4, num_kv_heads=2,
                               head_dim=32, hidden_size=128)
        rng = random.Random(case)
        calib = [[rng.randrange(3, 512) for _ in range(64)] for _ in range(4)]
        layers = quantize_checkpoint_int8(src, root / case / "q", dequant_dst=root / case / "dq",
                                          calib_prompts=calib, **qkw)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 9, 17, 33, 2, 60)]
        cases[case] = (root / case / "dq", layers, prompts)
        specs[case] = (_engine_spec(root / case / "q", prompts, 16), None)
    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok(p)["input_ids"] for p in DEFAULT_PROMPTS]
    calib = [tok(c)["input_ids"] for c in CALIBRATION_TEXTS]
    layers = quantize_checkpoint_int8(default_model, root / "default" / "q", strategy="channel",
                                      calib_prompts=calib, smoothing=0.8,
                                      dequant_dst=root / "default" / "dq")
    cases["default"] = (root / "default" / "dq", layers, prompts)
    specs["default"] = (_engine_spec(root / "default" / "q", prompts, 32,
                                     {"max_model_len": 1024}), None)
    return SharedEngines(specs, root), cases


@pytest.mark.engine
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_w8a8_matches_hf_on_dequantized(case, engines):
    qkw = ENGINE_CASES[case]
    shared, cases = engines
    dequant, layers, prompts = cases[case]
    agree, lp_diff = _engine_vs_oracle(
        case, shared(case), dequant, layers, prompts, 16,
        dynamic=not qkw.get("static", False), symmetric=qkw.get("act_symmetric", True))
    assert agree["free"] >= 0.9 and agree["tf"] >= 0.9
    assert lp_diff[0] <= TINY_LOGPROB_BOUND[0] and lp_diff[1] <= TINY_LOGPROB_BOUND[1]


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "import numpy as np\n",
]
#: Why the default-model W8A8 case asserts teacher-forced agreement: SmolLM2-135M
#: (converted from a Q4_1 GGUF) is chaotic under any perturbation over 32 greedy
#: tokens: in HF alone, per-channel int8 *weights* (fp32 activations) keep only
#: 59% of free-running positions of the float model, and W8A8 per-token
#: activations 34% (its down_proj inputs have per-token max/mean ratios up to
#: ~1200, so per-token int8 is very lossy there). vLLM vs the fake-quant oracle
#: differ only by fp32 rounding, but over 30 layers those move some activations
#: across int8 rounding boundaries, the resulting code flips cascade, and one
#: flipped near-tie changes every later free-running position. Teacher forcing
#: (HF's next-token choice on vLLM's own prefix) compares every position on
#: the same context. SmoothQuant (strength 0.8, llmcompressor's default) shrinks
#: the outliers: the same HF-only comparison then gives argmax agreement 92-100%
#: and mean |d logprob| 0.03-0.09 (vs 76-93% and 0.09-0.28 without smoothing).
DEFAULT_MODEL_NOTE = True
#: default model, 30 layers: (mean, max) bound on |teacher-forced log-prob difference|
#: Measured without vLLM: HF with the dequantized weights + float64 fake-quant vs HF
#: with int8_linear in every Linear (same formula, different fp32 rounding), teacher
#: forced on 3 natural-text prompts, smoothed model: mean |d logprob| 0.03-0.09,
#: max 0.16-0.58. That cascade, not the kernel, sets these bounds.
DEFAULT_LOGPROB_BOUND = (0.15, 1.0)


#: SmoothQuant calibration text (disjoint from the test prompts)
CALIBRATION_TEXTS = [
    "Machine learning is a field of study in artificial intelligence concerned with the "
    "development of statistical algorithms that can learn from data.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y\n",
    "Paris is the capital and largest city of France. The city is known for its museums, "
    "architecture and cafes.",
]


@pytest.mark.engine
def test_engine_w8a8_default_model(engines):
    """SmolLM2-135M W8A8 as llmcompressor's W8A8 recipe makes it (SmoothQuant 0.8,
    per-channel int8 weights, dynamic per-token int8 activations), 8 prompts x 32
    new tokens vs HF on the dequantized (smoothed) weights."""
    shared, cases = engines
    dequant, layers, prompts = cases["default"]
    agree, lp_diff = _engine_vs_oracle("default-model W8A8 dynamic", shared("default"), dequant,
                                       layers, prompts, 32, dynamic=True, symmetric=True)
    # Free-running agreement is printed, not asserted (see DEFAULT_MODEL_NOTE). Teacher
    # forced: vs the fake-quant oracle and vs HF with fp32 activations (measured 97.7% and
    # 95.3%).
    assert agree["tf"] >= 0.9 and agree["tf_plain"] >= 0.9
    assert lp_diff[0] <= DEFAULT_LOGPROB_BOUND[0] and lp_diff[1] <= DEFAULT_LOGPROB_BOUND[1]
