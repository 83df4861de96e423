"""llmcompressor (compressed-tensors) checkpoints: ``gcu_compressed_tensors``.

The config (``quant_method: compressed-tensors``) maps layers to schemes through
``config_groups`` (each with ``targets``: module class names such as ``Linear``
or ``re:<regex>`` layer names, and ``weights``/``input_activations`` args) minus
``ignore``; each scheme has a ``format`` (or the config's global one). Per layer:

* ``pack-quantized``, integer weights of 4 or 8 bits, no input quantization
  (W4A16 / W8A16), strategy ``group`` or ``channel``, symmetric or not:
  :class:`AccelCTWNA16LinearMethod` (the wint scheme of
  :mod:`vllm_accel.quant.wint_method`).
* ``int-quantized`` with 8-bit integer weights (channel/tensor) and 8-bit
  integer input activations (dynamic per-token or static per-tensor):
  ``vllm_accel.quant.w8a8.AccelW8A8LinearMethod``.
* ``float-quantized`` FP8 weights (strategy ``tensor``, ``channel`` or ``block``;
  llmcompressor's FP8 / FP8_DYNAMIC / FP8_BLOCK presets), with or without fp8 input
  activations: dequantized at load by :mod:`vllm_accel.quant.fp8` (activations stay
  in the model dtype, as in vLLM's CPU fp8 kernels).
* anything else (nvfp4/mxfp4, 2:4 sparsity, W4A8, group act-order, int block
  strategy, transforms, KV-cache schemes, ...): a startup error naming the layer
  and the fix.

``pack-quantized`` on disk, per Linear (``pf = 32 // bits``, ``G`` groups):

* ``weight_packed`` int32 ``[out, ceil(in/pf)]``: packed along the *input* dim,
  lowest bits first; each field holds ``q + 2**(bits-1)`` for the signed code
  ``q`` (i.e. an unsigned code);
* ``weight_scale`` ``[out, G]`` (``G = 1`` for ``channel``), model dtype;
* ``weight_zero_point`` (asymmetric only) int32 ``[ceil(out/pf), G]``: signed
  zero points offset by ``2**(bits-1)``, packed along the *output* dim;
* ``weight_shape`` int64 ``[2]`` = ``(out, in)``.

``W = (q - zp) * scale``; with both offset, ``W = (code - zero) * scale`` on the
unsigned fields, which is the resident layout's formula directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.parameter import (
    BasevLLMParameter,
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
)

from vllm_accel.logger import init_logger
from vllm_accel.quant.base import AccelQuantConfig, is_moe
from vllm_accel.quant.fp8 import AccelFp8LinearMethod, AccelFp8MoEMethod, Fp8Layout
from vllm_accel.quant.moe import QuantMoEMethod
from vllm_accel.quant.packed import WIntResident, resident_from_codes, unpack_int32
from vllm_accel.quant.w8a8 import AccelW8A8LinearMethod, AccelW8A8MoEMethod
from vllm_accel.quant.wint_method import WIntLinearMethod

logger = init_logger(__name__)

QUANT_NAME = "gcu_compressed_tensors"
CT_METHOD = "compressed-tensors"
WEIGHT_ONLY_FORMATS = ("pack-quantized",)
W8A8_FORMATS = ("int-quantized",)
WNA16_BITS = (4, 8)


@dataclass(frozen=True)
class CTScheme:
    """One config group, as the loader needs it."""

    name: str
    targets: tuple[str, ...]
    weights: dict | None
    input_activations: dict | None
    output_activations: dict | None
    format: str | None

    def describe(self) -> str:
        def args(a):
            if not a:
                return "none"
            return (f"{a.get('type')}{a.get('num_bits')} {a.get('strategy')}"
                    f"{'' if a.get('symmetric', True) else ' asym'}"
                    f"{' dynamic' if a.get('dynamic') else ''}")

        return (f"group {self.name!r} (format {self.format}, weights {args(self.weights)}, "
                f"input activations {args(self.input_activations)})")


@dataclass(frozen=True)
class WNA16Params:
    """Weight-only settings of one layer."""

    bits: int
    strategy: str  # group | channel
    group_size: int  # -1 for channel
    symmetric: bool


def _unsupported_fix(scheme: CTScheme) -> str:
    return ("re-export the model with llmcompressor using a supported scheme: W4A16 / "
            "W8A16 (pack-quantized, group or channel, sym or asym), W8A8 int8 "
            "(int-quantized, channel/tensor weights, dynamic per-token or static "
            "per-tensor activations) or FP8 (float-quantized, tensor/channel/block "
            "weights), or list this layer in `ignore`")


FP8_FORMATS = ("float-quantized", "naive-quantized")


def fp8_layout(scheme: CTScheme, prefix: str) -> Fp8Layout:
    """Validate an FP8-weight scheme for one layer (errors name the layer)."""
    fail = AccelCompressedTensorsConfig.fail
    w, a = scheme.weights or {}, scheme.input_activations
    strategy = str(w.get("strategy", ""))
    if int(w.get("num_bits", 0)) != 8 or not w.get("symmetric", True) or w.get("dynamic"):
        raise fail(prefix, f"float weights other than static symmetric 8-bit "
                   f"({scheme.describe()}) are not supported", _unsupported_fix(scheme))
    if scheme.format not in FP8_FORMATS:
        raise fail(prefix, f"fp8 weights in format {scheme.format!r} ({scheme.describe()}) "
                   f"are not supported (supported: {', '.join(FP8_FORMATS)})",
                   _unsupported_fix(scheme))
    if a is not None and (a.get("type") != "float" or int(a.get("num_bits", 0)) != 8):
        raise fail(prefix, f"fp8 weights with {a.get('type')}{a.get('num_bits')} input "
                   f"activations ({scheme.describe()}) are not supported",
                   _unsupported_fix(scheme))
    static = a is not None and not a.get("dynamic")
    if strategy == "block":
        block = w.get("block_structure") or []
        if len(block) != 2 or min(block) <= 0:
            raise fail(prefix, f"block strategy with block_structure {block!r}",
                       "re-export with block_structure [bn, bk], e.g. [128, 128]")
        return Fp8Layout("block", "weight_scale", (int(block[0]), int(block[1])),
                         static_input=static, quant_name=QUANT_NAME)
    if strategy not in ("tensor", "channel"):
        raise fail(prefix, f"fp8 weight strategy {strategy!r} ({scheme.describe()}) is not "
                   "supported", "re-export with strategy 'channel', 'tensor' or 'block'")
    return Fp8Layout(strategy, "weight_scale", static_input=static, quant_name=QUANT_NAME)


def wna16_params(scheme: CTScheme, prefix: str) -> WNA16Params:
    """Validate a weight-only scheme for one layer (errors name the layer)."""
    fail = AccelCompressedTensorsConfig.fail
    w = scheme.weights or {}
    bits = int(w.get("num_bits", 0))
    strategy = str(w.get("strategy", ""))
    if w.get("type", "int") != "int":
        raise fail(prefix, f"{w.get('type')} weights ({scheme.describe()}) are not "
                   "supported", _unsupported_fix(scheme))
    if bits not in WNA16_BITS:
        raise fail(prefix, f"{bits}-bit weights ({scheme.describe()}) are not supported "
                   f"(supported: {', '.join(map(str, WNA16_BITS))})",
                   "re-quantize with num_bits 4 (W4A16) or 8 (W8A16)")
    if strategy not in ("group", "channel"):
        raise fail(prefix, f"weight strategy {strategy!r} ({scheme.describe()}) is not "
                   "supported for weight-only layers", "re-quantize with strategy "
                   "'group' (e.g. group_size 128) or 'channel'")
    if w.get("actorder") in ("group", "dynamic"):
        raise fail(prefix, f"activation ordering actorder={w.get('actorder')!r} stores a "
                   "per-layer g_idx that this plugin does not support",
                   "re-quantize with actorder 'static' (same accuracy, no g_idx) or none")
    if w.get("dynamic"):
        raise fail(prefix, "dynamic weight quantization is not a stored checkpoint",
                   "re-export the model with static weights")
    if w.get("block_structure"):
        raise fail(prefix, "block-structured weight scales are not supported",
                   "re-quantize with strategy 'group' or 'channel'")
    gs = -1
    if strategy == "group":
        gs = int(w.get("group_size") or 0)
        if gs <= 0:
            raise fail(prefix, f"strategy 'group' with group_size {w.get('group_size')}",
                       "set a positive group_size in the scheme")
    return WNA16Params(bits=bits, strategy=strategy, group_size=gs,
                       symmetric=bool(w.get("symmetric", True)))


def ct_to_resident(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                   weight_zero_point: torch.Tensor | None, *, bits: int, group_size: int,
                   in_features: int) -> WIntResident:
    """One layer's pack-quantized tensors (possibly a TP shard) -> resident layout."""
    out_features = weight_packed.shape[0]
    codes = unpack_int32(weight_packed, bits, dim=1)[:, :in_features]  # [out, in]
    zeros = None
    if weight_zero_point is not None:
        zeros = unpack_int32(weight_zero_point, bits, dim=0)[:out_features]  # [out, G]
    return resident_from_codes(codes, weight_scale, zeros, bits=bits, group_size=group_size)


