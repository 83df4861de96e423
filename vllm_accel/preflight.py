"""Checks before any engine process starts, so the last line a user reads names
the file, path or setting and the fix (vLLM would fail later, in a worker, with
"Engine core initialization failed. See root cause above" or a bare
AssertionError, or mistake a missing local path for a malformed repo id).
"""

import json
import os
import struct
import sys
from pathlib import Path

import torch


class StartupError(ValueError):
    """A configuration the plugin refuses before any worker starts. The platform
    raises it inside vLLM's pydantic config validation; the engine-args patch
    re-raises it unwrapped so it is the last line the user reads."""


#: bytes per element of safetensors' dtype names
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4,
                      "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                      "F8_E4M3": 1, "F8_E5M2": 1}
_FLOATS = {"F64", "F32", "F16", "BF16"}
#: quantization made at load (quant/w8a16.py): the checkpoint overstates the weights
ONLINE_QUANTIZATION = frozenset({"w8a16"})


def _looks_like_a_path(model: str) -> bool:
    """A Hugging Face repo id is ``name`` or ``org/name``; anything absolute,
    relative to here or home, or deeper is a local path."""
    return (model.startswith(("/", "./", "../", "~")) or model in (".", "..")
            or model.count("/") > 1)


def check_model_path(model: str) -> None:
    if _looks_like_a_path(model) and not Path(model).expanduser().exists():
        raise StartupError(
            f"Model path {model!r} does not exist. Pass an existing local model "
            "directory (config.json + weights), or a Hugging Face repo id "
            "('org/name'); `make setup` converts the default model to "
            "~/.cache/vllm-accel/models/SmolLM2-135M-Instruct.")


def _safetensors_header(path: Path) -> dict:
    """The header of ``path``; a clear error if the file is cut short."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StartupError(f"{path} is truncated ({size} bytes, not even a safetensors "
                             "header): re-download or re-convert the checkpoint.")
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            raise StartupError(f"{path} is truncated: its header alone needs {8 + length} "
                             f"bytes, the file has {size}. Re-download or re-convert the "
                             "checkpoint.")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            raise StartupError(f"{path} is corrupt (its safetensors header is not JSON): "
                             "re-download or re-convert the checkpoint.") from None
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    need = 8 + length + max((v["data_offsets"][1] for v in tensors.values()), default=0)
    if need > size:
        raise StartupError(f"{path} is truncated: its tensors need {need} bytes, the file "
                         f"has {size}. Re-download or re-convert the checkpoint.")
    return tensors


def check_weights(model: str, dtype_bytes: int) -> int:
    """Validate every ``*.safetensors`` file of a local model directory; the
    bytes its weights take with floating-point tensors stored at
    ``dtype_bytes`` per element (0 when there is no local safetensors file)."""
    root = Path(model).expanduser()
    if not root.is_dir():
        return 0
    total = 0
    for path in sorted(root.glob("*.safetensors")):
        for info in _safetensors_header(path).values():
            count = 1
            for dim in info["shape"]:
                count *= dim
            dtype = info["dtype"]
            per = dtype_bytes if dtype in _FLOATS else _SAFETENSORS_BYTES.get(dtype, 1)
            total += count * per
    return total


def check_fits(model: str, weight_bytes: int, ranks: int, capacity: int,
               capacity_hint: str) -> None:
    """Weights split over ``ranks`` devices of ``capacity`` bytes each must fit."""
    per_rank = weight_bytes / max(1, ranks)
    if per_rank > capacity:
        gib = 1 << 30
        raise StartupError(
            f"The weights of {model} take about {per_rank / gib:.3f} GiB per device "
            f"({weight_bytes / gib:.3f} GiB over {ranks} rank(s)), more than the "
            f"{capacity / gib:.3f} GiB each device has. Raise {capacity_hint}, spread "
            "the model with --tensor-parallel-size, or serve a quantized checkpoint.")


#: seconds a rank of a multi-node run waits for its peers (rendezvous and each
#: collective) unless --distributed-timeout-seconds says otherwise: torch's default
#: is 30 minutes, which a user reads as a hang when a peer never comes up
def ray_executor_cls() -> type:
    """The executor for ``--distributed-executor-backend ray``: vLLM's Ray executor
    V2 with our devices declared to Ray (worker/ray_executor.py). A missing ray
    package and vLLM's older Ray executor (not wired here) are refused up front."""
    import importlib.util

    import vllm.envs

    if importlib.util.find_spec("ray") is None:
        raise StartupError("--distributed-executor-backend ray needs the ray package: "
                           "pip install 'vllm-accel[ray]'.")
    if not vllm.envs.VLLM_USE_RAY_V2_EXECUTOR_BACKEND:
        raise StartupError("VLLM_USE_RAY_V2_EXECUTOR_BACKEND=0 selects vLLM's older Ray "
                           "executor, which vllm_accel does not support; unset it.")
    from vllm_accel.worker.ray_executor import AccelRayExecutor

    return AccelRayExecutor


MULTI_NODE_TIMEOUT_S = 300


def bound_multi_node_wait(parallel_config) -> bool:
    """Give a multi-node run (``--nnodes`` > 1) a finite wait for missing peers;
    whether it set one (an explicit --distributed-timeout-seconds wins)."""
    if parallel_config.nnodes <= 1 or parallel_config.distributed_timeout_seconds is not None:
        return False
    parallel_config.distributed_timeout_seconds = MULTI_NODE_TIMEOUT_S
    return True


