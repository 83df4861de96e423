"""Fake of Enflame's FlashAttention build: only its vLLM interface, ``vllm_flash_attn``."""
