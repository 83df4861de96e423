"""``torch_fast`` LoRA ops (contract: ``reference/lora.py``): every token's adapter slot
gathered at once, one batched product, the rows of tokens without an adapter masked."""

import torch

from vllm_accel.ops.reference.lora import _slot_weights
from vllm_accel.ops.registry import register_kernel
from vllm_accel.ops.torch_fast.attention import FAST


def _selected(stacked: torch.Tensor, indices: torch.Tensor, rows: int, dtype):
    """(each token's slot weights, its mask: 1 with an adapter, 0 without)."""
    idx = indices[:rows].long()
    return (_slot_weights(stacked)[idx.clamp(min=0)].to(dtype),
            (idx >= 0).to(dtype)[:, None])


@register_kernel("lora_shrink", FAST)
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, y: torch.Tensor,
                indices: torch.Tensor, scale: float) -> None:
    a, mask = _selected(lora_a, indices, x.shape[0], y.dtype)
    out = torch.einsum("bi,boi->bo", x.to(y.dtype), a)
    y[:x.shape[0], :out.shape[1]] = out * (mask * scale)


@register_kernel("lora_expand", FAST)
def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, indices: torch.Tensor,
                offset: int, size: int, add_inputs: bool) -> None:
    rows = y.shape[0]
    b, mask = _selected(lora_b, indices, rows, y.dtype)
    out = torch.einsum("bi,boi->bo", x[:rows].to(y.dtype), b[:, :size]) * mask
    if add_inputs:
        y[:, offset:offset + size] += out
    else:
        y[:, offset:offset + size] = out
