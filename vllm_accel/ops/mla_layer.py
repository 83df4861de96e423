"""vLLM's MLA layer (``MultiHeadLatentAttentionWrapper``) with a way out for cards
whose MLA kernel takes the whole layer.

Sophgo's ``paged_latent_attention`` starts from the latents: the latent query (before
``q_b_proj``), the normalised latent KV and the un-rotated ``k_pe``, with the query and
KV up-projection weights and the RoPE tables; vLLM's ``MLAAttention`` starts after the
query projection and RoPE. Where a provider other than the oracle serves the
``mla_latent_attention`` kernel (``reference/mla.py`` states its contract), this layer
computes the latents as vLLM's does, hands them with the layer's weights to that
kernel through one custom op (``vllm_accel::mla_latent_attention``, so a compiled
model calls it at run time with the step's metadata) and applies ``o_proj``; the
``MLAAttention`` sub-layer keeps owning the latent cache and its metadata (ACCEL_MLA's
builder). Everywhere else, and for what the kernel's contract leaves out (sparse MLA,
gated output, Llama-4 scaling, neox-style RoPE, quantized projections or latent cache),
it is vLLM's layer unchanged (also with LoRA adapters, which wrap the projections, and
multimodal RoPE). ``ACCEL_KERNEL_PROVIDER=reference`` runs the oracle
through this path, which is how the simulator tests it.
"""

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.rotary_embedding.mrope import MRotaryEmbedding
from vllm.utils.torch_utils import direct_register_custom_op

from vllm_accel import envs
from vllm_accel.logger import init_logger
from vllm_accel.ops.reference import mla as _reference  # noqa: F401  (registers)
from vllm_accel.ops.registry import REFERENCE, get_kernel, resolve_provider

logger = init_logger(__name__)

KERNEL = "mla_latent_attention"


def _unquantized(layer) -> bool:
    return layer is not None and isinstance(getattr(layer, "quant_method", None),
                                            UnquantizedLinearMethod)


