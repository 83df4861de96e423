"""ACCEL_ATTN: vllm_accel's paged attention backend (builder + impl + backend).

The KV cache of one layer is a ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``
tensor (K in the first half of the last dim, V in the second), contiguous per
(block, head) page. The kernels come from the kernel registry, so a device
backend can replace ``cache_write`` / ``paged_decode`` / ``paged_prefill`` per op.
"""

import functools
from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from vllm.config import VllmConfig
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVQuantMode
from vllm.v1.kv_cache_layout import KVCacheLayout

from vllm_accel import envs
from vllm_accel.logger import init_logger
from vllm_accel.ops.cpu_native import attention as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.paged_layout import FP8_KV_FORMATS, INT8_SCALE_BYTES
from vllm_accel.ops.reference import attention as _reference  # (also registers)
from vllm_accel.ops.reference import cache_write as _writers  # noqa: F401  (registers)
from vllm_accel.ops.torch_fast import attention as _torch_fast  # noqa: F401  (registers)
from vllm_accel.ops.kv_scales import load_kv_scales
from vllm_accel.ops.registry import get_kernel, providers_of, resolve_provider

logger = init_logger(__name__)

BACKEND_NAME = "ACCEL_ATTN"
#: decoder layers over the paged cache; encoder-only layers (BERT-style embedding and
#: reranker models) within each sequence of the batch, with no cache; encoder-decoder
#: (cross) layers over the paged cache of each request's encoder output (Whisper)
SUPPORTED_ATTN_TYPES = (AttentionType.DECODER, AttentionType.ENCODER_ONLY,
                        AttentionType.ENCODER_DECODER)
#: the INT8 KV cache: int8 K and V plus an fp32 scale each per (token, head)
INT8_KV = "int8_per_token_head"


def reject_unsupported(features: dict[str, bool]) -> None:
    """Fail at startup, naming the model and each attention feature it needs
    that ACCEL_ATTN lacks -- never serve silently wrong output."""
    missing = [feature for feature, needed in features.items() if needed]
    if not missing:
        return
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    model = config.model_config.model if config and config.model_config else "this model"
    raise NotImplementedError(
        f"{model} needs {', '.join(missing)}, which vllm_accel's {BACKEND_NAME} "
        "attention backend does not support yet. Serve a model without it, or "
        "exclude the plugin (VLLM_PLUGINS) to use vLLM's CPU backend."
    )


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    """Fail at startup for a KV cache dtype ACCEL_ATTN cannot store (vLLM hands an
    OOT backend any of its CacheDType values unchecked)."""
    from vllm_accel.preflight import StartupError

    supported = AccelAttentionBackend.supported_kv_cache_dtypes
    if kv_cache_dtype not in supported:
        raise StartupError(
            f"--kv-cache-dtype {kv_cache_dtype} is not supported by vllm_accel's "
            f"{BACKEND_NAME} attention backend; use one of {', '.join(supported)} "
            "(`int8` = int8_per_token_head).")


def _static_kv_scales(kv_cache_dtype: str) -> dict[int, tuple[float, float]] | None:
    """The ACCEL_KV_SCALES table for an INT8 cache (validated at model build)."""
    path = envs.ACCEL_KV_SCALES
    if not path:
        return None
    if kv_cache_dtype != INT8_KV:
        logger.warning_once("ACCEL_KV_SCALES is set but the KV cache is %s, not int8; "
                            "ignoring it.", kv_cache_dtype)
        return None
    from vllm.config import get_current_vllm_config

    num_layers = get_current_vllm_config().model_config.hf_text_config.num_hidden_layers
    return load_kv_scales(path, num_layers)


class AccelAttentionBackend(AttentionBackend):
    accept_output_buffer: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [
        torch.float16,
        torch.bfloat16,
        torch.float32,
    ]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", INT8_KV,
                                                 *FP8_KV_FORMATS]
    # forward writes the new K/V itself (do_kv_cache_update) before reading: one
    # vLLM custom op a layer instead of two (~30 us less a layer on this host).
    forward_includes_kv_cache_update: bool = True

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["AccelAttentionImpl"]:
        return AccelAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["AccelAttentionMetadataBuilder"]:
        return AccelAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(16)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return []  # the torch kernels take any head size

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        # Head-major pages first: a block gather per KV head is one contiguous
        # index_select. Block-major second: hybrid models (attention beside Mamba
        # state) need a block-compact layout; every reader takes both (page_table).
        return (KVCacheLayout.LHBNC, KVCacheLayout.LBHNC)

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """Room for the INT8 cache's two fp32 scales per (token, head)."""
        if spec.kv_quant_mode != KVQuantMode.INT8_PER_TOKEN_HEAD or spec.state_content_bytes:
            return spec
        return replace(spec, state_content_bytes=spec.head_size + spec.head_size_v
                       + INT8_SCALE_BYTES)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type in SUPPORTED_ATTN_TYPES

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return True  # two-way image ranges: AccelAttentionImpl._recompute_two_way_requests


