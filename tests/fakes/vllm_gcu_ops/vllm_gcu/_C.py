"""Fake vllm_gcu._C: Enflame's vLLM ops with their GCU schemas (notes section 1.6;
vllm-gcu's ``csrc/torch_bindings.cpp``).

Like the real extension, a schema is defined only if vLLM has not defined it
already (vllm-gcu's findSchema guard); implementations are registered for
PrivateUse1 (what vllm_accel checks for) and, because the fake's tensors live on
CPU, for CPU too -- replacing vLLM's CPU kernel in this (test) process. The math
is the reference math in float32 or float64; every call is counted in ``CALLS``.
"""

import collections

import torch

CALLS: collections.Counter = collections.Counter()

SCHEMAS = {
    "rms_norm": "rms_norm(Tensor! result, Tensor input, Tensor weight, float epsilon) -> ()",
    "fused_add_rms_norm": "fused_add_rms_norm(Tensor! input, Tensor! residual, Tensor weight, "
                          "float epsilon) -> ()",
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "rotary_embedding": "rotary_embedding(Tensor positions, Tensor! query, Tensor! key, "
                        "int head_size, Tensor cos_sin_cache, bool is_neox) -> ()",
}

_LIBRARIES: dict[tuple[str, str], torch.library.Library] = {}  # alive while loaded


def _register(namespace: str, schema: str, fn) -> None:
    """Defines ``namespace::schema`` unless vLLM did (vllm-gcu's findSchema guard) and
    implements it for PrivateUse1 and CPU."""
    name = schema.split("(", 1)[0]

    def library(kind):
        return _LIBRARIES.setdefault((namespace, kind), torch.library.Library(namespace, kind))

    try:
        torch._C._dispatch_find_schema_or_throw(f"{namespace}::{name}", "")
    except RuntimeError:
        library("FRAGMENT").define(schema)
    for key in ("PrivateUse1", "CPU"):
        library("IMPL").impl(name, fn, key)


def _norm(h, weight, eps):
    h = h.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(weight.dtype) * weight


def rms_norm(result, input, weight, epsilon):
    CALLS["rms_norm"] += 1
    result.copy_(_norm(input, weight, epsilon))


def fused_add_rms_norm(input, residual, weight, epsilon):
    CALLS["fused_add_rms_norm"] += 1
    h = input.float() + residual.float()
    residual.copy_(h)
    input.copy_(_norm(h, weight, epsilon))


def silu_and_mul(result, input):
    CALLS["silu_and_mul"] += 1
    d = input.shape[-1] // 2
    result.copy_(torch.nn.functional.silu(input[..., :d]) * input[..., d:])


def rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox,
                     rope_dim_offset=0, inverse=False):
    CALLS["rotary_embedding"] += 1
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.flatten().long()].float().chunk(2, dim=-1)
    for t in (query, key):
        x = t.view(positions.numel(), -1, head_size).float()
        r = x[..., :rot]
        if is_neox:
            x1, x2 = r.chunk(2, dim=-1)
        else:
            x1, x2 = r[..., 0::2], r[..., 1::2]
        c, s = cos[:, None], sin[:, None]
        o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
        r = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        t.copy_(torch.cat((r, x[..., rot:]), -1).view(t.shape))


for _name, _schema in SCHEMAS.items():
    _register("_C", _schema, globals()[_name])


