"""A Llama decoder layer as one C++ op (``vllm_accel::cpu_decoder_layer``,
``models/llama.py``) against a float64 layer, against the same kernels called one by
one, and in an engine against HF transformers."""

import random

import pytest
import torch

from conftest import (SharedEngines, assert_bf16_tokens_near_hf, build_tiny_model, kernel_calls,
                      run_engine)
from paged_cases import HKV, batch_mix, build, kernel_args, make_case, read_kv, reference
from vllm_accel.ops.cpu_native import bf16_linear
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.cpu_native import int8_linear  # noqa: F401 (defines int8_linear_dynamic)
from vllm_accel.ops.cpu_native import wint_gemv

pytestmark = pytest.mark.skipif(native.torch_ops() is None,
                                reason="the C++ ops library builds only with a C++ compiler")

HEADS, HEAD, HIDDEN, INTER, BS, EPS, SCALE = 3 * HKV, 64, 192, 256, 32, 1e-5, 0.125
ops = torch.ops.vllm_accel


def _weights(dtype, seed=5):
    """A layer's weights (bf16 linears; norms and the rope cache in ``dtype``) and the
    rope cache as vLLM builds it (neox, base 10000)."""
    g = torch.Generator().manual_seed(seed)

    def linear(n, k):
        return (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)

    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD, 2, dtype=torch.float64) / HEAD)
    freqs = torch.outer(torch.arange(512, dtype=torch.float64), inv_freq)
    return dict(
        input_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype),
        qkv=linear((HEADS + 2 * HKV) * HEAD, HIDDEN), o=linear(HIDDEN, HEADS * HEAD),
        post_norm=(1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(dtype),
        gate_up=linear(2 * INTER, HIDDEN), down=linear(HIDDEN, INTER),
        cos_sin=torch.cat([freqs.cos(), freqs.sin()], -1).to(dtype))


