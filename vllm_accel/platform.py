"""The platform vLLM sees when vllm_accel is installed.

The simulated GCU subclasses vLLM's CPU platform: tensors live on ``cpu`` (the
only way to keep vLLM's CPU infrastructure -- gloo/SHM tensor parallel, OMP
binding, C++ fallbacks for Triton kernels -- working without a real device),
while ``device_name`` is ``gcu`` and the worker, attention backend, ops and
quant methods are ours. This module must not import ``vllm.model_executor`` or
``vllm.distributed`` at import time (circular import while vLLM resolves
``current_platform``).

Real cards (Enflame ``gcu``, Sophgo ``sophtpu``) keep this class (vLLM resolves
one platform class per process) but skip the CPU-only parts: CpuPlatform's
config pass (it asserts ``device_type == "cpu"`` and LD_PRELOADs CPU allocators),
host-RAM memory queries and the CPU communicator. Neither the platform module nor
the plugin entry point imports a vendor library; the worker does.
"""

import argparse
import contextlib
import os

from vllm_accel.logger import init_logger
from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import PlatformEnum

from vllm_accel import envs, patches
from vllm_accel.backends import get_backend
from vllm_accel.compat import check_vllm_version
from vllm_accel.preflight import (MULTI_NODE_TIMEOUT_S, StartupError, bound_multi_node_wait,
                                  host_ranks, ray_executor_cls)

logger = init_logger(__name__)

check_vllm_version()
patches.apply_all()

#: what ``--device`` accepts (the device names of the backends)
DEVICE_CHOICES = ("gcu", "sophtpu")
ATTENTION_BACKEND_CLS = "vllm_accel.ops.attention.AccelAttentionBackend"
MLA_BACKEND_CLS = "vllm_accel.ops.mla.AccelMLABackend"
#: default KV block size on every backend (vLLM-GCU uses 64 too)
DEFAULT_BLOCK_SIZE = 64


class _DeviceAction(argparse.Action):
    """Stores ``--device`` and exports it as ACCEL_DEVICE for spawned processes.

    ``AsyncEngineArgs.from_cli_args`` drops unknown flags, so the environment is
    how EngineCore and the workers learn it.
    """

    def __call__(self, parser, namespace, values, option_string=None):
        device = str(values).strip().lower()
        if device not in DEVICE_CHOICES:
            parser.error(
                f"argument --device: {values!r} is not a device vllm_accel serves; "
                f"choose one of: {', '.join(DEVICE_CHOICES)}. To run vLLM's own CPU "
                "backend instead, exclude this plugin with VLLM_PLUGINS."
            )
        backend = get_backend()
        if device != backend.device_name:
            parser.error(
                f"argument --device: {device!r} disagrees with the active vllm_accel "
                f"backend {backend.name!r}, which serves {backend.device_name!r}. "
                f"{_how_to_get(device)}"
            )
        os.environ["ACCEL_DEVICE"] = device
        setattr(namespace, self.dest, device)


def _how_to_get(device: str) -> str:
    if device == "sophtpu":
        return ("Install Sophgo's torch_tpu (and set ACCEL_BACKEND=sophtpu), or pass "
                "--device for the active backend.")
    return ("Install Enflame's torch_gcu 2.x for a real GCU, or use ACCEL_BACKEND=sim for "
            "the simulated GCU.")


_backend = get_backend()


@contextlib.contextmanager
def _keeping_mla_scheduling(vllm_config):
    """CpuPlatform turns chunked prefill and prefix caching off for MLA models and
    forces 16-token blocks (its MLA kernels' limits); ACCEL_MLA has neither limit
    (prefill by decompression reads any cached context), so the user's settings are
    put back."""
    model_config = vllm_config.model_config
    if model_config is None or not model_config.use_mla:
        yield
        return
    scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
    kept = (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens,
            cache.enable_prefix_caching, cache.block_size)
    yield
    (scheduler.enable_chunked_prefill, scheduler.max_num_batched_tokens,
     cache.enable_prefix_caching, cache.block_size) = kept
    logger.info_once("vllm_accel: MLA (%s) keeps chunked prefill %s and prefix caching %s",
                     MLA_BACKEND_CLS.rsplit(".", 1)[-1], kept[0], kept[2])