@register_quantization_config(QUANT_NAME)
class AccelCompressedTensorsConfig(AccelQuantConfig):
    """compressed-tensors (llmcompressor) checkpoints on vllm_accel devices.

    Claims every ``quant_method: compressed-tensors`` checkpoint (auto-detected,
    or with ``--quantization compressed-tensors`` / ``gcu_compressed_tensors``).
    """

    quant_name = QUANT_NAME
    checkpoint_method = CT_METHOD
    claimed_aliases = ("compressed_tensors",)

    def __init__(self, schemes: list[CTScheme], ignore: list[str], quant_format: str | None,
                 kv_cache_scheme: dict | None = None, sparsity_config: dict | None = None,
                 transform_config: dict | None = None) -> None:
        super().__init__()
        self.schemes = schemes
        self.ignore = list(ignore or [])
        self.quant_format = quant_format
        self.kv_cache_scheme = kv_cache_scheme
        self.sparsity_config = sparsity_config or {}
        self.transform_config = transform_config or {}

    def __repr__(self) -> str:
        return (f"AccelCompressedTensorsConfig(format={self.quant_format!r}, "
                f"groups={[s.describe() for s in self.schemes]}, ignore={self.ignore})")

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AccelCompressedTensorsConfig:
        quant_format = config.get("format")
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            if not isinstance(group, dict):
                raise ValueError(
                    f"{QUANT_NAME}: config group {name!r} is a preset reference "
                    f"({group!r}), not a stored scheme. Fix: load and re-save the model "
                    "with llmcompressor/compressed-tensors so config.json holds the "
                    "expanded scheme")
            schemes.append(CTScheme(
                name=name, targets=tuple(group.get("targets") or ()),
                weights=group.get("weights"),
                input_activations=group.get("input_activations"),
                output_activations=group.get("output_activations"),
                format=group.get("format") or quant_format))
        return cls(schemes=schemes, ignore=config.get("ignore") or [],
                   quant_format=quant_format, kv_cache_scheme=config.get("kv_cache_scheme"),
                   sparsity_config=config.get("sparsity_config"),
                   transform_config=config.get("transform_config"))

    # -- layer -> scheme ---------------------------------------------------

    def scheme_for(self, layer: torch.nn.Module, prefix: str) -> CTScheme | None:
        """The config group of this layer, or None when it stays unquantized."""
        from vllm.model_executor.layers.quantization.compressed_tensors.utils import (
            find_matched_target,
            should_ignore_layer,
        )

        if should_ignore_layer(prefix, ignore=self.ignore,
                               fused_mapping=self.packed_modules_mapping):
            return None
        for scheme in self.schemes:
            if find_matched_target(prefix, layer, scheme.targets,
                                   fused_mapping=self.packed_modules_mapping):
                return scheme
        return None

    def _check_global(self, prefix: str) -> None:
        if self.sparsity_config:
            raise self.fail(prefix, f"sparsity ({self.sparsity_config.get('format', 'sparse')}) "
                            "is not supported", "re-export the model without sparsity")
        if self.transform_config:
            raise self.fail(prefix, "compressed-tensors transforms (e.g. SpinQuant/QuIP "
                            "rotations) are not supported", "re-export without transforms")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        self._check_global(prefix)
        if type(layer).__name__ == "Attention" and self.kv_cache_scheme:
            raise self.fail(prefix, "a compressed-tensors kv_cache_scheme (quantized KV cache "
                            "with stored scales) is not supported",
                            "re-export without kv_cache_scheme and use --kv-cache-dtype "
                            "int8_per_token_head for a quantized KV cache")
        if is_moe(layer):
            return self._moe_method(layer, prefix)
        if not self.is_quantizable_linear(
                layer, prefix, what="compressed-tensors quantized",
                lm_head_quantized=self.scheme_for(layer, prefix) is not None,
                lm_head_fix="add 'lm_head' to `ignore` and re-export"):
            return None
        scheme = self.scheme_for(layer, prefix)
        if scheme is None:
            return UnquantizedLinearMethod()
        return self._linear_method(scheme, prefix)

    def _moe_method(self, layer: torch.nn.Module, prefix: str):
        """llmcompressor writes a MoE layer's experts as linears ``experts.<e>.<proj>``:
        expert 0's gate projection stands for all. Weight-only W4A16/W8A16 experts and
        W8A8 int8 ones (per-channel, dynamic per-token) are served; other expert
        schemes fail naming the fix."""
        from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod

        expert = f"{prefix}.0.{layer.ckpt_gate_proj_name}"
        scheme = self.scheme_for(torch.nn.Linear(0, 0), expert)
        if scheme is None:
            return UnquantizedFusedMoEMethod(layer.moe_config)  # ours (register_oot)
        method = self._linear_method(scheme, expert)
        if isinstance(method, AccelCTWNA16LinearMethod):
            return AccelCTWNA16MoEMethod(method.params, layer.moe_config, prefix)
        w = scheme.weights or {}
        if (isinstance(method, AccelW8A8LinearMethod) and w.get("strategy") == "channel"
                and method.input_dynamic):
            return AccelW8A8MoEMethod(layer.moe_config, prefix)
        if isinstance(method, AccelFp8LinearMethod):
            return AccelFp8MoEMethod(layer.moe_config, method.layout, prefix)
        raise self.fail(prefix, f"MoE experts quantized as {scheme.describe()} are not "
                        "supported (served: W4A16/W8A16 pack-quantized, W8A8 int8 with "
                        "per-channel weights and dynamic per-token activations, and FP8)",
                        "re-export the experts with llmcompressor's W4A16 or W8A8 preset, "
                        "or add them to `ignore`")

    def _linear_method(self, scheme: CTScheme, prefix: str) -> LinearMethodBase:
        w, a = scheme.weights, scheme.input_activations
        if scheme.output_activations:
            raise self.fail(prefix, f"output activation quantization ({scheme.describe()}) is "
                            "not supported", _unsupported_fix(scheme))
        if w is None:
            raise self.fail(prefix, f"{scheme.describe()} quantizes activations only",
                            _unsupported_fix(scheme))
        if w.get("type") == "float":
            return AccelFp8LinearMethod(fp8_layout(scheme, prefix), prefix)
        if a is None:
            if scheme.format not in WEIGHT_ONLY_FORMATS:
                raise self.fail(prefix, f"weight-only format {scheme.format!r} "
                                f"({scheme.describe()}) is not supported (supported: "
                                f"{', '.join(WEIGHT_ONLY_FORMATS)})", _unsupported_fix(scheme))
            return AccelCTWNA16LinearMethod(wna16_params(scheme, prefix), prefix)
        is_w8a8 = (scheme.format in W8A8_FORMATS and w.get("type") == "int"
                   and int(w.get("num_bits", 0)) == 8 and a.get("type") == "int"
                   and int(a.get("num_bits", 0)) == 8)
        if not is_w8a8:
            raise self.fail(prefix, f"scheme {scheme.describe()} is not supported",
                            _unsupported_fix(scheme))
        return self._w8a8_method(scheme, prefix)

    def _w8a8_method(self, scheme: CTScheme, prefix: str) -> LinearMethodBase:
        w, a = scheme.weights, scheme.input_activations
        if w.get("strategy") not in ("channel", "tensor") or not w.get("symmetric", True):
            raise self.fail(prefix, f"W8A8 weights must be symmetric with strategy channel or "
                            f"tensor ({scheme.describe()})", _unsupported_fix(scheme))
        dynamic = bool(a.get("dynamic"))
        strategy = a.get("strategy")
        if (dynamic and strategy != "token") or (not dynamic and strategy != "tensor"):
            raise self.fail(prefix, f"W8A8 input activations must be dynamic per-token or "
                            f"static per-tensor ({scheme.describe()})", _unsupported_fix(scheme))
        if dynamic and not a.get("symmetric", True):
            raise self.fail(prefix, "asymmetric dynamic input activations are not supported",
                            _unsupported_fix(scheme))
        return AccelW8A8LinearMethod(weight_strategy=w["strategy"], input_dynamic=dynamic,
                                     input_symmetric=bool(a.get("symmetric", True)),
                                     prefix=prefix)


