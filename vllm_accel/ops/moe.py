"""The plugin's mixture-of-experts layer: one vLLM MoE method on every backend.

vLLM 0.32 builds every MoE block (Mixtral, Qwen2/3-MoE, DeepSeek, ...) through
``FusedMoEFactory``: a ``MoERunner`` that owns the gate, the shared experts and the
tensor/expert-parallel reduction, around ``RoutedExperts``, whose ``quant_method``
holds the expert weights and computes the routed experts. For unquantized experts
that method is ``UnquantizedFusedMoEMethod``, a ``CustomOp``: :func:`install`
registers :class:`AccelFusedMoEMethod` as its out-of-tree replacement, so every
construction (by ``RoutedExperts`` and by quantization configs that leave a MoE
layer unquantized) builds ours.

Why not vLLM's MoE kernels: on the card path (an out-of-tree platform) vLLM's oracle
picks no kernel, weight processing returns early and the first forward fails on a
``None`` kernel; its routers call ``_moe_C`` ops the CPU wheel lacks. On the
simulator vLLM's CPU experts refuse hidden sizes that are not multiples of 32, prepack
the weights and ignore the expert map (expert parallelism).

The method is *monolithic*: ``apply_monolithic`` gets the router logits and does the
routing itself, through the kernel registry like attention and the linears:

- ``moe_route``: softmax or sigmoid scores, top-k, DeepSeek's correction bias and
  group-limited choice, renormalisation and ``routed_scaling_factor``;
- ``moe_experts``: the chosen experts held on this rank (``expert_map``), their
  weighted sum ``[M, H]`` (providers: ``reference`` float64 oracle, ``torch_fast``
  grouped matmuls, ``cpu_native`` the simulator's C++ op on the bf16 kernel,
  ``triton`` two grouped GEMMs over the pairs sorted by expert, no host sync).

The runner adds the shared experts and all-reduces across ranks; DeepSeek's runner
scales the output by ``routed_scaling_factor`` itself (the layer's factor is 1 then).

Quantized experts (GPTQ, compressed-tensors W8A8) have methods of their own in
:mod:`vllm_accel.quant.moe` that share this routing (:class:`AccelMoERouting`).

On the simulator vLLM calls the runner as plain Python inside the compiled graph, so
the experts run as one opaque op a layer: ``vllm_accel::cpu_moe_experts`` (C++, no
Python per call) or ``vllm_accel::moe_experts`` (which resolves the provider when it
runs); on the card the runner's own ``vllm::moe_forward`` op wraps all of it.
"""

import torch

from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase, UnquantizedFusedMoEMethod
from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

from vllm_accel.logger import init_logger
from vllm_accel.ops.cpu_native import moe as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import moe as _reference  # noqa: F401  (registers)
from vllm_accel.ops.reference.moe import GATED_ACTIVATIONS, SCORING_FUNCS
from vllm_accel.ops.registry import get_kernel, resolve_provider
from vllm_accel.ops.torch_fast import moe as _torch_fast  # noqa: F401  (registers)

logger = init_logger(__name__)

_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("moe_experts(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, "
            "Tensor topk_ids, Tensor? expert_map, Tensor? w13_bias, Tensor? w2_bias, "
            "str activation, bool apply_router_weight_on_input) -> Tensor")


def _moe_experts_op(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                    activation, apply_router_weight_on_input):
    return get_kernel("moe_experts")(
        x, w13, w2, topk_weights, topk_ids, expert_map=expert_map, activation=activation,
        apply_router_weight_on_input=apply_router_weight_on_input, w13_bias=w13_bias,
        w2_bias=w2_bias)


