"""FP8 checkpoints (``quant_method: fp8``): the ``gcu_fp8`` config.

Checkpoint format (vLLM's ``Fp8Config``; transformers' FineGrainedFP8, DeepSeek-V3
and Qwen3 FP8 exports; older per-tensor FP8 exports), per Linear:

* ``weight`` float8_e4m3fn ``[out, in]``;
* block scales ``weight_scale_inv`` float32 ``[ceil(out/bn), ceil(in/bk)]`` when the
  config has ``weight_block_size: [bn, bk]`` (``W = q * s[o // bn, i // bk]``), else
  per-tensor ``weight_scale`` (one per checkpoint tensor, so a merged qkv has three);
* ``input_scale`` (``activation_scheme: static``): the calibrated activation scale.

vLLM's CPU kernels for these need AMX tiles (``CPUFp8BlockScaledMMKernel``,
``CPUFp8PerTensorScaledMMLinearKernel``); elsewhere stock vLLM CPU fails at startup
("Failed to find a kernel that can implement the ScaledMM linear layer"), and a card
has no fp8 kernel of ours. So this config claims fp8 checkpoints (only an explicit
``--quantization fp8`` on the simulator with AMX leaves them to vLLM's kernels) and
dequantizes each weight once at load (``q * s`` computed in float32, then rounded to
the model dtype) into a dense weight: the layer then *is* an unquantized linear (its
method swapped for vLLM's ``UnquantizedLinearMethod``), so it runs the dense kernels
and the one-op decoder layer of a bf16 model. MoE experts are dequantized the same way into the
plugin's unquantized experts (:class:`AccelFp8MoEMethod`). Activations stay in the
model dtype, as in vLLM's CPU fp8 kernels (W8A16); a static ``input_scale`` is
loaded and not applied. Resident weights take the model dtype's bytes (bf16: 2 per
weight), not fp8's 1. Any float dtype serves, float32 included (vLLM's ``fp8``
method refuses it). compressed-tensors' ``float-quantized`` layers use the same two
methods with their own scale layout (:class:`Fp8Layout`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    UnquantizedLinearMethod,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config

from vllm_accel.logger import init_logger
from vllm_accel.ops.moe import AccelFusedMoEMethod, check_supported
from vllm_accel.quant.base import AccelQuantConfig, is_moe, layer_error, load_summary

logger = init_logger(__name__)

QUANT_NAME = "gcu_fp8"
#: rows dequantized at a time (bounds the float32 temporary of a large layer)
_ROWS_PER_STEP = 1024


def vllm_amx_kernels_run() -> bool:
    """Whether vLLM's own CPU kernels for fp8 weights and MXFP4 experts can run here:
    the simulator (vLLM's CPU platform enum) on an x86 CPU with AMX tiles and vLLM's
    ``fp8_scaled_mm_cpu`` op built."""
    from vllm import _custom_ops as ops
    from vllm.platforms import current_platform

    return (current_platform.is_cpu() and torch.cpu._is_amx_tile_supported()
            and bool(getattr(ops, "_supports_cpu_fp8_w8a16", False)))


def dequantize_fp8(weight: torch.Tensor, row_scales: torch.Tensor, group: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn ``[out, in]`` times ``row_scales[o, i // group]`` (float32
    ``[out, ceil(in/group)]``), computed in float32, then rounded to ``dtype``."""
    out_rows, cols = weight.shape
    dense = torch.empty(out_rows, cols, dtype=dtype)
    col_scale_idx = torch.arange(cols) // group
    for r0 in range(0, out_rows, _ROWS_PER_STEP):
        rows = slice(r0, r0 + _ROWS_PER_STEP)
        scales = row_scales[rows].to(torch.float32).index_select(1, col_scale_idx)
        dense[rows] = weight[rows].to(torch.float32).mul_(scales)
    return dense


def block_row_scales(scale_inv: torch.Tensor, out_rows: int, block_n: int) -> torch.Tensor:
    """Block scales ``[ceil(out/bn), G]`` -> one row of scales per output ``[out, G]``."""
    return scale_inv.repeat_interleave(block_n, dim=0)[:out_rows]


def tensor_row_scales(weight_scale: torch.Tensor, widths: list[int]) -> torch.Tensor:
    """Per-tensor scales, one per merged checkpoint tensor of ``widths`` rows ->
    ``[out, 1]``."""
    return torch.cat([weight_scale.reshape(-1)[i].expand(w)
                      for i, w in enumerate(widths)]).unsqueeze(1)


class _Fp8Stats:
    """Layers dequantized in this process and their bytes, logged once loaded."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.layers, self.moe_layers, self.fp8_bytes, self.dense_bytes = 0, 0, 0, 0
        self.dtype = None

    def account(self, fp8: torch.Tensor, dense: torch.Tensor) -> None:
        self.layers += 1
        self._bytes(fp8, dense)

    def account_moe(self, projections: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.moe_layers += 1
        for fp8, dense in projections:
            self._bytes(fp8, dense)

    def _bytes(self, fp8: torch.Tensor, dense: torch.Tensor) -> None:
        self.fp8_bytes += fp8.numel()
        self.dense_bytes += dense.numel() * dense.element_size()
        self.dtype = dense.dtype

    def log_summary(self) -> None:
        if self.layers or self.moe_layers:
            logger.info("%s: %d fp8 linears and the experts of %d MoE layers dequantized "
                        "at load to %s (%.1f MiB of fp8 weights -> %.1f MiB resident)",
                        QUANT_NAME, self.layers, self.moe_layers,
                        str(self.dtype).split(".")[-1], self.fp8_bytes / 2**20,
                        self.dense_bytes / 2**20)
        self.reset()


STATS = _Fp8Stats()
load_summary(STATS.log_summary)


@register_quantization_config(QUANT_NAME)
class AccelFp8Config(AccelQuantConfig):
    """Serialized FP8 checkpoints, dequantized at load (module doc).

    Claims ``quant_method: fp8`` checkpoints (auto-detected, or ``--quantization fp8``
    / ``gcu_fp8``), except ``--quantization fp8`` where vLLM's AMX kernels run.
    """

    quant_name = QUANT_NAME
    checkpoint_method = "fp8"

    def __init__(self, activation_scheme: str = "dynamic",
                 ignored_layers: list[str] | None = None,
                 weight_block_size: list[int] | None = None,
                 store_dtype: str | None = None, fmt: str | None = None) -> None:
        super().__init__()
        self.activation_scheme = activation_scheme
        self.ignored_layers = list(ignored_layers or [])
        self.weight_block_size = list(weight_block_size) if weight_block_size else None
        self.store_dtype = store_dtype
        self.fmt = fmt
        #: modules with an fp8 weight in the checkpoint (from its metadata; None:
        #: unknown, every Linear counts as fp8)
        self.quantized_modules: list[str] | None = None

    def __repr__(self) -> str:
        return (f"AccelFp8Config(activation_scheme={self.activation_scheme!r}, "
                f"weight_block_size={self.weight_block_size}, "
                f"ignored_layers={self.ignored_layers})")

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant,
                                     hf_config=None) -> str | None:
        """An explicit ``--quantization fp8`` where vLLM's AMX kernels run asks for
        vLLM's own method (fp8 weights kept in fp8); any other fp8 request is ours."""
        claimed = super().override_quantization_method(hf_quant_cfg, user_quant, hf_config)
        if claimed is not None and user_quant == "fp8" and vllm_amx_kernels_run():
            return None
        return claimed

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AccelFp8Config:
        ignored = cls.get_from_keys_or(config, ["ignored_layers"], None)
        if not ignored:
            ignored = cls.get_from_keys_or(config, ["modules_to_not_convert"], None)
        return cls(
            activation_scheme=str(cls.get_from_keys_or(config, ["activation_scheme"],
                                                       "dynamic")),
            ignored_layers=ignored,
            weight_block_size=cls.get_from_keys_or(config, ["weight_block_size"], None),
            store_dtype=cls.get_from_keys_or(config, ["store_dtype"], None),
            fmt=cls.get_from_keys_or(config, ["fmt"], None))

    def validate(self, prefix: str) -> None:
        """Reject what the format or this method cannot serve, naming the layer."""
        if self.fmt not in (None, "e4m3"):
            raise self.fail(prefix, f"fp8 format {self.fmt!r} is not supported (e4m3 is)",
                            "use an e4m3 (float8_e4m3fn) export or the bf16 checkpoint")
        if self.store_dtype is not None:
            raise self.fail(prefix, f"store_dtype {self.store_dtype!r} is not supported",
                            "use a plain fp8 export or the bf16 checkpoint")
        if self.activation_scheme not in ("dynamic", "static"):
            raise self.fail(prefix, f"activation scheme {self.activation_scheme!r} is "
                            "unknown", "use a checkpoint with 'dynamic' or 'static'")
        block = self.weight_block_size
        if block is not None and (len(block) != 2 or min(block) <= 0):
            raise self.fail(prefix, f"weight_block_size {block} is not two positive sizes",
                            "use a checkpoint with weight_block_size [bn, bk], e.g. "
                            "[128, 128]")

    def apply_vllm_mapper(self, hf_to_vllm_mapper) -> None:
        if self.ignored_layers:
            self.ignored_layers = hf_to_vllm_mapper.apply_list(self.ignored_layers)
        if self.quantized_modules:
            self.quantized_modules = hf_to_vllm_mapper.apply_list(self.quantized_modules)

    def maybe_update_config(self, model_name: str, hf_config=None, revision=None) -> None:
        """Learn which modules hold fp8 weights, so that layers the export left in
        float (MoE routers, ...) load unquantized even when the config does not
        list them."""
        modules = self.modules_in_checkpoint(
            model_name, revision,
            lambda name, info: name.endswith(".weight") and info.get("dtype") == "F8_E4M3")
        if modules is not None:
            self.quantized_modules = modules

    def _in_float(self, prefix: str) -> bool:
        """Left in full precision: listed in ``ignored_layers``, or (where the
        checkpoint's metadata was read) without an fp8 weight."""
        from vllm.model_executor.layers.quantization.utils.gptq_utils import (
            is_layer_gptq_quantized,
        )
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            is_layer_skipped,
        )

        if is_layer_skipped(prefix, self.ignored_layers, self.packed_modules_mapping,
                            match_mode="exact"):
            return True
        return self.quantized_modules is not None and not is_layer_gptq_quantized(
            prefix, self.quantized_modules, self.packed_modules_mapping)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        from vllm.model_executor.layers.fused_moe import UnquantizedFusedMoEMethod
        from vllm.model_executor.layers.quantization.utils.quant_utils import (
            is_layer_skipped,
        )

        if is_moe(layer):
            # expert 0's gate projection stands for the layer's experts
            if self._in_float(f"{prefix}.0.{layer.ckpt_gate_proj_name}") or is_layer_skipped(
                    prefix, self.ignored_layers, self.packed_modules_mapping,
                    match_mode="exact"):
                return UnquantizedFusedMoEMethod(layer.moe_config)  # ours (register_oot)
            self.validate(prefix)
            return AccelFp8MoEMethod(layer.moe_config, self.layout(), prefix)
        if not isinstance(layer, LinearBase):
            return None  # embeddings, norms, the attention's KV scales: not fp8 here
        if self._in_float(prefix):
            return UnquantizedLinearMethod()
        self.validate(prefix)
        return AccelFp8LinearMethod(self.layout(), prefix)

    def layout(self) -> Fp8Layout:
        block = self.weight_block_size
        static = self.activation_scheme == "static"
        if block is not None:
            return Fp8Layout("block", "weight_scale_inv", tuple(block), static_input=static)
        return Fp8Layout("tensor", "weight_scale", static_input=static)