@register_weight_loader_v2_supported_method
class AccelCTWNA16LinearMethod(WIntLinearMethod, quant_name=QUANT_NAME,
                               cache_format="ct-pack"):
    """Loads pack-quantized W4A16/W8A16 tensors through vLLM's loaders (TP
    sharding, qkv/gate_up merging); the wint scheme converts and serves them."""

    unused_tensors = ("weight_shape",)

    def __init__(self, params: WNA16Params, prefix: str = "") -> None:
        super().__init__(prefix)
        self.params = params
        self.pack_factor = 32 // params.bits
        self.group_size = params.group_size
        self.in_features = 0

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        p, pf = self.params, self.pack_factor
        weight_loader = extra_weight_attrs.get("weight_loader")
        out_pp = sum(output_partition_sizes)
        is_row_parallel = input_size != input_size_per_partition
        if p.bits == 4 and input_size_per_partition % 2:
            raise self.fail(f"input size {input_size_per_partition} is odd",
                            "4-bit weights need an even input size per rank")
        if is_row_parallel and input_size_per_partition % pf:
            raise self.fail(f"input size {input_size_per_partition} per rank is not a "
                            f"multiple of {pf}, the {p.bits}-bit values per int32",
                            "use a tensor-parallel size that keeps it a multiple")
        if not p.symmetric and len(output_partition_sizes) > 1 and any(
                size % pf for size in output_partition_sizes):
            raise self.fail(f"merged output sizes {output_partition_sizes} (per rank) "
                            f"are not multiples of {pf}, as the packed zero points need",
                            "use a tensor-parallel size that keeps them multiples")
        channel = p.group_size == -1
        gs = input_size_per_partition if channel else p.group_size
        if input_size_per_partition % gs:
            raise self.group_size_error(p.group_size, input_size_per_partition,
                                        is_row_parallel, "e.g. 32, 64 or 128; or strategy "
                                        "'channel'")
        self.group_size = gs
        self.in_features = input_size_per_partition
        n_groups = 1 if channel else input_size_per_partition // gs

        weight = PackedvLLMParameter(
            data=torch.empty(out_pp, -(-input_size_per_partition // pf), dtype=torch.int32),
            input_dim=1, output_dim=0, packed_dim=1, packed_factor=pf,
            weight_loader=weight_loader)
        # fp32 holds fp16/bf16/fp32 checkpoint scales exactly; compacted at load.
        scale_data = torch.empty(out_pp, n_groups, dtype=torch.float32)
        if channel:
            scale = ChannelQuantScaleParameter(data=scale_data, output_dim=0,
                                               weight_loader=weight_loader)
        else:
            scale = GroupQuantScaleParameter(data=scale_data, output_dim=0, input_dim=1,
                                             weight_loader=weight_loader)
        shape = BasevLLMParameter(data=torch.empty(2, dtype=torch.int64),
                                  weight_loader=weight_loader)
        layer.register_parameter("weight_packed", weight)
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter("weight_shape", shape)
        if not p.symmetric:
            zp_data = torch.zeros(-(-out_pp // pf), n_groups, dtype=torch.int32)
            if channel:
                zp = PackedColumnParameter(data=zp_data, output_dim=0, packed_dim=0,
                                           packed_factor=pf, weight_loader=weight_loader)
            else:
                zp = PackedvLLMParameter(data=zp_data, input_dim=1, output_dim=0,
                                         packed_dim=0, packed_factor=pf,
                                         weight_loader=weight_loader)
            layer.register_parameter("weight_zero_point", zp)

    def checkpoint_tensors(self) -> list[str]:
        return ["weight_packed", "weight_scale"] + ([] if self.params.symmetric
                                                    else ["weight_zero_point"])

    def cache_params(self) -> dict:
        return {"bits": self.params.bits, "group_size": self.group_size,
                "in_features": self.in_features}

    def to_resident(self, sources: dict[str, torch.Tensor]) -> WIntResident:
        return ct_to_resident(sources["weight_packed"], sources["weight_scale"],
                              sources.get("weight_zero_point"), bits=self.params.bits,
                              group_size=self.group_size, in_features=self.in_features)

    def describe(self, res: WIntResident) -> str:
        p = self.params
        return (f"{p.bits}-bit {p.strategy}"
                f"{'' if p.strategy == 'channel' else ' ' + str(p.group_size)}"
                f"{' sym' if p.symmetric else ' asym'}")


class AccelCTWNA16MoEMethod(QuantMoEMethod):
    """compressed-tensors weight-only experts: vLLM's MoE loader fills ``[E, ...]``
    stacks of the checkpoint's tensors in their own orientation (``w13_weight_packed``
    ``[E, 2I, H/pf]``, scales ``[E, 2I, G]``, zero points packed along the outputs);
    after loading each expert is converted like a dense pack-quantized linear."""

    quant_name = QUANT_NAME

    def __init__(self, params: WNA16Params, moe, prefix: str) -> None:
        super().__init__(moe, prefix)
        self.params = params
        self.pack_factor = 32 // params.bits
        self.sizes: dict[str, tuple[int, int]] = {}  # proj -> (in features, group size)

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        self.check_layer(layer)
        p, pf, h, i = self.params, self.pack_factor, hidden_size, intermediate_size_per_partition
        if h % pf or i % pf:
            raise self.fail(f"hidden size {h} or intermediate size {i} (per rank) is not a "
                            f"multiple of {pf}, the {p.bits}-bit values per int32",
                            "use a tensor-parallel size that keeps them multiples")
        channel = p.group_size == -1
        gs13, gs2 = (h, i) if channel else (p.group_size, p.group_size)
        if h % gs13 or i % gs2:
            raise self.fail(f"group size {p.group_size} does not divide the hidden size {h} "
                            f"and the intermediate size {i} (per rank)",
                            "use a tensor-parallel size that keeps whole groups per rank, "
                            "or expert parallelism (--enable-expert-parallel)")
        self.sizes = {"w13": (h, gs13), "w2": (i, gs2)}
        strategy = (FusedMoeWeightScaleSupported.CHANNEL if channel
                    else FusedMoeWeightScaleSupported.GROUP).value
        attrs = {**extra_weight_attrs, "quant_method": strategy}
        e, g13, g2 = num_experts, h // gs13, i // gs2
        shapes = {
            "w13_weight_packed": ((e, 2 * i, h // pf), torch.int32),
            "w2_weight_packed": ((e, h, i // pf), torch.int32),
            # fp32 holds fp16 or bf16 checkpoint scales exactly; compacted at load
            "w13_weight_scale": ((e, 2 * i, g13), torch.float32),
            "w2_weight_scale": ((e, h, g2), torch.float32),
            "w13_weight_shape": ((e, 2), torch.int64),
            "w2_weight_shape": ((e, 2), torch.int64),
        }
        if not p.symmetric:
            shapes["w13_weight_zero_point"] = ((e, 2 * i // pf, g13), torch.int32)
            shapes["w2_weight_zero_point"] = ((e, h // pf, g2), torch.int32)
        self.register_expert_tensors(layer, shapes, attrs, e, h, i, params_dtype,
                                     extra_weight_attrs)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return tuple(f"{proj}_weight_{t}" for proj in ("w13", "w2")
                     for t in ("packed", "scale", "shape", "zero_point"))

    def expert_linears(self, layer, e: int):
        def one(proj: str):
            in_features, group_size = self.sizes[proj]
            zp = getattr(layer, f"{proj}_weight_zero_point", None)
            return self.install_expert(ct_to_resident(
                getattr(layer, f"{proj}_weight_packed")[e],
                getattr(layer, f"{proj}_weight_scale")[e],
                None if zp is None else zp[e], bits=self.params.bits,
                group_size=group_size, in_features=in_features))

        return one("w13"), one("w2")

    def describe(self) -> str:
        p = self.params
        return (f"W{p.bits}A16 {p.strategy}"
                f"{'' if p.strategy == 'channel' else ' ' + str(p.group_size)}"
                f"{' sym' if p.symmetric else ' asym'}")