_LIB.impl("moe_experts", _moe_experts_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm_accel::moe_experts", lib=_LIB)
def _moe_experts_shape(x, w13, w2, topk_weights, topk_ids, expert_map, w13_bias, w2_bias,
                       activation, apply_router_weight_on_input):
    return x.new_empty((x.shape[0], w2.shape[1]))


def unsupported_features(layer) -> list[tuple[str, str]]:
    """(feature, fix) for each routing or expert rule of ``layer`` (a ``RoutedExperts``)
    this method does not compute."""
    missing = []
    activation = layer.activation.value
    if activation not in GATED_ACTIVATIONS:
        missing.append((f"the expert activation {activation!r}",
                        f"a model whose experts use one of {', '.join(GATED_ACTIVATIONS)}"))
    if layer.custom_routing_function is None and layer.scoring_func not in SCORING_FUNCS:
        missing.append((f"the router scoring function {layer.scoring_func!r}",
                        f"a model routing by {' or '.join(SCORING_FUNCS)}"))
    if any(getattr(layer, n, None) is not None
           for n in ("swiglu_limit", "swiglu_alpha", "swiglu_beta")):
        missing.append(("clamped SwiGLU experts (swiglu_limit/alpha/beta)",
                        "a model with plain gated experts"))
    if layer.moe_config.has_hash_routing:
        missing.append(("hash routing", "a model with learned routing"))
    if layer.moe_config.is_lora_enabled:
        missing.append(("LoRA on MoE experts", "serve the model without --enable-lora"))
    groups = layer.num_expert_group if layer.use_grouped_topk else None
    if groups and groups > 1 and layer.global_num_experts % groups:
        missing.append((f"{layer.global_num_experts} experts in {groups} groups",
                        "a checkpoint whose n_group divides n_routed_experts"))
    return missing


def _log_once(layer) -> None:
    """Once per process (each EP rank names its own share of the experts)."""
    routing = ("the model's custom routing function" if layer.custom_routing_function
               else f"{layer.scoring_func} top-{layer.top_k} ({resolve_provider('moe_route')})")
    logger.info_once("MoE layers: vllm_accel AccelFusedMoEMethod, %d of %d experts here, "
                     "routing %s, experts %s", layer.local_num_experts,
                     layer.global_num_experts, routing, resolve_provider("moe_experts"),
                     scope="process")


def check_supported(layer) -> None:
    """Refuse, at startup, a layer whose routing or expert rules these kernels do not
    compute, naming the layer, each feature and its fix."""
    missing = unsupported_features(layer)
    if missing:
        raise ValueError(
            f"vllm_accel: MoE layer {layer.layer_name} needs "
            + "; ".join(f"{what} (fix: {fix})" for what, fix in missing)
            + ", which the plugin's MoE kernels do not support yet.")


class AccelMoERouting:
    """The part every MoE method of ours shares (unquantized and quantized experts,
    :mod:`vllm_accel.quant.moe`): monolithic, routing through ``moe_route``; a
    subclass provides ``experts(layer, x, topk_weights, topk_ids)``."""

    @property
    def is_monolithic(self) -> bool:
        return True

    @property
    def supports_eplb(self) -> bool:
        return False

    def route(self, layer, x: torch.Tensor, router_logits: torch.Tensor):
        """(topk weights float32, global expert ids int32) for each token."""
        if layer.custom_routing_function is not None:
            weights, ids = layer.custom_routing_function(
                hidden_states=x, gating_output=router_logits, topk=layer.top_k,
                renormalize=layer.renormalize)
            return weights.to(torch.float32), ids.to(torch.int32)
        grouped = layer.use_grouped_topk
        return get_kernel("moe_route")(
            router_logits, layer.top_k, renormalize=layer.renormalize,
            scoring_func=layer.scoring_func,
            num_expert_group=layer.num_expert_group if grouped else None,
            topk_group=layer.topk_group if grouped else None,
            e_score_correction_bias=layer.e_score_correction_bias,
            routed_scaling_factor=layer.routed_scaling_factor)

    def experts(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def apply_monolithic(self, layer, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = self.route(layer, x, router_logits)
        return self.experts(layer, x, topk_weights, topk_ids)

    def apply(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        # the modular entry (a caller that routed already): the same experts
        return self.experts(layer, x, topk_weights, topk_ids)


class AccelFusedMoEMethod(AccelMoERouting, UnquantizedFusedMoEMethod):
    """Unquantized experts on the kernel registry's ``moe_route`` / ``moe_experts``,
    weights in vLLM's own layout (``w13_weight`` ``[E, 2I, H]``, ``w2_weight``
    ``[E, H, I]``), read in place."""

    def __init__(self, moe) -> None:
        # (not UnquantizedFusedMoEMethod.__init__: its oracle picks a vLLM kernel)
        FusedMoEMethodBase.__init__(self, moe)
        self.unquantized_backend = UnquantizedMoeBackend.OOT
        self.experts_cls = None
        self.supports_pre_processed_weights = True

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        check_supported(layer)
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                               params_dtype, **extra_weight_attrs)

    def process_weights_after_loading(self, layer) -> None:
        _log_once(layer)
        # The kernels read vLLM's layout in place; contiguous rows per expert.
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            p = getattr(layer, name, None)
            if p is not None and not p.is_contiguous():
                p.data = p.data.contiguous()
        # a vendor kernel may store the weights the way its op reads them
        prepare = getattr(get_kernel("moe_experts"), "prepare_layer", None)
        if prepare is not None:
            prepare(layer)

    def experts(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        activation = layer.activation.value
        w13_bias, w2_bias = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        if _cpu_native.takes(x) and resolve_provider("moe_experts") == _cpu_native.NATIVE:
            return _cpu_native.cpu_moe_experts(
                x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                layer.expert_map, None, None, w13_bias, w2_bias, activation,
                layer.apply_router_weight_on_input)
        return torch.ops.vllm_accel.moe_experts(
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, layer.expert_map,
            w13_bias, w2_bias, activation, layer.apply_router_weight_on_input)
