#!/usr/bin/env python
"""Sweep the fused-MoE Triton kernels' launch tiles (``ops/triton/moe.py``'s ``Tiles``:
columns per program, reduction step, warps, pipeline stages) on a GPU.

Needs only torch and triton (no vLLM)::

    python benchmarks/triton_moe_tiles.py [--kinds bf16,w4a16] [--json OUT.json]
    python benchmarks/triton_moe_tiles.py --gemv [--kinds w4a16,w8a16] [--json OUT.json]

For Qwen3-30B-A3B's layer (128 experts, top-8, hidden 2048, intermediate 768) with
bf16, W4A16 or W8A16 (group 128) experts. A time is a CUDA graph replaying 8 layers,
each routed to other experts, so the weights come from memory, not L2 (what a server
replaying decode graphs sees); every launch's output is checked against the default's.

- default: each tiled kernel (gate/up, down) under every launch of ``GRID`` while the
  other keeps the default; printed per kind, batch and kernel: the best launches, then
  the layer with each kernel's best against the default.
- ``--gemv``: the quantized experts' matrix-vector kernels under every launch of
  ``GEMV_GRID`` at each batch, against the tiled kernels and against bf16 experts.
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
#: the matrix-vector kernels' launches (decode batches up to ``moe.GEMV_MAX_PAIRS`` pairs)
GEMV_GRID = [moe.Tiles(*t) for t in itertools.product((4, 8, 16), (128, 256, 512), (1, 2, 4),
                                                       (2, 3))]
#: layers a timing replays, each routed to other experts
LAYERS = 8


def experts(kind, n_experts, hidden, inter, g):
    if kind == "bf16":
        w13 = torch.randn(n_experts, 2 * inter, hidden, dtype=torch.bfloat16, device=DEV,
                          generator=g) * hidden ** -0.5
        w2 = torch.randn(n_experts, hidden, inter, dtype=torch.bfloat16, device=DEV,
                         generator=g) * inter ** -0.5
        return 0, lambda *a: moe.moe_experts(*a[:1], w13, w2, *a[1:])
    bits = int(kind[1])  # "w4a16", "w8a16"
    w13 = torch.nn.ModuleList(PackedExperts(2 * inter, hidden, g, bits=bits)
                              for _ in range(n_experts))
    w2 = torch.nn.ModuleList(PackedExperts(hidden, inter, g, bits=bits) for _ in range(n_experts))
    return bits, lambda *a: moe.moe_quant_experts(*a[:1], w13, w2, *a[1:])


def layer_time(layer, batches) -> float:
    """us per layer, replayed from a CUDA graph over ``batches``."""
    # do_bench_cudagraph runs on a stream of its own: the inputs must be written first
    torch.cuda.synchronize()
    def run_all():
        for x, weights, ids in batches:
            layer(x, weights, ids)
    return do_bench_cudagraph(run_all, rep=40) * 1e3 / len(batches)


def checked_time(layer, batches, want, label) -> float | None:
    """:func:`layer_time` where the launch now set gives ``want`` (else None, printed
    with the error or the exception, e.g. out of shared memory or registers)."""
    try:
        got = [layer(*b).float() for b in batches]
        err = max(((o - w).abs().max() / w.abs().max()).item() for o, w in zip(got, want))
        if err <= 2e-2:
            return layer_time(layer, batches)
        print(f"  {label}: error {err:.3g}")
    except Exception as exc:  # noqa: BLE001
        print(f"  {label}: {type(exc).__name__}: {str(exc)[:80]}")
    return None


def routed(batch, hidden, n_experts, top_k, g):
    """``LAYERS`` batches whose routings avoid each other's experts where they can."""
    out = []
    for i in range(LAYERS):
        x, weights, ids = routed_batch(batch, hidden, n_experts, top_k, g)
        out.append((x, weights, ((ids + i * top_k) % n_experts).to(torch.int32)))
    return out


def sweep_gemv(kind, batches_, n_experts=128, top_k=8, hidden=2048, inter=768):
    """The matrix-vector kernels under each launch of ``GEMV_GRID`` against the tiled
    kernels (at their ``moe.TILES`` launches) and bf16 experts (tiled), by batch."""
    g = torch.Generator(device=DEV).manual_seed(0)
    bits, layer = experts(kind, n_experts, hidden, inter, g)
    _, bf16_layer = experts("bf16", n_experts, hidden, inter, g)
    default, limit, rows = moe.GEMV_TILES[bits], moe.GEMV_MAX_PAIRS, []
    for batch in batches_:
        batches = routed(batch, hidden, n_experts, top_k, g)
        bf16_us = layer_time(bf16_layer, batches)
        moe.GEMV_MAX_PAIRS = 0  # the tiled kernels, at their tuned launches (moe.TILES)
        want = [layer(*b).float() for b in batches]
        tiled_us = layer_time(layer, batches)
        moe.GEMV_MAX_PAIRS = 1 << 30
        timed = []
        for tiles in GEMV_GRID:
            moe.GEMV_TILES[bits] = tiles
            us = checked_time(layer, batches, want, f"{kind} b{batch} gemv {tuple(tiles)}")
            if us is not None:
                timed.append((us, tiles))
        moe.GEMV_TILES[bits] = default
        default_us = layer_time(layer, batches)
        moe.GEMV_MAX_PAIRS = limit
        timed.sort(key=lambda t: t[0])
        print(f"{kind} batch {batch} ({batch * top_k} pairs): tiled {tiled_us:.1f} us, "
              f"matrix-vector {default_us:.1f} us at {tuple(default)} (bf16 experts, tiled: "
              f"{bf16_us:.1f} us); best "
              + ", ".join(f"{tuple(t)} {us:.1f}" for us, t in timed[:4]), flush=True)
        rows.append({"kind": kind, "batch": batch, "pairs": batch * top_k,
                     "bf16_tiled_us": round(bf16_us, 2), "tiled_us": round(tiled_us, 2),
                     "gemv_us": round(default_us, 2), "gemv_best_us": round(timed[0][0], 2),
                     "gemv_best_tiles": list(timed[0][1])})
    return rows


def sweep(kind, batches_, n_experts=128, top_k=8, hidden=2048, inter=768):
    g = torch.Generator(device=DEV).manual_seed(0)
    bits, layer = experts(kind, n_experts, hidden, inter, g)
    moe.GEMV_MAX_PAIRS = 0  # the tiled kernels at every batch
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
                us = checked_time(layer, batches, want, f"{kind} b{batch} {kernel} {tuple(tiles)}")
                if us is not None:
                    timed.append((us, tiles))
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
    parser.add_argument("--kinds", help="bf16, w4a16, w8a16 (default: bf16,w4a16; "
                        "w4a16,w8a16 with --gemv)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--gemv", action="store_true",
                        help="sweep the matrix-vector kernels' launches instead")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name} ({props.multi_processor_count} SMs); torch {torch.__version__}, "
          f"triton {triton.__version__}; {len(GEMV_GRID if args.gemv else GRID)} launches "
          "per kernel")
    batches = [int(b) for b in args.batches.split(",")]
    kinds = args.kinds or ("w4a16,w8a16" if args.gemv else "bf16,w4a16")
    results = {"gpu": props.name, "torch": torch.__version__, "triton": triton.__version__,
               "rows": [r for kind in kinds.split(",")
                        for r in (sweep_gemv if args.gemv else sweep)(kind, batches)]}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
