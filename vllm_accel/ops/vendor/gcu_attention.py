"""Enflame's paged attention ops as ``paged_decode`` (``_C::paged_attention_v1``) and
``paged_prefill`` (``_C::context_attention_forward``, vllm-gcu's V0 prefill with cached
context).

Both read vLLM's paged-attention tensors (K ``[nb, Hkv, D/x, bs, x]``, V ``[nb, Hkv, D,
bs]``), not our cache: each call gathers the pages the batch reads into them (one read
and write of them) and hands the op a compact block table over them. Which memory order
a build reads behind those shapes (upstream's, or the ``[nb, Hkv, bs, D]`` that
vllm-gcu's sources show) is decided on the first call per device, dtype, head size and
block size against the float64 oracle; neither matching sends the calls to the next
provider (logged).
"""

import torch

from vllm_accel.logger import init_logger
from vllm_accel.ops.paged_layout import gather_request_pages, new_token_slots
from vllm_accel.ops.registry import fallback_kernel
from vllm_accel.ops.vendor.oracle_probe import first_match, probe_case

logger = init_logger(__name__)

GCU_VENDOR = "gcu_vendor"


#: head sizes vLLM's paged-attention kernels are built for (Enflame's fork keeps the list)
PAGED_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
#: the values the adapter passes for ``paged_attention_v1``'s arguments after
#: ``kv_cache_dtype``, by name: no KV scaling (Enflame's float scales and zero-points,
#: or upstream's tensor scales), rank 0's heads, no block-sparse layout
_PAGED_ATTENTION_TAIL = {"k_scale": 1.0, "v_scale": 1.0, "tp_rank": 0,
                         "blocksparse_local_blocks": 0, "blocksparse_vert_stride": 0,
                         "blocksparse_block_size": 64, "blocksparse_head_sliding_step": 0,
                         "k_zero": 0.0, "v_zero": 0.0}
#: the types of ``paged_attention_v1``'s first arguments (out!, query, key_cache,
#: value_cache, num_kv_heads, scale, block_tables, seq_lens -- ``context_lens`` in some
#: forks --, block_size, max_seq_len, alibi_slopes, kv_cache_dtype)
_PAGED_ATTENTION_HEAD = ("Tensor",) * 4 + ("int", "float", "Tensor", "Tensor", "int", "int",
                                           "Optional[Tensor]", "str")


#: vllm-gcu calls ``paged_attention_v1`` up to this context only (``paged_attn.py``;
#: ``_v2`` beyond): longer contexts go to the next provider
PAGED_ATTENTION_V1_MAX_LEN = 8192


