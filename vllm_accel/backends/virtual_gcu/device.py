"""The Python face of the virtual GCU: what ``import torch_gcu`` does, on a
device whose memory is host memory and whose kernels are the CPU's.

:func:`install` loads the C++ device (``csrc/virtual_device.cpp``), renames
PrivateUse1 to ``gcu``, registers :data:`module` as ``torch.gcu`` (the API
surface of torch_gcu 2.x that vLLM-GCU uses: devices honouring
``TOPS_VISIBLE_DEVICES``, streams, events, memory counters, seeding, device
properties), generates ``Tensor.gcu()`` / ``.is_gcu`` and registers the
``eccl`` distributed backend (gloo over host memory). It is idempotent, and
irreversible in a process, like the vendor library's import.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
import types
from collections import namedtuple

import torch

from vllm_accel.backends.virtual_gcu.build import load_library

DEVICE = "gcu"
#: what get_device_properties reports (an S60's fields; the name says virtual)
DeviceProperties = namedtuple(
    "DeviceProperties", "name major minor multi_processor_count total_memory "
    "max_threads_per_multi_processor sip_count")


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


def _ops():
    return torch.ops.vgcu


def _index(device=None) -> int:
    if device is None:
        return _ops().current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return _ops().current_device() if device.index is None else device.index


class Stream:
    """A stream of the virtual GCU: work runs when issued, so every stream is
    always complete."""

    def __init__(self, device=None, priority: int = 0):
        self.device = torch.device(DEVICE, _index(device))
        self.priority = priority
        self.gcu_stream = 0

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


def _make_module(capacity: int) -> types.ModuleType:
    """``torch.gcu``: the functions below, in a module like torch_gcu's."""
    gcu = types.ModuleType("torch.gcu")
    default_streams: dict[int, Stream] = {}

    def device_count() -> int:
        return _ops().device_count()

    def current_device() -> int:
        return _ops().current_device()

    def set_device(device) -> None:
        _ops().set_device(_index(device))

    @contextlib.contextmanager
    def device(device):
        previous = current_device()
        set_device(device)
        try:
            yield
        finally:
            set_device(previous)

    def device_of(tensor):
        return device(tensor.device) if tensor.device.type == DEVICE else contextlib.nullcontext()

    def default_stream(device=None) -> Stream:
        index = _index(device)
        return default_streams.setdefault(index, Stream(index))

    @contextlib.contextmanager
    def stream(stream):
        yield stream

    def mem_get_info(device=None) -> tuple[int, int]:
        index = _index(device)
        return capacity - _ops().memory_allocated(index), capacity

    def memory_stats(device=None) -> dict[str, int]:
        index = _index(device)
        now, peak = _ops().memory_allocated(index), _ops().max_memory_allocated(index)
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": peak,
                "reserved_bytes.all.current": now, "reserved_bytes.all.peak": peak}

    def get_device_properties(device=None) -> DeviceProperties:
        _index(device)
        return DeviceProperties("Virtual GCU (host memory, CPU kernels)", 3, 0,
                                os.cpu_count() or 1, capacity, 1, os.cpu_count() or 1)

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
        "memory_allocated": lambda device=None: _ops().memory_allocated(_index(device)),
        "max_memory_allocated": lambda device=None: _ops().max_memory_allocated(_index(device)),
        "memory_reserved": lambda device=None: _ops().memory_allocated(_index(device)),
        "max_memory_reserved": lambda device=None: _ops().max_memory_allocated(_index(device)),
        "reset_peak_memory_stats": lambda device=None: _ops().reset_peak_memory_stats(
            _index(device)),
        "reset_max_memory_allocated": lambda device=None: _ops().reset_peak_memory_stats(
            _index(device)),
        "empty_cache": lambda: None,
        "memory_stats": memory_stats,
        "get_device_properties": get_device_properties,
        "get_device_name": lambda device=None: get_device_properties(device).name,
        "get_device_capability": lambda device=None: (3, 0),
        "get_sip_count": lambda device=None: os.cpu_count() or 1,
        "is_bf16_supported": lambda: True,
        "manual_seed": lambda seed: _ops().manual_seed(current_device(), int(seed)),
        "manual_seed_all": manual_seed_all,
        "seed": lambda: _ops().seed(current_device()),
        "initial_seed": lambda: _ops().initial_seed(current_device()),
        "OutOfMemoryError": torch.OutOfMemoryError,
    }
    for name, value in members.items():
        setattr(gcu, name, value)
    return gcu


def _host(value):
    """gcu tensors (also in lists) as CPU tensors over the same memory."""
    if isinstance(value, torch.Tensor):
        return torch.ops.vgcu.host_view(value) if value.device.type == DEVICE else value
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


class EcclProcessGroup(torch.distributed.ProcessGroup):
    """``eccl`` on the virtual GCU: gloo over the same host memory. gcu tensors
    reach gloo as CPU views of their storage, so collectives work in place."""

    def __init__(self, store, rank: int, size: int, timeout):
        super().__init__(rank, size)
        self._gloo = torch.distributed.ProcessGroupGloo(store, rank, size, timeout)
        # torch names a group after its backends (destroy_process_group needs it)
        self._register_backend(torch.device("cpu"), torch.distributed.ProcessGroup.BackendType.GLOO,
                               self._gloo)

    def getBackendName(self) -> str:
        return "eccl"


def _forward(name: str, gloo_name: str):
    def collective(self, *args, **kwargs):
        return getattr(self._gloo, gloo_name)(*(_host(a) for a in args),
                                              **{k: _host(v) for k, v in kwargs.items()})

    collective.__name__ = name
    return collective


for _name, _gloo_name in _COLLECTIVES.items():
    setattr(EcclProcessGroup, _name, _forward(_name, _gloo_name))


def _register_eccl() -> None:
    import torch.distributed as dist

    if "eccl" in dist.Backend.backend_list:
        return
    dist.Backend.register_backend("eccl", EcclProcessGroup, devices=[DEVICE, "cpu"])
    dist.is_eccl_available = lambda: True


@functools.cache
def install(count: int, capacity: int) -> types.ModuleType:
    """Load the device (``count`` devices of ``capacity`` bytes before
    ``TOPS_VISIBLE_DEVICES``) and make it ``gcu``; returns ``torch.gcu``."""
    load_library()
    torch.ops.vgcu.configure(_visible_count(count), capacity)
    torch.utils.rename_privateuse1_backend(DEVICE)
    module = _make_module(capacity)
    torch._register_device_module(DEVICE, module)
    torch.utils.generate_methods_for_privateuse1_backend(for_storage=True)
    _register_eccl()
    return module
