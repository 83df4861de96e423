"""vLLM's Ray executor (RayExecutorV2) with this host's devices declared to Ray.

Ray detects NVIDIA/AMD/Intel GPUs, TPUs, Ascend NPUs and a few others, but not an
Enflame GCU, a Sophgo SG2260 or the simulated GCU. The platform places its devices
under Ray's generic ``GPU`` resource (``ray_device_key``, as the vendors' vLLM
forks do), so a Ray cluster must declare them (``ray start --num-gpus N``). Left
alone, vLLM starts a local Ray instance with what Ray detected (no GPU) and its
placement group waits 30 minutes for devices that never come. This executor starts
that local instance with the engine's devices declared, and refuses a cluster with
too few device slots at once, naming the fix.
"""

from vllm.v1.executor.ray_executor_v2 import RayExecutorV2

from vllm_accel.logger import init_logger
from vllm_accel.preflight import StartupError

logger = init_logger(__name__)

#: the Ray resource that stands for one device (AccelPlatform.ray_device_key)
RAY_DEVICE_RESOURCE = "GPU"


class AccelRayExecutor(RayExecutorV2):
    def _init_executor(self) -> None:
        import ray

        needed = self.parallel_config.world_size
        if not ray.is_initialized():
            runtime_env = self.parallel_config.ray_runtime_env
            try:  # RAY_ADDRESS, or a cluster `ray start` left on this host
                ray.init(address="auto", runtime_env=runtime_env)
            except ConnectionError:
                logger.info("No running Ray cluster: starting a local Ray instance with "
                            "this engine's %d devices as Ray %s slots", needed,
                            RAY_DEVICE_RESOURCE)
                ray.init(num_gpus=needed, runtime_env=runtime_env)
        slots = ray.cluster_resources().get(RAY_DEVICE_RESOURCE, 0)
        if slots < needed:
            raise StartupError(
                f"The Ray cluster declares {slots:g} device slots (Ray resource "
                f"{RAY_DEVICE_RESOURCE!r}) but this engine needs {needed} "
                "(tensor x pipeline parallel size). Ray cannot detect these devices: "
                "start each node with its count, e.g. `ray start --head "
                f"--num-gpus {needed}` here, or run without a Ray cluster and vllm_accel "
                "starts a local one."
            )
        super()._init_executor()
