"""Tiny random-weight checkpoints of the model families users serve whose attention is
plain causal or windowed and whose novelty is in vLLM's model code (norm placement,
partial or skipped rope, biases, multipliers, MoE routing rules), for
``test_model_families.py``. Built by :func:`attention_models.build_tiny` from HF
transformers' own config classes (4 query / 2 KV heads, hidden 128, two layers; four
where layers share a KV cache).

Left out, with what was measured (stock vLLM 0.32 CPU the same): Cohere / Cohere2 /
Cohere2-MoE (vLLM's and HF's tiny models disagree on the top token, stock too), GPT-NeoX and JetMoE
(stock vLLM CPU's own attention crashes on them), Phi-3.5-MoE (vLLM serves it through
its Transformers backend, and transformers 5's PhiMoE forward fails, stock too), Apertus
(vLLM's xIELU is 3.7e-3 nats from HF's, stock too), MPT (removed from vLLM in 0.28),
Ministral 3's llama-4 attention scaling past ``original_max_position_embeddings`` (with
it set to 32, vLLM's top token is 0.011 nats below HF's at position 40, stock too; the
test keeps the released 16384, where the scaling is 1), DBRX (transformers 5 saves its
experts fused, not in the released layout vLLM loads) and LongCat-Flash (transformers'
config and saved experts differ from the released ones vLLM reads).
"""

from attention_models import WINDOW

#: two layers: the first windowed (or roped), the second global
_ALTERNATE = ["sliding_attention", "full_attention"]
#: MoE widths shared by the MoE families: 8 experts of 64, top-2
_EXPERTS = dict(moe_intermediate_size=64, num_experts_per_tok=2)
#: DeepSeek-style MoE layers after a dense first layer, one group
_DEEPSEEK_MOE = dict(n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1,
                     n_group=1, topk_group=1, **_EXPERTS)

#: Gemma 3n / Gemma 4 E-models: four layers, windowed and global in turn, the last two
#: sharing the KV cache of the first two; per-layer embeddings of 16 per layer
_GEMMA_KV_SHARING = dict(num_hidden_layers=4, layer_types=_ALTERNATE * 2, head_dim=32,
                         sliding_window=WINDOW, num_kv_shared_layers=2,
                         hidden_size_per_layer_input=16, vocab_size_per_layer_input=512,
                         final_logit_softcapping=30.0, tie_word_embeddings=True,
                         pad_token_id=0)

