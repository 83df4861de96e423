"""Our kernels and vLLM custom-op replacements, dispatched through the kernel registry."""
