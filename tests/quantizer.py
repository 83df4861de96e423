"""A small round-to-nearest (RTN) quantizer that writes real GPTQ checkpoints.

Test helper, not library code. From an HF float model directory it writes

* a GPTQ checkpoint in the AutoGPTQ / GPTQModel on-disk format (``qweight``,
  ``qzeros``, ``scales``, ``g_idx`` per decoder Linear, ``quantization_config``
  in ``config.json`` and a ``quantize_config.json`` like AutoGPTQ writes), and
* optionally, the oracle: an HF float checkpoint holding the *dequantized*
  weights, which HF transformers runs as the reference for the quantized model.

On-disk format (AutoGPTQ "v1", ``checkpoint_format: gptq``), per Linear with
``in`` input and ``out`` output features, ``bits`` in {4, 8}, ``pf = 32 // bits``
values per int32 and ``G`` groups:

* ``qweight`` int32 ``[in / pf, out]``: input rows packed along dim 0; value of
  input row ``r * pf + j`` sits in bits ``[bits * j, bits * (j + 1))`` of row ``r``.
* ``qzeros`` int32 ``[G, out / pf]``: zero points packed along dim 1 the same way.
  v1 stores ``zero - 1`` (gptq_v2 stores ``zero``).
* ``scales`` fp16 ``[G, out]``.
* ``g_idx`` int32 ``[in]``: the group of each input channel.

Dequantized weight: ``W[o, i] = (q[i, o] - zero[g_idx[i], o]) * scale[g_idx[i], o]``.

Quantization per (group, output row) follows GPTQ's quantizer: the range is
widened to include 0; ``sym`` uses a range symmetric around 0 and the fixed zero
``2**(bits-1)``; asym uses ``zero = round(-min / scale)``. Scales are rounded to
fp16 *before* the codes are computed, so codes and the stored scales agree.

``desc_act`` (act-order): GPTQ quantizes input channels in descending Hessian
diagonal order and forms groups in that order. Here a random permutation stands
in for the Hessian order: ``g_idx[perm[j]] = j // group_size``. Layers that read
the same input (q/k/v, gate/up) share one permutation, as they do in real GPTQ
(their Hessians are identical).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

#: decoder Linear layers that are quantized (lm_head and embeddings are not)
#: (Mixtral names its experts' gate/down/up w1/w2/w3; routers, ``gate``, stay float)
QUANTIZED_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                     "w1", "w2", "w3")
#: layers sharing an input (and so one act-order permutation)
SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "w1": "mlp_in", "w3": "mlp_in"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
#: a decoder Linear, or a MoE expert's (``mlp.experts.<e>.gate_proj``, Mixtral's
#: ``block_sparse_moe.experts.<e>.w1``, as GPTQModel and llmcompressor write MoE
#: checkpoints: one set of tensors per expert)
LINEAR_RE = re.compile(r"^(?P<prefix>.*\.layers\.\d+\.(?:self_attn|(?:mlp|block_sparse_moe)"
                       r"(?:\.experts\.\d+)?)\.(?P<name>\w+))\.weight$")


# ---------------------------------------------------------------------------
# Packing: values (non-negative ints < 2**bits) <-> int32 words
# ---------------------------------------------------------------------------


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit patterns -> int32 with the same bits."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack ``values`` along ``dim``: ``32 // bits`` consecutive entries per int32,
    the first one in the lowest bits."""
    pf = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    assert v.shape[-1] % pf == 0, f"size {v.shape[-1]} is not a multiple of {pf}"
    assert int(v.min()) >= 0 and int(v.max()) < 2**bits, "values out of range"
    v = v.reshape(*v.shape[:-1], -1, pf)
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)  # disjoint bit fields: sum == bitwise or
    return _to_int32(words).movedim(-1, dim).contiguous()


