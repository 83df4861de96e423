"""Put on PYTHONPATH by ``benchmarks/without_amx.py``: torch reports no AMX tiles.

``torch.cpu._is_amx_tile_supported()`` reads CPUID, which still lists AMX when the OS
refuses the tile state; answering False is what it answers on a CPU without AMX.
"""

try:
    import torch
except ImportError:  # a Python process without torch: nothing to tell
    pass
else:  # vLLM asks the first, inductor's vector-ISA check the second
    torch.cpu._is_amx_tile_supported = lambda: False
    torch._C._cpu._is_amx_tile_supported = lambda: False
