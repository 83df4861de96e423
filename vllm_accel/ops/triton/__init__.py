"""The ``triton`` kernel provider: paged and MLA attention, the fused MoE experts and
the quantized GEMMs in Triton.

Triton is how kernels reach accelerators without a port per vendor: Enflame and
Sophgo both ship Triton backends, and the same source runs on NVIDIA GPUs, which
is where these kernels are proven (tests and ``benchmarks/triton_kernels.py`` on
an H100). The kernels read this project's own layouts -- the paged KV cache of
``paged_layout`` (bf16/fp16/fp32 and INT8 with per-(token, head) scales) and
the weight-only resident layout of ``quant/packed.py`` -- so choosing Triton never
repacks anything.

The kernel modules import only torch and triton, so they run on a machine that has
nothing else (``python -m pytest tests/test_triton_kernels.py`` on a GPU box).
:mod:`.provider` probes the device and registers them with the kernel registry.
Triton has no CPU backend: on the simulator they run only under
``TRITON_INTERPRET=1`` with ``ACCEL_KERNEL_PROVIDER=triton``.
"""
