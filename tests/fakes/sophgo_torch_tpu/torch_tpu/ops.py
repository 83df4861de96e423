"""Fake torch.ops.my_ops: profiling hooks, rmsnorm_forward, fused_moe_fused_experts,
paged_attention_v3 and paged_latent_attention (the schemas of torch_tpu's C++
signatures; calls counted)."""

import collections
import os

import torch

# Kept on torch so a re-import (in-process tests) reuses the registered ops' state.
if not hasattr(torch, "_fake_my_ops_state"):
    torch._fake_my_ops_state = (collections.Counter(), [])
CALLS, PROFILE = torch._fake_my_ops_state
_REGISTERED = hasattr(torch, "_fake_my_ops_lib")
_lib = torch.library.Library("my_ops", "FRAGMENT") if not _REGISTERED else None
if not _REGISTERED:
    torch._fake_my_ops_lib = _lib
    _lib.define("enable_profile(int? max_record_num, int? mode) -> ()")
    _lib.define("disable_profile() -> ()")
    _lib.define("rmsnorm_forward(Tensor input, Tensor? scale, Tensor? bias, "
                "Tensor(a!) output, int axis, float eps) -> ()")
    _lib.define("fused_moe_fused_experts(Tensor(a!) output, Tensor input, Tensor? output_sample, "
                "Tensor? input_sample, Tensor gate_weights, Tensor up_weights, "
                "Tensor down_weights, Tensor? gate_scales, Tensor? up_scales, "
                "Tensor? down_scales, Tensor select_experts, Tensor routing_weights, "
                "Tensor? num_select_experts, Tensor? select_experts_middle, "
                "Tensor? routing_weights_middle, int blocksize, int num_experts, "
                "int num_experts_per_tok, bool use_grouped_topk, int num_expert_group, "
                "int topk_group, Tensor? silu, Tensor? sigmoid, Tensor? m0, "
                "bool save_mid_res) -> ()")
    _lib.define("paged_attention_v3(Tensor(a!) output, Tensor query, Tensor key, Tensor value, "
                "Tensor kcache, Tensor vcache, Tensor? pos_cos, Tensor? pos_sin, "
                "Tensor input_lengths, Tensor cache_lengths, Tensor save_slots, "
                "Tensor block_tables, Tensor? mask, float softmax_scale, int max_seqlen, "
                "int stage) -> ()")
    _lib.define("paged_latent_attention(Tensor(a!) OUT, Tensor Q, Tensor KV, Tensor PE, "
                "Tensor WUQ, Tensor WUKV, Tensor(b!) KVcache, Tensor(c!) PEcache, Tensor cos, "
                "Tensor sin, Tensor? block_table, Tensor save_slots, Tensor? KVU, "
                "Tensor? mask, Tensor input_lengths, Tensor cache_lengths, int head, "
                "int generate_token, int q_lora_rank, int kv_lora_rank, "
                "int qk_nope_head_dim, int qk_rope_head_dim, int v_head_dim, int mask_size, "
                "int max_paged_block_num, int paged_cache_block_size, float C, "
                "int attention_mode) -> Tensor")


def enable_profile(max_record_num=None, mode=None):
    PROFILE.append(("enable", max_record_num, mode))


def disable_profile():
    PROFILE.append(("disable",))


def rmsnorm_forward(input, scale, bias, output, axis, eps):
    CALLS["rmsnorm_forward"] += 1
    h = input.float()
    h = h * torch.rsqrt(h.pow(2).mean(axis, keepdim=True) + eps)
    if scale is not None:
        h = h * scale.float()
    if bias is not None:
        h = h + bias.float()
    output.copy_(h)


def fused_moe_fused_experts(output, input, output_sample, input_sample, gate_weights,
                            up_weights, down_weights, gate_scales, up_scales, down_scales,
                            select_experts, routing_weights, num_select_experts,
                            select_experts_middle, routing_weights_middle, blocksize,
                            num_experts, num_experts_per_tok, use_grouped_topk,
                            num_expert_group, topk_group, silu, sigmoid, m0, save_mid_res):
    """Each (token, choice) pair's unweighted SiLU-gated expert output into
    ``output[M, top_k, H]``; gate/up/down ``[E, I, H]``, unquantized only here."""
    CALLS["fused_moe_fused_experts"] += 1
    assert select_experts.dtype == torch.int32, "select_experts must be int32 dtype"
    assert down_weights.is_contiguous(), "down_weights must be contiguous [E, I, H]"
    x = input.float()
    for t in range(x.shape[0]):
        for j in range(num_experts_per_tok):
            e = int(select_experts[t, j])
            g = gate_weights[e].float() @ x[t]
            u = up_weights[e].float() @ x[t]
            output[t, j] = (torch.nn.functional.silu(g) * u) @ down_weights[e].float()


