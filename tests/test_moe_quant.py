"""Quantized MoE experts (quant/moe.py): each expert in the dense layers' resident
layouts, run per expert (``moe_quant_experts``) or stacked through the simulator's C++
op, against float64 oracles on the dequantized weights; then GPTQ, AWQ,
compressed-tensors W4A16/W8A16 and W8A8 (int8) tiny Qwen3-MoE / Mixtral checkpoints
through the whole plugin vs HF float64 on the dequantized checkpoint, on the simulator
and the virtual GCU."""

import random
from types import SimpleNamespace

import pytest
import torch

from conftest import VIRTUAL_GCU_ENV, SharedEngines
from moe_models import assert_matches_hf, build_tiny_moe
from quantizer import (quantize_checkpoint, quantize_checkpoint_awq, quantize_checkpoint_ct,
                       quantize_weight)
from quantizer_int8 import add_act_fake_quant, quantize_checkpoint_int8, quantize_weight_int8
import vllm_accel.quant  # noqa: F401  (first: wint_gemm imported alone is a cycle)
from vllm_accel.ops import registry
from vllm_accel.ops.cpu_native import moe as native_moe
from vllm_accel.ops.reference import moe as reference_moe
from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import wint_gemm
from vllm_accel.quant.gptq import gptq_to_resident
from vllm_accel.quant.moe import ExpertLinears, PreparedExperts, QuantMoEMethod, native_layout
from vllm_accel.quant.packed import InstalledWInt, resident_from_signed
from vllm_accel.quant.w8a8 import InstalledW8A8, resolve_mm_method, w8a8_to_resident

PROVIDERS = ["reference", "torch_fast"]
#: (name, bits, group size, sym, act-order)
GPTQ_CASES = [("int4-g32-sym", 4, 32, True, False), ("int4-g64-asym", 4, 64, False, False),
              ("int4-g32-actorder", 4, 32, True, True), ("int8-gall", 8, -1, True, False)]


def _gptq_expert(w, bits, gs, sym, act_order, gen):
    """(resident, float64 dequantized) of one float weight ``[out, in]``."""
    perm = torch.randperm(w.shape[1], generator=gen) if act_order else None
    qw = quantize_weight(w, bits, gs, sym, perm=perm)
    packed = qw.pack("gptq")
    res = gptq_to_resident(packed["qweight"], packed["qzeros"], packed["scales"],
                           packed["g_idx"], bits=bits, group_size=gs)
    return res, qw.dequantize(torch.float64)


def _modules(residents, dtype, prepared):
    """One module per expert: the generic layout (wint_linear) or the simulator's
    prepared one (torch's int4pack layout, which cpu_native prepares for bf16, and for
    float32 where its C++ kernel runs)."""
    mods = []
    for res in residents:
        layout = wint_gemm.prepare(res, dtype, int4_act_dtypes=(dtype,)) if prepared else None
        mods.append(InstalledWInt(res) if layout is None
                    else InstalledWInt(res, "cpu_native", layout))
    return mods


def _gptq_layer(case, e, h, i, gen):
    _, bits, gs, sym, act_order = case
    w13 = torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5
    w2 = torch.randn(e, h, i, generator=gen) * i ** -0.5
    r13, d13 = zip(*(_gptq_expert(w13[x], bits, gs, sym, act_order, gen) for x in range(e)))
    r2, d2 = zip(*(_gptq_expert(w2[x], bits, gs, sym, act_order, gen) for x in range(e)))
    return r13, r2, torch.stack(d13), torch.stack(d2)


def _route(m, e, k, gen):
    return get_kernel("moe_route", "reference")(torch.randn(m, e, generator=gen) * 2, k,
                                                renormalize=True)


def _assert_close(got, want, rel):
    scale = want.double().abs().amax(dim=1, keepdim=True)
    err = (got.double() - want.double()).abs()
    assert bool((err <= rel * scale).all()), float((err / scale).max())