def _case(mix, dtype, kv, seed=3):
    """Requests (decodes first, as vLLM orders them) with their cached history, the
    batch's hidden states, residual and positions, and the attention metadata."""
    reqs = sorted(batch_mix(mix, BS), key=lambda r: r[0] != 1)
    if kv == "auto":
        _, ks, vs, block_table, cache = make_case(reqs, BS, HEADS, HKV, HEAD, dtype, seed=seed)
    else:
        _, ks, vs, block_table, cache, _ = build(reqs, BS, 3, HEAD, dtype, "LHBNC", seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    tokens = sum(q for q, _ in reqs)
    positions = torch.cat([torch.arange(s - q, s) for q, s in reqs])
    slots = torch.cat([block_table[i, pos // BS].long() * BS + pos % BS
                       for i, (q, s) in enumerate(reqs) for pos in [torch.arange(s - q, s)]])
    query_start_loc, seq_lens = kernel_args(reqs)
    return dict(reqs=reqs, ks=ks, vs=vs, cache=cache, positions=positions,
                hidden=torch.randn(tokens, HIDDEN, generator=g).to(dtype),
                residual=torch.randn(tokens, HIDDEN, generator=g).to(dtype),
                md=(slots, block_table, query_start_loc, seq_lens))


def _op(case, w, residual, cache, max_prefill_pairs=1 << 20, qkv=None):
    return ops.cpu_decoder_layer(
        case["hidden"], residual, case["positions"], w["input_norm"],
        w["qkv"] if qkv is None else qkv, None, w["o"], None, w["post_norm"], w["gate_up"],
        w["down"], EPS, w["cos_sin"], HEAD, True, HEADS, HKV, HEAD, cache, *case["md"], SCALE,
        0.0, 0.0, max_prefill_pairs)


def _rms_norm(x, weight):
    return x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * weight.double()


def _rope(x, positions, cos_sin):
    cos, sin = cos_sin.double()[positions].chunk(2, -1)
    cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x.chunk(2, -1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _float64_layer(case, w, with_residual):
    """The layer in float64 on the same weights and history; (out, residual, new K)."""
    x = case["hidden"].double()
    if with_residual:
        x = x + case["residual"].double()
    qkv = _rms_norm(x, w["input_norm"]) @ w["qkv"].double().T
    q, k, v = qkv.split([HEADS * HEAD, HKV * HEAD, HKV * HEAD], -1)
    q = _rope(q.view(-1, HEADS, HEAD), case["positions"], w["cos_sin"])
    k = _rope(k.view(-1, HKV, HEAD), case["positions"], w["cos_sin"])
    v = v.view(-1, HKV, HEAD)
    attn, start = [], 0
    for (n, s), k_hist, v_hist in zip(case["reqs"], case["ks"], case["vs"]):
        k_all, v_all = k_hist.double().clone(), v_hist.double().clone()
        k_all[s - n:], v_all[s - n:] = k[start:start + n], v[start:start + n]
        attn.append(reference(q[start:start + n], k_all, v_all, SCALE))
        start += n
    x = torch.cat(attn).flatten(1) @ w["o"].double().T + x
    gate, up = (_rms_norm(x, w["post_norm"]) @ w["gate_up"].double().T).chunk(2, -1)
    return (torch.nn.functional.silu(gate) * up) @ w["down"].double().T, x, k


@pytest.mark.parametrize("dtype,mix,with_residual", [
    (torch.float32, "mixed", True), (torch.float32, "decode", False),
    (torch.bfloat16, "prefill_ctx", True)])
def test_op_matches_a_float64_layer(dtype, mix, with_residual, monkeypatch):
    """Output, residual and the K written to the cache against a float64 layer on the same
    (bf16) weights: float32 activations to 1e-5 of the output's scale (the kernels round
    only to float32), bf16 ones within bf16's rounding at each op boundary; one call."""
    case, w = _case(mix, dtype, "auto"), _weights(dtype)
    calls = kernel_calls(monkeypatch, "cpu_decoder_layer", "", 0)
    cache = case["cache"].clone()
    out, residual = _op(case, w, case["residual"] if with_residual else None, cache)
    assert calls() == (1, len(case["hidden"]))
    want_out, want_residual, want_k = _float64_layer(case, w, with_residual)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want in ((out, want_out), (residual, want_residual)):
        assert got.dtype == dtype and got.shape == want.shape
        assert (got.double() - want).abs().max() <= tol * want.abs().max()
    slots = case["md"][0]
    k_written, _ = read_kv(cache, slots // BS, slots % BS, HEAD)
    assert (k_written.double() - want_k).abs().max() <= tol * want_k.abs().max()


@pytest.mark.parametrize("kv", ["auto", "int8"])
@pytest.mark.parametrize("with_residual", [True, False])
def test_op_equals_the_kernels_one_by_one(kv, with_residual):
    """The same bits as vLLM's layer on the simulator's kernels, op by op (RMSNorm, the
    bf16 linears, rotary, the attention step, SiLU): output, residual and cache bytes,
    for a bf16 and an INT8 (dynamic scales) cache."""
    case, w = _case("mixed", torch.bfloat16, kv), _weights(torch.bfloat16)
    residual = case["residual"] if with_residual else None
    fused_cache, split_cache = case["cache"].clone(), case["cache"].clone()
    out, new_residual = _op(case, w, residual, fused_cache)
    want, r = _one_by_one(case, w, residual, split_cache)
    assert torch.equal(out, want) and torch.equal(new_residual, r)
    assert torch.equal(fused_cache.view(torch.uint8), split_cache.view(torch.uint8))


def _one_by_one(case, w, residual, cache, window=0, soft_cap=0.0, qk_norms=None,
                gemma_norms=None):
    """The layer as vLLM runs it on the simulator's kernels, op by op: (out, residual);
    with ``gemma_norms`` (attention-output, MLP-output weights) Gemma's layer, GELU-tanh."""
    h, r = ops.cpu_rms_norm(case["hidden"], w["input_norm"], EPS, residual)
    r = r if residual is not None else case["hidden"]
    q, k, v = ops.bf16_linear(h, w["qkv"], None).split([HEADS * HEAD, HKV * HEAD, HKV * HEAD],
                                                       -1)
    if qk_norms is not None:  # Qwen3: each head's q and k normed
        q = ops.cpu_rms_norm(q.reshape(-1, HEAD), qk_norms[0], EPS, None)[0].view(q.shape)
        k = ops.cpu_rms_norm(k.reshape(-1, HEAD), qk_norms[1], EPS, None)[0].view(k.shape)
    q, k = ops.cpu_rotary_embedding(case["positions"], q, k, w["cos_sin"], HEAD, HEAD, True)
    attn = torch.empty(len(q), HEADS, HEAD, dtype=torch.bfloat16)
    assert ops.cpu_attention_step(q.view(-1, HEADS, HEAD), k.view(-1, HKV, HEAD),
                                  v.view(-1, HKV, HEAD), cache, *case["md"], attn, SCALE,
                                  0.0, 0.0, 1 << 20, window, soft_cap)
    o = ops.bf16_linear(attn.flatten(1), w["o"], None)
    if gemma_norms is not None:
        o = ops.cpu_rms_norm(o, gemma_norms[0], EPS, None)[0]
    h, r = ops.cpu_rms_norm(o, w["post_norm"], EPS, r)
    gate_up = ops.bf16_linear(h, w["gate_up"], None)
    if gemma_norms is None:
        return ops.bf16_linear(ops.cpu_silu_and_mul(gate_up), w["down"], None), r
    gate, up = gate_up.chunk(2, -1)
    out = ops.bf16_linear(torch.nn.functional.gelu(gate, approximate="tanh") * up, w["down"],
                          None)
    return ops.cpu_rms_norm(out, gemma_norms[1], EPS, None)[0], r


@pytest.mark.parametrize("window,soft_cap", [(20, 0.0), (0, 8.0), (9, 5.0)])
def test_op_with_a_window_and_soft_cap_equals_the_kernels_one_by_one(window, soft_cap):
    """Mistral's sliding window and a logits soft-cap (windows shorter than the batch's
    histories, across block boundaries): the same bits as the kernels one by one with
    the same features (each held to float64 in test_attention_features.py), and not the
    plain causal layer's."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    fused_cache, split_cache = case["cache"].clone(), case["cache"].clone()
    out, new_residual = ops.cpu_decoder_layer(
        case["hidden"], case["residual"], case["positions"], w["input_norm"], w["qkv"], None,
        w["o"], None, w["post_norm"], w["gate_up"], w["down"], EPS, w["cos_sin"], HEAD, True,
        HEADS, HKV, HEAD, fused_cache, *case["md"], SCALE, 0.0, 0.0, 1 << 20, None, None,
        None, None, window, soft_cap)
    want, r = _one_by_one(case, w, case["residual"], split_cache, window, soft_cap)
    assert torch.equal(out, want) and torch.equal(new_residual, r)
    assert torch.equal(fused_cache.view(torch.uint8), split_cache.view(torch.uint8))
    plain, _ = _op(case, w, case["residual"], case["cache"].clone())
    assert not torch.equal(out, plain)


def test_op_with_qwen3_qk_norms_equals_the_kernels_one_by_one():
    """Qwen3's per-head q/k RMSNorm before the rotary: the same bits as the kernels one
    by one, and not the layer without them; one norm without the other is declined."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    norms = [(1 + 0.3 * torch.randn(HEAD, generator=g)).to(torch.bfloat16) for _ in range(2)]
    fused_cache, split_cache = case["cache"].clone(), case["cache"].clone()

    def op(cache, q_norm, k_norm):
        return ops.cpu_decoder_layer(
            case["hidden"], case["residual"], case["positions"], w["input_norm"], w["qkv"],
            None, w["o"], None, w["post_norm"], w["gate_up"], w["down"], EPS, w["cos_sin"],
            HEAD, True, HEADS, HKV, HEAD, cache, *case["md"], SCALE, 0.0, 0.0, 1 << 20, None,
            None, None, None, 0, 0.0, q_norm, k_norm)

    out, new_residual = op(fused_cache, *norms)
    want, r = _one_by_one(case, w, case["residual"], split_cache, qk_norms=norms)
    assert torch.equal(out, want) and torch.equal(new_residual, r)
    assert torch.equal(fused_cache.view(torch.uint8), split_cache.view(torch.uint8))
    plain, _ = _op(case, w, case["residual"], case["cache"].clone())
    assert not torch.equal(out, plain)
    assert op(case["cache"].clone(), norms[0], None) == (None, None)


def test_op_with_gemma_norms_and_gelu_equals_the_kernels_one_by_one():
    """Gemma's layer: the attention's and the MLP's outputs normed before they join the
    residual, q/k norms (Gemma 3), GELU-tanh, with Gemma 2's soft-cap and a window: the
    same bits as the kernels one by one, and not the layer without the output norms."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    qk = [(1 + 0.3 * torch.randn(HEAD, generator=g)).to(torch.bfloat16) for _ in range(2)]
    outs = [(1 + 0.3 * torch.randn(HIDDEN, generator=g)).to(torch.bfloat16) for _ in range(2)]

    def op(cache, attn_out_norm, mlp_out_norm, activation=2):
        return ops.cpu_decoder_layer(
            case["hidden"], case["residual"], case["positions"], w["input_norm"], w["qkv"],
            None, w["o"], None, w["post_norm"], w["gate_up"], w["down"], EPS, w["cos_sin"],
            HEAD, True, HEADS, HKV, HEAD, cache, *case["md"], SCALE, 0.0, 0.0, 1 << 20, None,
            None, None, None, 20, 8.0, *qk, attn_out_norm, mlp_out_norm, activation)

    fused_cache, split_cache = case["cache"].clone(), case["cache"].clone()
    out, new_residual = op(fused_cache, *outs)
    want, r = _one_by_one(case, w, case["residual"], split_cache, 20, 8.0, qk_norms=qk,
                          gemma_norms=outs)
    assert torch.equal(out, want) and torch.equal(new_residual, r)
    assert torch.equal(fused_cache.view(torch.uint8), split_cache.view(torch.uint8))
    without, _ = op(case["cache"].clone(), None, None)
    assert not torch.equal(out, without)
    assert op(case["cache"].clone(), *outs, activation=3) == (None, None)
    assert op(case["cache"].clone(), outs[0][:-1], outs[1]) == (None, None)


def _int4_linears(seed=9, group=64):
    """The four linears as 4-bit asymmetric group-64 weights in torch's CPU int4 layout
    (what the cpu_native int4 provider prepares from a GPTQ/AWQ checkpoint) and their
    exact dequantized values."""
    g = torch.Generator().manual_seed(seed)
    packed, sz, dense = {}, {}, {}
    for name, (n, k) in {"qkv": ((HEADS + 2 * HKV) * HEAD, HIDDEN), "o": (HIDDEN, HEADS * HEAD),
                         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}.items():
        codes = torch.randint(0, 16, (n, k), generator=g)
        zeros = torch.randint(4, 12, (n, k // group), generator=g).double()
        scales = (torch.rand(n, k // group, generator=g) * 0.02 / k**0.5 * 16 + 1e-3).to(
            torch.bfloat16).double()
        packed[name] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.int(), 1)
        sz[name] = torch.stack((scales.t(), ((8 - zeros) * scales).t()), -1).to(
            torch.bfloat16).contiguous()
        dense[name] = (codes - zeros.repeat_interleave(group, 1)) * scales.repeat_interleave(
            group, 1)
    return packed, sz, dense


def _int8_linears(seed=11):
    """The four linears as int8 weights with float32 per-channel scales (a W8A8
    checkpoint as AccelW8A8LinearMethod keeps it) and their exact dequantized values."""
    g = torch.Generator().manual_seed(seed)
    codes, scales, dense = {}, {}, {}
    for name, (n, k) in {"qkv": ((HEADS + 2 * HKV) * HEAD, HIDDEN), "o": (HIDDEN, HEADS * HEAD),
                         "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}.items():
        codes[name] = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scales[name] = torch.rand(n, generator=g) * 0.02 / k**0.5 + 1e-4
        dense[name] = codes[name].double() * scales[name].double()[:, None]
    return codes, scales, dense


def _fused_and_split(case, w, weights, quant, linear):
    """The layer through the op with ``weights`` and their quantization tensors, and
    the same kernels one by one with ``linear(x, name)``: (op's output, residual and
    cache, the split one's)."""
    fused_cache, split_cache = case["cache"].clone(), case["cache"].clone()
    out, new_residual = ops.cpu_decoder_layer(
        case["hidden"], case["residual"], case["positions"], w["input_norm"], weights["qkv"],
        None, weights["o"], None, w["post_norm"], weights["gate_up"], weights["down"], EPS,
        w["cos_sin"], HEAD, True, HEADS, HKV, HEAD, fused_cache, *case["md"], SCALE, 0.0, 0.0,
        1 << 20, quant["qkv"], quant["o"], quant["gate_up"], quant["down"])
    assert out is not None
    h, r = ops.cpu_rms_norm(case["hidden"], w["input_norm"], EPS, case["residual"])
    q, k, v = linear(h, "qkv").split([HEADS * HEAD, HKV * HEAD, HKV * HEAD], -1)
    q, k = ops.cpu_rotary_embedding(case["positions"], q, k, w["cos_sin"], HEAD, HEAD, True)
    attn = torch.empty(len(q), HEADS, HEAD, dtype=torch.bfloat16)
    assert ops.cpu_attention_step(q.view(-1, HEADS, HEAD), k.view(-1, HKV, HEAD),
                                  v.view(-1, HKV, HEAD), split_cache, *case["md"], attn, SCALE,
                                  0.0, 0.0, 1 << 20)
    h, r = ops.cpu_rms_norm(linear(attn.flatten(1), "o"), w["post_norm"], EPS, r)
    want = linear(ops.cpu_silu_and_mul(linear(h, "gate_up")), "down")
    return (out, new_residual, fused_cache), (want, r, split_cache)


def _declined_with_bad_quant(case, w, weights, quant, bad_qkv):
    """A quantized weight whose quantization tensor does not fit it is declined,
    nothing written."""
    cache = case["cache"].clone()
    assert ops.cpu_decoder_layer(
        case["hidden"], case["residual"], case["positions"], w["input_norm"], weights["qkv"],
        None, weights["o"], None, w["post_norm"], weights["gate_up"], weights["down"], EPS,
        w["cos_sin"], HEAD, True, HEADS, HKV, HEAD, cache, *case["md"], SCALE, 0.0, 0.0,
        1 << 20, bad_qkv, quant["o"], quant["gate_up"], quant["down"]) == (None, None)
    assert torch.equal(cache.view(torch.uint8), case["cache"].view(torch.uint8))


def test_int4_layer_matches_float64_and_the_kernels_one_by_one(monkeypatch):
    """A layer whose four linears are int4 (a GPTQ/AWQ model on the cpu_native int4
    layout): within bf16's rounding of a float64 layer on the dequantized weights, and
    the same bits as vLLM's layer op by op (``int4pack_linear`` for each linear)."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    packed, sz, dense = _int4_linears()
    gemv_calls = kernel_calls(monkeypatch, "int4pack_linear", "accel_int4pack_gemv", 6)
    (out, new_residual, fused_cache), split = _fused_and_split(
        case, w, packed, sz, lambda x, name: ops.int4pack_linear(x, packed[name], 64, sz[name]))
    # the four linears took the C++ int4 kernel inside the op, where it is built (then
    # once more each, one by one)
    tokens = len(case["hidden"])
    assert gemv_calls() == ((8, 8 * tokens) if wint_gemv.gemv_available() else (0, 0))
    want_out, want_residual, _ = _float64_layer(case, {**w, **dense}, True)
    for got, want in ((out, want_out), (new_residual, want_residual)):
        assert (got.double() - want).abs().max() <= 2e-2 * want.abs().max()
    assert torch.equal(out, split[0]) and torch.equal(new_residual, split[1])
    assert torch.equal(fused_cache.view(torch.uint8), split[2].view(torch.uint8))
    _declined_with_bad_quant(case, w, packed, sz, sz["qkv"][:, :HEAD])


def test_w8a8_layer_matches_float64_and_the_kernels_one_by_one(monkeypatch):
    """A layer whose four linears are W8A8 with dynamic per-token activations: within
    the activations' int8 rounding of a float64 layer on the dequantized weights, and
    the same bits as vLLM's layer op by op (``int8_linear_dynamic`` for each linear,
    which the op ran inside)."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    codes, scales, dense = _int8_linears()
    calls = kernel_calls(monkeypatch, "int8_linear_dynamic", "", 0)
    (out, new_residual, fused_cache), split = _fused_and_split(
        case, w, codes, scales,
        lambda x, name: ops.int8_linear_dynamic(x, codes[name], scales[name], None))
    tokens = len(case["hidden"])
    assert calls() == (8, 8 * tokens)  # four in the op, four one by one
    want_out, want_residual, _ = _float64_layer(case, {**w, **dense}, True)
    for got, want in ((out, want_out), (new_residual, want_residual)):
        assert (got.double() - want).abs().max() <= 5e-2 * want.abs().max()
    assert torch.equal(out, split[0]) and torch.equal(new_residual, split[1])
    assert torch.equal(fused_cache.view(torch.uint8), split[2].view(torch.uint8))
    _declined_with_bad_quant(case, w, codes, scales, scales["qkv"][:HEAD])


def test_op_shows_its_phases_to_the_profiler():
    """Each kernel of the op runs inside a profiler range of its own, in the layer's
    order, nested in the op's event (what benchmarks/step_profile.py splits by)."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _op(case, w, case["residual"], case["cache"].clone())
    phases = [e for e in prof.events() if e.name.startswith("accel_layer::")]
    assert [e.name.split("::")[1] for e in sorted(phases, key=lambda e: e.time_range.start)] == [
        "norm", "qkv_proj", "rotary", "attention", "o_proj", "norm", "gate_up_proj",
        "act_and_mul", "down_proj"]
    assert all(e.cpu_parent is not None and e.cpu_parent.name == "vllm_accel::cpu_decoder_layer"
               for e in phases)


def test_op_declines_without_side_effects():
    """What it does not take (a prefill past ``max_prefill_pairs``, where the torch
    attention wins; weights of the wrong shape) returns no tensors and leaves the
    cache alone: the layer then runs op by op."""
    case, w = _case("mixed", torch.bfloat16, "auto"), _weights(torch.bfloat16)
    cache = case["cache"].clone()
    assert _op(case, w, case["residual"], cache, max_prefill_pairs=100) == (None, None)
    assert _op(case, w, case["residual"], cache, qkv=w["qkv"][:-HEAD]) == (None, None)
    assert torch.equal(cache, case["cache"])


@pytest.mark.engine
def test_engine_runs_each_layer_as_one_op_and_matches_hf(tmp_path):
    """An eager bf16 tiny Llama on the simulator (ACCEL_BF16_LINEAR=on, so its linears
    take the bf16 kernel on any AVX-512 CPU): the layers run as the op (logged, counted
    in the worker), the first step's prefills (four 800-token prompts: past
    PREFILL_NATIVE_MAX_PAIRS together) op by op;
    its greedy tokens, teacher-forced through HF transformers on the same bf16 weights
    (float32 math), are HF's top token or within 0.05 nats of it."""
    model = build_tiny_model(tmp_path / "tiny", num_heads=4, num_kv_heads=2, head_dim=32,
                             hidden_size=128, norm_spread=0.3)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40, *[800] * 4)]
    results, log = run_engine(
        {"llm": {"model": str(model), "dtype": "bfloat16", "enforce_eager": True,
                 "skip_tokenizer_init": True, "max_model_len": 1024,
                 "max_num_batched_tokens": 4096, "seed": 0},
         "prompts": prompts,
         "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True,
                      "detokenize": False, "logprobs": 1},
         "worker_kernel_calls": ["cpu_decoder_layer"]},
        tmp_path, env={"ACCEL_BF16_LINEAR": "on", "ACCEL_SIM_DEVICE_MEMORY_GB": "1"})
    if bf16_linear.available():
        assert "each runs as one C++ op (vllm_accel::cpu_decoder_layer), 2 layers" in log
        ((calls, rows),) = [c["cpu_decoder_layer"] for c in results["worker_kernel_calls"]]
        assert calls >= 2 * 11  # every decode step's two layers
        assert rows < 2 * 800  # not the first step's prefills
    else:
        assert "vLLM's forward for 2 of 2" in log

    assert_bf16_tokens_near_hf(model, prompts, results["outputs"])


