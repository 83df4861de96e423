"""Paged-attention test cases and the float64 oracle, shared by every provider's
kernel tests (pure torch plus the reference cache writers, so the Triton tests can
run them on a machine with only torch and triton).

Each case builds per-request K/V, scatters them into a cache pre-filled with
garbage through a shuffled (non-contiguous) block table whose unused columns hold
garbage block ids; kernels are checked against plain attention over the original
tensors. Any read of a slot a request does not own shows up as a mismatch
(garbage is +/-1e4, far outside the tolerances).
"""

import math

import torch

from vllm_accel.ops.reference.cache_write import cache_write, cache_write_int8

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}
HKV = 2
GQA = [1, 3, 8]  # H = ratio * HKV
PAD_COLS = 2  # extra block-table columns per request, filled with garbage ids


def batch_mix(name: str, bs: int) -> list[tuple[int, int]]:
    """(q_len, seq_len) per request; lengths straddle block boundaries."""
    return {
        "decode": [(1, 1), (1, bs), (1, bs + 1), (1, 3 * bs - 7), (1, 45)],
        "prefill": [(1, 1), (bs, bs), (2 * bs + 3, 2 * bs + 3), (23, 23)],
        "prefill_ctx": [(17, 2 * bs), (bs, 2 * bs), (5, bs + 9), (40, 40 + bs // 2)],
        "mixed": [(30, 30 + bs + 3), (1, 2 * bs + 5), (19, 19), (1, 1), (1, bs)],
    }[name]


def empty_cache(num_blocks, hkv, bs, d, dtype, layout, fill):
    """A logical [NB, Hkv, BS, 2D] cache in the given physical layout."""
    if layout == "LHBNC":
        return torch.full((hkv, num_blocks, bs, 2 * d), fill, dtype=dtype).transpose(0, 1)
    return torch.full((num_blocks, hkv, bs, 2 * d), fill, dtype=dtype)


def read_kv(kv_cache, blk, off, d):
    """K and V at (block, offset) pairs: a page holds its K rows, then its V rows."""
    nb, hkv, bs, _ = kv_cache.shape
    page = kv_cache[blk]  # [n, Hkv, BS, 2D] -> reinterpret each page as [2, BS, D]
    page = page.reshape(len(blk), hkv, 2, bs, d)
    rows = torch.arange(len(blk))
    return page[rows, :, 0, off], page[rows, :, 1, off]


def make_case(reqs, bs, h, hkv, d, dtype, seed, layout="LHBNC", fill=None):
    """Unpaged per-request Q/K/V, a shuffled block table and the filled cache."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / bs) for _, s in reqs]
    num_blocks = sum(need) + 3  # a few blocks nobody owns
    perm = torch.randperm(num_blocks, generator=g)
    width = max(need) + PAD_COLS
    block_table = torch.randint(0, num_blocks, (len(reqs), width), generator=g, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        block_table[i, :n] = perm[used : used + n].to(torch.int32)
        used += n

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    qs = [rand(q, h, d) for q, _ in reqs]
    ks = [rand(s, hkv, d) for _, s in reqs]
    vs = [rand(s, hkv, d) for _, s in reqs]

    # Slot mapping for every token of every request, plus padding rows, shuffled.
    slots = []
    for i, (_, s) in enumerate(reqs):
        pos = torch.arange(s)
        slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
    n_pad = 4
    slot_mapping = torch.cat(slots + [torch.full((n_pad,), -1, dtype=torch.long)])
    key = torch.cat(ks + [rand(n_pad, hkv, d)])
    value = torch.cat(vs + [rand(n_pad, hkv, d)])
    order = torch.randperm(len(slot_mapping), generator=g)
    if fill is None:  # finite garbage: a masked key must contribute exactly 0
        kv_cache = empty_cache(num_blocks, hkv, bs, d, dtype, layout, 0.0)
        kv_cache.copy_((torch.rand(kv_cache.shape, generator=g) * 2e4 - 1e4).to(dtype))
    else:
        kv_cache = empty_cache(num_blocks, hkv, bs, d, dtype, layout, fill)
    cache_write(key[order], value[order], kv_cache, slot_mapping[order])
    return qs, ks, vs, block_table, kv_cache


def reference(q, k, v, scale, sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
              sinks=None, causal=True, two_way_ranges=()):
    """float64 causal attention; q holds the last len(q) of len(k) positions. The model
    features, written out from their definitions: logits soft-capped as
    ``c * tanh(s / c)``, plus ``slope[h] * (j - i)`` (ALiBi), keys ``j`` with
    ``i - j < window`` only, and a sink logit per head in the softmax's denominator.
    Bidirectional (``causal=False``, q and k the same positions): every key, the window
    ``|i - j| < window`` and ALiBi ``-slope[h] * |i - j|``. ``two_way_ranges``:
    inclusive ``(first, last)`` positions whose tokens also see the later ones among
    them."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if logits_soft_cap:
        scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
    context = k.shape[0] - q.shape[0]
    q_pos = torch.arange(q.shape[0])[:, None] + context
    distance = torch.arange(k.shape[0])[None, :] - q_pos  # j - i
    if alibi_slopes is not None:
        scores = scores + torch.as_tensor(alibi_slopes).double()[:, None, None] * (
            distance if causal else -distance.abs())
    hidden = distance > 0 if causal else torch.zeros_like(distance, dtype=torch.bool)
    key_pos = torch.arange(k.shape[0])[None, :]
    for first, last in two_way_ranges:
        both = (first <= q_pos) & (q_pos <= last) & (first <= key_pos) & (key_pos <= last)
        hidden &= ~both
    if sliding_window is not None:
        hidden |= distance.abs() >= sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    if sinks is not None:
        sink = torch.as_tensor(sinks).double()[:, None, None].expand(-1, q.shape[0], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """The ALiBi paper's slopes (as Bloom and vLLM compute them), for any head count."""
    closest = 2 ** math.floor(math.log2(num_heads))
    base = 2.0 ** (-(2.0 ** -(math.log2(closest) - 3)))
    slopes = [base ** (i + 1) for i in range(closest)]
    if closest != num_heads:
        extra = 2.0 ** (-(2.0 ** -(math.log2(2 * closest) - 3)))
        slopes += [extra ** (2 * i + 1) for i in range(num_heads - closest)]
    return torch.tensor(slopes, dtype=torch.float32)


def free_before_window(kv_cache, block_table, reqs, window):
    """What vLLM's sliding-window KV manager does to blocks no query of a request can
    see any more: their table entries point at its null block. Here that block is an
    unowned one filled with NaN, so a kernel that reads it (even masked: NaN x 0 is
    NaN) returns NaN. Returns the null block's id."""
    bs = kv_cache.shape[2]
    owned = {int(b) for i, (_, s) in enumerate(reqs) for b in block_table[i, :math.ceil(s / bs)]}
    null = next(b for b in range(kv_cache.shape[0]) if b not in owned)
    if kv_cache.dtype == torch.int8:
        kv_cache[null].view(torch.uint8).fill_(0xFF)  # NaN scales (and codes -1)
    else:
        kv_cache[null] = float("nan")
    for i, (q_len, seq_len) in enumerate(reqs):
        first = max(0, seq_len - q_len + 1 - window)  # the first query's window
        block_table[i, :first // bs] = null
    return null


#: Bound: |out - ref| <= INT8_ERR * max|V of the request| + TOL[dtype] (the bf16/fp32
#: tolerance of the unquantized kernels). Measured worst over the full cross product
#: below (4 mixes x bs 16..128 x GQA 1/3/8 x D 64/128 x fp32/bf16 x both layouts,
#: decode + prefill): 0.0093 (fp32); bf16 0.0107 raw, 0.0024 beyond the bf16
#: tolerance. Theory: V rounding alone is <= max|V| / 254 = 0.0039; K rounding
#: perturbs the logits by ~0.007 std. 0.02 leaves ~2x margin.
INT8_ERR = 0.02


def int8_cache(num_blocks, bs, d, layout, g=None, fill=None):
    """A logical [NB, Hkv, BS, 2D+8] int8 cache; ``fill`` byte, else finite garbage."""
    width = 2 * d + 8
    shape = (HKV, num_blocks, bs, width) if layout == "LHBNC" else (num_blocks, HKV, bs, width)
    if fill is not None:
        phys = torch.full(shape, fill, dtype=torch.int8)
    else:
        phys = torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
        pages = phys.view(-1, bs * width)
        garbage_scales = torch.rand(pages.shape[0], 2 * bs, generator=g) * 100
        pages[:, 2 * bs * d :].view(torch.float32).copy_(garbage_scales)
    return phys.transpose(0, 1) if layout == "LHBNC" else phys


def write_shuffled(cache, block_table, ks, vs, g, **scales):
    """cache_write_int8 of all requests' K/V plus 4 padding rows, in shuffled order."""
    bs = cache.shape[2]
    slots = []
    for i, k in enumerate(ks):
        pos = torch.arange(len(k))
        slots.append(block_table[i, pos // bs].long() * bs + pos % bs)
    slot_mapping = torch.cat(slots + [torch.full((4,), -1, dtype=torch.long)])
    pad = torch.randn(4, *ks[0].shape[1:], generator=g).to(ks[0].dtype) * 1e3
    key, value = torch.cat(ks + [pad]), torch.cat(vs + [pad])
    order = torch.randperm(len(slot_mapping), generator=g)
    cache_write_int8(key[order], value[order], cache, slot_mapping[order], **scales)


def build(reqs, bs, ratio, d, dtype, layout, seed, fill=None, **scales):
    """make_case's data and block table, written into an int8 cache."""
    qs, ks, vs, block_table, bf16_cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                                    seed=seed, layout=layout, fill=0.0)
    g = torch.Generator().manual_seed(seed + 1)
    num_blocks = sum(math.ceil(s / bs) for _, s in reqs) + 3  # as make_case
    cache = int8_cache(num_blocks, bs, d, layout, g, fill)
    write_shuffled(cache, block_table, ks, vs, g, **scales)
    return qs, ks, vs, block_table, cache, bf16_cache


def read_slots(cache, blk, off):
    """(K int8, V int8 [n, Hkv, D], scales float32 [n, Hkv, 2]) at (block, offset) pairs."""
    n, (_, hkv, bs, width) = len(blk), cache.shape
    d = (width - 8) // 2
    page = cache[blk].reshape(n, hkv, bs * width)
    rows = torch.arange(n)
    k = page[..., : bs * d].reshape(n, hkv, bs, d)[rows, :, off]
    v = page[..., bs * d : 2 * bs * d].reshape(n, hkv, bs, d)[rows, :, off]
    s = page[..., 2 * bs * d :].reshape(n, hkv, bs, 8).contiguous().view(torch.float32)
    return k, v, s[rows, :, off]


def request_slots(block_table, i, seq_len, bs):
    pos = torch.arange(seq_len)
    return block_table[i, pos // bs].long(), pos % bs


def kernel_args(reqs):
    query_start_loc = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    return query_start_loc, seq_lens


def assert_within_int8_bound(out, expected, vmax, dtype):
    """|out - expected| <= INT8_ERR * vmax (per row) + TOL[dtype], reporting the worst."""
    tol = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * expected.abs()
    excess = ((out.double() - expected).abs() - tol) / vmax
    assert excess.max() <= INT8_ERR, f"error {excess.max():.4f} * max|V| > {INT8_ERR}"
