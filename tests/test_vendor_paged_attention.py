"""The GCU vendor decode-attention adapter (``_C::paged_attention_v1`` over vLLM's paged
layout) against the schemas the op has: Enflame's (float scales, zero-points,
``out_scales``, ``query_scales``) and upstream vLLM's (tensor scales), which Enflame's
library keeps when vLLM defined the op first. Each schema is defined in a test
namespace with a CPU implementation that checks what the adapter passes where, reads
the vLLM-layout caches back into dense K/V by plain indexing and answers with float64
math; the fake Enflame library (test_backend_faithful) covers Enflame's schema on the
PrivateUse1 device. A schema the adapter does not know is not registered."""

import functools

import pytest
import torch

from vllm_accel.ops.reference import attention as attn_ref
from vllm_accel.ops.vendor.gcu_attention import PAGED_ATTENTION_V1_MAX_LEN, _gcu_paged_decode

HEAD = ("Tensor! out, Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, "
        "float scale, Tensor block_tables, Tensor seq_lens, int block_size, int max_seq_len, "
        "Tensor? alibi_slopes, str kv_cache_dtype, ")
BLOCKSPARSE = ("int tp_rank, int blocksparse_local_blocks, int blocksparse_vert_stride, "
               "int blocksparse_block_size, int blocksparse_head_sliding_step")
SCHEMAS = {
    "enflame": HEAD + "float k_scale, float v_scale, " + BLOCKSPARSE
    + ", float k_zero, float v_zero, Tensor? out_scales, Tensor? query_scales",
    "upstream": HEAD + "Tensor k_scale, Tensor v_scale, " + BLOCKSPARSE,
    "unknown": HEAD + "Tensor k_scale, Tensor v_scale, int tp_rank, int new_required_arg",
    "scrambled": HEAD + "Tensor k_scale, Tensor v_scale, " + BLOCKSPARSE,
    # the names vllm-gcu's op schema file gives the lengths
    "context_lens": (HEAD.replace("seq_lens", "context_lens").replace("max_seq_len",
                                                                      "max_context_len")
                     + "float k_scale, float v_scale, " + BLOCKSPARSE
                     + ", float k_zero, float v_zero, Tensor? out_scales, Tensor? query_scales"),
}
#: the memory order each test build reads behind vLLM's tensor shapes: upstream's CUDA
#: order, or the [nb, H, bs, D] Enflame's cache writer stores
ORDER = {"enflame": "gcu", "context_lens": "gcu", "upstream": "vllm", "unknown": "vllm",
         "scrambled": "scrambled"}
CALLS: dict[str, int] = {}


