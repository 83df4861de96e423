#!/usr/bin/env python
"""Whisper transcription: the vllm_accel plugin (simulated GCU) vs stock vLLM CPU, in one
run, float32 (Whisper's checkpoints), vLLM's default (compiled) mode or ``--eager``::

    python benchmarks/speech.py [--json PATH] [--requests 8] [--tokens 64] [--eager]

The model is whisper-tiny's shape (4 encoder and 4 decoder layers, d_model 384, 6 heads
of 64, a 30 s window: 1500 encoder positions) with random weights and the default
model's BPE as its vocabulary (~49k), written once under
``~/.cache/vllm-accel/bench/whisper-tiny-shape``. Each engine runs in a fresh process
(this script with ``--worker``): after a warm-up, ``--requests`` recordings of 30 s at
once, ``--tokens`` greedy tokens each (``ignore_eos``): wall time and requests/s, time to
first token (the encoder runs then) and the mean decode step from the engine's token
timestamps, and the accel/stock ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
import fresh_process  # noqa: E402
import roofline  # noqa: E402
import throughput  # noqa: E402

MODEL = Path.home() / ".cache" / "vllm-accel" / "bench" / "whisper-tiny-shape"
#: the plugin, and stock vLLM CPU (the allowlist names no plugin of ours: throughput.py's)
ENGINES = {"accel": {}, "stock": {"VLLM_PLUGINS": "lora_filesystem_resolver"}}


def write_model() -> Path:
    """whisper-tiny's shape with random weights (once)."""
    if (MODEL / "model.safetensors").is_file():
        return MODEL
    import torch
    from transformers import (WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor)

    from speech_models import build_tiny_whisper

    import shutil
    import tempfile

    MODEL.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=MODEL.parent))
    small = build_tiny_whisper(staging / "tiny", Path(throughput.default_model()))
    processor = WhisperProcessor.from_pretrained(small)
    config = WhisperConfig.from_pretrained(small)
    config.update(dict(d_model=384, encoder_layers=4, decoder_layers=4,
                       encoder_attention_heads=6, decoder_attention_heads=6,
                       encoder_ffn_dim=1536, decoder_ffn_dim=1536, max_source_positions=1500))
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config)
    model.save_pretrained(staging / "model")
    WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80),
                     tokenizer=processor.tokenizer).save_pretrained(staging / "model")
    (staging / "model").rename(MODEL)  # whole, or not there: a killed run leaves no half model
    shutil.rmtree(staging)
    return MODEL


def run_worker(spec_path: str) -> None:
    """One engine, a warm-up and one timed batch; prints ``BENCH_RESULT <json>``."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams

    from speech_models import TRANSCRIBE, random_audio

    llm = LLM(model=spec["model"], dtype="float32", max_model_len=448, seed=0,
              enforce_eager=spec["eager"], max_num_seqs=spec["requests"],
              kv_cache_memory_bytes=1 << 30,
              max_num_batched_tokens=2048,  # a whole 1500-position recording in a step
              limit_mm_per_prompt={"audio": 1}, disable_log_stats=False)  # (token times)
    params = SamplingParams(temperature=0.0, max_tokens=spec["tokens"], ignore_eos=True)

    def requests(count: int, seed: int) -> list[dict]:
        return [{"encoder_prompt": {"prompt": "", "multi_modal_data": {
            "audio": (random_audio(seed + i, 30 * 16000), 16000)}},
            "decoder_prompt": TRANSCRIBE} for i in range(count)]

    llm.generate(requests(2, 100), params, use_tqdm=False)  # warm-up
    batch = requests(spec["requests"], 0)
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    first = [o.metrics.first_token_ts - o.metrics.queued_ts for o in outs]
    steps = [(o.metrics.last_token_ts - o.metrics.first_token_ts)
             / (len(o.outputs[0].token_ids) - 1) for o in outs]
    print("BENCH_RESULT " + json.dumps({
        "wall_s": wall, "requests_s": len(outs) / wall,
        "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "first_token_ms": 1e3 * sum(first) / len(first),
        "decode_step_ms": 1e3 * sum(steps) / len(steps)}), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--eager", action="store_true", help="both engines eager")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args.worker)
        return 0
    spec = {"model": str(write_model()), "requests": args.requests, "tokens": args.tokens,
            "eager": args.eager}
    host = {"cpu": roofline.cpu_model(), "cpu_flags": roofline.cpu_flags(),
            "date": time.strftime("%Y-%m-%d")}
    print(f"CPU: {host['cpu']} ({' '.join(host['cpu_flags'])})", flush=True)
    results = {"host": host, "workload": spec}
    for name, env in ENGINES.items():
        results[name] = fresh_process.run(__file__, name, spec, env)
    results["accel_over_stock"] = {
        "requests_s": results["accel"]["requests_s"] / results["stock"]["requests_s"],
        "first_token_ms": results["accel"]["first_token_ms"] / results["stock"]["first_token_ms"],
        "decode_step_ms": results["accel"]["decode_step_ms"] / results["stock"]["decode_step_ms"]}
    print(f"accel/stock: {results['accel_over_stock']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
        print(f"saved {args.json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
