#!/usr/bin/env python
"""Mixture-of-experts decode: the plugin vs stock vLLM CPU on a random-weight model of
realistic shape, in one run::

    python benchmarks/moe.py [--modes compiled,eager] [--engines accel,stock,accel-w4a16]
                             [--json PATH]

The model is Qwen3-MoE-shaped (32 experts, top-4, hidden 1024, expert width 512, 16
layers, vocab 49152: ~1.0 B parameters, ~0.23 B active per token), bf16, written once
to ``~/.cache/vllm-accel/bench/qwen3-moe-1b`` from a fixed seed (no download). Weights
are drawn so that routing spreads over the experts (router std 0.3).

``accel-w4a16`` serves the model as a GPTQ 4-bit group-64 checkpoint (every expert and
linear quantized by the tests' quantizer, written once), against stock bf16.

Workloads (``throughput.py``'s engines and timing): batch 1 (1 x 32 in / 128 out),
batch 16 (16 x 32 / 64), batch 64 (64 x 32 / 32). For the plugin the benchmark reads how
many experts each MoE layer call ran (the C++ op counts them), and turns that into the
batch-1 roofline: the bytes a step reads (every weight but the experts', the experts it
ran, the KV cache) at one core's measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402

MODEL_DIR = Path.home() / ".cache" / "vllm-accel" / "bench" / "qwen3-moe-1b"
SHAPE = dict(vocab_size=49152, hidden_size=1024, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, head_dim=64, intermediate_size=2816,
             moe_intermediate_size=512, num_experts=32, num_experts_per_tok=4,
             norm_topk_prob=True, max_position_embeddings=4096, tie_word_embeddings=False,
             rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
WORKLOADS = {"B1": {"num_prompts": 1, "input_len": 32, "output_len": 128},
             "B16": {"num_prompts": 16, "input_len": 32, "output_len": 64},
             "B64": {"num_prompts": 64, "input_len": 32, "output_len": 32}}


def build_model(path: Path = MODEL_DIR) -> Path:
    """Write the random-weight checkpoint once (bf16 safetensors, ~2 GB)."""
    if (path / "config.json").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    print(f"writing the random-weight Qwen3-MoE checkpoint to {path} ...", flush=True)
    config = Qwen3MoeConfig(**SHAPE)
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 if "gate.weight" in name else 0.02)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    # the default model's tokenizer (same vocabulary size), so vLLM starts as usual
    tokenizer_dir = Path(throughput.default_model())
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, tmp / name)
    tmp.rename(path)
    return path


def num_experts(cfg: dict) -> int:
    """Routed experts of a layer (transformers writes Qwen3-MoE's as num_local_experts)."""
    return cfg.get("num_experts") or cfg["num_local_experts"]


def expert_bytes(path: Path) -> tuple[int, int]:
    """(bytes of one expert's three matrices, bytes of every other weight a batch-1 step
    reads: attention, norms, routers, LM head, one embedding row), bf16."""
    cfg = json.loads((path / "config.json").read_text())
    h, i, layers = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads, head = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attention = h * (heads + 2 * kv_heads) * head + heads * head * h + 2 * head + 2 * h
    router = num_experts(cfg) * h
    other = layers * (attention + router) + cfg["vocab_size"] * h + 2 * h
    return 3 * h * i * 2, other * 2


def roofline(results: list[dict], path: Path, bandwidth: float) -> None:
    """Batch-1 rows: the step's bytes from the experts the plugin ran, at ``bandwidth``."""
    per_expert, other = expert_bytes(path)
    cfg = json.loads((path / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    counts = {r["workload"]: r["moe_experts"] for r in results
              if r["engine"] == "accel" and r.get("moe_experts")}
    for wl, c in counts.items():
        w = WORKLOADS[wl]
        steps = w["output_len"]
        per_call = c["experts_run"] / max(c["layer_calls"], 1)
        print(f"{wl}: {c['layer_calls']} MoE layer calls ({c['layer_calls'] / layers:.0f} steps "
              f"incl. prefill), {per_call:.2f} of {num_experts(cfg)} experts per layer call")
        if w["num_prompts"] != 1:
            continue
        context = w["input_len"] + steps // 2
        kv = 2 * layers * cfg["num_key_value_heads"] * cfg["head_dim"] * context * 2
        step = other + layers * per_call * per_expert + kv
        for r in results:
            if r["workload"] == wl and r["engine"] in ("accel", "stock"):  # (bf16 bytes)
                r["step_MB"] = round(step / 1e6, 1)
                r["roofline_tok_s"] = round(bandwidth / step, 1)
                r["pct_of_roofline"] = round(100 * r["out_tok_s"] * step / bandwidth, 1)
                print(f"  {r['engine']}: {r['out_tok_s']:.1f} tok/s = {r['pct_of_roofline']}% of "
                      f"{r['roofline_tok_s']} ({step / 1e6:.0f} MB a step at "
                      f"{bandwidth / 1e9:.1f} GB/s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--modes", default="compiled,eager", help="comma list of compiled, eager")
    p.add_argument("--workloads", default="B1,B16,B64")
    p.add_argument("--engines", default="accel,stock")
    p.add_argument("--json", dest="json_path", help="save the results here")
    p.add_argument("--reuse", action="store_true",
                   help="take a mode's runs from /tmp/moe-bench-MODE.json where it exists")
    args = p.parse_args()
    model = build_model()
    throughput.WORKLOADS.update(WORKLOADS)
    throughput.COUNT_MOE_EXPERTS = True
    payload = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": str(model),
               "shape": SHAPE, "modes": {}}
    rc = 0
    for mode in args.modes.split(","):
        out = Path(f"/tmp/moe-bench-{mode}.json")
        argv = ["--model", str(model), "--workloads", args.workloads, "--engines", args.engines,
                "--json", str(out), "--max-model-len", "1024"] + (
                    ["--compile"] if mode == "compiled" else [])
        print(f"\n=== {mode} ===", flush=True)
        if not (args.reuse and out.is_file()):
            rc |= throughput.main(argv)
        run = json.loads(out.read_text())
        roofline(run["results"], model, run["host"]["read_bandwidth_GBps"] * 1e9)
        payload["host"] = run["host"]
        payload["modes"][mode] = {"results": run["results"],
                                  "ratio_out_tok_s_accel_over_stock":
                                      run["ratio_out_tok_s_accel_over_stock"]}
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
        print(f"saved {args.json_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
