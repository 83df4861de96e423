#!/usr/bin/env python
"""The simulator's decode attention kernel (``csrc/paged_attention.cpp``) on a bf16
and an INT8 KV cache, one thread, at issue 13's W1 shape: 64 requests of the
default model (9 query / 3 KV heads of 64), block size 64, the 30 layers' caches
each in its own buffer (cold, as in an engine), blocks shuffled. Prints ms per
decode step (30 layers), the bytes/s each cache is read at and the INT8 / bf16 time.

Needs only torch and a C++ compiler (no vLLM): the kernel is built here with the
plugin's flags, so it runs on any x86 machine with AVX-512, e.g. a device machine's
host. ``--baseline FILE`` builds another version of the source as well and
alternates the two in this process (A/B of a kernel change). Pin it to one core:
``taskset -c 0 python benchmarks/decode_attention.py``.
"""

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

from bf16_linear_rows import CSRC, compile_source
from roofline import cpu_flags, cpu_model, read_bandwidth

#: the default model's attention: query heads, KV heads, head size, layers
HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 9, 3, 64, 30
#: bytes of float32 (k_scale, v_scale) per token and head of an INT8 page
INT8_SCALE_BYTES = 8
BF16 = 1  # the C ABI's dtype code of a bf16 query


def build(source: Path, out_dir: Path, name: str) -> ctypes.CDLL:
    lib = compile_source(source, out_dir, name)
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.accel_paged_attention.argtypes = [
        i32, ptr, i64, i64, ptr, i64, i64, ptr, i32, i64, i64, i32, i32, i64, ptr, i64, i64,
        ptr, ptr, i32, i32, i32, ctypes.c_float]
    lib.accel_cache_write.argtypes = [
        i32, ptr, ptr, i64, i64, i64, i64, ptr, i32, i64, i64, ptr, i64, i32, i32, i32, i64,
        ctypes.c_float, ctypes.c_float]
    return lib


class Case:
    """One decode step's inputs: the layers' caches of one dtype, filled by the kernel
    library's own writer."""

    def __init__(self, lib, int8: bool, requests: int, context: int, block_size: int):
        self.int8, self.block_size = int8, block_size
        blocks_per = (context + block_size - 1) // block_size
        num_blocks = requests * blocks_per
        g = torch.Generator().manual_seed(0)
        self.block_table = torch.randperm(num_blocks, generator=g).to(torch.int32)
        self.block_table = self.block_table.view(requests, blocks_per).contiguous()
        self.seq_lens = torch.full((requests,), context, dtype=torch.int32)
        self.query_start_loc = torch.arange(requests + 1, dtype=torch.int32)
        width = 2 * HEAD_SIZE + (INT8_SCALE_BYTES if int8 else 0)
        dtype = torch.int8 if int8 else torch.bfloat16
        pos = torch.arange(context).repeat(requests)
        req = torch.arange(requests).repeat_interleave(context)
        slots = (self.block_table[req, pos // block_size].long() * block_size
                 + pos % block_size).contiguous()
        self.caches, self.queries = [], []
        for _ in range(LAYERS):
            cache = torch.zeros(num_blocks, KV_HEADS, block_size, width, dtype=dtype)
            k = torch.randn(len(slots), KV_HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
            v = torch.randn(len(slots), KV_HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
            rc = lib.accel_cache_write(
                BF16, k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), v.stride(0),
                v.stride(1), cache.data_ptr(), int(int8), cache.stride(0), cache.stride(1),
                slots.data_ptr(), len(slots), KV_HEADS, block_size, HEAD_SIZE, num_blocks,
                0.0, 0.0)
            assert rc == 0, rc
            self.caches.append(cache)
            self.queries.append(torch.randn(requests, HEADS, HEAD_SIZE, generator=g)
                                .to(torch.bfloat16))
        self.out = torch.empty_like(self.queries[0])
        self.bytes = sum(c.numel() * c.element_size() for c in self.caches)

    def run(self, lib) -> float:
        start = time.perf_counter()
        for q, cache in zip(self.queries, self.caches):
            rc = lib.accel_paged_attention(
                BF16, q.data_ptr(), q.stride(0), q.stride(1), self.out.data_ptr(),
                self.out.stride(0), self.out.stride(1), cache.data_ptr(), int(self.int8),
                cache.stride(0), cache.stride(1), self.block_size, HEAD_SIZE, cache.shape[0],
                self.block_table.data_ptr(), self.block_table.stride(0),
                self.block_table.shape[1], self.query_start_loc.data_ptr(),
                self.seq_lens.data_ptr(), len(self.seq_lens), HEADS, KV_HEADS,
                HEAD_SIZE ** -0.5)
            assert rc == 0, rc
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="192,1024", help="tokens per request")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--baseline", type=Path, help="another paged_attention.cpp to alternate with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"CPU: {cpu_model()}; flags: {' '.join(cpu_flags())}; single-core read bandwidth "
          f"{read_bandwidth() / 1e9:.1f} GB/s")
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"kernel": build(CSRC / "paged_attention.cpp", Path(tmp), "kernel")}
        if args.baseline:
            kernels["baseline"] = build(args.baseline, Path(tmp), "baseline")
        for context in (int(c) for c in args.contexts.split(",")):
            cases = {name: Case(kernels["kernel"], name == "int8", args.requests, context,
                                args.block_size) for name in ("bf16", "int8")}
            best = {}
            for _ in range(args.repeats):  # alternated, best of each
                for cache, case in cases.items():
                    for name, lib in kernels.items():
                        t = case.run(lib)
                        best[name, cache] = min(best.get((name, cache), t), t)
            print(f"{args.requests} requests x {context} tokens, {LAYERS} layers, one thread:")
            for name in kernels:
                bf16, int8 = best[name, "bf16"], best[name, "int8"]
                print(f"  {name:8s} bf16 KV {bf16 * 1e3:7.2f} ms ({cases['bf16'].bytes / bf16 / 1e9:5.1f}"
                      f" GB/s)  INT8 KV {int8 * 1e3:7.2f} ms ({cases['int8'].bytes / int8 / 1e9:5.1f}"
                      f" GB/s)  INT8/bf16 time {int8 / bf16:.2f}")


if __name__ == "__main__":
    main()
