"""Vendor kernels and xformers as kernel-registry providers.

After the worker has loaded the vendor library, ``install_vendor_kernels`` asks
the backend for each vendor op (``backend.op("ns::name")`` answers only when a
kernel is registered for the device's dispatch key) and registers an adapter
under the backend's provider name. The adapter translates our functional kernel
signature to the vendor's in-place schema, and hands argument combinations the
vendor op does not cover to the next provider (``fallback_kernel``), so every op
keeps working with or without the vendor's build.

Providers:

* ``gcu_vendor``: Enflame's ``vllm_gcu._C`` ops (registered under vLLM's ``_C``
  namespace for PrivateUse1): ``rms_norm``, ``fused_add_rms_norm``,
  ``silu_and_mul``, ``rotary_embedding``. Decode attention through
  ``paged_attention_v1`` (with ALiBi), which reads vLLM's paged-attention tensors:
  the pages a batch reads are gathered into them per call; prefill after cached
  context through ``context_attention_forward`` (vllm-gcu's V0 prefix prefill) over
  the same tensors (``gcu_attention.py``). The cache writes stay ours (Enflame's
  ``reshape_and_cache`` writes vLLM's layout too).
  Routing for MoE: ``_moe_C::topk_softmax`` (softmax top-k; vLLM's schema, with or
  without its ``renormalize`` argument, which older forks lack) and
  ``_C::fused_grouped_topk`` (softmax or sigmoid scores, DeepSeek's correction bias
  and group-limited choice; what vllm-gcu swaps in for vLLM's ``grouped_topk``).
  The experts through ``_moe_C::moe_align_block_size`` and ``_C::fused_moe_kernel``
  (vllm-gcu's bf16/fp16/fp32 expert path, on vLLM's weight layout).
  MLA: the latent cache write through ``_C_cache_ops::concat_and_cache_mla`` and the
  absorbed decode through FlashMLA's ``_flashmla_C::fwd_kvcache_mla`` (vLLM's latent
  cache is ours, so both read and write it in place; decode within FlashMLA's
  contract: bf16/fp16, 512 + 64 latent, pages of 64, which is our default).
* ``sophgo_vendor``: Sophgo's ``my_ops::rmsnorm_forward`` and the MoE experts
  ``my_ops::fused_moe_fused_experts`` (SiLU-gated bf16/fp16 experts without biases;
  each (token, choice) pair's unweighted output, weighted and summed here). Decode
  and prefill attention through ``my_ops::paged_attention_v3``, which reads and
  writes its own cache layout: the pages a batch reads are gathered into it per call
  (``sophgo_attention.py``). MLA through ``my_ops::paged_latent_attention``, a whole
  layer's attention from its latents (query and KV up-projections, RoPE, its own
  latent and rope caches): ``mla_latent_attention``, which ``mla_layer.py``'s MLA
  layer calls instead of vLLM's query projection and ``MLAAttention``; the pages a
  batch reads are gathered into the op's caches per call (``sophgo_mla.py``).
* ``flash_attn``: Enflame's FlashAttention build (what vllm-gcu's V1 engine uses),
  prefill and decode reading our cache in place, registered for the features a probe
  on the device matched (``flash_attn.py``).
* ``xformers``: ``paged_prefill`` through ``xformers.ops.memory_efficient_attention``
  (what Enflame's vLLM uses for prefill), registered only when a probe on the
  device succeeds.
* ``triton``: our Triton kernels (``ops/triton``), registered only when a probe
  kernel compiles and runs on the device.
"""

from collections.abc import Callable

import torch

from vllm_accel.logger import init_logger
from vllm_accel.ops.reference.moe import gated_activation
from vllm_accel.ops.registry import fallback_kernel, get_kernel, register_kernel
from vllm_accel.ops.vendor.flash_attn import FLASH_ATTN, probe_flash_attn
from vllm_accel.ops.vendor.gcu_attention import (GCU_VENDOR, _gcu_context_attention,
                                                 _gcu_paged_decode)
from vllm_accel.ops.vendor.sophgo_attention import SOPHGO_VENDOR, sophgo_paged_kernel
from vllm_accel.ops.vendor.sophgo_mla import sophgo_latent_kernel
from vllm_accel.ops.triton.provider import TRITON, install_triton_kernels

logger = init_logger(__name__)

XFORMERS = "xformers"


# ---------------------------------------------------------------------------
# Enflame (vllm_gcu._C) adapters.
# ---------------------------------------------------------------------------


def _gcu_rms_norm(ops: dict[str, Callable]):
    rms_norm, fused_add = ops.get("_C::rms_norm"), ops.get("_C::fused_add_rms_norm")

    def gcu_rms_norm(x, weight, eps, residual=None, variance_size=None):
        if weight is None or variance_size is not None or (
                residual is None and rms_norm is None) or (
                residual is not None and fused_add is None):
            return fallback_kernel("rms_norm", GCU_VENDOR)(x, weight, eps, residual, variance_size)
        if residual is None:
            out = torch.empty_like(x)
            rms_norm(out, x.contiguous(), weight, eps)
            return out
        h, r = x.clone(), residual.clone()  # the vendor op works in place
        fused_add(h, r, weight, eps)
        return h, r

    return gcu_rms_norm


def _gcu_silu_and_mul(ops):
    op = ops["_C::silu_and_mul"]

    def gcu_silu_and_mul(x):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        op(out, x.contiguous())
        return out

    return gcu_silu_and_mul


def _gcu_rotary_embedding(ops):
    op = ops["_C::rotary_embedding"]

    def gcu_rotary_embedding(positions, query, key, cos_sin_cache, head_size, rotary_dim,
                             is_neox_style):
        # The GCU schema needs a key and derives rotary_dim from the cache width.
        if key is None or cos_sin_cache.shape[-1] != rotary_dim:
            return fallback_kernel("rotary_embedding", GCU_VENDOR)(
                positions, query, key, cos_sin_cache, head_size, rotary_dim, is_neox_style)
        q, k = query.clone(), key.clone()
        op(positions, q, k, head_size, cos_sin_cache, is_neox_style)
        return q, k

    return gcu_rotary_embedding


