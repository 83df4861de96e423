"""Quantized linear layers under torch.compile (vLLM's default mode).

Everything a quant method runs per forward is traced into vLLM's graph, so it may
not log, branch on tensor data or read tensor values (``.item()``): any of these
breaks the graph (an error at engine start under vLLM's full-graph compile). The
kernel-level tests trace each per-forward path with ``fullgraph=True`` and
dynamic batch sizes, through AOTAutograd's fake tensors as vLLM's inductor
backend does, and compare with eager. The engine tests run vLLM's default
compilation per quant family and hold it to the eager engine's tokens.
"""

import random
import re

import pytest
import torch
from conftest import SharedEngines, build_tiny_model
from quantizer import quantize_checkpoint, quantize_checkpoint_awq, quantize_checkpoint_ct
from quantizer_int8 import quantize_checkpoint_int8

from vllm_accel.quant import (
    AccelW8A8LinearMethod,
    AccelW8A16LinearMethod,
    w8a8,
)
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.cpu_native import wint_gemv
from vllm_accel.quant.packed import install_resident, resident_from_codes
from vllm_accel.quant.wint_method import WIntLinearMethod


def _resident_layer(bits, group_size, sym, act_order, provider, monkeypatch, dtype,
                    n=64, k=256, non_uniform_groups=False):
    """A random resident weight installed as the weight-only methods install it,
    run through their shared ``apply``."""
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", provider)
    g = torch.Generator().manual_seed(bits * 100 + group_size)
    gs = k if group_size == -1 else group_size
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g)
    scales = torch.rand(n, k // gs, generator=g) * 0.02 + 0.002
    zeros = None if sym else torch.randint(0, 2 ** bits, (n, k // gs), generator=g).float()
    perm = torch.randperm(k, generator=g) if act_order else None
    g_idx = None
    if non_uniform_groups:  # act-order groups left in checkpoint order (generic layout)
        g_idx = (torch.randperm(k, generator=g) // gs).to(torch.int32)
    res = resident_from_codes(codes, scales, zeros, bits=bits, group_size=group_size,
                              perm=perm, g_idx=g_idx)
    layer = torch.nn.Module()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # vLLM loads with the model dtype as default
    try:
        install_resident(layer, res)
    finally:
        torch.set_default_dtype(prev)
    # 4-bit weights with float32 activations: the generic layout on torch_fast (torch's
    # int4 kernel is a scalar loop for them), cpu_native's layout where its C++ kernel runs
    int4_float32 = bits == 4 and dtype == torch.float32
    prepared = {"torch_fast": not int4_float32,
                "cpu_native": not int4_float32 or wint_gemv.gemv_available()}
    assert (layer.wint.provider is not None) == prepared.get(provider, False)
    def forward(x):  # what every weight-only format's apply runs (WIntLinearMethod)
        return WIntLinearMethod.apply(None, layer, x)

    return forward


def _param(t):
    return torch.nn.Parameter(t, requires_grad=False)


#: nats within which two candidate tokens count as tied: an INT8 KV cache turns the
#: eager and compiled paths' float32 rounding differences (~1e-6) into code flips worth
#: ~1e-3 nats (measured: 1.6e-3), which reorder a near-tie
TIE_NATS = 0.01


def assert_same_greedy_tokens(got: list[dict], want: list[dict]) -> None:
    """Greedy tokens equal ``want``'s (engine_run outputs with 2 logprobs), but for a
    divergence at a near-tie: both tokens in ``want``'s top 2 within TIE_NATS (the
    sequences are not compared after it)."""
    for g, w in zip(got, want, strict=True):
        for step, (a, b) in enumerate(zip(g["token_ids"], w["token_ids"], strict=True)):
            if a != b:
                top = w["logprobs"][step]
                assert str(a) in top and abs(top[str(a)] - top[str(b)]) <= TIE_NATS, (
                    step, a, b, top)
                break


#: what the W8A8 method resolves its int8 GEMM to here: torch's where it is exact, the
#: simulator's own where torch's is not (CPUs without AVX-512)
EXACT_MM = w8a8.resolve_mm_method(torch.device("cpu"))


def _w8a8(static, symmetric, mm_method, monkeypatch):
    """A W8A8 layer as loaded (two shards), processed and run by the method."""
    g = torch.Generator().manual_seed(3)
    layer = torch.nn.Module()
    layer.logical_widths = [32, 16]
    layer.weight = _param(torch.randint(-128, 128, (48, 128), generator=g, dtype=torch.int8))
    layer.weight_scale = _param(torch.rand(48, 1, generator=g) * 0.01 + 0.001)
    if static:
        layer.input_scale = _param(torch.tensor([0.02, 0.02]))
        if not symmetric:
            layer.input_zero_point = _param(torch.tensor([5, 5], dtype=torch.int32))
    if mm_method == "fp32_exact":  # as on a torch build without a CPU _int_mm
        monkeypatch.setattr(w8a8, "resolve_mm_method", lambda device: "fp32_exact")
    method = AccelW8A8LinearMethod("channel", not static, symmetric, prefix="test.qkv_proj")
    method.process_weights_after_loading(layer)
    assert method.mm_method == mm_method
    return lambda x: method.apply(layer, x)


def _w8a16(dtype):
    layer = torch.nn.Module()
    layer.weight = _param(torch.randn(64, 128, generator=torch.Generator().manual_seed(5))
                          .to(dtype))
    method = AccelW8A16LinearMethod(prefix="test.down_proj")
    method.process_weights_after_loading(layer)
    return lambda x: method.apply(layer, x)


CASES = {
    # weight-only: torch's fused int4/int8 GEMMs on the prepared layout (4-bit float32:
    # the generic layout and tile kernel)
    "int4-g32-sym-fast": lambda mp, dt: _resident_layer(4, 32, True, False, "torch_fast", mp, dt),
    # torch_fast's layout, the C++ int4 kernel for bf16 batches of up to 64 rows
    "int4-g64-asym-native": lambda mp, dt: _resident_layer(4, 64, False, False, "cpu_native",
                                                           mp, dt),
    "int4-g64-asym-actorder-fast": lambda mp, dt: _resident_layer(4, 64, False, True,
                                                                   "torch_fast", mp, dt),
    "int8-channel-asym-fast": lambda mp, dt: _resident_layer(8, -1, False, False, "torch_fast",
                                                             mp, dt),
    # the generic layout and tile kernel, with scattered act-order groups
    "int4-g32-asym-gidx-reference": lambda mp, dt: _resident_layer(
        4, 32, False, False, "reference", mp, dt, non_uniform_groups=True),
    # W8A8: dynamic / static activations, sym / asym, both int8 GEMMs
    "w8a8-dynamic-sym": lambda mp, dt: _w8a8(False, True, EXACT_MM, mp),
    "w8a8-dynamic-asym": lambda mp, dt: _w8a8(False, False, EXACT_MM, mp),
    "w8a8-static-sym": lambda mp, dt: _w8a8(True, True, EXACT_MM, mp),
    "w8a8-static-asym-fp32exact": lambda mp, dt: _w8a8(True, False, "fp32_exact", mp),
    # online W8A16: torch's int8 kernel (bf16) and the float tile path
    "w8a16": lambda mp, dt: _w8a16(dt),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_per_forward_path_traces_as_one_graph(case, dtype, monkeypatch):
    fn = CASES[case](monkeypatch, dtype)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    g = torch.Generator().manual_seed(11)
    for tokens in (3, 17, 40, 1):  # one trace serves every batch size but 1 (specialized)
        k = 128 if case.startswith("w8a") else 256
        x = torch.randn(tokens, k, generator=g).to(dtype)
        got = compiled(x)  # first, as in vLLM: the warm-up compiles before any eager run
        want = fn(x)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------
# end to end: one compiled engine per quant family, with an INT8 KV cache
# ---------------------------------------------------------------------------

#: calls of the quantized GEMMs (torch's and our custom op) in inductor's generated
#: code (comments excluded)
QUANT_GEMM_CALL = re.compile(
    r"^(?!\s*#).*?\b(extern_kernels\._int_mm|extern_kernels\._weight_int8pack_mm|"
    r"vllm_accel\.int8_weight_mm\.default|vllm_accel\.int4pack_linear\.default|"
    r"vllm_accel\.int8_linear_dynamic\.default|vllm_accel\.int8_gemm\.default|"
    r"int4mm_packed_weight_cpu\.default|aten\._weight_int4pack_mm_for_cpu\.default|"
    r"aten\._weight_int8pack_mm\.default)\(")
#: a float GEMM in the graph: a quantized layer that fell back to a dequantized weight
FLOAT_GEMM_CALL = re.compile(r"^(?!\s*#).*?\b(extern_kernels\.(?:mm|addmm|bmm)|aten\.(?:mm|addmm"
                             r"|bmm)\.default|onednn_mm)\(")
#: a decoder layer as one C++ op (models/llama.py), whose four linears run the int4
#: GEMM inside it
LAYER_CALL = re.compile(r"^(?!\s*#).*?\bvllm_accel\.llama_layer\.default\(")
OUTPUT_CODE = "[__output_code]"


def _gptq(src, dst):
    quantize_checkpoint(src, dst, bits=4, group_size=32, sym=False, desc_act=True)


def _awq(src, dst):
    quantize_checkpoint_awq(src, dst, group_size=32)


def _ct_w8a16(src, dst):
    quantize_checkpoint_ct(src, dst, bits=8, group_size=-1, symmetric=False)


def _w8a8_dynamic(src, dst):
    quantize_checkpoint_int8(src, dst)


def _w8a8_static_asym(src, dst):
    rng = random.Random(1)
    calib = [[rng.randrange(3, 512) for _ in range(48)] for _ in range(4)]
    quantize_checkpoint_int8(src, dst, static=True, act_symmetric=False, calib_prompts=calib)


FAMILIES = {
    # name: (checkpoint writer (None: the float model), extra LLM kwargs, log line of the method)
    "gptq-w4-g32-asym-actorder": (_gptq, {}, "AccelGPTQLinearMethod serves 8"),
    "awq-w4-g32": (_awq, {}, "AccelAWQLinearMethod serves 8"),
    "ct-w8a16-channel-asym": (_ct_w8a16, {}, "AccelCTWNA16LinearMethod serves 8"),
    "ct-w8a8-dynamic": (_w8a8_dynamic, {}, "AccelW8A8LinearMethod serves 8"),
    "ct-w8a8-static-asym": (_w8a8_static_asym, {}, "AccelW8A8LinearMethod serves 8"),
    "online-w8a16": (None, {"quantization": "w8a16"}, "AccelW8A16LinearMethod serves 8"),
}


def _prompts(family):
    rng = random.Random(family)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 9, 17, 33, 2, 60)]


def _llm(model, family):
    return {"model": str(model), "dtype": "float32", "kv_cache_dtype": "int8",
            "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0, **FAMILIES[family][1]}


SAMPLING = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True, "detokenize": False,
            "logprobs": 2}
ENV = {"ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: W8A8 also restarts from vLLM's compile cache (its own): its activation quantizer
#: asks the kernel registry per call, inside the traced code
RESTARTED = "ct-w8a8-dynamic"


def _fused(family) -> bool:
    """4-bit without act-order and W8A8 with dynamic activations run each layer as one
    op where the C++ ops build."""
    return family in ("awq-w4-g32", "ct-w8a8-dynamic") and native.torch_ops() is not None


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """Each family's checkpoint (written once) and engines: the eager ones one after
    another in one process, the compiled ones (inductor's code logged, no compile
    cache) in another; the restarted family's compiled engine on its own cache."""
    # (peaked logits: an INT8 KV cache turns eager/compiled rounding differences into
    # code flips, ~1e-3 nats, which would reorder HF-init near-ties)
    root = tmp_path_factory.mktemp("quant_compiled")
    src = build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128, head_std=0.4)
    specs = {}
    for family, (write, _, _) in FAMILIES.items():
        model = src
        if write is not None:
            model = root / family
            write(src, model)
        llm = _llm(model, family)
        counted = _fused(family) and family == "ct-w8a8-dynamic"  # (the op counts every call)
        cache = ({"VLLM_CACHE_ROOT": str(root / "vllm-cache")} if family == RESTARTED
                 else {"VLLM_DISABLE_COMPILE_CACHE": "1"})
        specs["eager-" + family] = ({"llm": {**llm, "enforce_eager": True},
                                     "prompts": _prompts(family), "sampling": SAMPLING}, ENV)
        specs["compiled-" + family] = (
            {"llm": llm, "prompts": _prompts(family), "sampling": SAMPLING,
             **({"worker_kernel_calls": ["int8_linear_dynamic", "cpu_decoder_layer"]}
                if counted else {})}, {**ENV, "TORCH_LOGS": "output_code", **cache})
        if family == RESTARTED:
            specs["restarted-" + family] = ({"llm": llm, "prompts": _prompts(family),
                                             "sampling": SAMPLING}, {**ENV, **cache})
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_engine_gives_the_eager_tokens(family, engines):
    """vLLM's default mode (torch.compile, inductor) on a tiny 2-layer model whose 8
    linear layers are quantized, with an INT8 KV cache: the greedy tokens equal
    the eager engine's, and inductor's generated code calls torch's quantized
    GEMM once per quantized layer (or, for AWQ's 4-bit layers and W8A8 with dynamic
    activations, the one-op decoder layer that runs them: its four linears ran the
    quantized kernel inside it) and no float GEMM (no dequantized fallback)."""
    served = FAMILIES[family][2]
    eager, eager_log = engines("eager-" + family)
    fused = _fused(family)
    counted = fused and family == "ct-w8a8-dynamic"
    compiled, log = engines("compiled-" + family)
    for run_log in (eager_log, log):
        assert served in run_log and "int8_per_token_head" in run_log
    assert "Warming up model for the compilation" in log
    code = [line.split(OUTPUT_CODE, 1)[1] for line in log.splitlines() if OUTPUT_CODE in line]
    assert code, "inductor generated no code: the model was not compiled"
    quant_calls = [line for line in code if QUANT_GEMM_CALL.match(line)]
    float_calls = [line for line in code if FLOAT_GEMM_CALL.match(line)]
    layer_calls = [line for line in code if LAYER_CALL.match(line)]
    assert len(layer_calls) == (2 if fused else 0), layer_calls
    assert len(quant_calls) == (0 if fused else 8) and not float_calls, (quant_calls, float_calls)
    if counted:
        (counts,) = compiled["worker_kernel_calls"]
        layers = counts["cpu_decoder_layer"][0]
        assert layers >= 2 * 11 and counts["int8_linear_dynamic"][0] >= 4 * layers, counts
    tokens = [o["token_ids"] for o in compiled["outputs"]]
    assert_same_greedy_tokens(compiled["outputs"], eager["outputs"])
    if family == RESTARTED:  # (after the compiled engine, which saved the graph)
        restarted, log = engines("restarted-" + family)
        assert "Directly load AOT compilation" in log, log[-4000:]
        assert [o["token_ids"] for o in restarted["outputs"]] == tokens
