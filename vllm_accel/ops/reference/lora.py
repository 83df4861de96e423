"""The ``reference`` provider of the LoRA ops the punica wrapper calls (``ops/lora.py``):
a token's rows go through its adapter's slot, or through none where its index is ``-1``
(a request without an adapter), one token at a time. ``lora_linear`` is a whole LoRA
linear layer (every output slice's shrink and expand) in one call."""

import torch

from vllm_accel.ops.registry import register_kernel


def _slot_weights(stacked: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked LoRA weights ``[slots, 1, rows, cols]`` (or without the 1)."""
    return stacked.squeeze(1) if stacked.dim() == 4 else stacked


@register_kernel("lora_shrink")
def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, y: torch.Tensor,
                indices: torch.Tensor, scale: float) -> None:
    """``y[t, :r] = scale * lora_a[indices[t]] @ x[t]`` (0 where ``indices[t] < 0``)."""
    a = _slot_weights(lora_a)
    for t, slot in enumerate(indices.tolist()[:x.shape[0]]):
        y[t, :a.shape[1]] = 0 if slot < 0 else scale * (a[slot].double() @ x[t].double())


@register_kernel("lora_expand")
def lora_expand(x: torch.Tensor, lora_b: torch.Tensor, y: torch.Tensor, indices: torch.Tensor,
                offset: int, size: int, add_inputs: bool) -> None:
    """``y[t, offset:offset+size] (+)= lora_b[indices[t]] @ x[t]``: nothing added (or 0
    written) where ``indices[t] < 0``."""
    b = _slot_weights(lora_b)
    for t, slot in enumerate(indices.tolist()[:y.shape[0]]):
        out = (torch.zeros(size, dtype=torch.float64) if slot < 0
               else b[slot, :size].double() @ x[t].double())
        row = y[t, offset:offset + size]
        row.copy_(row.double() + out if add_inputs else out)


@register_kernel("lora_linear")
def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: tuple[torch.Tensor, ...],
                lora_b: tuple[torch.Tensor, ...], indices: torch.Tensor, scale: float,
                out_sizes: tuple[int, ...]) -> None:
    """For each output slice ``i`` (its columns after the slices before it) and each
    token ``t`` of a slot ``s >= 0``: ``y[t, slice i] += lora_b[i][s] @ (scale *
    lora_a[i][s] @ x[t])``, in float64; tokens of slot ``-1`` keep their rows."""
    for t, slot in enumerate(indices.tolist()[:x.shape[0]]):
        if slot < 0:
            continue
        offset = 0
        for a, b, size in zip(lora_a, lora_b, out_sizes, strict=True):
            h = scale * (_slot_weights(a)[slot].double() @ x[t].double())
            row = y[t, offset:offset + size]
            row.copy_(row.double() + _slot_weights(b)[slot, :size].double() @ h)
            offset += size
