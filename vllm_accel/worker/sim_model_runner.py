"""The simulated GCU's model runner: vLLM's CPU runner, with device decisions
routed through the backend and the weight/activation accounting its memory
budget needs."""

import ctypes

import psutil

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from vllm_accel import compile_cache, envs
from vllm_accel.backends import get_backend
from vllm_accel.backends.cpu_sim.huge_pages import HUGE_PAGE, back_with_huge_pages
from vllm_accel.backends.cpu_sim.weight_arena import gather_weights
from vllm_accel.logger import init_logger
from vllm_accel.models.llama import prepare_fused_layers
from vllm_accel.ops.mla import prepare_mla_layers
from vllm_accel.quant.base import log_load_summaries

logger = init_logger(__name__)


def _release_free_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``; a
    no-op elsewhere)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _tables_packed_later(model) -> int:
    """Bytes of the copy vLLM packs of an input embedding at its first matmul
    (``patches._pack_at_first_matmul``): only a model without an LM head layer of
    its own runs that matmul (it reuses the embedding for its logits)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    modules = list(model.modules())
    if any(isinstance(m, ParallelLMHead) for m in modules):
        return 0
    return sum(m.weight.numel() * m.weight.element_size() for m in modules
               if getattr(getattr(m, "cpu_linear", None), "packs_at_first_matmul", False))


class AccelSimModelRunner(CPUModelRunner):
    def _sync_device(self) -> None:
        get_backend().synchronize()

    def load_model(self, *args, **kwargs) -> None:
        rss_before = psutil.Process().memory_info().rss
        super().load_model(*args, **kwargs)
        model = self.get_model()
        tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
        # (a tied embedding and LM head can be two parameters on one storage: once)
        parameter_bytes = sum(nbytes for _, nbytes in {
            (t.data_ptr(), t.numel() * t.element_size()) for t in tensors.values()})
        # vLLM's CPU linear layers repack weights into oneDNN handles and drop
        # the parameters, so resident growth is the truer size of the weights --
        # once the heap has handed back the originals they replaced (the device
        # process keeps freed heap memory, backends/cpu_sim; counted, they added
        # 0.1-0.3 GiB to the default model's 0.6 GiB in float32, run to run).
        _release_free_heap()
        self._weight_bytes = (max(parameter_bytes,
                                  psutil.Process().memory_info().rss - rss_before)
                              + _tables_packed_later(model))
        log_load_summaries()
        prepare_fused_layers(model)
        prepare_mla_layers(model)
        # before the first forward, where vLLM hashes the config for its compile cache
        compile_cache.add_to_config(self.vllm_config)
        self._place_weights(model, list(tensors.values()), parameter_bytes)

    def _place_weights(self, model, tensors: list, parameter_bytes: int) -> None:
        """Gather the weights into one block in forward order and back them with huge
        pages, as configured, and log what that gave."""
        huge_pages = envs.ACCEL_SIM_HUGE_PAGES
        if envs.ACCEL_SIM_WEIGHT_ARENA:
            gathered = gather_weights(model, huge_pages)
            logger.info("Weights: %.1f MiB in one block in forward order%s, %.1f MiB left "
                        "where they loaded (held outside the model)%s "
                        "(ACCEL_SIM_WEIGHT_ARENA=off leaves all there)", gathered.moved / 2**20,
                        f" ({gathered.huge / 2**20:.1f} MiB of it in {HUGE_PAGE >> 20} MiB pages)"
                        if huge_pages else "", gathered.kept / 2**20,
                        f"; {gathered.problem}" if gathered.problem else "")
            tensors = gathered.left
        if huge_pages and tensors:
            huge, problem = back_with_huge_pages(tensors)
            logger.info("Weights in %d MiB pages: %.1f of %.1f MiB of parameters%s "
                        "(ACCEL_SIM_HUGE_PAGES=off keeps 4 KiB pages)", HUGE_PAGE >> 20,
                        huge / 2**20, parameter_bytes / 2**20,
                        f"; {problem}" if problem else "")

    def weight_bytes(self) -> int:
        """Device memory the loaded weights occupy."""
        return self._weight_bytes

    def activation_reserve_bytes(self) -> int:
        """Peak activation memory of the largest step the scheduler may run.

        A real card measures this with a profiling forward pass; host RSS is too
        noisy for that, so the simulator reserves an upper estimate: per batched
        token the residual stream, QKV, MLP activations (fp32 worst case), plus
        fp32 logits and sampler buffers for every running sequence. Where the MLP
        width is per layer (Gemma 3n's list), the widest layer's.
        """
        model_config = self.model_config
        text_config = model_config.hf_text_config
        hidden = model_config.get_hidden_size()
        intermediate = getattr(text_config, "intermediate_size", None) or 4 * hidden
        if isinstance(intermediate, (list, tuple)):
            intermediate = max(intermediate)
        tokens = self.scheduler_config.max_num_batched_tokens
        seqs = self.scheduler_config.max_num_seqs
        per_token = (6 * hidden + 3 * intermediate) * 4
        logits = seqs * model_config.get_vocab_size() * 4 * 2
        return tokens * per_token + logits
