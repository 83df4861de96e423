"""A vendor card's worker: vLLM's GPU Worker with device selection, distributed
init and memory accounting through the backend.

The vendor library is imported in ``__init__``, before ``torch.distributed``
exists, so ``eccl``/``sccl`` are registered. Nothing of vLLM's CPU worker runs:
``CPUWorker.init_device`` replaces ``torch.set_num_threads``, and vLLM's
``CPUModelRunner`` turns ``torch.accelerator.synchronize/empty_cache`` into no-ops
for good and swaps ``torch.cuda.Stream``/``torch.Event`` for placeholders while it
builds -- on a card those would silently break the vendor runtime.
"""

import contextlib

import torch
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes

from vllm_accel import patches
from vllm_accel.backends import get_backend
from vllm_accel.ops.vendor.kernels import install_vendor_kernels
from vllm_accel.worker.card_model_runner import AccelCardModelRunner
from vllm_accel.worker.common import AccelWorkerMixin


@contextlib.contextmanager
def _must_fit(worker, what: str):
    """The device running out of memory while the engine starts is a setup
    error: say what did not fit and the fix."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        free, total = worker.backend.mem_get_info()
        raise RuntimeError(
            f"{what} of {worker.model_config.model} do not fit device {worker.device} "
            f"({total / 2**30:.2f} GiB, {free / 2**30:.2f} GiB free): "
            f"{str(e).splitlines()[0]}. Fix: spread the model over more devices "
            "(--tensor-parallel-size), serve a quantized checkpoint, lower "
            "--max-num-batched-tokens, or use a device with more memory (on the virtual "
            "GCU: ACCEL_SIM_DEVICE_MEMORY_GB); --gpu-memory-utilization sizes only the "
            "KV cache, after these."
        ) from e


class AccelCardWorker(AccelWorkerMixin, Worker):
    def __init__(self, vllm_config, local_rank: int, rank: int,
                 distributed_init_method: str, is_driver_worker: bool = False):
        self.backend = get_backend()
        # The vendor library registers its collective backend at import: load it
        # before anything can initialize torch.distributed.
        self.backend.load()
        install_vendor_kernels(self.backend)
        super().__init__(vllm_config, local_rank, rank, distributed_init_method,
                         is_driver_worker=is_driver_worker)
        self._claim_device(local_rank)

    def init_device(self) -> None:
        """Select the card and join the process group."""
        backend = self.backend
        self.device = backend.torch_device(self.local_rank)
        # The API and EngineCore processes leave DeviceConfig.device unset (the
        # device type exists only once the vendor library is loaded, here).
        self.vllm_config.device_config.device = self.device
        backend.set_device(self.local_rank)
        backend.empty_cache()
        init_method = self.distributed_init_method
        patches.apply_all("card_worker", init_method=init_method)
        with backend.distributed_init(self.rank, self.local_rank,
                                      self.parallel_config.world_size):
            init_worker_distributed_environment(
                self.vllm_config, self.rank, init_method, self.local_rank,
                backend.dist_backend,
            )
        set_random_seed(self.model_config.seed)
        backend.manual_seed_all(self.model_config.seed)
        with _must_fit(self, "The runner's input buffers"):
            self.model_runner = AccelCardModelRunner(self.vllm_config, self.device)
        self._log_classes()

    def load_model(self, *args, **kwargs) -> None:
        with _must_fit(self, "The weights"):
            super().load_model(*args, **kwargs)

    def _maybe_get_memory_pool_context(self, tag: str):
        """No sleep-mode memory pool: that is CUDA's (and XPU's) cumem allocator;
        the platform reports sleep mode unavailable."""
        return contextlib.nullcontext()

    def determine_available_memory(self) -> int:
        with _must_fit(self, "The activations of the largest step"):
            return self.model_runner.plan_kv_cache_bytes(self.device_memory, self.local_rank)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Cards run eagerly (no graphs to capture); reset the seed like vLLM does
        # after profiling.
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        self.backend.manual_seed_all(self.model_config.seed)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )
