#!/usr/bin/env python
"""Offline throughput: the vllm_accel plugin vs stock vLLM CPU, in one invocation.

Every (engine, workload) pair runs in a fresh subprocess (this script re-invoked
with ``--worker SPEC.json``), one at a time, and prints one stdout line
``BENCH_RESULT <json>``. The parent collects them, prints a table and, per
workload, the accel/stock (and accel-int8/accel) ratio of output tokens/s.

Engines
  accel  the inherited environment: our platform plugin is active
         (vllm.platforms.current_platform must be AccelPlatform).
  stock  VLLM_PLUGINS=lora_filesystem_resolver: the allowlist excludes our
         plugin, so vLLM falls back to its CpuPlatform (checked).
  virtual  ACCEL_BACKEND=virtual: the card path (card worker, vLLM's GPU model
         runner) on the virtual GCU, a torch device on host memory running the
         CPU's kernels one aten op at a time; a correctness device, eager.
  accel-int8   accel with --kv-cache-dtype int8 (compared with accel).
  accel-w4a16  accel on the model as a GPTQ 4-bit group-64 checkpoint, and
  accel-w8a8   accel on it as a compressed-tensors W8A8 checkpoint (int8 per
         channel, dynamic per-token activations): the test quantizers' output,
         written once under ~/.cache/vllm-accel/bench/; compared with stock on
         the unquantized model, as issue 13's targets are.

Both get the same model, dtype, seed, max_model_len, explicit KV-cache size
(kv_cache_memory_bytes; stock CPU would otherwise read gpu_memory_utilization
as a fraction of host RAM) and eager mode (unless --compile). Block size is
each platform's default unless --block-size.

Workloads (random prompt token ids in [100, vocab-100), fixed seed, passed as
TokensPrompt; greedy, ignore_eos, so every request makes exactly output_len tokens)
  W1      64 prompts x 128 in / 128 out
  W3      1 prompt   x  32 in / 256 out
  LONG    8 prompts  x 2000 in / 64 out (long context)
  custom  --num-prompts x --input-len / --output-len

Only ``llm.generate`` is timed (after a short warm-up generate); engine start is
reported separately.

Examples
  python benchmarks/throughput.py                         # W1,W3 on accel and stock
  python benchmarks/throughput.py --workloads W3 --json out.json
  python benchmarks/throughput.py --workloads custom --num-prompts 2 --input-len 8 --output-len 4
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import platform as py_platform
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402

RESULT_TAG = "BENCH_RESULT "
PLATFORM_MISMATCH_RC = 3
GiB = 1 << 30

WORKLOADS: dict[str, dict[str, int]] = {
    "W1": {"num_prompts": 64, "input_len": 128, "output_len": 128},
    "W3": {"num_prompts": 1, "input_len": 32, "output_len": 256},
    "LONG": {"num_prompts": 8, "input_len": 2000, "output_len": 64},
}

ENGINES: dict[str, dict[str, Any]] = {
    # env: variables set for the run (None removes one); llm: LLM kwargs on top of
    # the shared ones.
    "accel": {"platform": "AccelPlatform", "env": {}, "llm": {}},
    "accel-int8": {"platform": "AccelPlatform", "env": {}, "llm": {"kv_cache_dtype": "int8"}},
    "stock": {"platform": "CpuPlatform", "env": {"VLLM_PLUGINS": "lora_filesystem_resolver"},
              "llm": {}},
    "virtual": {"platform": "AccelPlatform",
                "env": {"ACCEL_BACKEND": "virtual", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"},
                "llm": {}},
    # checkpoint: the model quantized by the test quantizers (quantized_model)
    "accel-w4a16": {"platform": "AccelPlatform", "env": {}, "llm": {}, "checkpoint": "w4a16"},
    "accel-w8a8": {"platform": "AccelPlatform", "env": {}, "llm": {}, "checkpoint": "w8a8"},
}
#: what each engine is compared with
BASELINES = (("accel", "stock"), ("accel-int8", "accel"), ("virtual", "accel"),
             ("accel-w4a16", "stock"), ("accel-w8a8", "stock"))

#: read the plugin's MoE expert counts around generate (benchmarks/moe.py sets it)
COUNT_MOE_EXPERTS = False
#: also time the decode steps alone (benchmarks/attention_families.py sets it)
DECODE_STEPS = False
WARMUP_PROMPTS = 2
WARMUP_OUTPUT_LEN = 8
TOKEN_ID_MARGIN = 100


# --------------------------------------------------------------------------- worker


def _probe_worker(worker: Any = None) -> dict[str, Any]:
    """Runs inside vLLM's model worker process (via collective_rpc)."""
    import os as _os

    import torch as _torch

    try:
        affinity = len(_os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "pid": _os.getpid(),
        "torch_threads": _torch.get_num_threads(),
        "omp_num_threads": _os.environ.get("OMP_NUM_THREADS"),
        "cpu_affinity": affinity,
    }