def paged_attention_v3(output, query, key, value, kcache, vcache, pos_cos, pos_sin,
                       input_lengths, cache_lengths, save_slots, block_tables, mask,
                       softmax_scale, max_seqlen, stage):
    """torch_tpu's contract as its C++ and vllm-tpu's caller show it: K/V caches
    ``[num_blocks, block_size, Hkv, D]`` (non-contiguous ones are copied first, so
    writes to them are lost); each request's ``input_lengths`` new tokens (K/V written
    at ``save_slots``) attend causally after its ``cache_lengths`` cached ones (read
    through ``block_tables``; the new ones from ``key``/``value``); lengths int32 on
    the host. No RoPE or mask here: the
    adapter passes neither. ``FAKE_SOPHGO_CACHE_ORDER=heads`` reads the caches as
    ``[num_blocks, Hkv, block_size, D]`` instead (a build the probe must refuse)."""
    CALLS["paged_attention_v3"] += 1
    assert pos_cos is None and pos_sin is None and mask is None, "the fake models no RoPE/mask"
    for t in (input_lengths, cache_lengths):
        assert t.device.type == "cpu" and t.dtype == torch.int32, "lengths: int32 on the host"
    assert block_tables.dtype == torch.int32, "block_tables must be int32 dtype"
    assert save_slots.dtype == torch.int32, "save_slots: int32, as vllm-tpu's slot_mapping"
    inputs, cached = input_lengths.tolist(), cache_lengths.tolist()
    assert stage in (2, 3) and (stage == 2 or set(inputs) == {1}), stage
    # what the op computes itself when given 0
    assert max_seqlen in (0, max(n + c for n, c in zip(inputs, cached))), max_seqlen
    if not (kcache.is_contiguous() and vcache.is_contiguous()):
        kcache, vcache = kcache.contiguous(), vcache.contiguous()
    nb, bs, hkv, d = kcache.shape
    assert nb >= sum(-(-n // bs) for n in inputs), "KVCache block_num too small"
    if os.environ.get("FAKE_SOPHGO_CACHE_ORDER") == "heads":
        kcache, vcache = (c.view(nb, hkv, bs, d).transpose(1, 2) for c in (kcache, vcache))
    slots = save_slots.long().flatten()
    kcache.view(-1, hkv, d)[slots] = key.to(kcache.dtype)
    vcache.view(-1, hkv, d)[slots] = value.to(vcache.dtype)
    group = query.shape[1] // hkv
    start = 0
    for i, (n, c) in enumerate(zip(inputs, cached)):
        total = n + c
        blocks = block_tables[i, :-(-total // bs)].long()
        # cached tokens from the cache, the new ones from key/value (as a fused kernel
        # would take them): slots that miss the new tokens' places show
        k = torch.cat((kcache[blocks].reshape(-1, hkv, d)[:c], key[start:start + n]))
        v = torch.cat((vcache[blocks].reshape(-1, hkv, d)[:c], value[start:start + n]))
        k, v = (t.float().repeat_interleave(group, 1) for t in (k, v))
        q = query[start:start + n].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
        later = torch.arange(total)[None, :] > (c + torch.arange(n))[:, None]
        p = s.masked_fill(later, float("-inf")).softmax(-1)
        output[start:start + n] = torch.einsum("hqk,khd->qhd", p, v).to(output.dtype)
        start += n


def _deinterleaved_rope(x, cos, sin):
    """torch-tpu test/mla.py's ``apply_rope``: the pairs split into halves (even dims,
    then odd), then rotated neox-style by ``cos``/``sin`` ``[T, 1, R]``."""
    t, heads, rope = x.shape
    if os.environ.get("FAKE_SOPHGO_MLA_ROPE") != "halves":
        x = x.view(t, heads, rope // 2, 2).transpose(2, 3).reshape(t, heads, rope)
    rotated = torch.cat((-x[..., rope // 2:], x[..., :rope // 2]), dim=-1)
    return x * cos + rotated * sin


def paged_latent_attention(OUT, Q, KV, PE, WUQ, WUKV, KVcache, PEcache, cos, sin,
                           block_table, save_slots, KVU, mask, input_lengths, cache_lengths,
                           head, generate_token, q_lora_rank, kv_lora_rank, qk_nope_head_dim,
                           qk_rope_head_dim, v_head_dim, mask_size, max_paged_block_num,
                           paged_cache_block_size, C, attention_mode):
    """torch-tpu's MLA (``Mla.cpp``) as its CPU model ``python/test/mla.py`` (MLACpu)
    computes it, per request (``input_lengths`` new tokens after ``cache_lengths``
    cached ones, int32 on the host): queries ``Q @ WUQ.T`` per head ``[nope | rope]``,
    the rope part de-interleaved and rotated, the nope part absorbed by ``WUKV``'s key
    rows; the new latents ``KV`` and rotated ``PE`` written into ``KVcache`` ``[blocks,
    BS, L]`` / ``PEcache`` ``[blocks, BS, R]`` (stage 2: through ``block_table`` after the
    cached tokens; stage 3: at ``save_slots``); causal attention over the request's
    cached + new latents; ``WUKV``'s value rows; ``OUT`` ``[T, H, V]``. Stage 2 with more
    than one new token needs ``KVU`` (the decompressed K/V, ``max new + max cached``
    rows, as test/mla.py sizes it). ``FAKE_SOPHGO_MLA_ROPE=halves`` skips the
    de-interleaving (a build the check must refuse); ``FAKE_SOPHGO_MLA_DECODE=no_context``
    makes stage 3 ignore the cached tokens (a build whose decode stage must not be
    used)."""
    CALLS["paged_latent_attention"] += 1
    for t in (input_lengths, cache_lengths):
        assert t.device.type == "cpu" and t.dtype == torch.int32 and t.is_contiguous(), \
            "MLA input lengths must be int32, contiguous, on the host"
    assert block_table is not None and block_table.dtype == torch.int32
    assert mask is None and generate_token == 1, "the fake models no mask or MTP"
    assert KVcache.is_contiguous() and PEcache.is_contiguous(), "caches: contiguous"
    inputs, cached = input_lengths.tolist(), cache_lengths.tolist()
    heads, nope, rope, lora = head, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank
    assert WUQ.shape == (heads * (nope + rope), q_lora_rank) == (WUQ.shape[0], Q.shape[1])
    assert WUKV.shape == (heads * (nope + v_head_dim), lora) and KV.shape[1] == lora
    assert cos.shape == sin.shape == (Q.shape[0], 1, rope), "cos/sin: [T, 1, R]"
    assert KVcache.shape[1] == PEcache.shape[1] == paged_cache_block_size
    assert block_table.shape[1] == max_paged_block_num
    if attention_mode == 3:
        assert set(inputs) == {1} and KVU is None and mask_size == 0
        assert save_slots.dtype == torch.int32 and save_slots.numel() == Q.shape[0]
    else:
        assert attention_mode == 2, attention_mode
        assert mask_size == max(n + c for n, c in zip(inputs, cached))
        if max(inputs) > 1:
            assert KVU is not None and KVU.shape[0] >= max(inputs) + max(cached), "KVU rows"
            assert KVU.shape[1:] == (heads, nope + v_head_dim)
    t = Q.shape[0]
    q = (Q.float() @ WUQ.float().T).view(t, heads, nope + rope)
    q_pe = _deinterleaved_rope(q[..., nope:], cos.float(), sin.float())
    w = WUKV.float().view(heads, nope + v_head_dim, lora)
    q_nope = torch.einsum("thp,hpl->thl", q[..., :nope], w[:, :nope])
    k_pe = _deinterleaved_rope(PE.float()[:, None], cos.float(), sin.float())[:, 0]
    bs = paged_cache_block_size
    if attention_mode == 3 and os.environ.get("FAKE_SOPHGO_MLA_DECODE") == "no_context":
        cached = [0] * len(cached)  # a build whose decode stage ignores cache_lengths
    start = 0
    for i, (n, c) in enumerate(zip(inputs, cached)):
        pos = torch.arange(c, c + n)
        if attention_mode == 3:
            slots = save_slots[start:start + n].long()
        else:
            slots = block_table[i, pos // bs].long() * bs + pos % bs
        KVcache.view(-1, lora)[slots] = KV[start:start + n].to(KVcache.dtype)
        PEcache.view(-1, rope)[slots] = k_pe[start:start + n].to(PEcache.dtype)
        total = torch.arange(c + n)
        rows = block_table[i, total // bs].long() * bs + total % bs
        latent = KVcache.view(-1, lora)[rows].float()
        pe = PEcache.view(-1, rope)[rows].float()
        s = (torch.einsum("qhl,kl->hqk", q_nope[start:start + n], latent)
             + torch.einsum("qhr,kr->hqk", q_pe[start:start + n], pe)) * C
        later = total[None, :] > (c + torch.arange(n))[:, None]
        p = s.masked_fill(later, float("-inf")).softmax(-1)
        o = torch.einsum("hqk,kl->qhl", p, latent)
        OUT[start:start + n] = torch.einsum("qhl,hvl->qhv", o, w[:, nope:]).to(OUT.dtype)
        start += n
    return OUT


if not _REGISTERED:
    _lib.impl("enable_profile", enable_profile, "CompositeExplicitAutograd")
    _lib.impl("disable_profile", disable_profile, "CompositeExplicitAutograd")
    for _key in ("PrivateUse1", "CPU"):
        _lib.impl("rmsnorm_forward", rmsnorm_forward, _key)
        _lib.impl("fused_moe_fused_experts", fused_moe_fused_experts, _key)
        _lib.impl("paged_attention_v3", paged_attention_v3, _key)
        _lib.impl("paged_latent_attention", paged_latent_attention, _key)