class AccelMultiHeadLatentAttention(MultiHeadLatentAttentionWrapper):
    """vLLM's MLA layer; its attention through ``mla_latent_attention`` where a card
    serves that kernel (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._latent_provider = self._whole_layer_provider()
        if self._latent_provider:
            # the kernel reads the query projection's weight as loaded: vLLM's CPU
            # linears would swap it for an empty one once they pack it (as for
            # MLAAttention's kv_b_proj, which vLLM marks the same way)
            self._q_proj_layer()._cpu_skip_gemm_dispatch = True

    def _q_proj_layer(self):
        return self.q_b_proj if self.q_lora_rank is not None else self.q_proj

    def _whole_layer_provider(self) -> str | None:
        provider = resolve_provider(KERNEL)
        if provider == REFERENCE and envs.ACCEL_KERNEL_PROVIDER != REFERENCE:
            return None
        rope = self.rotary_emb
        q_proj = self._q_proj_layer()
        missing = {
            "LoRA adapters (they wrap the projections)":
            get_current_vllm_config().lora_config is not None,
            "multimodal RoPE": isinstance(rope, MRotaryEmbedding),
            "sparse MLA": self.is_sparse or self.indexer is not None,
            "a gated output": self.g_proj is not None,
            "decode context parallel": self.dcp_q_replicate,
            "no or neox-style RoPE": rope is None or getattr(rope, "is_neox_style", True),
            "RoPE over part of the rope dims": getattr(rope, "rotary_dim",
                                                       None) != self.qk_rope_head_dim,
            "quantized q/kv_b projections": not (_unquantized(q_proj)
                                                 and _unquantized(self.kv_b_proj)),
            "a quantized latent cache": self.mla_attn.kv_cache_dtype != "auto",
            "no fused q/kv_a projection": (self.q_lora_rank is not None
                                           and self.fused_qkv_a_proj is None),
        }
        reasons = [name for name, hit in missing.items() if hit]
        if not reasons and not self._kernel_checks_out(q_proj.weight):
            reasons = ["a kernel that matches the oracle at this layer's shapes"]
        if reasons:
            logger.info_once("MLA layers: vLLM's forward, not %s's %s (needs %s)",
                             provider, KERNEL, ", ".join(reasons))
            return None
        logger.info_once("MLA layers: attention from the latents through %s's %s",
                         provider, KERNEL)
        return provider

    def _kernel_checks_out(self, w_uq: torch.Tensor) -> bool:
        """A card kernel's own check (``serves``: against the oracle, at this layer's
        shapes, dtype, device and the cache's block size) before the model is traced;
        kernels without one (the oracle) pass; without a block size, none runs."""
        serves = getattr(get_kernel(KERNEL), "serves", None)
        block_size = get_current_vllm_config().cache_config.block_size
        return serves is None or block_size is not None and serves(
            w_uq.dtype, w_uq.device, self.num_heads, self.qk_nope_head_dim,
            self.qk_rope_head_dim, self.v_head_dim, w_uq.shape[1], self.kv_lora_rank,
            block_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                llama_4_scaling: torch.Tensor | None = None) -> torch.Tensor:
        if (self._latent_provider is None or llama_4_scaling is not None
                or positions.dim() != 1):
            return super().forward(positions, hidden_states, llama_4_scaling)
        lora, rope = self.kv_lora_rank, self.qk_rope_head_dim
        if self.q_lora_rank is not None:
            q_c, kv_lora = self.fused_qkv_a_proj(hidden_states)[0].split(
                [self.q_lora_rank, lora + rope], dim=-1)
            q_c = self.q_a_layernorm(q_c)
        else:
            kv_lora = self.kv_a_proj_with_mqa(hidden_states)[0]
            q_c = hidden_states
        w_uq, w_ukv = self._q_proj_layer().weight, self.kv_b_proj.weight
        kv_c, k_pe = kv_lora.split([lora, rope], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        output = torch.empty(hidden_states.shape[0], self.num_heads * self.v_head_dim,
                             dtype=hidden_states.dtype, device=hidden_states.device)
        torch.ops.vllm_accel.mla_latent_attention(
            q_c, kv_c_normed, k_pe, positions, self.rotary_emb.cos_sin_cache, w_uq, w_ukv,
            output, self.mla_attn.layer_name, self.num_heads,
            self.qk_nope_head_dim, self.v_head_dim, self.mla_attn.scale)
        return self.o_proj(output)[0]


def _mla_latent_attention(q_c: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          w_uq: torch.Tensor, w_ukv: torch.Tensor, output: torch.Tensor,
                          layer_name: str, num_heads: int, qk_nope_head_dim: int,
                          v_head_dim: int, scale: float) -> None:
    """The step's metadata for ``layer_name`` (ACCEL_MLA's builder) -> the kernel."""
    attn_metadata, _, kv_cache, slot_mapping = get_attention_context(layer_name)
    if attn_metadata is None or kv_cache.numel() == 0:  # profiling run
        output.zero_()
        return
    n = attn_metadata.num_actual_tokens
    requests = getattr(attn_metadata, "accel_requests_host", None)
    if requests is None:  # the first layer of the step: lengths to the host, once
        block_table, seq_lens, query_start_loc = attn_metadata.accel_requests
        requests = attn_metadata.accel_requests_host = (block_table, seq_lens.cpu(),
                                                        query_start_loc)
    block_table, seq_lens, query_start_loc = requests
    cos, sin = cos_sin_cache[positions[:n].long()].to(q_c.dtype).chunk(2, dim=-1)
    out = get_kernel(KERNEL)(q_c[:n], kv_c_normed[:n], k_pe[:n], cos, sin, w_uq, w_ukv,
                             kv_cache, block_table, query_start_loc, seq_lens,
                             slot_mapping[:n], num_heads, qk_nope_head_dim, v_head_dim, scale)
    output[:n].copy_(out.flatten(1))
    output[n:].zero_()


def _mla_latent_attention_fake(q_c, kv_c_normed, k_pe, positions, cos_sin_cache, w_uq,
                               w_ukv, output, layer_name, num_heads, qk_nope_head_dim,
                               v_head_dim, scale) -> None:
    return None


_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
direct_register_custom_op("mla_latent_attention", _mla_latent_attention,
                          mutates_args=["output"], fake_impl=_mla_latent_attention_fake,
                          target_lib=_LIB)
