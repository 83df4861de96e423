"""Quantization methods of vllm_accel.

Importing this package registers the quantization configs with vLLM (the
``vllm.general_plugins`` entry point imports it in every vLLM process):

* ``gcu_gptq`` (:mod:`vllm_accel.quant.gptq`): GPTQ checkpoints (AutoGPTQ /
  GPTQModel format), 4/8-bit, grouped or per-channel, sym/asym, act-order. Its
  ``override_quantization_method`` claims every ``quant_method: gptq``
  checkpoint, also when the user passes ``--quantization gptq``.
* ``gcu_awq`` (:mod:`vllm_accel.quant.awq`): AutoAWQ GEMM checkpoints (4-bit,
  zero point); claims ``quant_method: awq`` (also ``--quantization awq``).
* ``gcu_compressed_tensors`` (:mod:`vllm_accel.quant.compressed_tensors`):
  llmcompressor checkpoints; claims ``quant_method: compressed-tensors``.
  ``pack-quantized`` W4A16/W8A16 run here, ``int-quantized`` W8A8 layers are
  handed to :mod:`vllm_accel.quant.w8a8`.
* ``w8a16`` (:mod:`vllm_accel.quant.w8a16`): online per-channel int8 weights
  made at load from a float checkpoint (``--quantization w8a16``).
* ``gcu_fp8`` (:mod:`vllm_accel.quant.fp8`): serialized FP8 checkpoints (block or
  per-tensor scales), dequantized at load to the model dtype where vLLM's AMX fp8
  kernels do not run; claims ``quant_method: fp8``.
* ``gcu_mxfp4`` (:mod:`vllm_accel.quant.mxfp4`): gpt-oss MXFP4 experts, dequantized at
  load where vLLM's AMX MXFP4 experts do not run.

Formats and schemes: each weight-only format above is a config plus a converter
from its checkpoint tensors to one resident layout (:mod:`vllm_accel.quant.packed`),
served by one linear method, the weight-only int scheme
(:mod:`vllm_accel.quant.wint_method`: repack cache, installation, resident bytes,
kernel). W8A8 is the other scheme (:mod:`vllm_accel.quant.w8a8`). The simulator's
fused int4/int8 GEMM provider is :mod:`vllm_accel.ops.torch_fast.wint_gemm`.

This package imports ``vllm.model_executor``; never import it from the platform
module (circular import while vLLM resolves ``current_platform``).
"""

from vllm_accel.ops.torch_fast import wint_gemm  # noqa: F401  (registers torch_fast's GEMM)
from vllm_accel.ops.cpu_native import wint_gemv  # noqa: F401  (registers cpu_native's GEMM)
from vllm_accel.quant import gptq  # noqa: F401  (registers gcu_gptq at import)
from vllm_accel.quant.gptq import AccelGPTQConfig, AccelGPTQLinearMethod
from vllm_accel.quant import awq  # noqa: F401,E402  (registers gcu_awq at import)
from vllm_accel.quant import compressed_tensors  # noqa: F401,E402  (gcu_compressed_tensors)
from vllm_accel.quant.awq import AccelAWQConfig, AccelAWQLinearMethod  # noqa: E402
from vllm_accel.quant.compressed_tensors import (  # noqa: E402
    AccelCompressedTensorsConfig,
    AccelCTWNA16LinearMethod,
)
from vllm_accel.quant import w8a16  # noqa: F401,E402  (registers w8a16 at import)
from vllm_accel.quant.w8a8 import AccelW8A8LinearMethod  # noqa: E402
from vllm_accel.ops.cpu_native import int8_linear  # noqa: F401,E402  (cpu_native's W8A8 GEMM)
from vllm_accel.quant.w8a16 import AccelW8A16Config, AccelW8A16LinearMethod  # noqa: E402
from vllm_accel.quant.fp8 import AccelFp8Config, AccelFp8LinearMethod  # noqa: E402
from vllm_accel.quant.mxfp4 import AccelMxfp4Config  # noqa: E402

__all__ = ["AccelGPTQConfig", "AccelGPTQLinearMethod", "AccelAWQConfig",
           "AccelAWQLinearMethod", "AccelCompressedTensorsConfig", "AccelCTWNA16LinearMethod",
           "AccelW8A8LinearMethod", "AccelW8A16Config", "AccelW8A16LinearMethod",
           "AccelFp8Config", "AccelFp8LinearMethod", "AccelMxfp4Config"]
