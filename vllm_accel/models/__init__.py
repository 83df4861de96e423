"""vLLM model classes the plugin registers in place of vLLM's (``register_general``)."""

#: architecture -> our class, registered lazily (imported in the worker that builds it)
OVERRIDES = {"LlamaForCausalLM": "vllm_accel.models.llama:AccelLlamaForCausalLM",
             "MistralForCausalLM": "vllm_accel.models.llama:AccelMistralForCausalLM",
             "Qwen3ForCausalLM": "vllm_accel.models.llama:AccelQwen3ForCausalLM",
             "Gemma2ForCausalLM": "vllm_accel.models.llama:AccelGemma2ForCausalLM",
             "Gemma3ForCausalLM": "vllm_accel.models.llama:AccelGemma3ForCausalLM",
             "LagunaForCausalLM": "vllm_accel.models.laguna:AccelLagunaForCausalLM"}
