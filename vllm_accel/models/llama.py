"""Llama, Mistral, Qwen3 and Gemma 2/3 on the simulator: each decoder layer in one C++
call.

vLLM runs a Llama decoder layer as a dozen module calls around ten ops (two norms,
four linears, rotary, its attention op, SiLU): ~145 us of Python a layer on a 2-core
Xeon, where the kernels themselves take a few us apart from the weight reads. The
simulator has a C++ kernel for each of them, so ``vllm_accel::cpu_decoder_layer``
(``csrc/torch_ops.cpp``) runs the whole layer in one call where every part of it
would take the simulator's kernel anyway: bf16 linears routed to
``vllm_accel::bf16_linear``, 4-bit weight-only ones on the ``cpu_native`` int4
layout (``vllm_accel::int4pack_linear``, no act-order permutation) or W8A8 ones with
dynamic per-token activations (``vllm_accel::int8_linear_dynamic``), ACCEL_ATTN with
its one-call attention step (plain causal, or with Mistral's sliding window or a
logits soft-cap), Qwen3's and Gemma 3's per-head q/k RMSNorm, Gemma's four norms
(``x * (1 + w)``, the weight held as ``1 + w`` in the activations' dtype) and GELU-tanh
MLP, vLLM's rotary formula, one world rank. Every other layer (other
quantized or LoRA linears, oneDNN linears, tensor parallel, rope variants with their
own forward, a card) keeps vLLM's forward: the choice is made once per model after
its weights load (``prepare_fused_layers``) and logged.

In a compiled model the layer is one opaque op, ``vllm_accel::llama_layer``: it
finds its layer and the batch's attention metadata in vLLM's forward context at
run time, as vLLM's attention op does. A batch the C++ op declines (a long
prefill, where the torch attention kernels win) runs the layer op by op.
"""

import torch

from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.gemma2 import (
    Gemma2Attention,
    Gemma2DecoderLayer,
    Gemma2ForCausalLM,
    Gemma2MLP,
)
from vllm.model_executor.models.gemma3 import (
    Gemma3Attention,
    Gemma3DecoderLayer,
    Gemma3ForCausalLM,
    Gemma3MLP,
)
from vllm.model_executor.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from vllm.model_executor.models.mistral import (
    MistralAttention,
    MistralDecoderLayer,
    MistralForCausalLM,
)
from vllm.model_executor.models.qwen2 import Qwen2MLP
from vllm.model_executor.models.qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3ForCausalLM,
)
from vllm.v1.attention.backend import AttentionType
from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE, direct_register_custom_op

from vllm_accel.logger import init_logger
from vllm_accel.ops.attention import INT8_KV, AccelAttentionImpl
from vllm_accel.ops.cpu_native import bf16_linear
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.cpu_native.attention import PREFILL_NATIVE_MAX_PAIRS
from vllm_accel.ops.custom_ops import AccelRotaryEmbedding
from vllm_accel.quant.packed import InstalledWInt
from vllm_accel.quant.w8a8 import AccelW8A8LinearMethod, InstalledW8A8
from vllm_accel.quant.wint_method import WIntLinearMethod

logger = init_logger(__name__)

#: rope forwards that compute vLLM's base formula from ``cos_sin_cache`` (subclasses
#: that only change the cache, such as Llama 3's, keep them)
_BASE_ROPE_FORWARDS = {getattr(cls, name) for cls in (RotaryEmbedding, AccelRotaryEmbedding)
                       for name in ("forward_native", "forward_cpu", "forward_oot")}


