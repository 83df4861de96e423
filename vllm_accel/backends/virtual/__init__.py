"""The virtual card: a real torch device whose memory is host memory and whose
kernels are the CPU's, standing in for a vendor library so the card path runs
end to end without a card.

Each backend here is the vendor's backend with one difference, what it loads:
``ACCEL_BACKEND=virtual`` is the Enflame backend importing
:mod:`~vllm_accel.backends.virtual.torch_gcu` instead of ``torch_gcu``;
``ACCEL_BACKEND=virtual-sophtpu`` is the Sophgo backend importing
:mod:`~vllm_accel.backends.virtual.torch_tpu` instead of ``torch_tpu``.
Everything else -- the card worker and runner, the attention backend, the quant
methods, custom ops, the vendor-op fallback -- runs exactly as on a card.
"""

from vllm_accel.backends.enflame_gcu import EnflameGcuBackend
from vllm_accel.backends.sophgo_tpu import SophgoTpuBackend

_RUNS = "a torch device on host memory running the CPU's kernels"


class VirtualGcuBackend(EnflameGcuBackend):
    name = "virtual"
    vendor_modules = ("vllm_accel.backends.virtual.torch_gcu",)
    optional_vendor_modules = frozenset()
    kernel_extensions = ()

    def describe(self) -> str:
        return f"virtual GCU ({_RUNS}, driven through the Enflame card path)"


class VirtualSophTpuBackend(SophgoTpuBackend):
    name = "virtual-sophtpu"
    vendor_modules = ("vllm_accel.backends.virtual.torch_tpu",)

    def describe(self) -> str:
        return f"virtual SG2260 ({_RUNS}, driven through the Sophgo card path)"
