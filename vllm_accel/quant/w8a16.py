"""Online W8A16: ``--quantization w8a16`` on a float (bf16/fp16/fp32) checkpoint.

Every decoder Linear is loaded in its float dtype through vLLM's loaders, then
``process_weights_after_loading`` quantizes it per output channel, symmetric:
``scale[o] = max_i |W[o, i]| / 127`` (computed in fp32, rounded up to the
model dtype for bf16/fp16 models), ``code[o, i] = round(W[o, i] / scale[o])`` in
``[-127, 127]``, and drops the float weight (peak memory during loading still
holds the float model, as for an unquantized load). lm_head and the
embeddings are not Linear layers of this method and stay in full precision.

Resident layout (int8, 1 byte/weight + 2 or 4 bytes/row):

* ``gcu_qweight`` int8 ``[out, in]``, output-major (the rows a GEMM tile reads);
* ``gcu_scales`` ``[out]`` in the model dtype when the model is bf16/fp16 (the
  fp32 ``absmax / 127`` rounded *up* to that dtype, then the codes computed
  with the rounded scale, so ``codes * scales`` is exactly the weight every
  kernel uses and no code clips), else fp32.

Kernel ``w8a16_linear`` (registry, provider ``reference``):

* bf16 activations with bf16 scales and ``in % 16 == 0``: ``torch._weight_int8pack_mm``
  (PyTorch's CPU int8-weight GEMM: int8 codes read directly, fp32
  accumulation, per-channel scale, bf16 output). Measured on this CPU it runs
  bs=1 decode at or below the bf16 dense GEMM's time. Its CPU kernel reads out
  of bounds (wrong results or a segfault) when ``in`` is not a multiple of 16,
  and is slow for fp32/fp16 inputs: those go to the tile path.
* otherwise: a per-channel scale factors out of the K-sum, ``x @ W.T = (x @
  codes.T) * scale``, so the codes are converted to fp32 one tile of output rows
  at a time (exact), multiplied in fp32, and scaled once per output; the
  result is rounded to ``x.dtype`` once.

This module imports ``vllm.model_executor``; import it only from the general
plugin (never from the platform module).
"""

from __future__ import annotations

from typing import Any

import torch

from vllm.model_executor.layers.linear import (
    LinearBase,
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.parameter import ModelWeightParameter

from vllm_accel.logger import init_logger
from vllm_accel.quant.base import AccelQuantConfig, is_moe, layer_error
from vllm_accel.ops.registry import get_kernel, register_kernel

logger = init_logger(__name__)

QUANT_NAME = "w8a16"
KERNEL_NAME = "w8a16_linear"
#: output rows converted per step (fp32 tile = TILE_N x in x 4 bytes)
TILE_N = 1024


def _fail(prefix: str, problem: str, fix: str) -> ValueError:
    return layer_error(QUANT_NAME, prefix, problem, fix)


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


def _int8pack_ok(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> bool:
    return (x.dtype == torch.bfloat16 and scales.dtype == torch.bfloat16
            and x.device.type == "cpu" and qweight.shape[1] % 16 == 0
            and hasattr(torch, "_weight_int8pack_mm"))


@register_kernel(KERNEL_NAME)
def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None, tile_n: int = TILE_N,
                 method: str = "auto") -> torch.Tensor:
    """``y = x @ (codes * scales[:, None]).T (+ bias)``; ``x`` ``[..., in]``
    (fp32/bf16/fp16), ``qweight`` int8 ``[out, in]``, ``scales`` ``[out]``.
    ``method``: ``auto``, ``int8pack`` (bf16 only, see module doc) or ``tile``."""
    n, k = qweight.shape
    x2 = x.reshape(-1, k)
    if method == "auto":
        method = "int8pack" if _int8pack_ok(x, qweight, scales) else "tile"
    if method == "int8pack":
        if not _int8pack_ok(x, qweight, scales):
            raise ValueError("w8a16_linear: int8pack needs bf16 activations and scales on "
                             f"CPU and in % 16 == 0 (got {x.dtype}, {scales.dtype}, in={k})")
        y = torch._weight_int8pack_mm(x2.contiguous(), qweight, scales)
        if bias is not None:
            y = (y.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)
        return y.reshape(*x.shape[:-1], n)
    x2 = x2.to(torch.float32)
    if n <= tile_n:
        y = x2 @ qweight.to(torch.float32).t()
    else:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32, device=x.device)
        for n0 in range(0, n, tile_n):
            n1 = min(n0 + tile_n, n)
            torch.matmul(x2, qweight[n0:n1].to(torch.float32).t(), out=y[:, n0:n1])
    y = y * scales.to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


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
            raise _fail(prefix, "online W8A16 of MoE experts is not supported",
                        "serve the model without --quantization w8a16, or a dense model")
        if isinstance(layer, LinearBase):
            return AccelW8A16LinearMethod(prefix)
        return None  # embeddings, lm_head, norms: full precision


