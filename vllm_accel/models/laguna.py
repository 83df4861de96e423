"""Laguna with its router's correction bias loaded."""

import re
from collections.abc import Iterable

import torch
from vllm.model_executor.models.laguna import LagunaForCausalLM

#: where checkpoints keep a MoE layer's router correction bias
_CHECKPOINT_BIAS = re.compile(r"(.*layers\.\d+\.mlp\.experts\.)e_score_correction_bias$")


class AccelLagunaForCausalLM(LagunaForCausalLM):
    """vLLM 0.32's Laguna hands each MoE layer's correction bias to its MoE runner,
    whose routed experts hold it one module deeper than checkpoints name it
    (``mlp.experts.e_score_correction_bias``); the loader skips unmatched names ending
    in ``_bias``, so the bias stayed zero and routing picked other experts (0.7 nats
    off HF on a tiny model). Loads it into the parameter the runner holds."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def rest():
            for name, tensor in weights:
                found = _CHECKPOINT_BIAS.match(name)
                if found and name not in params:
                    target = next((p for p in params if p.startswith(found.group(1))
                                   and p.endswith(".e_score_correction_bias")), None)
                    if target is not None:
                        params[target].data.copy_(tensor.to(params[target].dtype))
                        loaded.add(target)
                        continue
                yield name, tensor

        return super().load_weights(rest()) | loaded