@dataclass
class AccelAttentionMetadata:
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    max_seq_len: int
    query_start_loc_cpu: torch.Tensor  # [num_reqs + 1]
    seq_lens: torch.Tensor  # [num_reqs]
    block_table: torch.Tensor  # [num_reqs, max_blocks]
    slot_mapping: torch.Tensor  # [num_tokens]
    #: False: vLLM's encoder-only layers (bidirectional) and cross-attention layers,
    #: whose ``seq_lens`` are then the encoder lengths (vLLM's CrossAttentionBuilder)
    causal: bool = True
    #: prefill request index -> the two-way ranges (inclusive positions) that its
    #: queries this step fall in (multimodal prefix models: Gemma 3's images). vLLM's
    #: name for it: a model whose layers differ clears it on the layers where images
    #: stay causal (Gemma 4's global layers, each KV cache group its own metadata)
    mm_prefix_range: dict[int, list[tuple[int, int]]] | None = None

    @functools.cached_property
    def rows_per_token(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block table, seq_lens) with one row per query token, each its request's:
        a cross-attention step reads them as decode rows (built once a step, shared by
        every cross layer)."""
        num_reqs = self.query_start_loc_cpu.numel() - 1
        block_table, seq_lens = self.block_table[:num_reqs], self.seq_lens[:num_reqs]
        query_lens = self.query_start_loc_cpu.diff()
        if not bool((query_lens != 1).any()):
            return block_table, seq_lens
        rows = torch.repeat_interleave(torch.arange(num_reqs), query_lens)
        return block_table[rows.to(block_table.device)], seq_lens[rows.to(seq_lens.device)]


class AccelAttentionMetadataBuilder(AttentionMetadataBuilder[AccelAttentionMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER
    # Single-token requests first: they run as one batched decode.
    reorder_batch_threshold: int | None = 1

    def __init__(  # the base declares it abstract
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> AccelAttentionMetadata:
        if isinstance(common_attn_metadata.causal, torch.Tensor):
            reject_unsupported({"per-request causal masks (multimodal prefixes)": True})
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            common_attn_metadata, decode_threshold=self.reorder_batch_threshold
        )
        return AccelAttentionMetadata(
            num_actual_tokens=common_attn_metadata.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            max_seq_len=common_attn_metadata.max_seq_len,
            query_start_loc_cpu=common_attn_metadata.query_start_loc_cpu,
            seq_lens=common_attn_metadata.seq_lens,
            block_table=common_attn_metadata.block_table_tensor,
            slot_mapping=common_attn_metadata.slot_mapping,
            causal=common_attn_metadata.causal,
            mm_prefix_range=_two_way_ranges(common_attn_metadata, num_decodes),
        )


def _two_way_ranges(cm: CommonAttentionMetadata,
                    num_decodes: int) -> dict[int, list[tuple[int, int]]] | None:
    """The prefill requests whose query tokens this step fall in one of vLLM's
    multimodal prefix ranges (``mm_req_doc_ranges``), with those ranges. vLLM keeps an
    image's tokens in one step for these models (no chunked multimodal input), and a
    decode token is never inside an image."""
    if not cm.mm_req_doc_ranges:
        return None
    starts = cm.query_start_loc_cpu.tolist()
    seq_lens = cm.seq_lens.cpu().tolist()
    found = {}
    for req, ranges in cm.mm_req_doc_ranges.items():
        if req < num_decodes or req >= len(seq_lens):
            continue
        first_query = seq_lens[req] - (starts[req + 1] - starts[req])
        inside = [(a, b) for a, b in ranges if b >= first_query and a < seq_lens[req]]
        if inside:
            found[req] = inside
    return found or None


def _fused_attention_step(suffix: str):
    """The provider's one-call layer (``attention_step``: cache write and attention
    into the output), where the provider serving the kernels it fuses offers one."""
    name = "attention_step" + suffix
    offered = providers_of(name)
    provider = resolve_provider(name) if offered else None
    if provider not in offered or any(resolve_provider(kernel + suffix) != provider
                                      for kernel in ("cache_write", "paged_decode",
                                                     "paged_prefill")):
        return None
    return get_kernel(name)


class AccelAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        reject_unsupported({
            f"{attn_type} attention": attn_type not in SUPPORTED_ATTN_TYPES,
            f"sliding window {sliding_window}": sliding_window is not None
            and sliding_window < 1,
            f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))} (one per "
            f"query head: {num_heads})": sinks is not None
            and tuple(sinks.shape) != (num_heads,),
        })
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        # (an ACCEL_KV_SCALES table holds decoder self-attention layers: a cross layer
        # of the same index quantizes the encoder's K/V, dynamically)
        self._static_kv_scales = (None if attn_type == AttentionType.ENCODER_DECODER
                                  else _static_kv_scales(kv_cache_dtype))
        # A float8 cache is allocated as uint8; the kernels get a float8 view.
        self._fp8 = FP8_KV_FORMATS.get(kv_cache_dtype)
        suffix = "_int8" if kv_cache_dtype == INT8_KV else "_fp8" if self._fp8 else ""
        self._cache_write = get_kernel("cache_write" + suffix)
        self._paged_decode = get_kernel("paged_decode" + suffix)
        self._paged_prefill = get_kernel("paged_prefill" + suffix)
        self._attention_step = _fused_attention_step(suffix)
        #: the model's attention features, as every provider's kernels take them
        #: (reference/attention.py); the sinks are the layer's parameter (loaded later)
        self.features = {name: value for name, value in (
            ("sliding_window", sliding_window),
            ("logits_soft_cap", logits_soft_cap or None),
            ("alibi_slopes", None if alibi_slopes is None
             else torch.tensor(alibi_slopes, dtype=torch.float32)),
            ("sinks", sinks)) if value is not None}
        self._layer_scales: tuple[float | None, float | None] | None = None  # on first use
        if attn_type == AttentionType.ENCODER_DECODER:
            logger.info_once("%s: encoder-decoder attention over each request's cached "
                             "encoder output", BACKEND_NAME)
        if self.features:
            logger.info_once("%s: attention with %s", BACKEND_NAME, ", ".join(
                f"{name} {value}" if name in ("sliding_window", "logits_soft_cap")
                else name for name, value in self.features.items()))
        logger.info_once(
            "%s attention kernels: %s%s",
            BACKEND_NAME,
            ", ".join(f"{k.__module__}.{k.__name__}" for k in
                      (self._cache_write, self._paged_decode, self._paged_prefill)),
            f"; {self._attention_step.__module__}.{self._attention_step.__name__} runs "
            "the layer in one call where it takes the batch"
            if self._attention_step is not None else "",
        )

    def _layer_kv_scales(self, layer: torch.nn.Module) -> tuple[float | None, float | None]:
        """This layer's static INT8 (k_scale, v_scale), or ``(None, None)`` (looked up
        once: the impl learns its layer's name only from the forward's ``layer``)."""
        if self._layer_scales is None:
            self._layer_scales = (
                (None, None) if self._static_kv_scales is None
                else self._static_kv_scales[extract_layer_index(layer.layer_name)])
        return self._layer_scales

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        n = slot_mapping.shape[0]
        if self._fp8 is not None:
            self._cache_write(key[:n], value[:n], kv_cache.view(self._fp8), slot_mapping,
                              layer._k_scale_float, layer._v_scale_float)
            return
        if self._static_kv_scales is None:
            self._cache_write(key[:n], value[:n], kv_cache, slot_mapping)
            return
        self._cache_write(key[:n], value[:n], kv_cache, slot_mapping,
                          *self._layer_kv_scales(layer))

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AccelAttentionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(
                f"{BACKEND_NAME} does not fuse output quantization into attention"
            )
        if attn_metadata is None:  # profiling / warm-up run: no cache yet
            return output
        md = attn_metadata
        features = self._device_features(query.device)
        if self.attn_type == AttentionType.ENCODER_ONLY:  # no cache: within each sequence
            n = md.num_actual_tokens
            output[:n].view(n, self.num_heads, self.head_size).copy_(get_kernel(
                "varlen_attention")(query[:n].view(n, self.num_heads, self.head_size),
                                    key[:n].view(n, self.num_kv_heads, self.head_size),
                                    value[:n].view(n, self.num_kv_heads, self.head_size),
                                    md.query_start_loc_cpu, self.scale, causal=md.causal,
                                    **features))
            return output
        writes = (self.kv_sharing_target_layer_name is None and key is not None
                  and value is not None)
        if self.attn_type == AttentionType.ENCODER_DECODER:
            if writes:  # the encoder's K/V, on a request's first step only
                self.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
            return self._cross_attention(layer, query, kv_cache, md, output, features)
        if (writes and self._attention_step is not None and self._attention_step(
                query, key, value, kv_cache, md.slot_mapping, md.block_table,
                md.query_start_loc_cpu, md.seq_lens, output, self.scale,
                *self._layer_kv_scales(layer), **features)):
            self._recompute_two_way_requests(layer, query, kv_cache, md, output)
            return output
        if writes:
            self.do_kv_cache_update(layer, key, value, kv_cache, md.slot_mapping)
        n = md.num_actual_tokens
        out = output[:n].view(n, self.num_heads, self.head_size)
        query = query[:n].view(n, self.num_heads, self.head_size)

        kv_cache, fp8_scales = self._readable(layer, kv_cache)
        nd, ndt = md.num_decodes, md.num_decode_tokens
        if nd:
            out[:ndt] = self._paged_decode(
                query[:ndt], kv_cache, md.block_table[:nd], md.seq_lens[:nd], self.scale,
                *fp8_scales, **features,
            )
        if ndt < n:
            qsl = md.query_start_loc_cpu[nd:]
            out[ndt:] = self._paged_prefill(
                query[ndt:],
                kv_cache,
                md.block_table[nd:],
                qsl - qsl[0],
                md.seq_lens[nd:],
                self.scale,
                *fp8_scales,
                **features,
            )
        self._recompute_two_way_requests(layer, query, kv_cache, md, output)
        return output

    def _cross_attention(self, layer, query, kv_cache, md, output, features) -> torch.Tensor:
        """Encoder-decoder attention: every decoder token reads the whole cached
        encoder output of its request, nothing masked -- so each token is one decode
        row over its request's blocks, and every provider's decode kernel serves it
        (prompt tokens included; Whisper's prompts are a few tokens)."""
        n = md.num_actual_tokens
        block_table, seq_lens = md.rows_per_token
        kv_cache, fp8_scales = self._readable(layer, kv_cache)
        output[:n].view(n, self.num_heads, self.head_size).copy_(self._paged_decode(
            query[:n].view(n, self.num_heads, self.head_size), kv_cache, block_table,
            seq_lens, self.scale, *fp8_scales, **features))
        return output

    def _readable(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, tuple]:
        """The cache as the readers take it: a float8 cache's view and the layer's
        scales (vLLM's, 1.0 by default); other caches as they are."""
        if self._fp8 is None:
            return kv_cache, ()
        return kv_cache.view(self._fp8), (layer._k_scale_float, layer._v_scale_float)

    def _recompute_two_way_requests(self, layer, query, kv_cache, md, output) -> None:
        """Recompute the prefill requests with two-way ranges this step (images of a
        multimodal prefix model, a few per batch) through the reference reader, the
        only one that takes them; every other row keeps its provider's result."""
        if not md.mm_prefix_range:
            return
        n = md.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)
        out = output[:n].view(n, self.num_heads, self.head_size)
        kv_cache, fp8_scales = self._readable(layer, kv_cache)
        starts = md.query_start_loc_cpu.tolist()
        for req, ranges in md.mm_prefix_range.items():
            rows = slice(starts[req], starts[req + 1])
            out[rows] = _reference.paged_attention(
                query[rows], kv_cache, md.block_table[req:req + 1],
                torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
                md.seq_lens[req:req + 1], self.scale, *fp8_scales,
                two_way_ranges=[ranges], **self._device_features(query.device))

    def _device_features(self, device: torch.device) -> dict:
        """The features with the ALiBi slopes on the query's device (moved once)."""
        slopes = self.features.get("alibi_slopes")
        if slopes is not None and slopes.device != device:
            self.features["alibi_slopes"] = slopes.to(device)
        return self.features
