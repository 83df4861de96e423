"""Put on PYTHONPATH by ``benchmarks/as_cpu.py``: torch reports the CPU ``ACCEL_AS_CPU``
names (``avx512``: no AMX tiles; ``avx2``: no AVX-512 and no AMX either;
``baseline``: not even AVX2).

torch's ``torch.cpu._is_*_supported()`` read CPUID, which still lists AMX when the OS
refuses the tile state, and AVX-512 whatever torch is told to run; answering False is
what they answer on such a CPU.
"""

import os

try:
    import torch
except ImportError:  # a Python process without torch: nothing to tell
    pass
else:  # vLLM asks torch.cpu, inductor's vector-ISA check both
    _absent = ["amx_tile", "amx_fp16"]
    if os.environ.get("ACCEL_AS_CPU") in ("avx2", "baseline"):
        _absent += ["avx512", "avx512_bf16", "vnni"]
    if os.environ.get("ACCEL_AS_CPU") == "baseline":
        _absent += ["avx2"]
    for _name in _absent:
        for _module in (torch.cpu, torch._C._cpu):
            if hasattr(_module, f"_is_{_name}_supported"):
                setattr(_module, f"_is_{_name}_supported", lambda: False)