@pytest.mark.engine
def test_engine_keeps_vllms_layer_for_a_cache_of_another_dtype(tmp_path):
    """A float16 KV cache under bf16 activations is one the attention step declines:
    the layers keep vLLM's forward from the start (logged), the op never runs."""
    model = build_tiny_model(tmp_path / "tiny", num_heads=4, num_kv_heads=2, head_dim=32,
                             hidden_size=128)
    results, log = run_engine(
        {"llm": {"model": str(model), "dtype": "bfloat16", "enforce_eager": True,
                 "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0,
                 "kv_cache_dtype": "float16"},
         "prompts": [[5, 6, 7, 8]],
         "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True,
                      "detokenize": False},
         "worker_kernel_calls": ["cpu_decoder_layer"]},
        tmp_path, env={"ACCEL_BF16_LINEAR": "on", "ACCEL_SIM_DEVICE_MEMORY_GB": "1"})
    assert len(results["outputs"][0]["token_ids"]) == 4
    if bf16_linear.available():
        assert ("vLLM's forward for 2 of 2 (a float16 KV cache for torch.bfloat16 "
                "activations)") in log
        ((calls, _),) = [c["cpu_decoder_layer"] for c in results["worker_kernel_calls"]]
        assert calls == 0


def _tiny_mistral(path):
    from attention_models import build_tiny

    return build_tiny(path, "mistral", seed=0)


