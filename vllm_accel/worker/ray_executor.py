"""vLLM's Ray executor (RayExecutorV2) with this host's devices declared to Ray.

Ray detects NVIDIA/AMD/Intel GPUs, TPUs, Ascend NPUs and a few others, but not an
Enflame GCU, a Sophgo SG2260 or the simulated GCU. The platform places its devices
under Ray's generic ``GPU`` resource (``ray_device_key``, as the vendors' vLLM
forks do), so a Ray cluster must declare them (``ray start --num-gpus N``). Left
alone, vLLM starts a local Ray instance with what Ray detected (no GPU) and its
placement group waits 30 minutes for devices that never come. This executor starts
that local instance with the engine's devices declared, and refuses a cluster with
too few device slots at once, naming the fix.

It also stops its actors before Ray's own exit hook. Ray registers ``ray.shutdown``
with atexit when it is imported, which is after vLLM's engine finalizers registered
theirs, so an engine still referenced at exit (a script's top-level ``llm`` with
in-process EngineCore) found Ray gone: ``ray.kill`` started a second local Ray
instance, and the executor's monitor thread, still inside ``ray.wait``, could crash
the interpreter (SIGSEGV at exit).
"""

import atexit
import weakref

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
        # registered after `import ray`, so it runs before Ray's shutdown (atexit is LIFO)
        atexit.register(_shutdown_if_alive, weakref.ref(self))


def _shutdown_if_alive(executor_ref: "weakref.ref[AccelRayExecutor]") -> None:
    executor = executor_ref()
    if executor is not None:
        executor.shutdown()  # idempotent: a no-op if the engine already shut it down
