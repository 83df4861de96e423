"""W8A8 int8 linear layers (compressed-tensors ``int-quantized``) on vllm_accel devices.

Checkpoint format (llmcompressor / compressed-tensors ``int-quantized``), per
quantized Linear with ``out``/``in`` features:

* ``weight`` int8 ``[out, in]``: symmetric codes in ``[-128, 127]``;
* ``weight_scale`` ``[out, 1]`` (strategy ``channel``) or ``[1]`` (strategy
  ``tensor``), in the model's float dtype: ``W = weight * weight_scale``;
* static activations only: ``input_scale`` ``[1]`` and, when asymmetric,
  ``input_zero_point`` int8 ``[1]``: ``x_q = clamp(round(x / s) + zp, -128, 127)``.
  Dynamic activations store nothing: scales are computed per token at run time.

Merged layers (qkv, gate_up) load one ``weight_scale`` per shard under the
``tensor`` strategy. They are kept exactly by expanding each shard's scale over
that shard's output rows (a per-channel scale vector) instead of re-quantizing
the codes to the largest scale, which would round every other shard's codes a
second time. Static ``input_scale``/``input_zero_point`` are also loaded per
shard; the shards read the same input, so calibration gives them identical
values. If they differ, the union of their ranges is used (logged).

Resident layout (no float copy of the weight survives loading):

* ``weight`` int8 ``[out, in]`` (the checkpoint's codes, output-major);
* ``weight_scale`` fp32 ``[out]`` (per channel, also for ``tensor``);
* ``input_scale`` fp32 scalar and ``input_zero_point`` int32 scalar (static only);
* ``weight_col_sums`` int32 ``[out]`` = ``sum_i weight[o, i]`` (asymmetric
  activations only): ``(x_q - zp) @ W_q.T = x_q @ W_q.T - zp * col_sums``.

Kernel ``int8_linear`` (registry, provider ``reference``): quantizes the
activations (``int8_quant_act``), multiplies ``int8 x int8 -> int32`` exactly
(``torch._int_mm``; if this torch build lacks a CPU ``_int_mm``, an exact
fp32 path over K chunks of <= 1024 columns, see :func:`int8_mm`), then applies
``x_scale[m] * w_scale[o]`` in fp32. The exact integer accumulation makes the
result equal, up to the final fp32 scaling, to float64 math on the quantized
operands: that is what the tests check.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import (
    ChannelQuantScaleParameter,
    ModelWeightParameter,
    PerTensorScaleParameter,
)

from vllm_accel.logger import init_logger
from vllm_accel.ops.registry import get_kernel, register_kernel
from vllm_accel.quant.base import layer_error, load_summary
from vllm_accel.quant.moe import QuantMoEMethod
from vllm_accel.quant.stats import LayerTotals

logger = init_logger(__name__)

QUANT_NAME = "compressed-tensors W8A8 int8"
WEIGHT_STRATEGIES = ("channel", "tensor")
INT8_MIN, INT8_MAX = -128, 127
#: fp32 sums of int8 x int8 products stay exact up to 2**24 = 1024 * 128 * 128
EXACT_FP32_CHUNK = 1024
#: sentinel for per-shard tensors the checkpoint did not provide
_UNLOADED_ZP = -(2**20)


_fail = functools.partial(layer_error, QUANT_NAME)


# ---------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------

_int_mm_state: dict[str, object] = {}


def _int_mm_works(device: torch.device) -> bool:
    """Whether ``torch._int_mm`` runs (and is exact) on ``device``; probed once
    per device type. Older torch builds have no CPU implementation, and oneDNN's
    AVX2 int8 GEMM (CPUs without AVX-512 or AVX-VNNI: AMD Zen 1-3) sums pairs of
    products in saturating int16 (VPMADDUBSW), wrong wherever two codes of a row meet
    two large weights: the probe has such rows and columns."""
    key = device.type
    if key not in _int_mm_state:
        try:
            gen = torch.Generator().manual_seed(0)
            a = torch.randint(-128, 128, (4, 64), generator=gen, dtype=torch.int8)
            b = torch.randint(-128, 128, (64, 8), generator=gen, dtype=torch.int8)
            a[0], a[1], b[:, 0], b[:, 1] = 127, -128, 127, -128
            exact = a.long() @ b.long()
            ok = torch.equal(torch._int_mm(a.to(device), b.to(device)).cpu().long(), exact)
            reason = "" if ok else "returned a wrong result"
        except (RuntimeError, NotImplementedError, AttributeError) as e:
            ok, reason = False, str(e).splitlines()[0]
        if not ok:
            logger.warning("torch._int_mm unusable on %s (%s): int8_linear uses %s", key,
                           reason, "the simulator's own int8 GEMM"
                           if _native_int8_gemm(device) else "the exact chunked fp32 path")
        _int_mm_state[key] = ok
    return bool(_int_mm_state[key])


def _native_int8_gemm(device: torch.device) -> bool:
    """Whether the simulator's kernel library has an exact int8 GEMM of its own
    (``vllm_accel::int8_gemm``: CPUs with AVX2 but no AVX-512)."""
    from vllm_accel.ops.cpu_native import int8_linear as native_w8a8

    return device.type == "cpu" and native_w8a8.own_gemm()


def resolve_mm_method(device: torch.device) -> str:
    """The exact int8 GEMM ``int8_mm`` uses on ``device``: torch's where it is exact,
    else the simulator's own where built, else chunked fp32."""
    if _int_mm_works(device):
        return "int_mm"
    return "native" if _native_int8_gemm(device) else "fp32_exact"


