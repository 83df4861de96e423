"""AccelWorker: vLLM's CPUWorker with the device's memory budget.

Stock vLLM CPU reads ``gpu_memory_utilization`` as a fraction of host RAM and
refuses to start when that much is not free. On a GCU it is a fraction of the
device's memory; the simulated GCU has its own capacity (capped by what the
host can give), so the budget below works like a card's.

Real cards (``backend.is_real_card``): the vendor library is imported in
``__init__`` (before ``torch.distributed`` exists, so ``eccl``/``sccl`` are
registered), and none of the CPU worker's process-wide patches run --
``CPUWorker.init_device`` replaces ``torch.set_num_threads``, and vLLM's
``CPUModelRunner`` turns ``torch.accelerator.synchronize/empty_cache`` into no-ops
for good and swaps ``torch.cuda.Stream``/``torch.Event`` for placeholders while it
builds. Device selection, distributed init and memory accounting go through the
backend instead.
"""

import os

import torch

from vllm_accel.logger import init_logger
from vllm.utils.cpu_resource_utils import get_allowed_cpu_list, get_visible_memory_node
from vllm.utils.mem_utils import format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_accel.backends import get_backend
from vllm_accel.worker.model_runner import AccelCardModelRunner, AccelModelRunner

logger = init_logger(__name__)


class AccelWorker(CPUWorker):
    def __init__(self, vllm_config, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False):
        self.backend = get_backend()
        # The vendor library registers its collective backend at import: load it
        # before anything can initialize torch.distributed.
        self.backend.load()
        if self.backend.is_real_card:
            from vllm_accel.ops.vendor_kernels import install_vendor_kernels

            install_vendor_kernels(self.backend)
        else:
            # CPUWorker.__init__ checks host RAM against gpu_memory_utilization; our
            # budget is the device's, so bind host memory as it does and skip the check.
            cpu_node = get_allowed_cpu_list()[0].numa_node
            nodes = get_visible_memory_node()
            torch.ops._C.init_cpu_memory_env([cpu_node if cpu_node in nodes else nodes[0]])
        Worker.__init__(self, vllm_config, local_rank, rank, distributed_init_method,
                        is_driver_worker=is_driver_worker)
        self.parallel_config.disable_custom_all_reduce = True
        local_world_size = max(1, self.parallel_config.tensor_parallel_size
                               * self.parallel_config.pipeline_parallel_size)
        count = self.backend.device_count()
        if local_world_size > count:
            raise ValueError(
                f"{local_world_size} ranks need {local_world_size} {self.backend.device_name} "
                f"devices, but this host has {count} ({self.backend.name}"
                f"{_visibility_note(self.backend)}); lower --tensor-parallel-size."
            )
        self.local_world_size = local_world_size
        self.backend.set_device(local_rank)
        self.device_memory = self.backend.total_memory(local_rank, local_world_size)

    def init_device(self) -> None:
        if self.backend.is_real_card:
            self._init_card_device()
            self.model_runner = AccelCardModelRunner(self.vllm_config, self.device)
            return
        super().init_device()
        # CPUWorker.init_device builds vLLM's CPUModelRunner by name; replace it
        # with ours (the first one holds no model or KV cache yet).
        self.model_runner = AccelModelRunner(self.vllm_config, self.device)

    def _init_card_device(self) -> None:
        """Select the card and join the process group -- no CPU-worker patches."""
        backend = self.backend
        self.device = backend.torch_device(self.local_rank)
        backend.set_device(self.local_rank)
        backend.empty_cache()
        init_method = self.distributed_init_method
        os.environ["VLLM_DIST_IDENT"] = (
            os.path.basename(init_method.removeprefix("file://"))
            if init_method.startswith("file://") else init_method.split(":")[-1]
        )
        with backend.distributed_init(self.rank, self.local_rank,
                                      self.parallel_config.world_size):
            init_worker_distributed_environment(
                self.vllm_config, self.rank, init_method, self.local_rank,
                backend.dist_backend,
            )
        set_random_seed(self.model_config.seed)
        backend.manual_seed_all(self.model_config.seed)

    def determine_available_memory(self) -> int:
        if self.backend.is_real_card:
            return self.model_runner.plan_kv_cache_bytes(self.device_memory, self.local_rank)
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

    def compile_or_warm_up_model(self) -> CompilationTimes:
        if not self.backend.is_real_card:
            return super().compile_or_warm_up_model()
        # Cards run eagerly (no graphs to capture); reset the seed like vLLM does
        # after profiling.
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        self.backend.manual_seed_all(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        logger.info(
            "Device %s:%d KV cache: %d blocks x %d tokens = %d tokens.",
            self.backend.device_name, self.local_rank, kv_cache_config.num_blocks,
            self.cache_config.block_size,
            kv_cache_config.num_blocks * self.cache_config.block_size,
        )


def _visibility_note(backend) -> str:
    var = backend.visible_devices_env
    if backend.is_real_card and var in os.environ:
        return f", {var}={os.environ[var]!r}"
    return ""
