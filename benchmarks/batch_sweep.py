#!/usr/bin/env python
"""Output tokens/s against batch size: stock vLLM CPU, vllm_accel bf16, W4A16 and INT8 KV.

One engine per configuration (a fresh subprocess, this script re-invoked with
``--worker SPEC.json``) serves every batch size in turn, so a sweep costs four
engine starts, not sixteen. Each batch size runs ``B`` random-token prompts of
``--input-len`` tokens, greedy, ``--output-len`` new tokens each (ignore_eos),
after one warm-up generate of the same batch size; only that generate is timed.

Configurations (same model, dtype, seed, max_model_len and explicit KV-cache size)
  stock        stock vLLM CPU (our plugin excluded through VLLM_PLUGINS), bf16
  accel        vllm_accel's simulated GCU, bf16
  accel-w4a16  the same model as a GPTQ 4-bit group-64 checkpoint (the test
               quantizer's, written once under ~/.cache/vllm-accel/bench/)
  accel-int8kv vllm_accel, bf16 weights, --kv-cache-dtype int8

Writes the numbers (``--json``) and a PNG plot (``--png``; needs matplotlib, which
``make bench`` installs). Compiled (vLLM's default) unless ``--eager``.

    python benchmarks/batch_sweep.py [--batch-sizes 1,4,16,64] [--eager]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402
import throughput  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "stock": {"engine": "stock", "llm": {}},
    "accel": {"engine": "accel", "llm": {}},
    "accel-w4a16": {"engine": "accel", "llm": {}, "checkpoint": "w4a16"},
    "accel-int8kv": {"engine": "accel", "llm": {"kv_cache_dtype": "int8"}},
}
RESULT_TAG = throughput.RESULT_TAG


def run_worker(spec_path: str) -> None:
    """In the engine subprocess: one LLM, then every batch size."""
    spec = json.loads(Path(spec_path).read_text(encoding="utf-8"))
    import vllm.platforms
    from vllm import LLM, SamplingParams

    platform = type(vllm.platforms.current_platform).__name__
    if platform != spec["expected_platform"]:
        print(f"PLATFORM MISMATCH: {platform}, expected {spec['expected_platform']}", flush=True)
        sys.exit(throughput.PLATFORM_MISMATCH_RC)
    t0 = time.perf_counter()
    llm = LLM(**spec["llm"])
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    for batch, prompts, warmup in zip(spec["batch_sizes"], spec["prompts"], spec["warmup"]):
        llm.generate(throughput._token_prompts(warmup), params, use_tqdm=False)
        t0 = time.perf_counter()
        outputs = llm.generate(throughput._token_prompts(prompts), params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outputs)
        if made != batch * spec["output_len"]:
            raise SystemExit(f"batch {batch}: {made} tokens, expected {batch * spec['output_len']}")
        print(RESULT_TAG + json.dumps({"config": spec["config"], "batch": batch,
                                       "out_tok_s": made / seconds, "start_s": start_s}),
              flush=True)


def plot(results: list[dict[str, Any]], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"--png needs matplotlib ({exc}): pip install "
                         "'matplotlib>=3.8,<3.11' (make bench does)") from exc
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in CONFIGS:
        points = sorted((r["batch"], r["out_tok_s"]) for r in results if r["config"] == config)
        if points:
            ax.plot(*zip(*points), marker="o", label=config)
    ax.set_xscale("log", base=2)
    batches = sorted({r["batch"] for r in results})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("batch size (concurrent requests)")
    ax.set_ylabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: compiled)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--png", default=None, help="write the plot here")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args.worker)
        return 0

    batches = [int(b) for b in args.batch_sizes.split(",")]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configs {sorted(unknown)} (choose from {', '.join(CONFIGS)})")
    model = throughput.default_model()
    vocab = throughput.vocab_size(model)
    bandwidth = roofline.read_bandwidth()
    cpu = f"{roofline.cpu_model()} ({' '.join(roofline.cpu_flags()) or 'no AVX-512/AMX'})"
    mode = "eager" if args.eager else "compiled"
    print(f"CPU: {cpu}; single-core read bandwidth {bandwidth / 1e9:.1f} GB/s; {mode}", flush=True)
    prompts = [throughput.random_prompts(b, args.input_len, vocab, seed=b) for b in batches]
    warmup = [throughput.random_prompts(b, args.input_len, vocab, seed=10_000 + b) for b in batches]
    results: list[dict[str, Any]] = []
    for config in configs:
        spec_config = CONFIGS[config]
        engine = throughput.ENGINES[spec_config["engine"]]
        checkpoint = (throughput.quantized_model(model, spec_config["checkpoint"])
                      if spec_config.get("checkpoint") else model)
        spec = {
            "config": config, "workload": f"sweep/{config}", "engine": spec_config["engine"],
            "expected_platform": engine["platform"], "batch_sizes": batches,
            "prompts": prompts, "warmup": warmup, "output_len": args.output_len,
            "llm": {"model": checkpoint, "dtype": "bfloat16", "seed": 0,
                    "max_model_len": 4096, "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
                    "enforce_eager": args.eager, **spec_config["llm"]},
        }
        print(f"[{config}] starting ({', '.join(map(str, batches))}) ...", flush=True)
        found = throughput.run_worker_process(spec, engine["env"], args.timeout, False,
                                              script=__file__)
        for r in found:
            print(f"  {config:13s} batch {r['batch']:3d}: {r['out_tok_s']:8.1f} out tok/s "
                  f"(engine start {r['start_s']:.0f} s)", flush=True)
        results += found

    by = {(r["config"], r["batch"]): r["out_tok_s"] for r in results}
    print(f"\n{'batch':>5s}  " + "  ".join(f"{c:>13s}" for c in configs)
          + ("  accel/stock" if {"accel", "stock"} <= set(configs) else ""))
    for b in batches:
        cells = "  ".join(f"{by.get((c, b), float('nan')):13.1f}" for c in configs)
        ratio = (f"  {by[('accel', b)] / by[('stock', b)]:10.2f}x"
                 if ("accel", b) in by and ("stock", b) in by else "")
        print(f"{b:5d}  {cells}{ratio}")
    meta = {"cpu": cpu, "read_bandwidth_GBps": round(bandwidth / 1e9, 2), "mode": mode,
            "input_len": args.input_len, "output_len": args.output_len, "model": model}
    if args.json:
        Path(args.json).write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    if args.png:
        plot(results, f"SmolLM2-135M-Instruct, {mode}, {args.input_len} in / {args.output_len} "
                      f"out\n{roofline.cpu_model()}, 2 cores", Path(args.png))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
