"""Grouped integer weights shared by every weight-only quant method.

GPTQ, AWQ and compressed-tensors ``pack-quantized`` (W4A16 / W8A16) all store
"integer codes, a float scale per (output row, input group), an optional zero
point": ``W[o, i] = (code[o, i] - zero[o, g(i)]) * scale[o, g(i)]``. They differ
only in how the checkpoint packs those tensors, so each format converts its
checkpoint tensors once at load into the single resident layout below and runs
the one kernel ``wint_linear``.

Resident layout (:class:`WIntResident`; no float copy of the weight survives
loading):

* ``qweight`` uint8, output-major: 8-bit ``[out, in]`` unsigned codes; 4-bit
  ``[out, in/2]`` two codes per byte (even column in the low nibble), i.e. the
  same 0.5 byte/weight as the checkpoints. Output-major rows are what a GEMM
  tile reads (``x @ W.T``); unsigned codes keep sym and asym alike.
* ``scales`` ``[out, G]`` in fp16 when the loaded scales are exactly
  representable in fp16, else fp32 (never the activation dtype: bf16 would
  round fp16 scales).
* ``zeros`` ``[out, G]`` zero points in code units in the scales dtype
  (integers <= 256 are exact there), or None when every zero point is
  ``2**(bits-1)`` (symmetric): the kernel then uses that constant.
* ``perm`` (int64 ``[in]``, optional): resident column ``j`` multiplies
  ``x[..., perm[j]]`` (GPTQ act-order, see gptq.py); ``g_idx`` (int32 ``[in]``,
  optional): group of resident column ``j`` when groups are not contiguous.

``wint_linear`` (kernel registry, provider ``reference``) dequantizes one K-tile
of the weight at a time (group-aligned, ``TILE_K`` columns) in fp32 and
accumulates ``x_tile @ W_tile.T`` in fp32: no dequantized weight is kept between
calls, and the peak temporary is ``out x TILE_K`` floats. A device backend
registers its own provider of ``wint_linear`` to plug in its GEMM.

Fused kernels usually want their own weight layout. A provider that has one
registers ``wint_prepare`` (resident weight -> its layout, or None when it cannot
express the layer) and ``wint_prepared_linear``; :func:`install_resident` then
keeps only the prepared layout and its module calls that provider's
GEMM (see ops/torch_fast/wint_gemm.py, the simulator's ``torch_fast`` provider).

This module is pure torch (no vLLM imports) so it can be used anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_accel.logger import init_logger
from vllm_accel.ops.registry import get_kernel, register_kernel, resolve_provider
from vllm_accel.quant.stats import LayerTotals

logger = init_logger(__name__)

KERNEL_NAME = "wint_linear"
PREPARE_NAME = "wint_prepare"
PREPARED_KERNEL_NAME = "wint_prepared_linear"
#: weight columns dequantized per step in the reference kernel
TILE_K = 512
#: bump when the resident layout changes (invalidates the repack cache)
LAYOUT_VERSION = 1


# ---------------------------------------------------------------------------
# Packing helpers
# ---------------------------------------------------------------------------


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack ``32 // bits`` fields of each int32 along ``dim`` (lowest bits first)
    into int32 values in ``[0, 2**bits)``."""
    pf = 32 // bits
    w = words.to(torch.int32).movedim(dim, -1)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    # Arithmetic shift of negative words fills with ones above bit 31; the mask
    # keeps only the field.
    v = torch.bitwise_and(w.unsqueeze(-1) >> shifts, (1 << bits) - 1)
    return v.reshape(*w.shape[:-1], w.shape[-1] * pf).movedim(-1, dim)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit codes ``[out, in]`` (in even) -> ``[out, in/2]``, even column low."""
    c = codes.to(torch.uint8)
    return (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()


def codes_of(qweight: torch.Tensor, bits: int, k0: int, k1: int) -> torch.Tensor:
    """Columns ``[k0, k1)`` of the resident weight as uint8 codes ``[out, k1-k0]``."""
    if bits == 8:
        return qweight[:, k0:k1]
    b0, b1 = k0 // 2, (k1 + 1) // 2
    p = qweight[:, b0:b1]
    both = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], -1)
    start = k0 - 2 * b0
    return both[:, start:start + (k1 - k0)]


def compact_float(t: torch.Tensor) -> torch.Tensor:
    """fp16 if that holds ``t`` exactly, else fp32."""
    t32 = t.to(torch.float32)
    t16 = t32.to(torch.float16)
    return t16 if torch.equal(t16.to(torch.float32), t32) else t32


# ---------------------------------------------------------------------------
# Resident weights
# ---------------------------------------------------------------------------


@dataclass
class WIntResident:
    """One layer's weight in the resident layout (see module doc)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    g_idx: torch.Tensor | None
    bits: int
    group_size: int  # normalized (never -1)
    in_features: int
    out_features: int

    #: ``(provider, tensors)`` when a provider's own layout replaced the generic
    #: one in the layer (set by :func:`install_resident`)
    prepared: tuple[str, dict[str, torch.Tensor]] | None = None

    TENSORS = ("qweight", "scales", "zeros", "perm", "g_idx")

    def nbytes(self) -> dict[str, int]:
        """Bytes of what the layer keeps: the generic layout, or the prepared one."""
        def size(t):
            return 0 if t is None else t.numel() * t.element_size()

        if self.prepared is not None:
            parts = {"prepared": sum(size(t) for t in self.prepared[1].values())}
        else:
            parts = {"qweight": size(self.qweight), "scales": size(self.scales),
                     "zeros": size(self.zeros), "perm": size(self.perm) + size(self.g_idx)}
        parts["total"] = sum(parts.values())
        return parts

    def dequantize(self) -> torch.Tensor:
        """float64 ``[out, in]`` in *checkpoint* column order (for tests and
        debugging only; never called on the serving path)."""
        codes = codes_of(self.qweight, self.bits, 0, self.in_features).double()
        g = (self.g_idx.long() if self.g_idx is not None
             else torch.arange(self.in_features) // self.group_size)
        z = (float(2 ** (self.bits - 1)) if self.zeros is None
             else self.zeros.double()[:, g])
        w = (codes - z) * self.scales.double()[:, g]
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w


def resident_from_codes(codes: torch.Tensor, scales: torch.Tensor,
                        zeros: torch.Tensor | None, *, bits: int, group_size: int,
                        perm: torch.Tensor | None = None,
                        g_idx: torch.Tensor | None = None) -> WIntResident:
    """Build the resident weight from unsigned codes ``[out, in]`` (values in
    ``[0, 2**bits)``), scales ``[out, G]`` and zero points ``[out, G]`` in code
    units (None: symmetric). Zero points that are all ``2**(bits-1)`` are
    dropped (the kernel's symmetric constant)."""
    out_features, in_features = codes.shape
    gs = in_features if group_size == -1 else group_size
    if bits == 4 and in_features % 2:
        raise ValueError(f"4-bit resident weights need an even input size, got {in_features}")
    scales_r = compact_float(scales)
    zeros_r = None
    if zeros is not None and not bool((zeros == 2 ** (bits - 1)).all()):
        zeros_r = zeros.to(scales_r.dtype).contiguous()
    c = codes.to(torch.uint8)
    packed = pack_nibbles(c) if bits == 4 else c.contiguous()
    return WIntResident(qweight=packed, scales=scales_r.contiguous(), zeros=zeros_r,
                        perm=perm, g_idx=g_idx, bits=bits, group_size=gs,
                        in_features=in_features, out_features=out_features)


def resident_from_signed(codes: torch.Tensor, scales: torch.Tensor, *, bits: int,
                         group_size: int = -1) -> WIntResident:
    """Symmetric signed codes ``[out, in]`` (e.g. int8 in ``[-128, 127]``) with
    scales ``[out]``, ``[out, 1]`` or ``[out, G]`` -> resident weight (codes
    offset by ``2**(bits-1)``, no zero points)."""
    if scales.dim() == 1:
        scales = scales[:, None]
    unsigned = codes.to(torch.int16) + 2 ** (bits - 1)
    return resident_from_codes(unsigned, scales, None, bits=bits, group_size=group_size)


# ---------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------


def _k_tiles(in_features: int, group_size: int, tile_k: int, uniform: bool):
    """Column tiles ``(k0, k1)``: whole groups per tile when groups are small,
    several tiles per group when a group is wider than ``tile_k``."""
    if not uniform:
        return [(k, min(k + tile_k, in_features)) for k in range(0, in_features, tile_k)]
    if group_size <= tile_k:
        step = (tile_k // group_size) * group_size
        return [(k, min(k + step, in_features)) for k in range(0, in_features, step)]
    return [(c, min(c + tile_k, g + group_size))
            for g in range(0, in_features, group_size)
            for c in range(g, g + group_size, tile_k)]


@register_kernel(KERNEL_NAME)
def wint_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor | None, *, bits: int, group_size: int,
                perm: torch.Tensor | None = None, g_idx: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, tile_k: int = TILE_K) -> torch.Tensor:
    """``y = x @ W.T (+ bias)`` for a weight in the resident layout.

    ``x`` ``[..., in]`` (fp32/bf16/fp16); ``qweight`` uint8 ``[out, in]`` (8-bit)
    or ``[out, in/2]`` (4-bit nibbles); ``scales``/``zeros`` ``[out, G]``
    (``zeros`` None: symmetric, zero ``2**(bits-1)``); ``perm`` int ``[in]``:
    resident column ``j`` multiplies ``x[..., perm[j]]``; ``g_idx`` int ``[in]``:
    group of resident column ``j`` (None: ``j // group_size``). Dequantization
    and accumulation run in fp32; the result is rounded to ``x.dtype`` once.
    """
    out_features = scales.shape[0]
    in_features = x.shape[-1]
    gs = in_features if group_size == -1 else group_size
    x2 = x.reshape(-1, in_features)
    if perm is not None:
        x2 = x2.index_select(1, perm)
    x2 = x2.to(torch.float32)
    acc = torch.zeros(x2.shape[0], out_features, dtype=torch.float32, device=x.device)
    sym_zero = float(2 ** (bits - 1))
    for k0, k1 in _k_tiles(in_features, gs, tile_k, g_idx is None):
        codes = codes_of(qweight, bits, k0, k1).to(torch.float32)  # [out, T]
        if g_idx is not None:
            gi = g_idx[k0:k1].to(torch.int64)
            s = scales[:, gi].to(torch.float32)
            z = sym_zero if zeros is None else zeros[:, gi].to(torch.float32)
            w = (codes - z) * s
        elif k1 - k0 >= gs:  # whole groups g0 .. g0+n-1
            g0, n = k0 // gs, (k1 - k0) // gs
            s = scales[:, g0:g0 + n, None].to(torch.float32)
            z = sym_zero if zeros is None else zeros[:, g0:g0 + n, None].to(torch.float32)
            w = ((codes.view(out_features, n, gs) - z) * s).view(out_features, k1 - k0)
        else:  # part of group k0 // gs
            g = k0 // gs
            s = scales[:, g:g + 1].to(torch.float32)
            z = sym_zero if zeros is None else zeros[:, g:g + 1].to(torch.float32)
            w = (codes - z) * s
        acc.addmm_(x2[:, k0:k1], w.t())
    if bias is not None:
        acc += bias.to(torch.float32)
    return acc.to(x.dtype).reshape(*x.shape[:-1], out_features)


@register_kernel(PREPARE_NAME)
def keep_generic_layout(res: WIntResident, act_dtype: torch.dtype) -> None:
    """The reference provider has no layout of its own."""
    return None


# ---------------------------------------------------------------------------
# Layer parameters and resident-bytes accounting
# ---------------------------------------------------------------------------


class InstalledWInt(torch.nn.Module):
    """A layer's weight as it serves: the generic resident tensors, run by
    ``wint_linear``, or the layout a kernel provider prepared from them, run by
    that provider's ``wint_prepared_linear``. A submodule of the layer (its
    tensors are parameters), so vLLM and torch.compile see them as the layer's."""

    def __init__(self, res: WIntResident, provider: str | None = None,
                 prepared: dict[str, torch.Tensor] | None = None) -> None:
        super().__init__()
        self.bits, self.group_size = res.bits, res.group_size
        self.out_features = res.out_features
        self.provider = provider
        # resolved once per layer: the workers register their providers first
        self.kernel = (get_kernel(KERNEL_NAME) if provider is None
                       else get_kernel(PREPARED_KERNEL_NAME, provider))
        tensors = prepared if prepared is not None else {
            name: getattr(res, name) for name in WIntResident.TENSORS}
        self.names = tuple(tensors)
        for name, t in tensors.items():
            if t is None:
                setattr(self, name, None)
            else:
                self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.provider is not None:
            return self.kernel(x, {name: getattr(self, name) for name in self.names}, bias)
        return self.kernel(x, self.qweight, self.scales, self.zeros, bits=self.bits,
                           group_size=self.group_size, perm=self.perm, g_idx=self.g_idx,
                           bias=bias)

    @property
    def generic_layout(self) -> bool:
        """Whether this module holds the generic resident tensors without an act-order
        permutation (what kernels that stack the experts of a MoE layer read)."""
        return self.provider is None and self.perm is None and self.g_idx is None

    def cpp_operands(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(int4 weight, scales and zeros) where the simulator's C++ ops (the decoder
        layer, the MoE experts) compute this weight with ``int4pack_linear``: the
        cpu_native provider's int4 layout without an act-order permutation; else None."""
        if self.provider != CPP_PROVIDER or set(self.names) != _INT4_PREPARED:
            return None
        return self.int4_weight, self.int4_scales_zeros


#: the provider whose prepared int4 layout the C++ ops read, and that layout's tensors
CPP_PROVIDER = "cpu_native"
_INT4_PREPARED = {"int4_weight", "int4_scales_zeros"}


def installed(res: WIntResident) -> InstalledWInt:
    """The module serving ``res``: the preferred provider's prepared layout when it
    has one (called while vLLM loads the model, so the default dtype is the
    activation dtype), else the generic one."""
    provider = resolve_provider(PREPARE_NAME)
    prepared = get_kernel(PREPARE_NAME, provider)(res, torch.get_default_dtype())
    if prepared is None:
        return InstalledWInt(res)
    res.prepared = (provider, prepared)
    return InstalledWInt(res, provider, prepared)


def install_resident(layer: torch.nn.Module, res: WIntResident) -> None:
    """Install the weight on ``layer`` as ``layer.wint`` (:func:`installed`).

    ``layer.qweight`` then names the installed packed weight (an alias, not another
    parameter): vLLM's LoRA layers place a quantized base layer's adapters on the
    device of its ``qweight`` (``vllm/lora/layers/utils.py``) and refuse a layer
    without one."""
    layer.wint = installed(res)
    layer.__dict__["qweight"] = next(layer.wint.parameters())


class ResidentStats(LayerTotals):
    """Resident bytes of one weight-only method's layers in the model being loaded: one
    log line per layer kind while loading, one summary once the model is loaded."""

    def __init__(self, quant_name: str, method_name: str) -> None:
        self.quant_name = quant_name
        self.method_name = method_name
        super().__init__()

    def reset(self) -> None:
        super().reset()
        self.packed = 0
        self.kernels: dict[str, int] = {}  # "kernel[provider]" -> layers

    def account(self, prefix: str, res: WIntResident, describe: str) -> None:
        """Add one layer; ``describe``: its scheme in words (e.g. '4-bit group 128 asym')."""
        nb = res.nbytes()
        n_weights = res.in_features * res.out_features
        n_groups = res.scales.shape[1]
        first_of_kind = self.add(prefix, nb["total"], n_weights)
        self.packed += int(n_weights * res.bits / 8 + n_groups * res.out_features
                           * (2 + res.bits / 8))
        if res.prepared is not None:
            kernel = f"{PREPARED_KERNEL_NAME}[{res.prepared[0]}]"
            layout = "prepared " + ", ".join(
                f"{name} {t.numel() * t.element_size()} {str(t.dtype).split('.')[-1]}"
                for name, t in res.prepared[1].items())
        else:
            kernel = f"{KERNEL_NAME}[{resolve_provider(KERNEL_NAME)}]"
            layout = (f"qweight {nb['qweight']} uint8{' nibbles' if res.bits == 4 else ''}, "
                      f"scales {nb['scales']} {str(res.scales.dtype).split('.')[-1]}, "
                      f"zeros {nb['zeros']}, perm {nb['perm']}")
        self.kernels[kernel] = self.kernels.get(kernel, 0) + 1
        if not first_of_kind:
            return
        kind = prefix.rsplit(".", 1)[-1] or "linear"
        logger.info(
            "%s %s (e.g. %s): [%d x %d] %s -> resident %d B (%s) = %.3f B/weight vs fp16 "
            "weight %d B; kernel %s", self.quant_name, kind, prefix, res.out_features,
            res.in_features, describe, nb["total"], layout, nb["total"] / n_weights,
            2 * n_weights, kernel)

    def log_summary(self) -> None:
        """The loaded layers' kernels and bytes (nothing if this method has none)."""
        if not self.layers:
            return
        logger.info(
            "%s serves %d %s layers: kernels %s; resident quantized weights %.2f MiB "
            "(checkpoint packing %.2f MiB, fp16 %.2f MiB)", self.method_name, self.layers,
            self.quant_name, ", ".join(f"{k} x{n}" for k, n in sorted(self.kernels.items())),
            self.resident / 2**20, self.packed / 2**20, self.fp16 / 2**20)
