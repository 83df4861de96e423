"""Out-of-tree replacements for vLLM's RMSNorm, SiluAndMul, RotaryEmbedding and
multimodal encoder attention (vision towers, Whisper's audio encoder), for its
unquantized MoE method
(:mod:`vllm_accel.ops.moe`) and its MLA layer (:mod:`vllm_accel.ops.mla_layer`).

Each replacement subclasses the vLLM op (same constructor, same buffers and
parameters, so weight loading is unchanged) and routes ``forward_native``,
``forward_cpu`` and ``forward_oot`` to kernels looked up in the kernel registry
(``get_kernel``) at call time, so a device backend can swap a kernel by
registering a preferred provider (``reference`` kernels: ``reference/elementwise.py``).

Registration happens as an import side effect (``install()`` runs at the end of
this module); the general plugin imports this module in every vLLM process.
``install()`` is idempotent: vLLM's ``register_oot`` asserts on a duplicate name,
so already-registered classes are skipped, and a stale copy of our own class (left
by a module reload) is replaced.

How vLLM uses the registration: ``CustomOp.__new__`` looks up the *class name* of
the class being constructed (``"RMSNorm"``) in ``op_registry_oot`` and instantiates
our subclass instead, on every platform. Subclasses with their own names (e.g.
``Llama3RotaryEmbedding``, ``YaRNScalingRotaryEmbedding``, ``GemmaRMSNorm``) are
*not* swapped and keep vLLM's implementations.

``register_oot`` renames the registered class to the registry key (``"RMSNorm"``),
which would make ``compilation_config.custom_ops`` entries like ``-rms_norm`` miss
our op (it would answer to ``-RMSNorm`` only). ``install()`` restores the in-tree
op name (``rms_norm``, ``silu_and_mul``, ``rotary_embedding``) so the usual
``+name``/``-name`` switches treat our op exactly like vLLM's.

This module imports ``vllm.model_executor``; import it only from the general
plugin (never from the platform module).
"""

import torch

from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.model_executor.models.whisper import WhisperEncoderAttention

from vllm_accel.logger import init_logger
from vllm_accel.ops.cpu_native import elementwise as _cpu_native  # noqa: F401  (registers)
from vllm_accel.ops.reference import attention as _reference_attention  # noqa: F401
from vllm_accel.ops.reference import elementwise as _reference  # noqa: F401  (registers)
from vllm_accel.ops.torch_fast import attention as _torch_fast_attention  # noqa: F401
from vllm_accel.ops.mla_layer import AccelMultiHeadLatentAttention
from vllm_accel.ops.moe import AccelFusedMoEMethod, UnquantizedFusedMoEMethod
from vllm_accel.ops.registry import get_kernel, resolve_provider

logger = init_logger(__name__)

# Class attribute marking our replacements, so install() can recognise a copy of
# its own class left in the registry by an earlier import of this module.
_MARKER = "_vllm_accel_oot"


# ---------------------------------------------------------------------------
# Op classes.
# ---------------------------------------------------------------------------


