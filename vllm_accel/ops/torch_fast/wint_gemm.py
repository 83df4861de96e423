"""``torch_fast`` provider of the weight-only integer GEMM: torch's fused CPU kernels.

The ``reference`` ``wint_linear`` dequantizes fp32 tiles of the weight on every
call: exact and general, but at batch 1 it moves ~10 bytes per weight where a
bf16 GEMV moves 2. torch ships fused CPU kernels that read the packed weight
directly: ``_weight_int4pack_mm_for_cpu`` (4-bit, groups of 32/64/128/256) and
``_weight_int8pack_mm`` (8-bit, one scale per output channel). They need their
own weight layouts, so this provider works in two steps, both through the kernel
registry:

* ``wint_prepare(res, act_dtype)`` at load: the resident weight in the fused
  kernel's layout, or None when the kernel cannot express it (the layer then
  keeps the generic layout and the ``reference`` kernel). Prepared layouts are
  as compact as the generic one (0.5 byte/weight at 4-bit), and the generic
  copy is dropped.
* ``wint_prepared_linear(x, prepared, bias)`` per call.

``_weight_int4pack_mm_for_cpu`` is vectorized for bf16 activations only: for fp32
and fp16 it runs a scalar loop (2.3 GFLOP/s on one core of an Intel Xeon with AMX,
torch 2.13: 60-80x slower than the ``reference`` kernel's fp32 tiles from 8 rows,
at par at one row; a virtual GCU's fp32 profile run of 8192 tokens took 17 s in two
layers). So 4-bit weights with fp32/fp16 activations keep the generic layout and
the ``reference`` kernel here; ``cpu_native``, whose C++ kernel reads the int4
layout with fp32 activations at any row count, prepares it for fp32 as well
(``int4_act_dtypes``).

``_weight_int8pack_mm`` is fast for bf16 activations only (10-35x slower than a
dense GEMM for fp32/fp16 on this torch): 8-bit weights with other activations, or
with ``K`` not a multiple of 16, run ``vllm_accel::int8_weight_mm`` instead, which
converts output-row tiles of the int8 codes to fp32 and multiplies in fp32, the
per-channel scale applied once per output (exact codes, one rounding at the end).
It is a ``torch.library`` custom op, so torch.compile keeps it as one call.

Both kernels evaluate ``W = (q - z) * s`` exactly as the generic layout does:
4-bit uses torch's form ``(q - 8) * s + z'`` with ``z' = (8 - z) * s``; 8-bit
asymmetric adds the zero-point term as a rank-1 correction
``x.sum(-1) * ((128 - z) * s)``. Scales (and ``z'``) are held in the activation
dtype, as the kernels require: exact for fp32 models, rounded to bf16/fp16
otherwise (relative error <= 2**-9 per group, below the output rounding).
"""

from __future__ import annotations

import torch

from vllm_accel.ops.registry import register_kernel

PROVIDER = "torch_fast"
#: activation dtypes torch's int4 CPU kernel runs vectorized (see above)
INT4_ACT_DTYPES = (torch.bfloat16,)
#: group sizes torch's int4 CPU kernel accepts
INT4_GROUP_SIZES = (256, 128, 64, 32)
#: output features must be a multiple of this for the int4 weight layout
INT4_N_MULTIPLE = 16
#: input features must be a multiple of this for the int8 kernel
INT8_K_MULTIPLE = 16
#: output rows converted to fp32 per step in int8_weight_mm (temporary rows x K floats)
INT8_TILE_ROWS = 1024


