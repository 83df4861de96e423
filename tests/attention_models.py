"""Tiny random-weight checkpoints of the model families whose attention goes beyond
plain causal (a few MB each, HF safetensors), for the engine tests of
``test_attention_models.py``.

Each family is built from HF transformers' own config class, with the feature that
matters set small enough that the tests' sequences (up to ~90 tokens) cross it: a
sliding window of ``WINDOW`` tokens (per layer where the family alternates), Gemma 2's
logit soft-caps, Bloom's ALiBi, GraniteSWA's attention sinks. Weights are drawn wider
than HF's init (std 0.08, LM head / tied embedding 0.4) so the logits are peaked and a
kernel's rounding flips no token.
"""

from pathlib import Path

import torch

#: the sliding window of the windowed families: shorter than the prompts, not a
#: multiple of the block size
WINDOW = 21

#: family -> (HF config class, architecture vLLM serves, what its attention adds,
#: config arguments beyond the common ones)
FAMILIES = {
    "mistral": ("MistralConfig", "sliding window (every layer)",
                dict(sliding_window=WINDOW, head_dim=32)),
    "phi3": ("Phi3Config", "sliding window (every layer), fused qkv",
             dict(sliding_window=WINDOW, pad_token_id=0)),
    "qwen2": ("Qwen2Config", "use_sliding_window (vLLM serves it on every layer or none)",
              dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=0,
                   head_dim=32)),
    "gemma2": ("Gemma2Config", "alternating window / global layers, logit soft-caps "
               "(attention 50, final 30), query_pre_attn_scalar",
               dict(sliding_window=WINDOW, head_dim=32, query_pre_attn_scalar=24,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                    tie_word_embeddings=True)),
    "gemma3_text": ("Gemma3TextConfig", "alternating window / global layers (local and "
                    "global rope), q/k norms",
                    dict(sliding_window=WINDOW, head_dim=32, query_pre_attn_scalar=32,
                         layer_types=["sliding_attention", "full_attention"],
                         tie_word_embeddings=True)),
    "starcoder2": ("Starcoder2Config", "sliding window, biases, LayerNorm (vLLM's "
                   "Transformers backend)",
                   dict(sliding_window=WINDOW, use_bias=True, norm_epsilon=1e-5)),
    "bloom": ("BloomConfig", "ALiBi", dict(n_layer=2, n_head=4, tie_word_embeddings=True)),
    "granite_swa": ("GraniteSWAConfig", "attention sinks on every layer, a window on "
                    "alternate ones",
                    dict(sliding_window=WINDOW,
                         layer_types=["sliding_attention", "full_attention"])),
}


def build_tiny(path: Path, family: str, *, hidden: int = 128, layers: int = 2,
               vocab: int = 512, seed: int = 0) -> Path:
    """A ``family`` checkpoint at ``path`` (4 query / 2 KV heads where the family has
    GQA; Bloom is MHA)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, _, extra = FAMILIES[family]
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=2 * hidden,
                  max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2)
    config = getattr(transformers, config_name)(**{**common, **extra})
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    head = model.get_output_embeddings()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4 if head is not None and p is head.weight else 0.08)
            elif "sinks" in name:
                p.normal_(0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path
