"""What every vllm_accel quantization config shares."""

from collections.abc import Callable

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from vllm_accel.logger import init_logger

logger = init_logger(__name__)

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

    from vllm_accel.quant import stats

    for fn in _load_summaries:
        fn()
    stats.reset_all()  # (a second model of this process counts its own layers)
    repack_cache.log_summary_once()


class AccelQuantConfig(QuantizationConfig):
    """Base of the plugin's quant configs: any float activation dtype, and no
    compute-capability gate (that is a CUDA notion; our devices accept every
    method whose kernels are registered). Subclasses set ``quant_name``."""

    quant_name: str
    #: the checkpoint ``quant_method`` this config claims (None: online methods)
    checkpoint_method: str | None = None
    #: other ``--quantization`` values under which it claims such a checkpoint
    #: (besides none, the checkpoint's method and ``quant_name``)
    claimed_aliases: tuple[str, ...] = ()

    @classmethod
    def get_name(cls) -> str:
        return cls.quant_name

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant,
                                     hf_config=None) -> str | None:
        """Serve every checkpoint of ``checkpoint_method`` unless the user asked
        for another method by name (e.g. vLLM's own ``awq_marlin``)."""
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if cls.checkpoint_method is None or method != cls.checkpoint_method:
            return None
        claimed = (None, cls.checkpoint_method, cls.quant_name, *cls.claimed_aliases)
        return cls.quant_name if user_quant in claimed else None

    @classmethod
    def fail(cls, prefix: str, problem: str, fix: str) -> ValueError:
        """The startup error for a layer this method cannot serve."""
        return layer_error(cls.quant_name, prefix, problem, fix)

    def modules_in_checkpoint(self, model_name: str, revision,
                              holds: Callable[[str, dict], bool]) -> list[str] | None:
        """The modules owning a checkpoint tensor for which ``holds(name,
        safetensors info)``; None when the checkpoint has no safetensors metadata
        (then every Linear counts as quantized)."""
        try:
            from vllm.transformers_utils.config import get_safetensors_params_metadata

            metadata = get_safetensors_params_metadata(model_name, revision=revision)
        except Exception as e:
            logger.debug("%s: no safetensors metadata for %s (%s)", self.quant_name,
                         model_name, e)
            return None
        return sorted({name.rsplit(".", 1)[0] for name, info in metadata.items()
                       if holds(name, info)})

    def is_quantizable_linear(self, layer: torch.nn.Module, prefix: str, *, what: str,
                              lm_head_quantized: bool,
                              moe_fix: str = "",
                              lm_head_fix: str) -> bool:
        """True for a Linear layer this method may serve; False for layers vLLM
        keeps in full precision (embeddings, norms, an unquantized lm_head).
        A quantized lm_head is refused, naming the layer; a MoE layer reaching here
        (a method without quantized experts) is refused with ``moe_fix``."""
        from vllm.model_executor.layers.linear import LinearBase
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

        if is_moe(layer):
            raise self.fail(prefix, f"{what} MoE experts are not supported yet", moe_fix)
        if isinstance(layer, ParallelLMHead):
            if lm_head_quantized:
                article = "an" if what[:1].upper() in "AEIOU" else "a"
                raise self.fail(prefix, f"{article} {what} lm_head is not supported",
                                lm_head_fix)
            return False
        return isinstance(layer, LinearBase)

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
    """Fused MoE experts (vLLM's ``RoutedExperts``), which a quantization config
    serves with a MoE method rather than a linear one."""
    return any(c.__name__ in ("FusedMoE", "RoutedExperts") for c in type(layer).__mro__)
