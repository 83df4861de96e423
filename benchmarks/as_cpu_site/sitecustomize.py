"""Put on PYTHONPATH by ``benchmarks/as_cpu.py``: torch reports the CPU ``ACCEL_AS_CPU``
names (``avx512``: no AMX tiles; ``avx2``: no AVX-512 and no AMX either;
``baseline``: not even AVX2).

torch's ``torch.cpu._is_*_supported()`` read CPUID, which still lists AMX when the OS
refuses the tile state, and AVX-512 whatever torch is told to run; answering False is
what they answer on such a CPU. torch is patched when something imports it, not here:
a process that never imports torch stays without it.
"""

import importlib.abc
import importlib.util
import os
import sys


def _absent() -> list[str]:
    mode = os.environ.get("ACCEL_AS_CPU", "")
    names = ["amx_tile", "amx_fp16"]
    if mode in ("avx2", "baseline"):
        names += ["avx512", "avx512_bf16", "vnni"]
    if mode == "baseline":
        names += ["avx2"]
    return names


def _patch(torch_cpu) -> None:
    """vLLM asks torch.cpu, inductor's vector-ISA check too."""
    for name in _absent():
        if hasattr(torch_cpu, f"_is_{name}_supported"):
            setattr(torch_cpu, f"_is_{name}_supported", lambda: False)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.cpu`` right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