@torch.library.custom_op("vllm_accel::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``x @ (weight * scales[:, None]).T`` for int8 ``weight`` ``[N, K]`` and
    fp32 ``scales`` ``[N]``: codes converted a tile of rows at a time (exact)."""
    x = x.to(torch.float32)
    n = weight.shape[0]
    if n <= INT8_TILE_ROWS:
        return (x @ weight.to(torch.float32).t()) * scales
    y = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    for n0 in range(0, n, INT8_TILE_ROWS):
        n1 = min(n0 + INT8_TILE_ROWS, n)
        torch.matmul(x, weight[n0:n1].to(torch.float32).t(), out=y[:, n0:n1])
    return y.mul_(scales)


@int8_weight_mm.register_fake
def _int8_weight_mm_shape(x, weight, scales):
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


def _int4_group_size(group_size: int, in_features: int) -> int | None:
    """The largest kernel group size that tiles every checkpoint group (scales
    are then repeated per sub-group, which is exact)."""
    for gs in INT4_GROUP_SIZES:
        if group_size % gs == 0 and in_features % gs == 0:
            return gs
    return None


@register_kernel("wint_prepare", PROVIDER)
def prepare(res, act_dtype: torch.dtype,
            int4_act_dtypes: tuple[torch.dtype, ...] = INT4_ACT_DTYPES
            ) -> dict[str, torch.Tensor] | None:
    """The fused kernel's layout of a :class:`~vllm_accel.quant.packed.WIntResident`,
    or None if it has none (non-uniform act-order groups, unsupported shapes, 4-bit
    weights with activations not in ``int4_act_dtypes``). torch's int4 and int8pack
    kernels are CPU kernels, which a card's torch does not have: a weight on another
    device keeps the generic layout at 4 bits and takes ``int8_weight_mm`` (plain
    torch ops) at 8."""
    if res.g_idx is not None or act_dtype not in (torch.float32, torch.bfloat16,
                                                  torch.float16):
        return None
    # (here, not at import: vllm_accel.quant's package import registers this module's
    # kernels, so importing it first would find this module half-initialized)
    from vllm_accel.quant.packed import codes_of

    n, k = res.out_features, res.in_features
    on_cpu = res.qweight.device.type == "cpu"
    if res.bits == 4 and not on_cpu:
        return None
    codes = codes_of(res.qweight, res.bits, 0, k)  # uint8 [N, K]
    scales = res.scales.to(torch.float32)  # [N, G]
    zeros = (torch.full_like(scales, float(2 ** (res.bits - 1))) if res.zeros is None
             else res.zeros.to(torch.float32))
    prepared: dict[str, torch.Tensor] = {}
    if res.bits == 4:
        gs = _int4_group_size(res.group_size, k)
        if gs is None or n % INT4_N_MULTIPLE or act_dtype not in int4_act_dtypes:
            return None
        repeat = res.group_size // gs
        s = scales.repeat_interleave(repeat, dim=1)
        z = ((8.0 - zeros) * scales).repeat_interleave(repeat, dim=1)
        prepared["int4_weight"] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32), 1)
        prepared["int4_scales_zeros"] = torch.stack((s.t(), z.t()), dim=-1).to(
            act_dtype).contiguous()  # [K/gs, N, 2]
    elif res.bits == 8:
        if scales.shape[1] != 1:
            return None
        signed = (codes.to(torch.int16) - 128).to(torch.int8).contiguous()
        # torch 2.13's CPU _weight_int8pack_mm returns wrong values (or crashes)
        # unless K is a multiple of 16 (probed over 486 shapes), and is slow but for bf16.
        if on_cpu and act_dtype == torch.bfloat16 and k % INT8_K_MULTIPLE == 0:
            prepared["int8_weight"] = signed
            prepared["int8_scales"] = scales[:, 0].to(act_dtype).contiguous()
        else:
            prepared["int8_tile_weight"] = signed
            prepared["int8_tile_scales"] = scales[:, 0].contiguous()
        if res.zeros is not None:
            prepared["int8_zero_term"] = ((128.0 - zeros[:, 0]) * scales[:, 0]).contiguous()
    else:
        return None
    if res.perm is not None:
        prepared["perm"] = res.perm
    return prepared


@register_kernel("wint_prepared_linear", PROVIDER)
def prepared_linear(x: torch.Tensor, prepared: dict[str, torch.Tensor],
                    bias: torch.Tensor | None = None,
                    int4_mm=torch.ops.aten._weight_int4pack_mm_for_cpu) -> torch.Tensor:
    """``x @ W.T (+ bias)`` with a weight :func:`prepare` made (``int4_mm``: the
    int4 layout's matmul, torch's or another provider's on the same layout)."""
    in_features = x.shape[-1]
    x2 = x.reshape(-1, in_features)
    if "perm" in prepared:
        x2 = x2.index_select(1, prepared["perm"])
    x2 = x2.contiguous()
    if "int4_weight" in prepared:
        scales_zeros = prepared["int4_scales_zeros"]  # [K / group, N, 2]
        y = int4_mm(x2, prepared["int4_weight"], in_features // scales_zeros.shape[0],
                    scales_zeros)
    else:
        if "int8_weight" in prepared:
            y = torch.ops.aten._weight_int8pack_mm(x2, prepared["int8_weight"],
                                                   prepared["int8_scales"])
        else:
            y = torch.ops.vllm_accel.int8_weight_mm(x2, prepared["int8_tile_weight"],
                                                    prepared["int8_tile_scales"])
        if "int8_zero_term" in prepared:  # rank-1 zero-point term, summed in fp32
            term = x2.sum(dim=-1, keepdim=True, dtype=torch.float32) * prepared["int8_zero_term"]
            y = y.to(torch.float32) + term
        y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], y.shape[-1])