def _moe_experts_counts(worker: Any = None) -> list[int] | None:
    """In the model worker: (layer calls, experts run summed) of the plugin's C++ MoE op
    so far, or None where it is not loaded (stock vLLM)."""
    import ctypes

    if "vllm_accel.ops.cpu_native.moe" not in sys.modules:
        return None
    from vllm_accel.ops.cpu_native import build as native

    lib = native.torch_ops()
    rows = ctypes.c_int64()
    calls = lib.accel_torch_ops_kernel_calls(b"cpu_moe_experts", ctypes.byref(rows))
    return [calls, rows.value]


def _token_prompts(token_lists: list[list[int]]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=ids) for ids in token_lists]


def _engine_core_process() -> Any:
    """vLLM's EngineCore process (a child of this one), or None (in-process engine)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            if "EngineCore" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _cpu_seconds(process: Any) -> float | None:
    if process is None:
        return None
    times = process.cpu_times()
    return times.user + times.system


def run_worker(spec_path: str) -> None:
    with open(spec_path, encoding="utf-8") as fh:
        spec = json.load(fh)
    expected = spec["expected_platform"]

    import torch
    import vllm
    import vllm.platforms
    from vllm import LLM, SamplingParams

    platform_name = type(vllm.platforms.current_platform).__name__
    if platform_name != expected:
        print(f"[worker] PLATFORM MISMATCH: engine {spec['engine']!r} resolved "
              f"current_platform={platform_name}, expected {expected} "
              f"(VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS')!r}, "
              f"VLLM_TARGET_DEVICE={os.environ.get('VLLM_TARGET_DEVICE')!r})", flush=True)
        sys.exit(PLATFORM_MISMATCH_RC)

    t0 = time.perf_counter()
    llm = LLM(**spec["llm"])
    start_s = time.perf_counter() - t0

    # Warm-up (different random ids, so the timed run gets no prefix-cache hits).
    warm = SamplingParams(temperature=0.0, max_tokens=WARMUP_OUTPUT_LEN, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(_token_prompts(spec["warmup_prompts"]), warm, use_tqdm=False)
    warmup_s = time.perf_counter() - t0

    output_len = spec["output_len"]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = _token_prompts(spec["prompts"])
    count_experts = spec.get("probe_threads") and spec.get("count_moe_experts")
    experts0 = llm.collective_rpc(_moe_experts_counts)[0] if count_experts else None
    engine_core = _engine_core_process()
    cpu0 = _cpu_seconds(engine_core)
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    cpu1 = _cpu_seconds(engine_core)

    if len(outputs) != len(prompts):
        raise SystemExit(f"[worker] {len(outputs)} outputs for {len(prompts)} prompts")
    in_tokens = out_tokens = 0
    bad = []
    for i, out in enumerate(outputs):
        n_in = len(out.prompt_token_ids or [])
        n_out = len(out.outputs[0].token_ids)
        if n_in != len(spec["prompts"][i]) or n_out != output_len:
            bad.append((i, n_in, n_out))
        in_tokens += n_in
        out_tokens += n_out
    if bad:
        raise SystemExit(
            f"[worker] requests with wrong token counts (index, in, out), expected "
            f"out={output_len}: {bad[:8]}{' ...' if len(bad) > 8 else ''}"
        )

    # decode steps alone: each request's first to last token, from the engine's own
    # timestamps (log stats on for these runs)
    decode_step_ms = None
    if spec.get("decode_steps"):
        spans = [(o.metrics.last_token_ts - o.metrics.first_token_ts)
                 / max(len(o.outputs[0].token_ids) - 1, 1)
                 for o in outputs if getattr(o, "metrics", None) is not None]
        decode_step_ms = 1e3 * sum(spans) / len(spans) if spans else None

    moe_experts = None
    if experts0 is not None:
        experts1 = llm.collective_rpc(_moe_experts_counts)[0]
        moe_experts = {"layer_calls": experts1[0] - experts0[0],
                       "experts_run": experts1[1] - experts0[1]}
    probe: dict[str, Any] | None = None
    if spec.get("probe_threads"):
        try:
            probe = llm.collective_rpc(_probe_worker)[0]
        except Exception as exc:  # noqa: BLE001 - informational only
            probe = {"error": f"{type(exc).__name__}: {exc}"}

    vcfg = llm.llm_engine.vllm_config
    cache, sched = vcfg.cache_config, vcfg.scheduler_config
    platform_after = type(vllm.platforms.current_platform).__name__
    if platform_after != expected:
        print(f"[worker] PLATFORM MISMATCH: platform changed to {platform_after}, "
              f"expected {expected}", flush=True)
        sys.exit(PLATFORM_MISMATCH_RC)

    result = {
        "workload": spec["workload"],
        "engine": spec["engine"],
        "platform": platform_name,
        "vllm_version": vllm.__version__,
        "num_prompts": len(prompts),
        "input_len": spec["input_len"],
        "output_len": output_len,
        "start_s": start_s,
        "warmup_s": warmup_s,
        "generate_s": generate_s,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "out_tok_s": out_tokens / generate_s,
        "total_tok_s": (in_tokens + out_tokens) / generate_s,
        "block_size": cache.block_size,
        "num_kv_blocks": getattr(cache, "num_gpu_blocks", None),
        "kv_cache_memory_bytes": cache.kv_cache_memory_bytes,
        "enable_prefix_caching": cache.enable_prefix_caching,
        "max_num_seqs": sched.max_num_seqs,
        "max_num_batched_tokens": sched.max_num_batched_tokens,
        "async_scheduling": bool(sched.async_scheduling),
        "enforce_eager": vcfg.model_config.enforce_eager,
        "compilation_mode": getattr(vcfg.compilation_config.mode, "name",
                                    str(vcfg.compilation_config.mode)),
        "dtype": str(vcfg.model_config.dtype),
        "prompts_sha256": spec["prompts_sha256"],
        # EngineCore's CPU seconds per second of generate: ~1 where it spins while the
        # worker runs a step (vLLM's wait), near 0 where it sleeps (the plugin's patch)
        "engine_core_cpu_share": (None if cpu0 is None or cpu1 is None
                                  else round((cpu1 - cpu0) / generate_s, 3)),
        "bench_proc": {"pid": os.getpid(), "torch_threads": torch.get_num_threads()},
        "engine_worker": probe,
        # the plugin's MoE op during generate: layer calls and experts run (summed)
        "moe_experts": moe_experts,
        # (with DECODE_STEPS) ms per token after each request's first, from its timestamps
        "decode_step_ms": decode_step_ms,
    }
    print(RESULT_TAG + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- parent


def default_model() -> str:
    try:
        from vllm_accel.tools.models import default_model_path
    except ImportError as exc:
        raise SystemExit(f"vllm_accel is not importable ({exc}); pass --model") from exc
    return str(default_model_path())


def vocab_size(model: str) -> int:
    config = Path(model) / "config.json"
    if config.is_file():
        with open(config, encoding="utf-8") as fh:
            cfg = json.load(fh)
        size = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
        if size:
            return int(size)
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model)
    return int(getattr(cfg, "vocab_size", None) or cfg.get_text_config().vocab_size)


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    lo, hi = TOKEN_ID_MARGIN, vocab - TOKEN_ID_MARGIN
    if hi <= lo:
        raise SystemExit(f"vocab size {vocab} too small for ids in [{lo}, {hi})")
    rng = random.Random(seed)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


class PlatformMismatch(RuntimeError):
    """An engine did not run on the platform it is meant to measure."""


def run_one(spec: dict[str, Any], env_update: dict[str, str | None], timeout: float,
            verbose: bool) -> dict[str, Any]:
    """One (engine, workload) in a fresh worker process: its result, with its wall time."""
    t0 = time.perf_counter()
    result = run_worker_process(spec, env_update, timeout, verbose)[-1]
    result["process_wall_s"] = time.perf_counter() - t0
    return result


#: (what the compiled engine did, vLLM's log line saying so): a warm start loads
COMPILE_CACHE_MARKERS = (("loaded", "Directly load AOT compilation"),
                         ("compiled", "saved AOT compiled function"))


def run_worker_process(spec: dict[str, Any], env_update: dict[str, str | None], timeout: float,
                       verbose: bool, script: str = __file__) -> list[dict[str, Any]]:
    """Run ``script --worker SPEC`` with ``env_update`` applied; every result line it
    printed. Raises (with the worker's last lines) on failure or a platform mismatch."""
    env = dict(os.environ)
    for key, value in env_update.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bench-spec-",
                                     delete=False, encoding="utf-8") as fh:
        json.dump(spec, fh)
        spec_path = fh.name
    cmd = [sys.executable, os.path.abspath(script), "--worker", spec_path]
    tail: collections.deque[str] = collections.deque(maxlen=60)
    found: list[dict[str, Any]] = []
    compile_cache: list[str] = []  # what vLLM's compile cache did, in log order

    def reader(stream: Any) -> None:
        for line in stream:
            if line.startswith(RESULT_TAG):
                found.append(json.loads(line[len(RESULT_TAG):]))
                continue
            compile_cache.extend(what for what, marker in COMPILE_CACHE_MARKERS if marker in line)
            tail.append(line.rstrip("\n"))
            if verbose:
                print(f"    | {line}", end="", file=sys.stderr, flush=True)

    try:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        thread = threading.Thread(target=reader, args=(proc.stdout,), daemon=True)
        thread.start()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            thread.join(timeout=5)
            print("\n".join(f"    | {ln}" for ln in tail), file=sys.stderr)
            raise TimeoutError(f"worker exceeded --timeout {timeout:.0f}s") from None
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        # EngineCore children may keep the pipe open briefly after the worker exits.
        thread.join(timeout=30)
    finally:
        os.unlink(spec_path)
    if rc == PLATFORM_MISMATCH_RC:
        mismatch = [ln for ln in tail if "PLATFORM MISMATCH" in ln]
        raise PlatformMismatch(mismatch[-1] if mismatch else f"exit {rc}")
    if rc != 0 or not found:
        print("\n".join(f"    | {ln}" for ln in tail), file=sys.stderr)
        raise RuntimeError(f"{spec['workload']}/{spec['engine']} worker failed "
                           f"(exit {rc}{', no ' + RESULT_TAG.strip() if not found else ''})")
    for result in found:
        result["compile_cache"] = "+".join(compile_cache) or "-"
    return found


