"""Tiny random-weight checkpoints of model families whose released checkpoints carry
their own modeling code (``trust_remote_code``) and that vLLM 0.32 serves with its own
model classes: ChatGLM (GLM-4-9B-chat's layout), InternLM2/2.5, MiniCPM, MiniCPM3,
TeleChat2, Ling 2.0 (Bailing MoE V2) and DeepSeek-MoE, and InternVL's released layout,
for ``test_remote_code_families.py``.

transformers has no class for them, so there is no HF oracle: each checkpoint is
written tensor by tensor in the released checkpoints' layout (names, packed and
interleaved projections), with a ``config.json`` of the released fields. Where
vLLM has no config class of its own (all but ChatGLM), a ``configuration_tiny.py``
beside it (a plain ``PretrainedConfig`` under the family's ``model_type``, named by
``auto_map``) stands in for the released remote code, as vLLM loads it with
``trust_remote_code``. The oracle is stock vLLM CPU on the same checkpoint.

Sizes as elsewhere: hidden 128, 4 query / 2 KV heads of 32 (TeleChat2: 4 heads, no
GQA, as vLLM's loader assumes), two layers, a 512-token vocabulary; weights drawn wide
(std 0.08, the LM head 0.4) so the logits are peaked.
"""

import json
from pathlib import Path

import torch

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB, LAYERS = 128, 4, 2, 32, 256, 512, 2

#: family -> what its layers add (the support table's words)
FAMILIES = {
    "chatglm": "fused qkv with biases, MQA groups, half-width interleaved rope "
               "(ChatGLM3 / GLM-4-9B-chat; vLLM's own config class)",
    "internlm2": "wqkv packed per KV group (each group's queries, then its key and "
                 "value), w1/w3/w2 MLP (InternLM2 / 2.5)",
    "minicpm": "muP scales: embeddings x scale_emb, residual branches x scale_depth / "
               "sqrt(layers), logits / (hidden / dim_model_base), tied embeddings (MiniCPM)",
    "minicpm3": "low-rank q and kv (q LoRA 64, kv LoRA 64) decompressed into 4 heads of "
                "64 (32 + 32 rope), values padded from 32; LongRoPE short factors; "
                "MiniCPM's muP scales (MiniCPM3)",
    "telechat2": "query and a per-head interleaved key_value, biases on the output "
                 "projections only (TeleChat2)",
    "bailing_moe": "MoE: sigmoid top-2 of 8 with expert bias, 2 groups, routed scaling "
                   "2.5, a shared expert, the first layer dense; fused qkv, q/k RMSNorm, "
                   "half-width rope (Ling 2.0)",
    "deepseek": "MoE: softmax top-2 of 8 not renormalised, 2 shared experts, the first "
                "layer dense; Llama attention (DeepSeek-MoE 16B, DeepSeek's first "
                "generation)",
}
#: the families with MoE layers (the plugin's MoE method serves them)
MOE = ("bailing_moe", "deepseek")

