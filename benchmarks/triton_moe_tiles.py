#!/usr/bin/env python
"""Sweep the fused-MoE Triton kernels' launch tiles (``ops/triton/moe.py``'s ``Tiles``:
columns per program, reduction step, warps, pipeline stages) on a GPU.

Needs only torch and triton (no vLLM)::

    python benchmarks/triton_moe_tiles.py [--kinds bf16,w4a16] [--json OUT.json]

For Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, intermediate 768) with
bf16 or W4A16 (4-bit, group 128) experts, at batch 1, 16 and 64, each kernel
(gate/up, down) is timed under every launch of the grid while the other keeps the
default. A time is a CUDA graph replaying 8 layers, each routed to other experts, so
the weights come from memory, not L2 (what a server replaying decode graphs sees);
every launch's output is checked against the default's. Printed per kind, batch and
kernel: the best launches; then the layer with each kernel's best against the default.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from triton_kernels import DEV, PackedExperts, routed_batch  # noqa: E402

from vllm_accel.ops.triton import moe  # noqa: E402

GRID = [moe.Tiles(*t) for t in itertools.product((32, 64, 128), (64, 128, 256), (4, 8),
                                                  (2, 3, 4))]
#: layers a timing replays, each routed to other experts
LAYERS = 8


def experts(kind, n_experts, hidden, inter, g):
    if kind == "bf16":
        w13 = torch.randn(n_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=DEV,
                          generator=g) * hidden ** -0.5
        w2 = torch.randn(n_experts, hidden, inter, dtype=torch.bfloat16, device=DEV,
                         generator=g) * inter ** -0.5
        return 0, lambda *a: moe.moe_experts(*a[:1], w13, w2, *a[1:])
    w13 = torch.nn.ModuleList(PackedExperts(2 * inter, hidden, g) for _ in range(n_experts))
    w2 = torch.nn.ModuleList(PackedExperts(hidden, inter, g) for _ in range(n_experts))
    return 4, lambda *a: moe.moe_quant_experts(*a[:1], w13, w2, *a[1:])


def layer_time(layer, batches) -> float:
    """us per layer, replayed from a CUDA graph over ``batches``."""
    def run_all():
        for x, weights, ids in batches:
            layer(x, weights, ids)
    return do_bench_cudagraph(run_all, rep=40) * 1e3 / len(batches)


def routed(batch, hidden, n_experts, top_k, g):
    """``LAYERS`` batches whose routings avoid each other's experts where they can."""
    out = []
    for i in range(LAYERS):
        x, weights, ids = routed_batch(batch, hidden, n_experts, top_k, g)
        out.append((x, weights, ((ids + i * top_k) % n_experts).to(torch.int32)))
    return out


def sweep(kind, batches_, n_experts=128, top_k=8, hidden=2048, inter=768):
    g = torch.Generator(device=DEV).manual_seed(0)
    bits, layer = experts(kind, n_experts, hidden, inter, g)
    rows = []
    for batch in batches_:
        batches = routed(batch, hidden, n_experts, top_k, g)
        moe.TILES.clear()
        want = [layer(*b).float() for b in batches]
        default_us = layer_time(layer, batches)
        best = {}
        for kernel in ("gate_up", "down"):
            timed = []
            for tiles in GRID:
                moe.TILES.clear()
                moe.TILES[(kernel, bits)] = [(1 << 30, tiles)]
                try:
                    got = [layer(*b).float() for b in batches]
                    err = max(((o - w).abs().max() / w.abs().max()).item()
                              for o, w in zip(got, want))
                    if err > 2e-2:
                        print(f"  {kind} b{batch} {kernel} {tuple(tiles)}: error {err:.3g}")
                        continue
                    timed.append((layer_time(layer, batches), tiles))
                except Exception as exc:  # noqa: BLE001 -- e.g. out of shared memory
                    print(f"  {kind} b{batch} {kernel} {tuple(tiles)}: "
                          f"{type(exc).__name__}: {str(exc)[:80]}")
            timed.sort(key=lambda t: t[0])
            best[kernel] = timed[0][1]
            print(f"{kind} batch {batch} {kernel}: default {default_us:.1f} us; best "
                  + ", ".join(f"{tuple(t)} {us:.1f}" for us, t in timed[:4]), flush=True)
        moe.TILES.clear()
        for kernel, tiles in best.items():
            moe.TILES[(kernel, bits)] = [(1 << 30, tiles)]
        tuned_us = layer_time(layer, batches)
        moe.TILES.clear()
        print(f"{kind} batch {batch}: default {default_us:.1f} us, both best {tuned_us:.1f} us "
              f"({default_us / tuned_us:.2f}x)", flush=True)
        rows.append({"kind": kind, "batch": batch, "pairs": batch * top_k,
                     "default_us": round(default_us, 2), "tuned_us": round(tuned_us, 2),
                     **{f"{k}_tiles": list(t) for k, t in best.items()}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="bf16,w4a16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name} ({props.multi_processor_count} SMs); torch {torch.__version__}, "
          f"triton {triton.__version__}; {len(GRID)} launches per kernel")
    batches = [int(b) for b in args.batches.split(",")]
    results = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
               "rows": [r for kind in args.kinds.split(",") for r in sweep(kind, batches)]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