def fmt_threads(r: dict[str, Any]) -> str:
    probe = r.get("engine_worker") or {}
    if "torch_threads" in probe:
        return f"{probe['torch_threads']}/{probe.get('cpu_affinity')}"
    return "?"


def print_table(results: list[dict[str, Any]]) -> None:
    headers = ["workload", "engine", "platform", "start s", "compile", "generate s",
               "out tok/s", "total tok/s", "blk", "thr/cpu"]
    rows = [[
        r["workload"], r["engine"], r["platform"], f"{r['start_s']:.1f}",
        r.get("compile_cache", "-"),
        f"{r['generate_s']:.3f}", f"{r['out_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
        str(r["block_size"]), fmt_threads(r),
    ] for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    align_left = {0, 1, 2}

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in align_left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths)))

    print(line(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(line(row))


def print_roofline(results, workloads, model, args, bandwidth, all_cores) -> None:
    """Batch-1 workloads against the decode roofline: one core's read bandwidth over
    the bytes a step reads (weights + the KV cache at the mean context; issue 13's
    measure, where stock vLLM's worker runs one thread), and ``all_cores`` (cores,
    their read bandwidth) over the same bytes (the simulator's worker runs a thread
    on each)."""
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}.get(args.dtype)
    if dtype_bytes is None or args.quantization or quantized_checkpoint(model):
        return  # bytes per step of a quantized model depend on its format
    if "num_experts_per_tok" in json.loads((Path(model) / "config.json").read_text()):
        return  # a MoE step's bytes depend on the experts it runs (benchmarks/moe.py)
    cores, bandwidth_all = all_cores
    for r in results:
        w = workloads[r["workload"]]
        if w["num_prompts"] != 1 or ENGINES[r["engine"]].get("checkpoint"):
            continue
        context = w["input_len"] + w["output_len"] // 2
        step = roofline.decode_step_bytes(model, dtype_bytes, context)
        r["roofline_tok_s"] = round(bandwidth / step, 1)
        r["pct_of_roofline"] = round(100 * r["out_tok_s"] * step / bandwidth, 1)
        r["roofline_all_cores_tok_s"] = round(bandwidth_all / step, 1)
        r["pct_of_roofline_all_cores"] = round(100 * r["out_tok_s"] * step / bandwidth_all, 1)
        print(f"roofline {r['workload']}/{r['engine']}: {step / 1e6:.0f} MB per decode step "
              f"-> {r['roofline_tok_s']} tok/s on one core, {r['roofline_all_cores_tok_s']} "
              f"on {cores}; measured {r['out_tok_s']:.1f} = {r['pct_of_roofline']}% / "
              f"{r['pct_of_roofline_all_cores']}%")


def quantized_model(model: str, kind: str) -> str:
    """The float checkpoint ``model`` quantized by the test quantizers (``kind``
    w4a16: GPTQ 4-bit sym group 64, since 128 does not divide SmolLM2's 576
    inputs; w8a8: compressed-tensors int8 per channel, dynamic per-token
    activations), written once under ~/.cache/vllm-accel/bench/."""
    suffix = {"w4a16": "-gptq-4bit-g64", "w8a8": "-w8a8"}[kind]
    dst = Path.home() / ".cache" / "vllm-accel" / "bench" / (Path(model).name + suffix)
    if not (dst / "config.json").is_file():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        print(f"writing the {kind.upper()} checkpoint to {dst} ...", flush=True)
        if kind == "w4a16":
            from quantizer import quantize_checkpoint

            quantize_checkpoint(Path(model), dst, bits=4, group_size=64)
        else:
            from quantizer_int8 import quantize_checkpoint_int8

            quantize_checkpoint_int8(Path(model), dst)
    return str(dst)


def quantized_checkpoint(model: str) -> bool:
    config = Path(model) / "config.json"
    return config.is_file() and "quantization_config" in json.loads(config.read_text())


def compute_ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    by = {(r["workload"], r["engine"]): r for r in results}
    ratios = {}
    for wl in dict.fromkeys(r["workload"] for r in results):
        for engine, base in BASELINES:
            a, s = by.get((wl, engine)), by.get((wl, base))
            if a and s and s["out_tok_s"] > 0:
                ratios[f"{wl} {engine}/{base}"] = a["out_tok_s"] / s["out_tok_s"]
    return ratios


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help="model path/name (default: vllm_accel.tools.models.default_model_path())")
    p.add_argument("--workloads", default="W1,W3",
                   help="comma list of W1, W3, LONG, custom (default: %(default)s)")
    p.add_argument("--engines", default="accel,stock", help=f"comma list of {', '.join(ENGINES)} (default: %(default)s)")
    p.add_argument("--num-prompts", type=int, default=None, help="custom workload: prompts (default 1)")
    p.add_argument("--input-len", type=int, default=None, help="custom workload: input tokens (default 32)")
    p.add_argument("--output-len", type=int, default=None, help="custom workload: output tokens (default 32)")
    p.add_argument("--dtype", default="bfloat16", help="model dtype (default: %(default)s)")
    p.add_argument("--kv-cache-gib", type=float, default=2.0,
                   help="explicit KV cache size for both engines, as kv_cache_memory_bytes "
                        "(default: %(default)s)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: 4096, raised if a workload needs more")
    p.add_argument("--block-size", type=int, default=None,
                   help="default: each platform's own default")
    p.add_argument("--quantization", default=None,
                   help="vLLM --quantization for every engine (e.g. w8a16); quantized "
                        "checkpoints are detected without it")
    p.add_argument("--compile", action="store_true",
                   help="use vLLM's default compilation for both (default: enforce_eager)")
    p.add_argument("--seed", type=int, default=0, help="engine seed and prompt RNG seed (default: %(default)s)")
    p.add_argument("--no-thread-probe", action="store_true",
                   help="skip reading the engine worker's torch thread count (the probe "
                        "sets VLLM_ALLOW_INSECURE_SERIALIZATION=1 for both engines)")
    p.add_argument("--timeout", type=float, default=1800.0, help="per-run limit in seconds (default: %(default)s)")
    p.add_argument("--json", dest="json_path", default=None, help="also save results here")
    p.add_argument("-v", "--verbose", action="store_true", help="stream worker logs to stderr")
    p.add_argument("--worker", metavar="SPEC_JSON", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker)
        return 0

    workloads = dict(WORKLOADS)
    custom_given = any(v is not None for v in (args.num_prompts, args.input_len, args.output_len))
    wl_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if "custom" in wl_names or custom_given:
        workloads["custom"] = {
            "num_prompts": args.num_prompts if args.num_prompts is not None else 1,
            "input_len": args.input_len if args.input_len is not None else 32,
            "output_len": args.output_len if args.output_len is not None else 32,
        }
        if custom_given and "custom" not in wl_names:
            print("note: --num-prompts/--input-len/--output-len only apply to workload 'custom'",
                  file=sys.stderr)
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name in wl_names:
        if name not in workloads:
            raise SystemExit(f"unknown workload {name!r} (choose from W1, W3, LONG, custom)")
        w = workloads[name]
        if min(w.values()) < 1:
            raise SystemExit(f"workload {name}: all sizes must be >= 1 ({w})")
    for name in engines:
        if name not in ENGINES:
            raise SystemExit(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})")

    model = args.model or default_model()
    if args.model is None and not (Path(model) / "config.json").is_file():
        raise SystemExit(f"default model not found at {model}; run "
                         "`python -m vllm_accel.tools.models prepare-default` first")
    vocab = vocab_size(model)
    need_len = max(workloads[w]["input_len"] + workloads[w]["output_len"] for w in wl_names)
    max_model_len = args.max_model_len or max(4096, need_len)
    if need_len > max_model_len:
        raise SystemExit(f"--max-model-len {max_model_len} < {need_len} needed by the workloads")

    llm_kwargs: dict[str, Any] = {
        "model": model,
        "dtype": args.dtype,
        "seed": args.seed,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": int(args.kv_cache_gib * GiB),
        "enforce_eager": not args.compile,
    }
    if args.block_size is not None:
        llm_kwargs["block_size"] = args.block_size
    models = {e: quantized_model(model, ENGINES[e]["checkpoint"])
              if ENGINES[e].get("checkpoint") else model for e in engines}
    if args.quantization is not None:
        llm_kwargs["quantization"] = args.quantization

    import torch

    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    host = {
        "python": sys.version.split()[0],
        "machine": py_platform.machine(),
        "os_cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "torch": torch.__version__,
        "torch_threads_parent": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
    }
    print(f"model: {model} (vocab {vocab})")
    print(f"settings: dtype={args.dtype} kv_cache={args.kv_cache_gib:g} GiB "
          f"max_model_len={max_model_len} block_size={args.block_size or 'platform default'} "
          f"{'compiled (vLLM default)' if args.compile else 'enforce_eager'} seed={args.seed}")
    print(f"host: cpu_count={host['os_cpu_count']} affinity={affinity} "
          f"torch {torch.__version__} threads in this process={host['torch_threads_parent']} "
          f"OMP_NUM_THREADS={host['OMP_NUM_THREADS']}")
    print(f"workloads: {', '.join(f'{w}={workloads[w]}' for w in wl_names)}; "
          f"engines: {', '.join(engines)}", flush=True)
    bandwidth = roofline.read_bandwidth()
    cores = roofline.all_cores()
    bandwidth_all = roofline.read_bandwidth(threads=cores)
    host.update(cpu=roofline.cpu_model(), cpu_flags=roofline.cpu_flags(),
                kernel_build=roofline.kernel_build(),
                read_bandwidth_GBps=round(bandwidth / 1e9, 2),
                read_bandwidth_all_cores_GBps=round(bandwidth_all / 1e9, 2))
    print(f"CPU: {host['cpu']}; kernel flags: {' '.join(host['cpu_flags']) or 'none'}; "
          f"read bandwidth: single core {bandwidth / 1e9:.1f} GB/s, {cores} cores "
          f"{bandwidth_all / 1e9:.1f} GB/s", flush=True)
    print(f"plugin kernels built for: {host['kernel_build']}", flush=True)

    results: list[dict[str, Any]] = []
    failures: list[str] = []
    for wi, wl in enumerate(wl_names):
        w = workloads[wl]
        prompts = random_prompts(w["num_prompts"], w["input_len"], vocab, args.seed + wi)
        warmup = random_prompts(WARMUP_PROMPTS, min(w["input_len"], 32), vocab,
                                args.seed + 1_000_003 + wi)
        digest = hashlib.sha256(json.dumps(prompts).encode()).hexdigest()[:16]
        for engine in engines:
            spec = {
                "workload": wl,
                "engine": engine,
                "expected_platform": ENGINES[engine]["platform"],
                "llm": {**llm_kwargs, **ENGINES[engine]["llm"], "model": models[engine]},
                "prompts": prompts,
                "prompts_sha256": digest,
                "warmup_prompts": warmup,
                "input_len": w["input_len"],
                "output_len": w["output_len"],
                "probe_threads": not args.no_thread_probe,
                "count_moe_experts": COUNT_MOE_EXPERTS,
                "decode_steps": DECODE_STEPS,
            }
            if DECODE_STEPS:  # the engine's per-request token timestamps
                spec["llm"] = {**spec["llm"], "disable_log_stats": False}
            env = dict(ENGINES[engine]["env"])
            if not args.no_thread_probe:
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
            print(f"[{wl}/{engine}] starting ({w['num_prompts']} x {w['input_len']} in / "
                  f"{w['output_len']} out) ...", flush=True)
            try:
                r = run_one(spec, env, args.timeout, args.verbose)
            except PlatformMismatch as exc:
                print(f"[{wl}/{engine}] ABORTING: {exc}", file=sys.stderr, flush=True)
                return 2
            except (RuntimeError, TimeoutError) as exc:
                print(f"[{wl}/{engine}] FAILED: {exc}", file=sys.stderr, flush=True)
                failures.append(f"{wl}/{engine}: {exc}")
                continue
            if r["platform"] != ENGINES[engine]["platform"]:  # the worker checks this too
                print(f"[{wl}/{engine}] ABORTING: platform {r['platform']}, expected "
                      f"{ENGINES[engine]['platform']}", file=sys.stderr, flush=True)
                return 2
            results.append(r)
            share = r.get("engine_core_cpu_share")
            print(f"[{wl}/{engine}] {r['platform']}: start {r['start_s']:.1f}s, generate "
                  f"{r['generate_s']:.3f}s, {r['out_tok_s']:.1f} out tok/s "
                  f"(engine worker threads/cpus {fmt_threads(r)}; EngineCore CPU "
                  f"{'?' if share is None else f'{100 * share:.0f}%'})", flush=True)

    print()
    print_table(results)
    print_roofline(results, workloads, model, args, bandwidth, (cores, bandwidth_all))
    ratios = compute_ratios(results)
    if ratios:
        print()
        print("output tok/s ratios:")
        for wl, ratio in ratios.items():
            print(f"  {wl}: {ratio:.3f}x")
    threads = sorted({fmt_threads(r) for r in results})
    print(f"\nengine worker torch threads/cpu affinity: {', '.join(threads) or '?'}; "
          f"host cpu_count={host['os_cpu_count']}, affinity={affinity}")

    if args.json_path:
        payload = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "argv": sys.argv[1:],
            "host": host,
            "llm_kwargs": {k: v for k, v in llm_kwargs.items()},
            "workloads": {w: workloads[w] for w in wl_names},
            "results": results,
            "ratio_out_tok_s_accel_over_stock": ratios,
            "failures": failures,
        }
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(payload, fh, indent=2)
        print(f"saved {args.json_path}")

    if failures:
        print("\nFAILED runs:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
