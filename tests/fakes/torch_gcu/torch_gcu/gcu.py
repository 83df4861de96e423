"""Fake ``torch.gcu`` (torch_gcu.gcu): device, memory, RNG, streams; state in ``state``."""

import contextlib
import dataclasses
import os
import time

import torch

from torch_gcu import _C


@dataclasses.dataclass
class FakeGcuState:
    count: int = int(os.environ.get("FAKE_GCU_COUNT", "2"))
    current: int = 0
    total: int = 48 * 2**30
    allocated: int = 0
    peak: int = 0
    capability: tuple = (3, 0)
    name: str = "Enflame S60"
    available: bool = True
    log: list = dataclasses.field(default_factory=list)


state = FakeGcuState()


def _parse_visible_devices():
    """TOPS_VISIBLE_DEVICES with CUDA's rules: stop at the first invalid,
    out-of-range or repeated ordinal; a repeated id makes the list invalid (0)."""
    raw = os.environ.get("TOPS_VISIBLE_DEVICES")
    if raw is None:
        return list(range(_C._gcu_getDeviceCount()))
    seen = []
    for item in raw.split(","):
        item = item.strip()
        if not item.isdigit():
            break
        n = int(item)
        if n in seen:
            return []
        if n >= _C._gcu_getDeviceCount():
            break
        seen.append(n)
    return seen


def is_available():
    return state.available and device_count() > 0


def device_count():
    return len(_parse_visible_devices())


def set_device(d):
    d = d.index if isinstance(d, torch.device) else int(d)
    if not 0 <= d < device_count():
        raise RuntimeError(f"gcu: invalid device ordinal {d} (visible: {device_count()})")
    _C._gcu_setDevice(d)
    state.log.append(("set_device", d))


def current_device():
    return _C._gcu_getDevice()


@contextlib.contextmanager
def device(d):
    prev = current_device()
    set_device(d)
    try:
        yield
    finally:
        set_device(prev)


def device_of(t):
    return device(t.device.index or 0)


def synchronize(device=None):
    _C._gcu_synchronize(device)


def get_device_name(d=None):
    return state.name


def get_device_properties(d=None):
    return _C._GcuDeviceProperties(state.name, *state.capability, 24, state.total, 2048, 24)


def get_device_capability(d=None):
    return state.capability


def get_sip_count(d=None):
    return 24


def mem_get_info(device=None):
    return state.total - state.allocated, state.total


def memory_allocated(device=None):
    return state.allocated


def max_memory_allocated(device=None):
    return state.peak


def memory_reserved(device=None):
    return state.allocated


def max_memory_reserved(device=None):
    return state.peak


def reset_peak_memory_stats(device=None):
    state.peak = state.allocated
    state.log.append(("reset_peak_memory_stats",))


reset_max_memory_allocated = reset_peak_memory_stats


def empty_cache():
    state.log.append(("empty_cache",))


def memory_stats(device=None):
    return {"allocated_bytes.all.current": state.allocated, "allocated_bytes.all.peak": state.peak,
            "reserved_bytes.all.current": state.allocated, "reserved_bytes.all.peak": state.peak}


def fake_allocate(nbytes):
    """Test hook: pretend the allocator handed out ``nbytes`` (negative frees)."""
    state.allocated += nbytes
    state.peak = max(state.peak, state.allocated)


def manual_seed(seed):
    state.log.append(("manual_seed", seed))
    torch.manual_seed(seed)


def manual_seed_all(seed):
    state.log.append(("manual_seed_all", seed))
    torch.manual_seed(seed)


def initial_seed():
    return torch.initial_seed()


class Stream:
    def __init__(self, device=None, priority=0):
        self.gcu_stream = 0
        self._limit = (0, 0)

    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass

    def set_limit(self, cluster_num, sip_num):
        self._limit = (cluster_num, sip_num)

    def get_limit(self):
        return self._limit


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self._t = None

    def record(self, stream=None):
        self._t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end._t - self._t) * 1000.0


_current_stream = Stream()


def current_stream(device=None):
    return _current_stream


default_stream = current_stream


@contextlib.contextmanager
def stream(s):
    yield


def set_stream(s):
    pass


class GCUGraph:
    def __init__(self, *a, **k):
        raise NotImplementedError("fake torch_gcu: GCU graphs cannot be faked")


def graph(*a, **k):
    raise NotImplementedError("fake torch_gcu: GCU graphs cannot be faked")


amp = torch.amp


def is_bf16_supported():
    return True
