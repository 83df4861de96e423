"""Simulated device memory: capacity, host cap, and the worker's KV budget."""

import os
import re
from types import SimpleNamespace

import psutil
import pytest

from vllm_accel.backends.cpu_sim import CpuSimBackend
from vllm_accel.envs import GiB


@pytest.fixture
def host_with_free(monkeypatch):
    def set_free(gib: float):
        vm = SimpleNamespace(available=int(gib * GiB), total=int(64 * GiB))
        monkeypatch.setattr(psutil, "virtual_memory", lambda: vm)
    return set_free


def test_capacity_is_configured_size_when_host_has_room(monkeypatch, host_with_free):
    host_with_free(200)
    monkeypatch.delenv("ACCEL_SIM_DEVICE_MEMORY_GB", raising=False)
    assert CpuSimBackend().total_memory(0, 1) == 48 * GiB  # an S60
    monkeypatch.setenv("ACCEL_SIM_DEVICE_MEMORY_GB", "2.5")
    assert CpuSimBackend().total_memory(0, 1) == int(2.5 * GiB)


def test_capacity_is_capped_by_host_and_split_between_ranks(monkeypatch, host_with_free):
    host_with_free(20)
    monkeypatch.delenv("ACCEL_SIM_DEVICE_MEMORY_GB", raising=False)
    monkeypatch.setenv("ACCEL_SIM_HOST_MEMORY_FRACTION", "0.5")
    assert CpuSimBackend().total_memory(0, 1) == 10 * GiB
    assert CpuSimBackend().total_memory(1, 2) == 5 * GiB


def test_bad_capacity_settings_are_clear_errors(monkeypatch):
    monkeypatch.setenv("ACCEL_SIM_DEVICE_MEMORY_GB", "lots")
    with pytest.raises(ValueError, match="ACCEL_SIM_DEVICE_MEMORY_GB='lots' is not a number"):
        CpuSimBackend().total_memory(0, 1)
    monkeypatch.setenv("ACCEL_SIM_DEVICE_MEMORY_GB", "0")
    with pytest.raises(ValueError, match="must be positive"):
        CpuSimBackend().total_memory(0, 1)


def _fake_worker(capacity_gib, utilization, weights_gib, activations_gib, explicit=None):
    runner = SimpleNamespace(weight_bytes=lambda: int(weights_gib * GiB),
                             activation_reserve_bytes=lambda: int(activations_gib * GiB))
    return SimpleNamespace(
        _should_warm_up_model=lambda: False, model_runner=runner,
        cache_config=SimpleNamespace(gpu_memory_utilization=utilization,
                                     kv_cache_memory_bytes=explicit),
        device_memory=int(capacity_gib * GiB), backend=CpuSimBackend(), local_rank=0,
    )


def test_kv_budget_is_a_fraction_of_device_memory_minus_weights_and_activations():
    from vllm_accel.worker.sim_worker import AccelSimWorker

    kv = AccelSimWorker.determine_available_memory(_fake_worker(48, 0.5, 1.0, 0.5))
    assert kv == int(24 * GiB) - int(1.0 * GiB) - int(0.5 * GiB)


def test_kv_budget_errors_name_the_fix():
    from vllm_accel.worker.sim_worker import AccelSimWorker

    with pytest.raises(ValueError, match="Raise --gpu-memory-utilization"):
        AccelSimWorker.determine_available_memory(_fake_worker(2, 0.3, 0.5, 0.2))
    with pytest.raises(ValueError, match="Lower --kv-cache-memory-bytes"):
        AccelSimWorker.determine_available_memory(_fake_worker(2, 0.9, 0.5, 0.1, explicit=2 * GiB))
    assert AccelSimWorker.determine_available_memory(
        _fake_worker(2, 0.9, 0.5, 0.1, explicit=GiB)) == GiB