def _tiny_gemma(family):
    from attention_models import build_tiny

    return lambda path: build_tiny(path, family, seed=1, norm_spread=0.3)


def _tiny_qwen3(path):
    return build_tiny_model(path, arch="qwen3", num_heads=4, num_kv_heads=2, head_dim=32,
                            hidden_size=128, norm_spread=0.3)


#: family: (checkpoint builder, prompt lengths, engine settings, what the log adds,
#: nats from HF)
FAMILY_ENGINES = {
    # its 21-token window (prompts past it, blocks of 16 so vLLM frees the blocks behind
    # it, prefix caching). Its peaked logits reach |x| = 16-19, where bf16's spacing is
    # 0.125: the engine's bf16 logits round by up to 0.0625 each, a log-prob or a top-1
    # gap by up to twice that, on top of two layers of bf16 activations; a window read
    # wrong moves them by nats
    "mistral": (_tiny_mistral, (5, 40, 70, 33),
                {"block_size": 16, "enable_prefix_caching": True}, "sliding_window 21", 0.25),
    # q/k norms drawn away from 1
    "qwen3": (_tiny_qwen3, (5, 17, 40), {}, "", 0.05),
    # Gemma 2: four norms (1 + w, drawn away from 1), GELU-tanh, the attention's
    # soft-cap and query_pre_attn_scalar, a window on alternate layers; Gemma 3: q/k
    # norms, local and global rope. Seen on AMD EPYC Zen 5: 0.03 / 0.02 nats; with an
    # output norm dropped or every norm 5% off, 0.6 / 0.4
    "gemma2": (_tiny_gemma("gemma2"), (5, 40, 70, 33),
               {"block_size": 16, "enable_prefix_caching": True}, "", 0.1),
    "gemma3": (_tiny_gemma("gemma3_text"), (5, 40, 70, 33),
               {"block_size": 16, "enable_prefix_caching": True}, "", 0.1),
}