def _gcu_moe_route(ops):
    """``moe_route`` on ``_moe_C::topk_softmax`` (plain softmax top-k) and
    ``_C::fused_grouped_topk`` (every rule the reference routes by), whichever the
    library registers; ``routed_scaling_factor`` is applied here (neither op has it)."""
    softmax_op = ops.get("_moe_C::topk_softmax")
    grouped_op = ops.get("_C::fused_grouped_topk")
    # (topk_weights!, topk_ids!, token_expert_indices!, gating_output[, renormalize, ...])
    takes_renormalize = softmax_op is not None and len(softmax_op._schema.arguments) > 4

    def gcu_moe_route(router_logits, top_k, *, renormalize, scoring_func="softmax",
                      num_expert_group=None, topk_group=None, e_score_correction_bias=None,
                      routed_scaling_factor=1.0):
        plain = (scoring_func == "softmax" and e_score_correction_bias is None
                 and (num_expert_group or 1) <= 1)
        if not (plain and softmax_op is not None) and (
                grouped_op is None or scoring_func not in ("softmax", "sigmoid")):
            return fallback_kernel("moe_route", GCU_VENDOR)(
                router_logits, top_k, renormalize=renormalize, scoring_func=scoring_func,
                num_expert_group=num_expert_group, topk_group=topk_group,
                e_score_correction_bias=e_score_correction_bias,
                routed_scaling_factor=routed_scaling_factor)
        m, device = router_logits.shape[0], router_logits.device
        weights = torch.empty(m, top_k, dtype=torch.float32, device=device)
        ids = torch.empty(m, top_k, dtype=torch.int32, device=device)
        logits = router_logits.to(torch.float32).contiguous()
        if plain and softmax_op is not None:
            token_expert = torch.empty(m, top_k, dtype=torch.int32, device=device)
            softmax_op(weights, ids, token_expert, logits,
                       *((renormalize,) if takes_renormalize else ()))
            if renormalize and not takes_renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        else:
            bias = (None if e_score_correction_bias is None
                    else e_score_correction_bias.to(torch.float32).contiguous())
            grouped_op(weights, ids, logits, top_k, renormalize, num_expert_group or 1,
                       topk_group or 1, bias, scoring_func)
        if routed_scaling_factor != 1.0:
            weights = weights * routed_scaling_factor
        return weights, ids

    return gcu_moe_route


#: FlashMLA's contract, which Enflame's ``_flashmla_C`` reuses with vLLM's op names:
#: DeepSeek's latent (512 + 64 rope) in pages of 64 tokens, bf16 or fp16
FLASH_MLA_LATENT, FLASH_MLA_ROPE, FLASH_MLA_PAGE = 512, 64, 64


def _gcu_mla_cache_write(ops):
    """``mla_cache_write`` on vLLM's ``_C_cache_ops::concat_and_cache_mla``: its latent
    cache ``[num_blocks, block_size, L + R]`` is ours, so no copy between layouts.
    Unquantized caches only (the INT8 and fp8 caches have their own kernels)."""
    op = ops["_C_cache_ops::concat_and_cache_mla"]
    unit_scale: dict[torch.device, torch.Tensor] = {}

    def gcu_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping):
        if kv_cache.dtype != kv_c.dtype:
            return fallback_kernel("mla_cache_write", GCU_VENDOR)(kv_c, k_pe, kv_cache,
                                                                 slot_mapping)
        scale = unit_scale.get(kv_c.device)
        if scale is None:
            scale = unit_scale[kv_c.device] = torch.ones(1, dtype=torch.float32,
                                                         device=kv_c.device)
        op(kv_c.contiguous(), k_pe.contiguous(), kv_cache, slot_mapping, "auto", scale)

    return gcu_mla_cache_write


def _gcu_mla_decode(ops):
    """``mla_decode`` on ``_flashmla_C::fwd_kvcache_mla`` with its scheduling metadata
    (``get_mla_metadata``, or ``get_mla_decoding_metadata`` in later vLLMs). Three
    schemas of the op are in use; they differ after ``kcache``: vLLM 0.8-0.9 pass
    ``Tensor? vcache`` (None) there, vLLM 0.10 and Enflame's library append
    ``descale_q, descale_k`` and later ones ``is_fp8, indices``: their defaults (None,
    False) keep the plain bf16 decode. Enflame's library registers no metadata op
    (vllm-gcu patches vLLM's ``get_mla_metadata`` to return ``None, None`` and passes
    those): without one, neither is passed either. Calls outside FlashMLA's contract
    (dtype, latent widths, page size) go to the next provider. Returns None (not
    registered) when the schema is none of the three."""
    fwd = ops["_flashmla_C::fwd_kvcache_mla"]
    metadata = (ops.get("_flashmla_C::get_mla_decoding_metadata")
                or ops.get("_flashmla_C::get_mla_metadata"))
    args = fwd._schema.arguments
    takes_vcache = len(args) > 2 and isinstance(args[2].type, torch._C.OptionalType)
    fixed = 10 if takes_vcache else 9
    tail = []
    for a in args[fixed:]:
        if isinstance(a.type, torch._C.OptionalType):
            tail.append(None)
        elif a.type == torch._C.BoolType.get():
            tail.append(False)
        else:
            return None
    if len(args) < fixed or (metadata is not None and len(metadata._schema.arguments) > 6):
        return None

    def gcu_mla_decode(q_nope, q_pe, kv_cache, block_table, seq_lens, scale):
        b, n, lora = q_nope.shape
        if (q_nope.dtype not in (torch.bfloat16, torch.float16)
                or kv_cache.dtype != q_nope.dtype or lora != FLASH_MLA_LATENT
                or q_pe.shape[-1] != FLASH_MLA_ROPE or kv_cache.shape[1] != FLASH_MLA_PAGE
                or b == 0):
            return fallback_kernel("mla_decode", GCU_VENDOR)(q_nope, q_pe, kv_cache,
                                                            block_table, seq_lens, scale)
        lens = seq_lens.to(torch.int32)
        tile_metadata = num_splits = None
        if metadata is not None:
            # (seqlens, query heads per KV head, KV heads[, query heads, fp8, top-k])
            extra = (n, False, None)[:len(metadata._schema.arguments) - 3]
            tile_metadata, num_splits = metadata(lens, n, 1, *extra)
        q = torch.cat((q_nope, q_pe), dim=-1).unsqueeze(1)  # [B, 1, N, L + R]
        cache = kv_cache.unsqueeze(2)  # [num_blocks, page, 1 KV head, L + R]
        out, _ = fwd(q, cache, *((None,) if takes_vcache else ()), lora, lens,
                     block_table.to(torch.int32), scale, False, tile_metadata, num_splits,
                     *tail)
        # requests without cached tokens (batch padding) read nothing: zeros
        return torch.where(lens.view(b, 1, 1) > 0, out.view(b, n, lora), 0)

    return gcu_mla_decode


