"""``mla_latent_attention`` on Sophgo's ``my_ops::paged_latent_attention``.

The op is a whole MLA layer's attention (torch-tpu ``Mla.cpp``; its semantics in
torch-tpu's ``python/test/mla.py`` CPU model and vllm-tpu's DeepSeek caller): from
the latent query ``Q`` ``[T, Lq]``, the normalised latent ``KV`` ``[T, L]`` and the
un-rotated ``PE`` ``[T, R]`` it up-projects the query by ``WUQ`` ``[H * (P + R), Lq]``,
absorbs ``WUKV``'s key part ``[H, P, L]`` into it, rotates the rope parts with ``cos``
/ ``sin`` ``[T, 1, R]`` (DeepSeek's interleaved pairs, which it first de-interleaves:
halves ``[even | odd]``, then rotates neox-style), writes the new latents and rotated
rope parts into its two caches ``[blocks, BS, L]`` and ``[blocks, BS, R]`` (through the
block table at each request's ``cache_lengths`` in the prefill stage 2, at
``save_slots`` in the decode stage 3), attends causally over context and new tokens
with ``softmax_scale`` and applies ``WUKV``'s value part: ``[T, H, V]``.

vLLM's latent cache is one ``[blocks, BS, L + R]`` tensor with the rope part in its
interleaved order, so each call writes the new tokens there itself (the latents and
their rotated ``k_pe``, through the next provider's ``mla_cache_write``), then copies
the pages the batch reads into the op's two caches, the rope part de-interleaved (the
op's writes land in that copy, which is dropped). Lengths go as vllm-tpu passes
them: int32 on the host, ``input_lengths`` the tokens scheduled, ``cache_lengths``
those computed before. Decode batches (one new token each) run stage 3 with the new
tokens' slots, as torch-tpu's test does (or, where a build's decode stage does not
match, stage 2, which vllm-tpu calls for every batch); other batches stage 2 with the
block table as ``save_slots`` and a ``KVU`` scratch of ``max(new) + max(context)`` rows
for the decompressed keys and values (what torch-tpu's test allocates; vllm-tpu's
``max(new)`` rows are fewer).

Whether a build computes that is checked per (device, dtype, shapes, block size)
against the float64 oracle when the layer is built (:func:`serves`) and again on a
call's first use of a case -- a decode, a fresh prefill, a prefill after cached
context -- on two requests with random latents and the layer's shapes. Quantized
weights (``paged_latent_attention_fp8``'s block-fp8 ``WUQ``/``WUKV``) are not served:
vLLM's block-fp8 layers keep their own weight layout, and ``mla_layer.py`` keeps
quantized projections on vLLM's path.
"""

import functools

import torch

from vllm_accel.logger import init_logger
from vllm_accel.ops.paged_layout import new_token_slots, request_blocks
from vllm_accel.ops.reference.elementwise import rotate
from vllm_accel.ops.registry import fallback_kernel, get_kernel
from vllm_accel.ops.vendor.oracle_probe import first_match
from vllm_accel.ops.vendor.sophgo_attention import DECODE_STAGE, PREFILL_STAGE, SOPHGO_VENDOR

logger = init_logger(__name__)

KERNEL = "mla_latent_attention"
#: ``paged_latent_attention``'s argument types, as torch_tpu's C++ signature infers them
PAGED_LATENT_ATTENTION_ARGS = (("Tensor",) * 10 + ("Optional[Tensor]", "Tensor")
                               + ("Optional[Tensor]",) * 2 + ("Tensor",) * 2
                               + ("int",) * 10 + ("float", "int"))
#: the dtypes the op dispatches on (AT_DISPATCH_FLOATING_TYPES_AND2(Half, BFloat16))
SERVED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def deinterleaved(rope: int, device) -> torch.Tensor:
    """The rope dims' order inside the op: the even ones, then the odd ones."""
    return torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2))).to(device)