#: what the log calls each method
_MM_NAMES = {"int_mm": "torch._int_mm", "native": "vllm_accel::int8_gemm",
             "fp32_exact": "exact chunked fp32"}


def int8_mm(a: torch.Tensor, w: torch.Tensor, method: str = "auto") -> torch.Tensor:
    """Exact ``a @ w.T`` for int8 ``a`` ``[M, K]`` and int8 ``w`` ``[N, K]`` -> int32.

    ``int_mm``: ``torch._int_mm`` (int32 accumulation). ``native``: the simulator's
    ``vllm_accel::int8_gemm`` (the same sums). ``fp32_exact``: fp32 GEMMs over K
    chunks of at most 1024 columns; every partial sum is an integer of magnitude <=
    1024 * 128 * 128 = 2**24, which fp32 holds exactly, and the chunk results are
    summed in int32. ``auto``: :func:`resolve_mm_method`'s choice.
    """
    if method == "auto":
        method = resolve_mm_method(a.device)
    if method == "int_mm":
        return torch._int_mm(a, w.t())
    if method == "native":
        return torch.ops.vllm_accel.int8_gemm(a, w)
    if method != "fp32_exact":
        raise ValueError(f"unknown int8_mm method {method!r}")
    k = a.shape[1]
    acc = None
    for k0 in range(0, k, EXACT_FP32_CHUNK):
        k1 = min(k0 + EXACT_FP32_CHUNK, k)
        part = (a[:, k0:k1].to(torch.float32) @ w[:, k0:k1].to(torch.float32).t())
        part = part.to(torch.int32)
        acc = part if acc is None else acc + part
    return acc


@register_kernel("int8_quant_act")
def int8_quant_act(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                   input_zero_point: torch.Tensor | None = None, *,
                   symmetric: bool = True):
    """Quantize activations ``x`` ``[M, K]`` to int8.

    Static (``input_scale`` given): ``q = clamp(round(x / s) + zp, -128, 127)``
    with the checkpoint's scalar ``s``/``zp`` (compressed-tensors' formula).
    Dynamic: one scale per token (row); symmetric ``s = amax / 127`` (no code
    clips); asymmetric ``s = (max - min) / 255`` over a range widened to hold 0,
    ``zp = round(-128 - min / s)``. Returns ``(q int8 [M, K], scale fp32 [M, 1]
    or scalar, zp int32 [M, 1] / scalar or None)``.
    """
    xf = x.to(torch.float32)
    if input_scale is not None:
        s = input_scale.to(torch.float32)
        q = torch.round(xf / s)
        zp = None
        if input_zero_point is not None:
            zp = input_zero_point.to(torch.int32)
            q = q + zp.to(torch.float32)
        return q.clamp_(INT8_MIN, INT8_MAX).to(torch.int8), s, zp
    if symmetric:
        s = xf.abs().amax(dim=1, keepdim=True) / INT8_MAX
        s = torch.where(s == 0, torch.ones_like(s), s)
        q = torch.round(xf / s).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return q, s, None
    lo = xf.amin(dim=1, keepdim=True).clamp(max=0)
    hi = xf.amax(dim=1, keepdim=True).clamp(min=0)
    s = (hi - lo) / (INT8_MAX - INT8_MIN)
    s = torch.where(s == 0, torch.ones_like(s), s)
    zp = torch.round(INT8_MIN - lo / s).clamp_(INT8_MIN, INT8_MAX)
    q = (torch.round(xf / s) + zp).clamp_(INT8_MIN, INT8_MAX).to(torch.int8)
    return q, s, zp.to(torch.int32)


