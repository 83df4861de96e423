"""Out-of-tree replacements for vLLM's RMSNorm, SiluAndMul and RotaryEmbedding.

Each replacement subclasses the vLLM op (same constructor, same buffers and
parameters, so weight loading is unchanged) and routes ``forward_native``,
``forward_cpu`` and ``forward_oot`` to kernels looked up in the kernel registry
(``get_kernel``) at call time, so a device backend can swap a kernel by
registering a preferred provider. The ``reference`` kernels here reproduce the
numerics of vLLM's torch-native implementations operation for operation.

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
import torch.nn.functional as F

from vllm.model_executor.custom_op import CustomOp, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from vllm_accel.logger import init_logger
from vllm_accel.ops import custom_ops_native  # noqa: F401  (registers the cpu_native provider)
from vllm_accel.ops.registry import get_kernel, register_kernel

logger = init_logger(__name__)

# Class attribute marking our replacements, so install() can recognise a copy of
# its own class left in the registry by an earlier import of this module.
_MARKER = "_vllm_accel_oot"


# ---------------------------------------------------------------------------
# Reference kernels (plain torch).
# ---------------------------------------------------------------------------


@register_kernel("rms_norm")
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    residual: torch.Tensor | None = None,
    variance_size: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMS normalization, optionally fused with a residual add.

    Without ``residual``: returns ``out``. With ``residual``: returns
    ``(out, new_residual)`` where ``new_residual = (x + residual)`` rounded to
    ``x.dtype`` and ``out`` is the norm of the *unrounded* float32 sum (vLLM's
    ``fused_add_rms_norm`` semantics). Functional: the inputs are not modified.

    Numerics follow vLLM: the sum and the statistics are float32; the normalized
    value is cast to ``weight.dtype`` *before* the weight multiply, then to
    ``x.dtype``. ``weight=None`` skips the multiply. ``variance_size`` computes the
    mean square over the first ``variance_size`` channels only (but normalizes all).
    """
    orig_dtype = x.dtype
    h = x.to(torch.float32)
    new_residual = None
    if residual is not None:
        h = h + residual.to(torch.float32)
        new_residual = h.to(orig_dtype)
    h_var = h if variance_size is None else h[..., :variance_size]
    variance = h_var.pow(2).mean(dim=-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if weight is not None:
        h = h.to(weight.dtype) * weight
    out = h.to(orig_dtype)
    if new_residual is None:
        return out
    return out, new_residual


@register_kernel("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(x[..., :d]) * x[..., d:]`` with ``d = x.shape[-1] // 2``.

    Computed in ``x.dtype``, like vLLM's native op.
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rotate(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_tokens: int,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` channels of every head of ``x``.

    ``x`` is ``[num_tokens, num_heads * head_size]`` or ``[..., num_heads,
    head_size]`` (any shape whose elements regroup as ``[num_tokens, -1,
    head_size]``); the result has ``x``'s shape. ``cos``/``sin``:
    ``[num_tokens, rotary_dim // 2]``.
    """
    shape = x.shape
    x = x.reshape(num_tokens, -1, head_size)
    cos = cos.unsqueeze(-2).to(x.dtype)
    sin = sin.unsqueeze(-2).to(x.dtype)
    rot = x[..., :rotary_dim]
    if is_neox_style:
        # Pairs (i, i + rotary_dim/2).
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        # GPT-J style: interleaved pairs (2i, 2i + 1).
        x1 = rot[..., 0::2]
        x2 = rot[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if is_neox_style:
        rot = torch.cat((o1, o2), dim=-1)
    else:
        rot = torch.stack((o1, o2), dim=-1).flatten(-2)
    if rotary_dim < head_size:
        rot = torch.cat((rot, x[..., rotary_dim:]), dim=-1)
    return rot.reshape(shape)


@register_kernel("rotary_embedding")
def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    head_size: int,
    rotary_dim: int,
    is_neox_style: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary position embedding; returns new ``(query, key)`` (inputs untouched).

    ``positions``: token positions, any shape (flattened to ``[T]``).
    ``query``/``key``: ``[T, H * head_size]`` (how vLLM's attention layers pass
    them) or ``[T, H, head_size]``; ``key`` may be ``None`` and may have fewer
    heads than ``query``. ``cos_sin_cache``: ``[max_positions, rotary_dim]``, cos
    in the first half, sin in the second. ``rotary_dim <= head_size``: channels
    past ``rotary_dim`` pass through (partial rotary). The rotation is computed
    in each tensor's own dtype with cos/sin cast to it, like vLLM's native op.
    """
    if rotary_dim > head_size or rotary_dim % 2:
        raise ValueError(
            f"rotary_dim must be even and <= head_size; got rotary_dim={rotary_dim}, "
            f"head_size={head_size}"
        )
    positions = positions.flatten()
    num_tokens = positions.shape[0]
    cos, sin = cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
    query = _rotate(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    if key is not None:
        key = _rotate(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    return query, key


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

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        pass_weight = self.pass_weight if residual is None else self.pass_weight_add
        return get_kernel("rms_norm")(
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

    # vLLM declares forward_native a staticmethod (callers may use it unbound),
    # so ours is one too.
    @staticmethod
    def forward_native(x: torch.Tensor) -> torch.Tensor:
        return get_kernel("silu_and_mul")(x)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return get_kernel("silu_and_mul")(x)

    forward_oot = forward_cpu


class AccelRotaryEmbedding(RotaryEmbedding):
    """vLLM's default ``RotaryEmbedding`` backed by the ``rotary_embedding`` kernel.

    ``forward_native`` is functional, like vLLM's. ``forward_cpu`` and
    ``forward_oot`` also write the result into ``query``/``key`` and return them,
    because vLLM's enabled (non-native) rope paths are in place and a caller may
    rely on that (deepseek_v2 passes ``is_inplace_rope=rope.enabled()``).
    """

    def _run(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Casts the cache to query's dtype/device once and keeps it (vLLM's helper).
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        return get_kernel("rotary_embedding")(
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


# (vLLM class, our replacement)
OOT_OPS: tuple[tuple[type[CustomOp], type[CustomOp]], ...] = (
    (RMSNorm, AccelRMSNorm),
    (SiluAndMul, AccelSiluAndMul),
    (RotaryEmbedding, AccelRotaryEmbedding),
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