_CONFIG_CODE = '''"""A stand-in for a released checkpoint's configuration module (tests)."""
from transformers import PretrainedConfig


class TinyRemoteConfig(PretrainedConfig):
    model_type = {model_type!r}
    attribute_map = {attribute_map!r}

    def __init__(self, **kwargs):
        # as released configuration classes do: the model's own fields are attributes
        # before the base class reads the rest (rope fields among them)
        for key in {fields!r}:
            if key in kwargs:
                setattr(self, key, kwargs.pop(key))
        super().__init__(**kwargs)
'''
#: config.json fields the base ``PretrainedConfig`` takes itself
_BASE_FIELDS = {"architectures", "model_type", "auto_map", "torch_dtype",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"}


class _Weights:
    """Draws the checkpoint's tensors from one seeded generator, in insertion order."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.tensors: dict[str, torch.Tensor] = {}

    def normal(self, name: str, *shape: int, std: float = 0.08, mean: float = 0.0):
        self.tensors[name] = mean + std * torch.randn(*shape, generator=self.gen)

    def norm(self, name: str, width: int):
        self.normal(name, width, std=0.1, mean=1.0)


def _chatglm(w: _Weights) -> dict:
    p = "transformer.encoder.layers"
    w.normal("transformer.embedding.word_embeddings.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        w.norm(f"{p}.{i}.input_layernorm.weight", HIDDEN)
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
        w.normal(f"{p}.{i}.self_attention.query_key_value.weight", qkv, HIDDEN)
        w.normal(f"{p}.{i}.self_attention.query_key_value.bias", qkv, std=0.2)
        w.normal(f"{p}.{i}.self_attention.dense.weight", HIDDEN, HEADS * HEAD_DIM)
        w.norm(f"{p}.{i}.post_attention_layernorm.weight", HIDDEN)
        w.normal(f"{p}.{i}.mlp.dense_h_to_4h.weight", 2 * FFN, HIDDEN)
        w.normal(f"{p}.{i}.mlp.dense_4h_to_h.weight", HIDDEN, FFN)
    w.norm("transformer.encoder.final_layernorm.weight", HIDDEN)
    w.normal("transformer.output_layer.weight", VOCAB, HIDDEN, std=0.4)
    return {"architectures": ["ChatGLMModel"], "model_type": "chatglm",
            "num_layers": LAYERS, "padded_vocab_size": VOCAB, "hidden_size": HIDDEN,
            "ffn_hidden_size": FFN, "kv_channels": HEAD_DIM, "num_attention_heads": HEADS,
            "multi_query_attention": True, "multi_query_group_num": KV_HEADS,
            "add_qkv_bias": True, "add_bias_linear": False, "rmsnorm": True,
            "post_layer_norm": True, "apply_residual_connection_post_layernorm": False,
            "original_rope": True, "rope_ratio": 1.0, "seq_length": 1024,
            "layernorm_epsilon": 1e-5, "tie_word_embeddings": False,
            "eos_token_id": 2, "pad_token_id": 0}


def _internlm2(w: _Weights) -> dict:
    groups = HEADS // KV_HEADS
    w.normal("model.tok_embeddings.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.norm(f"{p}.attention_norm.weight", HIDDEN)
        # per KV group: its `groups` query heads, then its key head, then its value head
        w.normal(f"{p}.attention.wqkv.weight", KV_HEADS * (groups + 2) * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.attention.wo.weight", HIDDEN, HEADS * HEAD_DIM)
        w.norm(f"{p}.ffn_norm.weight", HIDDEN)
        w.normal(f"{p}.feed_forward.w1.weight", FFN, HIDDEN)
        w.normal(f"{p}.feed_forward.w3.weight", FFN, HIDDEN)
        w.normal(f"{p}.feed_forward.w2.weight", HIDDEN, FFN)
    w.norm("model.norm.weight", HIDDEN)
    w.normal("output.weight", VOCAB, HIDDEN, std=0.4)
    return {"architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
            "max_position_embeddings": 1024, "vocab_size": VOCAB, "bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "pad_token_id": 0}


#: MiniCPM's muP fields (the released 2B's scale_depth; its scale_emb, 12, would let
#: the input token's own embedding dominate a random model's residual stream, and with
#: tied embeddings it predicts that token again; a dim_model_base below the hidden
#: size scales the logits up, as in the releases)
_MUP = {"scale_emb": 2.0, "scale_depth": 1.4, "dim_model_base": 64}


#: MiniCPM's tied embeddings: narrow, for the same reason (a table of std 0.4 at
#: scale_emb 12 put the input token ~16 nats ahead of the rest)...
_TIED_STD = 0.05


def _tied_final_norm(w: _Weights) -> None:
    """...and a final norm of ~8 instead, so the logits (the table as LM head) spread
    over a few nats rather than near-ties."""
    w.normal("model.norm.weight", HIDDEN, std=0.5, mean=8.0)


def _minicpm(w: _Weights) -> dict:
    w.normal("model.embed_tokens.weight", VOCAB, HIDDEN, std=_TIED_STD)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", HIDDEN)
        w.normal(f"{p}.self_attn.q_proj.weight", HEADS * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.self_attn.k_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.self_attn.v_proj.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM)
        w.norm(f"{p}.post_attention_layernorm.weight", HIDDEN)
        _expert(w, f"{p}.mlp", FFN)
    _tied_final_norm(w)
    return {"architectures": ["MiniCPMForCausalLM"], "model_type": "minicpm",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 1024, "vocab_size": VOCAB, **_MUP,
            "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


#: MiniCPM3's attention widths: q and kv through rank-64 bottlenecks, heads of 32
#: without rope + 32 with it, values of 32 (vLLM pads them to 64 for the cache)
_MINICPM3 = {"q_lora_rank": 64, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
             "qk_rope_head_dim": 32, "v_head_dim": 32}


def _minicpm3(w: _Weights) -> dict:
    d = _MINICPM3
    qk = d["qk_nope_head_dim"] + d["qk_rope_head_dim"]
    w.normal("model.embed_tokens.weight", VOCAB, HIDDEN, std=_TIED_STD)
    for i in range(LAYERS):
        p = f"model.layers.{i}.self_attn"
        w.norm(f"model.layers.{i}.input_layernorm.weight", HIDDEN)
        w.normal(f"{p}.q_a_proj.weight", d["q_lora_rank"], HIDDEN)
        w.norm(f"{p}.q_a_layernorm.weight", d["q_lora_rank"])
        w.normal(f"{p}.q_b_proj.weight", HEADS * qk, d["q_lora_rank"], std=0.15)
        w.normal(f"{p}.kv_a_proj_with_mqa.weight", d["kv_lora_rank"] + d["qk_rope_head_dim"],
                 HIDDEN)
        w.norm(f"{p}.kv_a_layernorm.weight", d["kv_lora_rank"])
        w.normal(f"{p}.kv_b_proj.weight", HEADS * (d["qk_nope_head_dim"] + d["v_head_dim"]),
                 d["kv_lora_rank"], std=0.15)
        w.normal(f"{p}.o_proj.weight", HIDDEN, HEADS * d["v_head_dim"])
        w.norm(f"model.layers.{i}.post_attention_layernorm.weight", HIDDEN)
        _expert(w, f"model.layers.{i}.mlp", FFN)
    _tied_final_norm(w)
    half = d["qk_rope_head_dim"] // 2
    # LongRoPE as the releases carry it: per-frequency factors, the short ones in use
    # while sequences stay within original_max_position_embeddings
    short = [1.0 + 0.05 * j for j in range(half)]
    return {"architectures": ["MiniCPM3ForCausalLM"], "model_type": "minicpm3",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, **d,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 1024,
            "rope_scaling": {"rope_type": "longrope", "short_factor": short,
                             "long_factor": [2 * f for f in short],
                             "original_max_position_embeddings": 1024},
            "vocab_size": VOCAB, **_MUP, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2}


def _telechat2(w: _Weights) -> dict:
    w.normal("transformer.word_embeddings.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"transformer.h.{i}"
        w.norm(f"{p}.input_layernorm.weight", HIDDEN)
        w.normal(f"{p}.self_attention.query.weight", HEADS * HEAD_DIM, HIDDEN)
        # per head: its key rows, then its value rows
        w.normal(f"{p}.self_attention.key_value.weight", 2 * HEADS * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.self_attention.dense.weight", HIDDEN, HEADS * HEAD_DIM)
        w.normal(f"{p}.self_attention.dense.bias", HIDDEN, std=0.2)
        w.norm(f"{p}.post_attention_layernorm.weight", HIDDEN)
        _expert(w, f"{p}.mlp", FFN)
        w.normal(f"{p}.mlp.down_proj.bias", HIDDEN, std=0.2)
    w.norm("transformer.ln_f.weight", HIDDEN)
    w.normal("lm_head.weight", VOCAB, HIDDEN, std=0.4)
    return {"architectures": ["TeleChat2ForCausalLM"], "model_type": "telechat",
            "hidden_size": HIDDEN, "ffn_hidden_size": FFN, "n_layer": LAYERS,
            "n_head": HEADS, "layer_norm_epsilon": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 1024, "vocab_size": VOCAB,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _bailing_moe(w: _Weights) -> dict:
    experts, moe_ffn = 8, 64
    w.normal("model.word_embeddings.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", HIDDEN)
        w.normal(f"{p}.attention.query_key_value.weight", (HEADS + 2 * KV_HEADS) * HEAD_DIM,
                 HIDDEN)
        w.norm(f"{p}.attention.query_layernorm.weight", HEAD_DIM)
        w.norm(f"{p}.attention.key_layernorm.weight", HEAD_DIM)
        w.normal(f"{p}.attention.dense.weight", HIDDEN, HEADS * HEAD_DIM)
        w.norm(f"{p}.post_attention_layernorm.weight", HIDDEN)
        _moe_or_dense_mlp(w, p, i, experts, moe_ffn, moe_ffn, expert_bias=True)
    w.norm("model.norm.weight", HIDDEN)
    w.normal("lm_head.weight", VOCAB, HIDDEN, std=0.4)
    return {"architectures": ["BailingMoeV2ForCausalLM"], "model_type": "bailing_moe_v2",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 1024, "vocab_size": VOCAB,
            "use_qk_norm": True, "use_rmsnorm": True, "use_bias": False,
            "use_qkv_bias": False, "num_experts": experts, "num_experts_per_tok": 2,
            "moe_intermediate_size": moe_ffn, "num_shared_experts": 1,
            "moe_shared_expert_intermediate_size": moe_ffn, "first_k_dense_replace": 1,
            "norm_topk_prob": True, "score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 2.5, "router_dtype": "fp32", "embedding_dropout": 0.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _deepseek(w: _Weights) -> dict:
    experts, moe_ffn, shared = 8, 64, 2
    w.normal("model.embed_tokens.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        w.norm(f"{p}.input_layernorm.weight", HIDDEN)
        for name in ("q_proj", "k_proj", "v_proj"):  # (MHA, as released)
            w.normal(f"{p}.self_attn.{name}.weight", HEADS * HEAD_DIM, HIDDEN)
        w.normal(f"{p}.self_attn.o_proj.weight", HIDDEN, HEADS * HEAD_DIM)
        w.norm(f"{p}.post_attention_layernorm.weight", HIDDEN)
        _moe_or_dense_mlp(w, p, i, experts, moe_ffn, shared * moe_ffn, expert_bias=False)
    w.norm("model.norm.weight", HIDDEN)
    w.normal("lm_head.weight", VOCAB, HIDDEN, std=0.4)
    return {"architectures": ["DeepseekForCausalLM"], "model_type": "deepseek",
            "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "hidden_act": "silu",
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
            "vocab_size": VOCAB, "n_routed_experts": experts, "n_shared_experts": shared,
            "num_experts_per_tok": 2, "moe_intermediate_size": moe_ffn,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "norm_topk_prob": False,
            "scoring_func": "softmax", "topk_method": "greedy", "attention_bias": False,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def _moe_or_dense_mlp(w: _Weights, p: str, layer: int, experts: int, width: int,
                      shared_width: int, expert_bias: bool) -> None:
    """Layer ``layer``'s MLP at ``p``: dense on the first layer (first_k_dense_replace
    1), else a router, ``experts`` experts of ``width`` and the shared experts."""
    if layer == 0:
        _expert(w, f"{p}.mlp", FFN)
        return
    w.normal(f"{p}.mlp.gate.weight", experts, HIDDEN, std=0.3)
    if expert_bias:
        w.normal(f"{p}.mlp.gate.expert_bias", experts, std=0.1)
    for e in range(experts):
        _expert(w, f"{p}.mlp.experts.{e}", width)
    _expert(w, f"{p}.mlp.shared_experts", shared_width)


def _expert(w: _Weights, p: str, width: int) -> None:
    """One expert's (or the shared experts') SwiGLU projections at ``p``."""
    w.normal(f"{p}.gate_proj.weight", width, HIDDEN)
    w.normal(f"{p}.up_proj.weight", width, HIDDEN)
    w.normal(f"{p}.down_proj.weight", HIDDEN, width)


_BUILDERS = {"chatglm": _chatglm, "internlm2": _internlm2, "minicpm": _minicpm,
             "minicpm3": _minicpm3, "telechat2": _telechat2, "bailing_moe": _bailing_moe,
             "deepseek": _deepseek}
#: families whose config class vLLM 0.32 ships (the rest need the checkpoint's code)
VLLM_CONFIGS = {"chatglm"}
#: the released configuration classes' attribute maps, where the releases have one
_ATTRIBUTE_MAPS = {"telechat2": {"num_hidden_layers": "n_layer",
                                 "num_attention_heads": "n_head"}}


def build_tiny_remote(path: Path, family: str, seed: int = 0) -> Path:
    """Write ``family``'s tiny checkpoint (safetensors, config, and the configuration
    module where the family's config is remote code) at ``path``."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    weights = _Weights(seed)
    config = {**_BUILDERS[family](weights), "torch_dtype": "float32"}
    if family not in VLLM_CONFIGS:
        (path / "configuration_tiny.py").write_text(_CONFIG_CODE.format(
            model_type=config["model_type"], attribute_map=_ATTRIBUTE_MAPS.get(family, {}),
            fields=sorted(set(config) - _BASE_FIELDS)))
        config["auto_map"] = {"AutoConfig": "configuration_tiny.TinyRemoteConfig"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.tensors.items()},
              str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