#: family -> (HF config class, what its layers add, config arguments)
FAMILIES = {
    "qwen3": ("Qwen3Config", "q/k RMSNorm per head (Qwen3)", dict(head_dim=32)),
    "glm": ("GlmConfig", "half-width interleaved rope, qkv biases (GLM-4)",
            dict(head_dim=32, partial_rotary_factor=0.5, pad_token_id=0)),
    "glm4": ("Glm4Config", "half-width rope, norms after attention and MLP (GLM-4-0414)",
             dict(head_dim=32, partial_rotary_factor=0.5, pad_token_id=0)),
    "glm4_moe": ("Glm4MoeConfig", "MoE: sigmoid top-2 of 8 with correction bias, routed "
                 "scaling 2.5, a shared expert, the first layer dense; q/k norms, half-width "
                 "rope (GLM-4.5)",
                 dict(head_dim=32, partial_rotary_factor=0.5, use_qk_norm=True,
                      routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0,
                      **_DEEPSEEK_MOE)),
    "ernie4_5": ("Ernie4_5Config", "interleaved rope (ERNIE 4.5)",
                 dict(head_dim=32, pad_token_id=0)),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "MoE: top-2 of 8 with a shared expert, the "
                     "first layer dense (ERNIE 4.5 MoE)",
                     dict(head_dim=32, moe_num_experts=8, moe_k=2, moe_layer_start_index=1,
                          moe_intermediate_size=64, moe_num_shared_experts=1,
                          pad_token_id=0)),
    "hunyuan_v1_dense": ("HunYuanDenseV1Config", "q/k norms after rope (Hunyuan)",
                         dict(head_dim=32, pad_token_id=0)),
    # (HF's experts take intermediate_size, vLLM's moe_intermediate_size: equal here)
    "hunyuan_v1_moe": ("HunYuanMoEV1Config", "MoE: top-2 of 8 with a shared expert; q/k "
                       "norms after rope (Hunyuan-A13B)",
                       dict(head_dim=32, num_experts=8, moe_topk=2, intermediate_size=64,
                            moe_intermediate_size=64, num_shared_expert=1, pad_token_id=0)),
    "olmo2": ("Olmo2Config", "q/k RMSNorm over all heads, norms after attention and MLP "
              "(OLMo 2)", dict(pad_token_id=0)),
    "olmo3": ("Olmo3Config", "OLMo 2's layers, a window on alternate layers (OLMo 3)",
              dict(sliding_window=WINDOW, layer_types=_ALTERNATE, pad_token_id=0)),
    "olmoe": ("OlmoeConfig", "MoE: top-2 of 8 not renormalised; q/k norms (OLMoE)",
              dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64,
                   pad_token_id=0)),
    "exaone4": ("Exaone4Config", "a window on alternate layers, global layers without "
                "rope, q/k norms, norms after attention and MLP (EXAONE 4.0)",
                dict(sliding_window=WINDOW, layer_types=_ALTERNATE, head_dim=32,
                     pad_token_id=0)),
    "smollm3": ("SmolLM3Config", "rope skipped on every second layer (SmolLM3)",
                dict(no_rope_layer_interval=2, pad_token_id=0)),
    "seed_oss": ("SeedOssConfig", "qkv biases (Seed-OSS)", dict(head_dim=32, pad_token_id=0)),
    "falcon": ("FalconConfig", "attention and MLP in parallel from one LayerNorm, GQA "
               "(Falcon's new decoder architecture)",
               dict(new_decoder_architecture=True, num_kv_heads=2, layer_norm_epsilon=1e-5,
                    pad_token_id=0)),
    "stablelm": ("StableLmConfig", "quarter-width rope, LayerNorm (StableLM)",
                 dict(layer_norm_eps=1e-5, partial_rotary_factor=0.25, pad_token_id=0)),
    "granite": ("GraniteConfig", "embedding, residual, attention and logit multipliers "
                "(Granite 3)",
                dict(embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.1, logits_scaling=2.0, pad_token_id=0)),
    "granitemoe": ("GraniteMoeConfig", "Granite's multipliers; MoE top-2 of 8 (Granite 3 "
                   "MoE)",
                   dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                        embedding_multiplier=2.0, residual_multiplier=0.5,
                        attention_multiplier=0.1, logits_scaling=2.0, pad_token_id=0)),
    "dots1": ("Dots1Config", "MoE: top-2 of 8 with a shared expert, the first layer dense; "
              "q/k norms (dots.llm1)", dict(head_dim=32, pad_token_id=0, **_DEEPSEEK_MOE)),
    "phi": ("PhiConfig", "half-width rope, attention and MLP in parallel, LayerNorm and "
            "biases (Phi-2)",
            dict(partial_rotary_factor=0.5, layer_norm_eps=1e-5, pad_token_id=0)),
    "nemotron": ("NemotronConfig", "LayerNorm with 1 + w, squared-ReLU MLP, half-width "
                 "rope (Nemotron)",
                 dict(partial_rotary_factor=0.5, head_dim=32, norm_eps=1e-5,
                      pad_token_id=0)),
    "gemma": ("GemmaConfig", "GeGLU, embeddings scaled by sqrt(hidden), RMSNorm with 1 + w "
              "(Gemma)", dict(head_dim=32, tie_word_embeddings=True, pad_token_id=0)),
    "arcee": ("ArceeConfig", "squared-ReLU MLP without a gate (Arcee AFM)",
              dict(head_dim=32, pad_token_id=0)),
    # (new families go last: each family's seed is its place in this table)
    "gemma3n_text": ("Gemma3nTextConfig", "AltUp over 4 streams, LAuReL, per-layer "
                     "embeddings, Gaussian top-k activation sparsity, the last 2 of 4 "
                     "layers reading earlier layers' KV cache, a window on alternate "
                     "layers, final soft-cap (Gemma 3n)",
                     dict(_GEMMA_KV_SHARING, laurel_rank=8, altup_num_inputs=4,
                          activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0])),
    "gemma4_text": ("Gemma4TextConfig", "per-layer embeddings, the last 2 of 4 layers "
                    "reading earlier layers' KV cache (their MLPs double-wide), head size "
                    "32 on windowed layers and 64 with quarter-width proportional rope on "
                    "global ones, v norm, learned layer scalars, final soft-cap (Gemma 4 "
                    "E2B/E4B)",
                    dict(_GEMMA_KV_SHARING, global_head_dim=64, use_double_wide_mlp=True)),
    "gemma4_text_moe": ("Gemma4TextConfig", "MoE: top-2 of 8 with per-expert scales beside "
                        "the dense MLP; global layers with keys as values (one KV head of "
                        "64), windowed ones with 32 (Gemma 4 26B-A4B)",
                        dict(head_dim=32, global_head_dim=64, attention_k_eq_v=True,
                             num_global_key_value_heads=1, enable_moe_block=True,
                             num_experts=8, top_k_experts=2, moe_intermediate_size=64,
                             hidden_size_per_layer_input=0, sliding_window=WINDOW,
                             layer_types=_ALTERNATE, final_logit_softcapping=30.0,
                             tie_word_embeddings=True, pad_token_id=0)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "MLA (q LoRA 64, latent 256 + rope 64); MoE: "
                      "sigmoid top-2 of 8 with correction bias, routed scaling 1.8, a shared "
                      "expert, the first layer dense (GLM-4.7-Flash)",
                      dict(q_lora_rank=64, kv_lora_rank=256, qk_rope_head_dim=64,
                           qk_nope_head_dim=32, v_head_dim=32, num_key_value_heads=4,
                           pad_token_id=0, **_DEEPSEEK_MOE)),
    "minimax_m2": ("MiniMaxM2Config", "MoE: sigmoid top-2 of 8 with routing bias; q/k "
                   "RMSNorm over all heads, half-width rope (MiniMax-M2)",
                   dict(head_dim=32, num_local_experts=8, num_experts_per_tok=2,
                        intermediate_size=64, rotary_dim=16, partial_rotary_factor=0.5,
                        scoring_func="sigmoid", use_routing_bias=True, pad_token_id=0)),
    "exaone_moe": ("ExaoneMoeConfig", "MoE: sigmoid top-2 of 8 with correction bias, routed "
                   "scaling 2.5, a shared expert, the first layer dense; a window on "
                   "alternate layers (K-EXAONE)",
                   dict(head_dim=32, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=64, num_shared_experts=1,
                        first_k_dense_replace=1, sliding_window=WINDOW,
                        layer_types=_ALTERNATE, pad_token_id=0)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "Granite's multipliers; MoE top-2 of 8 "
                         "beside a shared expert (Granite 3 MoE with a shared expert)",
                         dict(num_local_experts=8, num_experts_per_tok=2,
                              intermediate_size=64, shared_intermediate_size=64,
                              embedding_multiplier=2.0, residual_multiplier=0.5,
                              attention_multiplier=0.1, logits_scaling=2.0, pad_token_id=0)),
    "ministral3": ("Ministral3Config", "YaRN rope (factor 16, its attention scaling) "
                   "(Ministral 3)", dict(head_dim=32, pad_token_id=0)),
    "afmoe": ("AfmoeConfig", "MoE: sigmoid top-2 of 8 with expert bias, renormalised and "
              "scaled by 2, a shared expert, the first layer dense; gated attention, q/k "
              "norms, a window on alternate layers (Arcee Trinity)",
              dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                   num_shared_experts=1, num_dense_layers=1, sliding_window=WINDOW,
                   layer_types=_ALTERNATE, score_func="sigmoid", route_norm=True,
                   route_scale=2.0, n_group=1, topk_group=1, pad_token_id=0)),
    "hy_v3": ("HYV3Config", "MoE: sigmoid top-2 of 8 with correction bias, renormalised and "
              "scaled by 2, a shared expert, the first layer dense; q/k norms (Hunyuan 3)",
              dict(head_dim=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                   moe_intermediate_size=64, expert_hidden_dim=64,
                   mlp_layer_types=["dense", "sparse"], first_k_dense_replace=1,
                   router_scaling_factor=2.0, route_norm=True, qk_norm=True,
                   pad_token_id=0)),
    "granitemoe_swa": ("GraniteMoeSWAConfig", "MoE top-2 of 8; attention sinks on every "
                       "layer, a window on alternate ones (Granite MoE SWA)",
                       dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64,
                            sliding_window=WINDOW, layer_types=_ALTERNATE, pad_token_id=0)),
    "flex_olmo": ("FlexOlmoConfig", "MoE: top-2 of 8 not renormalised; q/k RMSNorm over all "
                  "heads, norms after attention and MLP (FlexOlmo; vLLM serves it through its "
                  "Transformers MoE backend)",
                  dict(num_experts=8, num_experts_per_tok=2, intermediate_size=64,
                       pad_token_id=0)),
    # (vLLM 0.32's Laguna drops the correction bias at load: vllm_accel/models/laguna.py;
    # stock vLLM CPU cannot run it, its CPU router taking softmax scoring only)
    "laguna": ("LagunaConfig", "MoE: sigmoid top-2 of 8 with correction bias, renormalised, "
               "a shared expert, the first layer dense; gated attention, q/k norms, a window "
               "on alternate layers (Laguna)",
               dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                    shared_expert_intermediate_size=64, sliding_window=WINDOW,
                    layer_types=_ALTERNATE, pad_token_id=0)),
}
