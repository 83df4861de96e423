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
