#!/usr/bin/env python
"""Attention beyond plain causal: the plugin vs stock vLLM CPU on random-weight models of
realistic layer shapes (fewer layers, the default model's vocabulary), in one run::

    python benchmarks/attention_families.py [--suites window,gemma2,deepseek] [--modes compiled]
                                           [--json PATH]

Suites (models written once under ``~/.cache/vllm-accel/bench/``, fixed seeds, bf16):

- ``window``: a Mistral-shaped model (hidden 1024, 8 layers, 16/4 heads of 64) with a
  1024-token sliding window; one request decoding after a 1k, 4k and 16k-token prompt.
  Prints each context's time per decode step (from the engine's first and last token
  timestamps of the request) and the 16k / 1k ratio: flat beyond the window when only
  the window's blocks are read.
- ``gemma2``: Gemma-2-2B's layer shapes (hidden 2304, 8/4 heads of 256, MLP 9216,
  alternating 4096-token windows, logit soft-caps 50 / 30), 13 of its 26 layers.
- ``deepseek``: DeepSeek-V2-Lite's layer shapes (hidden 2048, 16 heads, MLA latent 512 +
  rope 64, 64 experts top-6 of width 1408 plus 2 shared, the first layer dense), 4 of its
  27 layers. For batch 1 the MLA roofline: the bytes a decode step reads (every weight
  but the routed experts', the routed experts the plugin ran, the latent cache) at one
  core's measured read bandwidth.

Workloads of ``gemma2`` / ``deepseek``: B1 (1 x 32 in / 128 out) and B64 (64 x 32 / 32),
``throughput.py``'s engines and timing.
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

BENCH = Path.home() / ".cache" / "vllm-accel" / "bench"
VOCAB = 49152
COMMON = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
#: suite -> (model directory name, HF config class, its arguments)
MODELS = {
    "window": ("mistral-window1k", "MistralConfig", dict(
        hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
        head_dim=64, intermediate_size=2816, sliding_window=1024,
        max_position_embeddings=32768, tie_word_embeddings=False)),
    "gemma2": ("gemma2-2b-13l", "Gemma2Config", dict(
        hidden_size=2304, num_hidden_layers=13, num_attention_heads=8, num_key_value_heads=4,
        head_dim=256, intermediate_size=9216, sliding_window=4096, query_pre_attn_scalar=256,
        attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        max_position_embeddings=8192, tie_word_embeddings=True)),
    "deepseek": ("deepseek-v2-lite-4l", "DeepseekV2Config", dict(
        hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16,
        q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, intermediate_size=10944, moe_intermediate_size=1408,
        n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, max_position_embeddings=4096,
        tie_word_embeddings=False)),
}
WINDOW_WORKLOADS = {f"CTX{n // 1024}K": {"num_prompts": 1, "input_len": n, "output_len": 65}
                    for n in (1024, 4096, 16384)}
BATCH_WORKLOADS = {"B1": {"num_prompts": 1, "input_len": 32, "output_len": 128},
                   "B64": {"num_prompts": 64, "input_len": 32, "output_len": 32}}


def build_model(suite: str) -> Path:
    """Write the suite's random-weight checkpoint once (bf16 safetensors)."""
    name, config_cls, shape = MODELS[suite]
    path = BENCH / name
    if (path / "config.json").is_file():
        return path
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    print(f"writing the random-weight {config_cls} checkpoint to {path} ...", flush=True)
    config = getattr(transformers, config_cls)(**COMMON, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3 if pname.endswith("mlp.gate.weight") else 0.02)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer_dir = Path(throughput.default_model())  # (same vocabulary size)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, tmp / f)
    tmp.rename(path)
    return path