# Resident bytes over all W8A16 layers of this process.
_totals = {"layers": 0, "resident": 0, "float": 0}
_logged_layer_types: set[str] = set()
_apply_logged = False


@register_weight_loader_v2_supported_method
class AccelW8A16LinearMethod(LinearMethodBase):
    """Loads the float weight like an unquantized Linear, then keeps only
    per-channel int8 codes and fp32 scales (see module doc)."""

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        weight = ModelWeightParameter(
            data=torch.empty(sum(output_partition_sizes), input_size_per_partition,
                             dtype=params_dtype),
            input_dim=1, output_dim=0, weight_loader=extra_weight_attrs.get("weight_loader"))
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        w = layer.weight.data
        if not w.is_floating_point():
            raise _fail(self.prefix, f"the loaded weight has dtype {w.dtype}, not a float",
                        "use --quantization w8a16 only on an unquantized checkpoint")
        # bf16/fp16 models: scales in that dtype (exact for the fast bf16 kernel)
        scale_dtype = w.dtype if w.dtype in (torch.bfloat16, torch.float16) else torch.float32
        codes, scales = quantize_per_channel(w, scale_dtype)
        float_bytes = w.numel() * w.element_size()
        del layer.weight  # the float copy goes now
        layer.register_parameter("gcu_qweight", torch.nn.Parameter(codes, requires_grad=False))
        layer.register_parameter("gcu_scales", torch.nn.Parameter(scales, requires_grad=False))
        resident = codes.numel() + scales.numel() * scales.element_size()
        _totals["layers"] += 1
        _totals["resident"] += resident
        _totals["float"] += float_bytes
        kind = self.prefix.rsplit(".", 1)[-1] or "linear"
        if kind not in _logged_layer_types:
            _logged_layer_types.add(kind)
            logger.info("w8a16 %s (e.g. %s): [%d x %d] %s -> resident %d B (int8 weight %d, "
                        "%s scales %d) = %.3f B/weight vs loaded weight %d B", kind,
                        self.prefix, codes.shape[0], codes.shape[1], str(w.dtype).split(".")[-1],
                        resident, codes.numel(), str(scales.dtype).split(".")[-1],
                        scales.numel() * scales.element_size(),
                        resident / codes.numel(), float_bytes)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        kernel = get_kernel(KERNEL_NAME)
        global _apply_logged
        if not _apply_logged:
            _apply_logged = True
            logger.info("AccelW8A16LinearMethod running: kernel %s = %s.%s on %d layers; "
                        "resident quantized weights %.2f MiB (loaded float weights %.2f MiB)",
                        KERNEL_NAME, kernel.__module__, kernel.__qualname__, _totals["layers"],
                        _totals["resident"] / 2**20, _totals["float"] / 2**20)
        return kernel(x, layer.gcu_qweight, layer.gcu_scales, bias=bias)