def _layer_weight(linear: torch.nn.Module, linear_type: type, bias_ok: bool
                  ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What the C++ layer op computes vLLM's ``linear`` from: (bf16 weight, None) where
    it runs ``vllm_accel::bf16_linear``, (int4 weight, scales and zeros) where a
    weight-only method runs ``vllm_accel::int4pack_linear`` on them, (int8 weight,
    per-channel scales) where W8A8 with dynamic symmetric activations runs
    ``vllm_accel::int8_linear_dynamic``; else None."""
    if (type(linear) is not linear_type or linear.skip_bias_add
            or not (bias_ok or linear.bias is None)):
        return None
    if type(linear.quant_method) is UnquantizedLinearMethod:
        routed = getattr(linear, "cpu_linear", None) is bf16_linear.cpu_linear
        return (linear.weight, None) if routed else None
    wint = getattr(linear, "wint", None)
    if (isinstance(linear.quant_method, WIntLinearMethod)
            and type(linear.quant_method).apply is WIntLinearMethod.apply
            and isinstance(wint, InstalledWInt)):
        return wint.cpp_operands()
    w8a8 = getattr(linear, "w8a8", None)
    if type(linear.quant_method) is AccelW8A8LinearMethod and isinstance(w8a8, InstalledW8A8):
        return w8a8.cpp_operands()
    return None


def _layer_weights(layer: "FusedDecoderLayer") -> list | None:
    """``_layer_weight`` of the QKV, O, gate/up and down linears, or None."""
    attn_layer, mlp = layer.self_attn, layer.mlp
    weights = [_layer_weight(attn_layer.qkv_proj, QKVParallelLinear, True),
               _layer_weight(attn_layer.o_proj, RowParallelLinear, True),
               _layer_weight(mlp.gate_up_proj, MergedColumnParallelLinear, False),
               _layer_weight(mlp.down_proj, RowParallelLinear, False)]
    return None if None in weights else weights


#: the attention features the C++ layer's attention step takes
_FUSED_FEATURES = {"sliding_window", "logits_soft_cap"}


def _activation_code(act_fn: torch.nn.Module) -> int | None:
    """The C++ layer's code of the MLP's gated activation (``gated_activation``: SiLU 0,
    GELU 1, GELU-tanh 2; the plugin's own SiluAndMul is one), or None."""
    if isinstance(act_fn, SiluAndMul):
        return 0
    if isinstance(act_fn, GeluAndMul):
        return {"none": 1, "tanh": 2}.get(act_fn.approximate)
    return None


def _is_gemma(layer: "FusedDecoderLayer") -> bool:
    """Gemma's layer: four norms (x * (1 + w)), the attention's and the MLP's outputs
    normed before they join the residual."""
    return isinstance(layer, (Gemma2DecoderLayer, Gemma3DecoderLayer))


def _layer_norms(layer: "FusedDecoderLayer") -> list[torch.nn.Module]:
    """The layer's hidden-size norms, input first; then the ones the C++ op takes as
    ``post_norm`` (added to the residual), ``attn_out_norm`` and ``mlp_out_norm``."""
    if _is_gemma(layer):
        return [layer.input_layernorm, layer.pre_feedforward_layernorm,
                layer.post_attention_layernorm, layer.post_feedforward_layernorm]
    return [layer.input_layernorm, layer.post_attention_layernorm]


def _plain_norm(norm: torch.nn.Module, gemma: bool) -> bool:
    """vLLM's RMSNorm with a weight and no variance override, or Gemma's."""
    if gemma:
        return type(norm) is GemmaRMSNorm
    return isinstance(norm, RMSNorm) and norm.has_weight and norm.variance_size_override is None


def _norm_weight(norm: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The weight the C++ RMSNorm multiplies by: Gemma's ``1 + w`` (in ``dtype``)."""
    if type(norm) is GemmaRMSNorm:
        return (norm.weight.float() + 1.0).to(dtype)
    return norm.weight


def _plain_attention_and_mlp(layer: "FusedDecoderLayer") -> bool:
    """Llama's attention and MLP, Mistral's without its Llama-4 scaling and its
    time-conditioned norm (the Voxtral variant), Qwen3's or Gemma 3's with q/k norms of
    the layer's epsilon, or Gemma 2's."""
    attn_layer = layer.self_attn
    if type(layer.mlp) not in (LlamaMLP, Qwen2MLP, Gemma2MLP, Gemma3MLP):
        return False
    if type(attn_layer) in (LlamaAttention, Gemma2Attention):
        return True
    if type(attn_layer) in (Qwen3Attention, Gemma3Attention):
        eps = layer.input_layernorm.variance_epsilon
        return all(_plain_norm(n, _is_gemma(layer)) and n.variance_epsilon == eps
                   for n in (attn_layer.q_norm, attn_layer.k_norm))
    return (type(attn_layer) is MistralAttention and not attn_layer.do_llama_4_scaling
            and getattr(layer, "ada_rms_norm_t_cond", None) is None)


def _why_not_fused(layer: "FusedDecoderLayer") -> str | None:
    """What keeps ``layer`` on vLLM's forward, or None when the C++ op runs all of it."""
    attn_layer, mlp = layer.self_attn, layer.mlp
    if native.torch_ops() is None:
        return "the C++ ops library did not build"
    if get_tensor_model_parallel_world_size() != 1:
        return "tensor parallel (the layer all-reduces between its linears)"
    if layer.kv_transfer:  # (vLLM creates the connector after loading the model)
        return "a KV connector (it hooks vLLM's attention op)"
    if not _plain_attention_and_mlp(layer):
        return "a Llama variant with its own attention or MLP"
    if _layer_weights(layer) is None:
        return ("a linear that is neither a plain bf16 one on vllm_accel::bf16_linear, "
                "a 4-bit one on the cpu_native int4 kernel nor a W8A8 one with dynamic "
                "per-token activations on vllm_accel::int8_linear_dynamic (float32/float16 "
                "weights, another quantization, act-order, static activation scales, "
                "LoRA, or ACCEL_BF16_LINEAR=off)")
    norms = _layer_norms(layer)
    if not all(_plain_norm(n, _is_gemma(layer)) for n in norms) or len(
            {n.variance_epsilon for n in norms}) != 1:
        return "an RMSNorm variant"
    rope = attn_layer.rotary_emb
    if not (isinstance(rope, RotaryEmbedding) and rope.cos_sin_cache.dim() == 2
            and rope.head_size == attn_layer.head_dim
            and {getattr(type(rope), name) for name in ("forward_native", "forward_cpu",
                                                        "forward_oot")} <= _BASE_ROPE_FORWARDS):
        return f"rotary embedding {type(rope).__name__}"
    if _activation_code(mlp.act_fn) is None:
        return f"activation {type(mlp.act_fn).__name__}"
    attn = attn_layer.attn
    impl = attn.impl
    if not (isinstance(impl, AccelAttentionImpl) and impl._attention_step is not None
            and impl.kv_sharing_target_layer_name is None and attn.query_quant is None):
        return (f"attention {type(impl).__name__} without the one-call cache write and "
                "attention step (another backend or kernel provider, an fp8 cache, or a "
                "shared KV cache)")
    if impl.attn_type != AttentionType.DECODER:
        return f"{impl.attn_type} attention (the C++ layer's attention step is causal)"
    if set(impl.features) - _FUSED_FEATURES:
        return (f"attention with {', '.join(sorted(set(impl.features) - _FUSED_FEATURES))} "
                "(the C++ layer takes a sliding window and a soft-cap)")
    dtype = layer.input_layernorm.weight.dtype
    if (attn.kv_cache_dtype not in ("auto", INT8_KV)
            and STR_DTYPE_TO_TORCH_DTYPE.get(attn.kv_cache_dtype) != dtype):
        return f"a {attn.kv_cache_dtype} KV cache for {dtype} activations"
    return None


class FusedDecoderLayer:
    """Mixed into a vLLM Llama-style decoder layer (before it): the layer runs as
    ``vllm_accel::cpu_decoder_layer`` once ``prepare_fused`` found every part of it on
    the simulator's kernels."""

    def __init__(self, *args, prefix: str = "", **kwargs) -> None:
        super().__init__(*args, prefix=prefix, **kwargs)
        # (Llama's and Mistral's layers are handed the config; Qwen3's is built while
        # vLLM holds it as the current one)
        vllm_config = kwargs.get("vllm_config") or get_current_vllm_config()
        # how llama_layer finds this layer at run time (vLLM's attention layers and
        # its MoE layers register the same way)
        self.layer_name = prefix
        forward_context = vllm_config.compilation_config.static_forward_context
        if prefix in forward_context:
            raise ValueError(f"Duplicate layer name: {prefix}")
        forward_context[prefix] = self
        self.kv_transfer = vllm_config.kv_transfer_config is not None
        #: the C++ op's per-layer arguments; None until prepare_fused, () for vLLM's forward
        self._fused_args: tuple | None = None
        #: its trailing ones: each linear's quantization tensor (int4 scales and zeros,
        #: or W8A8 per-channel scales; None: a bf16 linear)
        self._fused_quant: tuple = ()
        #: the attention step's sliding window and soft-cap (0: none), the q/k norms,
        #: Gemma's attention- and MLP-output norms, the activation's code
        self._fused_features: tuple = (0, 0.0, None, None, None, None, 0)

    def prepare_fused(self) -> str | None:
        """Decide (after the weights load) whether this layer runs as one C++ op;
        returns what keeps it on vLLM's forward, if anything."""
        reason = _why_not_fused(self)
        if reason is not None:
            self._fused_args = ()
            return reason
        attn_layer, mlp = self.self_attn, self.mlp
        dtype = self.input_layernorm.weight.dtype
        rope = attn_layer.rotary_emb
        # the cache in the activations' dtype, as the rope kernel wants it (vLLM's helper
        # casts it once and keeps it)
        cos_sin_cache = rope._match_cos_sin_cache_dtype(self.input_layernorm.weight.new_empty(0))
        (qkv, _), (o, _), (gate_up, _), (down, _) = weights = _layer_weights(self)
        norm_in, norm_post, *out_norms = [_norm_weight(n, dtype) for n in _layer_norms(self)]
        self._fused_args = (
            norm_in, qkv, attn_layer.qkv_proj.bias, o, attn_layer.o_proj.bias, norm_post,
            gate_up, down, self.input_layernorm.variance_epsilon, cos_sin_cache,
            rope.rotary_dim, rope.is_neox_style, attn_layer.num_heads,
            attn_layer.num_kv_heads, attn_layer.head_dim)
        self._fused_quant = tuple(quant for _, quant in weights)
        features = attn_layer.attn.impl.features
        qk_norms = [_norm_weight(n, dtype) if n is not None else None
                    for n in (getattr(attn_layer, "q_norm", None),
                              getattr(attn_layer, "k_norm", None))]
        attn_out_norm, mlp_out_norm = out_norms or (None, None)
        self._fused_features = (features.get("sliding_window", 0),
                                features.get("logits_soft_cap", 0.0), *qk_norms,
                                attn_out_norm, mlp_out_norm, _activation_code(mlp.act_fn))
        return None

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self._fused_args or any(v is not None for v in kwargs.values()):
            return super().forward(positions, hidden_states, residual, **kwargs)
        if torch.compiler.is_compiling():  # the graph holds one opaque op a layer
            return torch.ops.vllm_accel.llama_layer(positions, hidden_states, residual,
                                                    self.layer_name)
        # eager: the op's body without the dispatcher round trip (~10 us a layer)
        return self.forward_fused(get_forward_context().attn_metadata, positions,
                                  hidden_states, residual)

    def forward_fused(self, attn_metadata, positions: torch.Tensor, hidden_states: torch.Tensor,
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer through the C++ op, or op by op where it declines the batch (or
        there is none: vLLM's profiling run)."""
        if isinstance(attn_metadata, list):  # speculative decoding: [0] is the base model's
            attn_metadata = attn_metadata[0]
        attn = self.self_attn.attn
        md = (attn_metadata.get(attn.layer_name) if isinstance(attn_metadata, dict)
              else attn_metadata)
        if md is not None:
            k_scale, v_scale = attn.impl._layer_kv_scales(attn)
            out, new_residual = torch.ops.vllm_accel.cpu_decoder_layer(
                hidden_states, residual, positions, *self._fused_args, attn.kv_cache,
                md.slot_mapping, md.block_table, md.query_start_loc_cpu, md.seq_lens,
                attn.impl.scale, k_scale or 0.0, v_scale or 0.0, PREFILL_NATIVE_MAX_PAIRS,
                *self._fused_quant, *self._fused_features)
            if out is not None:
                return out, new_residual
        # (new tensors, as an op's outputs must be: the post-attention norm makes the
        # residual, the first layer's too)
        return super().forward(positions, hidden_states, residual)


class AccelLlamaDecoderLayer(FusedDecoderLayer, LlamaDecoderLayer):
    """vLLM's Llama decoder layer, one C++ op where it can."""


class AccelMistralDecoderLayer(FusedDecoderLayer, MistralDecoderLayer):
    """vLLM's Mistral decoder layer (Llama's with a sliding window), one C++ op where
    it can."""


class AccelQwen3DecoderLayer(FusedDecoderLayer, Qwen3DecoderLayer):
    """vLLM's Qwen3 decoder layer (q/k norms), one C++ op where it can (built by
    vLLM's ``Qwen3Model`` through ``patches.py``'s ``qwen3_layer``)."""


class AccelGemma2DecoderLayer(FusedDecoderLayer, Gemma2DecoderLayer):
    """vLLM's Gemma 2 decoder layer (four norms, soft-capped and windowed attention,
    GELU-tanh), one C++ op where it can (built through ``patches.py``'s
    ``gemma_layers``)."""


class AccelGemma3DecoderLayer(FusedDecoderLayer, Gemma3DecoderLayer):
    """vLLM's Gemma 3 decoder layer (Gemma 2's with q/k norms, local and global rope),
    one C++ op where it can (built through ``patches.py``'s ``gemma_layers``)."""


class AccelLlamaForCausalLM(LlamaForCausalLM):
    """vLLM's ``LlamaForCausalLM`` built from ``AccelLlamaDecoderLayer``."""

    def __init__(self, *, vllm_config, prefix: str = "",
                 layer_type: type[torch.nn.Module] = AccelLlamaDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class AccelMistralForCausalLM(MistralForCausalLM):
    """vLLM's ``MistralForCausalLM`` built from ``AccelMistralDecoderLayer``."""

    def __init__(self, *, vllm_config, prefix: str = "",
                 layer_type: type[torch.nn.Module] = AccelMistralDecoderLayer) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, layer_type=layer_type)


class AccelQwen3ForCausalLM(Qwen3ForCausalLM):
    """vLLM's ``Qwen3ForCausalLM`` built from ``AccelQwen3DecoderLayer``."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm_accel import patches

        with patches.applied("qwen3_model", layer_type=AccelQwen3DecoderLayer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)


class AccelGemma2ForCausalLM(Gemma2ForCausalLM):
    """vLLM's ``Gemma2ForCausalLM`` built from ``AccelGemma2DecoderLayer``."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm_accel import patches

        with patches.applied("gemma_layers", name="Gemma2DecoderLayer",
                             layer_type=AccelGemma2DecoderLayer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)


class AccelGemma3ForCausalLM(Gemma3ForCausalLM):
    """vLLM's ``Gemma3ForCausalLM`` built from ``AccelGemma3DecoderLayer``."""

    def __init__(self, *, vllm_config, prefix: str = "") -> None:
        from vllm_accel import patches

        with patches.applied("gemma_layers", name="Gemma3DecoderLayer",
                             layer_type=AccelGemma3DecoderLayer):
            super().__init__(vllm_config=vllm_config, prefix=prefix)


def prepare_fused_layers(model: torch.nn.Module) -> None:
    """Run each Llama or Mistral decoder layer of ``model`` as one C++ op where it can
    (call after the weights load, before the first forward) and log the outcome."""
    layers = [m for m in model.modules() if isinstance(m, FusedDecoderLayer)]
    reasons = {layer.prepare_fused() for layer in layers}
    if not layers:
        return
    if reasons == {None}:
        logger.info("Llama decoder layers: each runs as one C++ op "
                    "(vllm_accel::cpu_decoder_layer), %d layers", len(layers))
        return
    logger.info("Llama decoder layers: vLLM's forward for %d of %d (%s)",
                sum(not layer._fused_args for layer in layers), len(layers),
                "; ".join(sorted(r for r in reasons if r)))


def _llama_layer(positions: torch.Tensor, hidden_states: torch.Tensor,
                 residual: torch.Tensor | None, layer_name: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    context = get_forward_context()
    return context.no_compile_layers[layer_name].forward_fused(
        context.attn_metadata, positions, hidden_states, residual)


def _llama_layer_shape(positions, hidden_states, residual, layer_name):
    return torch.empty_like(hidden_states), torch.empty_like(hidden_states)


_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
direct_register_custom_op("llama_layer", _llama_layer, mutates_args=[],
                          fake_impl=_llama_layer_shape, target_lib=_LIB)
