"""Triton fused mixture-of-experts (contract: ``reference/moe.py``'s ``moe_experts``):
the routed experts as two grouped GEMMs over the (token, choice) pairs sorted by
expert, without a host synchronisation (so a card can capture it in a graph).

1. :func:`align_pairs` (one Triton program up to ``ALIGN_MAX_PAIRS`` pairs, torch ops
   beyond): the pairs sorted by local expert, each expert's run padded to ``BLOCK_M``
   rows, and the expert of every ``BLOCK_M`` block.
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

Quantized experts (``moe_quant_experts``: GPTQ, AWQ, compressed-tensors W4A16/W8A16)
run the same kernels on the weight-only resident layout of the dense linears
(``quant/packed.py``: codes ``[N, K/2]`` nibbles, even column low, or ``[N, K]`` bytes;
scales and zero points ``[N, G]``). Each 4-bit byte is loaded once, its nibbles
multiplied with the even and odd input columns; where a reduction step lies in one group,
the products run on the integer codes and the group's scale is applied to their sum,
else each weight is dequantized as it is loaded (``_expert_step``). The experts'
tensors are stacked ``[E, ...]`` once, on the first call, and each expert's module then
holds views of the stack, so memory does not grow; act-order permutations and
prepared layouts go to the next provider.
"""

import logging
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from vllm_accel.ops.reference.moe import GATED_ACTIVATIONS, local_slots
from vllm_accel.ops.registry import fallback_kernel
from vllm_accel.ops.triton.paged_attention import interpreted

# (vLLM's logger configuration reaches children of "vllm": vllm_accel.logger's naming,
# without importing vLLM, which this module runs without)
logger = logging.getLogger("vllm." + __name__)

#: pairs per block (tl.dot needs at least 16 rows)
BLOCK_M = 16


class Tiles(NamedTuple):
    """One kernel's launch: output columns per program, reduction step, warps and
    software-pipeline stages."""
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


#: the launch for every kernel and weight kind (128-wide steps rather than 64: W4A16
#: experts 70 instead of 114 us at batch 1, bf16 ones 40 instead of 44; H100)
DEFAULT_TILES = Tiles(64, 128, 4, 3)
#: launches that beat the default, by (kernel, weight bits): ``(max pairs, tiles)``
#: rows in increasing order, from ``benchmarks/triton_moe_tiles.py``. None so far: on an
#: H100 (``benchmarks/results/triton_moe_tiles_h100.json``) no launch beat the default
#: for bf16 experts by more than 2%, and the batches where 4-bit ones gained (82.4 ->
#: 73.9 us at 8 pairs, 383.9 -> 355.8 us at 128) now go to the matrix-vector kernels
TILES: dict[tuple[str, int], list[tuple[int, Tiles]]] = {}


def tiles_for(kernel: str, bits: int, pairs: int) -> Tiles:
    """The launch of ``kernel`` ("gate_up" or "down") over ``pairs`` routed pairs."""
    for max_pairs, tiles in TILES.get((kernel, bits), ()):
        if pairs <= max_pairs:
            return tiles
    return DEFAULT_TILES


#: routed pairs up to which each pair of quantized experts is a program of its own that
#: reads its expert's codes as matrix-vector products: no alignment, and no 16-row
#: tensor-core tiles, which a dequantizing loop fills through shared memory. H100,
#: Qwen3-30B-A3B's layer (``benchmarks/results/triton_moe_gemv_h100.json``), 4-bit
#: experts: 81.4 -> 35.6 us at 8 pairs (bf16 experts 39.7), 504.0 -> 492.6 at 256,
#: 565.3 tiled but 945.2 at 512; 8-bit alike. bf16 experts gained at most 2% from them
#: (H200), so they stay tiled
GEMV_MAX_PAIRS = 256
#: the matrix-vector kernels' launch by weight bits (a step holds whole groups, or lies
#: in one), from ``benchmarks/triton_moe_tiles.py --gemv``
GEMV_TILES = {4: Tiles(8, 256, 1, 3), 8: Tiles(16, 512, 2, 3)}
#: their launch under Triton's interpreter (CPU tests), which runs each program in
#: Python: the same code and masks in 16x fewer programs (an engine test's tiny
#: Mixtral 175 s with the GPU's launch)
INTERPRETED_GEMV_TILES = Tiles(128, 128, 4, 2)

#: the kernels' gated activations (``reference/moe.py``'s first three; swigluoai's
#: interleaved halves are not in them)
_ACTIVATION_CODES = {name: code for code, name in enumerate(GATED_ACTIVATIONS[:3])}


