"""Test quantizer: writes llmcompressor-format W8A8 int8 checkpoints.

The output matches what llmcompressor (``QuantizationModifier(scheme="W8A8")``
and variants) saves through compressed-tensors' ``ModelCompressor``:

* ``config.json`` ``quantization_config``: compressed-tensors'
  ``QuantizationConfig`` dumped the way ``ModelCompressor.update_config`` does
  (``quant_method: compressed-tensors``, ``format: int-quantized``,
  ``quantization_status: compressed``, one ``config_groups.group_0`` targeting
  ``Linear``, ``ignore: ["lm_head"]``, ``version``, empty sparsity/transform).
  The config is built with compressed-tensors' own pydantic classes, so every
  field and default is the library's.
* per quantized Linear: ``weight`` int8 ``[out, in]``, ``weight_scale``
  (``[out, 1]`` channel / ``[1]`` tensor, in the weight's dtype); static
  activations add ``input_scale`` ``[1]`` and, if asymmetric,
  ``input_zero_point`` int8 ``[1]``. Zero points of symmetric quantizers are
  not saved (compressed-tensors drops them).

Quantization parameters come from compressed-tensors' ``calculate_qparams``
(min-max, range widened to hold 0; symmetric int8: ``scale = absmax / 127.5``
with codes clamped to ``[-128, 127]``) and codes from its ``quantize``. Static
activation ranges are calibrated by running the float model in HF transformers
over calibration prompts (a min-max observer over all tokens).

With ``dequant_dst`` the oracle checkpoint is written too: same config without
``quantization_config``, each quantized Linear replaced by ``codes * scale``
(fp32 math).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from quantizer import LINEAR_RE, QUANTIZED_LINEARS, _copy_side_files, _load_state_dict



def _args(**kw):
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=8, type="int", **kw)


def scheme_args(strategy: str = "channel", static: bool = False, act_symmetric: bool = True):
    """(weights, input_activations) QuantizationArgs of the W8A8 variant."""
    weights = _args(strategy=strategy, symmetric=True, dynamic=False, observer="minmax")
    if static:
        acts = _args(strategy="tensor", symmetric=act_symmetric, dynamic=False,
                     observer="minmax")
    else:
        acts = _args(strategy="token", symmetric=act_symmetric, dynamic=True)
    return weights, acts


def quantization_config(strategy: str = "channel", static: bool = False,
                        act_symmetric: bool = True) -> dict:
    """``config.json``'s ``quantization_config`` as ModelCompressor writes it."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    weights, acts = scheme_args(strategy, static, act_symmetric)
    qc = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights,
                                                     input_activations=acts)},
        format="int-quantized", quantization_status="compressed",
        # MoE routers stay float, as llmcompressor's MoE recipes ignore them
        ignore=["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$"])
    return {"version": compressed_tensors.__version__, "quant_method": "compressed-tensors",
            "sparsity_config": {}, "transform_config": {},
            **json.loads(json.dumps(qc.model_dump(exclude=["quant_method"]), default=str))}


def qparams(lo: torch.Tensor, hi: torch.Tensor, args) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' scale / zero point for observed ``[lo, hi]``."""
    from compressed_tensors.quantization.utils import calculate_qparams

    return calculate_qparams(lo, hi, args)


