"""The virtual GCU: Enflame's backend contract on a real torch device whose
memory is host memory and whose kernels are the CPU's (``ACCEL_BACKEND=virtual``).

The backend is the Enflame one; only what it loads differs: instead of
``torch_gcu`` it imports :mod:`vllm_accel.backends.virtual_gcu.torch_gcu`, which
builds and registers the device. Everything else -- the card worker and runner,
GCU_ATTN, the quant methods, custom ops, the vendor-op fallback -- runs exactly
as on a card, so the card path is exercised end to end without one.
"""

from vllm_accel.backends.enflame_gcu import EnflameGcuBackend


class VirtualGcuBackend(EnflameGcuBackend):
    name = "virtual"
    vendor_modules = ("vllm_accel.backends.virtual_gcu.torch_gcu",)
    optional_vendor_modules = frozenset()
    kernel_extensions = ()

    def describe(self) -> str:
        return ("virtual GCU (a torch device on host memory running the CPU's kernels, "
                "driven through the Enflame card path)")
