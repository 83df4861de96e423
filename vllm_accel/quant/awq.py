"""AutoAWQ checkpoints: the ``gcu_awq`` config, its checkpoint tensors and converter.

Checkpoint format (AutoAWQ ``version: gemm``, ``zero_point: true``), per Linear
with ``in``/``out`` features, 4-bit, ``G = in / group_size`` groups:

* ``qweight`` int32 ``[in, out/8]``: packed along the *output* dim; word
  ``c`` of row ``i`` holds columns ``8c .. 8c+7`` in AutoAWQ's interleaved
  order: bit field ``f`` (bits ``4f .. 4f+3``) holds column ``8c + ORDER[f]``,
  ``ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``.
* ``qzeros`` int32 ``[G, out/8]``: zero points packed the same way (real
  values, no offset).
* ``scales`` fp16 ``[G, out]``.

``W[o, i] = (q[i, o] - zero[i // group_size, o]) * scale[i // group_size, o]``.
There is no ``g_idx`` (AWQ has no act-order). The load converts this into the
shared resident layout of :mod:`vllm_accel.quant.packed`, served by the wint
scheme (:mod:`vllm_accel.quant.wint_method`).

Layers listed in ``modules_to_not_convert`` (substring match, as AutoAWQ and
transformers do) and layers without a ``qweight`` in the checkpoint stay in
full precision, and so does ``lm_head``.

MoE experts (AutoAWQ writes them as linears ``experts.<e>.<proj>``) are stacked by
vLLM's MoE loader into ``w13_qweight`` ``[E, H, 2I/8]``, ``w2_qweight`` ``[E, I, H/8]``
and their zeros and scales; after loading each expert is converted like a dense AWQ
linear (:class:`AccelAWQMoEMethod`, on :mod:`vllm_accel.quant.moe`).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.linear import (
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.parameter import GroupQuantScaleParameter, PackedvLLMParameter

from vllm_accel.quant.base import AccelQuantConfig, is_moe
from vllm_accel.quant.moe import QuantMoEMethod
from vllm_accel.quant.packed import WIntResident, resident_from_codes, unpack_int32
from vllm_accel.quant.wint_method import WIntLinearMethod

QUANT_NAME = "gcu_awq"
SUPPORTED_BITS = (4,)
SUPPORTED_VERSIONS = ("gemm",)
#: bit field f of a packed word holds column 8c + AWQ_PACK_ORDER[f]
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_awq(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ-packed int32 ``[R, C/8]`` -> int32 values ``[R, C]`` in column order."""
    fields = unpack_int32(words, bits, dim=1)  # [R, C] in bit-field order per word
    r, c = fields.shape
    pf = 32 // bits
    order = torch.tensor(AWQ_PACK_ORDER[:pf], dtype=torch.long)
    out = torch.empty_like(fields).view(r, c // pf, pf)
    out[:, :, order] = fields.view(r, c // pf, pf)
    return out.view(r, c)


def awq_to_resident(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *,
                    bits: int, group_size: int) -> WIntResident:
    """One layer's AWQ tensors (as loaded, possibly a TP shard) -> resident layout."""
    codes = unpack_awq(qweight, bits).t()  # [out, in]
    zeros = unpack_awq(qzeros, bits).t()  # [out, G]
    return resident_from_codes(codes, scales.t().contiguous(), zeros.contiguous(), bits=bits,
                               group_size=group_size)


@register_quantization_config(QUANT_NAME)
class AccelAWQConfig(AccelQuantConfig):
    """AWQ (AutoAWQ GEMM format) on vllm_accel devices.

    Claims every ``quant_method: awq`` checkpoint (auto-detected, or with
    ``--quantization awq`` / ``gcu_awq``); ``--quantization auto_awq`` or
    ``awq_marlin`` still select vLLM's own methods. Supports 4-bit, zero point,
    any group size dividing the layer's input (per rank).
    """

    quant_name = QUANT_NAME
    checkpoint_method = "awq"

    def __init__(self, bits: int, group_size: int, zero_point: bool, version: str = "gemm",
                 modules_to_not_convert: list[str] | None = None,
                 lm_head_quantized: bool = False) -> None:
        super().__init__()
        self.weight_bits = bits
        self.group_size = group_size
        self.zero_point = zero_point
        self.version = version
        self.modules_to_not_convert = list(modules_to_not_convert or [])
        self.lm_head_quantized = lm_head_quantized
        #: layers with a ``qweight`` in the checkpoint (learnt from its metadata)
        self.quantized_modules: list[str] = []

    def __repr__(self) -> str:
        return (f"AccelAWQConfig(bits={self.weight_bits}, group_size={self.group_size}, "
                f"zero_point={self.zero_point}, version={self.version!r}, "
                f"modules_to_not_convert={self.modules_to_not_convert})")

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quant_config.json", "quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AccelAWQConfig:
        return cls(
            bits=int(cls.get_from_keys(config, ["w_bit", "bits"])),
            group_size=int(cls.get_from_keys(config, ["q_group_size", "group_size"])),
            zero_point=bool(cls.get_from_keys_or(config, ["zero_point"], True)),
            version=str(cls.get_from_keys_or(config, ["version"], "gemm")).lower(),
            modules_to_not_convert=cls.get_from_keys_or(config, ["modules_to_not_convert"],
                                                        None),
            lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
        )

    def validate(self, prefix: str) -> None:
        """Reject what the format or the kernel cannot serve, naming the layer."""
        if self.weight_bits not in SUPPORTED_BITS:
            raise self.fail(prefix, f"{self.weight_bits}-bit AWQ weights are not supported "
                            "(AutoAWQ GEMM is 4-bit)", "re-quantize the model with w_bit=4")
        if self.version not in SUPPORTED_VERSIONS:
            raise self.fail(prefix, f"AWQ version {self.version!r} is a kernel-specific layout "
                            f"(supported: {', '.join(SUPPORTED_VERSIONS)})",
                            "export the model with AutoAWQ version='GEMM'")
        if not self.zero_point:
            raise self.fail(prefix, "AWQ without zero points (zero_point: false) is not "
                            "supported", "re-quantize with zero_point=True (AutoAWQ's default)")
        if self.group_size <= 0 and self.group_size != -1:
            raise self.fail(prefix, f"group_size {self.group_size} is invalid",
                            "use a positive group size (e.g. 128) or -1")

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            is_layer_gptq_quantized,
        )
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            is_layer_skipped,
        )

        if is_moe(layer):
            return self._moe_method(layer, prefix)
        if not self.is_quantizable_linear(
                layer, prefix, what="AWQ-quantized",
                lm_head_quantized=self.lm_head_quantized,
                lm_head_fix="re-quantize with lm_head left in full precision"):
            return None
        if is_layer_skipped(prefix, self.modules_to_not_convert,
                            self.packed_modules_mapping, match_mode="substring"):
            return UnquantizedLinearMethod()
        if not is_layer_gptq_quantized(prefix, self.quantized_modules,
                                       self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        self.validate(prefix)
        return AccelAWQLinearMethod(self, prefix)

    def _moe_method(self, layer: torch.nn.Module, prefix: str):
        """Expert 0's gate projection stands for the layer's experts (whether the
        export skipped or quantized them)."""
        from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            is_layer_gptq_quantized,
        )
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            is_layer_skipped,
        )

        expert = f"{prefix}.0.{layer.ckpt_gate_proj_name}"
        if (is_layer_skipped(prefix, self.modules_to_not_convert,
                             self.packed_modules_mapping, match_mode="substring")
                or not is_layer_gptq_quantized(expert, self.quantized_modules,
                                               self.packed_modules_mapping)):
            return UnquantizedFusedMoEMethod(layer.moe_config)  # ours (register_oot)
        self.validate(prefix)
        return AccelAWQMoEMethod(self, layer.moe_config, prefix)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.modules_to_not_convert:
            self.modules_to_not_convert = hf_to_vllm_mapper.apply_list(
                self.modules_to_not_convert)
        if self.quantized_modules:
            self.quantized_modules = hf_to_vllm_mapper.apply_list(self.quantized_modules)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Learn which layers hold AWQ tensors (int32 ``qweight``) so that layers
        the export left in float load unquantized even when the config does not
        list them."""
        modules = self.modules_in_checkpoint(
            model_name, revision,
            lambda name, info: name.endswith(".qweight") and info.get("dtype") == "I32")
        if modules is not None:
            self.quantized_modules = modules


@register_weight_loader_v2_supported_method
class AccelAWQLinearMethod(WIntLinearMethod, quant_name=QUANT_NAME, cache_format="awq"):
    """Loads AWQ tensors through vLLM's loaders (TP sharding, qkv/gate_up
    merging); the wint scheme converts and serves them."""

    def __init__(self, config: AccelAWQConfig, prefix: str = "") -> None:
        super().__init__(prefix)
        self.config = config
        self.bits = config.weight_bits
        self.pack_factor = 32 // config.weight_bits
        self.group_size = config.group_size

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        pf = self.pack_factor
        weight_loader = extra_weight_attrs.get("weight_loader")
        out_pp = sum(output_partition_sizes)
        is_row_parallel = input_size != input_size_per_partition
        if any(size % pf for size in output_partition_sizes):
            raise self.fail(f"output sizes {output_partition_sizes} (per rank) are not "
                            f"multiples of {pf}, the {self.bits}-bit values per int32 of "
                            "AWQ's output-packed qweight",
                            "use a tensor-parallel size that keeps them multiples")
        if self.config.group_size == -1 and is_row_parallel:
            raise self.fail("a single AWQ group (group_size -1) cannot be split over "
                            "tensor-parallel ranks", "use tensor-parallel size 1 or a "
                            "checkpoint with a positive group size")
        gs = input_size_per_partition if self.config.group_size == -1 else self.config.group_size
        if input_size_per_partition % gs:
            raise self.group_size_error(self.config.group_size, input_size_per_partition,
                                        is_row_parallel, "e.g. 32, 64 or 128")
        self.group_size = gs
        n_groups = input_size_per_partition // gs
        qweight = PackedvLLMParameter(
            data=torch.empty(input_size_per_partition, out_pp // pf, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=1, packed_factor=pf,
            weight_loader=weight_loader)
        qzeros = PackedvLLMParameter(
            data=torch.empty(n_groups, out_pp // pf, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=1, packed_factor=pf,
            weight_loader=weight_loader)
        # fp32 holds fp16/bf16 checkpoint scales exactly; compacted at load.
        scales = GroupQuantScaleParameter(
            data=torch.empty(n_groups, out_pp, dtype=torch.float32), input_dim=0,
            output_dim=1, weight_loader=weight_loader)
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)

    def checkpoint_tensors(self) -> list[str]:
        return ["qweight", "qzeros", "scales"]

    def cache_params(self) -> dict:
        return {"bits": self.bits, "group_size": self.group_size}

    def to_resident(self, sources: dict[str, torch.Tensor]) -> WIntResident:
        return awq_to_resident(sources["qweight"], sources["qzeros"], sources["scales"],
                               bits=self.bits, group_size=self.group_size)

    def describe(self, res: WIntResident) -> str:
        return (f"{self.bits}-bit group {self.config.group_size} "
                f"{'asym' if res.zeros is not None else 'sym'}")


class AccelAWQMoEMethod(QuantMoEMethod):
    """AWQ experts: vLLM's MoE loader fills ``[E, ...]`` stacks of the checkpoint's
    tensors (output-packed as AWQ stores them, ``is_transposed``: input rows first);
    after loading each expert is converted like a dense AWQ linear."""

    quant_name = QUANT_NAME
    TENSORS = ("qweight", "qzeros", "scales")

    def __init__(self, config: AccelAWQConfig, moe, prefix: str) -> None:
        super().__init__(moe, prefix)
        self.config = config
        self.pack_factor = 32 // config.weight_bits

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        self.check_layer(layer)
        pf, h, i, gs = self.pack_factor, hidden_size, intermediate_size_per_partition, \
            self.config.group_size
        if h % pf or i % pf:
            raise self.fail(f"hidden size {h} or intermediate size {i} (per rank) is not a "
                            f"multiple of {pf}, the 4-bit values per int32",
                            "use a tensor-parallel size that keeps them multiples")
        if gs == -1 and layer.moe_config.tp_size > 1:
            raise self.fail("a single AWQ group (group_size -1) cannot be split over "
                            "tensor-parallel ranks",
                            "serve with --enable-expert-parallel or a positive group size")
        gs13, gs2 = (h, i) if gs == -1 else (gs, gs)
        if h % gs13 or i % gs2:
            raise self.fail(f"group size {gs} does not divide the hidden size {h} and the "
                            f"intermediate size {i} (per rank)",
                            "use a tensor-parallel size that keeps whole groups per rank, "
                            "or expert parallelism (--enable-expert-parallel)")
        self.group_sizes = (gs13, gs2)
        attrs = {**extra_weight_attrs, "is_transposed": True,
                 "quant_method": FusedMoeWeightScaleSupported.GROUP.value}
        e, g13, g2 = num_experts, h // gs13, i // gs2
        shapes = {
            "w13_qweight": ((e, h, 2 * i // pf), torch.int32),
            "w2_qweight": ((e, i, h // pf), torch.int32),
            "w13_qzeros": ((e, g13, 2 * i // pf), torch.int32),
            "w2_qzeros": ((e, g2, h // pf), torch.int32),
            # fp32 holds fp16 or bf16 checkpoint scales exactly; compacted at load
            "w13_scales": ((e, g13, 2 * i), torch.float32),
            "w2_scales": ((e, g2, h), torch.float32),
        }
        self.register_expert_tensors(layer, shapes, attrs, e, h, i, params_dtype,
                                     extra_weight_attrs)

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return tuple(f"{proj}_{t}" for proj in ("w13", "w2") for t in self.TENSORS)

    def expert_linears(self, layer, e: int):
        def one(proj: str, group_size: int):
            t = {name: getattr(layer, f"{proj}_{name}")[e] for name in self.TENSORS}
            return self.install_expert(awq_to_resident(
                t["qweight"], t["qzeros"], t["scales"], bits=self.config.weight_bits,
                group_size=group_size))

        return one("w13", self.group_sizes[0]), one("w2", self.group_sizes[1])

    def describe(self) -> str:
        return f"{self.config.weight_bits}-bit group {self.config.group_size} asym"
