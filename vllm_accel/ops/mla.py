"""ACCEL_MLA: vllm_accel's multi-head latent attention backend (DeepSeek-V2/V3, Kimi,
MiniCPM3-style models) on the kernel registry: builder + impl + backend.

vLLM's ``MLAAttention`` layer keeps the model side: it writes each token's latent
``(c, k_pe)`` through :meth:`AccelMLAImpl.do_kv_cache_update`, absorbs ``W_UK`` into
the decode queries before :meth:`AccelMLAImpl.forward_mqa` and applies ``W_UV`` after
it, and hands prefill tokens to :meth:`AccelMLAImpl.forward_mha`. The impl runs:

- **cache writes** through ``mla_cache_write`` into vLLM's latent cache
  ``[num_blocks, block_size, kv_lora_rank + rope]`` (``reference/mla.py``), or its INT8
  form (``--kv-cache-dtype int8``: the ``_int8`` kernels) or fp8 form (``fp8`` /
  ``fp8_e4m3``: e4m3 over the layer's ``k_scale``, the ``_fp8`` kernels);
- **decode** with the absorbed weights: ``mla_decode``, MQA over the latents (every
  head reads the same rows once);
- **prefill** by decompression: each prefill request's cached latents (its context
  and the new tokens, just written) gathered by ``mla_gather``, up-projected by the
  layer's ``kv_b_proj`` into per-head K/V, then causal ``varlen_attention`` of the new
  queries over them. One path for a first prefill, chunked prefill and prefix-cache
  hits alike, on any device: vLLM's own context path needs CUDA or CPU ops (its
  gather and LSE merge), which an out-of-tree device has neither of.
"""

from typing import ClassVar

import torch
from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
)
from vllm.v1.attention.backend import AttentionLayer, AttentionType, MultipleOf

from vllm_accel.logger import init_logger
from vllm_accel.ops.attention import INT8_KV, reject_unsupported
from vllm_accel.ops.cpu_native import mla as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import mla as _reference  # noqa: F401  (registers)
from vllm_accel.ops.registry import get_kernel, resolve_provider
from vllm_accel.ops.torch_fast import mla as _torch_fast  # noqa: F401  (registers)

logger = init_logger(__name__)

BACKEND_NAME = "ACCEL_MLA"
#: the fp8 latent-cache names served: vLLM's MLA layer views the cache as its
#: platform's fp8 dtype, e4m3 (so not fp8_e5m2)
FP8_LATENT_CACHE = ("fp8", "fp8_e4m3")


class AccelMLABackend(MLACommonBackend):
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", INT8_KV,
                                                 *FP8_LATENT_CACHE]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["AccelMLAImpl"]:
        return AccelMLAImpl

    @staticmethod
    def get_builder_cls() -> type["AccelMLAMetadataBuilder"]:
        return AccelMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]


class AccelMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata, plus what prefill by decompression reads: each prefill
    request's length (context + new tokens) and the key rows' starts, on the host
    (one copy per step, not per layer); and the whole batch's requests."""

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        # every request's pages, lengths and query starts, for a whole-layer kernel
        # (``mla_layer.py``; the lengths reach the host there, once per step)
        n = common_attn_metadata.num_reqs
        md.accel_requests = (common_attn_metadata.block_table_tensor[:n],
                             common_attn_metadata.seq_lens[:n],
                             common_attn_metadata.query_start_loc_cpu[:n + 1])
        if md.prefill is not None:
            seq_lens = common_attn_metadata.seq_lens[md.num_decodes:md.num_reqs].cpu()
            md.prefill.accel_seq_lens = seq_lens.tolist()
            md.prefill.accel_key_start_loc = torch.cat(
                (seq_lens.new_zeros(1), seq_lens.cumsum(0))).to(torch.int32)
            md.prefill.accel_query_start_loc = md.prefill.query_start_loc.cpu()
        return md


