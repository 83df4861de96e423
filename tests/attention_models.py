"""Tiny random-weight checkpoints of the model families whose attention goes beyond
plain causal (a few MB each, HF safetensors), for the engine tests of
``test_attention_models.py``.

Each family is built from HF transformers' own config class, with the feature that
matters set small enough that the tests' sequences (up to ~90 tokens) cross it: a
sliding window of ``WINDOW`` tokens (per layer where the family alternates), Gemma 2's
logit soft-caps, Bloom's ALiBi, GraniteSWA's attention sinks, Llama 4's attention
chunks; and encoder-only
embedding models (BERT, XLM-RoBERTa, ModernBERT, EmbeddingGemma: bidirectional
attention, no KV cache). Weights are drawn wider
than HF's init (std 0.08, LM head / tied embedding 0.4) so the logits are peaked and a
kernel's rounding flips no token.
"""

from pathlib import Path

import torch

#: the sliding window of the windowed families: shorter than the prompts, not a
#: multiple of the block size
WINDOW = 21

#: Llama 4's attention chunk: vLLM's chunked local attention needs a multiple of the
#: block size (16 in the tests); the prompts run past two chunks
CHUNK = 32

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
    # MLA: vLLM checks the latent width (kv_lora_rank + rope) is 320, 512 or 576
    "deepseek_v2": ("DeepseekV2Config", "MLA (V2-Lite: no q LoRA, latent 256 + rope 64); "
                    "softmax top-2 of 8 experts, a shared expert, the first layer dense",
                    dict(q_lora_rank=None, kv_lora_rank=256, qk_rope_head_dim=64,
                         qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=4,
                         n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         moe_intermediate_size=64, first_k_dense_replace=1,
                         topk_method="greedy", n_group=1, topk_group=1,
                         norm_topk_prob=False)),
    "deepseek_v3": ("DeepseekV3Config", "MLA (q LoRA 64, latent 448 + rope 64); sigmoid "
                    "routing with correction bias, 2 groups, routed scaling 2.5",
                    dict(q_lora_rank=64, kv_lora_rank=448, qk_rope_head_dim=64,
                         qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=4,
                         n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                         moe_intermediate_size=64, first_k_dense_replace=1, n_group=2,
                         topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                         # (released V3 configs name them; vLLM reads them)
                         topk_method="noaux_tc", scoring_func="sigmoid")),
    # (last: each family's seed is its place here)
    "llama4_text": ("Llama4TextConfig", "chunked local attention (chunks of 32) with rope, "
                    "global layers without rope, q/k L2 norms; MoE top-1 of 4 with a "
                    "shared expert (Llama 4)",
                    dict(head_dim=32, attention_chunk_size=CHUNK, no_rope_layers=[1, 0],
                         use_qk_norm=True, num_local_experts=4, num_experts_per_tok=1,
                         intermediate_size=64, intermediate_size_mlp=256,
                         interleave_moe_layer_step=1)),
}


#: the LM head's spread (tied: the embedding's too) where 0.4 saturates the logits:
#: Gemma scales its embeddings by sqrt(hidden) and soft-caps the logits, so with 0.4
#: every row is one-hot (log-probs 0 and < -30) and no error in between shows
HEAD_STD = {"gemma": 0.1, "gemma2": 0.1, "gemma3_text": 0.1}


