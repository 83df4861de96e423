"""The fused-MoE Triton kernels compile for NVIDIA Hopper and Ampere, on a machine
without a GPU: Triton's interpreter (test_triton_kernels, CI) runs a kernel's Python,
so code the compiler cannot build passes there -- like a constant-folded branch the
interpreter never takes but the compiler still builds (a negative shift for unquantized
weights once failed every MoE kernel on an H200). Each launch ``moe_experts`` and
``moe_quant_experts`` make for a configuration is recorded (not run) and compiled to
a cubin with the ``ptxas`` that Triton's wheel ships."""

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from triton_kernel_cases import _resident_experts
from vllm_accel.ops.reference import moe as reference_moe
from vllm_accel.ops.triton import moe

TARGETS = [GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32)]
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
          torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8"}


def _launches(monkeypatch, call) -> list[tuple[JITFunction, tuple, dict]]:
    seen = []
    monkeypatch.setattr(JITFunction, "run",
                        lambda self, *args, grid, warmup, **kw: seen.append((self, args, kw)))
    call()
    return seen


def _compile(fn: JITFunction, args: tuple, kwargs: dict, target: GPUTarget) -> None:
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(fn.arg_names, args)) | kwargs
    constexprs = {n: bound[n] for i, n in enumerate(fn.arg_names) if i in fn.constexprs}
    signature = {}
    for name, value in bound.items():
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
        else:
            signature[name] = "i64" if abs(int(value)) >= 2**31 else "i32"
    triton.compile(ASTSource(fn, signature, constexprs), target=target, options=options)


def _routing(m, e, k, seed):
    g = torch.Generator().manual_seed(seed)
    return reference_moe.route(torch.randn(m, e, generator=g), k, renormalize=True)


CASES = {
    "bf16": dict(dtype=torch.bfloat16),
    "fp16-gelu-bias-weight-on-input": dict(dtype=torch.float16, activation="gelu_tanh",
                                           bias=True, on_input=True),
    "fp32-expert-map": dict(dtype=torch.float32, expert_map=True),
    "int4-asym-g32-bf16": dict(dtype=torch.bfloat16, bits=4, group_size=32, asym=True),
    "int8-sym-g16-fp32": dict(dtype=torch.float32, bits=8, group_size=16, asym=False),
    # decode batches of 6 pairs: the matrix-vector kernels, steps of several groups
    "int4-asym-g32-bf16-decode": dict(dtype=torch.bfloat16, bits=4, group_size=32, asym=True,
                                      tokens=3),
    "int8-sym-g16-fp16-decode": dict(dtype=torch.float16, bits=8, group_size=16, asym=False,
                                     tokens=3),
}


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: f"sm{t.arch}")
@pytest.mark.parametrize("case", list(CASES))
def test_moe_kernels_compile_for_the_gpu(case, target, monkeypatch):
    spec = CASES[case]
    m, e, h, i, k, dtype = spec.get("tokens", 5), 4, 64, 64, 2, spec["dtype"]
    weights, ids = _routing(m, e, k, seed=len(case))
    x = torch.randn(m, h).to(dtype)
    if "bits" in spec:
        g = torch.Generator().manual_seed(1)
        w13 = _resident_experts(e, 2 * i, h, spec["bits"], spec["group_size"], spec["asym"], g)
        w2 = _resident_experts(e, h, i, spec["bits"], spec["group_size"], spec["asym"], g)
        call = lambda: moe.moe_quant_experts(x, w13, w2, weights, ids)  # noqa: E731
    else:
        w13, w2 = torch.randn(e, 2 * i, h).to(dtype), torch.randn(e, h, i).to(dtype)
        bias = spec.get("bias", False)
        call = lambda: moe.moe_experts(  # noqa: E731
            x, w13, w2, weights, ids, activation=spec.get("activation", "silu"),
            apply_router_weight_on_input=spec.get("on_input", False),
            w13_bias=torch.randn(e, 2 * i).to(dtype) if bias else None,
            w2_bias=torch.randn(e, h).to(dtype) if bias else None,
            expert_map=torch.arange(e, dtype=torch.int32) if spec.get("expert_map") else None)
    decode = "tokens" in spec
    if not decode:
        monkeypatch.setattr(moe, "GEMV_MAX_PAIRS", 0)
    launches = _launches(monkeypatch, call)
    if decode:
        tiles = moe.GEMV_TILES[spec["bits"]]
        assert [fn.fn.__name__ for fn, _, _ in launches] == ["_gemv_gate_up_kernel",
                                                              "_gemv_down_kernel"]
        assert launches[0][2]["GROUPS"] == tiles.block_k // spec["group_size"] > 1
    else:
        assert [fn.fn.__name__ for fn, _, _ in launches] == ["_align_kernel",
                                                              "_gate_up_kernel", "_down_kernel"]
    for fn, args, kwargs in launches:
        if "IEEE" in kwargs:
            kwargs["IEEE"] = dtype == torch.float32  # what a GPU launch passes
        _compile(fn, args, dict(kwargs), target)
