#!/usr/bin/env python
"""Speculative decoding and LoRA on the simulated GCU, against the plugin's own plain
decoding in one run (the default model, bf16, vLLM's default mode)::

    python benchmarks/serving_features.py [--json PATH]

- ``ngram``: prompts that repeat a passage (where prompt lookup finds its drafts), 128
  tokens each, with and without ``--speculative-config '{"method": "ngram", ...}'``, one
  request alone and 8 at once: output tokens/s of both, the speed-up, and the drafts'
  acceptance rate (vLLM's counters). Verifying 4 drafts makes a step 5 rows a request:
  it pays where a step is bound by reading the weights (one request), not where the
  rows' arithmetic already is (8 requests on a 2-core CPU).
- ``lora``: batch-16 decode (16 x 32 in / 64 out) with 4 LoRA adapters active (rank 8 on
  q/k/v/o and gate/up/down, 4 requests each) and with none: milliseconds per decode step
  from the engine's token timestamps, and their ratio. (vLLM's CPU path runs LoRA models
  eagerly, so the plain run here is eager too.)

Each engine runs in a fresh process (this script with ``--worker``); the adapters are
written once under ``~/.cache/vllm-accel/bench/lora-adapters``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fresh_process  # noqa: E402
import roofline  # noqa: E402
import throughput  # noqa: E402

ADAPTERS = Path.home() / ".cache" / "vllm-accel" / "bench" / "lora-adapters"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PASSAGE = ("The simulated GCU runs vLLM's own engine with the plugin's kernels. It reads the "
           "weights once per step and writes the new keys and values into the paged cache. ")


def write_adapters(model: Path, count: int = 4, rank: int = 8) -> list[Path]:
    """PEFT LoRA adapters for the default model (random A, small random B), written once."""
    paths = [ADAPTERS / f"adapter{i}" for i in range(count)]
    if all((p / "adapter_config.json").is_file() for p in paths):
        return paths
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(model / "model.safetensors"), "pt") as f:
        shapes = {name: f.get_slice(name).get_shape() for name in f.keys()}
    for i, path in enumerate(paths):
        g = torch.Generator().manual_seed(i)
        tensors = {}
        for name, shape in shapes.items():
            module = name.rsplit(".", 1)[0]
            if name.endswith(".weight") and module.rsplit(".", 1)[-1] in TARGETS:
                out_f, in_f = shape
                tensors[f"base_model.model.{module}.lora_A.weight"] = (
                    torch.randn(rank, in_f, generator=g) * in_f ** -0.5).bfloat16()
                tensors[f"base_model.model.{module}.lora_B.weight"] = (
                    torch.randn(out_f, rank, generator=g) * 0.01).bfloat16()
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
            "target_modules": list(TARGETS), "lora_dropout": 0.0, "bias": "none",
            "base_model_name_or_path": str(model)}))
    return paths


def run_worker(spec_path: str) -> None:
    """One engine, one timed generate; prints ``BENCH_RESULT <json>``."""
    spec = json.loads(Path(spec_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(**spec["llm"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    lora = [None if a is None else LoRARequest(f"a{a}", a + 1, spec["adapters"][a])
            for a in spec.get("lora", [None] * len(prompts))]
    # warm-up, long enough for the n-gram proposer's first drafts (its JIT compile)
    llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                 lora_request=lora[:2], use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    steps = [(o.metrics.last_token_ts - o.metrics.first_token_ts)
             / (len(o.outputs[0].token_ids) - 1) for o in outs if o.metrics is not None]
    metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
    drafted = metrics.get("vllm:spec_decode_num_draft_tokens") or 0
    accepted = metrics.get("vllm:spec_decode_num_accepted_tokens") or 0
    first = [o.metrics.first_token_ts - o.metrics.queued_ts for o in outs
             if o.metrics is not None]
    print("BENCH_RESULT " + json.dumps({
        "out_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / generate_s,
        "generate_s": generate_s,
        "first_token_ms": 1e3 * sum(first) / len(first) if first else None,
        "decode_step_ms": 1e3 * sum(steps) / len(steps) if steps else None,
        "acceptance": accepted / drafted if drafted else None}), flush=True)


def run(name: str, spec: dict) -> dict:
    return fresh_process.run(__file__, name, spec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", dest="json_path")
    p.add_argument("--only", choices=("ngram", "lora"),
                   help="run one of the two (the other's numbers stay in --json's file)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        run_worker(args.worker)
        return 0
    from transformers import AutoTokenizer

    model = Path(throughput.default_model())
    tok = AutoTokenizer.from_pretrained(model)
    base = {"model": str(model), "dtype": "bfloat16", "max_model_len": 1024, "seed": 0,
            "disable_log_stats": False, "kv_cache_memory_bytes": 1 << 30}
    passage = tok(PASSAGE * 6)["input_ids"]
    ngram_prompts = [passage[i:] for i in range(8)]
    lora_prompts = throughput.random_prompts(16, 32, tok.vocab_size, 0)
    adapters = [str(a) for a in write_adapters(model)]
    host = {"cpu": roofline.cpu_model(), "cpu_flags": roofline.cpu_flags(),
            "date": time.strftime("%Y-%m-%d")}
    print(f"CPU: {host['cpu']} ({' '.join(host['cpu_flags'])})", flush=True)
    previous = Path(args.json_path) if args.json_path else None
    results = (json.loads(previous.read_text()) if args.only and previous and previous.is_file() else {})
    results["host"] = host  # (--only: the other part's numbers kept from the file)
    if args.only != "lora":
        ngram_bench(results, base, ngram_prompts)
    if args.only != "ngram":
        lora_bench(results, base, lora_prompts, adapters)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
        print(f"saved {args.json_path}")
    return 0


def ngram_bench(results: dict, base: dict, prompts: list[list[int]]) -> None:
    """Plain and n-gram decoding of one request, then of all 8 at once."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    for batch in (1, len(prompts)):
        plain = run(f"plain-b{batch}", {"llm": base, "prompts": prompts[:batch],
                                        "output_len": 128})
        ngram = run(f"ngram-b{batch}", {"llm": {**base, "speculative_config": spec},
                                        "prompts": prompts[:batch], "output_len": 128})
        results[f"ngram_batch{batch}"] = {"plain": plain, "ngram": ngram,
                                          "speed_up": ngram["out_tok_s"] / plain["out_tok_s"]}
        print(f"n-gram speculative decoding, batch {batch}: "
              f"{ngram['out_tok_s'] / plain['out_tok_s']:.2f}x plain, "
              f"acceptance {ngram['acceptance']:.2f}", flush=True)


def lora_bench(results: dict, base: dict, prompts: list[list[int]], adapters: list[str]) -> None:
    lora_llm = {**base, "enable_lora": True, "max_loras": 4, "max_lora_rank": 8}
    none = run("lora-none", {"llm": lora_llm, "prompts": prompts, "output_len": 64})
    four = run("lora-4", {"llm": lora_llm, "prompts": prompts, "output_len": 64,
                          "adapters": adapters, "lora": [i % 4 for i in range(16)]})
    results["lora"] = {"none": none, "four_adapters": four,
                       "step_ratio": four["decode_step_ms"] / none["decode_step_ms"]}
    print(f"LoRA: batch-16 decode step {four['decode_step_ms']:.1f} ms with 4 adapters vs "
          f"{none['decode_step_ms']:.1f} ms without: {results['lora']['step_ratio']:.2f}x",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
