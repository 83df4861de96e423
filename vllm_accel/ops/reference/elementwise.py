"""``reference`` RMSNorm, SiluAndMul and rotary embedding in plain torch: they
reproduce the numerics of vLLM's torch-native implementations operation for
operation (the ops in ``custom_ops`` call them through the kernel registry)."""

import torch
import torch.nn.functional as F

from vllm_accel.ops.registry import register_kernel


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


def rotate(
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
    query = rotate(query, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    if key is not None:
        key = rotate(key, cos, sin, num_tokens, head_size, rotary_dim, is_neox_style)
    return query, key
