"""Simulated Enflame GCU: CPU kernels (C++, then torch) behind the real-card protocol.

Device memory is simulated: a configurable capacity (48 GiB like an S60 by
default) that drives KV-cache sizing exactly as a card's memory would, capped
by what this host can actually give, because every simulated byte is host RAM.
"""

import contextlib
import os

import psutil
import torch

from vllm_accel import envs
from vllm_accel.envs import GiB


#: How many of vLLM's reserved EngineCore cores the worker may also run on
#: (``process_env``; the API process sets it for its children). The platform then runs
#: the worker in EngineCore's process; a worker process of its own (an explicit ``mp``
#: executor) logs it, and EngineCore sleeps while it waits for it (patches.py).
SHARED_SCHEDULER_CORES_ENV = "_ACCEL_SIM_SHARED_SCHEDULER_CORES"


def _numa_nodes() -> list[int]:
    """NUMA nodes this process may allocate on (what vLLM's CPU binding counts)."""
    from vllm.utils.cpu_resource_utils import get_memory_affinity

    return list(get_memory_affinity())


class CpuSimBackend:
    name = "sim"
    device_name = "gcu"
    torch_device_type = "cpu"
    dist_backend = "gloo"
    visible_devices_env = "CPU_VISIBLE_MEMORY_NODES"
    # C++ attention built for this CPU, then batched torch CPU kernels; each
    # falls back to the next per call, `reference` fills in whatever they lack.
    kernel_providers = ("cpu_native", "torch_fast")
    is_real_card = False
    worker_cls = "vllm_accel.worker.sim_worker.AccelSimWorker"
    dispatch_key = "CPU"

    def load(self) -> None:
        """No vendor library to import."""

    def process_env(self, local_world_size: int) -> dict[str, str]:
        """Environment defaults for the processes that run the device.

        A card's caching allocator reuses freed device memory. The simulator's
        "device memory" is glibc's heap, which by default hands every allocation
        over a few MiB straight back to the kernel and page-faults it in again on
        the next step (measured: 7.5 ms instead of 0.6 ms to gather one decode
        batch's K/V). Keeping up to 32 MiB blocks on the heap and not trimming it
        gives the simulated device the same reuse.

        Tensor parallel: each simulated device is one worker process with its own
        share of the host's cores. vLLM's CPU path binds one NUMA node per local
        rank and refuses more ranks than nodes; on a host with fewer nodes its
        ``VLLM_CPU_SIM_MULTI_NUMA`` mode splits the cores evenly instead.

        One device on the host (``ACCEL_SIM_SHARE_SCHEDULER_CORE``): vLLM keeps one
        core for EngineCore, which on a 2-core host is half the machine spent waiting
        for the worker. The worker runs in EngineCore's process on every core instead
        (platform.py); a worker process of its own (an explicit ``mp`` executor) is
        bound to every core, and EngineCore sleeps while it waits (patches.py,
        "EngineCore sleeps ...").
        """
        env = {
            "MALLOC_MMAP_THRESHOLD_": str(32 << 20),
            "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
            "MALLOC_TOP_PAD_": str(256 << 20),
        }
        # (only for vLLM's automatic binding: it asserts so for explicit core lists)
        auto_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") == "auto"
        if auto_bind and local_world_size > 1 and local_world_size > len(_numa_nodes()):
            env["VLLM_CPU_SIM_MULTI_NUMA"] = "1"
        # vLLM reserves local_world_size cores (here 1) for EngineCore, unless the
        # host has no more cores than that. A reservation exported beside this
        # decision's marker is ours (an earlier engine's config pass in this process,
        # or a parent's), not the user's.
        user_reserved = ("VLLM_CPU_NUM_OF_RESERVED_CPU" in os.environ
                         and os.environ.get(SHARED_SCHEDULER_CORES_ENV) != "1")
        if (auto_bind and local_world_size == 1 and envs.ACCEL_SIM_SHARE_SCHEDULER_CORE
                and not user_reserved and len(os.sched_getaffinity(0)) > 1):
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
            env[SHARED_SCHEDULER_CORES_ENV] = "1"
        return env

    def describe(self) -> str:
        return (
            "simulated GCU (no torch_gcu found): vllm_accel's attention, ops and "
            "quant kernels run on torch CPU kernels"
        )

    def device_count(self) -> int:
        # One simulated device per tensor-parallel rank; the simulator has no
        # hard limit, the host's cores are the practical one.
        return max(1, psutil.cpu_count(logical=False) or 1)

    def set_device(self, local_rank: int) -> None:
        """Nothing to select: every simulated device is host memory."""

    def synchronize(self) -> None:
        """CPU kernels are synchronous."""

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def host_memory_cap(self, local_world_size: int) -> int:
        """What one rank's simulated device may take from this host's free RAM."""
        available = psutil.virtual_memory().available
        return int(available * envs.ACCEL_SIM_HOST_MEMORY_FRACTION / max(1, local_world_size))

    def total_memory(self, local_rank: int, local_world_size: int) -> int:
        configured = int(envs.ACCEL_SIM_DEVICE_MEMORY_GB * GiB)
        if configured <= 0:
            raise ValueError(
                "ACCEL_SIM_DEVICE_MEMORY_GB must be positive (it is the simulated "
                f"GCU's memory in GiB); got {envs.ACCEL_SIM_DEVICE_MEMORY_GB}."
            )
        return min(configured, self.host_memory_cap(local_world_size))

    def profiler(self) -> contextlib.AbstractContextManager:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])

    def memory_allocated(self) -> int:
        # Simulated device memory is host RSS; the model runner measures it.
        return psutil.Process().memory_info().rss

    def empty_cache(self) -> None:
        """glibc's heap keeps freed blocks by design (see process_env)."""

    def distributed_init(self, rank: int, local_rank: int, world_size: int):
        """gloo needs nothing beyond vLLM's own init."""
        return contextlib.nullcontext()

    def op(self, qualname: str):
        """The simulator has no vendor kernels."""
        return None