#: bound relative to an output row's largest entry: float32 sums over at most 128 terms
#: (~1e-6) for float32 activations; bf16 adds its rounding of x, the gate/up and
#: activation outputs and (prepared layout) of the scales: (7k + 1) units of 2**-8
REL = {torch.float32: 2e-5, torch.bfloat16: 33 * 2 ** -8}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("prepared", [False, True], ids=["generic", "prepared"])
@pytest.mark.parametrize("provider", PROVIDERS)
@pytest.mark.parametrize("case", GPTQ_CASES, ids=lambda c: c[0])
def test_gptq_experts_per_module_match_the_float64_oracle(case, provider, prepared, dtype):
    m, e, h, i, k = 21, 8, 128, 64, 4
    gen = torch.Generator().manual_seed(hash(case[0]) % 1000)
    r13, r2, d13, d2 = _gptq_layer(case, e, h, i, gen)
    x = torch.randn(m, h, generator=gen).to(dtype)
    weights, ids = _route(m, e, k, gen)
    got = get_kernel("moe_quant_experts", provider)(
        x, _modules(r13, dtype, prepared), _modules(r2, dtype, prepared), weights, ids)
    want = reference_moe.moe_experts(x, d13, d2, weights, ids)
    assert got.shape == (m, h) and got.dtype == dtype
    _assert_close(got, want, REL[dtype])


@pytest.mark.skipif(not native_moe.NATIVE_DISPATCH, reason="the C++ op library did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", [c for c in GPTQ_CASES if c[1] == 4 and not c[4]],
                         ids=lambda c: c[0])
def test_int4_experts_stacked_for_the_cpp_op_match_the_float64_oracle(case, dtype):
    """int4 experts without act-order have torch's int4pack layout, which the C++ op
    reads stacked ``[E, ...]``; an expert map keeps 5 of 8 experts on this rank."""
    m, e, h, i, k = 17, 8, 128, 64, 2
    gen = torch.Generator().manual_seed(3)
    r13, r2, d13, d2 = _gptq_layer(case, e, h, i, gen)
    held = [0, 2, 3, 5, 7]
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(len(held), dtype=torch.int32)
    layouts = [[native_layout(mod) for mod in _modules([r[j] for j in held], dtype, True)]
               for r in (r13, r2)]
    assert all(lay is not None for lays in layouts for lay in lays)
    (w13, q13), (w2, q2) = [tuple(torch.stack(t) for t in zip(*lays)) for lays in layouts]
    x = torch.randn(m, h, generator=gen).to(dtype)
    weights, ids = _route(m, e, k, gen)
    got = native_moe.cpu_moe_experts(x, w13, w2, weights, ids, expert_map, q13, q2, None,
                                     None, "silu", False)
    want = reference_moe.moe_experts(x, d13[held], d2[held], weights, ids,
                                     expert_map=expert_map)
    _assert_close(got, want, REL[dtype])


def test_act_order_experts_are_not_stacked():
    """An act-order permutation is a gather the C++ op does not do: per expert then."""
    gen = torch.Generator().manual_seed(4)
    r13, _, _, _ = _gptq_layer(GPTQ_CASES[2], 2, 128, 64, gen)
    assert all(native_layout(mod) is None for mod in _modules(r13, torch.float32, True))


def _fake_quant_per_token(x: torch.Tensor) -> torch.Tensor:
    """Dynamic symmetric per-token int8 (``amax / 127``), in float64."""
    s = x.abs().amax(-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(x / s).clamp(-127, 127) * s


def _w8a8_oracle(x, d13, d2, weights, ids):
    out = torch.zeros(x.shape[0], d2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = d13[e] @ _fake_quant_per_token(x[t].double())
            act = reference_moe.gated_activation(h, "silu")
            out[t] += float(weights[t, j]) * (d2[e] @ _fake_quant_per_token(act))
    return out


@pytest.fixture
def simulator_providers(monkeypatch):
    """The simulator's provider order (cpu_native first), as its worker sets it: the
    W8A8 modules resolve their int8 kernel when they are made."""
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    previous = registry._preferred_providers
    registry.set_preferred_providers(("cpu_native", "torch_fast"))
    yield
    registry.set_preferred_providers(previous)


@pytest.mark.parametrize("path", ["per-module", pytest.param("stacked", marks=pytest.mark.skipif(
    not native_moe.NATIVE_DISPATCH, reason="the C++ op library did not build"))])
def test_w8a8_experts_match_the_float64_oracle(path, simulator_providers):
    """int8 per-channel experts with dynamic per-token int8 activations (fp32)."""
    m, e, h, i, k = 13, 4, 128, 64, 2
    gen = torch.Generator().manual_seed(6)
    mods, deq = {}, {}
    for proj, shape in (("w13", (2 * i, h)), ("w2", (h, i))):
        layers = [quantize_weight_int8(torch.randn(*shape, generator=gen) * shape[1] ** -0.5)
                  for _ in range(e)]
        deq[proj] = torch.stack([c.double() * s.double() for c, s in layers])
        mods[proj] = [InstalledW8A8(w8a8_to_resident(c, s, [shape[0]], strategy="channel"),
                                    True, resolve_mm_method(torch.device("cpu")))
                      for c, s in layers]
    x = torch.randn(m, h, generator=gen)
    weights, ids = _route(m, e, k, gen)
    if path == "stacked":
        lays = {p: [native_layout(mod) for mod in mods[p]] for p in mods}
        assert all(lay is not None for ls in lays.values() for lay in ls)
        (w13, q13), (w2, q2) = [tuple(torch.stack(t) for t in zip(*lays[p]))
                                for p in ("w13", "w2")]
        got = native_moe.cpu_moe_experts(x, w13, w2, weights, ids, None, q13, q2, None, None,
                                         "silu", False)
    else:
        got = get_kernel("moe_quant_experts", "torch_fast")(x, mods["w13"], mods["w2"],
                                                             weights, ids)
    # per-token int8 codes: the kernel's float32 scale and the oracle's float64 one
    # round a code differently only at ties (none at these random values)
    _assert_close(got, _w8a8_oracle(x, deq["w13"], deq["w2"], weights, ids), 1e-5)


class _ResidentExperts(QuantMoEMethod):
    """A format whose experts are given as resident weights (the shared load path)."""

    quant_name = "test"

    def __init__(self, residents) -> None:  # (no vLLM MoE config: the load path only)
        self.prefix, self.residents = "model.layers.0.mlp.experts", residents

    def create_weights(self, *args, **kwargs):
        raise AssertionError("not loaded from a checkpoint")

    def expert_linears(self, layer, e):
        return tuple(self.install_expert(r) for r in self.residents[e])

    def checkpoint_tensors(self):
        return ()

    def describe(self):
        return "8-bit per channel sym"


def _resident_layer(e):
    layer = torch.nn.Module()
    layer.local_num_experts = layer.global_num_experts = e
    layer.layer_name, layer.expert_map = "model.layers.0.mlp.experts", None
    layer.apply_router_weight_on_input = False
    layer.activation = SimpleNamespace(value="silu")
    return layer


@pytest.mark.parametrize("declines", [False, True], ids=["prepared", "declined"])
def test_a_kernels_own_stacked_layout_replaces_the_expert_modules(declines, monkeypatch):
    """A ``moe_quant_experts`` kernel with a ``prepare_experts`` hook (Enflame's) gets the
    experts in the generic layout (not the int8 layout torch_fast would prepare for
    bf16), and its stacked tensors replace the per-expert modules as parameters of the
    layer; a hook that declines leaves the modules ``installed()`` picks."""
    provider, seen = "test_stacking", {}

    def prepare_experts(w13, w2, *, act_dtype, **features):
        seen.update(generic=all(m.generic_layout for m in (*w13, *w2)), dtype=act_dtype,
                    features=features)
        if declines:
            return None
        return tuple({"codes": torch.stack([m.qweight.data for m in mods]),
                      "scales": torch.stack([m.scales.data for m in mods]),
                      "group_size": mods[0].group_size} for mods in (w13, w2))

    def stacking_kernel(x, w13, w2, topk_weights, topk_ids, **kw):
        deq = [(p.codes.double() - 128) * p.scales.double() for p in (w13, w2)]
        return reference_moe.moe_experts(x.double(), *deq, topk_weights, topk_ids).to(x.dtype)

    stacking_kernel.prepare_experts = prepare_experts
    monkeypatch.setitem(registry._KERNELS["moe_quant_experts"], provider, stacking_kernel)
    monkeypatch.setattr(registry, "_preferred_providers", (provider, "torch_fast", "reference"))
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    monkeypatch.setattr(registry, "_resolved", {})
    e, h, i = 4, 64, 32
    gen = torch.Generator().manual_seed(8)
    residents = [[quantize_weight_int8(torch.randn(n, k, generator=gen)) for n, k in
                  ((2 * i, h), (h, i))] for _ in range(e)]
    method = _ResidentExperts([[resident_from_signed(c, s, bits=8) for c, s in pair]
                               for pair in residents])
    layer = _resident_layer(e)
    layer.quant_method = method
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # vLLM loads under the model's dtype
    try:
        method.process_weights_after_loading(layer)
    finally:
        torch.set_default_dtype(previous)
    assert seen == {"generic": True, "dtype": torch.bfloat16,
                    "features": {"expert_map": None, "apply_router_weight_on_input": False,
                                 "biased": False}}
    assert method._prepare is None  # only while the experts are built
    if declines:
        assert isinstance(layer.w13_experts, ExpertLinears)
        assert {m.provider for m in layer.w13_experts.experts} == {"torch_fast"}
        assert "per expert, moe_quant_experts[test_stacking]" in method.layout
        return
    assert isinstance(layer.w13_experts, PreparedExperts) and layer.w13_experts.provider == provider
    assert {n for n, _ in layer.named_parameters()} == {
        f"{p}_experts.{t}" for p in ("w13", "w2") for t in ("codes", "scales")}
    assert layer.w2_experts.group_size == i
    deq13, deq2 = (torch.stack([c.double() * s.double().reshape(-1, 1) for c, s in
                                (pair[j] for pair in residents)]) for j in (0, 1))
    x = torch.randn(5, h, generator=gen)
    weights, ids = _route(5, e, 2, gen)
    got = method.experts(layer, x, weights, ids)
    _assert_close(got, reference_moe.moe_experts(x, deq13, deq2, weights, ids), 1e-5)


# -- engines ---------------------------------------------------------------------------

VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: the Triton kernels forced (fused quantized experts), in Triton's interpreter
TRITON = {"ACCEL_KERNEL_PROVIDER": "triton", "TRITON_INTERPRET": "1"}


def _prompts(seed, lengths=(5, 29, 60, 3)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _spec(model, prompts, compiled, **llm):
    return {
        "llm": {"model": str(model), "dtype": "float32", "enforce_eager": not compiled,
                "skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 4,
                "max_num_batched_tokens": 64, "enable_prefix_caching": True, "seed": 0, **llm},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
        "worker_kernel_calls": ["cpu_moe_experts"],
    }


#: name: (family, bits, group size, sym, act-order, path env, compiled, experts layout)
GPTQ_ENGINES = {
    "qwen3_moe-int4-g32-sim-compiled": ("qwen3_moe", 4, 32, True, False, {}, True, "stacked"),
    "mixtral-int4-g32-asym-actorder-sim": ("mixtral", 4, 32, False, True, {}, False,
                                           "per expert"),
    "qwen3_moe-int8-g16-virtual": ("qwen3_moe", 8, 16, True, False, VIRTUAL, True,
                                   "per expert"),
    "mixtral-int4-g32-asym-triton": ("mixtral", 4, 32, False, False, TRITON, False,
                                     "moe_quant_experts[triton]"),
}


def _gptq_checkpoint(root, case) -> None:
    family, bits, gs, sym, act_order, *_ = GPTQ_ENGINES[case]
    # (Qwen3-MoE's intermediate size 64: int4 groups of 32, torch's int4 layout's least)
    overrides = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {}
    src = build_tiny_moe(root / "float", family, seed=7, **overrides)
    quantize_checkpoint(src, root / "q", bits=bits, group_size=gs, sym=sym,
                        desc_act=act_order, dequant_dst=root / "dq")


@pytest.mark.engine
@pytest.mark.parametrize("case", list(GPTQ_ENGINES))
def test_gptq_moe_checkpoint_matches_hf_on_the_dequantized_weights(case, engines):
    """A GPTQ checkpoint with every expert quantized (as GPTQModel writes MoE models:
    tensors per expert): HF float64 on its dequantized weights is the oracle; our
    int4/int8 kernels run on exactly those weights, so tokens are HF's top-1."""
    family, bits, gs, sym, act_order, env, compiled, layout = GPTQ_ENGINES[case]
    prompts = _prompts(case)
    results, log = engines("gptq-" + case)
    assert "gcu_gptq MoE experts" in log and layout in log
    assert "quantization=gcu_gptq" in log
    calls, _ = results["worker_kernel_calls"][0]["cpu_moe_experts"]
    assert (calls > 0) == (layout == "stacked")
    if env is VIRTUAL:
        assert "device gcu via virtual" in log
    if env is TRITON:
        assert "Triton fused MoE: 8 experts' 4-bit weights (group 32, asym) stacked" in log
    assert_matches_hf(engines.checkpoint("gptq-" + case) / "dq", prompts, results["outputs"],
                      nats=5e-3)


def _awq(src, dst, dq):
    quantize_checkpoint_awq(src, dst, group_size=32, dequant_dst=dq)


def _ct(bits, group_size, symmetric):
    def write(src, dst, dq):  # (MoE routers stay float, as llmcompressor's recipes do)
        quantize_checkpoint_ct(src, dst, bits=bits, group_size=group_size, symmetric=symmetric,
                               ignore=["re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"],
                               dequant_dst=dq)
    return write


#: name: (family, checkpoint writer, what the load log says, path env, compiled,
#: experts layout)
WEIGHT_ONLY_ENGINES = {
    "awq-qwen3_moe-g32-sim-compiled": ("qwen3_moe", _awq, "gcu_awq MoE experts", {}, True,
                                       "stacked"),
    "awq-mixtral-g32-virtual": ("mixtral", _awq, "gcu_awq MoE experts", VIRTUAL, False,
                                "per expert"),
    "ct-qwen3_moe-w4a16-g32-asym-sim-compiled": (
        "qwen3_moe", _ct(4, 32, False), "MoE experts (e.g. model.layers.0.mlp.experts): "
        "W4A16 group 32 asym", {}, True, "stacked"),
    "ct-mixtral-w8a16-channel-virtual": (
        "mixtral", _ct(8, -1, True), "W8A16 channel sym", VIRTUAL, False, "per expert"),
}


def _weight_only_checkpoint(root, case) -> None:
    family, write, *_ = WEIGHT_ONLY_ENGINES[case]
    overrides = {"moe_intermediate_size": 64} if family == "qwen3_moe" else {}
    src = build_tiny_moe(root / "float", family, seed=9, **overrides)
    write(src, root / "q", root / "dq")


@pytest.mark.engine
@pytest.mark.parametrize("case", list(WEIGHT_ONLY_ENGINES))
def test_weight_only_moe_checkpoint_matches_hf_on_the_dequantized_weights(case, engines):
    """AutoAWQ GEMM (4-bit with zero points, output-packed) and compressed-tensors
    pack-quantized (W4A16 group 32 asym, W8A16 per channel) checkpoints with every
    expert quantized, tensors per expert: HF float64 on the dequantized weights is the
    oracle, tokens its top-1."""
    family, write, logged, env, compiled, layout = WEIGHT_ONLY_ENGINES[case]
    prompts = _prompts(case)
    results, log = engines("weight-only-" + case)
    assert logged in log and layout in log, log[-3000:]
    calls, _ = results["worker_kernel_calls"][0]["cpu_moe_experts"]
    assert (calls > 0) == (layout == "stacked")
    if env is VIRTUAL:
        assert "device gcu via virtual" in log
    if env is TRITON:
        assert "Triton fused MoE: 8 experts' 4-bit weights (group 32, asym) stacked" in log
    assert_matches_hf(engines.checkpoint("weight-only-" + case) / "dq", prompts,
                      results["outputs"], nats=5e-3)


def _w8a8_fake_quant(layers):
    """HF's hooks for the W8A8 oracle: per-token int8 fake-quant of the inputs of
    the attention Linears (``add_act_fake_quant``) and, inside each experts module
    (HF keeps the experts as stacked tensors, run by ``F.linear``), of every expert
    projection's input."""

    def prepare(model):
        add_act_fake_quant(model, layers, dynamic=True)
        for name, mod in model.named_modules():
            if name.endswith("mlp.experts"):
                mod.forward = _fake_quant_linears(mod.forward)

    return prepare


def _fake_quant_linears(forward):
    def run(*args, **kwargs):
        linear = torch.nn.functional.linear

        def quantized(x, w, b=None):
            return linear(_fake_quant_per_token(x).to(x.dtype), w, b)

        torch.nn.functional.linear = quantized
        try:
            return forward(*args, **kwargs)
        finally:
            torch.nn.functional.linear = linear

    return run


#: name: (path env, compiled, experts layout)
W8A8_ENGINES = {"sim-compiled": ({}, True, "stacked"),
                "virtual-eager": (VIRTUAL, False, "per expert")}


def _w8a8_checkpoint(root, case) -> dict:
    src = build_tiny_moe(root / "float", "qwen3_moe", seed=11)
    return quantize_checkpoint_int8(src, root / "q", dequant_dst=root / "dq")


@pytest.mark.engine
@pytest.mark.parametrize("case", list(W8A8_ENGINES))
def test_w8a8_moe_checkpoint_matches_hf_with_fake_quant(case, engines):
    """A compressed-tensors W8A8 Qwen3-MoE checkpoint (int8 per-channel weights and
    dynamic per-token activations in attention and every expert): HF float64 on the
    dequantized weights, each quantized linear's input fake-quantized per token."""
    env, compiled, layout = W8A8_ENGINES[case]
    root = engines.checkpoint("w8a8-" + case)
    layers = engines.written["w8a8-" + case]  # the quantized layers, for HF's hooks
    assert any(".experts." in name for name in layers)
    prompts = _prompts(case)
    results, log = engines("w8a8-" + case)
    assert "compressed-tensors W8A8 int8 MoE experts" in log and layout in log
    calls, _ = results["worker_kernel_calls"][0]["cpu_moe_experts"]
    assert (calls > 0) == (layout == "stacked")
    # int8 codes of activations computed in float32 here and float64 in HF round
    # differently where a value sits at a code's edge: measured 0.015-0.021 nats
    # (AMD EPYC Zen 5), against 0.10-0.13 without HF's fake-quant
    assert_matches_hf(root / "dq", prompts, results["outputs"], nats=0.05,
                      prepare=_w8a8_fake_quant(layers))


class _QuantizedEngines(SharedEngines):
    """The module's checkpoints (written once, each in its own folder) and their
    engines, those of one environment one after another in one process."""

    def __init__(self, tmp_path_factory):
        writers = ({"gptq-" + c: (_gptq_checkpoint, c, GPTQ_ENGINES[c][5], GPTQ_ENGINES[c][6])
                    for c in GPTQ_ENGINES}
                   | {"weight-only-" + c: (_weight_only_checkpoint, c, WEIGHT_ONLY_ENGINES[c][3],
                                           WEIGHT_ONLY_ENGINES[c][4]) for c in WEIGHT_ONLY_ENGINES}
                   | {"w8a8-" + c: (_w8a8_checkpoint, c, W8A8_ENGINES[c][0], W8A8_ENGINES[c][1])
                      for c in W8A8_ENGINES})
        self.roots, self.written = {}, {}
        engines = {}
        for key, (write, case, env, compiled) in writers.items():
            root = self.roots[key] = tmp_path_factory.mktemp(key)
            self.written[key] = write(root, case)
            engines[key] = (_spec(root / "q", _prompts(case), compiled), env)
        super().__init__(engines, tmp_path_factory.mktemp("engines"))

    def checkpoint(self, key):
        return self.roots[key]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    return _QuantizedEngines(tmp_path_factory)
