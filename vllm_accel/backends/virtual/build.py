"""Builds the virtual card (``csrc/virtual_device.cpp``) at first use, for the
installed torch, and loads it.

It is a torch C++ extension (it registers a device with torch's dispatcher), so
it is compiled against torch's headers and libraries with the host's C++
compiler, into ``ACCEL_NATIVE_CACHE`` under a key of the source, compiler, flags
and torch build; later processes (and engine ranks) load the cached library.
"""

import functools
import hashlib
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from vllm_accel import envs
from vllm_accel.logger import init_logger
from vllm_accel.ops.cpu_native.build import compiler, torch_flags

logger = init_logger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "virtual_device.cpp"
FLAGS = ("-O2", "-std=c++17", "-fPIC", "-shared", "-w")


def _build(cxx: str) -> Path:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join(
        [SOURCE.read_text(), cxx, version, " ".join(FLAGS), torch.__version__,
         str(Path(torch.__file__).parent)]).encode()).hexdigest()[:16]
    target = Path(envs.ACCEL_NATIVE_CACHE) / f"virtual_device-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("Building the virtual card for torch %s (once per machine, about a minute)...",
                torch.__version__)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        result = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(built), *torch_flags()],
                                capture_output=True, text=True)
        if result.returncode:
            raise RuntimeError(f"building the virtual card with {cxx} failed:\n"
                               f"{result.stderr[-4000:]}")
        os.replace(built, target)
    logger.info("Built the virtual card: %s", target)
    return target


@functools.cache
def load_library() -> Path:
    """Build (once) and load the virtual card into this process; its path."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("ACCEL_BACKEND=virtual / virtual-sophtpu needs a C++ compiler to build the virtual "
                           "GCU against torch: install one (e.g. apt install g++) or set CXX.")
    if envs.ACCEL_NATIVE_CACHE.lower() in ("", "off", "0", "none"):
        raise RuntimeError("ACCEL_BACKEND=virtual / virtual-sophtpu builds the virtual card into "
                           "ACCEL_NATIVE_CACHE, which is off: set it to a writable directory.")
    path = _build(cxx)
    torch.ops.load_library(str(path))
    return path