def build_tiny(path: Path, family: str, *, hidden: int = 128, layers: int = 2,
               vocab: int = 512, seed: int = 0, norm_spread: float = 0.0,
               families: dict | None = None) -> Path:
    """A ``family`` checkpoint at ``path`` (4 query / 2 KV heads where the family has
    GQA; Bloom is MHA); ``norm_spread`` draws the norms' weights away from their init;
    ``families``: the table naming it (this module's :data:`FAMILIES` by default)."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_name, _, extra = (families or FAMILIES)[family]
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
                p.normal_(0, HEAD_STD.get(family, 0.4) if head is not None and p is head.weight
                          else 0.08)
            elif "sinks" in name:
                p.normal_(0, 1.0)
            elif "e_score_correction_bias" in name or name.endswith("expert_bias"):
                p.normal_(0, 0.1)  # (HF inits zeros)
            elif "per_expert_scale" in name or name.endswith("router.scale"):  # (ones)
                p.uniform_(0.5, 1.5)
            elif "norm" in name and norm_spread:
                p.add_(torch.randn_like(p) * norm_spread)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # (Gemma 4's, HF inits ones)
                buffer.uniform_(0.5, 1.5)
            elif name.endswith("e_score_correction_bias"):  # (a buffer in some; zeros)
                buffer.normal_(0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


#: encoder-only embedding families -> (HF config class, what vLLM serves them as,
#: config arguments beyond the common ones)
ENCODERS = {
    "bert": ("BertConfig", "BertModel -> BertEmbeddingModel, CLS pooling", {}),
    "xlm_roberta": ("XLMRobertaConfig", "XLMRobertaModel -> RobertaEmbeddingModel (position "
                    "ids after the padding index), CLS pooling", {}),
    "modernbert": ("ModernBertConfig", "ModernBertModel: a two-way window of 16 tokens on "
                   "alternate layers, global rope and local rope, CLS pooling",
                   dict(layer_types=["full_attention", "sliding_attention"],
                        local_attention=16, cls_token_id=0, sep_token_id=2)),
}


def build_tiny_encoder(path: Path, family: str, *, hidden: int = 128, layers: int = 2,
                       vocab: int = 512, seed: int = 0) -> Path:
    """An encoder-only ``family`` checkpoint (4 heads of 32), saved as its base model
    (what embedding checkpoints ship)."""
    import transformers
    from transformers import AutoModel

    config_name, _, extra = ENCODERS[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
        intermediate_size=2 * hidden, max_position_embeddings=514, pad_token_id=1,
        bos_token_id=0, eos_token_id=2, layer_norm_eps=1e-5,
        # (released checkpoints' config.json carry it; vLLM 0.32 reads it)
        position_embedding_type="absolute", **extra)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    pooler = {} if family == "modernbert" else {"add_pooling_layer": False}  # (it has none)
    model = AutoModel.from_config(config, dtype=torch.float32, **pooler)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    # vLLM's pooling entry points load a tokenizer: the default model's (the prompts
    # are token ids below this model's vocabulary)
    from quantizer import _copy_side_files
    from vllm_accel.tools.models import prepare_default_model

    _copy_side_files(prepare_default_model(), path)
    return path


#: what EmbeddingGemma adds (the support table's row)
EMBEDDING_GEMMA = ("Gemma3TextModel attending both ways (a two-way window on alternate "
                   "layers), mean pooling, sentence-transformers Dense layers")
#: EmbeddingGemma's sentence-transformers head: mean pooling, two Dense layers without
#: bias (hidden -> 2 x hidden -> hidden), then L2 normalisation
_ST_DENSE = ((128, 256), (256, 128))


def build_tiny_embedding_gemma(path: Path, *, seed: int = 0) -> Path:
    """An EmbeddingGemma checkpoint: Gemma 3 text layers with two-way attention (a window
    of 16 on the first layer), saved as ``Gemma3TextModel`` with sentence-transformers'
    ``modules.json``, mean pooling and Dense folders (what vLLM's pooler loads)."""
    import json

    from safetensors.torch import save_file
    from transformers import AutoModel, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True, query_pre_attn_scalar=32, bos_token_id=2,
        eos_token_id=1, pad_token_id=0, architectures=["Gemma3TextModel"])
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
            elif "norm" in name:  # (Gemma's norms scale by 1 + w, HF inits w = 0)
                p.normal_(0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 128, "pooling_mode_mean_tokens": True,
         "pooling_mode_cls_token": False, "include_prompt": True}))
    for i, (width_in, width_out) in enumerate(_ST_DENSE, start=2):
        folder = path / f"{i}_Dense"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(
            {"in_features": width_in, "out_features": width_out, "bias": False,
             "activation_function": "torch.nn.modules.linear.Identity"}))
        save_file({"linear.weight": torch.randn(width_out, width_in) * 0.1},
                  str(folder / "model.safetensors"))
        modules.append({"idx": i, "name": str(i), "path": folder.name,
                        "type": "sentence_transformers.models.Dense"})
    modules.append({"idx": 4, "name": "4", "path": "4_Normalize",
                    "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    from quantizer import _copy_side_files
    from vllm_accel.tools.models import prepare_default_model

    _copy_side_files(prepare_default_model(), path)
    return path


def hf_mean_dense_embeddings(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF float64 then sentence-transformers' head written out: each prompt's hidden
    states averaged, through the Dense folders' weights, L2-normalised."""
    from safetensors.torch import load_file
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    dense = [load_file(str(model_dir / f"{i}_Dense" / "model.safetensors"))["linear.weight"]
             .double() for i in range(2, 2 + len(_ST_DENSE))]
    out = []
    with torch.no_grad():
        for prompt in prompts:
            pooled = hf(torch.tensor([prompt])).last_hidden_state[0].mean(0)
            for weight in dense:
                pooled = weight @ pooled
            out.append(torch.nn.functional.normalize(pooled, dim=0))
    return out


def hf_cls_embeddings(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """HF float64: each prompt's first-token hidden state, L2-normalised (CLS pooling,
    as vLLM's embedding runner pools these models)."""
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(model_dir, dtype=torch.float64, attn_implementation="eager")
    with torch.no_grad():
        return [torch.nn.functional.normalize(
            hf(torch.tensor([p])).last_hidden_state[0, 0], dim=0) for p in prompts]
