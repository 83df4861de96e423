#!/usr/bin/env python
"""The CPU a benchmark ran on and its decode roofline.

Stock vLLM's CPU worker runs a model on one core here (the other runs the engine), so
a batch-1 decode step can go no faster than one core can read the step's bytes: every
weight once, plus the KV cache it attends to. This module measures that core's read
bandwidth (a single-threaded reduction over a buffer far larger than the caches) and,
for the simulator's worker, which runs a thread on every core, all cores' bandwidth
(the same reduction on every thread), and turns bytes per step into tokens per
second::

    python benchmarks/roofline.py        # CPU, flags, kernel build, read bandwidth
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

#: flags that decide which kernels run (what the dispatch reads at run time)
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx512vbmi", "avx512_bf16",
                "amx_tile", "amx_bf16", "amx_int8")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in KERNEL_FLAGS if f in have]
    return []


#: variables that change which instructions the kernels use on the same CPU
ISA_ENV = ("ACCEL_AS_CPU", "ACCEL_NATIVE_MARCH", "CXX", "ONEDNN_MAX_CPU_ISA",
           "ATEN_CPU_CAPABILITY", "TORCHINDUCTOR_CPP_MARCH")


def kernel_build() -> dict:
    """What the plugin's C++ kernels were built to use on this CPU (the flags say what
    it has; a build can use less, e.g. with AMX compiled out through ``CXX``) and the
    variables that cap torch's and oneDNN's instructions."""
    from vllm_accel.ops.cpu_native import build as native
    from vllm_accel.ops.cpu_native import wint_gemv as W

    env = {name: os.environ[name] for name in ISA_ENV if name in os.environ}
    # whether the OS gives this process AMX tile state (benchmarks/as_cpu.py
    # refuses it) and what torch, which stock vLLM asks, reports
    amx = {"amx_granted": bool(torch._C._cpu._init_amx()),
           "torch_reports_amx": bool(torch.cpu._is_amx_tile_supported()),
           "torch_reports_avx512": bool(torch.cpu._is_avx512_supported())}
    lib = native.library()
    if lib is None:
        return {"library": None, "env": env, **amx}
    int4 = lib.accel_int4pack_gemv_available()
    variants = [name for bit, name in ((W.FP32_FMA, "fp32_fma"), (W.BF16_DOT, "bf16_dot"),
                                       (W.I16_DOT, "i16_dot"), (W.AMX, "amx")) if int4 & bit]
    return {"library": "built", "vector_lanes": lib.accel_vector_lanes(), "int4_gemv": variants,
            "int4_layouts": lib.accel_int4pack_block_sizes(),
            "bf16_linear_amx_rows": lib.accel_bf16_linear_amx_rows(), "env": env, **amx}


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5, threads: int = 1) -> float:
    """Bytes per second ``threads`` threads read together (best of ``repeats`` sums
    of ``nbytes``)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(nbytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t)
        return nbytes / best
    finally:
        torch.set_num_threads(before)


def all_cores() -> int:
    """Cores this process may run on (the threads the simulator's worker runs)."""
    return len(os.sched_getaffinity(0))


def decode_step_bytes(model_dir: str, dtype_bytes: int = 2, context: int = 0) -> int:
    """Bytes a batch-1 decode step reads: every weight once (a tied embedding counts
    once, as the LM head's GEMV; the embedding lookup reads one row) plus the K and
    V of ``context`` cached tokens."""
    import json

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head = cfg.get("head_dim", h // heads)
    per_layer = h * (heads + 2 * kv_heads) * head + heads * head * h + 3 * h * inter + 2 * h
    head_weights = cfg["vocab_size"] * h
    params = layers * per_layer + head_weights + h
    if not cfg.get("tie_word_embeddings", False):
        params += h  # the embedding row looked up (the table itself is not streamed)
    kv = 2 * layers * kv_heads * head * context
    return (params + kv) * dtype_bytes


def main() -> None:
    bw = read_bandwidth()
    print(f"CPU: {cpu_model()}; kernel flags: {' '.join(cpu_flags()) or 'none of ' + str(KERNEL_FLAGS)}")
    print(f"plugin kernels built for: {kernel_build()}")
    print(f"single-core read bandwidth: {bw / 1e9:.1f} GB/s")
    print(f"{all_cores()}-core read bandwidth: {read_bandwidth(threads=all_cores()) / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
