"""What the simulator worker and the card worker share: claiming the device
(count check, selection, memory) and the KV-cache log line."""

import os

from vllm_accel.logger import init_logger
from vllm_accel.preflight import host_ranks

logger = init_logger(__name__)


class AccelWorkerMixin:
    """Mixed into both workers (before vLLM's worker class in the bases)."""

    def _claim_device(self, local_rank: int) -> None:
        """After vLLM's worker __init__: check that this host has a device for each
        of its ranks (else an error naming the fix), select this rank's, and read
        its memory."""
        parallel = self.parallel_config
        parallel.disable_custom_all_reduce = True
        local_world_size = max(1, parallel.local_world_size)  # this node's share
        count = self.backend.device_count()
        if local_world_size > count:
            var = self.backend.visible_devices_env
            visibility = f", {var}={os.environ[var]!r}" if var in os.environ else ""
            raise ValueError(
                f"{local_world_size} ranks need {local_world_size} {self.backend.device_name} "
                f"devices, but this host has {count} ({self.backend.name}{visibility}); "
                "lower --tensor-parallel-size."
            )
        self.local_world_size = local_world_size
        self.backend.set_device(local_rank)
        # simulated devices share the host's RAM with every DP engine's ranks here
        self.device_memory = self.backend.total_memory(local_rank, host_ranks(parallel))

    def _log_classes(self) -> None:
        """Which worker and model runner serve this rank (both differ per backend)."""
        logger.info("Rank %d on %s: worker %s.%s, model runner %s.%s", self.rank, self.device,
                    type(self).__module__, type(self).__qualname__,
                    type(self.model_runner).__module__, type(self.model_runner).__qualname__)

    def initialize_from_config(self, kv_cache_config) -> None:
        super().initialize_from_config(kv_cache_config)
        logger.info(
            "Device %s:%d KV cache: %d blocks x %d tokens = %d tokens.",
            self.backend.device_name, self.local_rank, kv_cache_config.num_blocks,
            self.cache_config.block_size,
            kv_cache_config.num_blocks * self.cache_config.block_size,
        )
