"""The check a vendor attention adapter runs on its first call per shape: a small
paged-attention case shaped like the call (heads, head size, pages, dtype), run
through the vendor op and compared with the float64 oracle (``reference``)."""

from collections.abc import Callable, Iterable

import torch

#: bf16/fp16 outputs of a softmax average of unit-scale values: a few ulps
PROBE_TOLERANCE = 3e-2
#: float32 outputs: the op's own summation order only
PROBE_TOLERANCE_FP32 = 1e-4


def probe_case(query: torch.Tensor, kv_cache: torch.Tensor, q_lens: list[int],
               scale: float, **features):
    """Two requests of ``bs + 3`` and 5 tokens, the newest ``q_lens`` of each queried,
    on CPU in the call's dtype: (query, cache, table, query_start_loc, seq_lens), and
    the float64 oracle's output."""
    from vllm_accel.ops.reference.attention import paged_attention

    g = torch.Generator().manual_seed(0)
    heads, hkv, bs, d = query.shape[1], kv_cache.shape[1], kv_cache.shape[2], query.shape[-1]
    cache = torch.randn(6, hkv, bs, 2 * d, generator=g).to(query.dtype)
    table = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32)
    seq_lens = torch.tensor([bs + 3, 5])
    starts = torch.tensor([0, q_lens[0], q_lens[0] + q_lens[1]])
    q = torch.randn(int(starts[-1]), heads, d, generator=g).to(query.dtype)
    want = paged_attention(q.double(), cache.double(), table, starts, seq_lens, scale,
                           **features)
    return (q, cache, table, starts, seq_lens), want


def first_match(candidates: Iterable, attempt: Callable, want: torch.Tensor,
                dtype: torch.dtype) -> tuple[object | None, str]:
    """The first candidate whose ``attempt(candidate)`` matches ``want`` within the
    dtype's tolerance, or None (the op raising ends the search: the build refuses the
    shapes); and why, for the log."""
    tol = PROBE_TOLERANCE_FP32 if dtype == torch.float32 else PROBE_TOLERANCE
    errors = []
    for candidate in candidates:
        try:
            got = attempt(candidate)
        except Exception as exc:
            errors.append(f"{candidate}: {type(exc).__name__}: {exc}")
            break
        error = float((got.cpu().double() - want).abs().max())
        if error <= tol:
            return candidate, f"{candidate}: max error {error:.2g} against the float64 oracle"
        errors.append(f"{candidate}: max error {error:.2g}")
    return None, "; ".join(errors)
