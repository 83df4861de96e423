"""``reference`` mixture-of-experts kernels: routing and experts written the obvious
way (one token at a time, float64 by default), the oracle every MoE provider is
tested against.

Conventions (vLLM's fused-MoE layer, ``fused_moe/routed_experts.py``):

- ``w13`` ``[E_local, 2 * I, H]``: the gate projection's rows, then the up
  projection's; ``w2`` ``[E_local, H, I]``; optional biases ``[E_local, 2 * I]`` and
  ``[E_local, H]``.
- ``topk_ids`` are global expert ids; ``expert_map`` (``[E_global]``, int32, -1 for an
  expert another rank holds) maps them to this rank's slots under expert parallelism.
- The result is this rank's share of the weighted sum over the chosen experts,
  ``[M, H]`` in x's dtype: shared experts and the cross-rank reduction are the
  caller's (vLLM's MoE runner adds and all-reduces them).
"""

import torch
import torch.nn.functional as F

from vllm_accel.ops.registry import register_kernel

#: gated activations the experts kernels compute: act(gate) * up; ``swigluoai``
#: (gpt-oss) reads gate and up interleaved (:func:`gated_activation`)
GATED_ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
#: vLLM's ``swigluoai`` constants (``SwigluOAIAndMul``; gpt-oss's swiglu_limit 7.0)
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0
#: router scoring functions
SCORING_FUNCS = ("softmax", "sigmoid")


def gated_activation(h: torch.Tensor, activation: str) -> torch.Tensor:
    """``act(h[..., :I]) * h[..., I:]`` for one of :data:`GATED_ACTIVATIONS`; for
    ``swigluoai`` gate and up are interleaved (``h[..., 0::2]``, ``h[..., 1::2]``) and
    clamped: ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, ``g = min(gate, 7)``."""
    if activation == "swigluoai":
        gate = h[..., 0::2].clamp(max=SWIGLUOAI_LIMIT)
        up = h[..., 1::2].clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
        return (up + 1) * (gate * torch.sigmoid(gate * SWIGLUOAI_ALPHA))
    gate, up = h.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "gelu":
        return F.gelu(gate) * up
    if activation == "gelu_tanh":
        return F.gelu(gate, approximate="tanh") * up
    raise ValueError(f"MoE activation {activation!r} is not one of {GATED_ACTIVATIONS}")


def route(router_logits: torch.Tensor, top_k: int, *, renormalize: bool,
          scoring_func: str = "softmax", num_expert_group: int | None = None,
          topk_group: int | None = None,
          e_score_correction_bias: torch.Tensor | None = None,
          routed_scaling_factor: float = 1.0,
          dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing -> (weights float32 ``[M, k]``, global ids int32 ``[M, k]``).

    Scores are ``softmax`` or ``sigmoid`` of the logits. A correction bias
    (DeepSeek-V3's ``noaux_tc``) is added for choosing only: the weights are the
    unbiased scores. With ``num_expert_group`` > 1 (DeepSeek's group-limited
    routing) experts come from the ``topk_group`` best groups only, a group scored by
    its best expert, or with a bias by the sum of its best two. Then the weights are
    renormalized to sum 1 if asked, and scaled by ``routed_scaling_factor``.
    """
    logits = router_logits.to(dtype)
    if scoring_func == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"MoE scoring function {scoring_func!r} is not one of {SCORING_FUNCS}")
    choice = scores if e_score_correction_bias is None else (
        scores + e_score_correction_bias.to(dtype).unsqueeze(0))
    if num_expert_group is not None and num_expert_group > 1:
        m, e = choice.shape
        grouped = choice.view(m, num_expert_group, e // num_expert_group)
        group_scores = (grouped.max(dim=-1).values if e_score_correction_bias is None
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))
        best_groups = group_scores.topk(topk_group or 1, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, dim=1),
                                    float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights * routed_scaling_factor
    return weights.to(torch.float32), ids.to(torch.int32)


def route_in(dtype: torch.dtype):
    """A ``moe_route`` kernel: :func:`route` computed in ``dtype``."""

    def moe_route(router_logits: torch.Tensor, top_k: int, **rules) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
        return route(router_logits, top_k, dtype=dtype, **rules)

    return moe_route


#: the oracle's routing, in float64
moe_route = register_kernel("moe_route")(route_in(torch.float64))


def local_slots(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Global expert ids -> this rank's weight slots (int64), -1 where another rank
    holds the expert."""
    ids = topk_ids.long()
    return ids if expert_map is None else expert_map.long()[ids]


@register_kernel("moe_experts")
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                compute_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Each token through each of its experts held here, one at a time, in
    ``compute_dtype``; the router weight scales the expert's input instead of its
    output with ``apply_router_weight_on_input`` (Llama 4)."""
    slots = local_slots(topk_ids, expert_map)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=compute_dtype, device=x.device)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            e = int(slots[t, j])
            if e < 0:
                continue
            weight = topk_weights[t, j].to(compute_dtype)
            xt = x[t].to(compute_dtype)
            if apply_router_weight_on_input:
                xt = xt * weight
            h = w13[e].to(compute_dtype) @ xt
            if w13_bias is not None:
                h = h + w13_bias[e].to(compute_dtype)
            y = w2[e].to(compute_dtype) @ gated_activation(h, activation)
            if w2_bias is not None:
                y = y + w2_bias[e].to(compute_dtype)
            out[t] += y if apply_router_weight_on_input else weight * y
    return out.to(x.dtype)


@register_kernel("moe_quant_experts")
def moe_quant_experts(x: torch.Tensor, w13: list, w2: list, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, expert_map: torch.Tensor | None = None,
                      activation: str = "silu", apply_router_weight_on_input: bool = False,
                      w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Quantized experts (``w13[e]`` / ``w2[e]``: the dense quantized linears'
    modules, ``module(x, bias)``, computing in x's dtype), one token at a time; the
    activation and the weighted sum in float64."""
    slots = local_slots(topk_ids, expert_map)
    out = torch.zeros(x.shape[0], w2[0].out_features, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for j in range(slots.shape[1]):
            e = int(slots[t, j])
            if e < 0:
                continue
            weight = topk_weights[t, j].to(torch.float64)
            xt = x[t:t + 1]
            if apply_router_weight_on_input:
                xt = (xt.to(torch.float64) * weight).to(x.dtype)
            h = w13[e](xt, None if w13_bias is None else w13_bias[e]).to(torch.float64)
            act = gated_activation(h, activation).to(x.dtype)
            y = w2[e](act, None if w2_bias is None else w2_bias[e])[0].to(torch.float64)
            out[t] += y if apply_router_weight_on_input else weight * y
    return out.to(x.dtype)
