"""The kernels as a CPU without AMX runs them (an AMD EPYC with AVX512-BF16), on any
x86-64 Linux machine: ``benchmarks/without_amx.py`` refuses the process AMX tile
state, as the make-bench comparison without AMX does. On a CPU with AMX the kernel
suites otherwise test only its tile paths from their first AMX row count; here the
same oracles check the AVX-512 paths that take those rows instead. On a CPU without
AMX nothing changes and the suites pass as they do in make test."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _xdist_worker_core

ROOT = Path(__file__).resolve().parent.parent
WRAPPER = [sys.executable, str(ROOT / "benchmarks" / "without_amx.py")]

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or os.uname().machine != "x86_64",
    reason="seccomp filter written for x86-64 Linux (AMX is x86's)")


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    core = _xdist_worker_core()  # (under make test: this worker's core, not both)
    return subprocess.run(WRAPPER + cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout,
                          preexec_fn=None if core is None else
                          lambda: os.sched_setaffinity(0, {core}))


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
    proc = _run([sys.executable, "-c", script], timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


def test_kernel_suites_pass_without_amx():
    """The bf16 linear, int4 GEMV and W8A8 int8 kernels' float64-oracle suites (their
    engine tests aside), rerun with AMX refused: their dispatch asks the OS, as the
    kernels do (``conftest.cpu_has``), so the AMX-only tests see no AMX."""
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                 "not engine", "tests/test_cpu_native_bf16_linear.py",
                 "tests/test_cpu_native_int4_gemv.py", "tests/test_quant_w8a8.py"],
                timeout=1200)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and " failed" not in tail, tail
