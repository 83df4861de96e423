"""Simulated device memory: capacity, host cap, and the worker's KV budget."""

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