def _family_prompts(family):
    rng = random.Random(11)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in FAMILY_ENGINES[family][1]]


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: spec[0](root / family) for family, spec in FAMILY_ENGINES.items()}


@pytest.fixture(scope="module")
def family_engines(family_models, tmp_path_factory):
    """The four families' engines, one after another in one process."""
    env = {"ACCEL_BF16_LINEAR": "on", "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
    return SharedEngines({family: ({
        "llm": {"model": str(family_models[family]), "dtype": "bfloat16",
                "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0,
                **FAMILY_ENGINES[family][2]},
        "prompts": _family_prompts(family),
        "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
        "worker_kernel_calls": ["cpu_decoder_layer"]}, env) for family in FAMILY_ENGINES},
        tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("family", list(FAMILY_ENGINES))
def test_engine_runs_the_familys_layers_as_one_op(family, family_models, family_engines):
    """A compiled bf16 tiny Mistral (sliding window), Qwen3 (q/k norms) or Gemma 2/3
    (four norms, GELU-tanh, soft-cap, alternating windows): its layers run as the op
    (logged, counted in the worker), its tokens within bf16's reach of HF transformers
    on the same weights."""
    _, _, _, logged, nats = FAMILY_ENGINES[family]
    model, prompts = family_models[family], _family_prompts(family)
    results, log = family_engines(family)
    assert logged in log
    if bf16_linear.available():
        assert "each runs as one C++ op (vllm_accel::cpu_decoder_layer), 2 layers" in log, \
            log[-3000:]
        ((calls, _),) = [c["cpu_decoder_layer"] for c in results["worker_kernel_calls"]]
        assert calls >= 2 * 11, calls  # every decode step's two layers
    assert_bf16_tokens_near_hf(model, prompts, results["outputs"], nats=nats)