class AccelMLAImpl(MLACommonImpl[MLACommonMetadata]):
    # decode returns no log-sum-exp: decode context parallel is not served
    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None, attn_type: str,
                 kv_sharing_target_layer_name: str | None, **mla_args) -> None:
        reject_unsupported({
            "MLA with ALiBi": alibi_slopes is not None,
            "MLA with a sliding window": sliding_window is not None,
            "MLA with a logit soft-cap": bool(logits_soft_cap),
            f"MLA for {attn_type} attention": attn_type != AttentionType.DECODER,
            "MLA with a shared KV cache": kv_sharing_target_layer_name is not None,
            "sparse MLA (an indexer)": mla_args.get("indexer") is not None,
            f"an MLA latent cache in {kv_cache_dtype} (served: "
            f"{', '.join(AccelMLABackend.supported_kv_cache_dtypes)})":
            kv_cache_dtype not in AccelMLABackend.supported_kv_cache_dtypes,
        })
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                         sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                         kv_sharing_target_layer_name, **mla_args)
        # the kernels of the cache's dtype (INT8: codes and per-token scales; fp8: e4m3
        # over the layer's k_scale)
        self._suffix = ("_int8" if kv_cache_dtype == INT8_KV
                        else "_fp8" if kv_cache_dtype in FP8_LATENT_CACHE else "")
        # (no fp8 queries, no flashinfer's concat, no decode context parallel)
        self.supports_quant_query_input = False
        self._use_flashinfer_concat_mla_k = False
        if self.dcp_world_size > 1:
            reject_unsupported({"decode context parallel with MLA": True})
        logger.info_once(
            "%s: latent cache of %d + %d per token%s, decode %s (absorbed), prefill by "
            "decompression (%s)", BACKEND_NAME, self.kv_lora_rank, self.qk_rope_head_dim,
            {"_int8": " in int8 with per-token scales",
             "_fp8": " in fp8 (e4m3, the layer's k_scale)"}.get(self._suffix, ""),
            resolve_provider("mla_decode" + self._suffix), resolve_provider("varlen_attention"))

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        if kv_cache.numel() == 0:  # profiling run
            return
        n = slot_mapping.shape[0]
        if self._suffix == "_fp8":
            get_kernel("mla_cache_write_fp8")(kv_c_normed[:n], k_pe[:n].reshape(n, -1),
                                              _fp8_view(kv_cache), slot_mapping, k_scale)
            return
        get_kernel("mla_cache_write" + self._suffix)(kv_c_normed[:n], k_pe[:n].reshape(n, -1),
                                                     kv_cache, slot_mapping)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer: AttentionLayer
                    ) -> tuple[torch.Tensor, None]:
        q_nope, q_pe = q if isinstance(q, tuple) else q.split(
            [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        decode = attn_metadata.decode
        if self._suffix == "_fp8":
            return get_kernel("mla_decode_fp8")(
                q_nope, q_pe, _fp8_view(kv_c_and_k_pe_cache), decode.block_table,
                decode.seq_lens, self.scale, layer._k_scale), None
        return get_kernel("mla_decode" + self._suffix)(
            q_nope, q_pe, kv_c_and_k_pe_cache, decode.block_table, decode.seq_lens,
            self.scale), None

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: torch.Tensor | None = None) -> None:
        if output_scale is not None:
            reject_unsupported({"MLA with fused output quantization": True})
        prefill = attn_metadata.prefill
        gather = get_kernel("mla_gather" + self._suffix)
        if self._suffix == "_int8":
            latent = gather(kv_c_and_k_pe_cache, prefill.block_table, prefill.accel_seq_lens,
                            self.kv_lora_rank)
        elif self._suffix == "_fp8":
            latent = gather(_fp8_view(kv_c_and_k_pe_cache), prefill.block_table,
                            prefill.accel_seq_lens, k_scale)
        else:
            latent = gather(kv_c_and_k_pe_cache, prefill.block_table, prefill.accel_seq_lens)
        c, k_rope = latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c.to(q.dtype).contiguous())[0].view(
            -1, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.to(q.dtype)[:, None, :].expand(
            -1, self.num_heads, -1)), dim=-1)
        out = get_kernel("varlen_attention")(
            q, k, v, prefill.accel_query_start_loc, self.scale, causal=True,
            key_start_loc=prefill.accel_key_start_loc)
        output.copy_(out.flatten(start_dim=-2))


def _fp8_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The latent cache as e4m3 (vLLM allocates it as bytes; its layer views it so for
    attention, not for the cache update)."""
    return kv_cache if kv_cache.dtype == torch.float8_e4m3fn else kv_cache.view(
        torch.float8_e4m3fn)


def prepare_mla_layers(model: torch.nn.Module) -> int:
    """Store each ACCEL_MLA layer's absorbed weights as transposed views of contiguous
    per-head ``[out, in]`` memory; returns how many changed.

    vLLM keeps ``W_UK_T`` ``[N, P, L]`` and ``W_UV`` ``[N, L, V]`` as permuted views of
    ``kv_b_proj``'s split, and torch's ``bmm`` copies such an operand on every call: at
    batch 1 of a DeepSeek-V2-Lite layer shape that was most of the step's 2.2 ms of
    ``aten::copy_`` (AMD EPYC Zen 5). A transposed view of contiguous memory is one
    torch's ``bmm`` reads in place (as a transposed operand: 161 us for the 16 heads'
    W_UK_T at one row, one core, vs 215 us contiguous), and the simulator's kernel reads
    each head as the rows of a linear (``cpu_native/mla.py``'s ``absorbed_bmm``).
    Call after the weights load, before the first forward."""
    changed = 0
    for module in model.modules():
        if not isinstance(getattr(module, "impl", None), AccelMLAImpl):
            continue
        for name in ("W_UK_T", "W_UV"):
            weight = getattr(module, name, None)
            if isinstance(weight, torch.Tensor) and weight.dim() == 3 and not (
                    weight.transpose(1, 2).is_contiguous()):
                weight.data = weight.data.transpose(1, 2).contiguous().transpose(1, 2)
                changed += 1
    return changed
