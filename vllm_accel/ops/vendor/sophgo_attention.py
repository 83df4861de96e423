"""``paged_decode`` and ``paged_prefill`` on Sophgo's ``my_ops::paged_attention_v3``.

The op attends over a cache of its own: contiguous K and V ``[num_blocks, block_size,
Hkv, D]`` (torch_tpu copies non-contiguous ones first, so a view of ours would lose
its writes), writes the new tokens' K/V at ``save_slots`` itself and can apply RoPE
(``cos``/``sin``). Our cache keeps one layout for every provider (pages per (block,
head), K rows then V rows), so each call copies the blocks the batch reads into
those two tensors (gathered, then re-laid out: two copies of them), hands the op the new tokens' K/V
read back from that copy with their slots in it (the op rewrites what is there; the
copy is dropped), no ``cos``/``sin`` (the model has applied RoPE) and the lengths as
vllm-tpu passes them: ``input_lengths`` the tokens scheduled, ``cache_lengths`` the
tokens computed before, both int32 on the host (the op reads them there), the
stage explicit (2 prefill, 3 decode).

Whether a build computes what that contract says is decided per (device, dtype, head
size, block size) on the first call, against the float64 oracle: a decode of two
requests, a prefill of a fresh prompt, a prefill after cached context (chunked
prefill, prefix caching). What fails goes to the next provider (logged), as do
sliding windows, soft-caps, ALiBi and sinks (the op takes none; vllm-tpu refuses
them too) and caches not in the query's dtype.
"""

import functools
from collections.abc import Callable

import torch

from vllm_accel.logger import init_logger
from vllm_accel.ops.paged_layout import gather_request_pages, new_token_slots
from vllm_accel.ops.registry import fallback_kernel
from vllm_accel.ops.vendor.oracle_probe import first_match, probe_case

logger = init_logger(__name__)

SOPHGO_VENDOR = "sophgo_vendor"
#: ``paged_attention_v3``'s argument types, as torch_tpu's C++ signature infers them
PAGED_ATTENTION_V3_ARGS = (("Tensor",) * 6 + ("Optional[Tensor]",) * 2 + ("Tensor",) * 4
                           + ("Optional[Tensor]", "float", "int", "int"))
PREFILL_STAGE, DECODE_STAGE = 2, 3


def sophgo_cache(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor):
    """The pages the requests read (``seq_lens`` tokens each) as Sophgo's K and V
    caches ``[n, BS, Hkv, D]`` and a compact int32 block table over them."""
    block_size = kv_cache.shape[2]
    nblk = -(-int(seq_lens.max()) // block_size)
    k, v, compact = gather_request_pages(kv_cache, block_table, seq_lens, nblk)
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous(), compact


@functools.cache
def make_kernels(op) -> tuple[Callable, Callable]:
    """(``paged_decode``, ``paged_prefill``) over ``op``, sharing its checks (each run
    once per case and shape)."""
    verdicts: dict[tuple, bool] = {}

    def run(query, kv_cache, block_table, q_lens, seq_lens, scale, stage):
        """``query`` ``[sum(q_lens), H, D]`` of requests with ``q_lens``/``seq_lens`` > 0
        (host tensors)."""
        kcache, vcache, compact = sophgo_cache(kv_cache, block_table, seq_lens)
        slots = new_token_slots(compact, seq_lens, q_lens, kcache.shape[1]).to(query.device)
        hkv, d = kcache.shape[2:]
        key = kcache.view(-1, hkv, d)[slots.long()]
        value = vcache.view(-1, hkv, d)[slots.long()]
        out = torch.empty_like(query)
        op(out, query.contiguous(), key, value, kcache, vcache, None, None,
           q_lens.to(torch.int32), (seq_lens - q_lens).to(torch.int32), slots,
           compact.to(query.device), None, scale, int(seq_lens.max()), stage)
        return out

    def works(case, query, kv_cache) -> bool:
        """Whether the op matches the oracle for ``case`` ("decode", "prefill",
        "context") with this query's device, dtype, head size and heads, and these pages."""
        key = (case, query.device, query.dtype, query.shape[-1], kv_cache.shape[2],
               query.shape[1], kv_cache.shape[1])
        if key not in verdicts:
            bs = kv_cache.shape[2]
            q_lens = {"decode": [1, 1], "prefill": [bs + 3, 5], "context": [4, 2]}[case]
            (q, cache, table, starts, seq_lens), want = probe_case(query, kv_cache, q_lens,
                                                                   0.125)
            dev = query.device
            stage = DECODE_STAGE if case == "decode" else PREFILL_STAGE
            used, why = first_match((stage,), lambda stage: run(
                q.to(dev), cache.to(dev), table.to(dev), starts.diff(), seq_lens, 0.125,
                stage), want, query.dtype)
            verdicts[key] = used is not None
            logger.info("sophgo_vendor paged_attention_v3 %s on %s (%s, head %d, pages of %d, "
                        "%d/%d heads): %s (stage %s)", *key,
                        "used" if used else "the next provider serves it", why)
        return verdicts[key]

    def served(query, kv_cache, features) -> bool:
        return (not features and kv_cache.dtype == query.dtype
                and query.dtype in (torch.bfloat16, torch.float16, torch.float32))

    def sophgo_paged_decode(query, kv_cache, block_table, seq_lens, scale, **features):
        lens = seq_lens.cpu()
        live = (lens > 0).nonzero().flatten()
        if not (served(query, kv_cache, features) and len(live)
                and works("decode", query, kv_cache)):
            return fallback_kernel("paged_decode", SOPHGO_VENDOR)(
                query, kv_cache, block_table, seq_lens, scale, **features)
        out = torch.zeros_like(query)  # requests without cached tokens (padding) read nothing
        rows = live.to(query.device)
        out[rows] = run(query[rows], kv_cache, block_table[rows], torch.ones_like(live),
                        lens[live], scale, DECODE_STAGE)
        return out

    def sophgo_paged_prefill(query, kv_cache, block_table, query_start_loc, seq_lens, scale,
                             **features):
        q_lens = query_start_loc.cpu().diff()
        lens = seq_lens.cpu()
        live = (q_lens > 0).nonzero().flatten()
        # one new token each: torch_tpu takes its decode path whatever the stage
        one_each = bool((q_lens[live] == 1).all())
        case = ("decode" if one_each else "context" if bool((lens[live] > q_lens[live]).any())
                else "prefill")
        if not (served(query, kv_cache, features) and len(live)
                and works(case, query, kv_cache)):
            return fallback_kernel("paged_prefill", SOPHGO_VENDOR)(
                query, kv_cache, block_table, query_start_loc, seq_lens, scale, **features)
        return run(query, kv_cache, block_table[live.to(block_table.device)], q_lens[live],
                   lens[live], scale, DECODE_STAGE if one_each else PREFILL_STAGE)

    return sophgo_paged_decode, sophgo_paged_prefill


def sophgo_paged_kernel(name: str):
    """A ``VENDOR_KERNELS`` factory for ``name`` (``paged_decode`` / ``paged_prefill``):
    None (not registered) where the op's schema is not torch_tpu's."""
    def factory(ops):
        op = ops["my_ops::paged_attention_v3"]
        if tuple(str(a.type) for a in op._schema.arguments) != PAGED_ATTENTION_V3_ARGS:
            return None
        decode, prefill = make_kernels(op)
        return decode if name == "paged_decode" else prefill
    return factory