@register_kernel("int8_linear")
def int8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, *,
                input_scale: torch.Tensor | None = None,
                input_zero_point: torch.Tensor | None = None,
                input_symmetric: bool = True,
                weight_col_sums: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, mm_method: str = "auto") -> torch.Tensor:
    """``y = dequant(quant(x)) @ dequant(W).T (+ bias)`` for an int8 weight.

    ``x`` ``[..., K]`` (fp32/bf16/fp16); ``weight`` int8 ``[N, K]``;
    ``weight_scale`` fp32 ``[N]``; ``input_scale`` None = dynamic per-token
    scales, else the static scalar (with ``input_zero_point`` when asymmetric);
    ``weight_col_sums`` int32 ``[N]`` is required for asymmetric activations.
    The int8 GEMM accumulates exactly in int32; scaling and bias run in fp32
    and the result is rounded to ``x.dtype`` once.
    """
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    quant = get_kernel("int8_quant_act")
    q, x_scale, x_zp = quant(x2, input_scale, input_zero_point, symmetric=input_symmetric)
    acc = int8_mm(q, weight, mm_method)  # int32 [M, N]
    if x_zp is not None:
        if weight_col_sums is None:
            raise ValueError("int8_linear: asymmetric activations need weight_col_sums")
        acc = acc - x_zp * weight_col_sums.view(1, n)
    y = acc.to(torch.float32) * x_scale
    y = y * weight_scale.view(1, n).to(torch.float32)
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# ---------------------------------------------------------------------------
# Loaded checkpoint tensors -> resident layout
# ---------------------------------------------------------------------------


@dataclass
class W8A8Resident:
    """One layer's resident W8A8 tensors (see module doc)."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    input_zero_point: torch.Tensor | None
    weight_col_sums: torch.Tensor | None

    def nbytes(self) -> dict[str, int]:
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        parts = {"weight": size(self.weight), "weight_scale": size(self.weight_scale),
                 "input": size(self.input_scale) + size(self.input_zero_point),
                 "col_sums": size(self.weight_col_sums)}
        parts["total"] = sum(parts.values())
        return parts


def _merge_static_input(scales: torch.Tensor, zps: torch.Tensor | None, prefix: str):
    """One static activation scale (and zero point) for all shards of a merged
    layer: equal shards are kept as they are; otherwise the union of the
    shards' ranges (the only single quantizer that clips none of them)."""
    scales = scales.to(torch.float32).flatten()
    if zps is None:
        if bool((scales == scales[0]).all()):
            return scales[0].clone(), None
        logger.info("%s: shards of %s have different static input scales %s; using their "
                    "max", QUANT_NAME, prefix, scales.tolist())
        return scales.max(), None
    zps = zps.to(torch.int32).flatten()
    if bool((scales == scales[0]).all()) and bool((zps == zps[0]).all()):
        return scales[0].clone(), zps[0].clone()
    lo = (scales * (INT8_MIN - zps)).min()
    hi = (scales * (INT8_MAX - zps)).max()
    s = (hi - lo) / (INT8_MAX - INT8_MIN)
    zp = torch.round(INT8_MIN - lo / s).clamp(INT8_MIN, INT8_MAX).to(torch.int32)
    logger.info("%s: shards of %s have different static input quantizers; using the "
                "union of their ranges (scale %g, zero point %d)", QUANT_NAME, prefix,
                float(s), int(zp))
    return s, zp


