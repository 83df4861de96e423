"""The ``cpu_native`` provider: paged attention and KV-cache writers in C++.

The batched torch readers (``torch_fast/attention.py``) copy every request's K/V pages
out of the cache before two batched matmuls; at decode that gather costs as much
as the attention itself. The C++ kernel (``csrc/paged_attention.cpp``) reads the
pages in place: one pass per (token, kv head) over its keys and values for all
query heads of the group, float32 scores, softmax and sums, one rounding at the
end. Decode and short prefills use it; a prefill whose causal work is large
(long prompts) goes to the ``torch_fast`` matmuls, which win there.

Each kernel takes the same arguments as the other providers and falls back to
the next provider (``fallback_kernel``) for inputs the C ABI does not take
(non-CPU tensors, a cache dtype other than the query's) or when the library
could not be built (see ``native``). The C entry points are reached through the
dispatcher ops ``vllm_accel::cpu_paged_attention`` / ``cpu_cache_write``
(``csrc/torch_ops.cpp``, which check the inputs in C++) wherever that library
builds, else through ctypes with the checks in Python. Where it builds, the
attention backend runs a layer through one of them, ``cpu_attention_step``
(``attention_step``: both kernels, the output written in place), and uses the
kernels one by one only for what that op declines.
"""

import ctypes
import functools

import torch

from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.registry import fallback_kernel, register_kernel

NATIVE = "cpu_native"
#: prefill rows x visible keys above which the torch matmul path is faster
PREFILL_NATIVE_MAX_PAIRS = 1 << 20


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


def _pages(kv_cache: torch.Tensor) -> tuple[int, int] | None:
    """(block stride, head stride) in elements if every (block, head) page is
    contiguous, else ``None``."""
    _, _, block_size, width = kv_cache.shape
    block_stride, head_stride, token_stride, elem_stride = kv_cache.stride()
    if (elem_stride, token_stride) != (1, width):
        return None
    return block_stride, head_stride


def _native_ok(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, *int_tensors: torch.Tensor) -> bool:
    """Whether the C ABI takes these inputs. Its AVX-512 paths read 16 rows of a
    page at a time, hence block sizes that are multiples of 16 (what ACCEL_ATTN
    asks vLLM for); shapes the torch kernels would reject go to them."""
    int8 = kv_cache.dtype == torch.int8
    num_heads, num_kv_heads = query.shape[1], kv_cache.shape[1]
    return (
        native.library() is not None
        and query.device.type == "cpu" and kv_cache.device.type == "cpu"
        and native.dtype_code(query.dtype) is not None
        and (int8 or kv_cache.dtype == query.dtype)
        and query.stride(-1) == 1
        and kv_cache.shape[2] % 16 == 0
        and num_heads % num_kv_heads == 0
        and query.shape[2] == _head_size(kv_cache)
        and block_table.shape[0] >= seq_lens.shape[0]
        and _pages(kv_cache) is not None
        and all(t.dtype == torch.int32 and t.device.type == "cpu"
                for t in (block_table, seq_lens, *int_tensors))
    )


def _head_size(kv_cache: torch.Tensor) -> int:
    from vllm_accel.ops.paged_layout import INT8_SCALE_BYTES

    width = kv_cache.shape[-1]
    return (width - INT8_SCALE_BYTES) // 2 if kv_cache.dtype == torch.int8 else width // 2


#: errors the C entry points return (csrc/paged_attention.cpp): they check every
#: block id and slot before touching the cache, since a bad one would read or
#: write outside it rather than raise
_ERRORS = {
    -2: "a seq_len needs more blocks than the block table has columns",
    -3: "the block table holds ids outside the cache in the blocks a request reads",
    -4: "a slot is outside the cache",
}


def _raise_for(rc: int, entry: str) -> None:
    if rc in _ERRORS:
        raise ValueError(f"{entry}: {_ERRORS[rc]}")
    raise RuntimeError(f"{entry} failed ({rc})")


@functools.lru_cache(maxsize=1)
def _iota(n: int) -> torch.Tensor:
    """``0..n`` as int32 (a decode batch's query_start_loc), reused across layers."""
    return torch.arange(n + 1, dtype=torch.int32)


