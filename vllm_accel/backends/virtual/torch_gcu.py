"""Imported by the virtual GCU backend where the Enflame backend imports
``torch_gcu``, with the same side effects: PrivateUse1 renamed ``gcu``,
``torch.gcu``, ``Tensor.gcu()``/``.is_gcu`` and the ``eccl`` backend.

Devices: ``ACCEL_VIRTUAL_DEVICE_COUNT`` (8, like an S60 server), of which
``TOPS_VISIBLE_DEVICES`` picks, as torch_gcu does; each holds
``ACCEL_SIM_DEVICE_MEMORY_GB`` of host memory, capped by what the host can give
(``ACCEL_SIM_HOST_MEMORY_FRACTION``).
"""

import os

import torch.distributed as dist

from vllm_accel import envs
from vllm_accel.backends.cpu_sim import CpuSimBackend
from vllm_accel.backends.virtual import device


def _visible_count(physical: int) -> int:
    """Devices after ``TOPS_VISIBLE_DEVICES`` (a comma list of ordinals; an
    empty, invalid or repeated entry ends the list, as CUDA's parsing does)."""
    spec = os.environ.get("TOPS_VISIBLE_DEVICES")
    if spec is None:
        return physical
    seen: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) >= physical or int(part) in seen:
            break
        seen.append(int(part))
    return len(seen)


class GcuStream(device.Stream):
    #: torch_gcu's raw ``topsStream_t`` handle (the default stream's is 0)
    gcu_stream = 0


class EcclProcessGroup(device.HostCollectives):
    backend_name = "eccl"


def _install() -> None:
    if hasattr(dist, "is_eccl_available"):  # imported before in this process
        return
    # The simulated GCU's rule: ACCEL_SIM_DEVICE_MEMORY_GB, capped by the host.
    capacity = CpuSimBackend().total_memory(0, 1)
    gcu = device.device_module("gcu", capacity, "Virtual GCU (host memory, CPU kernels)")
    gcu.Stream = GcuStream
    gcu.get_sip_count = lambda device=None: gcu.get_device_properties(device).sip_count
    device.install("gcu", _visible_count(envs.ACCEL_VIRTUAL_DEVICE_COUNT), capacity, gcu)
    dist.Backend.register_backend("eccl", EcclProcessGroup, devices=["gcu", "cpu"])
    dist.is_eccl_available = lambda: True


_install()
__version__ = "virtual"
