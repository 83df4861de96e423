"""Tiny random-weight mixture-of-experts checkpoints for the MoE tests (a few MB each,
HF safetensors) and their HF float64 teacher-forced log-probs.

Weights are drawn wider than HF's init (std 0.08, router 0.3, LM head 0.4), so the
logits are peaked and the routers' top-k choices are far from ties: a kernel's
rounding flips neither a token nor an expert.
"""

from pathlib import Path

import torch

#: family -> (HF config class name, its MoE arguments)
FAMILIES = {
    # softmax top-2 renormalised, no shared expert
    "mixtral": ("MixtralConfig", dict(intermediate_size=96, num_local_experts=8,
                                      num_experts_per_tok=2, sliding_window=None)),
    # softmax top-2 not renormalised, a sigmoid-gated shared expert, the second layer dense
    # (mlp_only_layers); moe_intermediate_size 40, not a multiple of 32
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=40,
                                         shared_expert_intermediate_size=64, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False,
                                         mlp_only_layers=[1], use_sliding_window=False)),
    # softmax top-4 of 16 renormalised, q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=48,
                                         num_experts=16, num_experts_per_tok=4,
                                         norm_topk_prob=True, use_sliding_window=False)),
    # top-2 of 8 (softmax of the chosen logits), experts with biases and gate/up
    # interleaved through the clamped swigluoai; attention sinks, a 16-token window on
    # alternate layers, biased q/k/v/o, YaRN rope (factor 32 over 32 positions)
    "gpt_oss": ("GptOssConfig", dict(intermediate_size=64, num_local_experts=8,
                                     num_experts_per_tok=2, sliding_window=16,
                                     rope_parameters={
                                         "rope_type": "yarn", "factor": 32.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": False, "rope_theta": 150000.0,
                                         "original_max_position_embeddings": 32})),
}


#: family -> what its MoE layers add (for the support table, tests/support_matrix.py)
DESCRIPTIONS = {
    "mixtral": "MoE: softmax top-2 of 8, renormalised; INT8 KV cache",
    "qwen2_moe": "MoE: top-2 of 8 not renormalised, a sigmoid-gated shared expert, a dense "
                 "layer",
    "qwen3_moe": "MoE: top-4 of 16, q/k norms; bf16; expert parallel at TP=2",
    "gpt_oss": "MoE: top-2 of 8, biased experts with clamped swigluoai (gate/up "
               "interleaved); attention sinks, a window on alternate layers, YaRN rope",
}


def build_tiny_moe(path: Path, family: str, *, hidden: int = 128, layers: int = 2,
                   vocab: int = 512, seed: int = 0, **moe_overrides) -> Path:
    """A ``family`` checkpoint at ``path`` (4 query / 2 KV heads of 32);
    ``moe_overrides`` replace the family's MoE arguments."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, moe = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **{**moe, **moe_overrides})
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                router = "gate.weight" in name or "router.weight" in name
                std = 0.4 if name == "lm_head.weight" else 0.3 if router else 0.08
                p.normal_(0, std)
            elif family == "gpt_oss" and ("bias" in name or "sinks" in name):
                p.normal_(0, 1.0 if "sinks" in name else 0.05)  # HF's init: zeros
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_logprobs(model_dir: Path, sequences: list[list[int]],
                prepare=None) -> list[torch.Tensor]:
    """Each sequence's next-token log-probs ``[len, vocab]`` from HF in float64
    (eager experts: HF's grouped matmul has no float64); ``prepare(model)`` may add
    hooks first (e.g. activation fake-quant)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64,
                                              experts_implementation="eager",
                                              attn_implementation="eager")
    if prepare is not None:
        prepare(hf)
    out = []
    with torch.no_grad():
        for seq in sequences:
            out.append(torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1))
    return out


def assert_matches_hf(model_dir: Path, prompts: list[list[int]], outputs: list[dict],
                      nats: float = 2e-3, top_nats: float = 0.0, prepare=None) -> tuple[float, float]:
    """Each generated token (``outputs``: engine_run's, ``logprobs`` 1) is HF float64's
    top-1 given the tokens before it (or within ``top_nats`` of it), and its log-prob
    within ``nats`` of HF's (``prepare``: :func:`hf_logprobs`'). Returns (largest
    top-1 gap, largest log-prob error)."""
    worst_gap = worst_err = 0.0
    sequences = [p + o["token_ids"] for p, o in zip(prompts, outputs, strict=True)]
    for prompt, out, logp in zip(prompts, outputs, hf_logprobs(model_dir, sequences, prepare),
                                 strict=True):
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logp[len(prompt) - 1 + step]
            gap, err = float(row.max() - row[token]), abs(top[str(token)] - row[token].item())
            worst_gap, worst_err = max(worst_gap, gap), max(worst_err, err)
            assert (int(row.argmax()) == token if not top_nats else gap <= top_nats), (
                len(prompt), step, gap)
            assert err <= nats, (len(prompt), step, err)
    return worst_gap, worst_err
