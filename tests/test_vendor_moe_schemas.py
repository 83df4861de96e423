"""The GCU vendor MoE experts adapter registers only over vllm-gcu's
``_C::fused_moe_kernel`` schema (inferred from its C++ signature: C!, A, B, weights,
ids, sorted ids, expert ids, padded count, mul_routed_weight, topk, block_size,
bias?). Another fork's op of the same name -- e.g. one taking (A!, B!, C!, ...,
tileConfig) -- must not be called with vllm-gcu's arguments. The vllm-gcu schema
itself runs over the fake Enflame library in test_backend_faithful."""

import torch

from vllm_accel.ops.vendor.kernels import _gcu_moe_experts

VLLM_GCU = ("Tensor(a!) _0, Tensor _1, Tensor _2, Tensor _3, Tensor _4, Tensor _5, "
            "Tensor _6, Tensor _7, bool _8, int _9, int _10, Tensor? _11")
OTHER_FORK = ("Tensor(a!) A, Tensor(b!) B, Tensor(c!) C, Tensor(d!) topk_weights, "
              "Tensor(e!) topk_ids, Tensor(f!) sorted_token_ids, Tensor(g!) expert_ids, "
              "Tensor(h!) num_tokens_post_padded, bool mul_routed_weight, int top_k, "
              "int tileConfig")
_libraries = []  # the test namespaces' definitions live while the module does


def _ops(tag: str, schema: str) -> dict:
    ns = f"_accel_test_moe_{tag}"
    lib = torch.library.Library(ns, "DEF")
    _libraries.append(lib)
    lib.define(f"fused_moe_kernel({schema}) -> ()")
    lib.define("moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
               "Tensor! sorted_token_ids, Tensor! experts_ids, Tensor! num_tokens_post_pad) -> ()")
    ops = getattr(torch.ops, ns)
    return {"_C::fused_moe_kernel": ops.fused_moe_kernel.default,
            "_moe_C::moe_align_block_size": ops.moe_align_block_size.default}


def test_only_vllm_gcus_schema_is_registered():
    assert _gcu_moe_experts(_ops("vllm_gcu", VLLM_GCU)) is not None
    assert _gcu_moe_experts(_ops("other_fork", OTHER_FORK)) is None
