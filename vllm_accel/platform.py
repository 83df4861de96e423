"""The platform vLLM sees when vllm_accel is installed.

The simulated GCU subclasses vLLM's CPU platform: tensors live on ``cpu`` (the
only way to keep vLLM's CPU infrastructure -- gloo/SHM tensor parallel, OMP
binding, C++ fallbacks for Triton kernels -- working without a real device),
while ``device_name`` is ``gcu`` and the worker, attention backend, ops and
quant methods are ours. This module must not import ``vllm.model_executor`` or
``vllm.distributed`` at import time (circular import while vLLM resolves
``current_platform``).
"""

import argparse
import os

from vllm_accel.logger import init_logger
from vllm.platforms.cpu import CpuPlatform

from vllm_accel import envs, patches
from vllm_accel.backends import get_backend
from vllm_accel.compat import check_vllm_version

logger = init_logger(__name__)

check_vllm_version()
patches.apply_all()
# Model Runner V1 is what vLLM picks without triton-cpu; pin it so the API
# process, EngineCore and workers agree even if triton-cpu appears later.
os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")

#: what ``--device`` accepts
DEVICE_CHOICES = ("gcu",)
WORKER_CLS = "vllm_accel.worker.AccelWorker"
ATTENTION_BACKEND_CLS = "vllm_accel.ops.attention.AccelAttentionBackend"
#: default KV block size on the GCU (as vLLM-GCU uses)
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
        os.environ["ACCEL_DEVICE"] = device
        setattr(namespace, self.dest, device)


_backend = get_backend()


def _accept_kv_cache_dtype_aliases(action) -> None:
    """Let ``--kv-cache-dtype int8`` through vLLM's choices as int8_per_token_head
    (argparse checks ``choices`` after ``type`` converts the value)."""
    if action is None:
        return
    convert = action.type or str

    def kv_cache_dtype(value: str) -> str:
        return convert(patches.KV_CACHE_DTYPE_ALIASES.get(value, value))

    action.type = kv_cache_dtype
    action.help = (action.help or "") + " vllm_accel also accepts `int8` (= int8_per_token_head)."


class AccelPlatform(CpuPlatform):
    # Identity and distributed settings come from the active device backend.
    device_name: str = _backend.device_name
    device_type: str = _backend.torch_device_type
    dist_backend: str = _backend.dist_backend
    device_control_env_var: str = _backend.visible_devices_env

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
        _accept_kv_cache_dtype_aliases(parser._option_string_actions.get("--kv-cache-dtype"))
        parser.add_argument(
            "--device",
            action=_DeviceAction,
            default=None,
            metavar="{" + ",".join(DEVICE_CHOICES) + "}",
            help="Accelerator to serve on (added by vllm_accel). `gcu` uses the "
            "Enflame GCU, or the simulated GCU on CPU when torch_gcu is absent.",
        )

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        backend = get_backend()
        if envs.ACCEL_DEVICE != backend.device_name:
            raise ValueError(
                f"--device/ACCEL_DEVICE is {envs.ACCEL_DEVICE!r}, but the active "
                f"vllm_accel backend ({backend.name}) serves {backend.device_name!r}; "
                f"use --device {backend.device_name}."
            )
        cache_config = vllm_config.cache_config
        user_block_size = cache_config.user_specified_block_size
        super().check_and_update_config(vllm_config)
        # CpuPlatform only fills worker_cls when it is "auto": set ours after it.
        vllm_config.parallel_config.worker_cls = WORKER_CLS
        # Inherited by the EngineCore and worker processes spawned after this;
        # a value the user exported wins.
        for name, value in backend.process_env().items():
            os.environ.setdefault(name, value)
        if not user_block_size:
            cache_config.block_size = DEFAULT_BLOCK_SIZE
        logger.info_once("vllm_accel: device %s via %s", cls.device_name, backend.describe())

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None) -> str:
        from vllm_accel.ops.attention import reject_unsupported

        config = attn_selector_config
        reject_unsupported({
            "MLA": config.use_mla,
            "sparse attention": config.use_sparse,
            "attention sinks": config.has_sink,
            "sliding-window attention": config.has_sliding_window,
            "non-causal attention": config.use_non_causal,
            f"{config.attn_type} attention": config.attn_type != "decoder",
        })
        if selected_backend is not None and selected_backend.name != "GCU_ATTN":
            logger.warning_once(
                "Attention backend %s is not available on the GCU; using GCU_ATTN.",
                selected_backend.name,
            )
        return ATTENTION_BACKEND_CLS