def unpack_int32(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_int32` (returns int32 values in ``[0, 2**bits)``)."""
    pf = 32 // bits
    w = words.to(torch.int64).movedim(dim, -1) & 0xFFFFFFFF
    shifts = torch.arange(pf, dtype=torch.int64) * bits
    v = (w.unsqueeze(-1) >> shifts) & (2**bits - 1)
    v = v.reshape(*w.shape[:-1], w.shape[-1] * pf)
    return v.to(torch.int32).movedim(-1, dim).contiguous()


# ---------------------------------------------------------------------------
# Quantizing one weight
# ---------------------------------------------------------------------------


@dataclass
class QuantizedWeight:
    """Unpacked GPTQ tensors of one Linear (``q``/``zeros`` hold real values,
    i.e. the v1 ``- 1`` offset is applied only when packing)."""

    q: torch.Tensor  # int32 [in, out], codes in [0, 2**bits)
    zeros: torch.Tensor  # int32 [G, out], zero points in [0, 2**bits)
    scales: torch.Tensor  # fp16 [G, out]
    g_idx: torch.Tensor  # int32 [in]
    bits: int
    group_size: int  # normalized: never -1

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[out, in]`` a GPTQ kernel must reproduce (fp32 math:
        the integer difference is exact, one rounding for the product)."""
        g = self.g_idx.long()
        diff = (self.q - self.zeros[g]).to(torch.float32)  # [in, out]
        return (diff * self.scales[g].to(torch.float32)).t().contiguous().to(dtype)

    def pack(self, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
        """The four on-disk tensors."""
        if checkpoint_format == "gptq":
            # v1 stores zero - 1; a zero of 0 would wrap to 2**bits - 1, which
            # readers decode as 2**bits: quantize_weight keeps zeros >= 1 for v1.
            assert int(self.zeros.min()) >= 1, "v1 format cannot store a zero point of 0"
            stored = self.zeros - 1
        elif checkpoint_format == "gptq_v2":
            stored = self.zeros
        else:
            raise ValueError(f"unknown checkpoint_format {checkpoint_format!r}")
        return {
            "qweight": pack_int32(self.q, self.bits, dim=0),
            "qzeros": pack_int32(stored, self.bits, dim=1),
            "scales": self.scales.contiguous(),
            "g_idx": self.g_idx.contiguous(),
        }


def make_g_idx(in_features: int, group_size: int, perm: torch.Tensor | None) -> torch.Tensor:
    """Group of each input channel; with act-order ``perm`` (the quantization
    order), groups are formed in permuted order."""
    order = torch.arange(in_features) if perm is None else perm
    g_idx = torch.empty(in_features, dtype=torch.int32)
    g_idx[order] = (torch.arange(in_features) // group_size).to(torch.int32)
    return g_idx


def quantize_weight(w: torch.Tensor, bits: int, group_size: int, sym: bool,
                    perm: torch.Tensor | None = None,
                    min_zero: int = 1) -> QuantizedWeight:
    """RTN-quantize a float weight ``[out, in]`` GPTQ-style (see module doc).

    ``min_zero`` (asym only) clamps zero points from below; 1 keeps them
    representable in the v1 format.
    """
    out_features, in_features = w.shape
    gs = in_features if group_size == -1 else group_size
    assert in_features % gs == 0, f"group_size {gs} does not divide {in_features}"
    maxq = 2**bits - 1
    g_idx = make_g_idx(in_features, gs, perm)
    n_groups = in_features // gs
    wt = w.detach().to(torch.float32).t()  # [in, out]
    # Gather each group's channels: [G, gs, out]
    order = torch.argsort(g_idx, stable=True)
    grouped = wt[order].reshape(n_groups, gs, out_features)
    xmin = grouped.amin(1).clamp(max=0)
    xmax = grouped.amax(1).clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    dead = (xmin == 0) & (xmax == 0)
    xmin = torch.where(dead, torch.full_like(xmin, -1.0), xmin)
    xmax = torch.where(dead, torch.full_like(xmax, 1.0), xmax)
    scales = ((xmax - xmin) / maxq).to(torch.float16)
    scales = torch.where(scales == 0, torch.full_like(scales, 2**-14), scales)  # fp16 underflow
    s32 = scales.to(torch.float32)
    if sym:
        zeros = torch.full_like(s32, (maxq + 1) // 2, dtype=torch.int32)
    else:
        zeros = torch.round(-xmin / s32).clamp(min_zero, maxq).to(torch.int32)
    g = g_idx.long()
    q = torch.round(wt / s32[g]) + zeros[g]
    q = q.clamp(0, maxq).to(torch.int32)
    return QuantizedWeight(q=q, zeros=zeros, scales=scales, g_idx=g_idx, bits=bits,
                           group_size=gs)


# ---------------------------------------------------------------------------
# Whole checkpoints
# ---------------------------------------------------------------------------


def _load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    assert files, f"no safetensors in {model_dir}"
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(f))
    return state


def _copy_side_files(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, dst / name)


def quantize_checkpoint(src: Path, dst: Path, *, bits: int = 4, group_size: int = 128,
                        sym: bool = True, desc_act: bool = False, seed: int = 0,
                        checkpoint_format: str = "gptq",
                        dequant_dst: Path | None = None) -> dict[str, QuantizedWeight]:
    """Write a GPTQ checkpoint of the float model in ``src`` to ``dst``.

    With ``dequant_dst``, also write the oracle: the same model (same config, no
    ``quantization_config``) with every quantized Linear replaced by its
    dequantized float weight. Returns the unpacked tensors per layer prefix.
    """
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = _load_state_dict(src)
    gen = torch.Generator().manual_seed(seed)
    perms: dict[tuple[str, str], torch.Tensor] = {}
    out_state: dict[str, torch.Tensor] = {}
    float_state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name, tensor in state.items():
        m = LINEAR_RE.match(name)
        if m is None or m["name"] not in QUANTIZED_LINEARS:
            out_state[name] = tensor
            float_state[name] = tensor
            continue
        prefix, proj = m["prefix"], m["name"]
        perm = None
        if desc_act and group_size != -1:
            # an expert's gate/up share its own order (each expert has its Hessian)
            layer = prefix.rsplit(".", 1 if ".experts." in prefix else 2)[0]
            key = (layer, SHARED_INPUT.get(proj, proj))
            if key not in perms:
                perms[key] = torch.randperm(tensor.shape[1], generator=gen)
            perm = perms[key]
        qw = quantize_weight(tensor, bits, group_size, sym, perm=perm,
                             min_zero=1 if checkpoint_format == "gptq" else 0)
        quantized[prefix] = qw
        for suffix, t in qw.pack(checkpoint_format).items():
            out_state[f"{prefix}.{suffix}"] = t
        float_state[name] = qw.dequantize(tensor.dtype)
    save_file(out_state, str(dst / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((src / "config.json").read_text())
    quant_cfg = {
        "quant_method": "gptq", "bits": bits, "group_size": group_size,
        "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
        "static_groups": False, "true_sequential": True, "damp_percent": 0.01,
        "lm_head": False,
    }
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant_cfg},
                                                indent=2))
    (dst / "quantize_config.json").write_text(json.dumps(
        {**quant_cfg, "model_name_or_path": str(dst), "model_file_base_name": "model"},
        indent=2))
    _copy_side_files(src, dst)

    if dequant_dst is not None:
        dequant_dst = Path(dequant_dst)
        dequant_dst.mkdir(parents=True, exist_ok=True)
        save_file(float_state, str(dequant_dst / "model.safetensors"),
                  metadata={"format": "pt"})
        (dequant_dst / "config.json").write_text(json.dumps(config, indent=2))
        _copy_side_files(src, dequant_dst)
    return quantized


# ---------------------------------------------------------------------------
# AWQ (AutoAWQ GEMM) and compressed-tensors (llmcompressor pack-quantized)
# ---------------------------------------------------------------------------
#
# AutoAWQ GEMM on disk, per Linear (4-bit, ``G = in / group_size``):
#   qweight int32 [in, out/8]   packed along the OUTPUT dim; bit field f of word c
#                               holds column 8c + AWQ_PACK_ORDER[f]
#   qzeros  int32 [G, out/8]    zero points (real values), same packing
#   scales  fp16  [G, out]
#   W[o, i] = (q[i, o] - z[i // gs, o]) * s[i // gs, o]
# config.json quantization_config = AutoAWQ's ``to_transformers_dict()``:
#   {quant_method: awq, zero_point, group_size, bits, version: gemm,
#    modules_to_not_convert}
# Quantization follows AutoAWQ's pseudo_quantize_tensor (zero_point=True): per
# (row, group) min/max (not widened to 0), scale = (max - min).clamp(1e-5) / 15,
# zero = clamp(-round(min / scale), 0, 15). (AWQ's activation-aware scale search
# only changes the float weights it starts from, not the format.)
#
# compressed-tensors pack-quantized, per Linear (pf = 32 // bits):
#   weight_packed     int32 [out, ceil(in/pf)]   q + 2**(bits-1), packed along the
#                                                INPUT dim, lowest bits first
#   weight_scale      [out, G] (G = 1: channel)  model dtype
#   weight_zero_point int32 [ceil(out/pf), G]    asym only: zp + 2**(bits-1),
#                                                packed along the OUTPUT dim
#   weight_shape      int64 [2] = (out, in)
#   W = (q - zp) * scale with signed q in [-2**(bits-1), 2**(bits-1) - 1]
# config.json quantization_config is written by compressed_tensors'
# ModelCompressor.update_config (exactly what llmcompressor saves).
# Quantization follows compressed-tensors' min/max qparams: the range is widened
# to include 0; sym: scale = max|w| / ((qmax - qmin) / 2), zp = 0; asym:
# scale = (max - min) / (qmax - qmin), zp = clamp(round(qmin - min / scale)).

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_awq(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """``[R, C]`` values -> AutoAWQ-packed int32 ``[R, C/8]`` (interleaved order)."""
    pf = 32 // bits
    v = values.to(torch.int64)
    r, c = v.shape
    assert c % pf == 0, f"size {c} is not a multiple of {pf}"
    v = v.reshape(r, c // pf, pf)
    words = torch.zeros(r, c // pf, dtype=torch.int64)
    for f in range(pf):  # AutoAWQ: word |= col[order_map[f]] << (f * bits)
        words |= v[:, :, AWQ_PACK_ORDER[f]] << (f * bits)
    return _to_int32(words)


def unpack_awq(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Inverse of :func:`pack_awq` (int32 values)."""
    pf = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    r, cw = w.shape
    out = torch.empty(r, cw, pf, dtype=torch.int64)
    for f in range(pf):
        out[:, :, AWQ_PACK_ORDER[f]] = (w >> (f * bits)) & (2**bits - 1)
    return out.reshape(r, cw * pf).to(torch.int32)


@dataclass
class AWQWeight:
    q: torch.Tensor  # int32 [out, in] codes in [0, 15]
    zeros: torch.Tensor  # int32 [out, G]
    scales: torch.Tensor  # fp16 [out, G]
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = torch.arange(self.q.shape[1]) // self.group_size
        diff = (self.q - self.zeros[:, g]).to(torch.float32)
        return (diff * self.scales[:, g].to(torch.float32)).to(dtype)

    def pack(self) -> dict[str, torch.Tensor]:
        return {"qweight": pack_awq(self.q.t()), "qzeros": pack_awq(self.zeros.t()),
                "scales": self.scales.t().contiguous()}


def quantize_awq(w: torch.Tensor, group_size: int, bits: int = 4) -> AWQWeight:
    """RTN AutoAWQ-style (zero_point=True) quantization of ``w`` ``[out, in]``."""
    out_features, in_features = w.shape
    gs = in_features if group_size == -1 else group_size
    assert in_features % gs == 0
    max_int = 2**bits - 1
    wg = w.detach().to(torch.float32).reshape(out_features, in_features // gs, gs)
    max_val, min_val = wg.amax(-1), wg.amin(-1)
    scales = ((max_val - min_val).clamp(min=1e-5) / max_int).to(torch.float16)
    s32 = scales.to(torch.float32)
    zeros = (-torch.round(min_val / s32)).clamp(0, max_int)
    q = (torch.round(wg / s32[..., None]) + zeros[..., None]).clamp(0, max_int)
    return AWQWeight(q=q.reshape(out_features, in_features).to(torch.int32),
                     zeros=zeros.to(torch.int32), scales=scales, group_size=gs)


def _pack_padded(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """:func:`pack_int32` after zero-padding ``dim`` to a multiple of ``32 // bits``
    (compressed-tensors pads a partial last word with zeros)."""
    pf = 32 // bits
    pad = (-values.shape[dim]) % pf
    if pad:
        shape = list(values.shape)
        shape[dim] = pad
        values = torch.cat([values, torch.zeros(shape, dtype=values.dtype)], dim=dim)
    return pack_int32(values, bits, dim=dim)


@dataclass
class CTWeight:
    q: torch.Tensor  # int32 [out, in] signed codes
    zp: torch.Tensor  # int32 [out, G] signed zero points (0 when symmetric)
    scale: torch.Tensor  # [out, G] in the model dtype
    bits: int
    group_size: int  # normalized (never -1)
    symmetric: bool

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        g = torch.arange(self.q.shape[1]) // self.group_size
        diff = (self.q - self.zp[:, g]).to(torch.float32)
        return (diff * self.scale[:, g].to(torch.float32)).to(dtype)

    def pack(self) -> dict[str, torch.Tensor]:
        off = 2 ** (self.bits - 1)
        out = {"weight_packed": _pack_padded(self.q + off, self.bits, dim=1),
               "weight_scale": self.scale.contiguous(),
               "weight_shape": torch.tensor(list(self.q.shape), dtype=torch.int64)}
        if not self.symmetric:
            out["weight_zero_point"] = _pack_padded(self.zp + off, self.bits, dim=0)
        return out


def quantize_ct(w: torch.Tensor, bits: int, group_size: int, symmetric: bool) -> CTWeight:
    """RTN compressed-tensors-style quantization of ``w`` ``[out, in]``;
    ``group_size`` -1 means strategy ``channel``. Scales are rounded to ``w``'s
    dtype (llmcompressor stores them in the model dtype) before the codes."""
    out_features, in_features = w.shape
    gs = in_features if group_size == -1 else group_size
    assert in_features % gs == 0
    qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    wg = w.detach().to(torch.float32).reshape(out_features, in_features // gs, gs)
    min_val = wg.amin(-1).clamp(max=0)
    max_val = wg.amax(-1).clamp(min=0)
    if symmetric:
        scale = torch.maximum(min_val.abs(), max_val) / ((qmax - qmin) / 2)
    else:
        scale = (max_val - min_val) / (qmax - qmin)
    scale = torch.where(scale == 0, torch.full_like(scale, 1e-6), scale).to(w.dtype)
    s32 = scale.to(torch.float32)
    if symmetric:
        zp = torch.zeros_like(s32)
    else:
        zp = torch.round(qmin - min_val / s32).clamp(qmin, qmax)
    q = (torch.round(wg / s32[..., None]) + zp[..., None]).clamp(qmin, qmax)
    return CTWeight(q=q.reshape(out_features, in_features).to(torch.int32),
                    zp=zp.to(torch.int32), scale=scale, bits=bits, group_size=gs,
                    symmetric=symmetric)


def _write_quantized(src: Path, dst: Path, quantize_one, skip: tuple[str, ...],
                     dequant_dst: Path | None) -> dict:
    """Shared walk: quantize every decoder Linear not matching ``skip``
    (substrings of the layer prefix) with ``quantize_one(tensor) -> weight``
    (an object with ``pack()`` and ``dequantize(dtype)``); write the tensors (and
    the dequantized oracle). Returns the weights per layer prefix."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = _load_state_dict(src)
    out_state: dict[str, torch.Tensor] = {}
    float_state: dict[str, torch.Tensor] = {}
    quantized = {}
    for name, tensor in state.items():
        m = LINEAR_RE.match(name)
        if (m is None or m["name"] not in QUANTIZED_LINEARS
                or any(s in m["prefix"] for s in skip)):
            out_state[name] = tensor
            float_state[name] = tensor
            continue
        qw = quantize_one(tensor)
        quantized[m["prefix"]] = qw
        for suffix, t in qw.pack().items():
            out_state[f"{m['prefix']}.{suffix}"] = t
        float_state[name] = qw.dequantize(tensor.dtype)
    save_file(out_state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    _copy_side_files(src, dst)
    if dequant_dst is not None:
        dequant_dst = Path(dequant_dst)
        dequant_dst.mkdir(parents=True, exist_ok=True)
        save_file(float_state, str(dequant_dst / "model.safetensors"),
                  metadata={"format": "pt"})
        (dequant_dst / "config.json").write_text((src / "config.json").read_text())
        _copy_side_files(src, dequant_dst)
    return quantized


def quantize_checkpoint_awq(src: Path, dst: Path, *, group_size: int = 128,
                            modules_to_not_convert: list[str] | None = None,
                            dequant_dst: Path | None = None) -> dict[str, AWQWeight]:
    """Write an AutoAWQ GEMM checkpoint (4-bit, zero point) of the model in ``src``.
    Layers whose prefix contains an entry of ``modules_to_not_convert`` stay
    float (and are listed in the config, as AutoAWQ does)."""
    skip = tuple(modules_to_not_convert or ())
    layers = _write_quantized(src, dst, lambda w: quantize_awq(w, group_size), skip,
                              dequant_dst)
    config = json.loads((Path(src) / "config.json").read_text())
    quant_cfg = {"quant_method": "awq", "zero_point": True, "group_size": group_size,
                 "bits": 4, "version": "gemm",
                 "modules_to_not_convert": modules_to_not_convert}
    (Path(dst) / "config.json").write_text(json.dumps({**config,
                                                       "quantization_config": quant_cfg},
                                                      indent=2))
    return layers


def ct_quantization_config(bits: int, group_size: int, symmetric: bool,
                           ignore: list[str]):
    """The compressed-tensors QuantizationConfig llmcompressor builds for a
    W{bits}A16 scheme (``group_size`` -1: strategy channel)."""
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
    )

    strategy = "channel" if group_size == -1 else "group"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric,
                            strategy=strategy,
                            group_size=None if group_size == -1 else group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=args, format="pack-quantized")
    return QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized",
                              quantization_status="compressed", ignore=ignore)


def quantize_checkpoint_ct(src: Path, dst: Path, *, bits: int = 4, group_size: int = 128,
                           symmetric: bool = True, ignore: list[str] | None = None,
                           dequant_dst: Path | None = None) -> dict[str, CTWeight]:
    """Write a compressed-tensors ``pack-quantized`` W{bits}A16 checkpoint of the
    model in ``src``. ``ignore`` lists layer names (exact, or ``re:`` regexes as
    llmcompressor writes them) kept float in addition to ``lm_head``."""
    from compressed_tensors.compressors import ModelCompressor

    ignore = ["lm_head"] + list(ignore or [])
    regexes = [re.compile(i[3:]) for i in ignore if i.startswith("re:")]
    exact = {i for i in ignore if not i.startswith("re:")}
    src, dst = Path(src), Path(dst)
    state_names = [m["prefix"] for n in _load_state_dict(src) if (m := LINEAR_RE.match(n))]
    skip = tuple(p for p in state_names
                 if p in exact or any(r.match(p) for r in regexes))
    layers = _write_quantized(src, dst, lambda w: quantize_ct(w, bits, group_size, symmetric),
                              skip, dequant_dst)
    (dst / "config.json").write_text((src / "config.json").read_text())
    ModelCompressor(quantization_config=ct_quantization_config(
        bits, group_size, symmetric, ignore)).update_config(str(dst))
    return layers