#: tokens per block of vllm-gcu's MoE alignment (its ``get_default_config``)
GCU_MOE_BLOCK = 64
#: from this many experts vllm-gcu aligns with ``_moe_C::sgl_moe_align_block_size``
GCU_SGL_ALIGN_EXPERTS = 224
#: the alignment ops (the first is required, the second used from 224 experts)
_GCU_ALIGN_OPS = ("_moe_C::moe_align_block_size", "_moe_C::sgl_moe_align_block_size")


def _gcu_align(ops, num_experts: int):
    """The alignment op vllm-gcu uses for ``num_experts``, or None where the library
    registers none (sgl's, from 224 experts)."""
    return ops.get(_GCU_ALIGN_OPS[num_experts >= GCU_SGL_ALIGN_EXPERTS])
#: ``_C::fused_moe_kernel``'s schema as vllm-gcu registers it (inferred from its C++
#: signature, so the arguments are unnamed): C!, A, B, topk_weights, topk_ids,
#: sorted_token_ids, expert_ids, num_tokens_post_pad, mul_routed_weight, topk,
#: block_size, bias?
_FUSED_MOE_TYPES = ("Tensor",) * 8 + ("bool", "int", "int", "Optional[Tensor]")


def _gcu_run_experts(align, gemm, x, topk_weights, topk_ids, num_experts, inter, hidden,
                     activation):
    """The routed experts as vllm-gcu runs them: ``align`` (:func:`_gcu_align`) sorts
    the (token, choice) pairs by expert into blocks of 64, ``gemm(out, a, proj,
    weights, ids, sorted_ids, expert_ids, padded, mul_routed_weight, topk)`` runs each
    block's pairs through their expert's projection (``w13``, then ``w2`` scaled by the
    router weight), the gated activation between; the choices are summed in float32."""
    m, top_k = topk_ids.shape
    device = x.device
    ids = topk_ids.to(torch.int32).contiguous()
    weights = topk_weights.to(torch.float32).contiguous()
    padded = ids.numel() + num_experts * (GCU_MOE_BLOCK - 1)
    sorted_ids = torch.empty(padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(padded // GCU_MOE_BLOCK, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    align(ids, num_experts, GCU_MOE_BLOCK, sorted_ids, expert_ids, num_padded)
    h = torch.empty(m, top_k, 2 * inter, dtype=x.dtype, device=device)
    gemm(h, x.contiguous(), "w13", weights, ids, sorted_ids, expert_ids, num_padded, False, top_k)
    h = h.view(m * top_k, -1)
    act = (get_kernel("silu_and_mul")(h) if activation == "silu"
           else gated_activation(h, activation))
    y = torch.empty(m, top_k, hidden, dtype=x.dtype, device=device)
    gemm(y, act.contiguous(), "w2", weights, ids, sorted_ids, expert_ids, num_padded, True, 1)
    return y.float().sum(dim=1).to(x.dtype)


def _gcu_moe_experts(ops):
    """``moe_experts`` on ``_C::fused_moe_kernel`` (:func:`_gcu_run_experts`), reading
    vLLM's ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` in place. Expert maps
    (expert parallel), biases and the router weight on the input go to the next
    provider, and so do 224 experts or more where the library lacks sgl's alignment.
    Returns None (not registered) when the kernel's schema is not vllm-gcu's."""
    fused = ops["_C::fused_moe_kernel"]
    if tuple(str(a.type) for a in fused._schema.arguments) != _FUSED_MOE_TYPES:
        return None

    def gcu_moe_experts(x, w13, w2, topk_weights, topk_ids, *, expert_map=None,
                        activation="silu", apply_router_weight_on_input=False,
                        w13_bias=None, w2_bias=None):
        align = _gcu_align(ops, w13.shape[0])
        if (expert_map is not None or apply_router_weight_on_input or w13_bias is not None
                or w2_bias is not None or x.dtype != w13.dtype or not x.shape[0]
                or align is None):
            return fallback_kernel("moe_experts", GCU_VENDOR)(
                x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                w13_bias=w13_bias, w2_bias=w2_bias)
        proj = {"w13": w13, "w2": w2}

        def gemm(out, a, name, weights, ids, sorted_ids, expert_ids, padded, mul, top_k):
            fused(out, a, proj[name], weights, ids, sorted_ids, expert_ids, padded, mul, top_k,
                  GCU_MOE_BLOCK, None)

        return _gcu_run_experts(align, gemm, x, topk_weights, topk_ids, w13.shape[0],
                                w13.shape[1] // 2, w2.shape[1], activation)

    return gcu_moe_experts


#: ``_C::fused_moe_quant_kernel``'s schema as vllm-gcu registers it (inferred from its
#: C++ signature): C!, A, B, A_scale?, B_scale, group_size, B_zp?, topk_weights,
#: topk_ids, sorted_token_ids, expert_ids, num_tokens_post_pad, mul_routed_weight,
#: topk, block_size, bias?, real_token_num?
_FUSED_MOE_QUANT_TYPES = (("Tensor",) * 3
                          + ("Optional[Tensor]", "Tensor", "int", "Optional[Tensor]")
                          + ("Tensor",) * 5 + ("bool", "int", "int") + ("Optional[Tensor]",) * 2)
#: input columns per block of vllm-gcu's 4-bit layout (``rearrange_uint4_int32_uint8_gptq``)
GCU_INT4_BLOCK = 128
#: the group sizes vllm-gcu's 8-bit experts take besides one scale per channel
GCU_INT8_GROUP_SIZES = (64, 128)


def _gcu_int8_codes(codes: torch.Tensor) -> torch.Tensor:
    """vllm-gcu's 8-bit weights: signed codes, the generic unsigned code minus 128
    (symmetric checkpoints only: vllm-gcu keeps no zero points at 8 bits)."""
    return (codes ^ 0x80).view(torch.int8)


def _gcu_int4_bytes(packed: torch.Tensor) -> torch.Tensor:
    """Generic 4-bit bytes ``[..., N, K/2]`` (even column in the low nibble) ->
    vllm-gcu's (``rearrange_uint4_int32_uint8_gptq``): per block of 128 input columns,
    byte ``j`` holds column ``j`` in its low nibble and column ``64 + j`` in its high one."""
    *lead, n, half = packed.shape
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).view(*lead, n, -1, 2, 64)
    return (codes[..., 0, :] | (codes[..., 1, :] << 4)).reshape(*lead, n, half)


def _gcu_int8_scales(scales: torch.Tensor, act_dtype) -> torch.Tensor:
    """Generic 8-bit scales ``[N, G]`` -> vllm-gcu's: ``[N]`` per channel, else ``[G, N]``,
    in the activation dtype."""
    s = scales.to(act_dtype)
    return (s[:, 0] if s.shape[1] == 1 else s.t()).contiguous()


def _gcu_int4_scales(scales: torch.Tensor, zeros: torch.Tensor | None, act_dtype):
    """Generic scales and zero points ``[..., N, G]`` -> vllm-gcu's scales and zero
    points times scales, ``[..., G, N]`` in the activation dtype (its asymmetric form,
    also for symmetric weights: their zero point 8 is passed, not left to the kernel).
    The product is of the rounded scales, as vllm-gcu computes it."""
    s = scales.to(act_dtype)
    z = torch.full_like(s, 8.0) if zeros is None else zeros.to(act_dtype)
    return s.transpose(-1, -2).contiguous(), (z * s).transpose(-1, -2).contiguous()


def _stacked(modules, convert) -> list[torch.Tensor]:
    """``convert(module)``'s tensors for every expert, stacked ``[E, ...]``: converted
    one expert at a time into the stacks (the temporaries of one expert at a time)."""
    stacks = None
    for e, module in enumerate(modules):
        parts = convert(module)
        if stacks is None:
            stacks = [t.new_empty((len(modules), *t.shape)) for t in parts]
        for stack, t in zip(stacks, parts):
            stack[e] = t
    return stacks


def _gcu_int8_experts(modules, act_dtype) -> dict:
    """vllm-gcu's 8-bit experts (``moe_wna16``'s GPTQ conversion): signed codes ``[E, N,
    K]``, scales ``[E, N]`` per channel (group size -1) or ``[E, G, N]``, in the
    activation dtype."""
    weight, scales = _stacked(modules, lambda m: (
        _gcu_int8_codes(m.qweight.data), _gcu_int8_scales(m.scales.data, act_dtype)))
    return {"weight": weight, "scales": scales, "zeros": None,
            "group_size": -1 if scales.dim() == 2 else modules[0].group_size}


def _gcu_int4_experts(modules, act_dtype) -> dict:
    """vllm-gcu's 4-bit experts: bytes ``[E, N, K/2]`` (:func:`_gcu_int4_bytes`), scales
    and zero terms ``[E, G, N]`` (:func:`_gcu_int4_scales`)."""
    weight, scales, zero_terms = _stacked(modules, lambda m: (
        _gcu_int4_bytes(m.qweight.data),
        *_gcu_int4_scales(m.scales.data, None if m.zeros is None else m.zeros.data,
                          act_dtype)))
    return {"weight": weight, "scales": scales, "zeros": zero_terms,
            "group_size": modules[0].group_size}


def _dynamic_w8a8(module) -> bool:
    """A W8A8 module (``InstalledW8A8``) with dynamic symmetric per-token activations."""
    return (getattr(module, "weight_scale", None) is not None
            and module.weight.dtype == torch.int8 and module.input_scale is None
            and module.input_symmetric)


def _gcu_w8a8_experts(modules) -> dict:
    """vllm-gcu's W8A8 experts (compressed-tensors' int8 method): int8 weights ``[E, N,
    K]``, float32 per-channel scales ``[E, 1, N]``, group size 1 as vllm-gcu passes it;
    the activations are quantized per token before each GEMM (``act_quant``)."""
    weight, scales = _stacked(modules, lambda m: (
        m.weight.data, m.weight_scale.data.to(torch.float32).reshape(1, -1)))
    return {"weight": weight, "scales": scales, "zeros": None, "group_size": 1,
            "act_quant": True}


def _gcu_quant_layout(modules, act_dtype) -> dict | None:
    """One projection of every expert in vllm-gcu's layout, or None where its kernel
    takes none: W8A8 with dynamic symmetric activations; or the generic weight-only
    resident layout without act-order (uniform over the experts), 8-bit symmetric per
    channel or in groups of 64/128, 4-bit in groups (vllm-gcu loads no per-channel
    4-bit weights) with input columns a multiple of 128."""
    first = modules[0]
    if all(_dynamic_w8a8(m) for m in modules) and len({m.weight.shape for m in modules}) == 1:
        return _gcu_w8a8_experts(modules)
    if not all(getattr(m, "generic_layout", False) for m in modules) or len(
            {(m.bits, m.group_size, m.zeros is None, m.qweight.shape) for m in modules}) != 1:
        return None
    width = first.qweight.shape[1] * (8 // first.bits)
    if first.bits == 8 and first.zeros is None and (
            first.group_size == width or first.group_size in GCU_INT8_GROUP_SIZES):
        return _gcu_int8_experts(modules, act_dtype)
    if first.bits == 4 and width % GCU_INT4_BLOCK == 0 and first.group_size < width:
        return _gcu_int4_experts(modules, act_dtype)
    return None


def _gcu_moe_quant_experts(ops):
    """``moe_quant_experts`` on ``_C::fused_moe_quant_kernel`` (weight-only 4/8-bit and
    W8A8, :func:`_gcu_run_experts`). ``prepare_experts`` converts a layer's experts at load
    into vllm-gcu's layouts (:func:`_gcu_quant_layout`), for bf16/fp16 activations
    (vllm-gcu's) without an expert map, biases or the router weight on the input
    (or 224 experts and more without sgl's alignment op); it declines other layers,
    which keep per-expert modules and the next provider.
    Returns None (not registered) when the kernel's schema is not vllm-gcu's."""
    quant = ops["_C::fused_moe_quant_kernel"]
    if tuple(str(a.type) for a in quant._schema.arguments) != _FUSED_MOE_QUANT_TYPES:
        return None

    def gcu_moe_quant_experts(x, w13, w2, topk_weights, topk_ids, *, expert_map=None,
                              activation="silu", apply_router_weight_on_input=False,
                              w13_bias=None, w2_bias=None):
        if getattr(w13, "provider", None) != GCU_VENDOR:  # per-expert modules
            return fallback_kernel("moe_quant_experts", GCU_VENDOR)(
                x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                w13_bias=w13_bias, w2_bias=w2_bias)
        if (expert_map is not None or apply_router_weight_on_input or w13_bias is not None
                or w2_bias is not None):
            raise RuntimeError("gcu_vendor: experts prepared for fused_moe_quant_kernel got "
                               "an expert map, biases or the router weight on the input, "
                               "which prepare_experts declines")
        if not x.shape[0]:
            return torch.zeros_like(x)
        proj = {"w13": w13, "w2": w2}
        align = _gcu_align(ops, w13.weight.shape[0])

        def gemm(out, a, name, weights, ids, sorted_ids, expert_ids, padded, mul, top_k):
            p = proj[name]
            a_scale = None
            if getattr(p, "act_quant", False):  # W8A8: int8 activations, per-token scales
                a, a_scale, _ = get_kernel("int8_quant_act")(a)
            quant(out, a, p.weight, a_scale, p.scales, p.group_size, p.zeros, weights, ids,
                  sorted_ids, expert_ids, padded, mul, top_k, GCU_MOE_BLOCK, None, None)

        return _gcu_run_experts(align, gemm, x, topk_weights, topk_ids, w13.weight.shape[0],
                                w13.weight.shape[1] // 2, w2.weight.shape[1], activation)

    def prepare_experts(w13, w2, *, act_dtype, expert_map, apply_router_weight_on_input,
                        biased):
        """(w13, w2) entries of vllm-gcu's layouts for these experts' modules, or None."""
        if (act_dtype not in (torch.bfloat16, torch.float16) or expert_map is not None
                or apply_router_weight_on_input or biased
                or _gcu_align(ops, len(w13)) is None):
            return None
        layouts = (_gcu_quant_layout(w13, act_dtype), _gcu_quant_layout(w2, act_dtype))
        return None if None in layouts else layouts

    gcu_moe_quant_experts.prepare_experts = prepare_experts
    return gcu_moe_quant_experts


#: ``_C::gptq_gemm_gcu``'s and ``_C::weight_only_quant``'s arguments as vllm-gcu
#: defines them (name, type)
_GCU_WINT_ARGS = {
    "_C::gptq_gemm_gcu": (("a", "Tensor"), ("b_q_weight", "Tensor"),
                          ("b_gptq_qzeros", "Tensor"), ("b_gptq_scales", "Tensor"),
                          ("b_g_idx", "Tensor"), ("bit", "int"), ("bias", "Optional[Tensor]"),
                          ("group_size", "int")),
    "_C::weight_only_quant": (("output", "Tensor"), ("input", "Tensor"), ("qweight", "Tensor"),
                              ("bias", "Optional[Tensor]"), ("scale", "Tensor"),
                              ("group_size", "int")),
}

# The dense GEMMs as one opaque op of ours, so torch.compile traces through its fake
# (vllm-gcu registers the vendor ops' fakes in its Python package, which is not loaded).
_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("gcu_wint_linear(Tensor x, Tensor weight, Tensor scales, Tensor? zeros, "
            "Tensor? group_index, Tensor? bias) -> Tensor")


def _gcu_wint_linear(x, weight, scales, zeros, group_index, bias):
    """``x`` ``[M, K]`` through vllm-gcu's 4-bit (``zeros`` given) or 8-bit GEMM."""
    groups = scales.shape[0] if scales.dim() == 2 else 1
    group_size = -1 if groups == 1 else x.shape[1] // groups
    if zeros is not None:
        return torch.ops._C.gptq_gemm_gcu(x, weight, zeros, scales, group_index, 4, bias,
                                          group_size)
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    torch.ops._C.weight_only_quant(out, x, weight, bias, scales, group_size)
    return out


_LIB.impl("gcu_wint_linear", _gcu_wint_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm_accel::gcu_wint_linear", lib=_LIB)
def _gcu_wint_linear_shape(x, weight, scales, zeros, group_index, bias):
    return x.new_empty(x.shape[0], weight.shape[1] if zeros is not None else weight.shape[0])


def _gcu_wint_schemas(ops) -> bool:
    """Whether every vllm-gcu dense GEMM found has vllm-gcu's schema."""
    return all(tuple((a.name, str(a.type)) for a in op._schema.arguments) == _GCU_WINT_ARGS[q]
               for q, op in ops.items())


def _gcu_wint_prepare(ops):
    """``wint_prepare``: a weight-only layer in vllm-gcu's layouts, for bf16/fp16
    activations (vllm-gcu's): 4-bit (``_C::gptq_gemm_gcu``) bytes ``[K/2, N]`` in its
    128-column blocks, scales and zero terms ``[G, N]``, in groups (vllm-gcu loads no
    per-channel 4-bit weights) with input widths a multiple of 128; 8-bit symmetric
    (``_C::weight_only_quant``) signed codes ``[N, K]`` with scales ``[N]`` or ``[G, N]``.
    Act-order keeps its permutation (the input is gathered per call). Other layers:
    None (the generic layout). Returns None (not registered) when a GEMM's schema is
    not vllm-gcu's."""
    if not _gcu_wint_schemas(ops):
        return None

    def gcu_wint_prepare(res, act_dtype):
        if act_dtype not in (torch.bfloat16, torch.float16) or res.g_idx is not None:
            return None
        if (res.bits == 4 and "_C::gptq_gemm_gcu" in ops and res.group_size < res.in_features
                and res.in_features % GCU_INT4_BLOCK == 0):
            scales, zero_terms = _gcu_int4_scales(res.scales, res.zeros, act_dtype)
            prepared = {"gcu_weight": _gcu_int4_bytes(res.qweight).t().contiguous(),
                        "gcu_scales": scales, "gcu_zeros": zero_terms,
                        "gcu_group_index": torch.arange(scales.shape[0], dtype=torch.int32,
                                                        device=scales.device)}
        elif res.bits == 8 and "_C::weight_only_quant" in ops and res.zeros is None:
            prepared = {"gcu_weight": _gcu_int8_codes(res.qweight).contiguous(),
                        "gcu_scales": _gcu_int8_scales(res.scales, act_dtype)}
        else:
            return None
        if res.perm is not None:
            prepared["perm"] = res.perm
        return prepared

    return gcu_wint_prepare


def _gcu_wint_prepared_linear(ops):
    """``wint_prepared_linear`` on :func:`_gcu_wint_prepare`'s layouts."""
    if not _gcu_wint_schemas(ops):
        return None

    def gcu_wint_prepared_linear(x, prepared, bias=None):
        if not x.numel():  # (vllm-gcu returns before its GEMMs too)
            width = prepared["gcu_scales"].shape[-1] if "gcu_zeros" in prepared else (
                prepared["gcu_weight"].shape[0])
            return x.new_empty(*x.shape[:-1], width)
        perm = prepared.get("perm")
        if perm is not None:
            x = x.index_select(-1, perm)
        out = torch.ops.vllm_accel.gcu_wint_linear(
            x.reshape(-1, x.shape[-1]).contiguous(), prepared["gcu_weight"],
            prepared["gcu_scales"], prepared.get("gcu_zeros"), prepared.get("gcu_group_index"),
            bias)
        return out.view(*x.shape[:-1], out.shape[-1])

    return gcu_wint_prepared_linear


#: ``_C::cutlass_scaled_mm``'s arguments as vllm-gcu defines it (vLLM's CPU build has
#: none): out!, the int8 activations ``[M, K]``, the int8 weight ``[K, N]`` column-major
#: (upstream's CUTLASS contract, which vllm-gcu's W8A8 kernel class keeps), the float32
#: activation scales ``[M, 1]`` or ``[1]``, the weight's ``[N, 1]`` or ``[1]``, bias?
_CUTLASS_SCALED_MM_ARGS = (("out", "Tensor"), ("x", "Tensor"), ("weight", "Tensor"),
                           ("x_scale", "Tensor"), ("w_scale", "Tensor"),
                           ("bias", "Optional[Tensor]"))
#: the same arguments as upstream vLLM names them (a vLLM build that defines the op
#: first keeps its names; vllm-gcu then only adds its implementation)
_UPSTREAM_SCALED_MM_ARGS = (("out", "Tensor"), ("a", "Tensor"), ("b", "Tensor"),
                            ("a_scales", "Tensor"), ("b_scales", "Tensor"),
                            ("bias", "Optional[Tensor]"))
#: upstream's wrapper sends other widths to a Triton kernel, which vllm-gcu lacks
GCU_SCALED_MM_MULTIPLE = 16

_LIB.define("gcu_scaled_mm(Tensor a, Tensor b, Tensor a_scale, Tensor b_scale, Tensor? bias, "
            "ScalarType out_dtype) -> Tensor")


def _gcu_scaled_mm(a, b, a_scale, b_scale, bias, out_dtype):
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    torch.ops._C.cutlass_scaled_mm(out, a, b, a_scale, b_scale, bias)
    return out


_LIB.impl("gcu_scaled_mm", _gcu_scaled_mm, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm_accel::gcu_scaled_mm", lib=_LIB)
def _gcu_scaled_mm_shape(a, b, a_scale, b_scale, bias, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


def _gcu_int8_linear(ops):
    """``int8_linear`` (W8A8) with its int8 GEMM and epilogue in vllm-gcu's
    ``_C::cutlass_scaled_mm`` (run inside the opaque op ``vllm_accel::gcu_scaled_mm``,
    so torch.compile traces its fake): the activations quantized by the registry's
    ``int8_quant_act``, the weight read in place as its ``[K, N]`` column-major
    transpose. Asymmetric activations, float32 outputs and widths that are not
    multiples of 16 go to the next provider. Returns None (not registered) when the
    op's schema is not vllm-gcu's."""
    op = ops["_C::cutlass_scaled_mm"]
    if tuple((a.name, str(a.type)) for a in op._schema.arguments) not in (
            _CUTLASS_SCALED_MM_ARGS, _UPSTREAM_SCALED_MM_ARGS):
        return None

    def gcu_int8_linear(x, weight, weight_scale, *, input_scale=None, input_zero_point=None,
                        input_symmetric=True, weight_col_sums=None, bias=None,
                        mm_method="auto"):
        n, k = weight.shape
        if (input_zero_point is not None or not input_symmetric or k % GCU_SCALED_MM_MULTIPLE
                or n % GCU_SCALED_MM_MULTIPLE or x.dtype not in (torch.bfloat16, torch.float16)
                or not x.numel()):
            return fallback_kernel("int8_linear", GCU_VENDOR)(
                x, weight, weight_scale, input_scale=input_scale,
                input_zero_point=input_zero_point, input_symmetric=input_symmetric,
                weight_col_sums=weight_col_sums, bias=bias, mm_method=mm_method)
        q, x_scale, _ = get_kernel("int8_quant_act")(x.reshape(-1, k), input_scale)
        # per token [M, 1]; a static scale [1], as vllm-gcu's own path sends it
        x_scale = x_scale.to(torch.float32)
        x_scale = x_scale.reshape(-1, 1) if input_scale is None else x_scale.reshape(1)
        y = torch.ops.vllm_accel.gcu_scaled_mm(
            q, weight.t(), x_scale,
            weight_scale.to(torch.float32).reshape(n, 1),
            None if bias is None else bias.to(x.dtype), x.dtype)
        return y.reshape(*x.shape[:-1], n)

    return gcu_int8_linear


# ---------------------------------------------------------------------------
# Sophgo (torch_tpu my_ops) adapters.
# ---------------------------------------------------------------------------


def _sophgo_rms_norm(ops):
    op = ops["my_ops::rmsnorm_forward"]

    def sophgo_rms_norm(x, weight, eps, residual=None, variance_size=None):
        if residual is not None or variance_size is not None:
            return fallback_kernel("rms_norm", SOPHGO_VENDOR)(x, weight, eps, residual,
                                                              variance_size)
        out = torch.empty_like(x)
        op(x.contiguous(), weight, None, out, x.dim() - 1, eps)
        return out

    return sophgo_rms_norm


def _sophgo_moe_experts(ops):
    """``moe_experts`` on ``my_ops::fused_moe_fused_experts``.

    The op takes the gate, up and down projections as ``[E, I, H]`` each (Sophgo's
    vLLM stores ``down_proj`` transposed) and writes each (token, choice) pair's
    unweighted expert output to ``[M, top_k, H]``; the router weights are applied
    here. The gate and up halves are views of vLLM's ``w13`` (each expert's rows
    contiguous). ``prepare_layer`` stores ``w2`` transposed in place at load (its shape
    stays vLLM's ``[E, H, I]``, the other providers read it through strides), so no
    call copies weights. Biases, expert maps, other activations and float32 go to the
    next provider.
    """
    op = ops["my_ops::fused_moe_fused_experts"]

    def serves(dtype, activation, biased, on_input, expert_map) -> bool:
        return (dtype in (torch.bfloat16, torch.float16) and activation == "silu"
                and not biased and not on_input and expert_map is None)

    def sophgo_moe_experts(x, w13, w2, topk_weights, topk_ids, *, expert_map=None,
                           activation="silu", apply_router_weight_on_input=False,
                           w13_bias=None, w2_bias=None):
        if not serves(x.dtype, activation, w13_bias is not None or w2_bias is not None,
                      apply_router_weight_on_input, expert_map):
            return fallback_kernel("moe_experts", SOPHGO_VENDOR)(
                x, w13, w2, topk_weights, topk_ids, expert_map=expert_map,
                activation=activation, apply_router_weight_on_input=apply_router_weight_on_input,
                w13_bias=w13_bias, w2_bias=w2_bias)
        m, top_k = topk_ids.shape
        num_experts, inter = w13.shape[0], w13.shape[1] // 2
        out = torch.empty(m, top_k, w2.shape[1], dtype=x.dtype, device=x.device)
        if m:
            halves = w13.view(num_experts, 2, inter, w13.shape[2])
            op(out, x.contiguous(), None, None, halves[:, 0], halves[:, 1],
               w2.transpose(1, 2).contiguous(), None, None, None,
               topk_ids.to(torch.int32).contiguous(), topk_weights.to(x.dtype).contiguous(),
               None, None, None, 0, num_experts, top_k, False, 1, 1, None, None, None, False)
        return torch.einsum("mkh,mk->mh", out.float(), topk_weights.float()).to(x.dtype)

    def prepare_layer(layer) -> None:
        """Store ``layer.w2_weight`` as ``[E, I, H]`` memory when this op serves it."""
        w2 = layer.w2_weight
        biased = getattr(layer, "w13_bias", None) is not None
        if serves(w2.dtype, layer.activation.value, biased, layer.apply_router_weight_on_input,
                  layer.expert_map):
            w2.data = w2.data.transpose(1, 2).contiguous().transpose(1, 2)

    sophgo_moe_experts.prepare_layer = prepare_layer
    return sophgo_moe_experts


# (provider, kernel name, vendor ops it uses, which it needs -- any one of them for
#  "any", all for "all", or those listed, the rest optional --, adapter factory)
VENDOR_KERNELS: tuple[tuple[str, str, tuple[str, ...], str | tuple[str, ...], Callable], ...] = (
    (GCU_VENDOR, "rms_norm", ("_C::rms_norm", "_C::fused_add_rms_norm"), "any", _gcu_rms_norm),
    (GCU_VENDOR, "silu_and_mul", ("_C::silu_and_mul",), "all", _gcu_silu_and_mul),
    (GCU_VENDOR, "rotary_embedding", ("_C::rotary_embedding",), "all", _gcu_rotary_embedding),
    (GCU_VENDOR, "moe_route", ("_moe_C::topk_softmax", "_C::fused_grouped_topk"), "any",
     _gcu_moe_route),
    (GCU_VENDOR, "paged_decode", ("_C::paged_attention_v1",), "all", _gcu_paged_decode),
    (GCU_VENDOR, "paged_prefill", ("_C::context_attention_forward",), "all",
     _gcu_context_attention),
    (GCU_VENDOR, "moe_experts", ("_C::fused_moe_kernel", *_GCU_ALIGN_OPS),
     ("_C::fused_moe_kernel", _GCU_ALIGN_OPS[0]), _gcu_moe_experts),
    (GCU_VENDOR, "wint_prepare", ("_C::gptq_gemm_gcu", "_C::weight_only_quant"), "any",
     _gcu_wint_prepare),
    (GCU_VENDOR, "wint_prepared_linear", ("_C::gptq_gemm_gcu", "_C::weight_only_quant"),
     "any", _gcu_wint_prepared_linear),
    (GCU_VENDOR, "int8_linear", ("_C::cutlass_scaled_mm",), "all", _gcu_int8_linear),
    (GCU_VENDOR, "moe_quant_experts", ("_C::fused_moe_quant_kernel", *_GCU_ALIGN_OPS),
     ("_C::fused_moe_quant_kernel", _GCU_ALIGN_OPS[0]), _gcu_moe_quant_experts),
    (GCU_VENDOR, "mla_cache_write", ("_C_cache_ops::concat_and_cache_mla",), "all",
     _gcu_mla_cache_write),
    (GCU_VENDOR, "mla_decode", ("_flashmla_C::fwd_kvcache_mla", "_flashmla_C::get_mla_metadata",
                                "_flashmla_C::get_mla_decoding_metadata"),
     ("_flashmla_C::fwd_kvcache_mla",), _gcu_mla_decode),
    (SOPHGO_VENDOR, "rms_norm", ("my_ops::rmsnorm_forward",), "all", _sophgo_rms_norm),
    (SOPHGO_VENDOR, "moe_experts", ("my_ops::fused_moe_fused_experts",), "all",
     _sophgo_moe_experts),
    (SOPHGO_VENDOR, "paged_decode", ("my_ops::paged_attention_v3",), "all",
     sophgo_paged_kernel("paged_decode")),
    (SOPHGO_VENDOR, "paged_prefill", ("my_ops::paged_attention_v3",), "all",
     sophgo_paged_kernel("paged_prefill")),
    (SOPHGO_VENDOR, "mla_latent_attention", ("my_ops::paged_latent_attention",), "all",
     sophgo_latent_kernel),
)


# ---------------------------------------------------------------------------
# xformers.
# ---------------------------------------------------------------------------


def probe_xformers(device: torch.device) -> tuple[bool, str]:
    """Whether xformers' memory_efficient_attention runs on ``device``, and why not.

    A tiny causal call on the device is the only reliable test: wheels differ in
    which devices they have kernels for (PyPI xformers has none for CPU; Enflame's
    fork targets the GCU).
    """
    try:
        import xformers.ops as xops
        from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightMask
    except Exception as exc:  # ImportError, or a build that fails to import
        return False, (f"xformers not usable on {device.type}: not importable "
                       f"({type(exc).__name__}: {exc})")
    try:  # allocation too: a device without the ops xformers needs fails here
        q = torch.zeros(1, 2, 1, 1, 8, device=device, dtype=torch.float32)
        xops.memory_efficient_attention(q, q, q, attn_bias=LowerTriangularFromBottomRightMask())
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        return False, (f"xformers not usable on {device.type}: no kernel for it "
                       f"({type(exc).__name__}: {first_line})")
    return True, "xformers memory_efficient_attention runs on " + device.type


def xformers_paged_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                           **features):
    """``paged_prefill`` with xformers doing the attention of each request.

    K/V are gathered from our cache, then attention runs in xformers' grouped
    ``[B, M, G, H, K]`` form (G = KV heads, H = query heads per KV head) with a
    bottom-right causal mask: the request's new queries are its last tokens. A
    sliding window is xformers' bottom-right local mask; soft-cap, ALiBi and sinks
    go to the next provider.
    """
    window = features.get("sliding_window")
    if set(features) - {"sliding_window"}:
        return fallback_kernel("paged_prefill", XFORMERS)(
            query, kv_cache, block_table, query_start_loc, seq_lens, scale, **features)
    import xformers.ops as xops
    from xformers.ops.fmha.attn_bias import (
        LowerTriangularFromBottomRightLocalAttentionMask,
        LowerTriangularFromBottomRightMask,
    )

    from vllm_accel.ops.torch_fast.attention import _gather_kv

    # keys in (i - window, i]: xformers' window counts the query's own key too
    mask = (LowerTriangularFromBottomRightMask() if window is None
            else LowerTriangularFromBottomRightLocalAttentionMask(window))

    t, h, d = query.shape
    hkv, block_size = kv_cache.shape[1], kv_cache.shape[2]
    group = h // hkv
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        # from the first query's window on (the blocks before it may be freed); the
        # mask is bottom-right aligned, so the keys dropped in front change nothing
        first = 0 if window is None else max(0, seq_len - (end - start) + 1 - window)
        first_block = first // block_size
        n = seq_len - first_block * block_size
        k, v, _ = _gather_kv(kv_cache, block_table[i:i + 1,
                                                    first_block:-(-seq_len // block_size)])
        k = k[:, :n].transpose(0, 1)[None, :, :, None].expand(1, n, hkv, group, d)
        v = v[:, :n].transpose(0, 1)[None, :, :, None].expand(1, n, hkv, group, d)
        q = query[start:end].view(1, end - start, hkv, group, d).to(k.dtype)
        o = xops.memory_efficient_attention(q, k, v, attn_bias=mask, scale=scale)
        out[start:end] = o.reshape(end - start, h, d).to(query.dtype)
    return out


# ---------------------------------------------------------------------------
# Installation.
# ---------------------------------------------------------------------------


def install_vendor_kernels(backend) -> dict[str, str]:
    """Register the providers the loaded backend can back; returns a report
    ``{"provider:kernel": "registered" | why not}`` (also logged)."""
    report: dict[str, str] = {}
    providers = set(backend.kernel_providers)
    for provider, name, qualnames, need, factory in VENDOR_KERNELS:
        if provider not in providers:
            continue
        ops = {q: op for q in qualnames if (op := backend.op(q)) is not None}
        required = qualnames if need == "all" else () if need == "any" else need
        ok = bool(ops) and set(required) <= set(ops)
        key = f"{provider}:{name}"
        adapter = factory(ops) if ok else None
        if adapter is not None:
            register_kernel(name, provider)(adapter)
            report[key] = "registered (" + ", ".join(sorted(ops)) + ")"
        elif ok:
            report[key] = ("not registered: schemas the adapter does not know: "
                           + "; ".join(str(op._schema) for op in ops.values()))
        else:
            missing = sorted(set(required or qualnames) - set(ops))
            report[key] = "not registered by the vendor library: " + ", ".join(missing)
    if FLASH_ATTN in providers:
        kernels, why = probe_flash_attn(backend.torch_device())
        if kernels is not None:
            for name, kernel in zip(("paged_prefill", "paged_decode"), kernels):
                register_kernel(name, FLASH_ATTN)(kernel)
            why = "registered (" + why + ")"
        report[f"{FLASH_ATTN}:paged_prefill,paged_decode"] = why
    if XFORMERS in providers:
        usable, why = probe_xformers(backend.torch_device())
        if usable:
            register_kernel("paged_prefill", XFORMERS)(xformers_paged_prefill)
            report[f"{XFORMERS}:paged_prefill"] = "registered (" + why + ")"
        else:
            report[f"{XFORMERS}:paged_prefill"] = why
    if TRITON in providers:
        _, report[TRITON] = install_triton_kernels(backend.torch_device())
    for key, status in report.items():
        logger.info("Kernel provider %s: %s", key, status)
    return report
