"""``torch_fast`` mixture-of-experts kernels: what a card without vendor MoE kernels
runs. Routing is the reference's in float32; the experts sort the (token, expert)
pairs by expert once (one host sync for the counts) and run each expert held here
on its tokens as two matmuls in the model dtype (quantized experts: the modules of
the dense quantized linears), the weighted outputs summed into a float32 accumulator
(conventions: ``reference/moe.py``)."""

import torch
import torch.nn.functional as F

from vllm_accel.ops.reference.moe import gated_activation, local_slots, route_in
from vllm_accel.ops.registry import register_kernel

FAST = "torch_fast"


#: the reference routing in float32 (what vLLM's routers compute in)
moe_route = register_kernel("moe_route", FAST)(route_in(torch.float32))


def expert_groups(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int):
    """(pair order sorted by local expert, pairs per local expert as a list): pairs are
    the flattened ``[M, k]`` (token, choice) slots; those of experts held elsewhere
    sort first and are skipped by the counts' offset (returned third)."""
    slots = local_slots(topk_ids, expert_map).reshape(-1)
    order = torch.argsort(slots, stable=True)
    counts = torch.bincount(slots + 1, minlength=num_local + 1).tolist()
    return order, counts[1:], counts[0]


def grouped_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    num_local: int, hidden: int, linear13, linear2, *,
                    expert_map: torch.Tensor | None, activation: str,
                    apply_router_weight_on_input: bool) -> torch.Tensor:
    """The experts contract with each expert's projections as calls
    ``linear13(e, x_e)`` / ``linear2(e, act)``: the pairs sorted by expert once, each
    expert held here run on its tokens, the weighted outputs summed in float32."""
    m, top_k = topk_ids.shape
    out = torch.zeros(m, hidden, dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    order, counts, start = expert_groups(topk_ids, expert_map, num_local)
    tokens = order // top_k
    weights = topk_weights.reshape(-1).to(torch.float32)[order]
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows, w = tokens[start:start + n], weights[start:start + n, None]
        start += n
        xe = x.index_select(0, rows)
        if apply_router_weight_on_input:
            xe = (xe.to(torch.float32) * w).to(x.dtype)
        y = linear2(e, gated_activation(linear13(e, xe), activation)).to(torch.float32)
        out.index_add_(0, rows, y if apply_router_weight_on_input else y * w)
    return out.to(x.dtype)


def _bias(bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
    return None if bias is None else bias[e]


@register_kernel("moe_experts", FAST)
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped per-expert matmuls over the tokens routed to each expert."""
    return grouped_experts(
        x, topk_weights, topk_ids, w13.shape[0], w2.shape[1],
        lambda e, xe: F.linear(xe, w13[e], _bias(w13_bias, e)),
        lambda e, act: F.linear(act, w2[e], _bias(w2_bias, e)),
        expert_map=expert_map, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input)


@register_kernel("moe_quant_experts", FAST)
def moe_quant_experts(x: torch.Tensor, w13: list, w2: list, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, expert_map: torch.Tensor | None = None,
                      activation: str = "silu", apply_router_weight_on_input: bool = False,
                      w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized experts: ``w13[e]`` / ``w2[e]`` are the modules the dense quantized
    linears serve with (``module(x, bias)``), each run on its expert's tokens."""
    return grouped_experts(
        x, topk_weights, topk_ids, len(w13), w2[0].out_features,
        lambda e, xe: w13[e](xe, _bias(w13_bias, e)),
        lambda e, act: w2[e](act, _bias(w2_bias, e)),
        expert_map=expert_map, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input)
