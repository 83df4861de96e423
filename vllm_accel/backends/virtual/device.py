"""The Python face of the virtual card: the device module (``torch.gcu`` /
``torch.tpu``) and collectives both vendor libraries' stand-ins share.

:func:`install` loads the C++ device (``csrc/virtual_device.cpp``), renames
PrivateUse1 to the vendor's name, registers the device module (the
``torch.cuda``-shaped surface torch_gcu 2.x and torch_tpu expose: devices,
streams, events, memory counters, seeding, device properties), and generates
``Tensor.<name>()`` / ``.is_<name>``. Vendor differences (visibility, chip maps,
what ``get_device_properties`` reports, the collective backend) are the
flavours' (``torch_gcu.py``, ``torch_tpu.py``). Installing is irreversible in a
process, like the vendor library's import.
"""

from __future__ import annotations

import contextlib
import os
import time
import types
from collections import namedtuple

import torch
import torch.distributed as dist

from vllm_accel.backends.virtual.build import load_library

#: get_device_properties' fields (an S60's; torch_tpu has the same names)
DeviceProperties = namedtuple(
    "DeviceProperties", "name major minor multi_processor_count total_memory "
    "max_threads_per_multi_processor sip_count")


def _ops():
    return torch.ops.vdevice


def device_type() -> str:
    """What PrivateUse1 is called in this process (``gcu``, ``tpu``)."""
    return torch._C._get_privateuse1_backend_name()


def device_index(device=None) -> int:
    if device is None:
        return _ops().current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _ops().current_device() if device.index is None else device.index


