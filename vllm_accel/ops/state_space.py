"""Mamba2 layers on the card path: vLLM's state-space ops with the kernel registry
behind them.

vLLM 0.32's ``MambaMixer2`` calls four module-level functions -- the causal
convolution over prefills and its one-token update, the chunked selective scan and
its one-token state update -- which are Triton kernels, or vLLM's C++ CPU ops when
the platform is a CPU. A card is neither, so :func:`install` (a patch in
``patches.py``) points the mixer's names at the adapters here, which keep vLLM's
signatures and run ``causal_conv1d``, ``causal_conv1d_step``, ``ssd_scan`` and
``ssm_decode_step`` from the registry (``torch_fast`` / ``reference``, or a vendor's).
"""

import torch

from vllm_accel.ops.reference import state_space as _reference  # noqa: F401  (registers)
from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import state_space as _torch_fast  # noqa: F401  (registers)

#: vLLM's padding slot and null block (vllm.v1.attention.backends.utils)
PAD_SLOT_ID, NULL_BLOCK_ID = -1, 0


def _activation(activation) -> str | None:
    if isinstance(activation, bool):
        return "silu" if activation else None
    return activation


def _first_column(indices: torch.Tensor) -> torch.Tensor:
    return indices[:, 0] if indices.dim() == 2 else indices


def _no_speculative_rows(num_accepted_tokens) -> None:
    if num_accepted_tokens is not None:
        raise NotImplementedError(
            "speculative decoding with Mamba2 layers is not served on the card path; "
            "serve without --speculative-config")


def causal_conv1d_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None,
                     has_initial_state=None, activation="silu", pad_slot_id=PAD_SLOT_ID,
                     null_block_id=NULL_BLOCK_ID, block_idx_first_scheduled_token=None,
                     **_):
    """vLLM's ``causal_conv1d_fn`` (prefills, ``x [dim, tokens]``)."""
    if block_idx_first_scheduled_token is not None:
        raise NotImplementedError("Mamba2 prefix caching in 'all' mode is not served on "
                                  "the card path; use vLLM's default ('align')")
    slots = (torch.arange(query_start_loc.numel() - 1) if cache_indices is None
             else _first_column(cache_indices).cpu())
    slots = torch.where(slots == null_block_id, pad_slot_id, slots)
    return get_kernel("causal_conv1d")(x, weight, bias, conv_states, query_start_loc.cpu(),
                                       slots, has_initial_state, _activation(activation),
                                       null_slot=pad_slot_id)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None,
                         conv_state_indices=None, num_accepted_tokens=None,
                         query_start_loc=None, max_query_len=-1,
                         null_block_id=NULL_BLOCK_ID, out=None, **_):
    """vLLM's ``causal_conv1d_update`` (one token a sequence, ``x [sequences, dim]``)."""
    _no_speculative_rows(num_accepted_tokens)
    slots = (torch.arange(x.shape[0]) if conv_state_indices is None
             else _first_column(conv_state_indices).cpu())
    y = get_kernel("causal_conv1d_step")(x, conv_state, weight, bias, slots,
                                         _activation(activation), null_slot=null_block_id)
    if out is None:
        return y
    out.copy_(y)
    return out


def mamba_chunk_scan_combined_varlen(x, dt, A, B, C, chunk_size, cu_seqlens,
                                     cu_chunk_seqlens, last_chunk_indices, seq_idx, out,
                                     D=None, z=None, dt_bias=None, initial_states=None,
                                     dt_softplus=False, dt_limit=(0.0, float("inf")),
                                     return_intermediate_states=False, state_dtype=None):
    """vLLM's ``mamba_chunk_scan_combined_varlen``: writes ``out``, returns the state
    after each of vLLM's chunks (``return_intermediate_states``) or each sequence's
    final state."""
    y, states = get_kernel("ssd_scan")(
        x, dt, A, B, C, cu_seqlens.cpu(), initial_states, D, z, dt_bias, dt_softplus,
        dt_limit, chunk_ends=cu_chunk_seqlens[1:].cpu())
    out.copy_(y.view(out.shape))
    if not return_intermediate_states:
        states = states[last_chunk_indices.cpu()]
    return states.to(state_dtype or x.dtype)


def selective_state_update(state, x, dt, A, B, C, D, dt_bias, z=None, dt_softplus=False,
                           state_batch_indices=None, dst_state_batch_indices=None,
                           null_block_id=NULL_BLOCK_ID, out=None, num_accepted_tokens=None,
                           cu_seqlens=None, **_):
    """vLLM's ``selective_state_update`` for one token a sequence (``x [S, H, P]``;
    ``dt``, ``A``, ``dt_bias``, ``D`` as the mixer expands them over the head dim)."""
    _no_speculative_rows(num_accepted_tokens)
    slots = (torch.arange(x.shape[0]) if state_batch_indices is None
             else _first_column(state_batch_indices).cpu())
    dst = None if dst_state_batch_indices is None else _first_column(
        dst_state_batch_indices).cpu()
    y = get_kernel("ssm_decode_step")(
        state, x, dt[..., 0] if dt.dim() == 3 else dt,
        A[:, 0, 0] if A.dim() == 3 else A, B, C, slots, D=D, z=z,
        dt_bias=dt_bias[:, 0] if dt_bias is not None and dt_bias.dim() == 2 else dt_bias,
        dt_softplus=dt_softplus, null_slot=null_block_id, dst_slots=dst)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y.view(out.shape))
    return out


#: MambaMixer2's module-level names -> their adapters here
MIXER2_OPS = {"causal_conv1d_fn": causal_conv1d_fn,
              "causal_conv1d_update": causal_conv1d_update,
              "mamba_chunk_scan_combined_varlen": mamba_chunk_scan_combined_varlen,
              "selective_state_update": selective_state_update}


def install() -> None:
    """Point ``vllm.model_executor.layers.mamba.mamba_mixer2``'s op names at the
    adapters (idempotent)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2

    for name, adapter in MIXER2_OPS.items():
        setattr(mamba_mixer2, name, adapter)
