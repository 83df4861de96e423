"""Device-agnostic worker: vLLM's CPU worker with memory and device decisions
taken by the active device backend (simulated GCU memory, not host RAM)."""

from vllm_accel.worker.worker import AccelWorker

__all__ = ["AccelWorker"]