#: InternVL's released layout (InternVL2 / 2.5 / 3: ``InternVLChatModel``): the
#: configuration module the releases carry, reduced to what it does (vision and LLM
#: sub-configs built from their dicts)
_INTERNVL_CONFIG_CODE = '''"""A stand-in for InternVL's released configuration module (tests)."""
from transformers import AutoConfig, PretrainedConfig


class InternVisionConfig(PretrainedConfig):
    model_type = "intern_vit_6b"


class InternVLChatConfig(PretrainedConfig):
    model_type = "internvl_chat"

    def __init__(self, vision_config=None, llm_config=None, **kwargs):
        super().__init__(**kwargs)
        vision = dict(vision_config or {})
        vision.pop("model_type", None)
        self.vision_config = InternVisionConfig(**vision)
        llm = dict(llm_config or {"model_type": "qwen2"})
        self.llm_config = AutoConfig.for_model(llm.pop("model_type"), **llm)

    def to_dict(self):
        out = super().to_dict()
        out["vision_config"] = self.vision_config.to_dict()
        out["llm_config"] = self.llm_config.to_dict()
        return out
'''
#: transformers' InternVL names -> the released checkpoints' (the reverse of
#: transformers' conversion script); the decoder's names are the same in both
_INTERNVL_RENAMES = [
    ("vision_tower.embeddings.cls_token", "vision_model.embeddings.class_embedding"),
    ("vision_tower.embeddings.patch_embeddings.projection",
     "vision_model.embeddings.patch_embedding"),
    ("vision_tower.embeddings.position_embeddings", "vision_model.embeddings.position_embedding"),
    ("vision_tower.encoder.layer.", "vision_model.encoder.layers."),
    (".attention.projection_layer.", ".attn.proj."),
    (".lambda_1", ".ls1"), (".lambda_2", ".ls2"),
    (".layernorm_before.", ".norm1."), (".layernorm_after.", ".norm2."),
    ("multi_modal_projector.layer_norm.", "mlp1.0."),
    ("multi_modal_projector.linear_1.", "mlp1.1."),
    ("multi_modal_projector.linear_2.", "mlp1.3."),
]
INTERNVL_CHAT = ("InternVL2 / 2.5 / 3 in the released layout (InternVLChatModel): an "
                 "InternViT tower (fused qkv, layer scales) over 56x56 tiles, pixel shuffle "
                 "to 4 tokens a tile, up to 4 tiles and a thumbnail, a Qwen2 decoder")