def deepseek_step_bytes(cfg: dict, experts_per_layer_call: float, context: int) -> float:
    """Bytes of a batch-1 decode step (bf16): the weights it reads, the routed experts it
    ran, the latent cache of ``context`` tokens."""
    h, n, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    lora, rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, v = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    attention = (h * n * (nope + rope) + h * (lora + rope) + lora * n * (nope + v)
                 + n * v * h + lora + 2 * h)
    expert = 3 * h * cfg["moe_intermediate_size"]
    dense = cfg["first_k_dense_replace"]
    moe_layers = layers - dense
    weights = (layers * attention + dense * 3 * h * cfg["intermediate_size"]
               + moe_layers * (cfg["n_routed_experts"] * h + cfg["n_shared_experts"] * expert)
               + cfg["vocab_size"] * h + h)
    routed = moe_layers * experts_per_layer_call * expert
    cache = layers * context * (lora + rope)
    return 2.0 * (weights + routed + cache)


def report_window(results: list[dict]) -> dict:
    """Per engine: decode step ms per context and the longest / shortest ratio."""
    summary = {}
    for engine in sorted({r["engine"] for r in results}):
        steps = {r["workload"]: r["decode_step_ms"] for r in results
                 if r["engine"] == engine and r.get("decode_step_ms")}
        if not steps:
            continue
        first, last = steps.get("CTX1K"), steps.get("CTX16K")
        ratio = last / first if first and last else None
        summary[engine] = {"decode_step_ms": steps, "ratio_16k_over_1k": ratio}
        print(f"{engine}: decode step " + ", ".join(f"{k} {v:.2f} ms" for k, v in steps.items())
              + (f"; 16k / 1k = {ratio:.2f}" if ratio else ""))
    return summary


def report_mla(results: list[dict], path: Path, bandwidth: float) -> None:
    cfg = json.loads((path / "config.json").read_text())
    moe_layers = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    for r in results:
        c = r.get("moe_experts")
        if r["workload"] != "B1" or r["engine"] != "accel" or not c:
            continue
        per_call = c["experts_run"] / max(c["layer_calls"], 1)
        w = BATCH_WORKLOADS["B1"]
        step = deepseek_step_bytes(cfg, per_call, w["input_len"] + w["output_len"] // 2)
        for row in results:
            if row["workload"] == "B1":
                row["step_MB"] = round(step / 1e6, 1)
                row["pct_of_roofline"] = round(100 * row["out_tok_s"] * step / bandwidth, 1)
                print(f"B1 {row['engine']}: {row['out_tok_s']:.1f} tok/s = "
                      f"{row['pct_of_roofline']}% of the MLA roofline ({step / 1e6:.0f} MB a "
                      f"step, {per_call:.2f} routed experts a layer call over {moe_layers} MoE "
                      f"layers, {bandwidth / 1e9:.1f} GB/s)")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--suites", default="window,gemma2,deepseek")
    p.add_argument("--modes", default="compiled", help="comma list of compiled, eager")
    p.add_argument("--engines", default="accel,stock")
    p.add_argument("--json", dest="json_path", help="save the results here")
    args = p.parse_args()
    payload = {"created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "suites": {}}
    rc = 0
    for suite in args.suites.split(","):
        model = build_model(suite)
        window = suite == "window"
        workloads = WINDOW_WORKLOADS if window else BATCH_WORKLOADS
        throughput.WORKLOADS.update(workloads)
        throughput.DECODE_STEPS = window
        throughput.COUNT_MOE_EXPERTS = suite == "deepseek"
        for mode in args.modes.split(","):
            out = Path(f"/tmp/attention-families-{suite}-{mode}.json")
            argv = ["--model", str(model), "--workloads", ",".join(workloads),
                    "--engines", args.engines, "--json", str(out),
                    "--max-model-len", str(16384 + 128 if window else 1024)] + (
                        ["--compile"] if mode == "compiled" else [])
            print(f"\n=== {suite} {mode} ===", flush=True)
            rc |= throughput.main(argv)
            run = json.loads(out.read_text())
            entry = {"model": str(model), "shape": MODELS[suite][2],
                     "results": run["results"],
                     "ratio_out_tok_s_accel_over_stock": run["ratio_out_tok_s_accel_over_stock"]}
            if window:
                entry["window"] = report_window(run["results"])
            if suite == "deepseek":
                report_mla(run["results"], model, run["host"]["read_bandwidth_GBps"] * 1e9)
            payload["host"] = run["host"]
            payload["suites"][f"{suite} {mode}"] = entry
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(payload, indent=2))
        print(f"saved {args.json_path}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
