"""gpt-oss MXFP4 checkpoints (``quant_method: mxfp4``): the ``gcu_mxfp4`` config.

OpenAI's gpt-oss checkpoints store only the MoE experts in MXFP4 (attention, router,
embeddings and LM head in bf16). Per layer, as vLLM's gpt-oss loader hands them over:

* ``w13_weight`` uint8 ``[E, 2I, H/2]``: e2m1 codes, two a byte (low nibble first),
  gate and up rows interleaved; ``w2_weight`` uint8 ``[E, H, I/2]``;
* ``w13_weight_scale`` / ``w2_weight_scale`` uint8 ``[E, rows, cols/32]``: e8m0
  exponents (``2 ** (s - 127)``) per 32 weights along the input;
* ``w13_bias`` / ``w2_bias`` in the model dtype.

vLLM 0.32's CPU experts for MXFP4 need AMX tiles, and a card has none of ours; so
this config claims gpt-oss MXFP4 checkpoints (only an explicit ``--quantization
mxfp4`` on the simulator with AMX leaves them to vLLM's experts) and dequantizes the
experts once at load (e2m1 value times
its power of two, exact in bf16 and float32) into the plugin's unquantized experts,
which run gpt-oss's swigluoai. Resident experts take the model dtype's bytes (bf16:
2 per weight, four times MXFP4's).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization import register_quantization_config

from vllm_accel.logger import init_logger
from vllm_accel.ops.moe import AccelFusedMoEMethod
from vllm_accel.quant.base import AccelQuantConfig, is_moe, layer_error, load_summary
from vllm_accel.quant.fp8 import vllm_amx_kernels_run

logger = init_logger(__name__)

QUANT_NAME = "gcu_mxfp4"
#: the checkpoint's quant_method, before and after vLLM's gpt-oss config renames it
CHECKPOINT_METHODS = ("mxfp4", "gpt_oss_mxfp4")
#: e2m1 codes 0-15
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
    """uint8 ``[..., R, C/2]`` (two e2m1 codes a byte, low nibble first) with uint8
    e8m0 ``scales`` ``[..., R, C/32]`` -> ``[..., R, C]`` in ``dtype``."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., R, C]
    exponents = scales.to(torch.int32) - 127
    values = torch.ldexp(values.unflatten(-1, (-1, BLOCK)), exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


class _Mxfp4Stats:
    """MoE layers dequantized in this process, logged once loaded."""

    def __init__(self) -> None:
        self.layers, self.mxfp4_bytes, self.dense_bytes, self.dtype = 0, 0, 0, None

    def account(self, packed: list[torch.Tensor], dense: list[torch.Tensor]) -> None:
        self.layers += 1
        self.mxfp4_bytes += sum(t.numel() for t in packed)
        self.dense_bytes += sum(t.numel() * t.element_size() for t in dense)
        self.dtype = dense[0].dtype

    def log_summary(self) -> None:
        if self.layers:
            logger.info("%s: the experts of %d MoE layers dequantized at load to %s "
                        "(%.1f MiB of MXFP4 weights and scales -> %.1f MiB resident)",
                        QUANT_NAME, self.layers, str(self.dtype).split(".")[-1],
                        self.mxfp4_bytes / 2**20, self.dense_bytes / 2**20)
        self.__init__()


STATS = _Mxfp4Stats()
load_summary(STATS.log_summary)


@register_quantization_config(QUANT_NAME)
class AccelMxfp4Config(AccelQuantConfig):
    """gpt-oss MXFP4 experts, dequantized at load (module doc)."""

    quant_name = QUANT_NAME

    def __repr__(self) -> str:
        return "AccelMxfp4Config(gpt-oss MXFP4 experts, dequantized at load)"

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict) -> AccelMxfp4Config:
        return cls()

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant,
                                     hf_config=None) -> str | None:
        """gpt-oss MXFP4 checkpoints, unless the user named another method, or named
        vLLM's (``mxfp4``) where its AMX experts run (they keep the experts in MXFP4)."""
        if (str(hf_quant_cfg.get("quant_method", "")).lower() not in CHECKPOINT_METHODS
                or getattr(hf_config, "model_type", None) != "gpt_oss"
                or user_quant not in (None, *CHECKPOINT_METHODS, QUANT_NAME)):
            return None
        if user_quant in CHECKPOINT_METHODS and vllm_amx_kernels_run():
            return None
        return QUANT_NAME

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if is_moe(layer):
            return AccelMxfp4MoEMethod(layer.moe_config, prefix)
        if isinstance(layer, LinearBase):
            return UnquantizedLinearMethod()  # gpt-oss keeps its linears in bf16
        return None


class AccelMxfp4MoEMethod(AccelFusedMoEMethod):
    """vLLM's MXFP4 expert parameters, filled whole by vLLM's gpt-oss loader, then
    dequantized into the plugin's unquantized experts (module doc)."""

    def __init__(self, moe, prefix: str) -> None:
        super().__init__(moe)
        self.prefix = prefix
        # vLLM's gpt-oss expert loader reads this to load packed experts
        self.weight_dtype = "gpt_oss_mxfp4"

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.utils import set_weight_attrs

        inter, hidden = intermediate_size_per_partition, hidden_size
        if inter % BLOCK or hidden % BLOCK:
            raise layer_error(QUANT_NAME, self.prefix,
                              f"hidden size {hidden} and intermediate size {inter} (per "
                              f"rank) must be multiples of the {BLOCK}-weight MXFP4 blocks",
                              "use a tensor-parallel size whose shards hold whole blocks")
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition,
                               params_dtype, **extra_weight_attrs)
        layer.orig_dtype = params_dtype
        shapes = {"w13_weight": (num_experts, 2 * inter, hidden // 2),
                  "w2_weight": (num_experts, hidden, inter // 2),
                  "w13_weight_scale": (num_experts, 2 * inter, hidden // BLOCK),
                  "w2_weight_scale": (num_experts, hidden, inter // BLOCK)}
        for name, shape in shapes.items():
            param = torch.nn.Parameter(torch.zeros(shape, dtype=torch.uint8),
                                       requires_grad=False)
            layer.register_parameter(name, param)
            set_weight_attrs(param, {**extra_weight_attrs, "weight_loader": _load_whole})
        for name in ("w13_bias", "w2_bias"):
            if hasattr(layer, name):
                getattr(layer, name).weight_loader = _load_whole  # replaces the layer's

    def process_weights_after_loading(self, layer) -> None:
        packed, dense = [], []
        for proj in ("w13", "w2"):
            codes = getattr(layer, f"{proj}_weight").data
            scales = getattr(layer, f"{proj}_weight_scale").data
            weight = dequantize_mxfp4(codes.cpu(), scales.cpu(), layer.orig_dtype)
            packed += [codes, scales]
            dense.append(weight)
            delattr(layer, f"{proj}_weight_scale")
            delattr(layer, f"{proj}_weight")
            layer.register_parameter(f"{proj}_weight", torch.nn.Parameter(
                weight.to(codes.device), requires_grad=False))
        STATS.account(packed, dense)
        super().process_weights_after_loading(layer)


def _load_whole(param: torch.nn.Parameter, loaded_weight: torch.Tensor, weight_name: str = "",
                shard_id=None, expert_id=None, return_success: bool = False):
    """vLLM's gpt-oss MXFP4 loader hands each tensor over for all local experts at
    once (this rank's slice): it fills the parameter's leading part."""
    param.data[tuple(slice(0, n) for n in loaded_weight.shape)].copy_(loaded_weight)
    return True if return_success else None