def latent_pages(kv_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
                 num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks each request reads (its first ``ceil(len / BS)`` table columns) ->
    their pages ``[n, BS, L + R]`` and a compact int32 table ``[B, num_blocks]`` over them
    (0 past a request's own)."""
    ids, compact = request_blocks(block_table, seq_lens, kv_cache.shape[1], num_blocks)
    return kv_cache.index_select(0, ids.long()), compact


def write_latents(kv_c_normed, k_pe, cos, sin, kv_cache, slot_mapping, provider) -> None:
    """The new tokens' latents and rotated ``k_pe`` into vLLM's cache (the provider
    after ``provider`` writes them)."""
    n, rope = k_pe.shape
    k_rot = rotate(k_pe.float(), cos.float(), sin.float(), n, rope, rope, False)
    fallback_kernel("mla_cache_write", provider)(kv_c_normed, k_rot.to(kv_cache.dtype),
                                                 kv_cache, slot_mapping)


@functools.cache
def make_kernel(op):
    """``mla_latent_attention`` over ``op``, with its checks (each run once per case
    and shape); the kernel's ``serves(...)`` runs them ahead of a model's first step."""
    verdicts: dict[tuple, int | None] = {}  # the stage that matched, or None

    def run(q_c, kv_c_normed, k_pe, cos, sin, w_uq, w_ukv, kv_cache, block_table, q_lens,
            seq_lens, heads, nope, v_dim, scale, stage):
        """The op in ``stage`` for requests with ``q_lens`` > 0 (host tensors), the
        cache holding the new tokens already."""
        lora, rope, bs = kv_c_normed.shape[-1], k_pe.shape[-1], kv_cache.shape[1]
        dev = q_c.device
        num_blocks = -(-int(seq_lens.max()) // bs)
        pages, compact = latent_pages(kv_cache, block_table, seq_lens, num_blocks)
        latent = pages[..., :lora].contiguous()
        pe = pages[..., lora:].index_select(-1, deinterleaved(rope, dev)).contiguous()
        context = seq_lens - q_lens
        table = compact.to(dev)
        if stage == DECODE_STAGE:
            kvu, mask_size = None, 0
            save = new_token_slots(compact, seq_lens, q_lens, bs).to(dev)
        else:
            save, mask_size = table, int(seq_lens.max())
            kvu = None if int(q_lens.max()) == 1 else q_c.new_empty(
                int(q_lens.max()) + int(context.max()), heads, nope + v_dim)
        out = q_c.new_empty(q_c.shape[0], heads, v_dim)
        op(out, q_c.contiguous(), kv_c_normed.contiguous(), k_pe.contiguous(),
           w_uq.contiguous(), w_ukv.contiguous(), latent, pe,
           torch.cat((cos, cos), -1)[:, None].contiguous(),
           torch.cat((sin, sin), -1)[:, None].contiguous(), table, save, kvu, None,
           q_lens.to(torch.int32), context.to(torch.int32), heads, 1, w_uq.shape[1], lora,
           nope, rope, v_dim, mask_size, num_blocks, bs, scale, stage)
        return out

    def works(case, dtype, device, heads, nope, rope, v_dim, q_lora, lora, bs) -> int | None:
        """The stage in which the op matches the oracle for ``case`` ("decode",
        "prefill", "context") at these shapes, on random latents and weights, or None.
        Decode tries the decode stage first, then the prefill stage (the one vllm-tpu
        calls for every batch). The case is built on the host in float32 whatever the
        defaults (a model is built under the card's device and dtype)."""
        key = (case, device, dtype, heads, nope, rope, v_dim, q_lora, lora, bs)
        if key not in verdicts:
            with torch.device("cpu"):
                verdicts[key] = check(key)
        return verdicts[key]

    def check(key) -> int | None:
        case, device, dtype, heads, nope, rope, v_dim, q_lora, lora, bs = key
        g = torch.Generator().manual_seed(0)

        def rand(*shape, std=1.0):
            return (torch.randn(*shape, generator=g, dtype=torch.float32) * std).to(dtype)

        q_lens = {"decode": [1, 1], "prefill": [bs + 3, 5], "context": [4, 2]}[case]
        seq_lens = torch.tensor([bs + 3, 5])
        starts = torch.tensor([0, q_lens[0], sum(q_lens)])
        t = sum(q_lens)
        w_uq = rand(heads * (nope + rope), q_lora, std=q_lora ** -0.5)
        w_ukv = rand(heads * (nope + v_dim), lora, std=lora ** -0.5)
        q_c, kv_c, k_pe = rand(t, q_lora), rand(t, lora), rand(t, rope)
        angles = torch.rand(t, rope // 2, generator=g, dtype=torch.float32) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        cache = rand(6, bs, lora + rope)
        table = torch.tensor([[3, 1, 5], [2, 4, 0]], dtype=torch.int32)
        slots = torch.cat([(table[i].long()[torch.arange(s - q, s) // bs] * bs
                            + torch.arange(s - q, s) % bs)
                           for i, (q, s) in enumerate(zip(q_lens, seq_lens.tolist()))])
        scale = (nope + rope) ** -0.5
        args = (cos, sin, w_uq, w_ukv)
        want = get_kernel(KERNEL, "reference")(
            q_c, kv_c, k_pe, *args, cache.clone(), table, starts, seq_lens, slots, heads,
            nope, v_dim, scale).double()
        norm = max(1.0, float(want.abs().max()))  # the tolerance is relative to the outputs

        def attempt(stage):
            mine = cache.to(device)
            on = [x.to(device) for x in (q_c, kv_c, k_pe, *args)]
            write_latents(on[1], on[2], on[3], on[4], mine, slots.to(device), SOPHGO_VENDOR)
            return run(*on[:3], *on[3:], mine, table.to(device), starts.diff(), seq_lens,
                       heads, nope, v_dim, scale, stage).cpu().double() / norm

        stages = (DECODE_STAGE, PREFILL_STAGE) if case == "decode" else (PREFILL_STAGE,)
        used, why = first_match(stages, attempt, want / norm, dtype)
        logger.info("sophgo_vendor paged_latent_attention %s on %s (%s, %d heads, %d+%d/%d, "
                    "q %d, latent %d, pages of %d): %s (stages tried: %s)", *key,
                    "used" if used else "the next provider serves it", why)
        return used

    def sophgo_mla_latent_attention(q_c, kv_c_normed, k_pe, cos, sin, w_uq, w_ukv, kv_cache,
                                    block_table, query_start_loc, seq_lens, slot_mapping,
                                    num_heads, qk_nope_head_dim, v_head_dim, scale):
        q_lens = query_start_loc.cpu().diff()
        lens = seq_lens.cpu()
        live = (q_lens > 0).nonzero().flatten()
        case = ("decode" if bool((q_lens[live] == 1).all()) else
                "context" if bool((lens[live] > q_lens[live]).any()) else "prefill")
        dims = (num_heads, qk_nope_head_dim, k_pe.shape[-1], v_head_dim, w_uq.shape[1],
                kv_c_normed.shape[-1], kv_cache.shape[1])
        eligible = (len(live) > 0 and q_c.dtype in SERVED_DTYPES
                    and kv_cache.dtype == w_uq.dtype == w_ukv.dtype == q_c.dtype)
        stage = works(case, q_c.dtype, q_c.device, *dims) if eligible else None
        if stage is None:
            return fallback_kernel(KERNEL, SOPHGO_VENDOR)(
                q_c, kv_c_normed, k_pe, cos, sin, w_uq, w_ukv, kv_cache, block_table,
                query_start_loc, seq_lens, slot_mapping, num_heads, qk_nope_head_dim,
                v_head_dim, scale)
        write_latents(kv_c_normed, k_pe, cos, sin, kv_cache, slot_mapping, SOPHGO_VENDOR)
        return run(q_c, kv_c_normed, k_pe, cos, sin, w_uq, w_ukv, kv_cache,
                   block_table[live.to(block_table.device)], q_lens[live], lens[live],
                   num_heads, qk_nope_head_dim, v_head_dim, scale, stage)

    def serves(dtype, device, heads, nope, rope, v_dim, q_lora, lora, bs) -> bool:
        """Whether every case passes its check at a layer's shapes."""
        return dtype in SERVED_DTYPES and all(
            works(case, dtype, device, heads, nope, rope, v_dim, q_lora, lora, bs) is not None
            for case in ("decode", "prefill", "context"))

    sophgo_mla_latent_attention.serves = serves
    return sophgo_mla_latent_attention


def sophgo_latent_kernel(ops):
    """A ``VENDOR_KERNELS`` factory: None (not registered) where the op's schema is not
    torch_tpu's."""
    op = ops["my_ops::paged_latent_attention"]
    if tuple(str(a.type) for a in op._schema.arguments) != PAGED_LATENT_ATTENTION_ARGS:
        return None
    return make_kernel(op)