def _paged_layout(k: torch.Tensor, v: torch.Tensor, layout: str):
    """Pages ``[n, Hkv, BS, D]`` as ``paged_attention_v1``'s K ``[n, Hkv, D/x, BS, x]``
    (``x`` elements make 16 bytes) and V ``[n, Hkv, D, BS]``. ``"vllm"``: those shapes'
    memory order (upstream's CUDA kernel); ``"gcu"``: the same shapes over
    ``[n, Hkv, BS, D]`` memory, the order Enflame's cache writer stores (vllm-gcu's
    FlashAttention backend reads the very tensors it hands this op as
    ``[num_blocks, num_kv_heads, block_size, head_size]``)."""
    n, hkv, block_size, d = k.shape
    x = 16 // k.element_size()
    if layout == "gcu":
        return k.view(n, hkv, d // x, block_size, x), v.view(n, hkv, d, block_size)
    key = k.view(n, hkv, block_size, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
    return key, v.transpose(2, 3).contiguous()


def _gcu_paged_decode(ops):
    """``paged_decode`` on ``_C::paged_attention_v1``, which reads vLLM's paged-attention
    tensors (K ``[nb, H, D/x, bs, x]``, V ``[nb, H, D, bs]``), not our cache.

    Each call gathers the pages the batch reads (one read and write of them) into
    those tensors and hands the op a compact block table over them. Which memory order
    the build reads behind those shapes (upstream's, or the ``[nb, H, bs, D]`` that
    vllm-gcu's sources show) is decided on the first call on each device: a small
    decode in both orders against the float64 oracle; neither matching sends every
    call to the next provider (logged). ALiBi is the op's own (``alibi_slopes``);
    windows, soft-caps, sinks, head sizes outside vLLM's list and contexts past
    :data:`PAGED_ATTENTION_V1_MAX_LEN` go to the next provider. The first twelve
    arguments are matched by type (forks name the lengths differently), those after
    ``kv_cache_dtype`` filled by name, so Enflame's schema (float scales with
    zero-points, ``out_scales``, ``query_scales``) and upstream vLLM's (tensor scales),
    which the library keeps when vLLM defined the op first, both work. Returns None
    (not registered) for any other schema.
    """
    op = ops["_C::paged_attention_v1"]
    args = op._schema.arguments
    if tuple(str(a.type) for a in args[:len(_PAGED_ATTENTION_HEAD)]) != _PAGED_ATTENTION_HEAD:
        return None
    tail_spec = []
    for a in args[len(_PAGED_ATTENTION_HEAD):]:
        if a.name in _PAGED_ATTENTION_TAIL:
            tail_spec.append((a.name, a.type == torch._C.TensorType.get()))
        elif isinstance(a.type, torch._C.OptionalType):
            tail_spec.append((a.name, None))
        else:
            return None
    tails: dict[torch.device, list] = {}  # the tail's values, built once per device
    layouts: dict[tuple, str | None] = {}  # (device, dtype, D, BS) -> the order it reads

    def tail(device):
        if device not in tails:
            tails[device] = [
                None if as_tensor is None
                else torch.tensor(_PAGED_ATTENTION_TAIL[name], dtype=torch.float32,
                                  device=device) if as_tensor
                else _PAGED_ATTENTION_TAIL[name]
                for name, as_tensor in tail_spec]
        return tails[device]

    def run(layout, query, kv_cache, block_table, lens, max_len, scale, slopes):
        b = query.shape[0]
        nblk = -(-max_len // kv_cache.shape[2])
        k, v, compact = gather_request_pages(kv_cache, block_table, lens, nblk)
        key_cache, value_cache = _paged_layout(k, v, layout)
        out = torch.empty_like(query)
        op(out, query.contiguous(), key_cache, value_cache, kv_cache.shape[1], scale, compact,
           lens, kv_cache.shape[2], max_len, slopes, "auto", *tail(query.device))
        # requests without cached tokens (batch padding) read nothing: zeros
        return out.masked_fill_((lens == 0).view(b, 1, 1), 0)

    def layout_for(query, kv_cache):
        """The memory order the op reads on this device, from a small decode in each."""
        key = (query.device, query.dtype, query.shape[-1], kv_cache.shape[2], query.shape[1],
               kv_cache.shape[1])
        if key not in layouts:
            (q, cache, table, _, lens), want = probe_case(query, kv_cache, [1, 1], 0.125)
            dev, lens = query.device, lens.to(torch.int32)
            layouts[key], why = first_match(("gcu", "vllm"), lambda layout: run(
                layout, q.to(dev), cache.to(dev), table.to(dev), lens.to(dev),
                int(lens.max()), 0.125, None), want, query.dtype)
            logger.info("gcu_vendor paged_decode on %s (%s, head %d, pages of %d, %d/%d "
                        "heads): paged_attention_v1 %s (%s)", *key,
                        f"reads the {layouts[key]} order" if layouts[key] else
                        "matches the oracle in neither order; the next provider decodes", why)
        return layouts[key]

    def gcu_paged_decode(query, kv_cache, block_table, seq_lens, scale, **features):
        b, h, d = query.shape
        lens = seq_lens.to(torch.int32)
        max_len = int(lens.max()) if b else 0
        if (set(features) - {"alibi_slopes"} or kv_cache.dtype != query.dtype
                or d not in PAGED_ATTENTION_HEAD_SIZES
                or not 0 < max_len <= PAGED_ATTENTION_V1_MAX_LEN
                or (layout := layout_for(query, kv_cache)) is None):
            return fallback_kernel("paged_decode", GCU_VENDOR)(
                query, kv_cache, block_table, seq_lens, scale, **features)
        return run(layout, query, kv_cache, block_table, lens, max_len, scale,
                   features.get("alibi_slopes"))

    return gcu_paged_decode


#: ``context_attention_forward``'s argument types (vllm-gcu's ``gcu_custom_functions.yaml``:
#: q, k, v, o!, key_cache, value_cache, block_tables, subquery_start_loc,
#: seq_lens_tensor, context_lens, max_query_len, alibi_slopes, sliding_window)
_CONTEXT_ATTENTION_ARGS = ("Tensor",) * 10 + ("int", "Optional[Tensor]", "Optional[int]")


def _gcu_context_attention(ops):
    """``paged_prefill`` on ``_C::context_attention_forward``: each request's new tokens
    (``q``, ``k``, ``v``) attend causally after its cached context, read from vLLM's
    paged-attention tensors (the module docstring: gathered per call, memory order
    probed). The new tokens' K/V are read back from the gathered pages (our cache
    holds them already).

    The op takes no scale: it scales by ``head_size ** -0.5`` (vllm-gcu's V0 backends
    pass none), so layers with another scale (Gemma's ``query_pre_attn_scalar``) go to
    the next provider. ALiBi and windows are the op's own, each checked by its own
    probe (with a window, each request's pages are gathered from its first query's
    window on, positions shifted: those before may be vLLM's freed null block);
    soft-caps, sinks, both features at once, head sizes outside vLLM's list and caches
    not in the query's dtype go to the next provider. Returns None (not registered)
    for another schema.
    """
    op = ops["_C::context_attention_forward"]
    if tuple(str(a.type) for a in op._schema.arguments) != _CONTEXT_ATTENTION_ARGS:
        return None
    orders: dict[tuple, str | None] = {}

    def run(order, query, kv_cache, block_table, q_lens, seq_lens, window, slopes):
        """Requests with ``q_lens`` > 0 (host tensors) and their query rows."""
        block_size = kv_cache.shape[2]
        if window:  # from each first query's window on: the blocks before may be freed
            skip = (seq_lens - q_lens - window + 1).clamp(min=0) // block_size
            width = block_table.shape[1]
            cols = (skip[:, None] + torch.arange(width)).clamp(max=width - 1)
            block_table = block_table.gather(1, cols.to(block_table.device))
            seq_lens = seq_lens - skip * block_size  # positions shift, distances do not
        k, v, compact = gather_request_pages(kv_cache, block_table, seq_lens,
                                             -(-int(seq_lens.max()) // block_size))
        slots = new_token_slots(compact, seq_lens, q_lens, block_size).long().to(k.device)
        blocks, offsets = slots // block_size, slots % block_size
        key, value = k[blocks, :, offsets], v[blocks, :, offsets]  # [T, Hkv, D]
        key_cache, value_cache = _paged_layout(k, v, order)
        dev = query.device
        starts = (q_lens.cumsum(0) - q_lens).to(dev, torch.int32)
        out = torch.empty_like(query)
        op(query.contiguous(), key, value, out, key_cache, value_cache, compact.to(dev),
           starts, seq_lens.to(dev, torch.int32), (seq_lens - q_lens).to(dev, torch.int32),
           int(q_lens.max()), slopes, window)
        return out

    def order_for(kind, query, kv_cache):
        """The memory order the op reads with ``kind`` ("causal", "alibi", "window") on
        this device, from a small prefill after cached context in each order."""
        h, d = query.shape[1:]
        key = (kind, query.device, query.dtype, d, kv_cache.shape[2], h, kv_cache.shape[1])
        if key not in orders:
            features = ({"alibi_slopes": torch.linspace(0.5, 0.05, h)} if kind == "alibi"
                        else {"sliding_window": 3} if kind == "window" else {})
            (q, cache, table, starts, seq_lens), want = probe_case(
                query, kv_cache, [4, 5], d ** -0.5, **features)
            dev = query.device
            slopes = features.get("alibi_slopes")
            orders[key], why = first_match(("gcu", "vllm"), lambda order: run(
                order, q.to(dev), cache.to(dev), table.to(dev), starts.diff(), seq_lens,
                features.get("sliding_window"), None if slopes is None else slopes.to(dev)),
                want, query.dtype)
            logger.info("gcu_vendor paged_prefill (%s) on %s (%s, head %d, pages of %d, %d/%d "
                        "heads): context_attention_forward %s (%s)", *key,
                        f"reads the {orders[key]} order" if orders[key] else
                        "matches the oracle in neither order; the next provider serves it",
                        why)
        return orders[key]

    def gcu_context_attention(query, kv_cache, block_table, query_start_loc, seq_lens,
                              scale, **features):
        d = query.shape[-1]
        q_lens, lens = query_start_loc.cpu().diff(), seq_lens.cpu()
        live = (q_lens > 0).nonzero().flatten()
        kind = ("alibi" if "alibi_slopes" in features
                else "window" if "sliding_window" in features else "causal")
        if (len(features) > 1 or set(features) - {"alibi_slopes", "sliding_window"}
                or abs(scale * d ** 0.5 - 1) > 1e-6 or kv_cache.dtype != query.dtype
                or d not in PAGED_ATTENTION_HEAD_SIZES or not len(live)
                or (order := order_for(kind, query, kv_cache)) is None):
            return fallback_kernel("paged_prefill", GCU_VENDOR)(
                query, kv_cache, block_table, query_start_loc, seq_lens, scale, **features)
        return run(order, query, kv_cache, block_table[live.to(block_table.device)],
                   q_lens[live], lens[live], features.get("sliding_window"),
                   features.get("alibi_slopes"))

    return gcu_context_attention
