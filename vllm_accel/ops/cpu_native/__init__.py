"""Provider ``cpu_native``: the simulated GCU's C++ kernels (``csrc/``), built for
this CPU at first use (``build.py``) and called through ctypes: paged attention,
KV-cache writers, RMSNorm, SiluAndMul, rotary."""
