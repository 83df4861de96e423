"""The simulated GCU's worker: vLLM's CPUWorker with the device's memory budget.

Stock vLLM CPU reads ``gpu_memory_utilization`` as a fraction of host RAM and
refuses to start when that much is not free. On a GCU it is a fraction of the
device's memory; the simulated GCU has its own capacity (capped by what the
host can give), so the budget below works like a card's.
"""

import os

import torch

from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node
from vllm.utils.mem_utils import format_gib
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from vllm_accel import envs
from vllm_accel.backends import get_backend
from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV
from vllm_accel.logger import init_logger
from vllm_accel.ops.triton.provider import TRITON, install_triton_kernels
from vllm_accel.preflight import StartupError
from vllm_accel.worker.common import AccelWorkerMixin
from vllm_accel.worker.sim_model_runner import AccelSimModelRunner

logger = init_logger(__name__)


class AccelSimWorker(AccelWorkerMixin, CPUWorker):
    def __init__(self, vllm_config, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False):
        self.backend = get_backend()
        self.backend.load()
        if envs.ACCEL_KERNEL_PROVIDER == TRITON:
            registered, status = install_triton_kernels(torch.device("cpu"))
            if not registered:
                raise StartupError(f"ACCEL_KERNEL_PROVIDER=triton: {status}.")
            logger.info("Kernel provider %s: %s", TRITON, status)
        # CPUWorker.__init__ checks host RAM against gpu_memory_utilization; our
        # budget is the device's, so bind host memory as it does and skip the check.
        cpu_node = get_allowed_cpu_list()[0].numa_node
        nodes = get_visible_memory_node()
        torch.ops._C.init_cpu_memory_env([cpu_node if cpu_node in nodes else nodes[0]])
        Worker.__init__(self, vllm_config, local_rank, rank, distributed_init_method,
                        is_driver_worker=is_driver_worker)
        self._claim_device(local_rank)

    def init_device(self) -> None:
        if self.parallel_config.use_ray:
            self._bind_cores_in_ray_actor()
        super().init_device()
        # CPUWorker.init_device builds vLLM's CPUModelRunner by name; replace it
        # with ours (the first one holds no model or KV cache yet).
        self.model_runner = AccelSimModelRunner(self.vllm_config, self.device)
        # (an in-process engine runs EngineCore in the worker's own thread: nothing shared)
        if (self.parallel_config.distributed_executor_backend == "mp"
                and os.environ.get(SHARED_SCHEDULER_CORES_ENV, "0") != "0"):
            logger.info("Worker threads: %d, one on EngineCore's core (EngineCore sleeps "
                        "while a step runs)", torch.get_num_threads())
        self._log_classes()

    def _bind_cores_in_ray_actor(self) -> None:
        """vLLM's multiprocessing executor binds each CPU worker to its cores with
        OpenMP variables set before it spawns the worker; Ray starts its actors
        itself. Apply the cores vLLM's rule gives this local rank here, before the
        worker's first parallel region creates the OpenMP threads (which inherit
        the process's affinity)."""
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        manager = OMPProcessManager(self.vllm_config)
        if manager.skip_setup:
            return
        cores = manager.cpu_lists[self.local_rank]
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))  # CPUWorker.init_device disables it after
        logger.info("Rank %d (Ray actor) bound to cores %s", self.rank, cores)

    def determine_available_memory(self) -> int:
        if self._should_warm_up_model():
            self.model_runner.warming_up_model()
        utilization = self.cache_config.gpu_memory_utilization
        budget = int(self.device_memory * utilization)
        weights = self.model_runner.weight_bytes()
        activations = self.model_runner.activation_reserve_bytes()
        explicit = self.cache_config.kv_cache_memory_bytes
        name = f"{self.backend.device_name}:{self.local_rank} ({self.backend.name})"
        if explicit is not None:
            kv_bytes = int(explicit)
            if kv_bytes + weights > self.device_memory:
                raise ValueError(
                    f"--kv-cache-memory-bytes={kv_bytes} plus {format_gib(weights)} GiB "
                    f"of weights exceeds the {format_gib(self.device_memory)} GiB of "
                    f"device {name}. Lower --kv-cache-memory-bytes (or "
                    "VLLM_CPU_KVCACHE_SPACE), or raise ACCEL_SIM_DEVICE_MEMORY_GB."
                )
        else:
            kv_bytes = budget - weights - activations
            if kv_bytes <= 0:
                raise ValueError(
                    f"No room for a KV cache on device {name}: "
                    f"{format_gib(self.device_memory)} GiB x gpu_memory_utilization "
                    f"{utilization} = {format_gib(budget)} GiB, but weights take "
                    f"{format_gib(weights)} GiB and activations "
                    f"{format_gib(activations)} GiB. Raise --gpu-memory-utilization "
                    "or ACCEL_SIM_DEVICE_MEMORY_GB, or lower --max-num-batched-tokens."
                )
        logger.info(
            "Device %s memory: capacity %s GiB, utilization %.2f -> budget %s GiB; "
            "weights %s GiB, activation reserve %s GiB, KV cache %s GiB%s.",
            name, format_gib(self.device_memory), utilization, format_gib(budget),
            format_gib(weights), format_gib(activations), format_gib(kv_bytes),
            " (explicit)" if explicit is not None else "",
        )
        return kv_bytes
