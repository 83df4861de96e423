"""Fake vllm_gcu plugin package. The real one patches vLLM for Enflame's own
platform on import, so vllm_accel must load only its _C ops, never this."""

raise ImportError("fake vllm_gcu: vllm_accel must not import the vllm_gcu plugin package")
