"""Imported by the virtual SG2260 backend (``ACCEL_BACKEND=virtual-sophtpu``)
where the Sophgo backend imports ``torch_tpu``, with the contract of Sophgo's
library (shared notes, vendor-apis section 2), quirks included, so the SG2260
card path meets them without a chip:

* PrivateUse1 renamed ``tpu``; ``torch.tpu``; ``torch_tpu.tpu``.
* ``torch.tpu.device_count()`` does no visibility filtering;
  ``torch.tpu.set_device(local_rank)`` maps through ``CHIP_MAP``, and so does
  ``torch.device("tpu:N")`` (torch_tpu replaces ``torch.device`` with a shim that
  maps ``N`` to ``CHIP_MAP[N % len]``, and a bare int to a ``tpu`` device).
* ``get_device_properties().total_memory`` is 0 and ``get_device_capability()``
  is None; ``mem_get_info`` answers only for the current chip.
* ``sccl`` (extended API) refuses to start before ``torch.tpu.set_chip_map``.
* ``torch.ops.my_ops.enable_profile`` / ``disable_profile``.

Chips: ``ACCEL_VIRTUAL_DEVICE_COUNT`` (8), each ``ACCEL_SIM_DEVICE_MEMORY_GB``.
"""

import os
import warnings

import torch
import torch.distributed as dist

from vllm_accel import envs
from vllm_accel.backends.cpu_sim import CpuSimBackend
from vllm_accel.backends.virtual import device

_torch_device = torch.device


def _chip_map() -> list[int] | None:
    raw = os.environ.get("CHIP_MAP", "").strip()
    return [int(chip) for chip in raw.split(",")] if raw else None


def _map_local_rank(local_rank: int) -> int:
    """torch_tpu's ``map_local_rank_to_device_idx``."""
    chips = _chip_map()
    return local_rank if chips is None else chips[local_rank % len(chips)]


class _DeviceMeta(type):
    """torch_tpu's ``torch.device`` shim: still answers ``isinstance``, and
    builds real ``torch.device`` objects, with tpu indices mapped to chips."""

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and isinstance(args[0], int):
            args = ("tpu", args[0])
        made = _torch_device(*args, **kwargs)
        if made.type == "tpu" and made.index is not None:
            return _torch_device("tpu", _map_local_rank(made.index))
        return made

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _torch_device)

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, _torch_device)


class TPUDevice(metaclass=_DeviceMeta):
    """What ``torch.device`` is after ``import torch_tpu``."""


class ProcessGroupSCCLOptions:
    def __init__(self):
        self.timeout = None
        self.chip_map: list[int] = []


class _State:
    chip_map_set: list[int] | None = None


def set_chip_map(options, use_rank_table: bool = False, chip_map=None) -> None:
    if chip_map is not None:
        options.chip_map = list(chip_map)
    _State.chip_map_set = list(options.chip_map)


class ScclProcessGroup(device.HostCollectives):
    backend_name = "sccl"


def _create_sccl(dist_options, pg_options):
    if _State.chip_map_set is None:
        raise RuntimeError("sccl: no chip map; call torch.tpu.set_chip_map("
                           "ProcessGroupSCCLOptions()) before init_process_group")
    return ScclProcessGroup(dist_options.store, dist_options.group_rank,
                            dist_options.group_size, dist_options.timeout)


def _register_profile_ops() -> None:
    """``torch.ops.my_ops.enable_profile(max_record_num, mode)`` and
    ``disable_profile()``: nothing is recorded on the virtual chip."""
    library = torch.library.Library("my_ops", "DEF")
    library.define("enable_profile(int? max_record_num=None, int? mode=None) -> ()")
    library.define("disable_profile() -> ()")
    library.impl("enable_profile", lambda max_record_num=None, mode=None: None,
                 "CompositeExplicitAutograd")
    library.impl("disable_profile", lambda: None, "CompositeExplicitAutograd")
    _register_profile_ops.library = library  # a Library unregisters when collected


def _device_module(capacity: int):
    tpu = device.device_module("tpu", capacity, "SG2260 (virtual: host memory, CPU kernels)")
    base_properties = tpu.get_device_properties
    common_mem_get_info = tpu.mem_get_info

    def set_device(local_rank) -> None:
        torch.ops.vdevice.set_device(_map_local_rank(device.device_index(local_rank)))

    def get_device_properties(dev=None):
        return base_properties(dev)._replace(total_memory=0)  # as torch_tpu reports

    def get_device_capability(dev=None):
        warnings.warn("torch.tpu.get_device_capability is not supported", stacklevel=2)

    def mem_get_info(dev=None):
        if dev is not None and device.device_index(dev) != tpu.current_device():
            raise RuntimeError("torch.tpu.mem_get_info answers only for the current device")
        return common_mem_get_info()

    tpu.set_device = set_device
    tpu.get_device_properties = get_device_properties
    tpu.get_device_capability = get_device_capability
    tpu.mem_get_info = mem_get_info
    tpu.flush = lambda dev=None: None
    tpu.set_chip_map = set_chip_map
    return tpu


def _install():
    if hasattr(torch, "tpu"):  # imported before in this process
        return torch.tpu
    capacity = CpuSimBackend().total_memory(0, 1)
    tpu = _device_module(capacity)
    device.install("tpu", envs.ACCEL_VIRTUAL_DEVICE_COUNT, capacity, tpu)
    torch.device = TPUDevice
    dist.Backend.register_backend("SCCL", _create_sccl, extended_api=True,
                                  devices=["tpu", "cpu"])
    _register_profile_ops()
    return tpu


tpu = _install()
__version__ = "virtual"