def w8a8_to_resident(weight: torch.Tensor, weight_scale: torch.Tensor,
                     logical_widths: list[int], *, strategy: str,
                     input_scale: torch.Tensor | None = None,
                     input_zero_point: torch.Tensor | None = None,
                     input_symmetric: bool = True, prefix: str = "<layer>") -> W8A8Resident:
    """Checkpoint tensors as loaded (possibly merged shards) -> resident layout."""
    if weight.dtype != torch.int8:
        raise _fail(prefix, f"weight has dtype {weight.dtype}, not int8",
                    "serve an int-quantized (W8A8 int8) compressed-tensors checkpoint")
    n = weight.shape[0]
    ws = weight_scale.to(torch.float32)
    if strategy == "channel":
        ws = ws.reshape(n)
    elif strategy == "tensor":
        ws = ws.reshape(-1)
        if ws.numel() != len(logical_widths):
            raise _fail(prefix, f"{ws.numel()} per-tensor weight scales for "
                        f"{len(logical_widths)} shards", "re-export the checkpoint")
        ws = torch.repeat_interleave(ws, torch.tensor(logical_widths))
    else:
        raise _fail(prefix, f"weight strategy {strategy!r} is not supported for W8A8 "
                    f"(supported: {', '.join(WEIGHT_STRATEGIES)})",
                    "quantize the weights per channel or per tensor")
    if not bool(torch.isfinite(ws).all()) or not bool((ws > 0).all()):
        raise _fail(prefix, "weight_scale is missing for some shard or not positive",
                    "check that the checkpoint holds weight_scale for every shard "
                    "(q/k/v, gate/up)")
    s_in = zp_in = col_sums = None
    if input_scale is not None:
        if not bool(torch.isfinite(input_scale).all()) or not bool((input_scale > 0).all()):
            raise _fail(prefix, "input_scale is missing for some shard or not positive",
                        "check that the checkpoint holds input_scale for every shard")
        if not input_symmetric:
            if input_zero_point is None or bool((input_zero_point == _UNLOADED_ZP).any()):
                raise _fail(prefix, "asymmetric static activations without "
                            "input_zero_point for every shard", "re-export the checkpoint")
        s_in, zp_in = _merge_static_input(input_scale, None if input_symmetric
                                          else input_zero_point, prefix)
    if not input_symmetric:
        col_sums = weight.to(torch.int32).sum(dim=1, dtype=torch.int32)
    return W8A8Resident(weight=weight.contiguous(), weight_scale=ws.contiguous(),
                        input_scale=s_in, input_zero_point=zp_in, weight_col_sums=col_sums)


