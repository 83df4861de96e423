"""Fake ``torch.tpu`` (torch_tpu.tpu) with Sophgo's quirks: set_device maps the
local rank through CHIP_MAP, no visibility filtering, total_memory == 0,
capability None, mem_get_info only for the current device."""

import dataclasses
import functools
import os

import torch


@dataclasses.dataclass
class FakeTpuState:
    count: int = int(os.environ.get("FAKE_TPU_COUNT", "8"))
    current: int = 0  # physical chip
    total: int = 64 * 2**30
    allocated: int = 0
    peak: int = 0
    chip_map_set: list | None = None
    log: list = dataclasses.field(default_factory=list)


state = FakeTpuState()


@functools.lru_cache
def device_count():
    return state.count


def is_available():
    return device_count() > 0


def _map_local_rank_to_device_idx(local_rank):
    raw = os.environ.get("CHIP_MAP")
    if not raw:
        return local_rank
    chips = [int(x) for x in raw.split(",")]
    return chips[local_rank % len(chips)]


def set_device(local_rank):
    chip = _map_local_rank_to_device_idx(int(local_rank))
    if not 0 <= chip < device_count():
        raise RuntimeError(f"tpu: invalid chip {chip}")
    state.current = chip
    state.log.append(("set_device", int(local_rank), chip))


def current_device():
    return state.current


def synchronize(device=None):
    state.log.append(("synchronize",))


def get_device_name(d=None):
    return "SG2260"


class _Props:
    name = "SG2260"
    total_memory = 0  # hard-coded to 0 in torch_tpu's Module.cpp


def get_device_properties(d=None):
    return _Props()


def get_device_capability(d=None):
    return None


def mem_get_info(device=None):
    if device is not None and int(getattr(device, "index", device)) != state.current:
        raise RuntimeError("tpu: mem_get_info only supports the current device")
    return state.total - state.allocated, state.total


def memory_allocated(device=None):
    return state.allocated


def max_memory_allocated(device=None):
    return state.peak


def reset_peak_memory_stats(device=None):
    state.peak = state.allocated


def empty_cache():
    state.log.append(("empty_cache",))


def fake_allocate(nbytes):
    state.allocated += nbytes
    state.peak = max(state.peak, state.allocated)


def manual_seed_all(seed):
    state.log.append(("manual_seed_all", seed))
    torch.manual_seed(seed)


manual_seed = manual_seed_all


def set_chip_map(options, use_rank_table=False, chip_map=None):
    if chip_map is not None:
        options.chip_map = list(chip_map)
    state.chip_map_set = list(options.chip_map)
    state.log.append(("set_chip_map", list(options.chip_map)))
