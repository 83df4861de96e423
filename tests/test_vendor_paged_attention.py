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
from vllm_accel.ops.vendor.kernels import _gcu_paged_decode

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
    # the names vllm-gcu's op schema file gives the lengths
    "context_lens": (HEAD.replace("seq_lens", "context_lens").replace("max_seq_len",
                                                                      "max_context_len")
                     + "float k_scale, float v_scale, " + BLOCKSPARSE
                     + ", float k_zero, float v_zero, Tensor? out_scales, Tensor? query_scales"),
}
def _dense(key_cache, value_cache, table, n):
    """Request's first ``n`` keys and values ``[n, Hkv, D]`` from vLLM's layout."""
    block_size = key_cache.shape[3]
    keys, values = [], []
    for pos in range(n):
        block, offset = int(table[pos // block_size]), pos % block_size
        keys.append(key_cache[block, :, :, offset, :].reshape(key_cache.shape[1], -1))
        values.append(value_cache[block, :, :, offset])
    return torch.stack(keys).double(), torch.stack(values).double()


@functools.cache  # once per schema; the cached library keeps the definitions alive
def _define(tag: str):
    ns = f"_accel_test_paged_attention_{tag}"
    lib = torch.library.Library(ns, "DEF")
    lib.define(f"paged_attention_v1({SCHEMAS[tag]}) -> ()")

    def impl(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
             block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, *rest):
        if tag in ("enflame", "context_lens"):
            assert (k_scale, v_scale) == (1.0, 1.0)
            assert tuple(rest) == (0, 0, 0, 64, 0, 0.0, 0.0, None, None), rest
        else:
            assert k_scale.dtype == v_scale.dtype == torch.float32
            assert float(k_scale) == float(v_scale) == 1.0 and tuple(rest) == (0, 0, 0, 64, 0)
        assert kv_cache_dtype == "auto" and max_seq_len == int(seq_lens.max())
        group = query.shape[1] // num_kv_heads
        for i, n in enumerate(seq_lens.tolist()):
            k, v = _dense(key_cache, value_cache, block_tables[i], n)
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
    kernel = _gcu_paged_decode(_define(tag)[1])
    torch.manual_seed(0)
    d, block_size = 64, 16
    cache = torch.randn(8, 2, block_size, 2 * d).to(dtype)
    table = torch.tensor([[5, 1, 7], [2, 0, 0], [3, 6, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 9, 17])
    q = torch.randn(3, 6, d).to(dtype)
    slopes = torch.tensor([0.5, 0.3, 0.2, 0.1, 0.05, 0.01])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for features in ({}, {"alibi_slopes": slopes}):
        got = kernel(q, cache, table, lens, 0.2, **features)
        want = attn_ref.paged_decode(q.double(), cache.double(), table, lens, 0.2, **features)
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


def test_unknown_schema_is_not_registered():
    assert _gcu_paged_decode(_define("unknown")[1]) is None
