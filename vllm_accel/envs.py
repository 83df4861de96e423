"""Every environment variable vllm_accel reads, in one place.

Values are read lazily (on attribute access), so a variable set after import -- by
``--device`` in the API process, or inherited by spawned EngineCore/worker
processes -- is always seen. The ``ACCEL_`` prefix keeps vLLM's unknown-``VLLM_*``
warning quiet. ``docs/configuration.md`` is generated from the docs below
(``python -m vllm_accel.tools.configuration --write``).
"""

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what ``envs.NAME`` returns, for readers and type checkers
    ACCEL_DEVICE: str = "gcu"
    ACCEL_BACKEND: str = "auto"
    ACCEL_SIM_DEVICE_MEMORY_GB: float = 48.0
    ACCEL_SIM_HOST_MEMORY_FRACTION: float = 0.6
    ACCEL_SIM_HUGE_PAGES: bool = True
    ACCEL_SIM_WEIGHT_ARENA: bool = True
    ACCEL_SIM_SHARE_SCHEDULER_CORE: bool = True
    ACCEL_VIRTUAL_DEVICE_COUNT: int = 8
    ACCEL_KERNEL_PROVIDER: str = ""
    ACCEL_KV_SCALES: str = ""
    ACCEL_MODEL_CACHE: str = "~/.cache/vllm-accel/models"
    ACCEL_NATIVE_CACHE: str = "~/.cache/vllm-accel/native"
    ACCEL_NATIVE_MARCH: str = "native"
    ACCEL_REPACK_CACHE: str = "~/.cache/vllm-accel/repack"
    ACCEL_BF16_LINEAR: str = "auto"

GiB = 1 << 30


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name, "")
        if raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number") from None

    return read


def _switch(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name, "").strip().lower()
        if raw == "":
            return default
        if raw in ("1", "on", "true", "yes"):
            return True
        if raw in ("0", "off", "false", "no"):
            return False
        raise ValueError(f"{name}={raw!r}: use `on` or `off`")

    return read


def _path(name: str, default: str) -> Callable[[], str]:
    def read() -> str:
        return os.path.expanduser(os.environ.get(name, default).strip())

    return read


