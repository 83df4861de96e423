"""Device backends: the one place where the plugin meets a device API.

The platform, worker, attention and quant layers are device-agnostic; everything
they need from a device -- identity, counting and selecting devices, memory,
synchronisation, seeding, the distributed backend, profiling, preferred kernel
providers -- goes through the ``DeviceBackend`` protocol below. ``cpu_sim`` is a
simulated GCU on torch CPU kernels; real-card backends (Enflame ``torch_gcu``,
Sophgo ``torch_tpu``) implement the same protocol and are imported only when chosen.
"""

import functools
from contextlib import AbstractContextManager
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from vllm_accel import envs

BACKEND_CHOICES = ("auto", "sim", "gcu", "sophtpu", "virtual", "virtual-sophtpu")


@runtime_checkable
class DeviceBackend(Protocol):
    #: short backend id (``sim``), shown in logs and selectable with ACCEL_BACKEND
    name: str
    #: the device kind users ask for with ``--device`` (``gcu``)
    device_name: str
    #: torch device type tensors live on (``cpu`` for the simulator)
    torch_device_type: str
    #: torch.distributed backend for tensor parallel (``gloo``, ``eccl``, ...)
    dist_backend: str
    #: environment variable that restricts the visible devices
    visible_devices_env: str
    #: kernel providers in order of preference (``reference`` is implied last)
    kernel_providers: tuple[str, ...]
    #: True for a vendor card (tensors on a PrivateUse1 device), False for the simulator
    is_real_card: bool
    #: the vLLM worker class the platform runs for this backend (qualified name)
    worker_cls: str
    #: dispatch key of the device's kernels (``CPU``, ``PrivateUse1``)
    dispatch_key: str

    def load(self) -> None:
        """Import the vendor library once (idempotent); before torch.distributed init."""

    def describe(self) -> str:
        """One line for the startup log: what runs where."""

    def process_env(self, local_world_size: int) -> dict[str, str]:
        """Environment defaults that EngineCore and the workers must start with,
        for ``local_world_size`` device processes on this host."""

    def device_count(self) -> int: ...

    def set_device(self, local_rank: int) -> None: ...

    def synchronize(self) -> None: ...

    def manual_seed_all(self, seed: int) -> None: ...

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        """Bytes of device memory one rank may plan with (KV sizing uses it)."""

    def profiler(self) -> AbstractContextManager:
        """Context manager that records a device trace (vendor profiler hook)."""

    def memory_allocated(self) -> int:
        """Bytes the caching allocator has handed out on the current device."""

    def empty_cache(self) -> None: ...

    def distributed_init(self, rank: int, local_rank: int, world_size: int) -> AbstractContextManager:
        """Wraps vLLM's distributed init with what the backend's collectives need."""

    def op(self, qualname: str) -> Callable | None:
        """A vendor kernel ``ns::name`` registered for the device, or None."""


def _sim() -> DeviceBackend:
    from vllm_accel.backends.cpu_sim import CpuSimBackend

    return CpuSimBackend()


def _gcu(detection) -> DeviceBackend:
    from vllm_accel.backends.enflame_gcu import EnflameGcuBackend

    return EnflameGcuBackend(detection.reason)


def _sophtpu(detection) -> DeviceBackend:
    from vllm_accel.backends.sophgo_tpu import SophgoTpuBackend

    return SophgoTpuBackend(detection.reason)


#: forced choice -> (detector name, install hint)
_REAL = {
    "gcu": ("detect_torch_gcu", "install Enflame's torch_gcu 2.x wheel from TopsRider"),
    "sophtpu": ("detect_sophgo_torch_tpu",
                "install Sophgo's torch_tpu wheel (github.com/sophgo/torch-tpu releases; "
                "PyPI's torch-tpu is Google's TorchTPU)"),
}


def select_backend(choice: str) -> DeviceBackend:
    """Resolve ACCEL_BACKEND to a backend object without importing a vendor library.

    ``auto`` picks torch_gcu, then Sophgo torch_tpu, then the simulator; a forced
    real backend whose library is missing is an error naming what to install.
    """
    if choice not in BACKEND_CHOICES:
        raise ValueError(
            f"ACCEL_BACKEND={choice!r} is not one of {', '.join(BACKEND_CHOICES)}."
        )
    if choice == "sim":
        return _sim()
    if choice == "virtual":
        from vllm_accel.backends.virtual import VirtualGcuBackend

        return VirtualGcuBackend("ACCEL_BACKEND=virtual")
    if choice == "virtual-sophtpu":
        from vllm_accel.backends.virtual import VirtualSophTpuBackend

        return VirtualSophTpuBackend("ACCEL_BACKEND=virtual-sophtpu")
    from vllm_accel.backends import detect

    factories = {"gcu": _gcu, "sophtpu": _sophtpu}
    if choice in _REAL:
        detector, hint = _REAL[choice]
        detection = getattr(detect, detector)()
        if not detection.found:
            raise RuntimeError(
                f"ACCEL_BACKEND={choice} but its library is unusable: {detection.reason}. "
                f"Fix: {hint}, or set ACCEL_BACKEND=auto/sim."
            )
        return factories[choice](detection)
    gcu = detect.detect_torch_gcu()
    tpu = detect.detect_sophgo_torch_tpu()
    if gcu.found and tpu.found:
        raise RuntimeError(
            f"Both Enflame torch_gcu ({gcu.reason}) and Sophgo torch_tpu ({tpu.reason}) "
            "are installed; both rename torch's PrivateUse1 device, so one process can "
            "use only one. Set ACCEL_BACKEND=gcu or ACCEL_BACKEND=sophtpu."
        )
    if gcu.found:
        return _gcu(gcu)
    if tpu.found:
        return _sophtpu(tpu)
    return _sim()


@functools.cache
def get_backend() -> DeviceBackend:
    """The backend chosen by ACCEL_BACKEND; cached per process."""
    return select_backend(envs.ACCEL_BACKEND)