def host_ranks(parallel_config) -> int:
    """Device processes on this host: the local tensor/pipeline ranks of every data
    parallel engine here. vLLM's CPU core binding counts them the same way (its
    API-process count stands for the local DP engines: a non-MoE DP engine's own
    config says data_parallel_size=1)."""
    return parallel_config.local_world_size * max(1, parallel_config._api_process_count)


def check_cores_for_ranks(parallel_config) -> None:
    """Each simulated GCU is a worker process bound to its own CPU cores (vLLM's
    CPU binding, ``VLLM_CPU_OMP_THREADS_BIND=auto``): more ranks than usable cores
    would die later on a bare AssertionError inside vLLM; say so first."""
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto":
        return  # explicit core lists (or nobind): vLLM checks those itself
    ranks = host_ranks(parallel_config)
    cores = len(os.sched_getaffinity(0))
    if ranks > cores:
        raise StartupError(
            f"{ranks} simulated GCU ranks were asked for (--tensor-parallel-size "
            f"{parallel_config.tensor_parallel_size}, --data-parallel-size "
            f"{parallel_config.data_parallel_size}), but this process may use "
            f"{cores} CPU core(s) and each rank needs at least one. Lower "
            f"--tensor-parallel-size to {cores} or fewer, or run on more cores.")


#: vLLM's modules of recurrent layers -> what a message calls them, first match wins
_RECURRENT_LAYER_MODULES = {
    "vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn": "Gated DeltaNet",
    "vllm.model_executor.layers.mamba.mamba_mixer2": "Mamba2",
    "vllm.model_executor.layers.mamba.mamba_mixer": "Mamba",  # v1
}
#: the kinds the card path serves (ops/state_space.py)
CARD_RECURRENT_KINDS = frozenset({"Gated DeltaNet", "Mamba2"})


def _modules_of_classes(module_name: str) -> set[str]:
    """The modules of the classes ``module_name`` holds (what it imports or defines)."""
    return {getattr(obj, "__module__", "") for obj in vars(sys.modules[module_name]).values()
            if isinstance(obj, type)}


def recurrent_layer_kind(model_cls: type) -> str:
    """What a hybrid or attention-free model's recurrent-state layers are: ``"Gated
    DeltaNet"`` (Qwen's), ``"Mamba2"``, ``"Mamba"``, else ``"linear-attention /
    short-convolution"``. Read from the layer classes vLLM's model module uses, else from
    those of the model modules it imports (MiniCPM-V 4.6 builds Qwen3.5's language
    model), not from the config: HF configs call Mamba2 layers "linear_attention" too."""
    used = _modules_of_classes(model_cls.__module__)
    for scope in (used, set().union(*(_modules_of_classes(m) for m in used
                                      if m.startswith("vllm.model_executor.models.")))):
        kind = next((kind for module, kind in _RECURRENT_LAYER_MODULES.items()
                     if module in scope), None)
        if kind is not None:
            return kind
    return "linear-attention / short-convolution"


def recurrent_layers(model_config) -> str | None:
    """:func:`recurrent_layer_kind` of the model, or None for attention-only models."""
    if not (model_config.is_hybrid or model_config.has_inner_state):
        return None
    model_cls, _ = model_config.registry.resolve_model_cls(model_config.architecture,
                                                           model_config=model_config)
    return recurrent_layer_kind(model_cls)


def check_state_space(model_config, on_card: bool, device_name: str,
                      speculative: bool = False) -> None:
    """State-space and linear-attention layers run vLLM's own CPU kernels
    (``layers/mamba/ops/cpu``) beside the plugin's attention and MoE: say at startup
    where those kernels cannot run, instead of a Triton or assertion error in a worker."""
    kind = recurrent_layers(model_config)
    if kind is None:
        return
    if kind == "Mamba":
        raise StartupError(
            f"{model_config.architecture} has Mamba (selective-scan) layers; vLLM 0.32's "
            "CPU build has no selective_scan_fwd kernel (stock vLLM CPU fails on them "
            "too); it is not served. Mamba2-based models (Granite 4.0-H, Nemotron-H, "
            "Falcon-H1) are served.")
    if on_card and kind not in CARD_RECURRENT_KINDS:
        raise StartupError(
            f"{model_config.architecture} has {kind} layers, which the {device_name} "
            "card path does not run yet (vLLM's kernels for them are Triton or CPU "
            "only). Serve it on the simulated gcu (ACCEL_BACKEND=sim).")
    if speculative:
        # Measured: a tiny Granite 4.0-H in float32 with n-gram speculation gives other
        # tokens than plain greedy decoding from the second on (stock vLLM CPU too);
        # with prefix caching vLLM's state copy is a Triton kernel (no CPU or card one).
        raise StartupError(
            f"{model_config.architecture} has {kind} layers: speculative decoding with "
            "them is not served (vLLM 0.32's CPU state-space path does not reproduce "
            "plain decoding under speculation; stock vLLM CPU neither). Serve without "
            "--speculative-config.")
    if not on_card and kind == "Gated DeltaNet" and model_config.dtype != torch.bfloat16:
        raise StartupError(
            f"{model_config.architecture} has Gated DeltaNet layers, which vLLM's CPU "
            f"kernel runs in bfloat16 only (--dtype is {model_config.dtype}); use "
            "--dtype bfloat16.")
