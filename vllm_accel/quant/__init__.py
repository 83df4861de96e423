"""Quantization methods of vllm_accel.

Importing this package registers the quantization configs with vLLM (the
``vllm.general_plugins`` entry point imports it in every vLLM process):

* ``gcu_gptq`` (:mod:`vllm_accel.quant.gptq`): GPTQ checkpoints (AutoGPTQ /
  GPTQModel format), 4/8-bit, grouped or per-channel, sym/asym, act-order. Its
  ``override_quantization_method`` claims every ``quant_method: gptq``
  checkpoint, also when the user passes ``--quantization gptq``.

This package imports ``vllm.model_executor``; never import it from the platform
module (circular import while vLLM resolves ``current_platform``).
"""

from vllm_accel.quant import gptq  # noqa: F401  (registers gcu_gptq at import)
from vllm_accel.quant.gptq import AccelGPTQConfig, AccelGPTQLinearMethod

__all__ = ["AccelGPTQConfig", "AccelGPTQLinearMethod"]
