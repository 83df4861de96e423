"""What every vllm_accel quantization config shares.

This module imports ``vllm.model_executor``; import it only from the general
plugin (never from the platform module).
"""

from collections.abc import Callable

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

#: per-method summaries (layers, kernels, resident bytes), logged once the model is
#: loaded: never from ``apply``, which runs inside torch.compile's graph
_load_summaries: list[Callable[[], None]] = []


def load_summary(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` to log a quant method's summary after the model loaded."""
    _load_summaries.append(fn)
    return fn


def log_load_summaries() -> None:
    """Called by the model runners after ``load_model`` (outside any graph)."""
    from vllm_accel.quant import repack_cache

    for fn in _load_summaries:
        fn()
    repack_cache.log_summary_once()


class AccelQuantConfig(QuantizationConfig):
    """Base of the plugin's quant configs: any float activation dtype, and no
    compute-capability gate (that is a CUDA notion; our devices accept every
    method whose kernels are registered). Subclasses set ``quant_name``."""

    quant_name: str

    @classmethod
    def get_name(cls) -> str:
        return cls.quant_name

    @classmethod
    def get_supported_act_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return -1


def layer_error(quant_name: str, prefix: str, problem: str, fix: str) -> ValueError:
    """The startup error for a layer a method cannot serve: what and the fix."""
    return ValueError(f"{quant_name} cannot serve layer {prefix!r}: {problem}. Fix: {fix}")


def is_moe(layer: torch.nn.Module) -> bool:
    """Fused MoE experts (no quantized MoE support yet in any of our methods)."""
    return any(c.__name__ in ("FusedMoE", "RoutedExperts") for c in type(layer).__mro__)