#: pairs up to which one program aligns them (decode batches, small prefill chunks):
#: one launch instead of ~40 small torch kernels (65 of the 113 us of a batch-1
#: Qwen3-30B-A3B layer on an H100, and ~1 ms of host time when eager)
ALIGN_MAX_PAIRS = 4096


def _padded_rows(pairs: int, num_local: int, block_m: int) -> int:
    """An upper bound on the padded rows, from the shapes: every pair, plus a partial
    block for each expert that can have one."""
    return -(-(pairs + min(num_local, pairs) * (block_m - 1)) // block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, map_ptr, shift_ptr, pair_ptr, block_ptr, pairs, num_local, rows,
                  HAS_MAP: tl.constexpr, P_PAD: tl.constexpr, E_PAD: tl.constexpr,
                  R_PAD: tl.constexpr, NB_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """:func:`align_pairs` in one program: the pairs sorted by (local expert, pair id),
    each sorted position moved by its expert's run start minus its first position."""
    p = tl.arange(0, P_PAD)
    valid = p < pairs
    ids = tl.load(ids_ptr + p, mask=valid, other=0)
    if HAS_MAP:
        slot = tl.load(map_ptr + ids, mask=valid, other=-1)
    else:
        slot = ids
    key = tl.where(valid & (slot >= 0), slot, num_local).to(tl.int32)  # elsewhere: last
    e = tl.arange(0, E_PAD)
    counts = tl.where(e < num_local, tl.histogram(key, E_PAD), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    shift = tl.cumsum(padded, 0) - padded - (tl.cumsum(counts, 0) - counts)
    tl.store(shift_ptr + e, shift)
    r = tl.arange(0, R_PAD)
    tl.store(pair_ptr + r, pairs, mask=r < rows)
    b = tl.arange(0, NB_PAD)
    tl.store(block_ptr + b, -1, mask=b < rows // BLOCK_M)
    tl.debug_barrier()  # the shifts and the fills are written for every thread
    order = tl.sort(key * P_PAD + p)
    expert = order // P_PAD
    local = expert < num_local
    row = p + tl.load(shift_ptr + expert, mask=local, other=0)
    tl.store(pair_ptr + row, order % P_PAD, mask=local)
    # every block of a run begins with a pair (a run is its pairs rounded up)
    tl.store(block_ptr + row // BLOCK_M, expert, mask=local & (row % BLOCK_M == 0))


def align_pairs(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_local: int,
                block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair id per padded row ``[R]`` -- ``M * top_k`` where a row is padding --,
    local expert per block ``[R // block_m]`` -- -1 past the last run) for the flattened
    ``[M, top_k]`` pairs, computed on their device with no host synchronisation: in
    one program up to :data:`ALIGN_MAX_PAIRS` pairs, else with torch ops."""
    pairs = topk_ids.numel()
    if not 0 < pairs <= ALIGN_MAX_PAIRS:
        return align_pairs_torch(topk_ids, expert_map, num_local, block_m)
    device = topk_ids.device
    rows = _padded_rows(pairs, num_local, block_m)
    pair_of_row = torch.empty(rows, dtype=torch.int32, device=device)
    block_expert = torch.empty(rows // block_m, dtype=torch.int32, device=device)
    e_pad = triton.next_power_of_2(num_local + 1)
    shift = torch.empty(e_pad, dtype=torch.int32, device=device)
    ids = topk_ids.contiguous()
    _align_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, shift, pair_of_row, block_expert,
        pairs, num_local, rows, HAS_MAP=expert_map is not None,
        P_PAD=max(16, triton.next_power_of_2(pairs)), E_PAD=e_pad,
        R_PAD=triton.next_power_of_2(rows), NB_PAD=max(2, triton.next_power_of_2(rows // block_m)),
        BLOCK_M=block_m, num_warps=4)
    return pair_of_row, block_expert


def align_pairs_torch(topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
                      num_local: int, block_m: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align_pairs` with torch ops (any number of pairs)."""
    device = topk_ids.device
    slots = local_slots(topk_ids, expert_map).reshape(-1)
    pairs = slots.numel()
    key = torch.where(slots < 0, num_local, slots)  # experts held elsewhere sort last
    # (not bincount: on a GPU it reads the largest id back to the host, which a
    # graph capture refuses and an eager call waits for)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    run_end = torch.cumsum(padded, 0)
    run_start = run_end - padded
    first = torch.cumsum(counts, 0) - counts  # each expert's first pair in sorted order
    order = torch.argsort(key, stable=True)
    sorted_key = key[order]
    local = sorted_key < num_local
    expert = sorted_key.clamp(max=num_local - 1)
    rows = torch.arange(pairs, device=device) - first[expert] + run_start[expert]
    bound = _padded_rows(pairs, num_local, block_m)
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
def _scale_zero(s_base, z_base, n, g, mask, stride_sn, BITS: tl.constexpr,
                HAS_ZEROS: tl.constexpr):
    """The scale and zero point of rows ``n`` in groups ``g`` (float32; the zero point
    ``2**(BITS-1)`` where the format is symmetric)."""
    scale = tl.load(s_base + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_base + n * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    else:
        zero = 1 << (BITS - 1)
    return scale, zero


@triton.jit
def _dequant(code, s_base, z_base, n, k, mask, stride_sn, group_size, BITS: tl.constexpr,
             HAS_ZEROS: tl.constexpr):
    """Codes ``[K, N]`` (float32) dequantized weight by weight: groups smaller than a
    reduction step, or not aligned to one."""
    scale, zero = _scale_zero(s_base, z_base, n, k // group_size, mask, stride_sn, BITS,
                              HAS_ZEROS)
    return (code - zero) * scale


@triton.jit
def _biased_codes(code, CODE_BIAS: tl.constexpr):
    """Integer codes as ``CODE_BIAS + code`` in the activations' dtype without a
    conversion instruction: the code ORed into the mantissa of 128 (bf16: spacing 1 from
    128 to 256) or 1024 (fp16: spacing 1 up to 2048); plain float32 codes for
    ``CODE_BIAS`` 0."""
    if CODE_BIAS == 128:
        out = (code.to(tl.uint16) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif CODE_BIAS == 1024:
        out = (code.to(tl.uint16) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        out = code.to(tl.float32)
    return out


@triton.jit
def _group_step(acc, part, a_sum, s_base, z_base, n, n_ok, group, stride_sn,
                BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, CODE_BIAS: tl.constexpr):
    """``acc`` plus a reduction step of one group: ``part`` is ``A @ (CODE_BIAS + codes)``
    and ``a_sum`` A's row sums over the step, so the step's product is
    ``(part - a_sum * (CODE_BIAS + zero)) * scale``, scaled once per output column."""
    scale, zero = _scale_zero(s_base, z_base, n, group, n_ok, stride_sn, BITS, HAS_ZEROS)
    return acc + (part - a_sum[:, None] * (zero + CODE_BIAS)) * scale


@triton.jit
def _expert_step(acc, a_rows, a_ok, w_base, s_base, z_base, n, n_ok, k0, width, stride_wn,
                 stride_sn, group_size, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
                 GROUP_STEPS: tl.constexpr, CODE_BIAS: tl.constexpr, IEEE: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    """``acc + A[:, k0:k0+BLOCK_K] @ W[n, k0:k0+BLOCK_K].T``, ``a_rows`` pointing to the
    ``[M, 1]`` rows of A and ``n`` the ``[1, N]`` rows of W (the weight itself for
    ``BITS`` 0, else its codes).

    A 4-bit byte holds columns 2j (low nibble) and 2j+1: each byte is loaded once, and
    A's even and odd columns meet its two nibbles in two products of half the depth.
    Where a step lies in one group (``GROUP_STEPS``), the products run on the codes
    themselves, offset by ``CODE_BIAS`` (``_biased_codes``: no conversion instruction,
    whose throughput bounds a dequantizing loop on GPUs), and the zero point and scale
    apply once per column to their float32 sum (``_group_step``). Otherwise each weight is
    dequantized as it is loaded."""
    if BITS == 4:
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        even_ok = 2 * j < width
        odd_ok = 2 * j + 1 < width
        byte = tl.load(w_base + n * stride_wn + j[:, None], mask=n_ok & even_ok[:, None],
                       other=0)
        a_even = tl.load(a_rows + 2 * j[None, :], mask=a_ok & even_ok[None, :], other=0.0)
        a_odd = tl.load(a_rows + 2 * j[None, :] + 1, mask=a_ok & odd_ok[None, :], other=0.0)
        if GROUP_STEPS:
            part = _dot(tl.zeros(acc.shape, tl.float32), a_even,
                        _biased_codes(byte & 0xF, CODE_BIAS), IEEE)
            part = _dot(part, a_odd, _biased_codes(byte >> 4, CODE_BIAS), IEEE)
            a_sum = tl.sum(a_even.to(tl.float32), 1) + tl.sum(a_odd.to(tl.float32), 1)
            out = _group_step(acc, part, a_sum, s_base, z_base, n, n_ok, k0 // group_size,
                              stride_sn, BITS, HAS_ZEROS, CODE_BIAS)
        else:
            w_even = _dequant((byte & 0xF).to(tl.float32), s_base, z_base, n, 2 * j[:, None],
                              n_ok & even_ok[:, None], stride_sn, group_size, BITS, HAS_ZEROS)
            w_odd = _dequant((byte >> 4).to(tl.float32), s_base, z_base, n,
                             2 * j[:, None] + 1, n_ok & odd_ok[:, None], stride_sn,
                             group_size, BITS, HAS_ZEROS)
            out = _dot(_dot(acc, a_even, w_even, IEEE), a_odd, w_odd, IEEE)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        a = tl.load(a_rows + k[None, :], mask=a_ok & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n * stride_wn + k[:, None], mask=n_ok & k_ok[:, None], other=0)
        if BITS == 0:
            out = _dot(acc, a, w, IEEE)
        elif GROUP_STEPS:
            part = _dot(tl.zeros(acc.shape, tl.float32), a, _biased_codes(w, CODE_BIAS),
                        IEEE)
            out = _group_step(acc, part, tl.sum(a.to(tl.float32), 1), s_base, z_base, n,
                              n_ok, k0 // group_size, stride_sn, BITS, HAS_ZEROS, CODE_BIAS)
        else:
            out = _dot(acc, a, _dequant(w.to(tl.float32), s_base, z_base, n, k[:, None],
                                        n_ok & k_ok[:, None], stride_sn, group_size, BITS,
                                        HAS_ZEROS), IEEE)
    return out


@triton.jit
def _block_pairs(pair_ptr, block, pairs, BLOCK_M: tl.constexpr):
    """A block's padded rows, the pair each holds and which rows are real pairs."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ptr + rows)
    return rows, pair, pair < pairs


@triton.jit
def _expert_tensors(expert, w_ptr, s_ptr, z_ptr, stride_we, stride_se):
    """Pointers to ``expert``'s weight, scales and zero points."""
    e = expert.to(tl.int64)
    return w_ptr + e * stride_we, s_ptr + e * stride_se, z_ptr + e * stride_se


@triton.jit
def _dot(acc, a, w, IEEE: tl.constexpr):
    """``acc + a @ w``: float32 products where ``IEEE`` (float32 inputs, or the
    interpreter, whose bf16 dot is wrong), else in the activations' dtype."""
    if IEEE:
        return acc + tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(a, w.to(a.dtype))


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, weights_ptr, pair_ptr,
                    block_expert_ptr, act_ptr, pairs, top_k, hidden, inter, stride_xm,
                    stride_we, stride_wn, stride_se, stride_sn, group_size, stride_be,
                    stride_am, HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
                    ACTIVATION: tl.constexpr, IEEE: tl.constexpr, BITS: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, GROUP_STEPS: tl.constexpr,
                    CODE_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows, pair, row_ok = _block_pairs(pair_ptr, block, pairs, BLOCK_M)
    token = tl.where(row_ok, pair // top_k, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_base, s_base, z_base = _expert_tensors(expert, w_ptr, s_ptr, z_ptr, stride_we, stride_se)
    x_rows = x_ptr + token[:, None] * stride_xm
    n, n_ok = cols[None, :], col_ok[None, :]
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        gate = _expert_step(gate, x_rows, row_ok[:, None], w_base, s_base, z_base, n, n_ok,
                            k0, hidden, stride_wn, stride_sn, group_size, BITS, HAS_ZEROS,
                            GROUP_STEPS, CODE_BIAS, IEEE, BLOCK_K)
        up = _expert_step(up, x_rows, row_ok[:, None], w_base, s_base, z_base, n + inter, n_ok,
                          k0, hidden, stride_wn, stride_sn, group_size, BITS, HAS_ZEROS,
                          GROUP_STEPS, CODE_BIAS, IEEE, BLOCK_K)
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
def _down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, weights_ptr, pair_ptr,
                 block_expert_ptr, out_ptr, pairs, hidden, inter, stride_am, stride_we,
                 stride_wn, stride_se, stride_sn, group_size, stride_be, stride_om,
                 HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr, IEEE: tl.constexpr,
                 BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_STEPS: tl.constexpr,
                 CODE_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows, pair, row_ok = _block_pairs(pair_ptr, block, pairs, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_base, s_base, z_base = _expert_tensors(expert, w_ptr, s_ptr, z_ptr, stride_we, stride_se)
    act_rows = act_ptr + rows.to(tl.int64)[:, None] * stride_am
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _expert_step(acc, act_rows, row_ok[:, None], w_base, s_base, z_base,
                           cols[None, :], col_ok[None, :], k0, inter, stride_wn, stride_sn,
                           group_size, BITS, HAS_ZEROS, GROUP_STEPS, CODE_BIAS, IEEE,
                           BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok,
                       other=0.0).to(tl.float32)[None, :]
    if not WEIGHT_ON_INPUT:
        acc *= tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + cols[None, :], acc,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gemv_step(acc, a_row, w_base, s_base, z_base, n, n_ok, k0, width, stride_wn, stride_sn,
               group_size, BITS: tl.constexpr, HAS_ZEROS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    """``acc + a[k0:k0+BLOCK_K] @ W[n, k0:k0+BLOCK_K].T`` for one row ``a`` and quantized
    rows ``n`` (``[BLOCK_N]`` float32), a step over ``GROUPS`` whole groups (or within
    one): products on the codes, each group's zero point and scale applied to its sum
    once per column. A 4-bit byte is loaded once, its nibbles meeting the even and odd
    inputs."""
    if BITS == 4:
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        even_ok = 2 * j < width
        odd_ok = 2 * j + 1 < width
        byte = tl.load(w_base + n[None, :] * stride_wn + j[:, None],
                       mask=n_ok[None, :] & even_ok[:, None], other=0)
        a_even = tl.load(a_row + 2 * j, mask=even_ok, other=0.0).to(tl.float32)
        a_odd = tl.load(a_row + 2 * j + 1, mask=odd_ok, other=0.0).to(tl.float32)
        prod = (a_even[:, None] * (byte & 0xF).to(tl.float32)
                + a_odd[:, None] * (byte >> 4).to(tl.float32))
        part = tl.sum(tl.reshape(prod, (GROUPS, BLOCK_K // 2 // GROUPS, BLOCK_N)), 1)
        a_sum = tl.sum(tl.reshape(a_even + a_odd, (GROUPS, BLOCK_K // 2 // GROUPS)), 1)
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < width
        w = tl.load(w_base + n[None, :] * stride_wn + k[:, None],
                    mask=n_ok[None, :] & k_ok[:, None], other=0)
        a = tl.load(a_row + k, mask=k_ok, other=0.0).to(tl.float32)
        part = tl.sum(tl.reshape(a[:, None] * w.to(tl.float32), (GROUPS, BLOCK_K // GROUPS,
                                                                  BLOCK_N)), 1)
        a_sum = tl.sum(tl.reshape(a, (GROUPS, BLOCK_K // GROUPS)), 1)
    g = k0 // group_size + tl.arange(0, GROUPS)
    scale, zero = _scale_zero(s_base, z_base, n[None, :], g[:, None],
                              n_ok[None, :] & (g * group_size < width)[:, None], stride_sn,
                              BITS, HAS_ZEROS)
    return acc + tl.sum((part - a_sum[:, None] * zero) * scale, 0)


@triton.jit
def _gemv_program(ids_ptr, map_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, width,
                  HAS_MAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's pair, its local expert (-1: held by another rank), its output
    columns within ``width`` and the expert's weight, scale and zero-point bases."""
    pair = tl.program_id(0)
    expert = tl.load(ids_ptr + pair)
    if HAS_MAP:
        expert = tl.load(map_ptr + expert)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base, s_base, z_base = _expert_tensors(expert, w_ptr, s_ptr, z_ptr, stride_we, stride_se)
    return pair, expert, cols, cols < width, w_base, s_base, z_base


@triton.jit
def _gemv_gate_up_kernel(x_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr,
                         act_ptr, top_k, hidden, inter, stride_xm, stride_we, stride_wn,
                         stride_se, stride_sn, group_size, stride_be, stride_am,
                         HAS_MAP: tl.constexpr, HAS_BIAS: tl.constexpr,
                         WEIGHT_ON_INPUT: tl.constexpr, ACTIVATION: tl.constexpr,
                         BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    pair, expert, cols, col_ok, w_base, s_base, z_base = _gemv_program(
        ids_ptr, map_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, inter, HAS_MAP, BLOCK_N)
    if expert < 0:
        return
    x_row = x_ptr + (pair // top_k).to(tl.int64) * stride_xm
    gate = tl.zeros((BLOCK_N,), tl.float32)
    up = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        gate = _gemv_step(gate, x_row, w_base, s_base, z_base, cols, col_ok, k0, hidden,
                          stride_wn, stride_sn, group_size, BITS, HAS_ZEROS, BLOCK_N, BLOCK_K,
                          GROUPS)
        up = _gemv_step(up, x_row, w_base, s_base, z_base, cols + inter, col_ok, k0, hidden,
                        stride_wn, stride_sn, group_size, BITS, HAS_ZEROS, BLOCK_N, BLOCK_K,
                        GROUPS)
    if WEIGHT_ON_INPUT:
        w = tl.load(weights_ptr + pair)
        gate *= w
        up *= w
    if HAS_BIAS:
        b_base = bias_ptr + expert.to(tl.int64) * stride_be
        gate += tl.load(b_base + cols, mask=col_ok, other=0.0).to(tl.float32)
        up += tl.load(b_base + inter + cols, mask=col_ok, other=0.0).to(tl.float32)
    act = _activate(gate, ACTIVATION) * up
    tl.store(act_ptr + pair.to(tl.int64) * stride_am + cols, act.to(act_ptr.dtype.element_ty),
             mask=col_ok)


@triton.jit
def _gemv_down_kernel(act_ptr, w_ptr, s_ptr, z_ptr, bias_ptr, weights_ptr, ids_ptr, map_ptr,
                      out_ptr, hidden, inter, stride_am, stride_we, stride_wn, stride_se,
                      stride_sn, group_size, stride_be, stride_om, HAS_MAP: tl.constexpr,
                      HAS_BIAS: tl.constexpr, WEIGHT_ON_INPUT: tl.constexpr,
                      BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, GROUPS: tl.constexpr):
    pair, expert, cols, col_ok, w_base, s_base, z_base = _gemv_program(
        ids_ptr, map_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, hidden, HAS_MAP, BLOCK_N)
    if expert < 0:
        return
    act_row = act_ptr + pair.to(tl.int64) * stride_am
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        acc = _gemv_step(acc, act_row, w_base, s_base, z_base, cols, col_ok, k0, inter,
                         stride_wn, stride_sn, group_size, BITS, HAS_ZEROS, BLOCK_N, BLOCK_K,
                         GROUPS)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok,
                       other=0.0).to(tl.float32)
    if not WEIGHT_ON_INPUT:
        acc *= tl.load(weights_ptr + pair)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + cols, acc, mask=col_ok)


class _Weights:
    """One projection of every local expert as the kernels read it: a float weight
    ``[E, N, K]`` (``bits`` 0), or stacked resident codes with their scales and zero
    points (None: symmetric)."""

    def __init__(self, weight, bits=0, group_size=1, scales=None, zeros=None):
        self.weight, self.bits, self.group_size = weight.contiguous(), bits, group_size
        self.scales = scales if scales is not None else self.weight
        self.zeros = zeros

    def args(self):
        """(weight, scales, zeros, expert and row strides of each, group size)."""
        zeros = self.zeros if self.zeros is not None else self.scales
        return (self.weight, self.scales, zeros, self.weight.stride(0), self.weight.stride(1),
                self.scales.stride(0), self.scales.stride(1), self.group_size)

    def group_steps(self, width: int, block_k: int) -> bool:
        """Whether every reduction step over ``width`` inputs lies in one group."""
        return self.bits > 0 and (self.group_size % block_k == 0 or self.group_size >= width)

    def gemv_groups(self, width: int, block_k: int) -> int | None:
        """The groups in each of the matrix-vector kernels' ``block_k`` steps over
        ``width`` inputs (1: the step lies in one group), or None where the steps do
        not hold whole groups (those go to the tiled kernels)."""
        if self.group_steps(width, block_k):
            return 1
        g = self.group_size
        return block_k // g if 8 <= g < block_k and g & (g - 1) == 0 else None

    def code_bias(self, dtype: torch.dtype) -> int:
        """The offset at which the codes are exact integers in ``dtype``'s mantissa
        (``_biased_codes``), or 0: converted to float32."""
        if dtype == torch.bfloat16 and self.bits == 4:
            return 128
        if dtype == torch.float16 and self.bits in (4, 8):
            return 1024
        return 0


def _gemv(x, w13: _Weights, w2: _Weights, b13, b2, weights, topk_ids, expert_map, out, inter,
          hidden, tiles: Tiles, groups13, groups2, activation, weight_on_input, has_b13,
          has_b2) -> None:
    """Each pair's gate/up and down products as matrix-vector kernels, into ``out``."""
    pairs, top_k = topk_ids.numel(), topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    expert_map_arg = expert_map if expert_map is not None else ids
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    block_n, block_k, warps, stages = tiles
    w13_ptr, s13, z13, we13, wn13, se13, sn13, g13 = w13.args()
    w2_ptr, s2, z2, we2, wn2, se2, sn2, g2 = w2.args()
    _gemv_gate_up_kernel[(pairs, triton.cdiv(inter, block_n))](
        x, w13_ptr, s13, z13, b13, weights, ids, expert_map_arg, act, top_k, hidden, inter,
        x.stride(0), we13, wn13, se13, sn13, g13, b13.stride(0), act.stride(0),
        HAS_MAP=expert_map is not None, HAS_BIAS=has_b13, WEIGHT_ON_INPUT=weight_on_input,
        ACTIVATION=_ACTIVATION_CODES[activation], BITS=w13.bits,
        HAS_ZEROS=w13.zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k, GROUPS=groups13,
        num_warps=warps, num_stages=stages)
    _gemv_down_kernel[(pairs, triton.cdiv(hidden, block_n))](
        act, w2_ptr, s2, z2, b2, weights, ids, expert_map_arg, out, hidden, inter,
        act.stride(0), we2, wn2, se2, sn2, g2, b2.stride(0), out.stride(0),
        HAS_MAP=expert_map is not None, HAS_BIAS=has_b2, WEIGHT_ON_INPUT=weight_on_input,
        BITS=w2.bits, HAS_ZEROS=w2.zeros is not None, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUPS=groups2, num_warps=warps, num_stages=stages)


def _fused(x, w13: _Weights, w2: _Weights, topk_weights, topk_ids, inter, hidden, *,
           expert_map, activation, apply_router_weight_on_input, w13_bias, w2_bias):
    if activation not in _ACTIVATION_CODES:
        raise ValueError(f"MoE activation {activation!r} is not one of {GATED_ACTIVATIONS}")
    m, top_k = topk_ids.shape
    num_local = w13.weight.shape[0]
    pairs = m * top_k
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    if pairs == 0:
        return out.view(m, hidden).to(x.dtype)
    x = x.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    b13 = w13_bias.contiguous() if w13_bias is not None else w13.weight
    b2 = w2_bias.contiguous() if w2_bias is not None else w2.weight
    if w13.bits and w2.bits and pairs <= GEMV_MAX_PAIRS:
        tiles = (INTERPRETED_GEMV_TILES if interpreted(_gemv_gate_up_kernel)
                 else GEMV_TILES[w13.bits])
        g13 = w13.gemv_groups(hidden, tiles.block_k)
        g2 = w2.gemv_groups(inter, tiles.block_k)
        if g13 is not None and g2 is not None:
            _gemv(x, w13, w2, b13, b2, weights, topk_ids, expert_map, out, inter, hidden,
                  tiles, g13, g2, activation, apply_router_weight_on_input, w13_bias is not None,
                  w2_bias is not None)
            return out.view(m, top_k, hidden).sum(dim=1).to(x.dtype)
    pair_of_row, block_expert = align_pairs(topk_ids, expert_map, num_local, BLOCK_M)
    act = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32 or interpreted(_gate_up_kernel)
    blocks = block_expert.numel()
    w13_ptr, s13, z13, we13, wn13, se13, sn13, g13 = w13.args()
    w2_ptr, s2, z2, we2, wn2, se2, sn2, g2 = w2.args()
    up = tiles_for("gate_up", w13.bits, pairs)
    _gate_up_kernel[(blocks, triton.cdiv(inter, up.block_n))](
        x, w13_ptr, s13, z13, b13, weights, pair_of_row, block_expert, act, pairs, top_k,
        hidden, inter, x.stride(0), we13, wn13, se13, sn13, g13, b13.stride(0), act.stride(0),
        HAS_BIAS=w13_bias is not None, WEIGHT_ON_INPUT=apply_router_weight_on_input,
        ACTIVATION=_ACTIVATION_CODES[activation], IEEE=ieee, BITS=w13.bits,
        HAS_ZEROS=w13.zeros is not None, GROUP_STEPS=w13.group_steps(hidden, up.block_k),
        CODE_BIAS=w13.code_bias(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=up.block_n,
        BLOCK_K=up.block_k, num_warps=up.num_warps, num_stages=up.num_stages)
    down = tiles_for("down", w2.bits, pairs)
    _down_kernel[(blocks, triton.cdiv(hidden, down.block_n))](
        act, w2_ptr, s2, z2, b2, weights, pair_of_row, block_expert, out, pairs, hidden, inter,
        act.stride(0), we2, wn2, se2, sn2, g2, b2.stride(0), out.stride(0),
        HAS_BIAS=w2_bias is not None, WEIGHT_ON_INPUT=apply_router_weight_on_input,
        IEEE=ieee, BITS=w2.bits, HAS_ZEROS=w2.zeros is not None,
        GROUP_STEPS=w2.group_steps(inter, down.block_k), CODE_BIAS=w2.code_bias(act.dtype),
        BLOCK_M=BLOCK_M, BLOCK_N=down.block_n, BLOCK_K=down.block_k,
        num_warps=down.num_warps, num_stages=down.num_stages)
    return out.view(m, top_k, hidden).sum(dim=1).to(x.dtype)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                expert_map: torch.Tensor | None = None, activation: str = "silu",
                apply_router_weight_on_input: bool = False,
                w13_bias: torch.Tensor | None = None,
                w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """The experts held here over their routed tokens: ``[M, H]`` in x's dtype;
    activations without a code here (gpt-oss's swigluoai) go to the next provider."""
    if activation not in _ACTIVATION_CODES:
        return fallback_kernel("moe_experts", "triton")(
            x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation,
            apply_router_weight_on_input=apply_router_weight_on_input, w13_bias=w13_bias,
            w2_bias=w2_bias)
    return _fused(x, _Weights(w13), _Weights(w2), topk_weights, topk_ids, w13.shape[1] // 2,
                  w2.shape[1], expert_map=expert_map, activation=activation,
                  apply_router_weight_on_input=apply_router_weight_on_input,
                  w13_bias=w13_bias, w2_bias=w2_bias)


#: the resident tensors a weight-only module (``quant/packed.py``'s InstalledWInt) holds
_RESIDENT = ("qweight", "scales", "zeros")


def _generic_resident(module) -> bool:
    """A weight-only module in the generic resident layout the kernels read: 4 or 8 bits,
    no act-order permutation, no provider's prepared layout."""
    return (getattr(module, "provider", "") is None and getattr(module, "bits", 0) in (4, 8)
            and getattr(module, "perm", None) is None and getattr(module, "g_idx", None) is None
            and isinstance(getattr(module, "qweight", None), torch.Tensor))


def stacked_experts(modules) -> _Weights | None:
    """The experts' resident tensors stacked ``[E, ...]`` (built once and kept on the
    module list; each module's tensors become views of the stack), or None where a
    module is not in the generic layout or the experts' schemes differ."""
    cached = modules.__dict__.get("_accel_triton_stack")
    if cached is not None:
        return cached
    first = modules[0]
    if not all(_generic_resident(m) for m in modules) or len(
            {(m.bits, m.group_size, m.zeros is None, m.qweight.shape, m.scales.dtype)
             for m in modules}) != 1:
        return None
    stacks = {}
    for name in _RESIDENT:
        if getattr(first, name) is None:
            continue
        stacks[name] = torch.stack([getattr(m, name).data for m in modules]).contiguous()
        for e, m in enumerate(modules):
            getattr(m, name).data = stacks[name][e]
    weights = _Weights(stacks["qweight"], first.bits, first.group_size, stacks["scales"],
                       stacks.get("zeros"))
    modules.__dict__["_accel_triton_stack"] = weights
    logger.info("Triton fused MoE: %d experts' %d-bit weights (group %d, %s) stacked, "
                "the modules now views of the stack", len(modules), first.bits,
                first.group_size, "asym" if first.zeros is not None else "sym")
    return weights


def moe_quant_experts(x: torch.Tensor, w13: list, w2: list, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, *, expert_map: torch.Tensor | None = None,
                      activation: str = "silu", apply_router_weight_on_input: bool = False,
                      w13_bias: torch.Tensor | None = None,
                      w2_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-only quantized experts (``w13[e]`` / ``w2[e]``: the dense linears' modules)
    fused like :func:`moe_experts`; other modules go to the next provider."""
    s13 = stacked_experts(w13)
    s2 = stacked_experts(w2) if s13 is not None else None
    if s2 is None:
        return fallback_kernel("moe_quant_experts", "triton")(
            x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation,
            apply_router_weight_on_input=apply_router_weight_on_input, w13_bias=w13_bias,
            w2_bias=w2_bias)
    return _fused(x, s13, s2, topk_weights, topk_ids, w13[0].out_features // 2,
                  w2[0].out_features, expert_map=expert_map, activation=activation,
                  apply_router_weight_on_input=apply_router_weight_on_input,
                  w13_bias=w13_bias, w2_bias=w2_bias)