class InstalledW8A8(torch.nn.Module):
    """A layer's W8A8 weight as it serves: int8 codes, their scales and the static
    activation quantizer, run by ``int8_linear`` with the int8 GEMM probed at
    load. A submodule of the layer (its tensors are parameters)."""

    TENSORS = ("weight", "weight_scale", "input_scale", "input_zero_point", "weight_col_sums")

    def __init__(self, res: W8A8Resident, input_symmetric: bool, mm_method: str) -> None:
        super().__init__()
        for name in self.TENSORS:
            t = getattr(res, name)
            if t is None:
                setattr(self, name, None)
            else:
                self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        self.input_symmetric = input_symmetric
        self.mm_method = mm_method
        self.out_features = res.weight.shape[0]
        # resolved once per layer: the workers register their providers first
        self.kernel = get_kernel("int8_linear")

    def cpp_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(int8 weight ``[N, K]``, float32 per-channel scales) where the simulator's
        C++ ops (the decoder layer, the MoE experts) compute this linear with
        ``int8_linear_dynamic``: the cpu_native kernel, dynamic symmetric per-token
        activations and an int8 GEMM it runs; else None."""
        from vllm_accel.ops.cpu_native import int8_linear as native_w8a8

        if (self.kernel is native_w8a8.int8_linear and native_w8a8.NATIVE_DISPATCH
                and self.input_scale is None and self.input_symmetric
                and native_w8a8.takes_mm_method(self.mm_method) and self.weight.dim() == 2
                and self.weight.stride(1) == 1):
            return self.weight, self.weight_scale
        return None

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel(x, self.weight, self.weight_scale, input_scale=self.input_scale,
                           input_zero_point=self.input_zero_point,
                           input_symmetric=self.input_symmetric,
                           weight_col_sums=self.weight_col_sums, bias=bias,
                           mm_method=self.mm_method)


# ---------------------------------------------------------------------------
# vLLM linear method
# ---------------------------------------------------------------------------

# Resident bytes over the W8A8 layers of the model being loaded, logged after loading.
_totals = LayerTotals()


@load_summary
def _log_summary() -> None:
    if not _totals.layers:
        return
    kernel = get_kernel("int8_linear")
    logger.info(
        "AccelW8A8LinearMethod serves %d layers: kernel int8_linear = %s.%s (int8 GEMM: %s); "
        "resident quantized weights %.2f MiB (fp16 %.2f MiB)", _totals.layers,
        kernel.__module__, kernel.__qualname__,
        ", ".join(f"{dev} {_MM_NAMES[resolve_mm_method(torch.device(dev))]}"
                  for dev in sorted(_int_mm_state)),
        _totals.resident / 2**20, _totals.fp16 / 2**20)


@register_weight_loader_v2_supported_method
class AccelW8A8LinearMethod(LinearMethodBase):
    """Loads compressed-tensors W8A8 int8 tensors through vLLM's loaders (TP
    sharding, qkv/gate_up merging), keeps them int8 and runs ``int8_linear``.

    ``weight_strategy``: ``channel`` or ``tensor``; ``input_dynamic``: per-token
    scales at run time (else the checkpoint's static ``input_scale``);
    ``input_symmetric``: False adds zero points (``input_zero_point`` for static).
    """

    def __init__(self, weight_strategy: str, input_dynamic: bool, input_symmetric: bool,
                 prefix: str = "") -> None:
        if weight_strategy not in WEIGHT_STRATEGIES:
            raise _fail(prefix, f"weight strategy {weight_strategy!r} is not supported for "
                        f"W8A8 int8 (supported: {', '.join(WEIGHT_STRATEGIES)})",
                        "re-quantize with strategy 'channel' (llmcompressor's W8A8 preset)")
        self.weight_strategy = weight_strategy
        self.input_dynamic = bool(input_dynamic)
        self.input_symmetric = bool(input_symmetric)
        self.prefix = prefix

    def create_weights(self, layer: torch.nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        weight_loader = extra_weight_attrs.get("weight_loader")
        out_pp = sum(output_partition_sizes)
        n_shards = len(output_partition_sizes)
        layer.logical_widths = list(output_partition_sizes)
        weight = ModelWeightParameter(
            data=torch.empty(out_pp, input_size_per_partition, dtype=torch.int8),
            input_dim=1, output_dim=0, weight_loader=weight_loader)
        layer.register_parameter("weight", weight)
        # fp32 holds bf16/fp16/fp32 checkpoint scales exactly. NaN marks
        # "not loaded", caught in process_weights_after_loading.
        if self.weight_strategy == "channel":
            scale = ChannelQuantScaleParameter(
                data=torch.full((out_pp, 1), float("nan"), dtype=torch.float32),
                output_dim=0, weight_loader=weight_loader)
        else:
            scale = PerTensorScaleParameter(
                data=torch.full((n_shards,), float("nan"), dtype=torch.float32),
                weight_loader=weight_loader)
        layer.register_parameter("weight_scale", scale)
        if not self.input_dynamic:
            # one per shard (merged layers load q/k/v's or gate/up's each)
            layer.register_parameter("input_scale", PerTensorScaleParameter(
                data=torch.full((n_shards,), float("nan"), dtype=torch.float32),
                weight_loader=weight_loader))
            if not self.input_symmetric:
                layer.register_parameter("input_zero_point", PerTensorScaleParameter(
                    data=torch.full((n_shards,), _UNLOADED_ZP, dtype=torch.int32),
                    weight_loader=weight_loader))

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        static = not self.input_dynamic
        res = w8a8_to_resident(
            layer.weight.data, layer.weight_scale.data, layer.logical_widths,
            strategy=self.weight_strategy,
            input_scale=layer.input_scale.data if static else None,
            input_zero_point=(layer.input_zero_point.data
                              if static and not self.input_symmetric else None),
            input_symmetric=self.input_symmetric, prefix=self.prefix)
        for name in ("weight", "weight_scale", "input_scale", "input_zero_point"):
            if hasattr(layer, name):
                delattr(layer, name)
        # probed here, at load: never inside a compiled graph
        self.mm_method = resolve_mm_method(res.weight.device)
        layer.w8a8 = InstalledW8A8(res, self.input_symmetric, self.mm_method)
        self._account(res)

    def _account(self, res: W8A8Resident) -> None:
        nb = res.nbytes()
        n_out, n_in = res.weight.shape
        if not _totals.add(self.prefix, nb["total"], n_out * n_in):
            return
        kind = self.prefix.rsplit(".", 1)[-1] or "linear"
        act = ("dynamic per-token" if self.input_dynamic else "static per-tensor") + (
            " sym" if self.input_symmetric else " asym")
        logger.info(
            "W8A8 int8 %s (e.g. %s): [%d x %d] weight %s, activations %s -> resident %d B "
            "(int8 weight %d, scales %d, input %d, col sums %d) = %.3f B/weight vs fp16 "
            "weight %d B", kind, self.prefix, n_out, n_in, self.weight_strategy, act,
            nb["total"], nb["weight"], nb["weight_scale"], nb["input"], nb["col_sums"],
            nb["total"] / (n_out * n_in), 2 * n_out * n_in)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor:
        return layer.w8a8(x, bias)


class AccelW8A8MoEMethod(QuantMoEMethod):
    """W8A8 int8 experts (per-channel weights, dynamic symmetric per-token
    activations, as llmcompressor's W8A8 preset writes them): vLLM's MoE loader fills
    ``w13_weight`` ``[E, 2I, H]`` / ``w2_weight`` ``[E, H, I]`` int8 and their
    per-channel scales; each expert then serves like a dense W8A8 linear."""

    quant_name = QUANT_NAME
    TENSORS = ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale")

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition,
                       params_dtype, **extra_weight_attrs):
        from vllm.model_executor.layers.fused_moe import FusedMoeWeightScaleSupported

        self.check_layer(layer)
        e, h, i = num_experts, hidden_size, intermediate_size_per_partition
        weights = {"w13_weight": (e, 2 * i, h), "w2_weight": (e, h, i)}
        # NaN marks "not loaded" (w8a8_to_resident refuses it)
        scales = {"w13_weight_scale": (e, 2 * i, 1), "w2_weight_scale": (e, h, 1)}
        scale_attrs = {**extra_weight_attrs,
                       "quant_method": FusedMoeWeightScaleSupported.CHANNEL.value}
        self.register_expert_tensors(
            layer, {name: (shape, torch.int8) for name, shape in weights.items()},
            extra_weight_attrs, e, h, i, params_dtype, extra_weight_attrs, biases=False)
        self.register_expert_tensors(
            layer, {name: (shape, torch.float32) for name, shape in scales.items()},
            scale_attrs, e, h, i, params_dtype, extra_weight_attrs, fill=float("nan"))

    def checkpoint_tensors(self) -> tuple[str, ...]:
        return self.TENSORS

    def expert_linears(self, layer, e: int):
        mm_method = resolve_mm_method(layer.w13_weight.device)
        i = layer.w2_weight.shape[2]

        def one(proj: str, widths: list[int]):
            res = w8a8_to_resident(getattr(layer, f"{proj}_weight")[e],
                                   getattr(layer, f"{proj}_weight_scale")[e], widths,
                                   strategy="channel", prefix=f"{self.prefix}.{e}.{proj}")
            return InstalledW8A8(res, True, mm_method)

        return one("w13", [i, i]), one("w2", [layer.w2_weight.shape[1]])

    def describe(self) -> str:
        return "int8 per-channel weights, dynamic per-token int8 activations"