def test_storage_ranges_merge_neighbours_and_skip_small_or_shared():
    import torch

    from vllm_accel.backends.cpu_sim.huge_pages import storage_ranges

    memory = bytearray(8 << 20)

    def at(offset: int, nbytes: int) -> torch.Tensor:  # its own storage over memory
        return torch.frombuffer(memory, dtype=torch.uint8, count=nbytes, offset=offset)

    mib = 1 << 20
    first = at(0, mib)
    near = at(mib + (32 << 10), mib)           # 32 KiB after first: merged with it
    far = at(2 * mib + (160 << 10), mib)       # 128 KiB after near: a range of its own
    small = at(6 * mib, 1024)                  # under 64 KiB, alone: skipped
    views = torch.zeros(4 * mib, dtype=torch.uint8)
    ranges = storage_ranges([first, near, far, small, views[:mib], views[2 * mib:],
                             torch.empty(8 << 20, device="meta")])

    def covering(t, nbytes):
        return [r for r in ranges if r[0] <= t.data_ptr() and t.data_ptr() + nbytes <= r[1]]

    assert covering(first, mib) and covering(first, mib) == covering(near, mib)
    assert covering(far, mib) and covering(far, mib) != covering(near, mib)
    assert not covering(small, 1024)
    assert covering(views, 4 * mib)  # two views: their whole storage, once
    assert len(ranges) <= 3  # the zeros may land next to memory and merge with it
    assert all(lo % 4096 == 0 and hi % 4096 == 0 and lo < hi for lo, hi in ranges)
    assert all(a[1] < b[0] for a, b in zip(ranges, ranges[1:]))  # sorted, disjoint


def _kernel_collapses_pages() -> bool:
    """Transparent huge pages and MADV_COLLAPSE (Linux >= 6.1) on this kernel."""
    release = tuple(int(v) for v in re.findall(r"\d+", os.uname().release)[:2])
    return os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") and release >= (6, 1)


def test_madvise_tries_again_on_eagain(monkeypatch):
    """MADV_COLLAPSE's EAGAIN (temporary contention) is retried; other errors are not."""
    import ctypes
    import errno

    from vllm_accel.backends.cpu_sim import huge_pages

    monkeypatch.setattr(huge_pages.time, "sleep", lambda s: None)

    class Libc:
        def __init__(self, errors):
            self.errors, self.calls = list(errors), 0

        def madvise(self, start, length, advice):
            self.calls += 1
            if not self.errors:
                return 0
            ctypes.set_errno(self.errors.pop(0))
            return -1

    libc = Libc([errno.EAGAIN, errno.EAGAIN])
    assert huge_pages._madvise(libc, 0, 4096, huge_pages.MADV_COLLAPSE) == 0
    assert libc.calls == 3
    libc = Libc([errno.EAGAIN] * 10)
    assert huge_pages._madvise(libc, 0, 4096, huge_pages.MADV_COLLAPSE) == errno.EAGAIN
    assert libc.calls == huge_pages.EAGAIN_RETRIES + 1
    libc = Libc([errno.EINVAL, errno.EAGAIN])
    assert huge_pages._madvise(libc, 0, 4096, huge_pages.MADV_COLLAPSE) == errno.EINVAL
    assert libc.calls == 1


def test_weights_move_to_huge_pages_in_place():
    """MADV_HUGEPAGE + MADV_COLLAPSE: every whole huge page inside the weights is one,
    by our smaps reading and by the kernel's own total, and the tensors keep address
    and values. A kernel that cannot collapse reports why and changes nothing."""
    import torch

    from engine_run import _huge_page_bytes
    from vllm_accel.backends.cpu_sim.huge_pages import HUGE_PAGE, back_with_huge_pages

    weights = [torch.randn(3072, 576).to(torch.bfloat16) for _ in range(4)]
    weights.append(torch.randn(49152, 576).to(torch.bfloat16))  # a mmap'd allocation
    before = [(w.data_ptr(), w.clone()) for w in weights]
    huge, problem = back_with_huge_pages(weights)
    for w, (ptr, values) in zip(weights, before):
        assert w.data_ptr() == ptr and torch.equal(w, values)
    if not _kernel_collapses_pages():
        assert problem, huge
        return
    assert problem is None, problem
    whole_pages = sum((w.data_ptr() + w.nbytes) // HUGE_PAGE - -(-w.data_ptr() // HUGE_PAGE)
                      for w in weights) * HUGE_PAGE
    assert whole_pages >= 40 << 20
    assert huge >= whole_pages
    assert _huge_page_bytes(None) >= whole_pages


@pytest.mark.parametrize("name", ["ACCEL_SIM_HUGE_PAGES", "ACCEL_SIM_WEIGHT_ARENA"])
def test_weight_placement_switches_are_clear_settings(monkeypatch, name):
    from vllm_accel import envs

    monkeypatch.delenv(name, raising=False)
    assert getattr(envs, name) is True
    monkeypatch.setenv(name, "off")
    assert getattr(envs, name) is False
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}.*use `on` or `off`"):
        getattr(envs, name)
