"""GPTQ checkpoints: the ``gcu_gptq`` config, its checkpoint tensors and converter.

Checkpoint format (AutoGPTQ / GPTQModel), per Linear with ``in``/``out``
features, ``bits`` in {4, 8}, ``pf = 32 // bits`` and ``G`` groups: ``qweight``
int32 ``[in/pf, out]`` (input rows packed, lowest bits first), ``qzeros`` int32
``[G, out/pf]`` (zero points packed along the output dim; ``checkpoint_format:
gptq`` stores ``zero - 1``, ``gptq_v2`` stores ``zero``), ``scales`` ``[G, out]``
and ``g_idx`` int32 ``[in]`` (the group of each input channel).
``W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``.

The load converts this into the shared resident layout of
:mod:`vllm_accel.quant.packed` (scales compacted to fp16, which holds GPTQ's fp16
scales exactly; the v1 zero-point offset removed). Act-order (``desc_act``,
non-trivial ``g_idx``): the weight's columns are reordered once at load by a
stable sort of ``g_idx``, so each group's columns become contiguous and the
grouped layout applies unchanged (a per-group scale over a contiguous column
block, the shape a device kernel wants); the sort permutation is kept as the
resident ``perm`` and applied to the activations at run time (one gather of
``tokens x in`` per call). Keeping checkpoint column order instead would need a
per-column scale gather inside every weight tile. Only when the sorted groups are
not uniform (act-order under row-parallel TP, where a rank holds a scattered
subset of the global groups) is the sorted ``g_idx`` kept too and the kernel
gathers scales per column.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from vllm.model_executor.layers.linear import (
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    GroupQuantScaleParameter,
    PackedColumnParameter,
    PackedvLLMParameter,
    RowvLLMParameter,
)

from vllm_accel.quant.base import AccelQuantConfig, is_moe
from vllm_accel.quant.moe import QuantMoEMethod
from vllm_accel.quant.packed import (
    WIntResident,
    compact_float,
    pack_nibbles,
    unpack_int32,
)
from vllm_accel.quant.wint_method import WIntLinearMethod

QUANT_NAME = "gcu_gptq"
SUPPORTED_BITS = (4, 8)
SUPPORTED_FORMATS = ("gptq", "gptq_v2")


# ---------------------------------------------------------------------------
# Checkpoint tensors -> resident layout (pure torch, no vLLM state)
# ---------------------------------------------------------------------------


def gptq_to_resident(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                     g_idx: torch.Tensor | None, *, bits: int, group_size: int,
                     checkpoint_format: str = "gptq", group_offset: int = 0,
                     prefix: str = "<layer>") -> WIntResident:
    """Convert one layer's checkpoint tensors (as loaded, possibly a TP shard) to
    the resident layout. ``g_idx`` may be None or all -1 (absent in the
    checkpoint: groups are contiguous). ``group_offset`` is subtracted from
    ``g_idx`` (the first group of this rank when scales are sharded by input)."""
    pf = 32 // bits
    in_features, out_features = qweight.shape[0] * pf, qweight.shape[1]
    gs = in_features if group_size == -1 else group_size
    n_groups = scales.shape[0]

    codes = unpack_int32(qweight, bits, dim=0).t()  # [out, in]
    zeros = unpack_int32(qzeros, bits, dim=1)  # [G, out]
    if checkpoint_format == "gptq":
        zeros = zeros + 1  # v1 stores zero - 1
    scales_r = compact_float(scales.t().contiguous())  # [out, G]
    zeros_r = None
    if not bool((zeros == 2 ** (bits - 1)).all()):
        zeros_r = zeros.t().contiguous().to(scales_r.dtype)

    perm = g_sorted = None
    trivial = torch.arange(in_features, dtype=torch.int64) // gs
    if g_idx is not None and not bool((g_idx < 0).all()):
        gi = g_idx.to(torch.int64) - group_offset
        if int(gi.min()) < 0 or int(gi.max()) >= n_groups:
            raise AccelGPTQConfig.fail(
                prefix, f"g_idx holds groups outside [0, {n_groups}) (after offset "
                f"{group_offset})", "the checkpoint's g_idx does not match its scales; "
                "re-export it")
        if not torch.equal(gi, trivial):
            perm = torch.argsort(gi, stable=True)
            codes = codes[:, perm]
            g_sorted = gi[perm]
            if torch.equal(g_sorted, trivial):
                g_sorted = None
            else:
                g_sorted = g_sorted.to(torch.int32)
    codes = codes.to(torch.uint8)
    packed = pack_nibbles(codes) if bits == 4 else codes.contiguous()
    return WIntResident(qweight=packed, scales=scales_r, zeros=zeros_r, perm=perm,
                        g_idx=g_sorted, bits=bits, group_size=gs,
                        in_features=in_features, out_features=out_features)


# ---------------------------------------------------------------------------
# vLLM config and linear method
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTQLayerParams:
    """GPTQ settings of one layer (the config's, after ``dynamic`` overrides)."""

    bits: int
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str


def _validate(params: GPTQLayerParams, prefix: str) -> None:
    fail = AccelGPTQConfig.fail
    if params.bits not in SUPPORTED_BITS:
        raise fail(prefix, f"{params.bits}-bit GPTQ weights are not supported "
                   f"(supported: {', '.join(map(str, SUPPORTED_BITS))})",
                   "re-quantize the model with bits=4 or bits=8")
    if params.checkpoint_format not in SUPPORTED_FORMATS:
        raise fail(prefix, f"checkpoint_format {params.checkpoint_format!r} is a "
                   "kernel-specific repacked layout, not the GPTQ format "
                   f"(supported: {', '.join(SUPPORTED_FORMATS)})",
                   "use the model's plain GPTQ export (GPTQModel saves "
                   "checkpoint_format='gptq' by default)")
    if params.group_size != -1 and params.group_size <= 0:
        raise fail(prefix, f"group_size {params.group_size} is invalid",
                   "use -1 (per output channel) or a positive group size")


@register_quantization_config(QUANT_NAME)
class AccelGPTQConfig(AccelQuantConfig):
    """GPTQ (AutoGPTQ / GPTQModel format) on vllm_accel devices.

    Claims every ``quant_method: gptq`` checkpoint (auto-detected, or with
    ``--quantization gptq`` / ``gcu_gptq``); ``--quantization auto_gptq`` still
    selects vLLM's own method. Supports 4/8-bit, any group size dividing the
    layer's input, sym/asym, act-order, ``checkpoint_format`` gptq and gptq_v2,
    GPTQModel ``dynamic`` per-module overrides and ``modules_in_block_to_quantize``.
    """

    quant_name = QUANT_NAME
    checkpoint_method = "gptq"

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool,
                 checkpoint_format: str = "gptq", lm_head_quantized: bool = False,
                 dynamic: dict[str, dict[str, Any]] | None = None,
                 modules_in_block_to_quantize: list | None = None) -> None:
        super().__init__()
        self.weight_bits = bits
        self.group_size = group_size
        self.desc_act = desc_act and group_size != -1  # no-op for one group
        self.is_sym = sym
        self.checkpoint_format = checkpoint_format
        self.lm_head_quantized = lm_head_quantized
        self.dynamic = dynamic or {}
        self.modules_in_block_to_quantize = modules_in_block_to_quantize or []

    def __repr__(self) -> str:
        return (f"AccelGPTQConfig(bits={self.weight_bits}, group_size={self.group_size}, "
                f"desc_act={self.desc_act}, sym={self.is_sym}, "
                f"checkpoint_format={self.checkpoint_format!r}, dynamic={self.dynamic})")

    @staticmethod
    def get_config_filenames() -> list[str]:
        return ["quantize_config.json"]

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AccelGPTQConfig:
        fmt = cls.get_from_keys_or(config, ["checkpoint_format", "format"], None) or "gptq"
        return cls(
            bits=int(cls.get_from_keys(config, ["bits"])),
            group_size=int(cls.get_from_keys(config, ["group_size"])),
            desc_act=bool(cls.get_from_keys_or(config, ["desc_act"], False)),
            sym=bool(cls.get_from_keys_or(config, ["sym"], True)),
            checkpoint_format=str(fmt).lower(),
            lm_head_quantized=bool(cls.get_from_keys_or(config, ["lm_head"], False)),
            dynamic=cls.get_from_keys_or(config, ["dynamic"], None),
            modules_in_block_to_quantize=cls.get_from_keys_or(
                config, ["modules_in_block_to_quantize"], None),
        )

    @staticmethod
    def get_checkpoint_weight_mapper():
        # The base class drops ``.g_idx`` (vLLM's kernels ignore act-order); we
        # need it.
        from vllm.model_executor.models.utils import WeightsMapper

        return WeightsMapper()

    def layer_params(self, prefix: str) -> GPTQLayerParams | None:
        """This layer's settings after GPTQModel ``dynamic`` rules (first match
        wins; ``-:regex`` leaves the layer unquantized), validated; None means
        unquantized."""
        values = {"bits": self.weight_bits, "group_size": self.group_size,
                  "desc_act": self.desc_act, "sym": self.is_sym}
        for pattern, overrides in self.dynamic.items():
            if pattern.startswith("-:"):
                if re.match(pattern[2:], prefix):
                    return None
                continue
            if re.match(pattern.removeprefix("+:"), prefix):
                values.update({k: v for k, v in (overrides or {}).items() if k in values})
                break
        params = GPTQLayerParams(
            bits=int(values["bits"]), group_size=int(values["group_size"]),
            desc_act=bool(values["desc_act"]) and int(values["group_size"]) != -1,
            sym=bool(values["sym"]), checkpoint_format=self.checkpoint_format)
        _validate(params, prefix)
        return params

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            is_layer_gptq_quantized,
        )

        if is_moe(layer):
            return self._moe_method(layer, prefix)
        if not self.is_quantizable_linear(
                layer, prefix, what="GPTQ-quantized", lm_head_quantized=self.lm_head_quantized,
                lm_head_fix="re-quantize with lm_head=False"):
            return None
        params = self.layer_params(prefix)
        if params is None or not is_layer_gptq_quantized(
                prefix, self.modules_in_block_to_quantize, self.packed_modules_mapping):
            return UnquantizedLinearMethod()
        return AccelGPTQLinearMethod(params, prefix)

    def _moe_method(self, layer: torch.nn.Module, prefix: str):
        """GPTQModel writes a MoE layer's experts as linears ``experts.<e>.<proj>``:
        expert 0's gate projection stands for all (its ``dynamic`` rule and whether
        the checkpoint quantized it)."""
        from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            is_layer_gptq_quantized,
        )

        expert = f"{prefix}.0.{layer.ckpt_gate_proj_name}"
        params = self.layer_params(expert)
        if params is None or not is_layer_gptq_quantized(
                expert, self.modules_in_block_to_quantize, self.packed_modules_mapping):
            return UnquantizedFusedMoEMethod(layer.moe_config)  # ours (register_oot)
        return AccelGPTQMoEMethod(params, layer.moe_config, prefix)

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.modules_in_block_to_quantize:
            self.modules_in_block_to_quantize = hf_to_vllm_mapper.apply_list(
                self.modules_in_block_to_quantize)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Learn which layers are quantized from the checkpoint (int32 tensors)
        when the config does not list them (as vLLM's own GPTQ configs do)."""
        from vllm.model_executor.layers.quantization.utils.gptq_utils import flatten_list

        if self.modules_in_block_to_quantize:
            self.modules_in_block_to_quantize = flatten_list(self.modules_in_block_to_quantize)
            return
        modules = self.modules_in_checkpoint(
            model_name, revision,
            lambda name, info: info.get("dtype") in ("I32", "I8", "U8", "I16"))
        if modules is not None:
            self.modules_in_block_to_quantize = modules


def _g_idx_loader(layer_loader, prefix: str):
    """Weight loader for ``g_idx``: merged layers (qkv, gate_up) load one g_idx
    per shard into a single tensor, which is only valid if all shards agree (they
    do in real GPTQ checkpoints: those layers read the same input, so share one
    act-order). A mismatch raises instead of silently keeping the last shard."""

    def load_g_idx(param, loaded_weight, *args, **kwargs):
        before = param.data.clone() if getattr(param, "_g_idx_loaded", False) else None
        layer_loader(param, loaded_weight, *args, **kwargs)
        if before is not None and not torch.equal(before, param.data):
            raise AccelGPTQConfig.fail(
                prefix, "its merged shards have different act-order g_idx",
                "re-quantize so that layers reading the same input share one act-order "
                "(as GPTQ does), or with desc_act=False")
        param._g_idx_loaded = True

    return load_g_idx


@register_weight_loader_v2_supported_method
class AccelGPTQLinearMethod(WIntLinearMethod, quant_name=QUANT_NAME, cache_format="gptq"):
    """Loads GPTQ tensors through vLLM's loaders (TP sharding, qkv/gate_up
    merging); the wint scheme converts and serves them."""

    def __init__(self, params: GPTQLayerParams, prefix: str = "") -> None:
        super().__init__(prefix)
        self.params = params
        self.pack_factor = 32 // params.bits
        self.group_offset = 0

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        p, pf, prefix = self.params, self.pack_factor, self.prefix
        weight_loader = extra_weight_attrs.get("weight_loader")
        out_pp = sum(output_partition_sizes)
        is_row_parallel = input_size != input_size_per_partition
        if input_size_per_partition % pf:
            raise self.fail(f"input size {input_size_per_partition} (per rank) is not a "
                            f"multiple of {pf}, the {p.bits}-bit values per int32",
                            "use a tensor-parallel size that keeps it a multiple")
        if any(size % pf for size in output_partition_sizes):
            raise self.fail(f"output sizes {output_partition_sizes} (per rank) are not "
                            f"multiples of {pf}, as the packed qzeros need",
                            "use a tensor-parallel size that keeps them multiples")
        gs = input_size if p.group_size == -1 else p.group_size
        # Act-order groups are scattered over all input channels, and a single
        # group (-1) spans them: a row-parallel rank then needs every group's
        # scales. Otherwise the groups shard with the input rows.
        replicate = is_row_parallel and (p.group_size == -1 or p.desc_act)
        if input_size % gs or (not replicate and input_size_per_partition % gs):
            raise self.group_size_error(
                p.group_size, input_size if replicate else input_size_per_partition,
                is_row_parallel, "e.g. 32, 64 or -1")
        n_groups = input_size // gs if replicate else input_size_per_partition // gs
        # A row-parallel rank holds input rows [rank * in_pp, ...) and, unless
        # replicated, only their groups; column-parallel ranks hold every input row.
        self.group_offset = (layer.tp_rank * (input_size_per_partition // gs)
                             if is_row_parallel and not replicate else 0)

        qweight = PackedvLLMParameter(
            data=torch.empty(input_size_per_partition // pf, out_pp, dtype=torch.int32),
            input_dim=0, output_dim=1, packed_dim=0, packed_factor=pf,
            weight_loader=weight_loader)
        # fp32 holds fp16 or bf16 checkpoint scales exactly; compacted at load.
        scale_data = torch.empty(n_groups, out_pp, dtype=torch.float32)
        zeros_data = torch.empty(n_groups, out_pp // pf, dtype=torch.int32)
        if replicate:
            scales = ChannelQuantScaleParameter(data=scale_data, output_dim=1,
                                                weight_loader=weight_loader)
            qzeros = PackedColumnParameter(data=zeros_data, output_dim=1, packed_dim=1,
                                           packed_factor=pf, weight_loader=weight_loader)
        else:
            scales = GroupQuantScaleParameter(data=scale_data, input_dim=0, output_dim=1,
                                              weight_loader=weight_loader)
            qzeros = PackedvLLMParameter(data=zeros_data, input_dim=0, output_dim=1,
                                         packed_dim=1, packed_factor=pf,
                                         weight_loader=weight_loader)
        # -1 = "not in the checkpoint" (some exports omit g_idx without act-order)
        g_idx = RowvLLMParameter(
            data=torch.full((input_size_per_partition,), -1, dtype=torch.int32),
            input_dim=0, weight_loader=_g_idx_loader(weight_loader, prefix))
        layer.register_parameter("qweight", qweight)
        layer.register_parameter("qzeros", qzeros)
        layer.register_parameter("scales", scales)
        layer.register_parameter("g_idx", g_idx)

    def checkpoint_tensors(self) -> list[str]:
        return ["qweight", "qzeros", "scales", "g_idx"]

    def cache_params(self) -> dict:
        p = self.params
        return {"bits": p.bits, "group_size": p.group_size,
                "checkpoint_format": p.checkpoint_format, "group_offset": self.group_offset}

    def to_resident(self, sources: dict[str, torch.Tensor]) -> WIntResident:
        p = self.params
        return gptq_to_resident(
            sources["qweight"], sources["qzeros"], sources["scales"], sources["g_idx"],
            bits=p.bits, group_size=p.group_size, checkpoint_format=p.checkpoint_format,
            group_offset=self.group_offset, prefix=self.prefix)

    def describe(self, res: WIntResident) -> str:
        p = self.params
        return (f"{p.bits}-bit group {p.group_size}{' sym' if p.sym else ' asym'}"
                f"{' act-order' if res.perm is not None else ''}")


def _expert_g_idx_loader(layer: torch.nn.Module, prefix: str):
    """Weight loader for the experts' ``g_idx`` (vLLM's MoE loader has no case for
    it): the local expert's row; gate and up (``w1``/``w3``) read the same input, so
    they must agree (as in real GPTQ checkpoints); ``w2``'s rows narrowed to this
    tensor-parallel rank's share of the intermediate channels."""

    def load(param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        e = layer._map_global_expert_id_to_local_expert_id(expert_id)
        if e == -1:
            return False if return_success else None
        dst = param.data[e]
        if shard_id == "w2":
            tp, rank = layer.moe_config.tp_size, layer.moe_config.tp_rank
            n = loaded_weight.shape[0] // tp
            dst.copy_(loaded_weight.narrow(0, rank * n, n))
        else:
            if bool((dst >= 0).any()) and not torch.equal(dst, loaded_weight.to(dst.dtype)):
                raise AccelGPTQConfig.fail(
                    f"{prefix}.{expert_id}", "its gate and up projections have different "
                    "act-order g_idx", "re-quantize so that gate and up share one "
                    "act-order (as GPTQ does), or with desc_act=False")
            dst.copy_(loaded_weight)
        return True if return_success else None

    return load


class AccelGPTQMoEMethod(QuantMoEMethod):
    """GPTQ experts: vLLM's MoE loader fills ``[E, ...]`` stacks of the checkpoint's
    tensors (``w13_qweight`` ``[E, H/pf, 2I]``, ``w13_scales``/``w13_qzeros`` per
    group, ``w2_*`` likewise, K-first as GPTQ stores them); after loading each expert
    is converted like a dense GPTQ linear (:func:`gptq_to_resident`)."""

    quant_name = QUANT_NAME
    PROJECTIONS = ("w13", "w2")
    TENSORS = ("qweight", "scales", "qzeros", "g_idx")

    def __init__(self, params: GPTQLayerParams, moe, prefix: str) -> None:
        super().__init__(moe, prefix)
        self.params = params
        self.pack_factor = 32 // params.bits
        self.w2_group_offset = 0

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
        from vllm.model_executor.utils import set_weight_attrs

        self.check_layer(layer)
        p, pf, h, i = self.params, self.pack_factor, hidden_size, intermediate_size_per_partition
        tp = layer.moe_config.tp_size
        if p.desc_act and tp > 1:
            raise self.fail(
                f"act-order (desc_act) experts at tensor-parallel size {tp}: each rank's "
                "share of a down projection would need every group's scales",
                "serve with --enable-expert-parallel (each rank holds whole experts), or "
                "a checkpoint quantized with desc_act=False")
        if h % pf or i % pf:
            raise self.fail(f"hidden size {h} or intermediate size {i} (per rank) is not a "
                            f"multiple of {pf}, the {p.bits}-bit values per int32",
                            "use a tensor-parallel size that keeps them multiples")
        gs13 = h if p.group_size == -1 else p.group_size
        gs2 = i if p.group_size == -1 else p.group_size
        if h % gs13 or i % gs2:
            raise self.fail(f"group size {p.group_size} does not divide the hidden size {h} "
                            f"and the intermediate size {i} (per rank)",
                            "use a tensor-parallel size that keeps whole groups per rank, "
                            "or expert parallelism (--enable-expert-parallel)")
        g13, g2 = h // gs13, i // gs2
        self.w2_group_offset = layer.moe_config.tp_rank * g2 if p.group_size != -1 else 0
        strategy = (FusedMoeWeightScaleSupported.CHANNEL if p.group_size == -1
                    else FusedMoeWeightScaleSupported.GROUP).value
        attrs = {**extra_weight_attrs, "quant_method": strategy, "is_transposed": True}
        e = num_experts
        shapes = {
            "w13_qweight": ((e, h // pf, 2 * i), torch.int32),
            "w2_qweight": ((e, i // pf, h), torch.int32),
            # fp32 holds fp16 or bf16 checkpoint scales exactly; compacted at load
            "w13_scales": ((e, g13, 2 * i), torch.float32),
            "w2_scales": ((e, g2, h), torch.float32),
            "w13_qzeros": ((e, g13, 2 * i // pf), torch.int32),
            "w2_qzeros": ((e, g2, h // pf), torch.int32),
        }
        self.register_expert_tensors(layer, shapes, attrs, e, h, i, params_dtype,
                                     extra_weight_attrs)
        # -1 = "not in the checkpoint" (exports without act-order may omit g_idx)
        for name, width in (("w13_g_idx", h), ("w2_g_idx", i)):
            param = torch.nn.Parameter(torch.full((e, width), -1, dtype=torch.int32),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {"weight_loader": _expert_g_idx_loader(layer, self.prefix)})

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return tuple(f"{proj}_{t}" for proj in self.PROJECTIONS for t in self.TENSORS)

    def expert_linears(self, layer, e: int):
        p = self.params

        def one(proj: str, group_offset: int):
            t = {name: getattr(layer, f"{proj}_{name}")[e] for name in self.TENSORS}
            return self.install_expert(gptq_to_resident(
                t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits=p.bits,
                group_size=p.group_size, checkpoint_format=p.checkpoint_format,
                group_offset=group_offset, prefix=f"{self.prefix}.{e}.{proj}"))

        return one("w13", 0), one("w2", self.w2_group_offset)

    def describe(self) -> str:
        p = self.params
        return (f"{p.bits}-bit group {p.group_size}{' sym' if p.sym else ' asym'}"
                f"{' act-order' if p.desc_act else ''}")
