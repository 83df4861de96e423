"""Fake torch.ops.my_ops: profiling hooks, rmsnorm_forward and fused_moe_fused_experts
(the schema of torch_tpu's C++ signature; calls counted)."""

import collections

import torch

# Kept on torch so a re-import (in-process tests) reuses the registered ops' state.
if not hasattr(torch, "_fake_my_ops_state"):
    torch._fake_my_ops_state = (collections.Counter(), [])
CALLS, PROFILE = torch._fake_my_ops_state
_REGISTERED = hasattr(torch, "_fake_my_ops_lib")
_lib = torch.library.Library("my_ops", "FRAGMENT") if not _REGISTERED else None
if not _REGISTERED:
    torch._fake_my_ops_lib = _lib
    _lib.define("enable_profile(int? max_record_num, int? mode) -> ()")
    _lib.define("disable_profile() -> ()")
    _lib.define("rmsnorm_forward(Tensor input, Tensor? scale, Tensor? bias, "
                "Tensor(a!) output, int axis, float eps) -> ()")
    _lib.define("fused_moe_fused_experts(Tensor(a!) output, Tensor input, Tensor? output_sample, "
                "Tensor? input_sample, Tensor gate_weights, Tensor up_weights, "
                "Tensor down_weights, Tensor? gate_scales, Tensor? up_scales, "
                "Tensor? down_scales, Tensor select_experts, Tensor routing_weights, "
                "Tensor? num_select_experts, Tensor? select_experts_middle, "
                "Tensor? routing_weights_middle, int blocksize, int num_experts, "
                "int num_experts_per_tok, bool use_grouped_topk, int num_expert_group, "
                "int topk_group, Tensor? silu, Tensor? sigmoid, Tensor? m0, "
                "bool save_mid_res) -> ()")


def enable_profile(max_record_num=None, mode=None):
    PROFILE.append(("enable", max_record_num, mode))


def disable_profile():
    PROFILE.append(("disable",))


def rmsnorm_forward(input, scale, bias, output, axis, eps):
    CALLS["rmsnorm_forward"] += 1
    h = input.float()
    h = h * torch.rsqrt(h.pow(2).mean(axis, keepdim=True) + eps)
    if scale is not None:
        h = h * scale.float()
    if bias is not None:
        h = h + bias.float()
    output.copy_(h)


def fused_moe_fused_experts(output, input, output_sample, input_sample, gate_weights,
                            up_weights, down_weights, gate_scales, up_scales, down_scales,
                            select_experts, routing_weights, num_select_experts,
                            select_experts_middle, routing_weights_middle, blocksize,
                            num_experts, num_experts_per_tok, use_grouped_topk,
                            num_expert_group, topk_group, silu, sigmoid, m0, save_mid_res):
    """Each (token, choice) pair's unweighted SiLU-gated expert output into
    ``output[M, top_k, H]``; gate/up/down ``[E, I, H]``, unquantized only here."""
    CALLS["fused_moe_fused_experts"] += 1
    assert select_experts.dtype == torch.int32, "select_experts must be int32 dtype"
    assert down_weights.is_contiguous(), "down_weights must be contiguous [E, I, H]"
    x = input.float()
    for t in range(x.shape[0]):
        for j in range(num_experts_per_tok):
            e = int(select_experts[t, j])
            g = gate_weights[e].float() @ x[t]
            u = up_weights[e].float() @ x[t]
            output[t, j] = (torch.nn.functional.silu(g) * u) @ down_weights[e].float()


if not _REGISTERED:
    _lib.impl("enable_profile", enable_profile, "CompositeExplicitAutograd")
    _lib.impl("disable_profile", disable_profile, "CompositeExplicitAutograd")
    for _key in ("PrivateUse1", "CPU"):
        _lib.impl("rmsnorm_forward", rmsnorm_forward, _key)
        _lib.impl("fused_moe_fused_experts", fused_moe_fused_experts, _key)
