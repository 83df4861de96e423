"""The GCU vendor adapters of the dense quantized GEMMs register only over vllm-gcu's
``_C::gptq_gemm_gcu(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, bit, bias?,
group_size) -> Tensor``, ``_C::weight_only_quant(output!, input, qweight, bias?,
scale, group_size)`` and ``_C::cutlass_scaled_mm(out!, x, weight, x_scale, w_scale,
bias?)``; an op of the same name with other arguments must not be called with these.
With one of the two weight-only GEMMs, only its bit width gets vllm-gcu's layout. The
GEMMs themselves run over the fake Enflame library in test_backend_faithful."""

import torch

from vllm_accel.ops.vendor.kernels import (_gcu_int8_linear, _gcu_wint_prepare,
                                           _gcu_wint_prepared_linear)
from vllm_accel.quant.packed import resident_from_codes

GPTQ_GEMM = ("gptq_gemm_gcu", "Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, "
             "Tensor b_gptq_scales, Tensor b_g_idx, int bit, Tensor? bias, int group_size",
             "Tensor")
WEIGHT_ONLY = ("weight_only_quant", "Tensor! output, Tensor input, Tensor qweight, "
               "Tensor? bias, Tensor scale, int group_size", "()")
# e.g. a GEMM taking the scale before the weight and no bias
OTHER_WEIGHT_ONLY = ("weight_only_quant", "Tensor! output, Tensor input, Tensor scale, "
                     "Tensor qweight, int group_size", "()")
SCALED_MM = ("cutlass_scaled_mm", "Tensor! out, Tensor x, Tensor weight, Tensor x_scale, "
             "Tensor w_scale, Tensor? bias", "()")
# upstream vLLM's names for the same arguments (kept where vLLM defines the op first)
UPSTREAM_SCALED_MM = ("cutlass_scaled_mm", "Tensor! out, Tensor a, Tensor b, Tensor a_scales, "
                      "Tensor b_scales, Tensor? bias", "()")
# e.g. a scaled GEMM taking the output dtype instead of the output tensor
OTHER_SCALED_MM = ("cutlass_scaled_mm", "Tensor x, Tensor weight, Tensor x_scale, "
                   "Tensor w_scale, ScalarType out_dtype, Tensor? bias", "Tensor")
_libraries = []  # the test namespaces' definitions live while the module does


def _ops(tag: str, *defs) -> dict:
    ns = f"_accel_test_quant_{tag}"
    lib = torch.library.Library(ns, "DEF")
    _libraries.append(lib)
    for name, args, returns in defs:
        lib.define(f"{name}({args}) -> {returns}")
    return {f"_C::{name}": getattr(getattr(torch.ops, ns), name).default
            for name, _, _ in defs}


def _resident(bits):
    g = torch.Generator().manual_seed(bits)
    return resident_from_codes(torch.randint(0, 2 ** bits, (32, 128), generator=g),
                               torch.rand(32, 2, generator=g), None, bits=bits,
                               group_size=64)


def test_only_vllm_gcus_schemas_are_registered():
    ops = _ops("vllm_gcu", GPTQ_GEMM, WEIGHT_ONLY)
    assert _gcu_wint_prepare(ops) is not None and _gcu_wint_prepared_linear(ops) is not None
    other = _ops("other", GPTQ_GEMM, OTHER_WEIGHT_ONLY)
    assert _gcu_wint_prepare(other) is None and _gcu_wint_prepared_linear(other) is None


def test_each_bit_width_needs_its_gemm():
    only_8bit = _gcu_wint_prepare(_ops("only_8bit", WEIGHT_ONLY))
    assert only_8bit(_resident(4), torch.bfloat16) is None
    assert set(only_8bit(_resident(8), torch.bfloat16)) == {"gcu_weight", "gcu_scales"}
    only_4bit = _gcu_wint_prepare(_ops("only_4bit", GPTQ_GEMM))
    assert only_4bit(_resident(8), torch.bfloat16) is None
    assert set(only_4bit(_resident(4), torch.bfloat16)) == {
        "gcu_weight", "gcu_scales", "gcu_zeros", "gcu_group_index"}


def test_only_vllm_gcus_scaled_mm_is_registered():
    assert _gcu_int8_linear(_ops("scaled_mm", SCALED_MM)) is not None
    assert _gcu_int8_linear(_ops("upstream_scaled_mm", UPSTREAM_SCALED_MM)) is not None
    assert _gcu_int8_linear(_ops("other_scaled_mm", OTHER_SCALED_MM)) is None
