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
from typing import Protocol, runtime_checkable

from vllm_accel import envs

BACKEND_CHOICES = ("auto", "sim")


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

    def describe(self) -> str:
        """One line for the startup log: what runs where."""

    def process_env(self) -> dict[str, str]:
        """Environment defaults that EngineCore and the workers must start with."""

    def device_count(self) -> int: ...

    def set_device(self, local_rank: int) -> None: ...

    def synchronize(self) -> None: ...

    def manual_seed_all(self, seed: int) -> None: ...

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        """Bytes of device memory one rank may plan with (KV sizing uses it)."""

    def profiler(self) -> AbstractContextManager:
        """Context manager that records a device trace (vendor profiler hook)."""


@functools.cache
def get_backend() -> DeviceBackend:
    """The backend chosen by ACCEL_BACKEND; cached per process."""
    choice = envs.ACCEL_BACKEND
    if choice not in BACKEND_CHOICES:
        raise ValueError(
            f"ACCEL_BACKEND={choice!r} is not one of {', '.join(BACKEND_CHOICES)}."
        )
    # Real-card detection arrives with the torch_gcu / torch_tpu hooks; until
    # then `auto` always resolves to the simulator.
    from vllm_accel.backends.cpu_sim import CpuSimBackend

    return CpuSimBackend()
