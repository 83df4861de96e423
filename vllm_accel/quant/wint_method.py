"""The weight-only integer scheme (``wint``) behind every weight-only format.

A format (GPTQ, AWQ, compressed-tensors pack-quantized, online W8A16) differs
only in the checkpoint tensors it registers and how it turns them into the
shared resident weight (:class:`~vllm_accel.quant.packed.WIntResident`). This
linear method does the rest once: after loading it converts the checkpoint
tensors (through the on-disk repack cache), drops them, installs the resident
weight (a kernel provider's prepared layout when it has one), accounts its bytes
and runs the kernel. A format subclasses it with ``create_weights`` (vLLM
parameters, with its checks) and :meth:`to_resident`.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.linear import LinearMethodBase

from vllm_accel.quant import repack_cache
from vllm_accel.quant.base import layer_error, load_summary
from vllm_accel.quant.packed import ResidentStats, WIntResident, install_resident


class WIntLinearMethod(LinearMethodBase):
    """A format subclasses it as ``class M(WIntLinearMethod, quant_name=...,
    cache_format=...)``: ``quant_name`` starts its errors and logs, ``cache_format``
    names its conversions in the repack cache (None: convert at every load)."""

    quant_name: str
    cache_format: str | None
    #: resident bytes of this method's layers in this process (one per subclass)
    stats: ResidentStats

    def __init_subclass__(cls, quant_name: str, cache_format: str | None = None,
                          **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.quant_name, cls.cache_format = quant_name, cache_format
        cls.stats = ResidentStats(quant_name, cls.__name__)
        load_summary(cls.stats.log_summary)

    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix

    def fail(self, problem: str, fix: str) -> ValueError:
        """The startup error for this layer: what it cannot serve, and the fix."""
        return layer_error(self.quant_name, self.prefix, problem, fix)

    def group_size_error(self, group_size: int, input_size: int, row_parallel: bool,
                         examples: str) -> ValueError:
        """``group_size`` does not divide the layer's (per-rank) input size."""
        return self.fail(
            f"group_size {group_size} does not divide the input size {input_size}"
            + (" per rank" if row_parallel else ""),
            f"use a checkpoint quantized with a group size that divides it ({examples})"
            + (", or a smaller tensor-parallel size" if row_parallel else ""))

    # -- what a format provides ---------------------------------------------

    def checkpoint_tensors(self) -> list[str]:
        """The layer parameters ``create_weights`` registered that convert into the
        resident weight."""
        raise NotImplementedError

    def to_resident(self, sources: dict[str, torch.Tensor]) -> WIntResident:
        """The loaded checkpoint tensors (possibly a TP shard) -> resident weight."""
        raise NotImplementedError

    def cache_params(self) -> dict:
        """What, besides the tensors, decides the conversion (the cache key)."""
        return {}

    def describe(self, res: WIntResident) -> str:
        """The layer's quantization in words, for the load log."""
        raise NotImplementedError

    #: other parameters ``create_weights`` registered, dropped after loading
    unused_tensors: tuple[str, ...] = ()

    # -- the shared part ------------------------------------------------------

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        sources = {n: getattr(layer, n).data for n in self.checkpoint_tensors()}
        if self.cache_format is None:
            res = self.to_resident(sources)
        else:
            res = repack_cache.cached_resident(self.cache_format, self.cache_params(), sources,
                                               lambda: self.to_resident(sources))
        for name in (*sources, *self.unused_tensors):
            delattr(layer, name)
        install_resident(layer, res)
        self.stats.account(self.prefix, res, self.describe(res))

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.wint(x, bias)
