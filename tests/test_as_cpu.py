"""The kernels as other CPUs run them, on any x86-64 Linux machine
(``benchmarks/as_cpu.py``, as make bench's comparisons run them):

- ``avx512``: an AVX512-BF16 CPU without AMX (an AMD EPYC Zen 4): AMX tile state refused;
- ``avx2``: an AVX2 + FMA + F16C CPU without AVX-512 (an AMD EPYC Zen 3): torch,
  inductor and oneDNN held to AVX2, the plugin's kernels built for x86-64-v3;
- ``baseline``: an x86-64 CPU without AVX2: the kernels' scalar paths.

The kernel suites' float64 oracles check the paths each of those CPUs takes (on a CPU
that is that kind already, nothing changes); on ``avx2`` a compiled bf16 and a compiled
GPTQ engine run their decoder layers as one C++ op each, every linear on the AVX2
kernels, against HF transformers.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cpu_has, on_worker_core

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = [sys.executable, str(ROOT / "benchmarks" / "as_cpu.py")]
#: the kernel-level suites (their engine tests aside) whose paths each mode changes:
#: without AMX the GEMMs' (attention has no AMX path), without AVX-512 all of them
GEMM_SUITES = ["tests/test_cpu_native_bf16_linear.py", "tests/test_cpu_native_int4_gemv.py",
               "tests/test_quant_w8a8.py"]
KERNEL_SUITES = {"avx512": GEMM_SUITES,
                 "avx2": [*GEMM_SUITES, "tests/test_native_kernels.py",
                          "tests/test_attention_kernels.py", "tests/test_attention_int8.py",
                          "tests/test_attention_features.py", "tests/test_mla_kernels.py",
                          "tests/test_lora.py::test_lora_linear_matches_float64",
                          "tests/test_lora.py::"
                          "test_cpu_native_lora_linear_runs_in_cpp_and_sees_new_adapter_weights"]}
KERNEL_SUITES["baseline"] = KERNEL_SUITES["avx2"]


def _skip_reason(mode: str) -> str | None:
    """Why this CPU does not run as ``mode``'s: it is that kind already (make test runs
    those paths itself), or less (it cannot run as a CPU with AVX-512)."""
    avx512 = cpu_has("avx512f", "avx512bw", "avx512vl")
    if mode == "avx512" and not avx512:
        return "running as an AVX-512 CPU needs one (this CPU has no AVX-512)"
    if {"avx512": avx512 and not cpu_has("amx_tile"),
            "avx2": cpu_has("avx2", "fma", "f16c") and not avx512,
            "baseline": not cpu_has("avx2")}[mode]:
        return f"this CPU is an {mode} one: make test runs these paths itself"
    return None

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64",
    reason="seccomp filter written for x86-64 Linux (AMX is x86's)")


def _run(mode: str, cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(WRAPPER + [mode] + cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, preexec_fn=on_worker_core())


def _script(mode: str, script: str) -> None:
    """Runs ``script`` with python as ``mode``'s CPU; it prints ok at the end."""
    proc = _run(mode, [sys.executable, "-c", script], timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def _pytest(mode: str, *args: str, timeout: float = 1500) -> str:
    proc = _run(mode, [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                       *args], timeout=timeout)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
    return tail


def test_refused_amx_reaches_torch_and_every_kernel():
    script = (
        "import torch\n"
        "from vllm_accel.ops.cpu_native import bf16_linear, wint_gemv\n"
        "from vllm_accel.ops.cpu_native import build as native\n"
        "assert not torch.cpu._is_amx_tile_supported()\n"
        "assert not torch._C._cpu._init_amx()  # the OS refuses the tile state\n"
        "lib = native.library()\n"
        "assert lib is not None\n"
        "assert bf16_linear.amx_rows() == 0 and wint_gemv.amx_rows() == 0\n"
        "assert lib.accel_int4pack_amx_rows() == 0\n"
        "assert not lib.accel_int4pack_gemv_available() & wint_gemv.AMX\n"
        "print('ok')\n"
    )
    _script("avx512", script)


def test_an_avx2_cpu_has_a_cpp_path_for_every_kernel():
    """Without AVX-512 every kernel of the simulator still runs C++ of its own: the
    vector paths at 8 lanes (attention, INT8 KV writer), the bf16 linear, the int4 GEMV
    on torch's AVX2 layout, the dispatcher ops (one-op decoder layer); torch, oneDNN
    and stock vLLM see a CPU without AVX-512 (vLLM loads its AVX2 build)."""
    script = (
        "import torch\n"
        "from vllm_accel.ops.cpu_native import bf16_linear, wint_gemv\n"
        "from vllm_accel.ops.cpu_native import build as native\n"
        "assert not torch.cpu._is_avx512_supported() and torch.cpu._is_avx2_supported()\n"
        "assert torch.backends.cpu.get_cpu_capability() == 'AVX2'\n"
        "assert native.vector_lanes() == 8\n"
        "assert bf16_linear.available() and bf16_linear.dp_rows() == 0\n"
        "assert wint_gemv.gemv_available() and wint_gemv.torch_layout() == 32\n"
        "assert native.library().accel_int4pack_gemv_available() == "
        "wint_gemv.FP32_FMA | wint_gemv.I16_DOT\n"
        "assert native.torch_ops() is not None\n"
        "from vllm.platforms import current_platform\n"
        "current_platform.import_kernels()\n"
        "maps = open('/proc/self/maps').read()\n"
        "assert '_C_AVX2.abi3.so' in maps and '_C.abi3.so' not in maps\n"
        "print('ok')\n"
    )
    _script("avx2", script)


@pytest.mark.parametrize("mode", [
    pytest.param(mode, marks=pytest.mark.skipif(bool(_skip_reason(mode)),
                                                reason=str(_skip_reason(mode))))
    for mode in KERNEL_SUITES])
def test_kernel_suites_pass(mode):
    """The kernel suites' float64-oracle tests (their engine tests aside): their
    dispatch checks ask the OS and the kernels' -march (``conftest.cpu_has``), so each
    expects the paths that CPU has."""
    # (the reference and torch_fast providers' cases run the same torch code on any CPU)
    tail = _pytest(mode, "-m", "not engine", "-k", "not reference- and not torch_fast-",
                   *KERNEL_SUITES[mode])
    if mode != "baseline":  # (without AVX2 the bf16 linear is not built: oneDNN's runs)
        assert "skipped" not in tail, tail


@pytest.mark.engine
@pytest.mark.skipif(bool(_skip_reason("avx2")), reason=str(_skip_reason("avx2")))
def test_avx2_compiled_engines_run_the_cpp_layers_and_match_hf():
    """vLLM's default (compiled) mode on an AVX2 CPU: a bf16 and a GPTQ 4-bit model
    whose decoder layers each run as one C++ op, every linear on the AVX2 kernels,
    against HF transformers (the tests' own assertions)."""
    _pytest("avx2", "-m", "engine",
            "tests/test_cpu_native_bf16_linear.py::test_compiled_engine_runs_the_kernel_and_matches_hf",
            "tests/test_cpu_native_int4_gemv.py::test_compiled_bf16_engine_runs_the_gemv_and_matches_hf")
