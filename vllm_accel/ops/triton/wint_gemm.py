"""Weight-only integer GEMM in Triton on the resident layout (torch + triton only).

``y = x @ W.T (+ bias)`` with ``W[o, i] = (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]``
read straight from ``quant/packed.py``'s layout: uint8 codes output-major (8-bit
``[N, K]``; 4-bit ``[N, K/2]``, even column in the low nibble), scales ``[N, G]``
fp16/fp32, zero points ``[N, G]`` or none (symmetric ``2**(bits-1)``), the act-order
permutation applied to ``x``'s columns and ``g_idx`` for non-contiguous groups.

Rows that are whole int32 words take the word kernels: one ``x`` row (batch-1
decode) a GEMV where a code costs one AND and one FMA (``_masked_code``), with K
split across programs that meet in a float32 workspace (``_SPLIT_WORKSPACE``), when
its tiles divide the shape; more rows, or other shapes, ``tl.dot`` over the code
planes of the words (from ``INTERLEAVE_MIN_ROWS`` rows the planes are put back in
column order for one wide dot). Other rows take byte kernels (a split-K GEMV,
``tl.dot`` tiles), where a byte's low nibbles multiply ``x``'s even columns and its
high nibbles the odd ones. Dequantization and accumulation run in float32; the
result is rounded once.

The entry point is a ``torch.library`` custom op, so torch.compile keeps it as one
call instead of tracing into Triton.
"""

import torch
import triton
import triton.language as tl

from vllm_accel.ops.triton.paged_attention import interpreted

#: largest batch that takes the GEMV form
GEMV_MAX_ROWS = 8
#: GEMV tile (rows x K columns), K slices per row tile, warps (tuned on an H100)
GEMV = {"bn": 16, "bk": 128, "splits": 4, "num_warps": 4}
#: the one-row word GEMV (tuned on an H100): row tiles and K tiles it may take (the
#: largest dividing the shape), about how many programs K splits aim for, and words a
#: thread holds (sets the warps)
GEMV_WORDS = {"bn": (128, 64, 32, 16), "bk": (256, 128, 64, 32), "programs": 256,
              "words_per_thread": 32}
#: the int32-word kernel (more than one row, when rows are whole words; tuned on an
#: H100: 4 warps from batch 32 up)
WORDS = {"bn": 128, "bk": 256, "num_warps": 8, "num_stages": 3, "programs": 528}
#: from this batch size up the word kernel puts the planes back in column order for
#: one wide dot (H100: 2-3x faster at batch 64, slower at 16); not for float32 dots,
#: whose tiles would not fit in shared memory
INTERLEAVE_MIN_ROWS = 17
#: tl.dot tiles; K is split until about ``programs`` programs run (small batches
#: have few output tiles: one per SM would idle most of an H100's 132)
GEMM = {"bn": 128, "bk": 128, "num_warps": 4, "num_stages": 3, "programs": 264}


@triton.jit
def _scale_zero(s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, mask, k0, G, group_size,
                BITS: tl.constexpr, HAS_Z: tl.constexpr, HAS_GIDX: tl.constexpr,
                ONE_GROUP: tl.constexpr):
    """Float32 scale and zero point of rows ``n`` at resident columns ``kk``:
    ``[BN, 1]`` when the whole K tile starting at ``k0`` lies in one group
    (``ONE_GROUP``), else gathered per column ``[BN, BK]``."""
    if ONE_GROUP:
        sz = n[:, None] * G + k0 // group_size
        smask = n_ok[:, None]
    else:
        if HAS_GIDX:
            g = tl.load(gidx_ptr + kk, mask=k_ok, other=0)
        else:
            g = kk // group_size
        sz = n[:, None] * G + g[None, :]
        smask = mask
    s = tl.load(s_ptr + sz, mask=smask, other=0.0).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + sz, mask=smask, other=0.0).to(tl.float32)
    else:
        z = tl.full([1, 1], 2 ** (BITS - 1), tl.float32)
    return s, z


