#!/usr/bin/env python
"""The simulator's bf16 linear kernel (``csrc/bf16_linear.cpp``) against torch's linear
(oneDNN) at each batch size, on the default model's 30 decoder layers' shapes, one
thread: where the op's hand-over to torch (``accel_bf16_linear_onednn_rows``) belongs on
this CPU, and how fast the kernel streams the weights.

Needs only torch and a C++ compiler (no vLLM): the kernel is built here with the
plugin's flags (and ``ACCEL_NATIVE_MARCH``), so it runs on any x86 machine with
AVX-512 or AVX2, e.g. a device machine's host. ``--baseline FILE`` builds another version of the source as well and alternates
the two in this process (A/B of a kernel change). Where vLLM is installed it also times
what stock vLLM CPU runs: oneDNN on a weight copy prepacked at load
(``create_onednn_mm`` / ``onednn_mm``). Pin it to one core for stable
numbers: ``taskset -c 0 python benchmarks/bf16_linear_rows.py``.
"""

import argparse
import ctypes
import functools
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from roofline import read_bandwidth

CSRC = Path(__file__).resolve().parent.parent / "vllm_accel" / "ops" / "cpu_native" / "csrc"
#: (out, in) features of a SmolLM2-135M decoder layer's qkv, o, gate_up and down
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30
#: cpu_native/build.py's FLAGS (that module imports the plugin, which needs vLLM;
#: tests/test_cpu_native_bf16_linear.py keeps the two equal)
FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17", "-fPIC")
_ARGS = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64,
         ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
         ctypes.c_int64]


def compile_source(source: Path, out_dir: Path, name: str) -> ctypes.CDLL:
    """One csrc file built alone with the plugin's flags, loaded."""
    out = out_dir / f"{name}.so"
    # the -march ACCEL_NATIVE_MARCH names, as the plugin's build (benchmarks/as_cpu.py avx2)
    march = f"-march={os.environ.get('ACCEL_NATIVE_MARCH', '').strip() or 'native'}"
    flags = [march if f == "-march=native" else f for f in FLAGS]
    subprocess.run(["c++", *flags, "-shared", "-w", f"-I{CSRC}", str(source), "-o", str(out)],
                   check=True)
    return ctypes.CDLL(str(out))


def build(source: Path, out_dir: Path, name: str) -> ctypes.CDLL:
    lib = compile_source(source, out_dir, name)
    lib.accel_bf16_linear.argtypes = _ARGS
    return lib


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,10,12,16,32,64")
    parser.add_argument("--baseline", type=Path, help="another bf16_linear.cpp to alternate with")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"kernel": build(CSRC / "bf16_linear.cpp", Path(tmp), "kernel")}
        if args.baseline:
            kernels["baseline"] = build(args.baseline, Path(tmp), "baseline")
        lib = kernels["kernel"]
        if not lib.accel_bf16_linear_available():
            raise SystemExit("the kernel is not built on this CPU (needs AVX-512 F/BW/VL or "
                             "AVX2 + FMA + F16C)")
        print(f"single-core read bandwidth {read_bandwidth() / 1e9:.1f} GB/s; kernel hands "
              f"bf16 batches to torch from {lib.accel_bf16_linear_onednn_rows(1) or 'no'} rows, "
              f"AVX512-BF16 tiles from {lib.accel_bf16_linear_dp_rows() or 'no'} rows")
        torch.manual_seed(0)
        weights = [(torch.randn(n, k) * 0.05).to(torch.bfloat16) for n, k in SHAPES]
        try:
            from vllm import _custom_ops as vllm_ops
            prepacked = [vllm_ops.create_onednn_mm(w.t(), 32) for w in weights]
        except ImportError:  # no vLLM here: the kernel and torch only
            prepacked = []
        except RuntimeError as exc:  # (oneDNN has no bf16 matmul for an AVX2-only CPU:
            # stock vLLM then runs torch's linear, as here)
            print(f"vLLM's oneDNN linear: {str(exc).splitlines()[0]}")
            prepacked = []
        gigabytes = sum(w.numel() * 2 for w in weights) / 1e9
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, 1536).to(torch.bfloat16)
            y = torch.empty(m, 3072, dtype=torch.bfloat16)

            def run(lib):
                for w in weights:
                    n, k = w.shape
                    rc = lib.accel_bf16_linear(x.data_ptr(), x.stride(0), 1, w.data_ptr(), k,
                                               None, y.data_ptr(), y.stride(0), m, n, k)
                    assert rc == 0, rc

            def torch_linear():
                for w in weights:
                    torch.nn.functional.linear(x[:, :w.shape[1]], w)

            def vllm_prepacked():
                for w, handle in zip(weights, prepacked):
                    vllm_ops.onednn_mm(handle, x[:, :w.shape[1]], None)

            calls = {name: functools.partial(run, lib) for name, lib in kernels.items()}
            calls["torch"] = torch_linear
            if prepacked:
                calls["vllm"] = vllm_prepacked
            best = dict.fromkeys(calls, float("inf"))
            for _ in range(args.repeats):  # alternated: each kind once a repeat
                for name, fn in calls.items():
                    best[name] = min(best[name], _timed(fn))
            line = (f"rows {m:3d}: kernel {best['kernel'] * 1e3:7.2f} ms "
                    f"({gigabytes / best['kernel']:.1f} GB/s), torch {best['torch'] * 1e3:7.2f} ms "
                    f"(torch/kernel {best['torch'] / best['kernel']:.2f})")
            if "vllm" in best:
                line += (f", vLLM prepacked {best['vllm'] * 1e3:7.2f} ms "
                         f"(vllm/kernel {best['vllm'] / best['kernel']:.2f})")
            if "baseline" in best:
                line += (f", baseline {best['baseline'] * 1e3:7.2f} ms "
                         f"(kernel speed {best['baseline'] / best['kernel']:.2f}x)")
            print(line, flush=True)


if __name__ == "__main__":
    main()
