"""State-space layers on the card path: vLLM's Mamba2 and Gated DeltaNet ops with
the kernel registry behind them.

vLLM 0.32's ``MambaMixer2`` calls four module-level functions -- the causal
convolution over prefills and its one-token update, the chunked selective scan and
its one-token state update -- which are Triton kernels, or vLLM's C++ CPU ops when
the platform is a CPU; its Gated DeltaNet layer picks a Triton/FLA or a CPU forward
the same way. A card is neither, so :func:`install` (a patch in ``patches.py``)
points the mixer's names at the adapters here, which keep vLLM's signatures and run
``causal_conv1d``, ``causal_conv1d_step``, ``ssd_scan`` and ``ssm_decode_step`` from
the registry (``torch_fast`` / ``reference``, or a vendor's), and serves the Gated
DeltaNet layer's core op with ``gated_delta_rule``.
"""

import torch
from vllm.utils.torch_utils import LayerNameType

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
            "speculative decoding with state-space layers is not served; "
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


def gdn_attention_core(mixed_qkv: torch.Tensor, b: torch.Tensor, a: torch.Tensor,
                       core_attn_out: torch.Tensor, layer_name: LayerNameType) -> None:
    """vLLM's ``cpu_gdn_attention_core`` op (what ``forward_cpu`` of a Gated DeltaNet
    layer calls) on the registry: the causal convolution over q/k/v, the gates
    ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``, then
    ``gated_delta_rule`` over decodes and prefills alike, states in vLLM's cache."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import _resolve_layer_name

    context = get_forward_context()
    layer = context.no_compile_layers[_resolve_layer_name(layer_name)]
    if context.attn_metadata is None:
        return
    meta = context.attn_metadata[layer.prefix]
    if meta.num_actual_tokens == 0:
        return
    _no_speculative_rows(meta.num_accepted_tokens)
    conv_state, ssm_state = layer.kv_cache[0], layer.kv_cache[1]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)  # (dim, state) views
    weight = layer.conv1d.weight.view(layer.conv1d.weight.size(0), -1)
    slots = meta.non_spec_state_indices_tensor.cpu()
    cu = meta.non_spec_query_start_loc.cpu()
    decodes, decode_tokens = meta.num_decodes, meta.num_decode_tokens
    tokens = decode_tokens + meta.num_prefill_tokens
    x = mixed_qkv[:tokens]
    conv = torch.empty_like(x)
    if decodes:
        conv[:decode_tokens] = get_kernel("causal_conv1d_step")(
            x[:decode_tokens], conv_state, weight, layer.conv1d.bias, slots[:decodes],
            layer.activation, null_slot=PAD_SLOT_ID)
    initial = torch.ones(len(slots), dtype=torch.bool)
    if meta.num_prefills:
        initial[decodes:] = meta.has_initial_state[decodes:].cpu()
        conv[decode_tokens:] = get_kernel("causal_conv1d")(
            x[decode_tokens:].transpose(0, 1), weight, layer.conv1d.bias, conv_state,
            cu[decodes:] - decode_tokens, slots[decodes:], initial[decodes:],
            layer.activation, null_slot=PAD_SLOT_ID).transpose(0, 1)
    query, key, value = (t[0] for t in layer.rearrange_mixed_qkv(conv))
    g = -torch.exp(layer.A_log.float()) * torch.nn.functional.softplus(
        a[:tokens].float() + layer.dt_bias.float())
    beta = torch.sigmoid(b[:tokens].float())
    out = get_kernel("gated_delta_rule")(query, key, value, g, beta, ssm_state, cu, slots,
                                         initial, null_slot=PAD_SLOT_ID)
    core_attn_out[:tokens] = out.to(core_attn_out.dtype)


#: MambaMixer2's module-level names -> their adapters here
MIXER2_OPS = {"causal_conv1d_fn": causal_conv1d_fn,
              "causal_conv1d_update": causal_conv1d_update,
              "mamba_chunk_scan_combined_varlen": mamba_chunk_scan_combined_varlen,
              "selective_state_update": selective_state_update}


def install() -> None:
    """Point ``vllm.model_executor.layers.mamba.mamba_mixer2``'s op names at the
    adapters; register :func:`gdn_attention_core` as vLLM's ``cpu_gdn_attention_core``
    op (vLLM registers it on CPU platforms only) and have Gated DeltaNet layers built
    from here on take ``forward_cpu``, which calls it (idempotent)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.gdn import qwen_gdn_linear_attn as gdn
    from vllm.utils.torch_utils import direct_register_custom_op

    for name, adapter in MIXER2_OPS.items():
        setattr(mamba_mixer2, name, adapter)
    if not hasattr(torch.ops.vllm, "cpu_gdn_attention_core"):
        direct_register_custom_op(op_name="cpu_gdn_attention_core",
                                  op_func=gdn_attention_core, mutates_args=["core_attn_out"])
    layer_cls = gdn.QwenGatedDeltaNetAttention
    if not getattr(layer_cls.__init__, "__accel_patched__", False):
        original = layer_cls.__init__

        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self._forward_method = self.forward_cpu

        __init__.__accel_patched__ = True
        layer_cls.__init__ = __init__