class AccelPlatform(CpuPlatform):
    # A card is not a CPU to vLLM: its CPU-only paths (oneDNN-packed linear
    # weights, CPU attention and ops) must not run on the card's tensors.
    _enum = PlatformEnum.OOT if _backend.is_real_card else PlatformEnum.CPU
    # vLLM torch.compiles small helpers (TP's vocab masking) with this backend;
    # inductor has no code generator for a card's device.
    simple_compile_backend: str = "eager" if _backend.is_real_card else CpuPlatform.simple_compile_backend
    # Identity and distributed settings come from the active device backend.
    # On a card vLLM builds torch devices and collective backend strings from
    # device_name ("<device_name>:<index>", "<device_name>:sccl"), so it must be
    # the torch device type (SG2260: "tpu"); `--device sophtpu` is checked
    # against the backend, not this.
    device_name: str = _backend.torch_device_type if _backend.is_real_card else _backend.device_name
    device_type: str = _backend.torch_device_type
    dist_backend: str = _backend.dist_backend
    device_control_env_var: str = _backend.visible_devices_env
    dispatch_key: str = _backend.dispatch_key
    # Ray detects none of our devices: they are its generic "GPU" slots, declared
    # by the cluster (worker/ray_executor.py), and Ray must not set CUDA's mask.
    ray_device_key: str = "GPU"
    ray_noset_device_env_vars: list[str] = ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def uses_host_device_handling(self) -> bool:
        # A real card's torch device type exists only after the vendor library is
        # imported, which only the worker does; leave DeviceConfig.device unset in
        # the API and EngineCore processes (the worker picks its own device).
        return get_backend().is_real_card

    @classmethod
    def set_device(cls, device) -> None:
        backend = get_backend()
        if not backend.is_real_card:
            return super().set_device(device)
        backend.set_device(device.index or 0)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        backend = get_backend()
        if not backend.is_real_card:
            return super().get_device_total_memory(device_id)
        return backend.total_memory(device_id, 1)

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        if not get_backend().is_real_card:
            return super().get_device_communicator_cls()
        # Plain torch.distributed collectives on the device group (eccl/sccl).
        return "vllm.distributed.device_communicators.base_device_communicator.DeviceCommunicatorBase"

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        get_backend().manual_seed_all(seed)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return f"{get_backend().name}:{cls.device_name}"

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        if parser is None or "--device" in parser._option_string_actions:
            return  # runs twice per `vllm serve`
        patches.apply_all("cli", parser=parser)
        parser.add_argument(
            "--device",
            action=_DeviceAction,
            default=None,
            metavar="{" + ",".join(DEVICE_CHOICES) + "}",
            help="Accelerator to serve on (added by vllm_accel); must match the "
            "active backend (ACCEL_BACKEND). `gcu`: an Enflame GCU via torch_gcu, or "
            "the simulated GCU on CPU when no vendor library is installed; `sophtpu`: "
            "a Sophgo SG2260 via Sophgo's torch_tpu.",
        )

    @classmethod
    def _lone_device_worker_in_engine_core(cls, vllm_config, backend, requested) -> None:
        """A lone simulated device whose worker takes every core
        (ACCEL_SIM_SHARE_SCHEDULER_CORE) runs that worker in EngineCore's process:
        vLLM's uniproc executor, as on a one-GPU host, which CpuPlatform turns into a
        worker process of its own (to set its OpenMP binding before it starts). With a
        process apart, EngineCore's scheduling, its wait for the reply and the
        hand-over of each step ran beside the worker's threads on the same two
        cores: batch-1 decode of a W4A16 Qwen3-MoE, 2-core Intel Xeon with AMX,
        40-47 tok/s, against 54-64 with the worker in EngineCore (64 in-process)."""
        from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV

        parallel_config = vllm_config.parallel_config
        if (requested not in (None, "uni") or parallel_config.world_size != 1
                or parallel_config.data_parallel_size != 1
                or backend.process_env(host_ranks(parallel_config)).get(
                    SHARED_SCHEDULER_CORES_ENV) != "1"):
            return
        parallel_config.distributed_executor_backend = "uni"
        logger.info_once("vllm_accel: the lone simulated %s runs its worker in EngineCore's "
                         "process, a thread on every core (ACCEL_SIM_SHARE_SCHEDULER_CORE=off "
                         "or --distributed-executor-backend mp: a worker process of its "
                         "own)", backend.device_name)

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        backend = get_backend()
        if envs.ACCEL_DEVICE != backend.device_name:
            raise StartupError(
                f"--device/ACCEL_DEVICE is {envs.ACCEL_DEVICE!r}, but the active "
                f"vllm_accel backend ({backend.name}) serves {backend.device_name!r}; "
                f"use --device {backend.device_name}."
            )
        from vllm_accel.ops.attention import check_kv_cache_dtype

        check_kv_cache_dtype(vllm_config.cache_config.cache_dtype)
        parallel_config = vllm_config.parallel_config
        if parallel_config.pipeline_parallel_size > 1:
            # vLLM 0.32's CPU path loses requests between pipeline stages (the
            # scheduler raises KeyError on the first step; stock CpuPlatform too).
            raise StartupError(
                f"pipeline_parallel_size={parallel_config.pipeline_parallel_size} is not "
                f"supported on the {backend.device_name} (vllm_accel); use "
                "--tensor-parallel-size to spread a model over several devices."
            )
        if parallel_config.distributed_executor_backend == "ray":
            parallel_config.distributed_executor_backend = ray_executor_cls()
        if bound_multi_node_wait(parallel_config):
            logger.info_once("--nnodes %d: a rank waits at most %d s for its peers "
                             "(--distributed-timeout-seconds to change it)",
                             parallel_config.nnodes, MULTI_NODE_TIMEOUT_S)
        cache_config = vllm_config.cache_config
        user_block_size = cache_config.user_specified_block_size
        cls._preflight(vllm_config, backend)
        requested_executor = parallel_config.distributed_executor_backend
        if backend.is_real_card:
            cls._check_and_update_card_config(vllm_config)
        else:
            with _keeping_mla_scheduling(vllm_config):
                super().check_and_update_config(vllm_config)
            cls._lone_device_worker_in_engine_core(vllm_config, backend, requested_executor)
        if vllm_config.lora_config is not None and not backend.is_real_card:
            logger.info_once("vllm_accel: LoRA runs eagerly on the %s (vLLM's CPU config "
                             "pass turns torch.compile off with LoRA)", backend.device_name)
        # CpuPlatform only fills worker_cls when it is "auto": set ours after it.
        vllm_config.parallel_config.worker_cls = backend.worker_cls
        patches.apply_all("config", env=backend.process_env(host_ranks(parallel_config)))
        if not user_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        logger.info_once("vllm_accel: device %s via %s; worker %s", backend.device_name,
                         backend.describe(), backend.worker_cls)

    @classmethod
    def _preflight(cls, vllm_config, backend) -> None:
        """Errors that name the file or setting, before any worker starts."""
        from vllm_accel import preflight

        model_config = vllm_config.model_config
        if model_config is None:
            return
        weights = preflight.check_weights(model_config.model, model_config.dtype.itemsize)
        preflight.check_state_space(model_config, backend.is_real_card, backend.device_name,
                                    vllm_config.speculative_config is not None)
        if backend.is_real_card:
            return  # a card's memory is known only in its worker (vendor library)
        parallel = vllm_config.parallel_config
        preflight.check_cores_for_ranks(parallel)
        if weights and model_config.quantization not in preflight.ONLINE_QUANTIZATION:
            preflight.check_fits(model_config.model, weights, parallel.tensor_parallel_size,
                                 backend.total_memory(0, preflight.host_ranks(parallel)),
                                 "ACCEL_SIM_DEVICE_MEMORY_GB")

    @classmethod
    def _check_and_update_card_config(cls, vllm_config) -> None:
        """The parts of CpuPlatform's config pass a real card needs, without its
        CPU-only ones (device_type assert, LD_PRELOAD of CPU allocators, OMP and
        inductor thread settings, host-RAM KV sizing)."""
        from vllm.config import CompilationMode

        patches.apply_all("card_config")
        vllm_config.scheduler_config.async_scheduling = False
        # Device graphs (GCUGraph/TPUGraph) are not wired up: run eagerly.
        compilation_config = vllm_config.compilation_config
        compilation_config.cudagraph_capture_sizes = []
        if compilation_config.mode != CompilationMode.NONE:
            logger.info_once("vllm_accel: %s runs eagerly (no torch.compile / device "
                             "graphs on real cards yet)", get_backend().device_name)
            compilation_config.mode = CompilationMode.NONE

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # ours on every backend: vLLM's CPU wrapper applies the last adapter slot to
        # requests without an adapter (ops/lora.py)
        return "vllm_accel.ops.lora.AccelPunicaWrapper"

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from vllm_accel.ops.attention import (
            BACKEND_NAME,
            SUPPORTED_ATTN_TYPES,
            reject_unsupported,
        )

        config = attn_selector_config
        reject_unsupported({
            "sparse attention": config.use_sparse,
            "non-causal attention": config.use_non_causal,
            f"{config.attn_type} attention": config.attn_type not in SUPPORTED_ATTN_TYPES,
        })
        if selected_backend is not None and selected_backend.name != BACKEND_NAME:
            logger.warning_once(
                "Attention backend %s is not available on %s; using %s.",
                selected_backend.name, get_backend().device_name, BACKEND_NAME,
            )
        return MLA_BACKEND_CLS if config.use_mla else ATTENTION_BACKEND_CLS
