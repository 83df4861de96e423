#!/usr/bin/env python
"""Resident weight memory and linear-kernel times: bf16 vs W4A16 vs W8A16 vs W8A8.

No engine runs. For the default model (``vllm_accel.tools.models``; ``--model DIR``
for another HF Llama-like checkpoint):

1. Resident weight bytes. The quantized variants are produced by the test
   quantizers into a temp dir (GPTQ 4-bit sym from tests/quantizer.py, group
   128 or, where 128 does not divide the Linear inputs (SmolLM2: 576), 64;
   W8A8 per-channel from tests/quantizer_int8.py) and converted with the
   library's own load-time conversions (``gptq_to_resident``,
   ``w8a8_to_resident``; W8A16 with ``w8a16.quantize_per_channel`` on the bf16
   weight, as ``--quantization w8a16`` does at load). Everything that is not a
   decoder Linear (embeddings, lm_head unless tied, norms) counts at bf16.
   Also the checkpoint sizes on disk.
2. Per-layer linear-kernel times at bs=1 (decode) and bs=64 for one decoder
   layer's shapes (qkv, o, gate_up, down), through the kernel registry:
   dense bf16 and fp32 (``x @ W.T``), W4A16 (``wint_linear``, bf16 in), W8A16
   (per-channel int8 on the shared resident layout, bf16 and fp32 in:
   ``torch._weight_int8pack_mm`` via the ``torch_fast`` provider), W8A8 (``int8_linear``, dynamic per-token, ``torch._int_mm``). Min and
   median of ``--iters`` calls after warm-up; the layer sum times
   ``num_hidden_layers`` estimates the linear time of one forward pass.

Usage::

    python benchmarks/quant_weights.py [--model DIR] [--iters 30] [--threads N]
                                       [--json out.json] [--skip-memory]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the test quantizers

LINEAR_RE = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.(?:self_attn|mlp)\.(?P<name>\w+))\.weight$")
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(f))
    return state


def _dir_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.glob("*.safetensors"))


def w4_group_size(config: dict) -> int:
    """128 (the usual GPTQ group) if it divides every Linear input, else the
    largest of 64 / 32 that does (SmolLM2-135M: hidden 576 = 4.5 x 128 -> 64)."""
    ins = (config["hidden_size"], config["intermediate_size"])
    return next(g for g in (128, 64, 32) if all(i % g == 0 for i in ins))


def resident_memory(model_dir: Path, work: Path) -> dict:
    """Resident weight bytes per format (see module doc)."""
    from quantizer import quantize_checkpoint
    from quantizer_int8 import quantize_checkpoint_int8

    from vllm_accel.quant import gptq as G
    from vllm_accel.quant import w8a8 as A8
    from vllm_accel.quant import w8a16 as W16

    config = json.loads((model_dir / "config.json").read_text())
    state = _load(model_dir)
    tied = bool(config.get("tie_word_embeddings"))
    other = sum(2 * t.numel() for n, t in state.items()
                if not (LINEAR_RE.match(n) and LINEAR_RE.match(n)["name"] in LINEARS)
                and not (tied and n == "lm_head.weight"))
    lin = {n: t for n, t in state.items()
           if LINEAR_RE.match(n) and LINEAR_RE.match(n)["name"] in LINEARS}
    n_lin = sum(t.numel() for t in lin.values())
    out = {"model": str(model_dir), "linear_weights": n_lin, "other_bytes_bf16": other,
           "formats": {}}

    def record(fmt, linear_bytes, disk=None):
        out["formats"][fmt] = {"linear_bytes": int(linear_bytes),
                               "total_bytes": int(linear_bytes + other),
                               "bytes_per_linear_weight": linear_bytes / n_lin,
                               "checkpoint_bytes": disk}

    record("bf16", 2 * n_lin)
    w16 = 0
    for t in lin.values():
        codes, s = W16.quantize_per_channel(t.to(torch.bfloat16), torch.bfloat16)
        w16 += _nbytes(codes) + _nbytes(s)
    record("W8A16 (online, per-channel)", w16)

    gs = w4_group_size(config)
    gdir = work / "gptq"
    quantize_checkpoint(model_dir, gdir, bits=4, group_size=gs, sym=True, desc_act=False)
    gstate = _load(gdir)
    w4 = 0
    for name in lin:
        p = LINEAR_RE.match(name)["prefix"]
        res = G.gptq_to_resident(gstate[f"{p}.qweight"], gstate[f"{p}.qzeros"],
                                 gstate[f"{p}.scales"], gstate[f"{p}.g_idx"], bits=4,
                                 group_size=gs)
        w4 += res.nbytes()["total"]
    record(f"W4A16 (GPTQ 4-bit g{gs} sym)", w4, _dir_bytes(gdir))

    adir = work / "w8a8"
    quantize_checkpoint_int8(model_dir, adir, strategy="channel")
    astate = _load(adir)
    w8 = 0
    for name in lin:
        p = LINEAR_RE.match(name)["prefix"]
        res = A8.w8a8_to_resident(astate[f"{p}.weight"], astate[f"{p}.weight_scale"],
                                  [astate[f"{p}.weight"].shape[0]], strategy="channel")
        w8 += res.nbytes()["total"]
    record("W8A8 (int8 per-channel, dynamic per-token)", w8, _dir_bytes(adir))
    out["formats"]["bf16"]["checkpoint_bytes"] = None
    return out


def _time(fn, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e6, statistics.median(ts) * 1e6


def kernel_times(config: dict, iters: int) -> dict:
    """Per-layer kernel times (us) for one decoder layer's Linear shapes."""
    from quantizer import quantize_weight

    from vllm_accel.ops.registry import get_kernel
    from vllm_accel.quant import gptq as G
    from vllm_accel.quant import w8a16 as W16
    from vllm_accel.quant.packed import KERNEL_NAME as WINT
    from vllm_accel.quant.packed import resident_from_signed

    h = config["hidden_size"]
    inter = config["intermediate_size"]
    nh = config["num_attention_heads"]
    nkv = config.get("num_key_value_heads", nh)
    hd = config.get("head_dim") or h // nh
    shapes = {"qkv_proj": ((nh + 2 * nkv) * hd, h), "o_proj": (h, nh * hd),
              "gate_up_proj": (2 * inter, h), "down_proj": (h, inter)}
    gs = w4_group_size(config)
    int8_linear = get_kernel("int8_linear")
    wint = get_kernel(WINT, "reference")
    prepare_fast = get_kernel("wint_prepare", "torch_fast")
    linear_fast = get_kernel("wint_prepared_linear", "torch_fast")
    gen = torch.Generator().manual_seed(0)
    results: dict = {}
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, generator=gen) * 0.05
        wb = w.to(torch.bfloat16)
        c16, s16 = W16.quantize_per_channel(wb, torch.bfloat16)
        c32, s32 = W16.quantize_per_channel(w)
        packed = quantize_weight(w, 4, gs, True).pack("gptq")
        r4 = G.gptq_to_resident(packed["qweight"], packed["qzeros"], packed["scales"],
                                packed["g_idx"], bits=4, group_size=gs)
        r4_fast = prepare_fast(r4, torch.bfloat16)
        r8_bf16 = prepare_fast(resident_from_signed(c16, s16, bits=8), torch.bfloat16)
        r8_fp32 = prepare_fast(resident_from_signed(c32, s32, bits=8), torch.float32)
        for bs in (1, 64):
            x = torch.randn(bs, k, generator=gen)
            xb = x.to(torch.bfloat16)
            row = {
                "bf16 dense": _time(lambda: xb @ wb.t(), iters),
                "fp32 dense": _time(lambda: x @ w.t(), iters),
                f"W4A16 g{gs} wint_linear[reference] (bf16 in)": _time(
                    lambda: wint(xb, r4.qweight, r4.scales, r4.zeros, bits=4,
                                 group_size=r4.group_size), iters),
                f"W4A16 g{gs} wint_prepared_linear[torch_fast] (bf16 in)": _time(
                    lambda: linear_fast(xb, r4_fast), iters),
                "W8A16 wint_prepared_linear[torch_fast] (bf16 in)": _time(
                    lambda: linear_fast(xb, r8_bf16), iters),
                "W8A16 wint_prepared_linear[torch_fast] (fp32 in)": _time(
                    lambda: linear_fast(x, r8_fp32), iters),
                "W8A8 int8_linear (bf16 in, dynamic)": _time(
                    lambda: int8_linear(xb, c16, s32), iters),
            }
            results.setdefault(f"bs={bs}", {})[f"{name} [{n}x{k}]"] = {
                k2: {"min_us": round(v[0], 1), "median_us": round(v[1], 1)}
                for k2, v in row.items()}
    layers = config["num_hidden_layers"]
    for bs_key, per_layer in results.items():
        methods = next(iter(per_layer.values())).keys()
        per_layer["per forward (sum x %d layers, min) ms" % layers] = {
            m: round(sum(v[m]["min_us"] for v in per_layer.values()
                         if isinstance(v, dict) and m in v) * layers / 1000, 2)
            for m in methods}
    return {"shapes": {k: list(v) for k, v in shapes.items()}, "threads":
            torch.get_num_threads(), "iters": iters, "times": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF model dir (default model)")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    ap.add_argument("--skip-memory", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    model_dir = args.model
    if model_dir is None:
        from vllm_accel.tools.models import prepare_default_model

        model_dir = prepare_default_model()
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    report: dict = {"model": str(model_dir)}
    if not args.skip_memory:
        with tempfile.TemporaryDirectory(prefix="quant-weights-") as tmp:
            report["memory"] = resident_memory(model_dir, Path(tmp))
        mem = report["memory"]
        print(f"Resident weights of {model_dir.name} ({mem['linear_weights'] / 1e6:.1f}M decoder "
              f"Linear weights; other tensors at bf16: {mem['other_bytes_bf16'] / 2**20:.1f} MiB)")
        print(f"{'format':48s} {'linear MiB':>10s} {'B/weight':>9s} {'total MiB':>10s} "
              f"{'ckpt MiB':>9s}")
        for fmt, r in mem["formats"].items():
            ck = "-" if r["checkpoint_bytes"] is None else f"{r['checkpoint_bytes'] / 2**20:.1f}"
            print(f"{fmt:48s} {r['linear_bytes'] / 2**20:10.1f} "
                  f"{r['bytes_per_linear_weight']:9.3f} {r['total_bytes'] / 2**20:10.1f} {ck:>9s}")
    report["kernels"] = kernel_times(config, args.iters)
    kt = report["kernels"]
    print(f"\nLinear kernel times, us (min / median of {kt['iters']}), "
          f"{kt['threads']} threads")
    for bs_key, per_layer in kt["times"].items():
        print(f"-- {bs_key}")
        for shape, row in per_layer.items():
            if shape.startswith("per forward"):
                print(f"   {shape}: " + ", ".join(f"{m} {v}" for m, v in row.items()))
                continue
            print(f"   {shape}")
            for m, v in row.items():
                print(f"      {m:42s} {v['min_us']:9.1f} / {v['median_us']:9.1f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
