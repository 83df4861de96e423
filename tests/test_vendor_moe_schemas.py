"""The GCU vendor MoE experts adapters register only over vllm-gcu's schemas of
``_C::fused_moe_kernel`` (inferred from its C++ signature: C!, A, B, weights, ids,
sorted ids, expert ids, padded count, mul_routed_weight, topk, block_size, bias?) and
``_C::fused_moe_quant_kernel`` (C!, A, B, A_scale?, B_scale, group size, B_zp?, the
same five routing tensors, mul_routed_weight, topk, block_size, bias?,
real_token_num?). Another op of the same name -- another fork's (A!, B!, C!, ...,
tileConfig), or the argument order of vllm-gcu's own ``fused_moe_quant_kernel_ex`` --
must not be called with these arguments. The vllm-gcu schemas themselves run over the
fake Enflame library in test_backend_faithful."""

import torch

import vllm_accel.quant  # noqa: F401  (registers the quant kernels)
from vllm_accel.ops.reference.moe import moe_experts, moe_route
from vllm_accel.ops.vendor.kernels import _gcu_moe_experts, _gcu_moe_quant_experts
from vllm_accel.quant.packed import InstalledWInt, resident_from_codes

VLLM_GCU = ("Tensor(a!) _0, Tensor _1, Tensor _2, Tensor _3, Tensor _4, Tensor _5, "
            "Tensor _6, Tensor _7, bool _8, int _9, int _10, Tensor? _11")
VLLM_GCU_QUANT = ("Tensor(a!) _0, Tensor _1, Tensor _2, Tensor? _3, Tensor _4, int _5, "
                  "Tensor? _6, Tensor _7, Tensor _8, Tensor _9, Tensor _10, Tensor _11, "
                  "bool _12, int _13, int _14, Tensor? _15, Tensor? _16")
QUANT_EX_ORDER = ("Tensor(a!) C, Tensor A, Tensor B, Tensor A_scale, Tensor B_scale, "
                  "Tensor B_zero, Tensor? bias, Tensor topk_weights, Tensor topk_ids, "
                  "Tensor sorted_token_ids, Tensor experts_ids, Tensor num_tokens_post_pad, "
                  "Tensor? real_token_num, bool mul_routed_weight, int topk, int block_size, "
                  "int group_k, int group_n")
OTHER_FORK = ("Tensor(a!) A, Tensor(b!) B, Tensor(c!) C, Tensor(d!) topk_weights, "
              "Tensor(e!) topk_ids, Tensor(f!) sorted_token_ids, Tensor(g!) expert_ids, "
              "Tensor(h!) num_tokens_post_padded, bool mul_routed_weight, int top_k, "
              "int tileConfig")
_libraries = []  # the test namespaces' definitions live while the module does


def _ops(tag: str, schema: str, name: str = "fused_moe_kernel") -> dict:
    ns = f"_accel_test_moe_{tag}"
    lib = torch.library.Library(ns, "DEF")
    _libraries.append(lib)
    lib.define(f"{name}({schema}) -> ()")
    lib.define("moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
               "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad) -> ()")
    ops = getattr(torch.ops, ns)
    return {f"_C::{name}": getattr(ops, name).default,
            "_moe_C::moe_align_block_size": ops.moe_align_block_size.default}


def test_only_vllm_gcus_schema_is_registered():
    assert _gcu_moe_experts(_ops("vllm_gcu", VLLM_GCU)) is not None
    assert _gcu_moe_experts(_ops("other_fork", OTHER_FORK)) is None


def test_only_vllm_gcus_quantized_schema_is_registered():
    name = "fused_moe_quant_kernel"
    assert _gcu_moe_quant_experts(_ops("vllm_gcu_quant", VLLM_GCU_QUANT, name)) is not None
    assert _gcu_moe_quant_experts(_ops("quant_ex_order", QUANT_EX_ORDER, name)) is None


def test_without_sgls_alignment_224_experts_go_to_the_next_provider():
    """vllm-gcu aligns 224 experts or more with ``_moe_C::sgl_moe_align_block_size``; a
    library without it keeps those layers on the next provider: quantized layers are
    declined at load (223 experts are prepared), unquantized calls handed on (the test
    namespace's fused kernel has no implementation: calling it would raise)."""
    adapter = _gcu_moe_quant_experts(_ops("no_sgl", VLLM_GCU_QUANT, "fused_moe_quant_kernel"))
    plain = dict(act_dtype=torch.bfloat16, expert_map=None, apply_router_weight_on_input=False,
                 biased=False)
    res = resident_from_codes(torch.randint(0, 256, (4, 16)), torch.rand(4, 1), None, bits=8,
                              group_size=-1)
    for experts, prepared in ((223, True), (224, False)):
        modules = [InstalledWInt(res) for _ in range(experts)]
        got = adapter.prepare_experts(modules, modules, **plain)
        assert (got is not None) == prepared, experts
    unquantized = _gcu_moe_experts(_ops("no_sgl_plain", VLLM_GCU))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 16, generator=g)
    w13, w2 = torch.randn(224, 32, 16, generator=g), torch.randn(224, 16, 16, generator=g)
    weights, ids = moe_route(torch.randn(5, 224, generator=g), 2, renormalize=True)
    assert torch.allclose(unquantized(x, w13, w2, weights, ids),
                          moe_experts(x, w13, w2, weights, ids))


def test_the_report_names_only_the_ops_a_kernel_needs():
    """sgl's alignment op is optional: a library with it alone lacks exactly the fused
    kernel and vLLM's alignment op, and the report says so."""
    from vllm_accel.ops.vendor.kernels import install_vendor_kernels

    class Backend:
        kernel_providers = ("gcu_vendor",)

        def op(self, qualname):
            return object() if qualname == "_moe_C::sgl_moe_align_block_size" else None

    report = install_vendor_kernels(Backend())
    assert report["gcu_vendor:moe_experts"] == (
        "not registered by the vendor library: _C::fused_moe_kernel, "
        "_moe_C::moe_align_block_size")
    assert report["gcu_vendor:rms_norm"] == (
        "not registered by the vendor library: _C::fused_add_rms_norm, _C::rms_norm")
