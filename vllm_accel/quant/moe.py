"""Quantized MoE experts: the checkpoint formats' expert tensors in our resident layouts.

A quantized MoE checkpoint stores every expert's ``gate``/``up``/``down`` projections
the way the format stores a dense linear (GPTQ ``qweight``/``qzeros``/``scales``,
compressed-tensors ``weight``/``weight_scale``, ...), stacked by vLLM's MoE loader
into ``[E, ...]`` parameters with vLLM's names (``w13_qweight``, ``w2_scales``, ...).
:class:`QuantMoEMethod` is the MoE method of every such format: the routing of
:class:`~vllm_accel.ops.moe.AccelMoERouting`, and after loading each expert converted
by the format (:meth:`QuantMoEMethod.expert_linears`) into the modules its dense
linears use (``InstalledWInt`` for weight-only integers, the W8A8 module for int8).

Experts run in one of three ways, chosen at load:

- **stacked** (the simulator's C++ op ``vllm_accel::cpu_moe_experts``): where every
  expert has a layout the op reads (int4 in torch's int4pack layout without an
  act-order permutation; int8 weights with per-channel scales and dynamic per-token
  int8 activations), the experts' tensors are stacked ``[E, ...]`` on the layer and
  the op runs them through the dense layers' int4 / int8 kernels;
- **prepared** (a vendor kernel with a stacked layout of its own, e.g. Enflame's
  ``fused_moe_quant_kernel``): where the resolved ``moe_quant_experts`` kernel has a
  ``prepare_experts`` hook, the experts are built in the generic resident layout,
  which the hook converts into its own ``[E, ...]`` tensors (:class:`PreparedExperts`,
  the per-expert modules dropped) or declines (None: per expert then);
- **per expert** (any device): the layer keeps one module per expert and projection;
  the registry's ``moe_quant_experts`` kernel buckets the tokens and calls them.
  Under torch.compile that runs inside the opaque op ``vllm_accel::moe_quant_experts``,
  which finds the layer by name (the layers register themselves at load, as vLLM's
  own ``moe_forward`` finds its layer in the forward context).
"""

from __future__ import annotations

import weakref

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEMethodBase

from vllm_accel.logger import init_logger
from vllm_accel.ops.cpu_native import moe as cpu_native_moe
from vllm_accel.ops.moe import AccelMoERouting, check_supported
from vllm_accel.ops.registry import get_kernel, resolve_provider
from vllm_accel.quant.base import layer_error
from vllm_accel.quant.packed import InstalledWInt, WIntResident, installed

logger = init_logger(__name__)

#: quantized MoE layers of this process by layer name, for the opaque op
_LAYERS: weakref.WeakValueDictionary[str, torch.nn.Module] = weakref.WeakValueDictionary()

_LIB = torch.library.Library("vllm_accel", "FRAGMENT")
_LIB.define("moe_quant_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, "
            "str layer_name) -> Tensor")


def _moe_quant_experts_op(x, topk_weights, topk_ids, layer_name):
    layer = _LAYERS.get(layer_name)
    if layer is None:
        raise RuntimeError(f"vllm_accel: no quantized MoE layer {layer_name!r} in this "
                           "process (it registers when its weights are processed)")
    return layer.quant_method.experts_per_module(layer, x, topk_weights, topk_ids)


_LIB.impl("moe_quant_experts", _moe_quant_experts_op, "CompositeExplicitAutograd")


@torch.library.register_fake("vllm_accel::moe_quant_experts")
def _moe_quant_experts_shape(x, topk_weights, topk_ids, layer_name):
    return x.new_empty(x.shape)