@triton.jit
def _code_plus_2_23(code):
    """``2**23 + code`` as float32 for an integer code < 2**23, by writing the code
    into the mantissa of 2**23: an OR instead of a (slow) int-to-float conversion."""
    return (code | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequant(w_ptr, s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, k0, G, group_size, stride_w,
             BITS: tl.constexpr, HAS_Z: tl.constexpr, HAS_GIDX: tl.constexpr,
             ONE_GROUP: tl.constexpr):
    """Float32 weights of rows ``n``: 8-bit -> ``[BN, BK]`` at columns ``kk``;
    4-bit -> (low, high) nibbles ``[BN, BK]`` of the bytes holding columns
    ``kk`` (even) and ``kk + 1``."""
    mask = n_ok[:, None] & k_ok[None, :]
    if BITS == 4:
        byte = tl.load(w_ptr + n[:, None] * stride_w + (kk // 2)[None, :], mask=mask, other=0)
        s, z = _scale_zero(s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, mask, k0, G, group_size,
                           BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
        byte = byte.to(tl.int32)
        lo = (_code_plus_2_23(byte & 0xF) - (8388608.0 + z)) * s
        if HAS_GIDX:  # the odd column may sit in another group
            s, z = _scale_zero(s_ptr, z_ptr, gidx_ptr, n, n_ok, kk + 1, k_ok, mask, k0, G,
                               group_size, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
        hi = (_code_plus_2_23(byte >> 4) - (8388608.0 + z)) * s
        return lo, hi
    code = tl.load(w_ptr + n[:, None] * stride_w + kk[None, :], mask=mask, other=0)
    s, z = _scale_zero(s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, mask, k0, G, group_size,
                       BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
    w = (_code_plus_2_23(code.to(tl.int32) & 0xFF) - (8388608.0 + z)) * s
    return w, w


@triton.jit
def _wint_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, gidx_ptr, y_ptr, N, K, G, group_size,
                      stride_x, stride_w, stride_y, k_per_prog,
                      BITS: tl.constexpr, HAS_Z: tl.constexpr, HAS_GIDX: tl.constexpr,
                      ONE_GROUP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      ROWS: tl.constexpr):
    """Programs: (output tile, K slice). Each row of ``x`` (``ROWS`` <= 8) gets its
    partial sum for the tile, added atomically into float32 ``y``."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    n_ok = n < N
    k_begin = pid_k * k_per_prog
    k_end = tl.minimum(K, k_begin + k_per_prog)
    for r in tl.static_range(ROWS):
        acc = tl.zeros([BN], tl.float32)
        for k0 in range(k_begin, k_end, BK):
            if BITS == 4:
                kk = k0 + 2 * tl.arange(0, BK // 2)
                k_ok = kk < k_end
                lo, hi = _dequant(w_ptr, s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, k0, G,
                                  group_size, stride_w, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
                x_even = tl.load(x_ptr + r * stride_x + kk, mask=k_ok, other=0.0)
                x_odd = tl.load(x_ptr + r * stride_x + kk + 1, mask=k_ok, other=0.0)
                acc += tl.sum(lo * x_even.to(tl.float32)[None, :], 1)
                acc += tl.sum(hi * x_odd.to(tl.float32)[None, :], 1)
            else:
                kk = k0 + tl.arange(0, BK)
                k_ok = kk < k_end
                w, _ = _dequant(w_ptr, s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, k0, G,
                                group_size, stride_w, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
                xv = tl.load(x_ptr + r * stride_x + kk, mask=k_ok, other=0.0)
                acc += tl.sum(w * xv.to(tl.float32)[None, :], 1)
        tl.atomic_add(y_ptr + r * stride_y + n, acc, mask=n_ok)


@triton.jit
def _masked_code(word, MASK: tl.constexpr, x_scaled):
    """``(word & MASK)`` read as a float32 times ``x_scaled``. Bit patterns below
    2**24 are subnormals or the first normal binade, both ``bits * 2**-149``: a code
    masked in place at bit ``b`` is ``code * 2**(b - 149)`` without a shift, an OR or
    an int-to-float conversion (``x_scaled`` carries the power of two back; the
    multiply-add rounds once)."""
    return (word & MASK).to(tl.float32, bitcast=True) * x_scaled


@triton.jit
def _write_row_tile(y, y_ptr, b_ptr, n, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        y += tl.load(b_ptr + n).to(tl.float32)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty))


@triton.jit
def _wint_gemv_words_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, G,
                            stride_w, BITS: tl.constexpr, GROUP: tl.constexpr,
                            HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, BN: tl.constexpr,
                            BK: tl.constexpr, KP: tl.constexpr, SPLIT: tl.constexpr):
    """One ``x`` row against ``BN`` weight rows over ``KP`` columns per program (axis 1
    splits K). Per code: one AND and one FMA (``_masked_code``; the top byte of a word
    is shifted down once), every product ``code * x * 2**PRODUCT_EXP`` (``x`` below
    2**54 stays finite, products above 2**-51 stay normal); the zero-point offset
    ``zero * sum(x)`` comes off per word, the group scale multiplies per word. The
    next tile's words and scales are loaded before this tile's math. Split K: the
    programs of a row tile add into the float32 workspace ``ws``; the last to arrive
    (``count``) writes the output and leaves ``ws`` and ``count`` at zero."""
    PLANES: tl.constexpr = 32 // BITS
    W: tl.constexpr = BK // PLANES
    CODE: tl.constexpr = (1 << BITS) - 1
    PRODUCT_EXP: tl.constexpr = -75
    pid_n = tl.program_id(0)
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, W)
    k_begin = tl.program_id(1) * KP
    w_rows = w_ptr + n[:, None] * stride_w
    s_rows = s_ptr + n[:, None] * G
    w_next = tl.load(w_rows + (k_begin // PLANES + j)[None, :])
    s_next = tl.load(s_rows + ((k_begin + j * PLANES) // GROUP)[None, :])
    acc = tl.zeros([BN, W], tl.float32)
    for k0 in range(k_begin, k_begin + KP, BK):
        words = w_next
        s = s_next.to(tl.float32)
        k_next = tl.minimum(k0 + BK, k_begin + KP - BK)  # the last tile reloads itself
        w_next = tl.load(w_rows + (k_next // PLANES + j)[None, :])
        s_next = tl.load(s_rows + ((k_next + j * PLANES) // GROUP)[None, :])
        col = k0 + j * PLANES
        x_sum = tl.zeros([1, W], tl.float32)  # (the loop below reuses these loads)
        for i in tl.static_range(PLANES):
            x_sum += tl.load(x_ptr + col[None, :] + i).to(tl.float32)
        if HAS_Z:  # the sums start at the zero-point offset
            z = tl.load(z_ptr + n[:, None] * G + (col // GROUP)[None, :]).to(tl.float32)
            t = -z * (x_sum * 2.0 ** PRODUCT_EXP)
        else:
            t = tl.broadcast_to(x_sum * -(2.0 ** (BITS - 1 + PRODUCT_EXP)), [BN, W])
        top = words >> 8  # bits 24-31 at 16-23, under the 2**24 limit
        for i in tl.static_range(PLANES):
            xi = tl.load(x_ptr + col[None, :] + i).to(tl.float32)
            if BITS * (i + 1) <= 24:
                t += _masked_code(words, CODE << (BITS * i),
                                  xi * 2.0 ** (149 + PRODUCT_EXP - BITS * i))
            else:
                t += _masked_code(top, CODE << (BITS * i - 8),
                                  xi * 2.0 ** (157 + PRODUCT_EXP - BITS * i))
        acc += t * s
    y = tl.sum(acc, 1) * 2.0 ** -PRODUCT_EXP
    if SPLIT > 1:
        tl.atomic_add(ws_ptr + n, y, sem="relaxed")
        tl.debug_barrier()  # every thread's partial sums before the arrival count
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:
            y = tl.atomic_add(ws_ptr + n, tl.zeros([BN], tl.float32), sem="acq_rel",
                              scope="gpu")
            tl.store(ws_ptr + n, tl.zeros([BN], tl.float32))
            tl.store(count_ptr + pid_n, 0)
            _write_row_tile(y, y_ptr, b_ptr, n, HAS_BIAS)
    else:
        _write_row_tile(y, y_ptr, b_ptr, n, HAS_BIAS)


@triton.jit
def _dot_acc(acc, x, w, DOT_F32: tl.constexpr):
    """``acc + x @ w.T``: float32 (IEEE) products, or ``w`` rounded to ``x``'s dtype
    for the tensor cores."""
    if DOT_F32:
        return acc + tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    return acc + tl.dot(x, tl.trans(w.to(x.dtype)))


@triton.jit
def _wint_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, gidx_ptr, y_ptr, M, N, K, G, group_size,
                      stride_x, stride_w, stride_y, k_per_prog,
                      BITS: tl.constexpr, HAS_Z: tl.constexpr, HAS_GIDX: tl.constexpr,
                      ONE_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      DOT_F32: tl.constexpr):
    """``tl.dot`` tiles: ``x`` tile ``[BM, BK]`` times the dequantized weight tile,
    over one K slice per program (axis 2); slices add atomically into float32 ``y``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_begin = tl.program_id(2) * k_per_prog
    k_end = tl.minimum(K, k_begin + k_per_prog)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_begin, k_end, BK):
        if BITS == 4:
            kk = k0 + 2 * tl.arange(0, BK // 2)
            k_ok = kk < k_end
            lo, hi = _dequant(w_ptr, s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, k0, G, group_size,
                              stride_w, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
            x_mask = m_ok[:, None] & k_ok[None, :]
            x_even = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :], mask=x_mask, other=0.0)
            x_odd = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :] + 1, mask=x_mask,
                            other=0.0)
            acc = _dot_acc(acc, x_even, lo, DOT_F32)
            acc = _dot_acc(acc, x_odd, hi, DOT_F32)
        else:
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < k_end
            w, _ = _dequant(w_ptr, s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, k_ok, k0, G, group_size,
                            stride_w, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
            xv = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :],
                         mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            acc = _dot_acc(acc, xv, w, DOT_F32)
    tl.atomic_add(y_ptr + m[:, None] * stride_y + n[None, :], acc,
                  mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _wint_words_kernel(x_ptr, w_ptr, s_ptr, z_ptr, gidx_ptr, y_ptr, M, N, K, G, group_size,
                       stride_x, stride_w, stride_y, k_per_prog,
                       BITS: tl.constexpr, HAS_Z: tl.constexpr, HAS_GIDX: tl.constexpr,
                       ONE_GROUP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, DOT_F32: tl.constexpr, INTERLEAVE: tl.constexpr):
    """The weight read as int32 words (8 nibbles / 4 bytes, column ``c`` of a word in
    bits ``BITS * c``): a K tile is ``BK / PLANES`` words per row, split into
    ``PLANES`` planes (code ``i`` of every word = columns ``k0 + PLANES * j + i``),
    each one ``tl.dot`` with the matching ``x`` columns. Wide loads, no byte
    interleaving, and the tensor cores do the multiply-adds even at batch 1."""
    PLANES: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BK // PLANES
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_begin = tl.program_id(2) * k_per_prog
    k_end = tl.minimum(K, k_begin + k_per_prog)
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    j = tl.arange(0, WORDS)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(k_begin, k_end, BK):
        word_ok = k0 + j * PLANES < k_end
        mask = n_ok[:, None] & word_ok[None, :]
        words = tl.load(w_ptr + n[:, None] * stride_w + (k0 // PLANES + j)[None, :],
                        mask=mask, other=0)
        if ONE_GROUP:  # integer weights (code - zero) in the dots, the scale once per tile
            if HAS_Z:
                z = tl.load(z_ptr + n * G + k0 // group_size, mask=n_ok, other=0.0)
                z = z.to(tl.float32)[:, None]
            else:
                z = tl.full([1, 1], 2 ** (BITS - 1), tl.float32)
            part = tl.zeros([BM, BN], tl.float32)
            if INTERLEAVE:  # the planes back in column order: one dot over contiguous x
                p = tl.arange(0, PLANES)
                code = (words[:, :, None] >> (BITS * p)[None, None, :]) & ((1 << BITS) - 1)
                w = tl.reshape(_code_plus_2_23(code) - (8388608.0 + z[:, :, None]), [BN, BK])
                kk = k0 + tl.arange(0, BK)
                xv = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :],
                             mask=m_ok[:, None] & (kk < k_end)[None, :], other=0.0)
                part = _dot_acc(part, xv, w, DOT_F32)
            else:
                for i in tl.static_range(PLANES):
                    kk = k0 + j * PLANES + i
                    code = (words >> (BITS * i)) & ((1 << BITS) - 1)
                    w = _code_plus_2_23(code) - (8388608.0 + z)
                    xv = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :],
                                 mask=m_ok[:, None] & word_ok[None, :], other=0.0)
                    part = _dot_acc(part, xv, w, DOT_F32)
            s_row = tl.load(s_ptr + n * G + k0 // group_size, mask=n_ok, other=0.0)
            acc += part * s_row.to(tl.float32)[None, :]
        else:
            for i in tl.static_range(PLANES):
                kk = k0 + j * PLANES + i
                s, z = _scale_zero(s_ptr, z_ptr, gidx_ptr, n, n_ok, kk, word_ok, mask, k0, G,
                                   group_size, BITS, HAS_Z, HAS_GIDX, ONE_GROUP)
                code = (words >> (BITS * i)) & ((1 << BITS) - 1)
                w = (_code_plus_2_23(code) - (8388608.0 + z)) * s
                xv = tl.load(x_ptr + m[:, None] * stride_x + kk[None, :],
                             mask=m_ok[:, None] & word_ok[None, :], other=0.0)
                acc = _dot_acc(acc, xv, w, DOT_F32)
    tl.atomic_add(y_ptr + m[:, None] * stride_y + n[None, :], acc,
                  mask=m_ok[:, None] & n_ok[None, :])


def _k_tile(preferred: int, group_size: int, g_idx) -> int:
    """The K tile: the preferred one, shrunk to the group size when that lets a
    tile read one scale per row (a power of two of at least 32)."""
    if g_idx is None and group_size < preferred and group_size >= 32 and \
            group_size & (group_size - 1) == 0:
        return group_size
    return preferred


def _one_group(k_tile: int, group_size: int, g_idx) -> bool:
    return g_idx is None and group_size % k_tile == 0


@torch.library.custom_op("vllm_accel_triton::wint_mm", mutates_args=())
def wint_mm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
            zeros: torch.Tensor | None, g_idx: torch.Tensor | None, bias: torch.Tensor | None,
            bits: int, group_size: int) -> torch.Tensor:
    """``x @ W.T + bias`` in ``x``'s dtype for a 2-D ``x`` whose columns are already in
    resident order."""
    m, k = x.shape
    n, groups = scales.shape
    x = x.contiguous()
    qweight = qweight.contiguous()
    scales = scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else scales  # unused when None
    words_ok = qweight.shape[1] % 4 == 0 and qweight.data_ptr() % 4 == 0
    if m == 1 and words_ok and g_idx is None:
        y = _gemv_words(x, qweight.view(torch.int32), scales, zeros, bias, bits, group_size)
        if y is not None:
            return y
    return _accumulated(x, qweight, scales, zeros, g_idx, bits, group_size, words_ok,
                        bias).to(x.dtype)


#: per (device, rows): the split-K GEMV's float32 partial sums and arrival
#: counts, zero between calls (the kernel's last program of a tile clears them). Calls
#: on one device must not overlap (vLLM runs a model's layers on one stream).
_SPLIT_WORKSPACE: dict = {}


def _gemv_words(x, words, scales, zeros, bias, bits, group_size):
    """``_wint_gemv_words_kernel`` for a one-row ``x`` when its tiles divide the shape
    (no masks in the loop), else None."""
    n, k = words.shape[0], x.shape[1]
    planes = 32 // bits
    bn = next((b for b in GEMV_WORDS["bn"] if n % b == 0), None)
    bk = next((b for b in GEMV_WORDS["bk"] if k % b == 0), None)
    if bn is None or bk is None or group_size % planes:
        return None
    tiles, steps = n // bn, k // bk
    split = 1
    while tiles * split * 2 <= GEMV_WORDS["programs"] and steps % (split * 2) == 0:
        split *= 2
    key = (x.device, n)  # the row tile follows from n
    if split > 1 and key not in _SPLIT_WORKSPACE:
        _SPLIT_WORKSPACE[key] = (torch.zeros(n, dtype=torch.float32, device=x.device),
                                 torch.zeros(tiles, dtype=torch.int32, device=x.device))
    ws, count = _SPLIT_WORKSPACE[key] if split > 1 else (scales, scales)
    warps = max(1, min(4, bn * bk // planes // (32 * GEMV_WORDS["words_per_thread"])))
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    _wint_gemv_words_kernel[(tiles, split)](
        x, words, scales, zeros, bias if bias is not None else scales, y, ws, count,
        scales.shape[1], words.stride(0), BITS=bits, GROUP=group_size,
        HAS_Z=zeros is not scales, HAS_BIAS=bias is not None, BN=bn, BK=bk, KP=k // split,
        SPLIT=split, num_warps=warps, num_stages=1)
    return y


def _accumulated(x, qweight, scales, zeros, g_idx, bits, group_size, words_ok, bias):
    """float32 ``x @ W.T (+ bias)`` from the kernels that add K slices atomically."""
    m, k = x.shape
    n, groups = scales.shape
    if g_idx is None and bits == 4 and group_size % 2:  # a byte's nibbles in two groups
        g_idx = torch.arange(k, device=x.device) // group_size
    gidx = g_idx.to(torch.int32).contiguous() if g_idx is not None else scales
    common = dict(BITS=bits, HAS_Z=zeros is not scales, HAS_GIDX=gidx is not scales)
    dot_f32 = x.dtype == torch.float32 or (
        interpreted(_wint_gemm_kernel) and x.dtype == torch.bfloat16)
    if words_ok:
        words = qweight.view(torch.int32)
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        bm, bn = max(16, min(64, triton.next_power_of_2(m))), WORDS["bn"]
        bk = WORDS["bk"]
        if g_idx is None and 128 <= group_size < bk and bk % group_size == 0:
            bk = group_size  # one scale per row and tile
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        splits = max(1, min(triton.cdiv(k, bk), triton.cdiv(WORDS["programs"], tiles)))
        k_per_prog = triton.cdiv(triton.cdiv(k, splits), bk) * bk
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, k_per_prog))
        _wint_words_kernel[grid](x, words, scales, zeros, gidx, y, m, n, k, groups, group_size,
                                 x.stride(0), words.stride(0), y.stride(0), k_per_prog,
                                 BM=bm, BN=bn, BK=bk, DOT_F32=dot_f32,
                                 INTERLEAVE=m >= INTERLEAVE_MIN_ROWS and not dot_f32,
                                 ONE_GROUP=g_idx is None and group_size % bk == 0,
                                 num_warps=WORDS["num_warps"] if m <= 16 else 4,
                                 num_stages=WORDS["num_stages"],
                                 **common)
        return _plus(y, bias)
    if m <= GEMV_MAX_ROWS:
        y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
        bn, bk = GEMV["bn"], _k_tile(GEMV["bk"], group_size, g_idx)
        k_per_prog = triton.cdiv(triton.cdiv(k, GEMV["splits"]), bk) * bk
        grid = (triton.cdiv(n, bn), triton.cdiv(k, k_per_prog))
        _wint_gemv_kernel[grid](x, qweight, scales, zeros, gidx, y, n, k, groups,
                                group_size, x.stride(0), qweight.stride(0), y.stride(0),
                                k_per_prog, BN=bn, BK=bk, ROWS=m, num_warps=GEMV["num_warps"],
                                ONE_GROUP=_one_group(bk, group_size, g_idx), **common)
        return _plus(y, bias)
    y = torch.zeros(m, n, dtype=torch.float32, device=x.device)
    bm, bn = min(64, max(16, triton.next_power_of_2(m))), GEMM["bn"]
    bk = _k_tile(GEMM["bk"], group_size, g_idx)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    splits = max(1, min(triton.cdiv(k, bk), triton.cdiv(GEMM["programs"], tiles)))
    k_per_prog = triton.cdiv(triton.cdiv(k, splits), bk) * bk
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, k_per_prog))
    _wint_gemm_kernel[grid](x, qweight, scales, zeros, gidx, y, m, n, k, groups, group_size,
                            x.stride(0), qweight.stride(0), y.stride(0), k_per_prog,
                            BM=bm, BN=bn, BK=bk,
                            DOT_F32=dot_f32, ONE_GROUP=_one_group(bk, group_size, g_idx),
                            num_warps=GEMM["num_warps"],
                            num_stages=GEMM["num_stages"], **common)
    return _plus(y, bias)


def _plus(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if bias is not None:
        y += bias.to(torch.float32)
    return y


@wint_mm.register_fake
def _wint_mm_shape(x, qweight, scales, zeros, g_idx, bias, bits, group_size):
    return x.new_empty((x.shape[0], scales.shape[0]))


def wint_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, *, bits: int, group_size: int,
                perm: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as the ``reference`` ``wint_linear`` (quant/packed.py)."""
    out_features = scales.shape[0]
    in_features = x.shape[-1]
    gs = in_features if group_size == -1 else group_size
    x2 = x.reshape(-1, in_features)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    y = wint_mm(x2, qweight, scales, zeros, g_idx, bias, bits, gs)
    return y.reshape(*x.shape[:-1], out_features)