def _dense(key_cache, value_cache, table, n, order):
    """Request's first ``n`` keys and values ``[n, Hkv, D]``, read by plain indexing
    (``scrambled``: a broken build's, K and V swapped)."""
    if order == "scrambled":
        return _dense(value_cache.view(key_cache.shape), key_cache.view(value_cache.shape),
                      table, n, "vllm")
    nb, hkv, _, block_size, _ = key_cache.shape
    if order == "gcu":
        k_mem = key_cache.contiguous().view(nb, hkv, block_size, -1)
        v_mem = value_cache.contiguous().view(nb, hkv, block_size, -1)
    keys, values = [], []
    for pos in range(n):
        block, offset = int(table[pos // block_size]), pos % block_size
        if order == "gcu":
            keys.append(k_mem[block, :, offset])
            values.append(v_mem[block, :, offset])
        else:
            keys.append(key_cache[block, :, :, offset, :].reshape(hkv, -1))
            values.append(value_cache[block, :, :, offset])
    return torch.stack(keys).double(), torch.stack(values).double()


@functools.cache  # once per schema; the cached library keeps the definitions alive
def _define(tag: str):
    ns = f"_accel_test_paged_attention_{tag}"
    lib = torch.library.Library(ns, "DEF")
    lib.define(f"paged_attention_v1({SCHEMAS[tag]}) -> ()")

    def impl(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
             block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, *rest):
        CALLS[tag] = CALLS.get(tag, 0) + 1
        if tag in ("enflame", "context_lens"):
            assert (k_scale, v_scale) == (1.0, 1.0)
            assert tuple(rest) == (0, 0, 0, 64, 0, 0.0, 0.0, None, None), rest
        else:
            assert k_scale.dtype == v_scale.dtype == torch.float32
            assert float(k_scale) == float(v_scale) == 1.0 and tuple(rest) == (0, 0, 0, 64, 0)
        assert kv_cache_dtype == "auto" and max_seq_len == int(seq_lens.max())
        assert int(block_tables.max()) < key_cache.shape[0]  # only gathered pages
        group = query.shape[1] // num_kv_heads
        for i, n in enumerate(seq_lens.tolist()):
            if n == 0:  # a padding request: the adapter zeroes its row
                continue
            k, v = _dense(key_cache, value_cache, block_tables[i], n, ORDER[tag])
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            logits = torch.einsum("hd,nhd->hn", query[i].double(), k) * scale
            if alibi_slopes is not None:
                logits += alibi_slopes.double()[:, None] * (torch.arange(n) - (n - 1))
            out[i] = torch.einsum("hn,nhd->hd", logits.softmax(-1), v).to(out.dtype)

    lib.impl("paged_attention_v1", impl, "CPU")
    return lib, {"_C::paged_attention_v1": getattr(torch.ops, ns).paged_attention_v1.default}


@pytest.mark.parametrize("tag", ["enflame", "upstream", "context_lens"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_through_each_schema(tag, dtype):
    """Each build's memory order found by the first call's check, then plain and ALiBi
    decodes vs float64; the table's columns past a request's blocks hold ids no page
    has (they must not be read), and a padding request (length 0) gives zeros."""
    kernel = _gcu_paged_decode(_define(tag)[1])
    torch.manual_seed(0)
    d, block_size = 64, 16
    cache = torch.randn(8, 2, block_size, 2 * d).to(dtype)
    junk = 10 ** 6
    table = torch.tensor([[5, 1, 7, junk], [2, junk, junk, junk], [3, 6, junk, junk],
                          [junk] * 4], dtype=torch.int32)
    lens = torch.tensor([40, 9, 17, 0])
    q = torch.randn(4, 6, d).to(dtype)
    slopes = torch.tensor([0.5, 0.3, 0.2, 0.1, 0.05, 0.01])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for features in ({}, {"alibi_slopes": slopes}):
        before = CALLS.get(tag, 0)
        got = kernel(q, cache, table, lens, 0.2, **features)
        want = attn_ref.paged_decode(q.double(), cache.double(), table.clamp(max=7), lens, 0.2,
                                     **features)
        assert got.dtype == dtype and CALLS[tag] > before
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
        assert not got[3].any()


def test_a_build_that_matches_in_neither_order_is_not_used():
    """The first call's check finds the op wrong in both orders (this build swaps K and
    V): every call goes to the next provider (here the reference)."""
    kernel = _gcu_paged_decode(_define("scrambled")[1])
    cache = torch.randn(4, 2, 16, 128)
    table, lens = torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([20])
    q = torch.randn(1, 2, 64)
    got = kernel(q, cache, table, lens, 0.2)
    want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert CALLS["scrambled"] == 2  # the check's two orders, then no more


def test_contexts_past_vllm_gcus_v1_limit_go_to_the_next_provider():
    kernel = _gcu_paged_decode(_define("enflame")[1])
    blocks = PAGED_ATTENTION_V1_MAX_LEN // 256 + 1
    cache = torch.randn(blocks, 1, 256, 64)
    table = torch.arange(blocks, dtype=torch.int32)[None]
    q = torch.randn(1, 1, 32)
    before = CALLS.get("enflame", 0)
    lens = torch.tensor([PAGED_ATTENTION_V1_MAX_LEN + 1])
    got = kernel(q, cache, table, lens, 0.2)
    want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.2)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    assert CALLS.get("enflame", 0) == before


def test_unknown_schema_is_not_registered():
    assert _gcu_paged_decode(_define("unknown")[1]) is None


# --- Sophgo's paged_attention_v3 ---------------------------------------------------

V3_ARGS = ("Tensor(a!) output, Tensor query, Tensor key, Tensor value, Tensor kcache, "
           "Tensor vcache, Tensor? pos_cos, Tensor? pos_sin, Tensor input_lengths, "
           "Tensor cache_lengths, Tensor save_slots, Tensor block_tables, Tensor? mask, "
           "float softmax_scale")
_v3_lib = torch.library.Library("_accel_test_sophgo_v3", "DEF")
_v3_lib.define(f"v3({V3_ARGS}, int max_seqlen, int stage) -> Tensor")
_v3_lib.define(f"v2({V3_ARGS}) -> Tensor")  # the v2 signature under the v3 name


V3_CALLS = []


def _refusing_v3(*args):
    V3_CALLS.append(args[-1])
    raise RuntimeError("tpudnn: unsupported head size")


_v3_lib.impl("v3", _refusing_v3, "CPU")


def test_sophgo_v3_registers_only_over_torch_tpus_schema():
    from vllm_accel.ops.vendor.sophgo_attention import sophgo_paged_kernel

    ns = torch.ops._accel_test_sophgo_v3
    for name in ("paged_decode", "paged_prefill"):
        assert sophgo_paged_kernel(name)({"my_ops::paged_attention_v3": ns.v3.default})
        assert sophgo_paged_kernel(name)({"my_ops::paged_attention_v3": ns.v2.default}) is None


def test_sophgo_v3_that_raises_in_its_probe_is_not_used():
    """A build that refuses the shapes (raises in the probe) leaves decode and prefill to
    the next provider, right against the oracle, and is not tried again."""
    from vllm_accel.ops.vendor.sophgo_attention import sophgo_paged_kernel

    op = {"my_ops::paged_attention_v3": torch.ops._accel_test_sophgo_v3.v3.default}
    decode = sophgo_paged_kernel("paged_decode")(op)
    prefill = sophgo_paged_kernel("paged_prefill")(op)
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 2, 16, 64, generator=g)
    table = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    lens = torch.tensor([20, 5])
    for _ in range(2):
        q = torch.randn(2, 4, 32, generator=g)
        want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.2)
        assert torch.allclose(decode(q, cache, table, lens, 0.2).double(), want, atol=1e-5)
        qsl = torch.tensor([0, 20, 25])
        q = torch.randn(25, 4, 32, generator=g)
        want = attn_ref.paged_attention(q.double(), cache.double(), table, qsl, lens, 0.2)
        got = prefill(q, cache, table, qsl, lens, 0.2)
        assert torch.allclose(got.double(), want, atol=1e-5)
    assert V3_CALLS == [3, 2]  # one probe each (decode stage 3, prefill stage 2)


# --- Sophgo's paged_latent_attention --------------------------------------------

_mla_lib = torch.library.Library("_accel_test_sophgo_mla", "DEF")
_MLA_ARGS = ("Tensor(a!) OUT, Tensor Q, Tensor KV, Tensor PE, Tensor WUQ, Tensor WUKV, "
             "Tensor(b!) KVcache, Tensor(c!) PEcache, Tensor cos, Tensor sin, "
             "Tensor? block_table, Tensor save_slots, Tensor? KVU, Tensor? mask, "
             "Tensor input_lengths, Tensor cache_lengths, int head, int generate_token, "
             "int q_lora_rank, int kv_lora_rank, int qk_nope_head_dim, int qk_rope_head_dim, "
             "int v_head_dim, int mask_size")
_mla_lib.define(f"plain({_MLA_ARGS}, int max_paged_block_num, int paged_cache_block_size, "
                "float C, int attention_mode) -> Tensor")
# the fp8 op's signature (block-fp8 weights with their scales) under the plain name
_mla_lib.define("fp8(Tensor(a!) OUT, Tensor Q, Tensor KV, Tensor PE, Tensor WUQ, Tensor WUKV, "
                "Tensor(b!) KVcache, Tensor(c!) PEcache, Tensor cos, Tensor sin, "
                "Tensor WUQ_scale, Tensor WUKV_scale, Tensor? block_table, Tensor save_slots, "
                "Tensor? KVU, Tensor? mask, Tensor input_lengths, Tensor cache_lengths, "
                "int head, int generate_token, int q_lora_rank, int kv_lora_rank, "
                "int qk_nope_head_dim, int qk_rope_head_dim, int v_head_dim, int mask_size, "
                "int quant_block_size, int max_paged_block_num, int paged_cache_block_size, "
                "float C, int attention_mode) -> Tensor")
MLA_CALLS = []


def _refusing_mla(*args):
    MLA_CALLS.append(args[-1])
    raise RuntimeError("tpudnn: unsupported kv_lora_rank")


_mla_lib.impl("plain", _refusing_mla, "CPU")


def test_sophgo_latent_attention_registers_only_over_torch_tpus_schema():
    from vllm_accel.ops.vendor.sophgo_mla import sophgo_latent_kernel

    ns = torch.ops._accel_test_sophgo_mla
    assert sophgo_latent_kernel({"my_ops::paged_latent_attention": ns.plain.default})
    assert sophgo_latent_kernel({"my_ops::paged_latent_attention": ns.fp8.default}) is None


def test_sophgo_latent_attention_that_raises_in_its_check_is_not_used():
    """A build that refuses a layer's shapes (raises in its check) does not serve it:
    ``serves`` says so (the MLA layer then keeps vLLM's forward), a call goes to the
    oracle, right, and the build is not tried again."""
    from vllm_accel.ops.reference import mla as mla_ref
    from vllm_accel.ops.vendor.sophgo_mla import make_kernel

    kernel = make_kernel(torch.ops._accel_test_sophgo_mla.plain.default)
    heads, nope, rope, v_dim, q_lora, lora, bs = 2, 8, 4, 8, 12, 16, 16
    assert not kernel.serves(torch.float32, torch.device("cpu"), heads, nope, rope, v_dim,
                             q_lora, lora, bs)
    assert MLA_CALLS == [3]  # the decode check (stage 3) refused: no more asked
    g = torch.Generator().manual_seed(5)
    t = 3
    args = (torch.randn(t, q_lora, generator=g), torch.randn(t, lora, generator=g),
            torch.randn(t, rope, generator=g), torch.ones(t, rope // 2),
            torch.zeros(t, rope // 2), torch.randn(heads * (nope + rope), q_lora, generator=g),
            torch.randn(heads * (nope + v_dim), lora, generator=g))
    cache = torch.randn(4, bs, lora + rope, generator=g)
    rest = (torch.tensor([[2, 0], [1, 3]], dtype=torch.int32), torch.tensor([0, 1, 3]),
            torch.tensor([20, 2]), torch.tensor([51, 16, 17]), heads, nope, v_dim, 0.2)
    for _ in range(2):  # a prefill after cached context: its own check, once
        mine, theirs = cache.clone(), cache.clone()
        want = mla_ref.mla_latent_attention(*args, theirs, *rest)
        got = kernel(*args, mine, *rest)
        assert torch.allclose(got, want) and torch.equal(mine, theirs)
    assert MLA_CALLS == [3, 2]


# --- Enflame's context_attention_forward ------------------------------------------

_caf_lib = torch.library.Library("_accel_test_gcu_caf", "DEF")
_CAF_ARGS = ("Tensor q, Tensor k, Tensor v, Tensor(a!) o, Tensor key_cache, Tensor value_cache, "
             "Tensor block_tables, Tensor subquery_start_loc, Tensor seq_lens_tensor, "
             "Tensor context_lens, int max_query_len, Tensor? alibi_slopes")
_caf_lib.define(f"enflame({_CAF_ARGS}, int? sliding_window) -> ()")
# e.g. upstream's Triton prefix prefill, which takes a scale and the cache dtype
_caf_lib.define(f"scaled({_CAF_ARGS}, float sm_scale, str kv_cache_dtype) -> ()")


def test_context_attention_registers_only_over_vllm_gcus_schema():
    from vllm_accel.ops.vendor.gcu_attention import _gcu_context_attention

    ns = torch.ops._accel_test_gcu_caf
    assert _gcu_context_attention({"_C::context_attention_forward": ns.enflame.default})
    assert _gcu_context_attention({"_C::context_attention_forward": ns.scaled.default}) is None