class ExpertLinears(torch.nn.Module):
    """One projection (``w13`` or ``w2``) of every local expert, as modules
    ``y = module(x)`` (a submodule of the layer, so its tensors stay the layer's)."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(modules)


class PreparedExperts(torch.nn.Module):
    """One projection (``w13`` or ``w2``) of every local expert in ``provider``'s own
    stacked layout (``prepare_experts``): its tensors become parameters of the layer,
    its other entries (group size, ...) plain attributes."""

    def __init__(self, provider: str, entries: dict) -> None:
        super().__init__()
        self.provider = provider
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                self.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))
            else:
                setattr(self, name, value)


class QuantMoEMethod(AccelMoERouting, FusedMoEMethodBase):
    """A format subclasses it with ``create_weights`` (vLLM's parameter names and
    shapes, the checks that name the fix), :meth:`expert_linears` and
    :meth:`describe`; ``quant_name`` starts its errors and logs."""

    quant_name: str
    #: the resolved ``moe_quant_experts`` kernel's ``prepare_experts`` hook while the
    #: experts are built (they then keep the generic layout the hook reads), and those
    #: modules' resident weights (to install as usual if the hook declines)
    _prepare = None
    _generic: dict | None = None

    def __init__(self, moe, prefix: str) -> None:
        FusedMoEMethodBase.__init__(self, moe)
        self.prefix = prefix

    def fail(self, problem: str, fix: str) -> ValueError:
        return layer_error(self.quant_name, self.prefix, problem, fix)

    def get_fused_moe_quant_config(self, layer):
        return None  # the experts run here, never through vLLM's modular kernels

    def check_layer(self, layer) -> None:
        """The routing rules and features every MoE method of ours refuses alike, and
        experts without a gated activation (the expert kernels run act-and-mul)."""
        check_supported(layer)
        if not self.moe.is_act_and_mul:
            raise self.fail("experts without a gated (act-and-mul) activation",
                            "a model with gated experts (Mixtral, Qwen-MoE, DeepSeek)")

    def register_expert_tensors(self, layer, shapes: dict, attrs: dict, num_experts: int,
                                hidden_size: int, intermediate_size: int, params_dtype,
                                extra_weight_attrs: dict, fill=0, biases: bool = True) -> None:
        """vLLM's stacked expert parameters ``{name: (shape, dtype)}`` filled with
        ``fill``, with the loader's ``attrs``; and (``biases``) the experts' biases
        where the model has them."""
        from vllm.model_executor.utils import set_weight_attrs

        for name, (shape, dtype) in shapes.items():
            param = torch.nn.Parameter(torch.full(shape, fill, dtype=dtype),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, attrs)
        if biases and self.moe.has_bias:
            for name, width in (("w13_bias", 2 * intermediate_size), ("w2_bias", hidden_size)):
                param = torch.nn.Parameter(torch.zeros(num_experts, width, dtype=params_dtype),
                                           requires_grad=False)
                layer.register_parameter(name, param)
                set_weight_attrs(param, extra_weight_attrs)

    # -- what a format provides ---------------------------------------------

    def expert_linears(self, layer, e: int) -> tuple[torch.nn.Module, torch.nn.Module]:
        """Local expert ``e``'s (``w13``, ``w2``) modules from the loaded tensors
        (weight-only formats build them with :meth:`install_expert`)."""
        raise NotImplementedError

    def checkpoint_tensors(self) -> tuple[str, ...]:
        """The layer parameters ``create_weights`` registered (dropped after loading)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The experts' quantization in words, for the load log."""
        raise NotImplementedError

    # -- the shared part ------------------------------------------------------

    def install_expert(self, res: WIntResident) -> InstalledWInt:
        """One weight-only expert projection's module: the generic resident layout
        while a ``prepare_experts`` hook is to stack it, else :func:`installed`'s."""
        if self._prepare is None:
            return installed(res)
        module = InstalledWInt(res)
        self._generic[module] = res
        return module

    def process_weights_after_loading(self, layer) -> None:
        native = self._native()
        provider = resolve_provider("moe_quant_experts")
        self._prepare = None if native else getattr(get_kernel("moe_quant_experts"),
                                                    "prepare_experts", None)
        self._generic = {}
        pairs = [self.expert_linears(layer, e) for e in range(layer.local_num_experts)]
        for name in self.checkpoint_tensors():
            if hasattr(layer, name):
                delattr(layer, name)
        stacked = self._stacked(pairs) if native else None
        prepared = self._prepared(layer, pairs)
        if self._prepare is not None and prepared is None:  # declined
            pairs = [tuple(installed(self._generic[m]) if m in self._generic else m
                           for m in pair) for pair in pairs]
        self._prepare = self._generic = None
        if stacked is not None:
            for name, t in stacked.items():
                layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
            self.layout = "stacked for vllm_accel::cpu_moe_experts"
        elif prepared is not None:
            layer.w13_experts = PreparedExperts(provider, prepared[0])
            layer.w2_experts = PreparedExperts(provider, prepared[1])
            _LAYERS[layer.layer_name] = layer
            self.layout = f"stacked in {provider}'s layout, moe_quant_experts[{provider}]"
        else:
            layer.w13_experts = ExpertLinears([p[0] for p in pairs])
            layer.w2_experts = ExpertLinears([p[1] for p in pairs])
            _LAYERS[layer.layer_name] = layer
            self.layout = f"per expert, moe_quant_experts[{provider}]"
        logger.info_once(
            "%s MoE experts (e.g. %s): %s, %d of %d experts here, %s", self.quant_name,
            layer.layer_name, self.describe(), layer.local_num_experts,
            layer.global_num_experts, self.layout, scope="process")

    def _prepared(self, layer, pairs) -> tuple[dict, dict] | None:
        """The ``prepare_experts`` hook's (w13, w2) entries for these experts, or None
        (no hook, or it declined). Called where vLLM loads, so the default dtype is the
        activation dtype."""
        if self._prepare is None:
            return None
        biased = any(getattr(layer, name, None) is not None for name in ("w13_bias", "w2_bias"))
        return self._prepare([p[0] for p in pairs], [p[1] for p in pairs],
                             act_dtype=torch.get_default_dtype(), expert_map=layer.expert_map,
                             apply_router_weight_on_input=layer.apply_router_weight_on_input,
                             biased=biased)

    def _native(self) -> bool:
        return (cpu_native_moe.NATIVE_DISPATCH
                and resolve_provider("moe_experts") == cpu_native_moe.NATIVE)

    @staticmethod
    def _stacked(pairs) -> dict[str, torch.Tensor] | None:
        """``w13``/``w2`` weights and their quant tensors stacked ``[E, ...]`` when
        every expert's modules have a layout the C++ op reads, else None."""
        out: dict[str, list[torch.Tensor]] = {}
        for pair in pairs:
            for proj, module in zip(("w13", "w2"), pair):
                native = native_layout(module)
                if native is None:
                    return None
                weight, quant = native
                out.setdefault(f"{proj}_native", []).append(weight)
                out.setdefault(f"{proj}_native_quant", []).append(quant)
        return {name: torch.stack(ts).contiguous() for name, ts in out.items()}

    def experts(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        w13_bias, w2_bias = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        if hasattr(layer, "w13_native") and cpu_native_moe.takes(x):
            return cpu_native_moe.cpu_moe_experts(
                x, layer.w13_native, layer.w2_native, topk_weights, topk_ids,
                layer.expert_map, layer.w13_native_quant, layer.w2_native_quant, w13_bias,
                w2_bias, layer.activation.value, layer.apply_router_weight_on_input)
        if hasattr(layer, "w13_native"):
            raise RuntimeError(f"vllm_accel: {layer.layer_name}'s experts are stacked for "
                               f"the C++ op, which does not take {x.dtype} {x.device} input")
        return torch.ops.vllm_accel.moe_quant_experts(x, topk_weights, topk_ids,
                                                      layer.layer_name)

    def experts_per_module(self, layer, x: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
        w13, w2 = layer.w13_experts, layer.w2_experts
        if isinstance(w13, PreparedExperts):  # the provider whose layout it is
            kernel = get_kernel("moe_quant_experts", w13.provider)
        else:
            kernel, w13, w2 = get_kernel("moe_quant_experts"), w13.experts, w2.experts
        return kernel(
            x, w13, w2, topk_weights, topk_ids,
            expert_map=layer.expert_map, activation=layer.activation.value,
            apply_router_weight_on_input=layer.apply_router_weight_on_input,
            w13_bias=getattr(layer, "w13_bias", None), w2_bias=getattr(layer, "w2_bias", None))


def native_layout(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight, quant) of a projection module in a layout ``cpu_moe_experts`` reads:
    the int4pack weight with its ``[K/g, N, 2]`` scales and zeros (no permutation),
    or an int8 ``[N, K]`` weight with float32 per-channel scales that the W8A8 method
    runs with dynamic symmetric per-token activations."""
    operands = getattr(module, "cpp_operands", None)
    return operands() if operands is not None else None
