"""``torch_fast`` mixture-of-experts kernels: what a card without vendor MoE kernels
runs. Routing is the reference's in float32; the experts sort the (token, expert)
pairs by expert once (one host sync for the counts) and run each expert held here
on its tokens as two matmuls in the model dtype, the weighted outputs summed into a
float32 accumulator (conventions: ``reference/moe.py``)."""

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


@register_kernel("moe_experts", FAST)
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped per-expert matmuls over the tokens routed to each expert."""
    m, top_k = topk_ids.shape
    out = torch.zeros(m, w2.shape[1], dtype=torch.float32, device=x.device)
    if m == 0:
        return out.to(x.dtype)
    order, counts, start = expert_groups(topk_ids, expert_map, w13.shape[0])
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
        h = F.linear(xe, w13[e], None if w13_bias is None else w13_bias[e])
        y = F.linear(gated_activation(h, activation), w2[e],
                     None if w2_bias is None else w2_bias[e]).to(torch.float32)
        out.index_add_(0, rows, y if apply_router_weight_on_input else y * w)
    return out.to(x.dtype)
