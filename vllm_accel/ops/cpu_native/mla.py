"""``cpu_native`` MLA decode: the simulator's C++ kernel (``csrc/mla_decode.cpp``) behind
the dispatcher op ``vllm_accel::cpu_mla_decode``: every head of a request reads its
latent rows once per pass, float32 math (contract: ``reference/mla.py``). Inputs the
op does not take (another device or dtype mix, no dispatcher library) go to the next
provider; the cache write and the prefill gather are ``torch_fast``'s (one
``index_copy_`` / ``index_select``)."""

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"


@register_kernel("mla_decode", NATIVE)
def mla_decode(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    if native.torch_ops() is not None:
        out = torch.ops.vllm_accel.cpu_mla_decode(q_nope, q_pe, kv_cache, block_table,
                                                  seq_lens, scale)
        if out.dim() == 3:
            return out
    return fallback_kernel("mla_decode", NATIVE)(q_nope, q_pe, kv_cache, block_table,
                                                 seq_lens, scale)


def takes_absorbed_weights(layer) -> bool:
    """Whether ``absorbed_bmm`` runs vLLM's MLA layer's absorbed-weight products on the
    simulator's kernel: bf16 ``W_UK_T`` and ``W_UV`` on the CPU, the kernel built and
    ``ACCEL_BF16_LINEAR`` not ``off``."""
    from vllm_accel.ops.cpu_native import bf16_linear

    return bf16_linear.wanted() and native.torch_ops() is not None and all(
        isinstance(w := getattr(layer, name, None), torch.Tensor) and w.dim() == 3
        and w.dtype == torch.bfloat16 and w.device.type == "cpu"
        for name in ("W_UK_T", "W_UV"))


def absorbed_bmm(input: torch.Tensor, mat2: torch.Tensor, *, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``torch.bmm`` as vLLM's MLA layer calls it for the absorbed weights (always with
    ``out``): a bf16 ``mat2`` stored as ``ops/mla.py``'s ``prepare_mla_layers`` leaves
    it (a transposed view of per-head ``[out, in]`` rows) runs every head in one call
    of the simulator's bf16 kernel (``vllm_accel::cpu_bf16_bmm``); anything else is
    torch's bmm."""
    if (out is not None and mat2.dtype == torch.bfloat16 and mat2.dim() == 3
            and mat2.stride(1) == 1 and input.device.type == "cpu"):
        torch.ops.vllm_accel.cpu_bf16_bmm(input, mat2.transpose(1, 2), out)
        return out
    return torch.bmm(input, mat2, out=out)
