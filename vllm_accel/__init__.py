"""vllm_accel: a vLLM 0.32 platform plugin for Enflame GCU and Sophgo SG2260,
with a simulated GCU on torch CPU kernels.

Importing this package imports neither vLLM internals nor any vendor library;
vLLM calls the two entry-point functions below.
"""

__version__ = "0.1.0"

PLATFORM_CLS = "vllm_accel.platform.AccelPlatform"


def register_platform() -> str | None:
    """``vllm.platform_plugins`` entry point: the platform class path.

    vLLM calls this twice per process and swallows exceptions, so it stays
    cheap, idempotent and side-effect free; checks happen when the platform
    module is imported.
    """
    return PLATFORM_CLS


def register_general() -> None:
    """``vllm.general_plugins`` entry point, run in every vLLM process:
    registers the ACCEL_ATTN attention backend, our custom ops and model classes."""
    from vllm import ModelRegistry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_accel import patches
    from vllm_accel.backends import get_backend
    from vllm_accel.ops.attention import BACKEND_NAME
    from vllm_accel.ops.registry import set_preferred_providers

    set_preferred_providers(get_backend().kernel_providers)

    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "vllm_accel.ops.attention.AccelAttentionBackend")
    import vllm_accel.ops.custom_ops  # noqa: F401  (register_oot at import)
    import vllm_accel.quant  # noqa: F401  (registers gcu_gptq at import)
    from vllm_accel.models import OVERRIDES

    for architecture, model_class in OVERRIDES.items():
        ModelRegistry.register_model(architecture, model_class)

    patches.apply_all("general")
