"""``cpu_native`` LoRA: a whole LoRA linear layer (every output slice, every token's
adapter) in one C++ call (``csrc/lora.cpp`` behind the dispatcher op
``vllm_accel::cpu_lora_linear``; contract: ``reference/lora.py``'s ``lora_linear``).
vLLM's wrapper makes two calls per slice, each a handful of torch ops: ~0.2 ms a layer
at batch 16, more than the layer's own matmul. The kernel reads each adapter's ``B``
transposed (``[slots, rank, n]``: the expand then runs along the outputs in vector
lanes), kept beside vLLM's tensor and made again when vLLM writes an adapter into it
(the tensor's version counter moves). Inputs the op does not take go to the next
provider."""

import weakref

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.reference.lora import _slot_weights
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"

#: id(vLLM's stacked B) -> (a weak reference to it, its version then, B transposed)
_transposed: dict[int, tuple[weakref.ref, int, torch.Tensor]] = {}


def transposed_b(b: torch.Tensor) -> torch.Tensor:
    """vLLM's stacked ``B`` (``[slots, 1, n, rank]``) as ``[slots, rank, n]``,
    contiguous; made once per adapter load."""
    key = id(b)
    entry = _transposed.get(key)
    if entry is not None and entry[0]() is b and entry[1] == b._version:
        return entry[2]
    b_t = _slot_weights(b).transpose(1, 2).contiguous()
    _transposed[key] = (weakref.ref(b, lambda _, key=key: _transposed.pop(key, None)),
                        b._version, b_t)
    return b_t


@register_kernel("lora_linear", NATIVE)
def lora_linear(y: torch.Tensor, x: torch.Tensor, lora_a: tuple[torch.Tensor, ...],
                lora_b: tuple[torch.Tensor, ...], indices: torch.Tensor, scale: float,
                out_sizes: tuple[int, ...]) -> None:
    if native.torch_ops() is not None and torch.ops.vllm_accel.cpu_lora_linear(
            y, x, list(lora_a), [transposed_b(b) for b in lora_b], indices, scale,
            list(out_sizes)):
        return
    fallback_kernel("lora_linear", NATIVE)(y, x, lora_a, lora_b, indices, scale, out_sizes)
