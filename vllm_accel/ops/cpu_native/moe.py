"""``cpu_native`` mixture-of-experts experts: the simulator's C++ op
``vllm_accel::cpu_moe_experts`` (``csrc/torch_ops.cpp``).

It buckets the (token, choice) pairs by expert in C++ and runs each expert held on
this rank through the kernels the dense layers use, reading vLLM's expert weights in
place: ``w13[e]`` ``[2I, H]`` and ``w2[e]`` ``[H, I]`` are row-major matrices that the
bf16 linear kernel (``csrc/bf16_linear.cpp``) takes as they are; fp16/fp32 experts go to
torch's linear. The weighted rows are summed in float32. One dispatcher call a layer,
no Python per call, opaque to torch.compile (a fake gives its shape).
"""

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.reference.moe import GATED_ACTIVATIONS
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"
#: the C++ op's activation codes
ACTIVATION_CODES = {name: code for code, name in enumerate(GATED_ACTIVATIONS)}
#: whether the C++ op exists (the dispatcher library built)
NATIVE_DISPATCH = native.torch_ops() is not None

if NATIVE_DISPATCH:
    @torch.library.register_fake("vllm_accel::cpu_moe_experts")
    def _cpu_moe_experts_shape(x, w13, w2, topk_weights, topk_ids, expert_map, w13_quant,
                               w2_quant, w13_bias, w2_bias, activation,
                               apply_router_weight_on_input):
        return x.new_empty((x.shape[0], w2.shape[1]))


def takes(x: torch.Tensor) -> bool:
    """Whether the C++ op takes activations ``x``."""
    return (NATIVE_DISPATCH and x.device.type == "cpu" and x.dim() == 2
            and native.dtype_code(x.dtype) is not None)


def cpu_moe_experts(x, w13, w2, topk_weights, topk_ids, expert_map, w13_quant, w2_quant,
                    w13_bias, w2_bias, activation: str, apply_router_weight_on_input: bool):
    """The C++ op, its activation named as in ``reference/moe.py``."""
    return torch.ops.vllm_accel.cpu_moe_experts(
        x, w13, w2, topk_weights, topk_ids, expert_map, w13_quant, w2_quant, w13_bias,
        w2_bias, ACTIVATION_CODES[activation], apply_router_weight_on_input)


@register_kernel("moe_experts", NATIVE)
def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The C++ op where it takes the inputs, else the next provider."""
    if takes(x) and activation in ACTIVATION_CODES and w13.device.type == "cpu":
        return cpu_moe_experts(x, w13, w2, topk_weights, topk_ids, expert_map, None, None,
                               w13_bias, w2_bias, activation, apply_router_weight_on_input)
    return fallback_kernel("moe_experts", NATIVE)(
        x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, w13_bias=w13_bias,
        w2_bias=w2_bias)
