"""A vendor card's model runner: vLLM's device (GPU) runner, memory from the
vendor allocator. Without a card it runs on the virtual GCU
(``ACCEL_BACKEND=virtual``), forward pass included."""

import torch
from vllm.v1.structured_output.utils import apply_grammar_bitmask
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_accel import patches
from vllm_accel.backends import get_backend
from vllm_accel.logger import init_logger
from vllm_accel.ops.mla import prepare_mla_layers
from vllm_accel.quant.base import log_load_summaries
from vllm_accel.worker.memory import CardMemory, card_kv_bytes

logger = init_logger(__name__)


def _devices(tensors) -> str:
    return ", ".join(sorted({str(t.device) for t in tensors})) or "none"


class AccelCardModelRunner(GPUModelRunner):
    def __init__(self, *args, **kwargs) -> None:
        with patches.applied("card_runner", device_module=get_backend().mod):
            super().__init__(*args, **kwargs)

    def _copy_draft_token_ids_to_cpu(self, *args, **kwargs) -> None:
        with patches.applied("card_runner", device_module=get_backend().mod):
            super()._copy_draft_token_ids_to_cpu(*args, **kwargs)

    def _sync_device(self) -> None:
        get_backend().synchronize()

    def _zero_block_ids(self, block_ids: list[int]) -> None:
        """Zero freshly allocated blocks of every layer's cache (attention pages and
        Mamba states alike), as vLLM's GPU runner does with a Triton kernel."""
        if not block_ids:
            return
        index = torch.tensor(block_ids, device=self.device)
        seen = set()
        for ctx in self.compilation_config.static_forward_context.values():
            caches = getattr(ctx, "kv_cache", None)
            for cache in caches if isinstance(caches, (list, tuple)) else (caches,):
                if not isinstance(cache, torch.Tensor) or not cache.numel():
                    continue
                key = (cache.data_ptr(), cache.shape, cache.stride())
                if key not in seen:
                    seen.add(key)
                    cache.index_fill_(0, index, 0)

    def load_model(self, *args, **kwargs) -> None:
        backend = get_backend()
        before = backend.memory_allocated()
        super().load_model(*args, **kwargs)
        prepare_mla_layers(self.get_model())
        self._weight_bytes = backend.memory_allocated() - before
        logger.info("Model weights on %s (%.3f GiB allocated)", _devices(
            self.get_model().parameters()), self._weight_bytes / 2**30)
        log_load_summaries()

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        logger.info("KV cache on %s (%d layers)", _devices(self.kv_caches), len(self.kv_caches))

    def weight_bytes(self) -> int:
        return self._weight_bytes

    def sample_tokens(self, grammar_output):
        """Apply structured-output masks on the host, then sample as vLLM does.

        vLLM hands a non-CPU device's logits to xgrammar, which picks its
        torch.compile kernel for any device but cuda/npu; inductor has no code
        generator for a vendor device (a virtual GCU dies with ``KeyError: 'gcu'``).
        Masking a host copy costs one logits round trip, only on steps that
        carry a grammar.
        """
        state = self.execute_model_state
        if grammar_output is not None and state is not None:
            host_logits = state.logits.cpu()
            apply_grammar_bitmask(state.scheduler_output, grammar_output, self.input_batch,
                                  host_logits)
            state.logits.copy_(host_logits)
            grammar_output = None
        return super().sample_tokens(grammar_output)

    def plan_kv_cache_bytes(self, device_memory: int, local_rank: int) -> int:
        """Profile one worst-case step, then size the KV cache from the allocator."""
        backend = get_backend()
        backend.empty_cache()
        backend.reset_peak_memory_stats()
        self.profile_run()
        backend.synchronize()
        free, _ = backend.mem_get_info()
        mem = CardMemory(total=device_memory, free=free, weights=self._weight_bytes,
                         peak=backend.max_memory_allocated())
        return card_kv_bytes(mem, self.cache_config.gpu_memory_utilization,
                             self.cache_config.kv_cache_memory_bytes,
                             f"{backend.device_name}:{local_rank} ({backend.name})")