@dataclass(frozen=True)
class Fp8Layout:
    """How a checkpoint stores one layer's fp8 weight: its scale ``strategy``
    (``block`` of ``block`` = (bn, bk), ``tensor``: one per checkpoint tensor,
    ``channel``: one per output row), the scale's tensor name, and whether a static
    ``input_scale`` comes with it."""

    strategy: str
    scale_name: str
    block: tuple[int, int] | None = None
    static_input: bool = False
    quant_name: str = QUANT_NAME


def row_scales(layout: Fp8Layout, scale: torch.Tensor, rows: int, cols: int,
               widths: list[int]) -> tuple[torch.Tensor, int]:
    """One matrix's loaded scales -> (``[rows, G]`` scales, group along the input)."""
    if layout.strategy == "block":
        return block_row_scales(scale, rows, layout.block[0]), layout.block[1]
    if layout.strategy == "tensor":
        return tensor_row_scales(scale, widths), cols
    return scale.reshape(rows, 1), cols


@register_weight_loader_v2_supported_method
class AccelFp8LinearMethod(LinearMethodBase):
    """Loads a Linear's fp8 weight and scales with vLLM's parameters; after loading,
    the layer holds the dense weight and vLLM's unquantized method (module doc)."""

    def __init__(self, layout: Fp8Layout, prefix: str) -> None:
        self.layout, self.prefix = layout, prefix

    def fail(self, problem: str, fix: str) -> ValueError:
        return layer_error(self.layout.quant_name, self.prefix, problem, fix)

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        from vllm.model_executor.layers.quantization.utils.fp8_utils import (
            create_fp8_input_scale,
            create_fp8_scale_parameter,
            create_fp8_weight_parameter,
            validate_fp8_block_shape,
        )
        from vllm.model_executor.parameter import (
            BlockQuantScaleParameter,
            ChannelQuantScaleParameter,
            PerTensorScaleParameter,
        )
        from vllm.model_executor.utils import set_weight_attrs

        loader = extra_weight_attrs.get("weight_loader")
        layer.logical_widths = list(output_partition_sizes)
        layer.orig_dtype = params_dtype
        block = list(self.layout.block) if self.layout.block else None
        layer.weight_block_size = block  # vLLM's loaders shard block scales by it
        if block is not None:
            try:
                validate_fp8_block_shape(layer, input_size, output_size,
                                         input_size_per_partition, output_partition_sizes,
                                         block)
            except ValueError as e:
                raise self.fail(str(e).rstrip("."), "use a tensor-parallel size whose "
                                "shards hold whole blocks") from e
            # vLLM's loaders place a merged tensor's scale rows at ceil(offset / bn)
            if any(w % block[0] for w in output_partition_sizes[:-1]):
                raise self.fail(f"merged projections of {output_partition_sizes} rows do "
                                f"not start on {block[0]}-row scale blocks",
                                "use a checkpoint whose projections are multiples of the "
                                "block size")
        layer.register_parameter("weight", create_fp8_weight_parameter(
            sum(output_partition_sizes), input_size_per_partition, loader))
        kind = {"block": BlockQuantScaleParameter, "tensor": PerTensorScaleParameter,
                "channel": ChannelQuantScaleParameter}[self.layout.strategy]
        layer.register_parameter(self.layout.scale_name, create_fp8_scale_parameter(
            kind, output_partition_sizes, input_size_per_partition, block, loader))
        if self.layout.static_input:
            scale = create_fp8_input_scale(output_partition_sizes, loader)
            set_weight_attrs(scale, {"scale_type": "input_scale"})
            layer.register_parameter("input_scale", scale)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight.data
        rows, cols = weight.shape
        scales, group = row_scales(self.layout, getattr(layer, self.layout.scale_name).data
                                   .cpu(), rows, cols, layer.logical_widths)
        dense = dequantize_fp8(weight.cpu(), scales, group, layer.orig_dtype)
        STATS.account(weight, dense)
        for name in ("weight", self.layout.scale_name, "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.weight = torch.nn.Parameter(dense.to(weight.device), requires_grad=False)
        layer.quant_method = UnquantizedLinearMethod()
        layer.quant_method.process_weights_after_loading(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        raise RuntimeError(f"{self.layout.quant_name}: layer {self.prefix!r} ran before its "
                           "weights were processed")


class AccelFp8MoEMethod(AccelFusedMoEMethod):
    """FP8 experts: vLLM's stacked expert parameters in fp8 with their scales (block:
    ``w13_<scale>`` ``[E, 2 ceil(I/bn), ceil(H/bk)]`` / ``w2_<scale>`` ``[E, ceil(H/bn),
    ceil(I/bk)]``; tensor: ``[E, 2]`` / ``[E]``; channel: ``[E, 2I, 1]`` / ``[E, H, 1]``),
    dequantized at load into the model-dtype experts of the plugin's unquantized MoE
    method, which then serves the layer."""

    def __init__(self, moe, layout: Fp8Layout, prefix: str) -> None:
        super().__init__(moe)
        self.layout, self.prefix = layout, prefix

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported
        from vllm.model_executor.utils import set_weight_attrs

        check_supported(layer)
        block = self.layout.block
        inter, hidden = intermediate_size_per_partition, hidden_size
        if block is not None and inter % block[0]:
            raise layer_error(self.layout.quant_name, self.prefix,
                              f"the experts' intermediate size {inter} (per rank) is not a "
                              f"multiple of the {block[0]}-row scale blocks",
                              "use a tensor-parallel size whose shards hold whole blocks")
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                               params_dtype, **extra_weight_attrs)
        layer.orig_dtype = params_dtype
        for name in ("w13_weight", "w2_weight"):
            param = getattr(layer, name)
            param.data = torch.empty(param.shape, dtype=torch.float8_e4m3fn)
        name, e = self.layout.scale_name, num_experts
        if block is not None:
            bn, bk = block
            shapes = {f"w13_{name}": (e, 2 * -(-inter // bn), -(-hidden // bk)),
                      f"w2_{name}": (e, -(-hidden // bn), -(-inter // bk))}
        elif self.layout.strategy == "tensor":
            shapes = {f"w13_{name}": (e, 2), f"w2_{name}": (e,)}
        else:
            shapes = {f"w13_{name}": (e, 2 * inter, 1), f"w2_{name}": (e, hidden, 1)}
        if self.layout.static_input:
            shapes.update(w13_input_scale=(e,), w2_input_scale=(e,))
        kind = getattr(FusedMoeWeightScaleSupported, self.layout.strategy.upper()).value
        for param_name, shape in shapes.items():
            param = torch.nn.Parameter(torch.ones(shape, dtype=torch.float32),
                                       requires_grad=False)
            layer.register_parameter(param_name, param)
            set_weight_attrs(param, {**extra_weight_attrs, "quant_method": kind})
        layer.w13_widths = [inter, inter]

    def process_weights_after_loading(self, layer) -> None:
        done = []
        for proj in ("w13", "w2"):
            weight = getattr(layer, f"{proj}_weight")
            codes = weight.data.cpu()
            rows, cols = codes.shape[1:]
            scales = getattr(layer, f"{proj}_{self.layout.scale_name}").data.cpu()
            widths = layer.w13_widths if proj == "w13" else [rows]
            dense = torch.empty(codes.shape, dtype=layer.orig_dtype)
            for e in range(codes.shape[0]):
                expert_scales, group = row_scales(self.layout, scales[e], rows, cols, widths)
                dense[e] = dequantize_fp8(codes[e], expert_scales, group, layer.orig_dtype)
            done.append((codes, dense))
            weight.data = dense.to(weight.device)
            for name in (f"{proj}_{self.layout.scale_name}", f"{proj}_input_scale"):
                if hasattr(layer, name):
                    delattr(layer, name)
        STATS.account_moe(done)
        super().process_weights_after_loading(layer)