def build_tiny_internvl_chat(path: Path, default_model: Path, seed: int = 0) -> Path:
    """InternVL in its released (remote-code) layout: transformers' tiny InternVL
    (``vlm_models.build_tiny_internvl``) renamed tensor by tensor, its q/k/v fused into
    InternViT's ``qkv``, under the released config fields and configuration module."""
    import shutil

    from safetensors.torch import load_file, save_file

    from vlm_models import IMAGE_SIZE, PATCH, build_tiny_internvl

    hf = build_tiny_internvl(path.with_name(path.name + "-hf"), default_model, seed=seed)
    tensors, hf_tensors = {}, load_file(str(hf / "model.safetensors"))
    for name, tensor in hf_tensors.items():
        if name.endswith(("attention.k_proj.weight", "attention.v_proj.weight")):
            continue
        if name.endswith("attention.q_proj.weight"):
            parts = [hf_tensors[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            name, tensor = name.replace("attention.q_proj", "attn.qkv"), torch.cat(parts)
        for old, new in _INTERNVL_RENAMES:
            name = name.replace(old, new)
        tensors[name] = tensor.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    hf_config = json.loads((hf / "config.json").read_text())
    vision = hf_config["vision_config"]
    llm = {**hf_config["text_config"], "architectures": ["Qwen2ForCausalLM"]}
    config = {
        "architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
        "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig"},
        "vision_config": {
            "hidden_size": vision["hidden_size"], "intermediate_size": vision["intermediate_size"],
            "num_hidden_layers": vision["num_hidden_layers"],
            "num_attention_heads": vision["num_attention_heads"], "image_size": IMAGE_SIZE,
            "patch_size": PATCH, "num_channels": 3, "qkv_bias": False,
            "qk_normalization": False, "norm_type": "layer_norm",
            "layer_norm_eps": vision["layer_norm_eps"], "hidden_act": vision["hidden_act"],
            "initializer_factor": 1.0, "drop_path_rate": 0.0, "use_flash_attn": False,
            "architectures": ["InternVisionModel"]},
        "llm_config": llm, "select_layer": -1, "force_image_size": IMAGE_SIZE,
        "downsample_ratio": hf_config["downsample_ratio"], "ps_version": "v2",
        "template": "internvl2_5", "dynamic_image_size": True, "use_thumbnail": True,
        "min_dynamic_patch": 1, "max_dynamic_patch": 4, "tie_word_embeddings": False,
        "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "configuration_internvl_chat.py").write_text(_INTERNVL_CONFIG_CODE)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "generation_config.json"):
        shutil.copy(hf / name, path / name)
    return path
