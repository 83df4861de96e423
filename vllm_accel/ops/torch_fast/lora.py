"""``torch_fast`` LoRA ops (contract: ``reference/lora.py``): every slot's adapter at
once, as two dense products. The shrink multiplies the tokens by all slots' ``A``
stacked (``[T, slots * r]``, a few dozen columns) and zeroes each token's columns but
its own slot's (none for slot ``-1``); the expand multiplies those columns by all
slots' ``B`` stacked. No per-token weight gather, no host sync: the adapters' ranks are
small, so computing every slot costs less than selecting one."""

import torch

from vllm_accel.ops.reference.lora import _slot_weights
from vllm_accel.ops.registry import register_kernel
from vllm_accel.ops.torch_fast.attention import FAST


def _slot_mask(indices: torch.Tensor, rows: int, slots: int, dtype) -> torch.Tensor:
    """``[rows, slots, 1]``: 1 at each token's slot, 0 elsewhere (all 0 for slot -1)."""
    idx = indices[:rows].long()
    return (idx[:, None] == torch.arange(slots, device=idx.device)).to(dtype)[..., None]


@register_kernel("lora_shrink", FAST)
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, y: torch.Tensor,
                indices: torch.Tensor, scale: float) -> None:
    a = _slot_weights(lora_a)  # [slots, r, in]
    slots, rank = a.shape[:2]
    rows = x.shape[0]
    h = (x @ a.reshape(slots * rank, -1).T).view(rows, slots, rank).to(y.dtype)
    h = (h * _slot_mask(indices, rows, slots, y.dtype)).sum(1)
    y[:rows, :rank] = h * scale


@register_kernel("lora_expand", FAST)
def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, indices: torch.Tensor,
                offset: int, size: int, add_inputs: bool) -> None:
    b = _slot_weights(lora_b)[:, :size]  # [slots, size, r]
    slots, _, rank = b.shape
    rows = y.shape[0]
    h = x[:rows, None, :rank].to(b.dtype) * _slot_mask(indices, rows, slots, b.dtype)
    out = h.reshape(rows, slots * rank) @ b.permute(0, 2, 1).reshape(slots * rank, size)
    if add_inputs:
        y[:, offset:offset + size] += out.to(y.dtype)
    else:
        y[:, offset:offset + size] = out.to(y.dtype)


@register_kernel("lora_linear", FAST)
def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: tuple[torch.Tensor, ...],
                lora_b: tuple[torch.Tensor, ...], indices: torch.Tensor, scale: float,
                out_sizes: tuple[int, ...]) -> None:
    """Each slice's shrink into a float32 buffer, then its expand added into ``y``."""
    offset = 0
    for a, b, size in zip(lora_a, lora_b, out_sizes, strict=True):
        buffer = torch.empty((x.shape[0], b.shape[-1]), dtype=torch.float32, device=x.device)
        lora_shrink(x, a, buffer, indices, scale)
        lora_expand(buffer, b, y, indices, offset, size, True)
        offset += size