class Stream:
    """A stream of the virtual card: work runs when issued, so every stream is
    always complete."""

    def __init__(self, device=None, priority: int = 0):
        self.device = torch.device(device_type(), device_index(device))
        self.priority = priority

    def wait_stream(self, stream: "Stream") -> None:
        pass

    def wait_event(self, event: "Event") -> None:
        pass

    def record_event(self, event: "Event | None" = None) -> "Event":
        event = event or Event()
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def __eq__(self, other) -> bool:
        return isinstance(other, Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(self.device)


class Event:
    """An event: records the wall-clock time (for ``elapsed_time``)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.enable_timing = enable_timing
        self._at: float | None = None

    def record(self, stream: Stream | None = None) -> None:
        self._at = time.perf_counter()

    def wait(self, stream: Stream | None = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "Event") -> float:
        if self._at is None or end._at is None:
            raise RuntimeError("elapsed_time needs two recorded events")
        return (end._at - self._at) * 1000.0


def device_module(name: str, capacity: int, device_name: str) -> types.ModuleType:
    """``torch.<name>`` with the members both vendors share; ``device_name`` is
    what ``get_device_properties().name`` says. Flavours replace members."""
    module = types.ModuleType(f"torch.{name}")
    default_streams: dict[int, Stream] = {}

    def device_count() -> int:
        return _ops().device_count()

    def current_device() -> int:
        return _ops().current_device()

    def set_device(device) -> None:
        _ops().set_device(device_index(device))

    @contextlib.contextmanager
    def device(device):
        previous = current_device()
        module.set_device(device)
        try:
            yield
        finally:
            _ops().set_device(previous)

    def device_of(tensor):
        return device(tensor.device) if tensor.device.type == name else contextlib.nullcontext()

    def default_stream(device=None) -> Stream:
        index = device_index(device)
        if index not in default_streams:
            default_streams[index] = module.Stream(index)
        return default_streams[index]

    @contextlib.contextmanager
    def stream(stream):
        yield stream

    def mem_get_info(device=None) -> tuple[int, int]:
        return capacity - _ops().memory_allocated(device_index(device)), capacity

    def memory_stats(device=None) -> dict[str, int]:
        index = device_index(device)
        now, peak = _ops().memory_allocated(index), _ops().max_memory_allocated(index)
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": peak,
                "reserved_bytes.all.current": now, "reserved_bytes.all.peak": peak}

    def get_device_properties(device=None) -> DeviceProperties:
        device_index(device)
        cores = os.cpu_count() or 1
        return DeviceProperties(device_name, 3, 0, cores, capacity, 1, cores)

    def manual_seed_all(seed: int) -> None:
        for index in range(device_count()):
            _ops().manual_seed(index, seed)

    members = {
        "is_available": lambda: device_count() > 0,
        "is_initialized": lambda: True,
        "_is_in_bad_fork": lambda: False,
        "_lazy_init": lambda: None,
        "init": lambda: None,
        "device_count": device_count,
        "current_device": current_device,
        "set_device": set_device,
        "device": device,
        "device_of": device_of,
        "synchronize": lambda device=None: None,
        "Stream": Stream,
        "Event": Event,
        "current_stream": default_stream,
        "default_stream": default_stream,
        "stream": stream,
        "set_stream": lambda stream: None,
        "mem_get_info": mem_get_info,
        "memory_allocated": lambda device=None: _ops().memory_allocated(device_index(device)),
        "max_memory_allocated": lambda device=None: _ops().max_memory_allocated(
            device_index(device)),
        "memory_reserved": lambda device=None: _ops().memory_allocated(device_index(device)),
        "max_memory_reserved": lambda device=None: _ops().max_memory_allocated(
            device_index(device)),
        "reset_peak_memory_stats": lambda device=None: _ops().reset_peak_memory_stats(
            device_index(device)),
        "reset_max_memory_allocated": lambda device=None: _ops().reset_peak_memory_stats(
            device_index(device)),
        "empty_cache": lambda: None,
        "memory_stats": memory_stats,
        "get_device_properties": get_device_properties,
        "get_device_name": lambda device=None: module.get_device_properties(device).name,
        "get_device_capability": lambda device=None: (3, 0),
        "is_bf16_supported": lambda: True,
        # (torch.amp.autocast asks the device module; vendor modules answer it)
        "get_amp_supported_dtype": lambda: [torch.bfloat16, torch.float16],
        "manual_seed": lambda seed: _ops().manual_seed(current_device(), int(seed)),
        "manual_seed_all": manual_seed_all,
        "seed": lambda: _ops().seed(current_device()),
        "initial_seed": lambda: _ops().initial_seed(current_device()),
        "OutOfMemoryError": torch.OutOfMemoryError,
    }
    for key, value in members.items():
        setattr(module, key, value)
    return module


def install(name: str, count: int, capacity: int, module: types.ModuleType) -> None:
    """Load the device (``count`` devices of ``capacity`` bytes), name it
    ``name`` and register ``module`` as ``torch.<name>``."""
    load_library()
    _ops().configure(count, capacity)
    torch.utils.rename_privateuse1_backend(name)
    torch._register_device_module(name, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)


def _host(value):
    """Device tensors (also in lists) as CPU tensors over the same memory."""
    if isinstance(value, torch.Tensor):
        return _ops().host_view(value) if value.device.type == device_type() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


#: ProcessGroup method (what torch.distributed calls) -> gloo backend method
_COLLECTIVES = {
    "allreduce": "allreduce", "allreduce_coalesced": "allreduce_coalesced",
    "allgather": "allgather", "allgather_coalesced": "allgather_coalesced",
    "all_gather_single": "_allgather_base",
    "all_gather_single_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "all_to_all_single": "alltoall_base", "alltoall": "alltoall", "broadcast": "broadcast",
    "reduce": "reduce", "gather": "gather", "scatter": "scatter", "barrier": "barrier",
    "send": "send", "recv": "recv", "recv_anysource": "recv_anysource",
}


class HostCollectives(dist.ProcessGroup):
    """A vendor collective backend (``eccl``, ``sccl``) on the virtual card: gloo
    over the same host memory. Device tensors reach gloo as CPU views of their
    storage, so collectives work in place."""

    backend_name: str

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)
        # torch names a group after its backends (destroy_process_group needs it)
        self._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                               self._gloo)

    def getBackendName(self) -> str:
        return self.backend_name


def _forward(name: str, gloo_name: str):
    def collective(self, *args, **kwargs):
        return getattr(self._gloo, gloo_name)(*(_host(a) for a in args),
                                              **{k: _host(v) for k, v in kwargs.items()})

    collective.__name__ = name
    return collective


for _name, _gloo_name in _COLLECTIVES.items():
    setattr(HostCollectives, _name, _forward(_name, _gloo_name))