def _per_head(t: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """ALiBi slopes or sink logits as the kernel reads them: float32 ``[H]`` on the CPU."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.tensor(t)
    return t.to(device="cpu", dtype=torch.float32).contiguous().view(num_heads)


def _attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale, padded=True,
               sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    """Run the C++ kernel; ``query`` ``[T, H, D]``, returns ``[T, H, D]``."""
    num_rows, num_heads, head_size = query.shape
    out = torch.empty_like(query)
    block_table = block_table.contiguous() if block_table.stride(-1) != 1 else block_table
    query_start_loc, seq_lens = query_start_loc.contiguous(), seq_lens.contiguous()
    block_stride, head_stride = _pages(kv_cache)
    rc = native.library().accel_paged_attention(
        native.dtype_code(query.dtype), _ptr(query), query.stride(0), query.stride(1),
        _ptr(out), out.stride(0), out.stride(1),
        _ptr(kv_cache), int(kv_cache.dtype == torch.int8), block_stride, head_stride,
        kv_cache.shape[2], head_size, kv_cache.shape[0],
        _ptr(block_table), block_table.stride(0), block_table.shape[1], _ptr(query_start_loc),
        _ptr(seq_lens), seq_lens.shape[0], num_heads, kv_cache.shape[1], ctypes.c_float(scale),
        sliding_window or 0, ctypes.c_float(logits_soft_cap or 0.0),
        None if alibi_slopes is None else _ptr(alibi_slopes),
        None if sinks is None else _ptr(sinks),
    )
    if rc:
        _raise_for(rc, "accel_paged_attention")
    if padded:  # rows past the last request's are not written by the kernel
        out[int(query_start_loc[-1]):].zero_()
    return out


@functools.cache
def _dispatched() -> bool:
    """Whether the C++ ops (``csrc/torch_ops.cpp``) check the inputs and call the
    kernels: no Python per call beyond the op's (~20 us less a layer than ctypes)."""
    return native.torch_ops() is not None


def _run(query, kv_cache, block_table, query_start_loc, seq_lens, scale, padded,
         sliding_window=None, logits_soft_cap=None, alibi_slopes=None, sinks=None):
    """The kernel's ``[T, H, D]`` output, or ``None`` where it does not take these inputs."""
    num_heads = query.shape[1]
    alibi_slopes, sinks = _per_head(alibi_slopes, num_heads), _per_head(sinks, num_heads)
    if _dispatched():
        out = torch.ops.vllm_accel.cpu_paged_attention(
            query, kv_cache, block_table, query_start_loc, seq_lens, scale, padded,
            sliding_window or 0, logits_soft_cap or 0.0, alibi_slopes, sinks)
        return out if out.dim() == 3 else None
    if (not _native_ok(query, kv_cache, block_table, seq_lens, query_start_loc)
            or query_start_loc.shape[0] != seq_lens.shape[0] + 1
            or int(query_start_loc[-1]) > query.shape[0]):
        return None
    return _attention(query, kv_cache, block_table, query_start_loc, seq_lens, scale, padded,
                      sliding_window, logits_soft_cap, alibi_slopes, sinks)


def _decode(name):
    def paged_decode(query, kv_cache, block_table, seq_lens, scale, **features):
        """One query token per request ``[B, H, D]``."""
        if seq_lens.shape[0] == query.shape[0]:
            out = _run(query, kv_cache, block_table, _iota(query.shape[0]), seq_lens, scale,
                       padded=False, **features)
            if out is not None:
                return out
        return fallback_kernel(name, NATIVE)(query, kv_cache, block_table, seq_lens, scale,
                                             **features)

    paged_decode.__name__ = name
    return register_kernel(name, NATIVE)(paged_decode)


def _prefill_pairs(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                   sliding_window: int | None = None) -> int:
    """Sum over query rows of the keys each row sees (the causal work; with a window,
    at most that many a row)."""
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    context = seq_lens.long() - q_lens
    pairs = q_lens * context + q_lens * (q_lens + 1) // 2
    if sliding_window:
        # rows past the window's length see `sliding_window` keys each
        w = sliding_window
        first = context + 1  # the first row's keys
        full = (seq_lens.long() - torch.maximum(first, torch.full_like(first, w)) + 1).clamp(min=0)
        short = q_lens - full  # rows seeing fewer than w keys: first .. w-1
        last_short = first + short - 1
        pairs = full * w + (first + last_short) * short // 2
    return int(pairs.sum())


def _prefill(name):
    def paged_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                      **features):
        """Causal attention for the newest ``q_len`` tokens of each request."""
        if (query_start_loc.shape[0] == seq_lens.shape[0] + 1
                and _prefill_pairs(query_start_loc, seq_lens, features.get("sliding_window"))
                <= PREFILL_NATIVE_MAX_PAIRS):
            out = _run(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                       padded=True, **features)
            if out is not None:
                return out
        return fallback_kernel(name, NATIVE)(query, kv_cache, block_table, query_start_loc,
                                             seq_lens, scale, **features)

    paged_prefill.__name__ = name
    return register_kernel(name, NATIVE)(paged_prefill)


