"""The ``torch_fast`` weight-only GEMM (torch's fused int4/int8 CPU kernels)
vs ``x @ W.T`` in float64, ``W`` built in the test from the random codes, scales
and zero points it packed (independent of the library's unpacking)."""

import pytest
import torch

from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import wint_gemm as torch_fast_gemm
from vllm_accel.quant.packed import resident_from_codes

choose_layout = get_kernel("wint_prepare", "torch_fast")
linear = get_kernel("wint_prepared_linear", "torch_fast")


def prepare(res, dtype):
    """The fused kernels' layout for ``dtype`` activations, also where the provider
    keeps the generic one for them (``test_int4_layout_for_bf16_activations_only``):
    cpu_native runs float32 on it."""
    return torch_fast_gemm.prepare(res, dtype, int4_act_dtypes=(dtype,))


def make_resident(n, k, bits, group_size, sym, act_order, seed):
    """A random resident weight and its float64 ``[out, in]`` in checkpoint column
    order, computed here from the raw codes (resident column ``j`` multiplies
    ``x[..., perm[j]]``)."""
    g = torch.Generator().manual_seed(seed)
    gs = k if group_size == -1 else group_size
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g)
    scales = torch.rand(n, k // gs, generator=g) * 0.02 + 0.002
    zeros = None if sym else torch.randint(0, 2 ** bits, (n, k // gs), generator=g).float()
    perm = torch.randperm(k, generator=g) if act_order else None
    res = resident_from_codes(codes, scales, zeros, bits=bits, group_size=group_size,
                              perm=perm)
    z = torch.full_like(scales, 2.0 ** (bits - 1)) if zeros is None else zeros
    w_resident = ((codes.double() - z.double().repeat_interleave(gs, 1))
                  * scales.double().repeat_interleave(gs, 1))
    w = torch.empty_like(w_resident)
    w[:, perm if perm is not None else torch.arange(k)] = w_resident
    return res, w


# fp32: scales exact, fp32 accumulation; bf16/fp16: scales (and 4-bit's folded
# zero term) rounded to the activation dtype once, plus the output rounding.
REL = {torch.float32: 2e-5, torch.bfloat16: 1.2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 7, 64])
@pytest.mark.parametrize("bits,group_size,sym,act_order", [
    (4, 32, True, False), (4, 64, False, False), (4, 128, False, True),
    (4, -1, False, False),  # per channel: K = 576 tiled by 64-groups
    (4, 192, True, False),  # 192 = 3 x 64: repeated scales
    (8, -1, True, False), (8, -1, False, True),
])
def test_matches_float64(bits, group_size, sym, act_order, tokens, dtype):
    n, k = 96, 576 if group_size != 128 else 512
    res, w = make_resident(n, k, bits, group_size, sym, act_order, seed=bits * 1000 + tokens)
    prepared = prepare(res, dtype)
    assert prepared is not None
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    bias = torch.randn(n).to(dtype)
    y = linear(x, prepared, bias)
    ref = x.double() @ w.t() + bias.double()
    magnitude = x.double().abs() @ w.abs().t() + bias.double().abs()
    err = (y.double() - ref).abs()
    assert y.dtype == dtype and y.shape == (tokens, n)
    assert bool((err <= REL[dtype] * magnitude + 1e-6).all()), (err / magnitude).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k", [576, 72])  # 72: not a multiple of 16
@pytest.mark.parametrize("sym", [True, False])
def test_int8_kernel_choice(dtype, k, sym):
    """torch's int8pack GEMM only where it is fast and correct (bf16, K % 16 == 0);
    everything else per channel goes to the fp32 tile custom op."""
    res, w = make_resident(1100, k, 8, -1, sym, False, seed=k)  # > one 1024-row tile
    prepared = prepare(res, dtype)
    fused = dtype == torch.bfloat16 and k % 16 == 0
    assert ("int8_weight" in prepared) == fused and ("int8_tile_weight" in prepared) != fused
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(2)).to(dtype)
    y = linear(x, prepared)
    err = (y.double() - x.double() @ w.t()).abs()
    assert bool((err <= REL[dtype] * (x.double().abs() @ w.abs().t()) + 1e-6).all())


def test_int4_layout_for_bf16_activations_only():
    """torch's int4 CPU kernel is a scalar loop for float32 and fp16 activations (60-80x
    slower than the reference kernel's float32 tiles from 8 rows): 4-bit weights keep
    the generic layout for them; 8-bit ones have their float32 tile kernel."""
    res4, _ = make_resident(128, 256, 4, 64, False, False, seed=0)
    res8, _ = make_resident(128, 256, 8, -1, False, False, seed=0)
    assert "int4_weight" in choose_layout(res4, torch.bfloat16)
    assert choose_layout(res4, torch.float32) is None
    assert choose_layout(res4, torch.float16) is None
    assert all(choose_layout(res8, dtype) is not None
               for dtype in (torch.float32, torch.bfloat16, torch.float16))


def test_weights_off_the_cpu_take_no_cpu_only_kernel():
    """torch's int4 and int8pack kernels exist for the CPU only: weights a card holds
    (here on the meta device) keep the generic layout at 4 bits and take the tiled
    int8 op of plain torch ops at 8, also for bf16, where the CPU gets int8pack."""
    res4, _ = make_resident(128, 256, 4, 64, False, False, seed=0)
    res8, _ = make_resident(128, 256, 8, -1, True, False, seed=0)
    for res in (res4, res8):
        res.qweight, res.scales = res.qweight.to("meta"), res.scales.to("meta")
        res.zeros = None if res.zeros is None else res.zeros.to("meta")
    assert choose_layout(res4, torch.bfloat16) is None
    prepared = choose_layout(res8, torch.bfloat16)
    assert set(prepared) == {"int8_tile_weight", "int8_tile_scales"}
    assert prepared["int8_tile_weight"].device.type == "meta"


def test_prepared_weight_is_as_compact_as_generic():
    res, _ = make_resident(256, 1024, 4, 128, False, False, seed=1)
    prepared = prepare(res, torch.bfloat16)
    assert prepared["int4_weight"].nbytes == res.qweight.nbytes == 256 * 1024 // 2


@pytest.mark.parametrize("case", ["n-not-16", "8bit-grouped", "group-16", "scattered-groups"])
def test_unsupported_layouts_keep_the_generic_kernel(case):
    if case == "n-not-16":
        res, _ = make_resident(40, 128, 4, 32, True, False, seed=0)
    elif case == "8bit-grouped":
        res, _ = make_resident(32, 128, 8, 32, True, False, seed=0)
    elif case == "group-16":
        res, _ = make_resident(32, 128, 4, 16, True, False, seed=0)
    else:
        res, _ = make_resident(32, 128, 4, 32, True, False, seed=0)
        res.g_idx = torch.arange(128, dtype=torch.int32) % 4
    assert prepare(res, torch.float32) is None and choose_layout(res, torch.bfloat16) is None
    assert get_kernel("wint_prepare", "reference")(res, torch.float32) is None


def test_int4_group_size_choice():
    assert torch_fast_gemm._int4_group_size(128, 512) == 128
    assert torch_fast_gemm._int4_group_size(576, 576) == 64
    assert torch_fast_gemm._int4_group_size(96, 576) == 32
    assert torch_fast_gemm._int4_group_size(16, 576) is None
