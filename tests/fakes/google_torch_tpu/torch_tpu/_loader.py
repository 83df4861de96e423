"""Fake torch.backends entry point of Google's TorchTPU (never imported by vllm_accel)."""


def load():
    raise ImportError("fake Google torch_tpu loader")
