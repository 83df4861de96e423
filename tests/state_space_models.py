"""Tiny random-weight checkpoints of state-space and hybrid families (Mamba, Mamba2,
Gated DeltaNet layers, alone or beside attention and MoE layers), for
``test_state_space_models.py``.

Each is built from HF transformers' own config class with the layer mix the family
ships (a few recurrent layers, then attention), small widths, and weights drawn wider
than HF's init (std 0.08, LM head 0.4) so logits are peaked. The recurrent layers'
own parameters keep HF's init (their decay ``A_log``, ``dt_bias`` and ``D`` have
meaning; a random draw would make the state blow up or vanish). MoE routers are drawn
wide (std 0.3) as in ``moe_models``.

Left out: Zamba2 (Mamba2 layers and a shared attention block with per-use LoRA
adapters): vLLM 0.32 and HF disagree on the tiny model's first token by 11-18 nats,
stock vLLM CPU as well, so the tiny checkpoint is no test of the plugin.
"""

from pathlib import Path

import torch

#: Qwen3.5's layers: three Gated DeltaNet, then gated attention
_GATED_DELTANET = dict(
    num_hidden_layers=4, head_dim=32,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4)

#: family -> (HF config class, what its layers are, config arguments)
FAMILIES = {
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        "Mamba2 layers (8 heads, state 16, 1 group) then attention; MoE top-2 of 4 with a "
        "shared expert (Granite 4.0-H)",
        dict(num_hidden_layers=4, layer_types=["mamba", "mamba", "mamba", "attention"],
             mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16,
             mamba_expand=2, mamba_d_conv=4, mamba_chunk_size=16, num_local_experts=4,
             num_experts_per_tok=2, shared_intermediate_size=128,
             position_embedding_type="rope")),
    "jamba": (
        "JambaConfig",
        "Mamba (selective scan, state 16) and attention layers; MoE top-2 of 4 on odd "
        "layers",
        dict(num_hidden_layers=4, attn_layer_period=4, attn_layer_offset=3,
             expert_layer_period=2, expert_layer_offset=1, num_experts=4,
             num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
             mamba_dt_rank=16, use_mamba_kernels=False)),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Gated DeltaNet linear attention (2 key / 4 value heads of 128) then gated "
        "attention (Qwen3.5)",
        _GATED_DELTANET),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Gated DeltaNet then gated attention; MoE top-2 of 8 with a gated shared expert "
        "(Qwen3.5-MoE)",
        dict(**_GATED_DELTANET, num_experts=8,
             num_experts_per_tok=2, moe_intermediate_size=64,
             shared_expert_intermediate_size=64)),
    "nemotron_h": (
        "NemotronHConfig",
        "Mamba2, attention and squared-ReLU MLP layers (Nemotron-H)",
        dict(num_hidden_layers=4, hybrid_override_pattern="M-M*", mamba_num_heads=8,
             mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4,
             chunk_size=16, head_dim=32, mlp_hidden_act="relu2")),
    "falcon_h1": (
        "FalconH1Config",
        "Mamba2 and attention in parallel in every layer (Falcon-H1)",
        dict(num_hidden_layers=2, mamba_n_heads=8, mamba_d_head=32, mamba_n_groups=1,
             mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
             mamba_d_ssm=256, head_dim=32)),
    "mamba2": (
        "Mamba2Config",
        "Mamba2 only (attention-free)",
        dict(num_hidden_layers=2, num_heads=8, head_dim=32, n_groups=1, state_size=16,
             expand=2, conv_kernel=4, chunk_size=16)),
    # (last: each family's seed is its place here)
    "qwen3_next": (
        "Qwen3NextConfig",
        "Gated DeltaNet then gated attention; MoE top-2 of 8 with a gated shared expert "
        "(Qwen3-Next)",
        dict(**_GATED_DELTANET, num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=64, shared_expert_intermediate_size=64)),
}

#: parameters of the recurrent layers whose HF init is kept (see the module docstring)
KEEP_INIT = ("A_log", "dt_bias", "D", "dt_proj.bias", "conv1d")


def build_tiny_state_space(path: Path, family: str, *, hidden: int = 128, vocab: int = 512,
                           seed: int = 0) -> Path:
    """A ``family`` checkpoint at ``path`` (4 query / 2 KV heads where it has attention)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, _, extra = FAMILIES[family]
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    config = getattr(transformers, config_name)(**{**common, **extra})
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and not any(k in name for k in KEEP_INIT):
                # routers drawn wide too: decisive expert choices, which bf16 keeps
                router = "gate.weight" in name or "router" in name
                p.normal_(0, 0.4 if p is head.weight else 0.3 if router else 0.08)
    model.save_pretrained(path, safe_serialization=True)
    return path