def _ctypes_cache_write(key, value, kv_cache, slot_mapping, int8, k_scale, v_scale) -> bool:
    """``accel_cache_write`` through ctypes (the first ``len(slot_mapping)`` rows of K/V);
    False where it does not take these inputs."""
    n = slot_mapping.shape[0]
    if (native.library() is None or key.shape[0] < n or value.shape[0] < n
            or key.device.type != "cpu"
            or kv_cache.device.type != "cpu" or native.dtype_code(key.dtype) is None
            or (not int8 and kv_cache.dtype != key.dtype) or value.dtype != key.dtype
            or key.stride(-1) != 1 or value.stride(-1) != 1
            or key.shape[1:] != (kv_cache.shape[1], _head_size(kv_cache))
            or _pages(kv_cache) is None):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    block_stride, head_stride = _pages(kv_cache)
    rc = native.library().accel_cache_write(
        native.dtype_code(key.dtype), _ptr(key), _ptr(value), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1),
        _ptr(kv_cache), int(int8), block_stride, head_stride, _ptr(slots), n,
        kv_cache.shape[1], kv_cache.shape[2], _head_size(kv_cache), kv_cache.shape[0],
        ctypes.c_float(k_scale or 0.0), ctypes.c_float(v_scale or 0.0),
    )
    if rc:
        _raise_for(rc, "accel_cache_write")
    return True


def _cache_write(name, int8):
    def cache_write(key, value, kv_cache, slot_mapping, k_scale=None, v_scale=None):
        """Scatter (quantizing, for an INT8 cache) new K/V ``[T, Hkv, D]`` into their slots."""
        if _dispatched():  # both C paths write the first len(slot_mapping) rows
            written = torch.ops.vllm_accel.cpu_cache_write(key, value, kv_cache, slot_mapping,
                                                           k_scale or 0.0, v_scale or 0.0)
        else:
            written = _ctypes_cache_write(key, value, kv_cache, slot_mapping, int8, k_scale,
                                          v_scale)
        if not written:
            n = slot_mapping.shape[0]
            static = (k_scale, v_scale) if int8 else ()
            fallback_kernel(name, NATIVE)(key[:n], value[:n], kv_cache, slot_mapping, *static)

    cache_write.__name__ = name
    return register_kernel(name, NATIVE)(cache_write)


def _attention_step(name):
    def attention_step(query, key, value, kv_cache, slot_mapping, block_table, query_start_loc,
                       seq_lens, output, scale, k_scale=None, v_scale=None, *,
                       sliding_window=None, logits_soft_cap=None, alibi_slopes=None,
                       sinks=None) -> bool:
        """A layer's cache write and attention over the whole batch in one C++ call,
        into ``output`` ``[T, H, D]``: True, or False with nothing done where the
        kernels must run one by one (inputs they do not take, a long prefill, or no
        dispatcher library)."""
        num_heads = query.shape[1]
        return _dispatched() and torch.ops.vllm_accel.cpu_attention_step(
            query, key, value, kv_cache, slot_mapping, block_table, query_start_loc, seq_lens,
            output, scale, k_scale or 0.0, v_scale or 0.0, PREFILL_NATIVE_MAX_PAIRS,
            sliding_window or 0, logits_soft_cap or 0.0, _per_head(alibi_slopes, num_heads),
            _per_head(sinks, num_heads))

    attention_step.__name__ = name
    return register_kernel(name, NATIVE)(attention_step)


paged_decode = _decode("paged_decode")
paged_decode_int8 = _decode("paged_decode_int8")
paged_prefill = _prefill("paged_prefill")
paged_prefill_int8 = _prefill("paged_prefill_int8")
cache_write = _cache_write("cache_write", int8=False)
cache_write_int8 = _cache_write("cache_write_int8", int8=True)
attention_step = _attention_step("attention_step")
attention_step_int8 = _attention_step("attention_step_int8")
