"""LoRA on every backend: the punica wrapper vLLM's LoRA layers call, on the kernel
registry's ``lora_linear`` (a whole layer: every output slice, each token's adapter) and
``lora_shrink`` / ``lora_expand`` (the LM head's adapters; ``reference/lora.py``,
``torch_fast/lora.py``, ``cpu_native/lora.py``).

vLLM 0.32's CPU wrapper (``PunicaWrapperCPU``, what the CPU platform and so the plugin
would otherwise get) indexes the stacked adapter weights with each token's slot, and a
request without an adapter has slot ``-1``: Python indexing takes the last slot, so in a
batch that mixes requests with and without adapters, the plain requests ran an adapter
(measured on stock vLLM CPU too). These ops skip slot ``-1``. The wrapper keeps vLLM's
bookkeeping (``PunicaWrapperBase``: slots per token, prefill metadata) and routes the
per-token products through the registry, so a card backend can plug in its own kernels.
"""

from typing import Any

import torch
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

from vllm_accel.ops.cpu_native import lora as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import lora as _reference  # noqa: F401  (registers)
from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import lora as _torch_fast  # noqa: F401  (registers)


class AccelPunicaWrapper(PunicaWrapperCPU):
    """Every shrink/expand of vLLM's wrapper through ``lora_shrink`` / ``lora_expand``
    with each token's slot (prefill and decode alike: ``token_lora_indices``)."""

    def add_lora_linear(self, y: torch.Tensor, x: torch.Tensor,
                        lora_a_stacked: tuple[torch.Tensor, ...],
                        lora_b_stacked: tuple[torch.Tensor, ...], scale: float,
                        output_slices: tuple[int, ...], *, buffer=None,
                        **kwargs: Any) -> torch.Tensor:
        """One ``lora_linear`` call for the layer (vLLM's wrapper: a shrink and an
        expand per slice); ``add_inputs=False`` (vLLM's side-stream path) writes the
        adapters' part alone."""
        if not kwargs.get("add_inputs", True):
            y[:, :sum(output_slices)] = 0
        get_kernel("lora_linear")(y, x, lora_a_stacked, lora_b_stacked,
                                  self.token_lora_indices, scale, output_slices)
        return y

    def _shrink(self, y, x, w_t_all, scale):
        get_kernel("lora_shrink")(x, w_t_all, y, self.token_lora_indices, scale)

    def _expand(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs):
        get_kernel("lora_expand")(x, w_t_all, y, self.token_lora_indices, y_offset,
                                  y_slice_size, add_inputs)

    def _shrink_prefill(self, y, x, w_t_all, scale):
        if not self.no_lora:
            self._shrink(y, x, w_t_all, scale)

    def _shrink_decode(self, y, x, w_t_all, scale):
        self._shrink(y, x, w_t_all, scale)

    def _expand_prefill(self, y, x, w_t_all, add_inputs):
        if not self.no_lora:
            self._expand(y, x, w_t_all, 0, y.shape[1], add_inputs)

    def _expand_decode(self, y, x, w_t_all, add_inputs):
        self._expand(y, x, w_t_all, 0, y.shape[1], add_inputs)

    def _expand_slice_prefill(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs):
        if not self.no_lora:
            self._expand(y, x, w_t_all, y_offset, y_slice_size, add_inputs)

    def _expand_slice_decode(self, y, x, w_t_all, y_offset, y_slice_size, add_inputs):
        self._expand(y, x, w_t_all, y_offset, y_slice_size, add_inputs)

    def add_lora_logits(self, y: torch.Tensor, x: torch.Tensor, lora_a_stacked: torch.Tensor,
                        lora_b_stacked: torch.Tensor, scale, *, buffer=None,
                        **kwargs: Any) -> None:
        """The LM head's adapters, per request (``sampler_indices``)."""
        y_org = y
        y, x = y.view(-1, y.shape[-1]), x.view(-1, x.shape[-1])
        r = lora_b_stacked.size(-1)
        if buffer is None:
            buffer = torch.zeros((x.size(0), r), dtype=torch.float32, device=x.device)
        get_kernel("lora_shrink")(x, lora_a_stacked, buffer, self.sampler_indices, scale)
        get_kernel("lora_expand")(buffer, lora_b_stacked, y, self.sampler_indices, 0,
                                  y.shape[1], True)
        y.view_as(y_org)