# name -> (reader, one-line documentation)
environment_variables: dict[str, tuple[Callable[[], Any], str]] = {
    "ACCEL_DEVICE": (
        lambda: os.environ.get("ACCEL_DEVICE", "gcu").strip().lower(),
        "Device kind the plugin serves (`gcu` or `sophtpu`; must match the backend). "
        "Set by `--device`; the spawned "
        "EngineCore and workers inherit it.",
    ),
    "ACCEL_BACKEND": (
        lambda: os.environ.get("ACCEL_BACKEND", "auto").strip().lower(),
        "Device backend: `auto` (Enflame torch_gcu if installed, else Sophgo "
        "torch_tpu, else the simulator), `sim`, `gcu`, `sophtpu`, `virtual` (the "
        "virtual GCU: a torch device on host memory running the CPU's kernels, "
        "driven through the Enflame card path; built at first use with the C++ "
        "compiler) or `virtual-sophtpu` (the same device under Sophgo's torch_tpu "
        "contract, driven through the SG2260 card path; `--device sophtpu`). Forcing "
        "a real backend whose library is missing is an error; so is `auto` with both "
        "vendor libraries installed. Detection reads package metadata only (no vendor "
        "import).",
    ),
    "ACCEL_SIM_DEVICE_MEMORY_GB": (
        _float("ACCEL_SIM_DEVICE_MEMORY_GB", 48.0),
        "Memory of one simulated GCU in GiB (an S60 has 48). Capped by what the "
        "host can give (see ACCEL_SIM_HOST_MEMORY_FRACTION).",
    ),
    "ACCEL_SIM_HOST_MEMORY_FRACTION": (
        _float("ACCEL_SIM_HOST_MEMORY_FRACTION", 0.6),
        "Largest fraction of the host's available RAM (at worker start) that the "
        "simulated devices of one host may take together.",
    ),
    "ACCEL_SIM_HUGE_PAGES": (
        _switch("ACCEL_SIM_HUGE_PAGES", True),
        "`on` (default): the simulator backs the model's parameters (the weights its "
        "kernels read in place; weights vLLM hands to oneDNN stay in oneDNN's buffers) "
        "with 2 MiB transparent huge pages (`MADV_HUGEPAGE` + `MADV_COLLAPSE`, Linux >= "
        "6.1, in place: same addresses and values), so decode's weight stream does not "
        "stall on 4 KiB page walks; the worker logs how many MiB it got. `off` keeps "
        "4 KiB pages.",
    ),
    "ACCEL_SIM_WEIGHT_ARENA": (
        _switch("ACCEL_SIM_WEIGHT_ARENA", True),
        "`on` (default): after loading, the simulator copies the model's parameters "
        "into one block in module order (a Llama layer's QKV, O, gate/up, down, layer "
        "after layer) and points them there (`Tensor.set_`: every holder sees the "
        "move), so a decode step reads its weights as one forward stream (in huge "
        "pages with ACCEL_SIM_HUGE_PAGES) instead of ~120 short ones; a tensor also "
        "held outside the model stays where it loaded; the worker logs the MiB moved "
        "and left. `off` leaves every tensor where it loaded.",
    ),
    "ACCEL_SIM_SHARE_SCHEDULER_CORE": (
        _switch("ACCEL_SIM_SHARE_SCHEDULER_CORE", True),
        "`on` (default): with one simulated device on the host (no TP/DP) and vLLM's "
        "automatic core binding, its worker runs in EngineCore's process (vLLM's "
        "uniproc executor, as on a one-GPU host) with a thread on every core, so a "
        "batch-1 decode streams its weights with every core's bandwidth and nothing "
        "else runs beside its threads between steps; the config pass logs it. With "
        "`--distributed-executor-backend mp` the worker is a process of its own, also "
        "on the core vLLM's CPU binding keeps for EngineCore "
        "(`VLLM_CPU_NUM_OF_RESERVED_CPU=0` for the engine's processes), and EngineCore "
        "sleeps instead of spinning while it waits for the worker's reply (patches.py). "
        "`off`: vLLM's layout as is (a worker process, a core kept for EngineCore, "
        "which spins through each step). An exported `VLLM_CPU_NUM_OF_RESERVED_CPU` "
        "wins over either; in-process engines (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) "
        "are never bound by vLLM.",
    ),
    "ACCEL_VIRTUAL_DEVICE_COUNT": (
        lambda: int(os.environ.get("ACCEL_VIRTUAL_DEVICE_COUNT", "8")),
        "Devices of the virtual card (`ACCEL_BACKEND=virtual` / `virtual-sophtpu`; "
        "8, like an S60 or SG2260 server), before `TOPS_VISIBLE_DEVICES` (GCU) or "
        "`CHIP_MAP` (SG2260) pick from them; each has ACCEL_SIM_DEVICE_MEMORY_GB of "
        "host memory.",
    ),
    "ACCEL_KERNEL_PROVIDER": (
        lambda: os.environ.get("ACCEL_KERNEL_PROVIDER", "").strip().lower(),
        "Force one kernel provider (`reference`: the slow, obviously correct kernels "
        "the tests use as an oracle; `torch_fast`: pure torch; `cpu_native`: the "
        "simulator's C++; `triton`; a card's vendor kernels, where its library "
        "registers them: `gcu_vendor`, `flash_attn`, `xformers`, `sophgo_vendor`) "
        "instead of the backend's preferred order (the simulator: `cpu_native`, then "
        "`torch_fast`); empty means the "
        "backend's order. `triton` on the simulator needs `TRITON_INTERPRET=1` "
        "(Triton has no CPU backend).",
    ),
    "ACCEL_KV_SCALES": (
        lambda: os.environ.get("ACCEL_KV_SCALES", ""),
        "Path of a JSON file with static per-layer INT8 KV scales "
        "(`{\"<layer>\": {\"k_scale\": s, \"v_scale\": s}}`, like the GCU fork's "
        "`int8_kv_cache.json`; `k_zero`/`v_zero` must be 0), used with "
        "`--kv-cache-dtype int8` instead of dynamic per-token scales. A malformed file "
        "fails at startup naming the file, the entry and the fix.",
    ),
    "ACCEL_MODEL_CACHE": (
        lambda: os.path.expanduser(
            os.environ.get("ACCEL_MODEL_CACHE", "~/.cache/vllm-accel/models")
        ),
        "Where `vllm-accel prepare-default` writes converted models.",
    ),
    "ACCEL_NATIVE_CACHE": (
        _path("ACCEL_NATIVE_CACHE", "~/.cache/vllm-accel/native"),
        "Directory where the simulated GCU's C++ kernels (`cpu_native`) and the "
        "virtual GCU are built on first use, for this CPU (one build per CPU model, "
        "flags and -march), with `$CXX` (else `c++`/`g++`; GCC >= 12 or Clang >= 15); "
        "`off` (or `0`, `none`, empty) disables them and the torch kernels run. "
        "Without a usable compiler the plugin warns once and runs the torch kernels.",
    ),
    "ACCEL_NATIVE_MARCH": (
        lambda: os.environ.get("ACCEL_NATIVE_MARCH", "").strip() or "native",
        "The `-march` the simulator's C++ kernels are built with: `native` (default: "
        "this CPU's extensions) or any GCC/Clang target, e.g. `x86-64-v3` (AVX2, no "
        "AVX-512) to run the paths a CPU without AVX-512 takes on one that has it "
        "(`benchmarks/as_cpu.py avx2` sets it, and holds torch, oneDNN and stock vLLM "
        "to AVX2 too). Each target is its own build in ACCEL_NATIVE_CACHE.",
    ),
    "ACCEL_REPACK_CACHE": (
        _path("ACCEL_REPACK_CACHE", "~/.cache/vllm-accel/repack"),
        "Directory of the on-disk cache of quantized weights repacked at load "
        "(GPTQ/AWQ/compressed-tensors), keyed by tensor content; `off` (or `0`, "
        "`none`, empty) disables it.",
    ),
    "ACCEL_BF16_LINEAR": (
        lambda: os.environ.get("ACCEL_BF16_LINEAR", "auto").strip().lower(),
        "Which kernel runs the simulator's bf16 Linear layers (and the LM head): `auto` "
        "(default) or `on`: the `cpu_native` kernel wherever it is built (x86 with "
        "AVX-512, or AVX2 + FMA + F16C), on the checkpoint's weights: float32 FMAs, AVX512-BF16 dot products "
        "from 3 rows where the CPU has them (a packed-panel GEMM from 24 rows), AMX "
        "tiles from 4 rows where it has AMX, and batches from 640 rows handed to "
        "torch's linear (oneDNN) there; `off`: vLLM's oneDNN linears on its prepacked "
        "weights.",
    ),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
