"""Online W8A16: ``--quantization w8a16`` on a float (bf16/fp16/fp32) checkpoint.

Every decoder Linear is loaded in its float dtype through vLLM's loaders, then
``process_weights_after_loading`` quantizes it per output channel, symmetric:
``scale[o] = max_i |W[o, i]| / 127`` (computed in fp32, rounded up to the
model dtype for bf16/fp16 models), ``code[o, i] = round(W[o, i] / scale[o])`` in
``[-127, 127]``, and drops the float weight (peak memory during loading still
holds the float model, as for an unquantized load). lm_head and the
embeddings are not Linear layers of this method and stay in full precision.

The codes and scales become the weight-only methods' shared resident layout
(:mod:`vllm_accel.quant.packed`: 8-bit, one group per row, symmetric), so online
W8A16 runs the same GEMMs as an 8-bit GPTQ or compressed-tensors checkpoint: on
the simulator torch's fused ``_weight_int8pack_mm`` (``torch_fast``, bf16/fp16/
fp32 activations; ``in % 16 == 0``), else the exact tile-dequantizing
``wint_linear``. Scales are rounded *up* to the model dtype for bf16/fp16 models
before the codes are computed, so ``codes * scales`` is exactly the weight every
kernel uses (the fused kernel takes its scales in the activation dtype) and no
code clips.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.linear import (
    LinearBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.parameter import ModelWeightParameter

from vllm_accel.quant.base import AccelQuantConfig, is_moe
from vllm_accel.quant.packed import WIntResident, resident_from_signed
from vllm_accel.quant.wint_method import WIntLinearMethod

QUANT_NAME = "w8a16"


def _round_up_to(s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 ``s`` rounded up to the nearest ``dtype`` value (returned in fp32)."""
    r = s.to(dtype).to(torch.float32)
    up = torch.nextafter(s.to(dtype), torch.tensor(float("inf"), dtype=dtype)).to(torch.float32)
    return torch.where(r < s, up, r)


def quantize_per_channel(w: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8 of a float ``[out, in]`` weight:
    ``(codes int8 [out, in] in [-127, 127], scales [out] in scale_dtype)``.
    The scale is rounded up to ``scale_dtype`` before the codes are computed.
    All-zero rows get scale 1."""
    wf = w.to(torch.float32)
    scales = wf.abs().amax(dim=1) / 127.0
    scales = torch.where(scales == 0, torch.ones_like(scales), scales)
    if scale_dtype != torch.float32:
        scales = _round_up_to(scales, scale_dtype)
    codes = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scales.to(scale_dtype)


@register_quantization_config(QUANT_NAME)
class AccelW8A16Config(AccelQuantConfig):
    """Online per-channel int8 weights, float activations (``--quantization w8a16``).

    Needs no checkpoint config: vLLM builds it with no arguments when the
    checkpoint has no ``quantization_config``. A checkpoint that is already
    quantized keeps its own method (vLLM rejects the mismatch at startup).
    """

    quant_name = QUANT_NAME

    def __init__(self) -> None:
        super().__init__()

    def __repr__(self) -> str:
        return "AccelW8A16Config(per-channel symmetric int8 weights, online)"

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AccelW8A16Config":
        return cls()

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        if is_moe(layer):
            raise self.fail(prefix, "online W8A16 of MoE experts is not supported",
                            "serve the model without --quantization w8a16, or a dense model")
        if isinstance(layer, LinearBase):
            return AccelW8A16LinearMethod(prefix)
        return None  # embeddings, lm_head, norms: full precision


@register_weight_loader_v2_supported_method
class AccelW8A16LinearMethod(WIntLinearMethod, quant_name=QUANT_NAME):
    """Loads the float weight like an unquantized Linear, then keeps only its
    per-channel int8 codes and scales as an 8-bit wint weight (module doc)."""

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                             dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader"))
        layer.register_parameter("weight", weight)

    def checkpoint_tensors(self) -> list[str]:
        return ["weight"]

    def to_resident(self, sources: dict[str, torch.Tensor]) -> WIntResident:
        w = sources["weight"]
        if not w.is_floating_point():
            raise self.fail(f"the loaded weight has dtype {w.dtype}, not a float",
                            "use --quantization w8a16 only on an unquantized checkpoint")
        # bf16/fp16 models: scales exact in that dtype (the fused kernel's scale dtype)
        scale_dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32
        codes, scales = quantize_per_channel(w, scale_dtype)
        self.made_from = (f"per-channel int8 of a {str(w.dtype).split('.')[-1]} weight, "
                          f"{str(scales.dtype).split('.')[-1]} scales")
        return resident_from_signed(codes, scales, bits=8)

    def describe(self, res: WIntResident) -> str:
        return self.made_from
