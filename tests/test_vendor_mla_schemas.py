"""The GCU vendor MLA decode adapter against the three schemas FlashMLA's decode op has
had under vLLM's names (vLLM 0.8-0.9: ``Tensor? vcache`` after ``kcache``; 0.10:
``descale_q, descale_k`` appended; later: ``is_fp8, indices`` and a six-argument
``get_mla_decoding_metadata``), and Enflame's library: 0.10's schema without a
metadata op. Each schema is defined in a test namespace with a CPU
implementation that checks what the adapter passes where and answers with the float64
oracle's math; the fake Enflame library (test_backend_faithful) covers Enflame's on
the PrivateUse1 device."""

import pytest
import torch

from vllm_accel.ops.reference import mla as mla_ref
from vllm_accel.ops.vendor.kernels import _gcu_mla_decode

COMMON = ("int head_size_v, Tensor seqlens_k, Tensor block_table, float softmax_scale, "
          "bool is_causal, Tensor tile_scheduler_metadata, Tensor num_splits")
SCHEMAS = {
    "v09": ("Tensor q, Tensor kcache, Tensor? vcache_, " + COMMON,
            "Tensor cache_seqlens, int num_heads_per_head_k, int num_heads_k"),
    "v010": ("Tensor q, Tensor kcache, " + COMMON + ", Tensor? descale_q, Tensor? descale_k",
             "Tensor cache_seqlens, int num_heads_per_head_k, int num_heads_k"),
    "later": ("Tensor q, Tensor kcache, " + COMMON + ", bool is_fp8, Tensor? indices",
              "Tensor cache_seqlens, int num_q_tokens_per_head_k, int num_heads_k, "
              "int? num_heads_q, bool is_fp8_kvcache, int? topk"),
    # Enflame's library: 0.10's schema and no metadata op (vllm-gcu passes None for both)
    "enflame": ("Tensor q, Tensor kcache, " + COMMON + ", Tensor? descale_q, Tensor? descale_k",
                None),
}
_libraries = []  # the test namespaces' definitions live while the module does


def _define(tag: str, fwd_args: str, meta_args: str):
    ns = f"_accel_test_flashmla_{tag}"
    lib = torch.library.Library(ns, "DEF")
    _libraries.append(lib)
    lib.define(f"fwd_kvcache_mla({fwd_args}) -> Tensor[]")
    if meta_args is not None:
        lib.define(f"metadata({meta_args}) -> Tensor[]")

    def metadata(seqlens, heads_per_k, heads_k, *rest):
        assert seqlens.dtype == torch.int32 and heads_k == 1
        assert rest == ((heads_per_k, False, None) if tag == "later" else ()), rest
        return [torch.zeros(1, 8, dtype=torch.int32),
                torch.arange(seqlens.numel() + 1, dtype=torch.int32)]

    def fwd(q, kcache, *args):
        if tag == "v09":
            assert args[0] is None
            args = args[1:]
        head_v, seqlens, table, scale, causal, tiles, splits, *tail = args
        assert tail == {"v09": [], "v010": [None, None], "later": [False, None],
                        "enflame": [None, None]}[tag], tail
        if meta_args is None:
            assert tiles is None and splits is None
        else:
            assert splits.shape == (q.shape[0] + 1,)
        assert not causal and q.shape[1] == 1
        out = mla_ref.mla_decode(q[:, 0, :, :head_v], q[:, 0, :, head_v:], kcache[:, :, 0],
                                 table, seqlens, scale)
        return [out.to(q.dtype).unsqueeze(1), torch.zeros(q.shape[0], q.shape[2], 1)]

    lib.impl("fwd_kvcache_mla", fwd, "CPU")
    ops = getattr(torch.ops, ns)
    if meta_args is None:
        return {"_flashmla_C::fwd_kvcache_mla": ops.fwd_kvcache_mla.default}
    lib.impl("metadata", metadata, "CPU")
    meta_name = ("_flashmla_C::get_mla_decoding_metadata" if tag == "later"
                 else "_flashmla_C::get_mla_metadata")
    return {"_flashmla_C::fwd_kvcache_mla": ops.fwd_kvcache_mla.default,
            meta_name: ops.metadata.default}


@pytest.mark.parametrize("tag", list(SCHEMAS))
def test_adapter_passes_each_schemas_arguments(tag):
    decode = _gcu_mla_decode(_define(tag, *SCHEMAS[tag]))
    torch.manual_seed(0)
    cache = torch.randn(5, 64, 576).to(torch.bfloat16)
    table = torch.tensor([[2, 0], [4, 1], [3, 3]], dtype=torch.int32)
    lens = torch.tensor([64, 100, 0], dtype=torch.int32)
    q_nope, q_pe = torch.randn(3, 2, 512).bfloat16(), torch.randn(3, 2, 64).bfloat16()
    got = decode(q_nope, q_pe, cache, table, lens, 0.04)
    want = mla_ref.mla_decode(q_nope.double(), q_pe.double(), cache.double(), table, lens, 0.04)
    assert got.shape == (3, 2, 512) and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=0)


def test_adapter_refuses_a_schema_it_does_not_know():
    fwd_args = "Tensor q, Tensor kcache, " + COMMON + ", int window"
    assert _gcu_mla_decode(_define("unknown", fwd_args, SCHEMAS["v09"][1])) is None
