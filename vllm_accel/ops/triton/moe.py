"""Triton fused mixture-of-experts (contract: ``reference/moe.py``'s ``moe_experts``):
the routed experts as two grouped GEMMs over the (token, choice) pairs sorted by
expert, without a host synchronisation (so a card can capture it in a graph).

1. :func:`align_pairs` (torch on the device): the pairs sorted by local expert, each
   expert's run padded to ``BLOCK_M`` rows, and the expert of every ``BLOCK_M`` block.
   The number of blocks is bounded from the shapes alone (pairs, plus one partial
   block per expert that can have tokens), so nothing waits for the counts; blocks past
   the last expert's run, and pairs of experts another rank holds, do nothing.
2. ``_gate_up_kernel``: per block of pairs and tile of the intermediate width, the
   gate and up products of the block's expert (``w13`` rows ``n`` and ``I + n``) in one
   pass over ``x``, the biases, the gated activation; the result is written per pair.
3. ``_down_kernel``: per block and tile of the hidden width, the down product, bias and
   router weight; each pair writes its own float32 row, and the ``top_k`` rows of a
   token are summed after (deterministic: no atomics).

The router weight scales the expert's input instead (``apply_router_weight_on_input``,
Llama 4) by scaling the gate/up products before their biases, which is the same sum.
"""

import torch
import triton
import triton.language as tl

from vllm_accel.ops.reference.moe import GATED_ACTIVATIONS, local_slots
from vllm_accel.ops.triton.paged_attention import interpreted

#: pairs per block (tl.dot needs at least 16 rows)
BLOCK_M = 16
#: output columns per program, and the reduction step
BLOCK_N = 64
BLOCK_K = 64
NUM_WARPS = 4

_ACTIVATION_CODES = {name: code for code, name in enumerate(GATED_ACTIVATIONS)}


def align_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair id per padded row ``[R]`` -- ``M * top_k`` where a row is padding --,
    local expert per block ``[R // block_m]`` -- -1 past the last run) for the flattened
    ``[M, top_k]`` pairs, computed on their device with no host synchronisation."""
    device = topk_ids.device
    slots = local_slots(topk_ids, expert_map).reshape(-1)
    pairs = slots.numel()
    key = torch.where(slots < 0, num_local, slots)  # experts held elsewhere sort last
    counts = torch.bincount(key, minlength=num_local + 1)[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = run_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in sorted order
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    local = sorted_key < num_local
    expert = sorted_key.clamp(max=num_local - 1)
    rows = torch.arange(pairs, device=device) - first[expert] + run_start[expert]
    # an upper bound on the padded rows, from the shapes: every pair, plus a partial
    # block for each expert that can have one
    bound = -(-(pairs + min(num_local, pairs) * (block_m - 1)) // block_m) * block_m
    dump = bound  # the row that pairs of experts held elsewhere are written to
    pair_of_row = torch.full((bound + 1,), pairs, dtype=torch.int32, device=device)
    pair_of_row.scatter_(0, torch.where(local, rows, dump), order.to(torch.int32))
    block_start = torch.arange(0, bound, block_m, device=device)
    block_expert = torch.searchsorted(run_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return pair_of_row[:bound], block_expert


@triton.jit
def _activate(g, ACTIVATION: tl.constexpr):
    if ACTIVATION == 0:  # silu
        return g * tl.sigmoid(g)
    elif ACTIVATION == 1:  # gelu (erf)
        return 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:  # gelu, tanh approximation: tanh(u) = 2 sigmoid(2u) - 1
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g * tl.sigmoid(2.0 * u)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, bias_ptr, weights_ptr, pair_ptr, block_expert_ptr, act_ptr,
                    pairs, top_k, hidden, inter, stride_xm, stride_we, stride_wn,
                    stride_be, stride_am,
                    HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
                    ACTIVATION: tl.constexpr, IEEE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < pairs
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < hidden
        a = tl.load(x_ptr + token[:, None] * stride_xm + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + cols[None, :] * stride_wn + k[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (cols[None, :] + inter) * stride_wn + k[:, None],
                     mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:  # float32 products (float32 inputs; the interpreter's bf16 dot is wrong)
            a = a.to(tl.float32)
            gate += tl.dot(a, wg.to(tl.float32), input_precision="ieee")
            up += tl.dot(a, wu.to(tl.float32), input_precision="ieee")
        else:
            gate += tl.dot(a, wg)
            up += tl.dot(a, wu)
    if WEIGHT_ON_INPUT:
        w = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
        gate *= w[:, None]
        up *= w[:, None]
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_base + inter + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = _activate(gate, ACTIVATION) * up
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * stride_am + cols[None, :],
             act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(act_ptr, w_ptr, bias_ptr, weights_ptr, pair_ptr, block_expert_ptr, out_ptr,
                 pairs, hidden, inter, stride_am, stride_we, stride_wn, stride_be,
                 stride_om, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
                 IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    row_ok = pair < pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    offs_k = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < inter
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * stride_am + k[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :] * stride_wn + k[:, None],
                    mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        if IEEE:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok,
                       other=0.0).to(tl.float32)[None, :]
    if not WEIGHT_ON_INPUT:
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts held here over their routed tokens: ``[M, H]`` in x's dtype."""
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"MoE activation {activation!r} is not one of {GATED_ACTIVATIONS}")
    m, top_k = topk_ids.shape
    num_local, inter2, hidden = w13.shape
    inter = inter2 // 2
    pairs = m * top_k
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return out.view(m, hidden).to(x.dtype)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    pair_of_row, block_expert = align_pairs(topk_ids, expert_map, num_local)
    act = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or interpreted(_gate_up_kernel)
    blocks = block_expert.numel()
    b13 = w13_bias.contiguous() if w13_bias is not None else w13
    b2 = w2_bias.contiguous() if w2_bias is not None else w2
    _gate_up_kernel[(blocks, triton.cdiv(inter, BLOCK_N))](
        x, w13, b13, weights, pair_of_row, block_expert, act, pairs, top_k, hidden, inter,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0), act.stride(0),
        HAS_BIAS=w13_bias is not None, WEIGHT_ON_INPUT=apply_router_weight_on_input,
        ACTIVATION=_ACTIVATION_CODES[activation], IEEE=ieee, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    _down_kernel[(blocks, triton.cdiv(hidden, BLOCK_N))](
        act, w2, b2, weights, pair_of_row, block_expert, out, pairs, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0), out.stride(0),
        HAS_BIAS=w2_bias is not None, WEIGHT_ON_INPUT=apply_router_weight_on_input,
        IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS)
    return out.view(m, top_k, hidden).sum(dim=1).to(x.dtype)