class AccelRMSNorm(RMSNorm):
    """vLLM ``RMSNorm`` backed by the ``rms_norm`` kernel.

    Handles every ``RMSNorm`` configuration (``has_weight=False`` and
    ``var_hidden_size`` included). Returns ``out``, or ``(out, new_residual)``
    when called with a residual, as new tensors (vLLM's native op on CPU does the
    same; only its CUDA kernel works in place).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # resolved once per layer: the workers register their providers first
        self._rms_norm = get_kernel("rms_norm")

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pass_weight = self.pass_weight if residual is None else self.pass_weight_add
        return self._rms_norm(
            x,
            self.weight.data if pass_weight else None,
            self.variance_epsilon,
            residual,
            self.variance_size_override,
        )

    forward_cpu = forward_native
    forward_oot = forward_native


class AccelSiluAndMul(SiluAndMul):
    """vLLM ``SiluAndMul`` backed by the ``silu_and_mul`` kernel."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._silu_and_mul = get_kernel("silu_and_mul")

    # vLLM declares forward_native a staticmethod (callers may use it unbound),
    # so ours is one too: it has no layer to keep its kernel on.
    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        return get_kernel("silu_and_mul")(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return self._silu_and_mul(x)

    forward_oot = forward_cpu


class AccelRotaryEmbedding(RotaryEmbedding):
    """vLLM's default ``RotaryEmbedding`` backed by the ``rotary_embedding`` kernel.

    ``forward_native`` is functional, like vLLM's. ``forward_cpu`` and
    ``forward_oot`` also write the result into ``query``/``key`` and return them,
    because vLLM's enabled (non-native) rope paths are in place and a caller may
    rely on that (deepseek_v2 passes ``is_inplace_rope=rope.enabled()``).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._rotary_embedding = get_kernel("rotary_embedding")

    def _run(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Casts the cache to query's dtype/device once and keeps it (vLLM's helper).
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        return self._rotary_embedding(
            positions,
            query,
            key,
            cos_sin_cache,
            self.head_size,
            self.rotary_dim,
            self.is_neox_style,
        )

    def _run_inplace(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        new_query, new_key = self._run(positions, query, key)
        query.copy_(new_query)
        if key is not None:
            key.copy_(new_key)
        return query, key

    def forward_native(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run(positions, query, key)

    def forward_cpu(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._run_inplace(positions, query, key)

    forward_oot = forward_cpu


class AccelMMEncoderAttention(MMEncoderAttention):
    """vLLM's multimodal encoder attention (vision towers: CLIP, SigLIP, Qwen2-VL's ViT)
    on the registry's ``varlen_attention``: bidirectional within each image's sequence
    (``cu_seqlens`` where the tower packs several, else each batch row), on the
    simulator and on a card alike, instead of torch SDPA on whatever device it is."""

    def _run(self, query, key, value, cu_seqlens=None, max_seqlen=None,
             sequence_lengths=None) -> torch.Tensor:
        bsz, q_len = query.shape[:2]
        kv_len = key.shape[1]
        q = query.reshape(bsz * q_len, self.num_heads, self.head_size)
        k = key.reshape(bsz * kv_len, self.num_kv_heads, self.head_size)
        v = value.reshape(bsz * kv_len, self.num_kv_heads, self.head_size)
        if cu_seqlens is not None:
            starts = cu_seqlens.to("cpu", torch.int32)
        else:
            starts = torch.arange(bsz + 1, dtype=torch.int32) * q_len
        logger.info_once("Multimodal encoder attention: varlen_attention (%s)",
                         resolve_provider("varlen_attention"))
        out = get_kernel("varlen_attention")(q, k, v, starts, self.scale, causal=False,
                                             key_start_loc=None if q_len == kv_len
                                             else torch.arange(bsz + 1, dtype=torch.int32)
                                             * kv_len)
        return out.reshape(query.shape if query.dim() == 4 else (bsz, q_len, -1))

    forward_native = forward_cpu = forward_oot = _run


class AccelWhisperEncoderAttention(WhisperEncoderAttention):
    """Whisper's audio encoder attention: a subclass of vLLM's multimodal encoder
    attention under its own class name (so the registry swaps it apart), on the same
    ``varlen_attention``; vLLM's ``forward`` still adds the batch dim to 2-D input."""

    forward_native = forward_cpu = forward_oot = AccelMMEncoderAttention._run


# (vLLM class, our replacement)
OOT_OPS: tuple[tuple[type, type], ...] = (
    (RMSNorm, AccelRMSNorm),
    (SiluAndMul, AccelSiluAndMul),
    (RotaryEmbedding, AccelRotaryEmbedding),
    (UnquantizedFusedMoEMethod, AccelFusedMoEMethod),
    (MMEncoderAttention, AccelMMEncoderAttention),
    (WhisperEncoderAttention, AccelWhisperEncoderAttention),
    # a pluggable layer (same registry): mla_layer.py
    (MultiHeadLatentAttentionWrapper, AccelMultiHeadLatentAttention),
)

for _vllm_cls, _ours in OOT_OPS:
    setattr(_ours, _MARKER, True)


def install() -> None:
    """Register our op classes with vLLM (``register_oot``); safe to call again.

    Skips an op whose slot already holds this class; replaces a stale copy of
    our own class (module reloaded); leaves a foreign replacement (another
    plugin's) in place with a warning.
    """
    for vllm_cls, ours in OOT_OPS:
        key = vllm_cls.__name__
        current = op_registry_oot.get(key)
        if current is ours:
            continue
        if current is not None:
            if not getattr(current, _MARKER, False):
                logger.warning(
                    "vLLM op %s already has the out-of-tree replacement %s.%s; "
                    "keeping it, so vllm_accel's %s kernel is not used for it.",
                    key,
                    current.__module__,
                    current.__qualname__,
                    ours.__name__,
                )
                continue
            del op_registry_oot[key]
        in_tree_name = vllm_cls.name
        vllm_cls.register_oot(ours)  # sets ours.name = key ...
        ours.name = in_tree_name  # ... restore "rms_norm" etc. for custom_ops switches
        logger.debug("Registered %s as the out-of-tree %s (%s)", ours.__name__, key, in_tree_name)


install()