# Decode attention over vLLM's paged-attention tensors (K [nb, Hkv, D/x, bs, x] with
# 16-byte x, V [nb, Hkv, D, bs]) read in the memory order Enflame's cache writer stores
# behind those shapes, [nb, Hkv, bs, D] (vllm-gcu's FlashAttention backend reads the same
# tensors that way), in Enflame's schema: float scales and zero-points after the
# block-sparse arguments, then out_scales and query_scales. The contract the adapter
# must keep is checked (shapes, int32 tables, an unquantized cache, no block-sparse).
def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables,
                       seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype,
                       k_scale, v_scale, tp_rank, blocksparse_local_blocks,
                       blocksparse_vert_stride, blocksparse_block_size,
                       blocksparse_head_sliding_step, k_zero, v_zero, out_scales,
                       query_scales):
    CALLS["paged_attention_v1"] += 1
    b, h, d = query.shape
    x = 16 // key_cache.element_size()
    nb = key_cache.shape[0]
    assert key_cache.shape == (nb, num_kv_heads, d // x, block_size, x), key_cache.shape
    assert value_cache.shape == (nb, num_kv_heads, d, block_size), value_cache.shape
    assert kv_cache_dtype == "auto" and (k_scale, v_scale, k_zero, v_zero) == (1, 1, 0, 0)
    assert blocksparse_vert_stride == 0 and out_scales is None and query_scales is None
    assert block_tables.dtype == seq_lens.dtype == torch.int32
    assert max_seq_len == int(seq_lens.max())
    k_mem = key_cache.contiguous().view(nb, num_kv_heads, block_size, d)
    v_mem = value_cache.contiguous().view(nb, num_kv_heads, block_size, d)
    for i, n in enumerate(seq_lens.tolist()):
        pos = torch.arange(n)
        blocks, offsets = block_tables[i, pos // block_size].long(), pos % block_size
        keys = k_mem[blocks, :, offsets].float()  # [n, Hkv, D]
        values = v_mem[blocks, :, offsets].float()
        for head in range(h):
            kv_head = head // (h // num_kv_heads)
            logits = keys[:, kv_head] @ query[i, head].float() * scale
            if alibi_slopes is not None:
                logits += alibi_slopes[head].float() * (pos - (n - 1))
            out[i, head] = (torch.softmax(logits, 0) @ values[:, kv_head]).to(out.dtype)


_register("_C", "paged_attention_v1(Tensor! out, Tensor query, Tensor key_cache, "
          "Tensor value_cache, int num_kv_heads, float scale, Tensor block_tables, "
          "Tensor seq_lens, int block_size, int max_seq_len, Tensor? alibi_slopes, "
          "str kv_cache_dtype, float k_scale, float v_scale, int tp_rank, "
          "int blocksparse_local_blocks, int blocksparse_vert_stride, "
          "int blocksparse_block_size, int blocksparse_head_sliding_step, float k_zero, "
          "float v_zero, Tensor? out_scales, Tensor? query_scales) -> ()", paged_attention_v1)


def context_attention_forward(q, k, v, o, key_cache, value_cache, block_tables,
                              subquery_start_loc, seq_lens_tensor, context_lens, max_query_len,
                              alibi_slopes, sliding_window):
    """vllm-gcu's V0 prefill with cached context: each request's new tokens (``q``, and
    ``k``/``v``, which the op takes directly) attend causally after its
    ``context_lens`` cached tokens, read from the paged tensors in the memory order of
    ``paged_attention_v1`` here; scaled by ``head_size ** -0.5`` (no scale argument);
    ALiBi ``slope * (j - i)``; a window keeps keys with ``i - j < sliding_window``."""
    CALLS["context_attention_forward"] += 1
    t, h, d = q.shape
    nb, hkv, _, block_size, x = key_cache.shape
    assert key_cache.shape == (nb, hkv, d // x, block_size, x) and x == 16 // q.element_size()
    assert value_cache.shape == (nb, hkv, d, block_size), value_cache.shape
    assert k.shape == v.shape == (t, hkv, d) and o.shape == q.shape
    index = (block_tables, subquery_start_loc, seq_lens_tensor, context_lens)
    assert all(i.dtype == torch.int32 for i in index), [i.dtype for i in index]
    q_lens = (seq_lens_tensor - context_lens).tolist()
    assert max_query_len == max(q_lens) and subquery_start_loc.tolist() == [
        sum(q_lens[:i]) for i in range(len(q_lens))]
    k_mem = key_cache.contiguous().view(nb, hkv, block_size, d)
    v_mem = value_cache.contiguous().view(nb, hkv, block_size, d)
    for i, (start, c, n) in enumerate(zip(subquery_start_loc.tolist(), context_lens.tolist(),
                                          q_lens)):
        pos = torch.arange(c)
        blocks, offsets = block_tables[i, pos // block_size].long(), pos % block_size
        keys = torch.cat((k_mem[blocks, :, offsets], k[start:start + n])).float()
        values = torch.cat((v_mem[blocks, :, offsets], v[start:start + n])).float()
        keys, values = (t_.repeat_interleave(h // hkv, 1) for t_ in (keys, values))
        logits = torch.einsum("qhd,khd->hqk", q[start:start + n].float(), keys) * d ** -0.5
        dist = (c + torch.arange(n))[:, None] - torch.arange(c + n)[None, :]  # i - j
        if alibi_slopes is not None:
            logits = logits - alibi_slopes.float()[:, None, None] * dist
        hidden = dist < 0
        if sliding_window:
            hidden |= dist >= sliding_window
        p = logits.masked_fill(hidden, float("-inf")).softmax(-1)
        o[start:start + n] = torch.einsum("hqk,khd->qhd", p, values).to(o.dtype)


_register("_C", "context_attention_forward(Tensor q, Tensor k, Tensor v, Tensor(a!) o, "
          "Tensor key_cache, Tensor value_cache, Tensor block_tables, "
          "Tensor subquery_start_loc, Tensor seq_lens_tensor, Tensor context_lens, "
          "int max_query_len, Tensor? alibi_slopes, int? sliding_window) -> ()",
          context_attention_forward)


# MoE routing under vLLM's _moe_C namespace, in the schema of the vLLM 0.6-0.8 forks
# Enflame ships (no renormalize argument): softmax top-k, float32 weights.


def topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output):
    CALLS["topk_softmax"] += 1
    probs = torch.softmax(gating_output.float(), dim=-1)
    values, ids = probs.topk(topk_weights.shape[1], dim=-1)
    topk_weights.copy_(values)
    topk_indices.copy_(ids.to(topk_indices.dtype))
    m = gating_output.shape[0]
    token_expert_indices.copy_(torch.arange(m * ids.shape[1], dtype=torch.int32).view(m, -1))


_register("_moe_C", "topk_softmax(Tensor! topk_weights, Tensor! topk_indices, "
          "Tensor! token_expert_indices, Tensor gating_output) -> ()", topk_softmax)


# MoE experts as vllm-gcu runs them: vLLM's alignment under _moe_C (pairs sorted by
# expert, each expert's run padded to whole blocks with the pair count; one expert id
# per block) and _C::fused_moe_kernel, whose schema vllm-gcu infers from its C++
# signature (unnamed arguments): C[pair] = A[pair // topk] @ B[expert]^T, times the
# pair's router weight when asked. The contract is checked (int32 ids, whole blocks,
# float32 weights, no bias), and so is that every pair was written.
def moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids,
                         num_tokens_post_pad, op="moe_align_block_size"):
    CALLS[op] += 1
    assert topk_ids.dtype == sorted_token_ids.dtype == experts_ids.dtype == torch.int32
    flat, pos = topk_ids.flatten().tolist(), 0
    for e in range(num_experts):
        pairs = [i for i, x in enumerate(flat) if x == e]
        if not pairs:
            continue
        run = -(-len(pairs) // block_size) * block_size
        sorted_token_ids[pos:pos + run] = torch.tensor(
            pairs + [len(flat)] * (run - len(pairs)), dtype=torch.int32)
        experts_ids[pos // block_size:(pos + run) // block_size] = e
        pos += run
    num_tokens_post_pad.fill_(pos)


def _expert_blocks(C, A, expert_weight, topk_weights, topk_ids, sorted_token_ids, expert_ids,
                   num_tokens_post_pad, mul_routed_weight, topk, block_size):
    """C[pair] = A[pair // topk] @ expert_weight(expert)^T (float64) per block of pairs."""
    assert topk_weights.dtype == torch.float32
    assert sorted_token_ids.dtype == expert_ids.dtype == torch.int32
    n_pairs, total = topk_ids.numel(), int(num_tokens_post_pad)
    assert total % block_size == 0
    rows = C.view(-1, C.shape[-1])
    written = torch.zeros(n_pairs, dtype=torch.bool)
    for block in range(total // block_size):
        pairs = sorted_token_ids[block * block_size:(block + 1) * block_size].long()
        pairs = pairs[pairs < n_pairs]
        out = A[pairs // topk].double() @ expert_weight(int(expert_ids[block])).T
        if mul_routed_weight:
            out = out * topk_weights.flatten()[pairs].double()[:, None]
        rows[pairs] = out.to(C.dtype)
        written[pairs] = True
    assert bool(written.all()), "pairs left unwritten"


def fused_moe_kernel(C, A, B, topk_weights, topk_ids, sorted_token_ids, expert_ids,
                     num_tokens_post_pad, mul_routed_weight, topk, block_size, bias):
    CALLS["fused_moe_kernel"] += 1
    assert bias is None
    _expert_blocks(C, A, lambda e: B[e].double(), topk_weights, topk_ids, sorted_token_ids,
                   expert_ids, num_tokens_post_pad, mul_routed_weight, topk, block_size)


# vllm-gcu's weight-only layouts (its moe_wna16 and gptq methods' conversions of GPTQ
# weights): 8-bit signed codes [N, K] with scales [N] (group size -1) or [G, N]; 4-bit
# bytes [N, K/2] (experts) or [K/2, N] (dense) holding, per block of 128 input columns,
# column j in the low nibble of byte j and column 64 + j in its high nibble, with scales
# [G, N] and zero points times scales [G, N] (weight = code * scale - zero term), in
# groups (vllm-gcu loads no per-channel 4-bit weights, so never passes -1 there).
# Scales are in the activation dtype. vllm-gcu's symmetric 4-bit experts call (no zero
# points) is not modelled: vllm_accel always passes them. W8A8 experts: int8 weights
# [E, N, K] with float32 scales [E, 1, N] (compressed-tensors' [E, N, 1] transposed),
# int8 activations with float32 per-token scales, group size 1.
def _per_column(t, group):
    return t.double().T.repeat_interleave(group, dim=1)


def _dequant_int8(codes, scales, gs):
    assert codes.dtype == torch.int8
    if gs == -1:
        assert scales.dim() == 1
        return codes.double() * scales.double()[:, None]
    assert scales.dim() == 2 and codes.shape[1] == gs * scales.shape[0]
    return codes.double() * _per_column(scales, gs)


def _dequant_int4(packed, scales, zero_terms, gs):
    """packed [N, K/2] bytes in the 128-column blocks -> float64 [N, K]."""
    assert packed.dtype == torch.uint8 and zero_terms is not None and gs > 0
    n, half = packed.shape
    blocks = packed.reshape(n, half // 64, 64)
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=2).reshape(n, 2 * half).double()
    assert scales.shape == zero_terms.shape == (2 * half // gs, n)
    return codes * _per_column(scales, gs) - _per_column(zero_terms, gs)


def _dequant_gcu_expert(B, B_scale, gs, B_zp, e):
    if B.dtype == torch.int8:
        assert B_zp is None, "vllm-gcu's 8-bit experts are symmetric"
        if gs != -1:
            assert gs in (64, 128)
        return _dequant_int8(B[e], B_scale[e], gs)
    assert B_zp.dim() == 3
    return _dequant_int4(B[e], B_scale[e], B_zp[e], gs)


def fused_moe_quant_kernel(C, A, B, A_scale, B_scale, gs, B_zp, topk_weights, topk_ids,
                           sorted_token_ids, expert_ids, num_tokens_post_pad,
                           mul_routed_weight, topk, block_size, bias, real_token_num):
    CALLS["fused_moe_quant_kernel"] += 1
    assert bias is None and real_token_num is None
    if A_scale is not None:  # W8A8: int8 A [M, K] with per-token scales, as vllm-gcu sends it
        assert A.dtype == B.dtype == torch.int8 and B_zp is None and gs == 1
        assert A_scale.dtype == B_scale.dtype == torch.float32 and A_scale.shape == (A.shape[0], 1)
        assert B_scale.shape == (B.shape[0], 1, B.shape[1])
        _expert_blocks(C, A.double() * A_scale.double(),
                       lambda e: B[e].double() * B_scale[e].double().reshape(-1, 1),
                       topk_weights, topk_ids, sorted_token_ids, expert_ids,
                       num_tokens_post_pad, mul_routed_weight, topk, block_size)
        return
    assert B_scale.dtype == A.dtype and (B_zp is None or B_zp.dtype == A.dtype)
    _expert_blocks(C, A, lambda e: _dequant_gcu_expert(B, B_scale, gs, B_zp, e), topk_weights,
                   topk_ids, sorted_token_ids, expert_ids, num_tokens_post_pad,
                   mul_routed_weight, topk, block_size)


_register("_moe_C", "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, "
          "Tensor! sorted_token_ids, Tensor! experts_ids, "
          "Tensor! num_tokens_post_pad) -> ()", moe_align_block_size)
# (vllm-gcu aligns with this one from 224 experts; the same contract)
_register("_moe_C", "sgl_moe_align_block_size(Tensor topk_ids, int num_experts, "
          "int block_size, Tensor! sorted_token_ids, Tensor! experts_ids, "
          "Tensor! num_tokens_post_pad) -> ()",
          lambda *args: moe_align_block_size(*args, op="sgl_moe_align_block_size"))
_register("_C", "fused_moe_kernel(Tensor(a!) _0, Tensor _1, Tensor _2, Tensor _3, Tensor _4, "
          "Tensor _5, Tensor _6, Tensor _7, bool _8, int _9, int _10, Tensor? _11) -> ()",
          fused_moe_kernel)
_register("_C", "fused_moe_quant_kernel(Tensor(a!) _0, Tensor _1, Tensor _2, Tensor? _3, "
          "Tensor _4, int _5, Tensor? _6, Tensor _7, Tensor _8, Tensor _9, Tensor _10, "
          "Tensor _11, bool _12, int _13, int _14, Tensor? _15, Tensor? _16) -> ()",
          fused_moe_quant_kernel)


# Dense weight-only GEMMs: gptq_gemm_gcu (4-bit; vllm-gcu passes a per-group index its
# kernel does not read) and weight_only_quant (8-bit, symmetric).
def gptq_gemm_gcu(a, b_q_weight, b_gptq_qzeros, b_gptq_scales, b_g_idx, bit, bias, group_size):
    CALLS["gptq_gemm_gcu"] += 1
    assert bit == 4 and a.dim() == 2 and b_gptq_scales.dtype == b_gptq_qzeros.dtype == a.dtype
    assert torch.equal(b_g_idx, torch.arange(b_gptq_scales.shape[0], dtype=torch.int32))
    w = _dequant_int4(b_q_weight.T, b_gptq_scales, b_gptq_qzeros, group_size)
    out = a.double() @ w.T
    return (out if bias is None else out + bias.double()).to(a.dtype)


def weight_only_quant(output, input, qweight, bias, scale, group_size):
    CALLS["weight_only_quant"] += 1
    assert scale.dtype == input.dtype
    out = input.double() @ _dequant_int8(qweight, scale, group_size).T
    output.copy_(out if bias is None else out + bias.double())


_register("_C", "gptq_gemm_gcu(Tensor a, Tensor b_q_weight, Tensor b_gptq_qzeros, "
          "Tensor b_gptq_scales, Tensor b_g_idx, int bit, Tensor? bias, int group_size) "
          "-> Tensor", gptq_gemm_gcu)
_register("_C", "weight_only_quant(Tensor! output, Tensor input, Tensor qweight, Tensor? bias, "
          "Tensor scale, int group_size) -> ()", weight_only_quant)



# W8A8: cutlass_scaled_mm with upstream vLLM's CUTLASS contract (vllm-gcu keeps its
# kernel class): int8 x [M, K] row-major, int8 weight [K, N] column-major, float32
# scales [M, 1] / [1] and [N, 1] / [1], K and N multiples of 16, bf16/fp16 out.
def cutlass_scaled_mm(out, x, weight, x_scale, w_scale, bias):
    CALLS["cutlass_scaled_mm"] += 1
    (m, k), n = x.shape, weight.shape[1]
    assert x.dtype == weight.dtype == torch.int8 and weight.stride(0) == 1
    assert k % 16 == 0 and n % 16 == 0 and out.dtype in (torch.bfloat16, torch.float16)
    assert x_scale.dtype == w_scale.dtype == torch.float32
    assert x_scale.shape in ((m, 1), (1,)) and w_scale.shape in ((n, 1), (1,))
    assert bias is None or bias.dtype == out.dtype
    y = (x.double() @ weight.double()) * x_scale.double().reshape(-1, 1) * (
        w_scale.double().reshape(1, -1))
    out.copy_(y if bias is None else y + bias.double())


_register("_C", "cutlass_scaled_mm(Tensor! out, Tensor x, Tensor weight, Tensor x_scale, "
          "Tensor w_scale, Tensor? bias) -> ()", cutlass_scaled_mm)

# Group-limited routing under _C (vllm-gcu's replacement for vLLM's grouped_topk):
# scores by softmax or sigmoid; a correction bias moves the choice, not the weights;
# groups scored by their best expert (with a bias: their best two).
def fused_grouped_topk(topk_weights, topk_ids, gating_output, topk, renormalize,
                       num_expert_group, topk_group, e_score_correction_bias, scoring_func):
    CALLS["fused_grouped_topk"] += 1
    logits = gating_output.float()
    scores = torch.softmax(logits, -1) if scoring_func == "softmax" else logits.sigmoid()
    biased = e_score_correction_bias is not None
    choice = scores + e_score_correction_bias.float() if biased else scores
    m, e = choice.shape
    grouped = choice.view(m, num_expert_group, e // num_expert_group)
    group_score = grouped.topk(2, -1).values.sum(-1) if biased else grouped.amax(-1)
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(topk_group, -1).indices, True)
    choice = choice.masked_fill(~keep.repeat_interleave(e // num_expert_group, 1), -1e30)
    ids = choice.topk(topk, -1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    topk_weights.copy_(weights)
    topk_ids.copy_(ids.to(topk_ids.dtype))


# vllm-gcu's schema: the bias is a plain Tensor, None passed where there is none
_register("_C", "fused_grouped_topk(Tensor! topk_weights, Tensor! topk_ids, "
          "Tensor gating_output, SymInt topk, bool renormalize, "
          "SymInt num_expert_group, SymInt topk_group, Tensor e_score_correction_bias, "
          "str scoring_func) -> ()", fused_grouped_topk)


# MLA in the schemas of vllm-gcu's bindings (csrc/torch_bindings.cpp): the latent cache
# write under _C_cache_ops, FlashMLA's decode under _flashmla_C with vLLM 0.10's
# descale arguments and no metadata op (vllm-gcu's get_mla_metadata returns None, None
# and those are passed on). FlashMLA's contract is checked (bf16/fp16, one KV head of
# 576 = 512 + 64, pages of 64, int32 lengths and tables) so an adapter that breaks it
# fails here.
def concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, kv_cache_dtype, scale):
    CALLS["concat_and_cache_mla"] += 1
    assert kv_cache_dtype == "auto" and kv_c.is_contiguous() and k_pe.is_contiguous()
    rows = kv_cache.view(-1, kv_cache.shape[-1])
    keep = slot_mapping >= 0
    rows[slot_mapping[keep].long()] = torch.cat((kv_c[keep], k_pe[keep]), -1).to(rows.dtype)


_register("_C_cache_ops", "concat_and_cache_mla(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, "
          "Tensor slot_mapping, str kv_cache_dtype, Tensor scale) -> ()", concat_and_cache_mla)


def fwd_kvcache_mla(q, kcache, head_size_v, seqlens_k, block_table, softmax_scale, is_causal,
                    tile_scheduler_metadata, num_splits, descale_q, descale_k):
    CALLS["fwd_kvcache_mla"] += 1
    b, s_q, h, d = q.shape
    assert s_q == 1 and q.dtype in (torch.bfloat16, torch.float16)
    assert tile_scheduler_metadata is None and num_splits is None  # as vllm-gcu calls it
    assert descale_q is None and descale_k is None
    assert kcache.dtype == q.dtype and kcache.shape[1:] == (64, 1, d) and d == 576
    assert head_size_v == 512 and seqlens_k.dtype == block_table.dtype == torch.int32
    rows = kcache.view(-1, d).float()
    out = torch.zeros(b, 1, h, head_size_v, dtype=q.dtype)
    lse = torch.full((b, h, 1), float("inf"))
    for i, n in enumerate(seqlens_k.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        latent = rows[block_table[i, pos // 64].long() * 64 + pos % 64]
        scores = q[i, 0].float() @ latent.T * softmax_scale
        out[i, 0] = (torch.softmax(scores, -1) @ latent[:, :head_size_v]).to(q.dtype)
        lse[i, :, 0] = torch.logsumexp(scores, -1)
    return out, lse


_register("_flashmla_C", "fwd_kvcache_mla(Tensor! q, Tensor kcache, int head_size_v, "
          "Tensor seqlens_k, Tensor block_table, float softmax_scale, bool is_causal, "
          "Tensor tile_scheduler_metadata, Tensor num_splits, Tensor? descale_q, "
          "Tensor? descale_k) -> (Tensor, Tensor)", fwd_kvcache_mla)
