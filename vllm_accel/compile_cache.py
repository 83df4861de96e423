"""The plugin's part of vLLM's torch.compile cache key.

vLLM saves the compiled model (``VLLM_CACHE_ROOT/torch_compile_cache``) under a hash
of its own config and ``VLLM_*`` variables, and a later start with the same hash
loads it without tracing. Which kernel each layer calls is decided by this plugin
at load time (``ACCEL_*`` settings, the CPU's units, the plugin's own code) and is
baked into the traced graph: a graph cached under another choice would call the
wrong kernel or read a weight in the wrong layout. The simulator's model runner puts
this key into ``additional_config`` (hashed by vLLM) after loading the model and before
the first forward, where vLLM computes the cache's hash: it is the worker's own view
(its host's CPU and environment, whether its C++ kernels built), so any such change
compiles afresh. It is deliberately broad: any ``ACCEL_*`` setting or plugin source
change recompiles once.
"""

import hashlib
import os
from pathlib import Path

from vllm_accel.logger import init_logger

logger = init_logger(__name__)

PACKAGE = Path(__file__).resolve().parent
#: the config entry the simulator's model runner sets (``additional_config[CONFIG_KEY]``)
CONFIG_KEY = "vllm_accel_compile_key"
_SOURCE_SUFFIXES = (".py", ".c", ".cc", ".cpp", ".h", ".hpp")


def _sources_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE.rglob("*") if p.suffix in _SOURCE_SUFFIXES):
        digest.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def compile_key() -> str:
    """Digest of what decides the plugin's kernels in this process: its sources, every
    ``ACCEL_*`` variable, the CPU's model and flags, and whether the C++ kernels and
    their dispatcher ops built here (each model layer routes on that)."""
    from vllm_accel.ops.cpu_native import build as native

    settings = sorted((k, v) for k, v in os.environ.items() if k.startswith("ACCEL_"))
    built = (native.library() is not None, native.torch_ops() is not None)
    parts = [_sources_digest(), repr(settings), native.cpu_signature(), repr(built)]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def add_to_config(vllm_config) -> None:
    """Put the key into ``vllm_config.additional_config`` (a dict, vLLM's default)."""
    extra = vllm_config.additional_config
    if isinstance(extra, dict):
        extra[CONFIG_KEY] = compile_key()
    else:
        logger.warning_once("additional_config is a %s, not a dict: vLLM's compile cache "
                            "is not keyed on vllm_accel's kernel choices; set "
                            "VLLM_DISABLE_COMPILE_CACHE=1 after changing ACCEL_* settings.",
                            type(extra).__name__)