@dataclass
class Int8Layer:
    """One quantized Linear: codes, scales, and the activation quantizer."""

    codes: torch.Tensor  # int8 [out, in]
    weight_scale: torch.Tensor  # [out, 1] or [1], weight dtype
    input_scale: torch.Tensor | None  # [1] (static only)
    input_zero_point: torch.Tensor | None  # int8 [1] (static asym only)

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[out, in]``: codes times scale (one fp32 rounding)."""
        # [out, 1] (channel) and [1] (tensor) both broadcast over [out, in]
        return self.codes.to(torch.float32) * self.weight_scale.to(torch.float32)


def quantize_weight_int8(w: torch.Tensor, strategy: str = "channel"):
    """int8 codes ``[out, in]`` and ``weight_scale`` (CT min-max, symmetric)."""
    from compressed_tensors.quantization.lifecycle.forward import quantize

    weights, _ = scheme_args(strategy)
    if strategy == "channel":
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    else:
        lo, hi = w.amin().reshape(1), w.amax().reshape(1)
    scale, zp = qparams(lo, hi, weights)
    scale = scale.to(w.dtype)
    codes = quantize(w, scale, zp, weights, dtype=torch.int8)
    return codes, scale


def calibrate(model_dir: Path, prompts: list[list[int]]) -> dict[str, tuple[float, float]]:
    """Per quantized-Linear input ``(min, max)`` over all calibration tokens, from
    the float model in HF transformers (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ranges: dict[str, list[float]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in QUANTIZED_LINEARS:
            def hook(_m, args, name=name):
                x = args[0].detach()
                r = ranges.setdefault(name, [float("inf"), float("-inf")])
                r[0] = min(r[0], float(x.min()))
                r[1] = max(r[1], float(x.max()))
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return {k: (v[0], v[1]) for k, v in ranges.items()}


def channel_absmax(model_dir: Path, prompts: list[list[int]], names: tuple[str, ...]
                   ) -> dict[str, torch.Tensor]:
    """Per input channel ``max |x|`` of the Linears whose last name is in
    ``names``, over all calibration tokens (HF transformers, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    stats: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in names:
            def hook(_m, args, name=name):
                a = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
                stats[name] = a if name not in stats else torch.maximum(stats[name], a)
            hooks.append(mod.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return stats


def smooth_state(state: dict[str, torch.Tensor], stats: dict[str, torch.Tensor],
                 alpha: float) -> None:
    """SmoothQuant (as llmcompressor's ``SmoothQuantModifier`` with Llama's default
    mappings) applied in place to a float state dict: per input channel ``j``,
    ``s_j = max|X_j|**alpha / max|W_:,j|**(1 - alpha)``; the input is divided by
    ``s`` (folded into the producer: input_layernorm for q/k/v,
    post_attention_layernorm for gate/up, up_proj's output rows for down_proj)
    and the consuming weights' columns multiplied by ``s``. The float model's
    function is unchanged (up to fp32 rounding); activation outliers shrink."""
    layers = sorted({m.group(1) for k in state
                     if (m := re.match(r"^(.*\.layers\.\d+)\.", k))})
    mappings = (("input_layernorm.weight", ("self_attn.q_proj", "self_attn.k_proj",
                                            "self_attn.v_proj")),
                ("post_attention_layernorm.weight", ("mlp.gate_proj", "mlp.up_proj")),
                ("mlp.up_proj.weight", ("mlp.down_proj",)))
    for layer in layers:
        for producer, consumers in mappings:
            act = stats[f"{layer}.{consumers[0]}"].to(torch.float32)
            wmax = torch.stack([state[f"{layer}.{c}.weight"].abs().amax(0).float()
                                for c in consumers]).amax(0)
            s = act.clamp(min=1e-5).pow(alpha) / wmax.clamp(min=1e-5).pow(1 - alpha)
            s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
            for c in consumers:
                w = state[f"{layer}.{c}.weight"]
                state[f"{layer}.{c}.weight"] = (w.float() * s[None, :]).to(w.dtype)
            p = state[f"{layer}.{producer}"]
            if p.dim() == 1:  # norm weight
                state[f"{layer}.{producer}"] = (p.float() / s).to(p.dtype)
            else:  # up_proj output rows
                state[f"{layer}.{producer}"] = (p.float() / s[:, None]).to(p.dtype)


def quantize_checkpoint_int8(src: Path, dst: Path, *, strategy: str = "channel",
                             static: bool = False, act_symmetric: bool = True,
                             calib_prompts: list[list[int]] | None = None,
                             smoothing: float | None = None,
                             dequant_dst: Path | None = None) -> dict[str, Int8Layer]:
    """Write the W8A8 checkpoint of the float model in ``src`` to ``dst`` (see
    module doc). Static activations and ``smoothing`` (SmoothQuant strength,
    e.g. 0.8 as llmcompressor's default; :func:`smooth_state`) need
    ``calib_prompts``. Returns the layers."""
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    state = _load_state_dict(src)
    if smoothing is not None:
        assert calib_prompts, "smoothing needs calibration prompts"
        stats = channel_absmax(src, calib_prompts, ("q_proj", "gate_proj", "down_proj"))
        smooth_state(state, stats, smoothing)
    ranges = {}
    _, acts = scheme_args(strategy, static, act_symmetric)
    if static:
        assert calib_prompts, "static activation scales need calibration prompts"
        if smoothing is None:
            ranges = calibrate(src, calib_prompts)
        else:  # activation ranges of the smoothed model
            import tempfile

            with tempfile.TemporaryDirectory() as tmp:
                save_file(state, str(Path(tmp) / "model.safetensors"),
                          metadata={"format": "pt"})
                (Path(tmp) / "config.json").write_text((src / "config.json").read_text())
                ranges = calibrate(Path(tmp), calib_prompts)
    out_state: dict[str, torch.Tensor] = {}
    float_state: dict[str, torch.Tensor] = {}
    layers: dict[str, Int8Layer] = {}
    for name, tensor in state.items():
        m = LINEAR_RE.match(name)
        if m is None or m["name"] not in QUANTIZED_LINEARS:
            out_state[name] = tensor
            float_state[name] = tensor
            continue
        prefix = m["prefix"]
        codes, scale = quantize_weight_int8(tensor, strategy)
        in_scale = in_zp = None
        if static:
            lo, hi = ranges[prefix]
            s, zp = qparams(torch.tensor([lo]), torch.tensor([hi]), acts)
            in_scale = s.to(tensor.dtype).reshape(1)
            if not act_symmetric:
                in_zp = zp.to(torch.int8).reshape(1)
        layer = Int8Layer(codes=codes, weight_scale=scale, input_scale=in_scale,
                          input_zero_point=in_zp)
        layers[prefix] = layer
        out_state[f"{prefix}.weight"] = codes.contiguous()
        out_state[f"{prefix}.weight_scale"] = scale.contiguous()
        if in_scale is not None:
            out_state[f"{prefix}.input_scale"] = in_scale
        if in_zp is not None:
            out_state[f"{prefix}.input_zero_point"] = in_zp
        float_state[name] = layer.dequantize().to(tensor.dtype)
    save_file(out_state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    qcfg = quantization_config(strategy, static, act_symmetric)
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg},
                                                indent=2, sort_keys=True))
    _copy_side_files(src, dst)
    if dequant_dst is not None:
        dequant_dst = Path(dequant_dst)
        dequant_dst.mkdir(parents=True, exist_ok=True)
        save_file(float_state, str(dequant_dst / "model.safetensors"),
                  metadata={"format": "pt"})
        (dequant_dst / "config.json").write_text(json.dumps(config, indent=2))
        _copy_side_files(src, dequant_dst)
    return layers


def add_act_fake_quant(model: torch.nn.Module, layers: dict[str, Int8Layer],
                       dynamic: bool, symmetric: bool = True) -> list:
    """Forward pre-hooks on the HF model's quantized Linears that quantize and
    dequantize their inputs the way the W8A8 kernel does (per-token dynamic:
    ``amax / 127`` symmetric or ``(max - min) / 255`` asymmetric; static: the
    checkpoint's scale and zero point), computed independently of the library
    in float64. Returns the hook handles."""
    handles = []
    for name, mod in model.named_modules():
        if name not in layers:
            continue
        lay = layers[name]

        def pre(_m, args, lay=lay):
            x = args[0]
            xd = x.double()
            if not dynamic:
                s = lay.input_scale.double()
                z = 0.0 if lay.input_zero_point is None else lay.input_zero_point.double()
                q = (torch.round(x.float() / lay.input_scale.float()).double() + z)
                q = q.clamp(-128, 127)
            elif symmetric:
                s = xd.abs().amax(-1, keepdim=True) / 127
                s = torch.where(s == 0, torch.ones_like(s), s)
                q, z = torch.round(xd / s).clamp(-127, 127), 0.0
            else:
                lo = xd.amin(-1, keepdim=True).clamp(max=0)
                hi = xd.amax(-1, keepdim=True).clamp(min=0)
                s = (hi - lo) / 255
                s = torch.where(s == 0, torch.ones_like(s), s)
                z = torch.round(-128 - lo / s).clamp(-128, 127)
                q = (torch.round(xd / s) + z).clamp(-128, 127)
            return ((q - z) * s).to(x.dtype),

        handles.append(mod.register_forward_pre_hook(pre))
    return handles


# ---------------------------------------------------------------------------
# HF oracles (greedy tokens, teacher-forced log-probs)
# ---------------------------------------------------------------------------


def _hf_model(model_dir: Path, layers: dict[str, Int8Layer] | None, dynamic: bool,
              symmetric: bool):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like vLLM's ignore_eos
    model.generation_config.pad_token_id = 0
    if layers is not None:
        add_act_fake_quant(model, layers, dynamic, symmetric)
    return model


def hf_oracle(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              layers: dict[str, Int8Layer] | None = None, dynamic: bool = True,
              symmetric: bool = True, score: list[list[int]] | None = None):
    """HF transformers fp32 on the dequantized checkpoint: greedy continuations
    and, for each ``score[i]`` (continuation token ids, e.g. vLLM's), teacher
    forced on ``prompt + score[i]``: the log-prob of each of its tokens and HF's
    own greedy choice at each of its positions (same prefix as the scored
    sequence, so one early divergence does not decide every later position).
    ``layers`` adds activation fake-quant (:func:`add_act_fake_quant`).
    Returns ``(greedy, logps, tf_argmax)``."""
    from conftest import greedy_batch

    model = _hf_model(model_dir, layers, dynamic, symmetric)
    # One prompt at a time under activation fake-quant: its rounding to int8 codes turns
    # the padded batch's last-bit differences into different codes (a tiny model's
    # static-asym case then lost a sequence); plain fp32 runs as one batch.
    greedy = (greedy_batch(model, prompts, max_new_tokens) if layers is None
              else [greedy_batch(model, [ids], max_new_tokens)[0] for ids in prompts])
    logps, tf_argmax = [], []
    with torch.no_grad():
        for i, ids in enumerate(prompts):
            if score is not None:
                seq = torch.tensor([ids + list(score[i])])
                lp = torch.log_softmax(model(seq).logits[0].double(), dim=-1)
                pos = torch.arange(len(ids) - 1, seq.shape[1] - 1)
                logps.append(lp[pos, seq[0, pos + 1]].tolist())
                tf_argmax.append(lp[pos].argmax(-1).tolist())
    return greedy, logps, tf_argmax
