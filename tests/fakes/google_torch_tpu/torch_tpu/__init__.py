"""Fake of Google's TorchTPU (PyPI torch-tpu 0.2.0): layout and metadata only.
vllm_accel must ignore it without importing it."""

raise ImportError("fake Google torch_tpu: vllm_accel must not import this package")
