"""Whether the plugin serves a checkpoint, read from its ``config.json`` alone (no
weights): ``python -m vllm_accel.tools.models check MODEL_DIR``.

Each finding names a feature the checkpoint needs, whether the plugin serves it and
how (the kernels, the path), or what is missing and the nearest workaround. The rules
are the plugin's own startup refusals (``ops/attention.py``, ``platform.py``,
``ops/moe.py``, ``quant/``), stated once here for a reader; the engine tests behind
each "served" are listed in ``docs/supported-models.md``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

#: quantization formats whose dense linears the plugin serves (config ``quant_method``)
QUANT_DENSE = {"gptq": "gcu_gptq (4/8-bit, groups, act-order)",
               "awq": "gcu_awq (4-bit GEMM layout)",
               "compressed-tensors": "compressed-tensors W4A16 / W8A16 / W8A8 int8",
               "fp8": "gcu_fp8 (e4m3, block or per-tensor scales): dequantized at load to "
                      "the model dtype (with AMX, --quantization fp8 picks vLLM's own kernels)"}
#: ... and whose MoE experts
QUANT_MOE = {"gptq": "GPTQ experts (quant/moe.py)",
             "awq": "AWQ experts (4-bit GEMM layout)",
             "compressed-tensors": "W4A16 / W8A16 experts, and W8A8 int8 ones with dynamic "
                                   "per-token activations",
             "fp8": "FP8 experts (block or per-tensor scales), dequantized at load into "
                    "the unquantized experts' method"}
#: gpt-oss's MXFP4 checkpoints (experts only), before and after vLLM renames the method
GPT_OSS_MXFP4 = ("mxfp4", "gpt_oss_mxfp4")
#: model types whose attention adds ALiBi (vLLM passes slopes to the backend)
ALIBI_TYPES = {"bloom", "mpt", "baichuan", "jais", "falcon"}
#: model types with learned attention sinks
SINK_TYPES = {"gpt_oss", "granite_swa", "granitemoe_swa"}
#: vision-language architectures whose image requests tests/test_vlm.py holds to HF
#: (InternVLChatModel: test_remote_code_families.py, to stock vLLM CPU)
VERIFIED_MULTIMODAL = {"Blip2ForConditionalGeneration", "Qwen2VLForConditionalGeneration",
                       "Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration",
                       "LlavaNextForConditionalGeneration", "InternVLForConditionalGeneration",
                       "InternVLChatModel",
                       "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration",
                       "Glm4vForConditionalGeneration", "Gemma3ForConditionalGeneration",
                       "Gemma4ForConditionalGeneration", "Mistral3ForConditionalGeneration",
                       "SmolVLMForConditionalGeneration", "Glm4vMoeForConditionalGeneration",
                       "LlavaOnevisionForConditionalGeneration",
                       "PaddleOCRVLForConditionalGeneration",
                       "MiniCPMV4_6ForConditionalGeneration"}
#: of those, the ones whose vision tower vLLM builds from transformers' own module
HF_VISION_TOWERS = {"Gemma4ForConditionalGeneration"}
#: encoder-decoder (speech-to-text) architectures tested through the plugin
VERIFIED_ENCODER_DECODER = {"WhisperForConditionalGeneration"}
#: audio-in decoder models tested through the plugin (their audio tower transformers' own)
VERIFIED_AUDIO = {"Qwen2AudioForConditionalGeneration"}
#: audio and image inputs (the Qwen Omni thinkers, by every name vLLM serves them by):
#: the vision tower on varlen_attention
VERIFIED_OMNI = {"Qwen2_5OmniModel", "Qwen2_5OmniForConditionalGeneration",
                 "Qwen3OmniMoeForConditionalGeneration"}
#: of the audio-in architectures, those whose audio tower is vLLM's own module
VLLM_AUDIO_TOWERS = {"Qwen3OmniMoeForConditionalGeneration"}


#: the finding of a checkpoint whose config class is its own code
REMOTE_CODE = "the checkpoint's own configuration code (auto_map)"


@dataclass
class Finding:
    feature: str
    served: bool
    how: str


def _text_config(config: dict) -> dict:
    """The decoder's fields: ``text_config``, or an Omni thinker's (``thinker_config``)."""
    config = config.get("thinker_config") or config
    return config.get("text_config") or config


def _layer_windows(text: dict) -> tuple[int | None, int, int]:
    """(window, windowed layers, layers) as vLLM applies them."""
    layers = int(text.get("num_hidden_layers") or text.get("n_layer") or 0)
    window = text.get("sliding_window")
    if not window or text.get("use_sliding_window") is False:
        return None, 0, layers
    types = text.get("layer_types")
    if types:
        windowed = sum(t == "sliding_attention" for t in types)
        return (window, windowed, layers) if windowed else (None, 0, layers)
    return window, layers, layers


def _attention(config: dict, text: dict, model_type: str) -> list[Finding]:
    found = []
    if text.get("kv_lora_rank"):
        found.append(Finding(
            f"MLA (kv_lora_rank {text['kv_lora_rank']}, rope dims "
            f"{text.get('qk_rope_head_dim')})", True,
            "ACCEL_MLA: vLLM's latent cache, decode with absorbed weights (the C++ kernel "
            "on the simulator, torch_fast on a card), prefill by decompression; chunked "
            "prefill and prefix caching kept"))
    window, windowed, layers = _layer_windows(text)
    if window:
        found.append(Finding(
            f"sliding window {window} on {windowed} of {layers} layers", True,
            "ACCEL_ATTN reads only the window's blocks (vLLM frees the rest): the C++ "
            "reader on the simulator, torch_fast / Triton on a card"))
    chunk = text.get("attention_chunk_size")
    if chunk:
        # (vLLM's Llama 4: layers whose no_rope_layers entry is 0 attend globally)
        chunked = sum(map(bool, text.get("no_rope_layers") or [1] * layers))
        found.append(Finding(
            f"chunked local attention (chunks of {chunk}) on {chunked} of {layers} layers",
            True, "vLLM's chunked local attention (a virtual request per chunk) over "
            "ACCEL_ATTN (every provider); needs a --block-size dividing the chunk"))
    shared = text.get("num_kv_shared_layers")
    if shared:
        found.append(Finding(
            f"KV cache shared by the last {shared} of {layers} layers", True,
            "vLLM's KV sharing: those layers read an earlier layer's cache and write "
            "none (ACCEL_ATTN, every provider)"))
    head_sizes = _head_sizes(text)
    if len(head_sizes) > 1:
        found.append(Finding(
            f"head sizes {' and '.join(map(str, head_sizes))} by layer", True,
            "a KV cache group per head size (vLLM's hybrid KV cache manager), ACCEL_ATTN "
            "on each"))
    cap = text.get("attn_logit_softcapping")
    if cap:
        found.append(Finding(f"attention logit soft-cap {cap}", True, "ACCEL_ATTN (every "
                             "provider)"))
    if model_type in ALIBI_TYPES and (model_type != "falcon" or text.get("alibi")):
        found.append(Finding("ALiBi", True, "ACCEL_ATTN with vLLM's slopes (every provider)"))
    if model_type in SINK_TYPES or text.get("attention_sinks"):
        found.append(Finding("learned attention sinks", True, "ACCEL_ATTN (every provider)"))
    return found


def _head_sizes(text: dict) -> list[int]:
    """The attention head sizes of the model's layers (Gemma 4's global layers: wider,
    as ``global_head_dim`` or transformers' ``per_layer_config``)."""
    sizes = {text.get("head_dim"), text.get("global_head_dim")}
    sizes |= {layer.get("head_dim") for layer in (text.get("per_layer_config") or {}).values()}
    return sorted(size for size in sizes if size)


def _moe(text: dict, quant: dict | None) -> list[Finding]:
    experts = (text.get("num_local_experts") or text.get("num_experts")
               or text.get("n_routed_experts") or text.get("moe_num_experts"))
    if not experts:
        return []
    top_k = (text.get("num_experts_per_tok") or text.get("moe_topk")
             or text.get("top_k_experts"))
    found = [Finding(f"mixture of experts ({experts} experts, top-{top_k})", True,
                     "AccelFusedMoEMethod: moe_route / moe_experts (the C++ experts op on "
                     "the simulator, torch_fast on a card); --enable-expert-parallel")]
    if text.get("model_type") == "gpt_oss":
        found.append(Finding("clamped SwiGLU experts (gpt-oss's swigluoai)", True,
                             "the MoE kernels' swigluoai (gate/up interleaved, clamped at "
                             "7): the C++ experts op on the simulator, torch_fast on a card"))
    elif text.get("swiglu_limit"):
        found.append(Finding(f"clamped SwiGLU experts (swiglu_limit {text['swiglu_limit']})",
                             False, "not served yet: the clamp is not in the MoE kernels; "
                             "exclude the plugin (VLLM_PLUGINS) for stock vLLM CPU"))
    if quant is not None:
        method = quant.get("quant_method")
        if method in GPT_OSS_MXFP4 and text.get("model_type") == "gpt_oss":
            found.append(Finding("gpt-oss MXFP4 MoE experts", True,
                                 "gcu_mxfp4: dequantized at load into the unquantized "
                                 "experts (with AMX, --quantization mxfp4 picks vLLM's "
                                 "own experts)"))
        elif method in QUANT_MOE:
            found.append(Finding(f"{method} MoE experts", True, QUANT_MOE[method] + " "
                                 "(other schemes of the format fail at startup naming the "
                                 "layer)"))
        else:
            found.append(Finding(f"{method} MoE experts", False,
                                 "not served: GPTQ, AWQ, compressed-tensors int and fp8 "
                                 "experts are; use such an export or the unquantized "
                                 "checkpoint"))
    return found


def _quantization(quant: dict | None, model_type: str) -> list[Finding]:
    if quant is None:
        return []
    method = quant.get("quant_method")
    if method in GPT_OSS_MXFP4 and model_type == "gpt_oss":
        return []  # experts only (_moe); gpt-oss's linears are bf16
    if method in QUANT_DENSE:
        return [Finding(f"{method} weights", True, QUANT_DENSE[method])]
    return [Finding(f"{method} weights", False,
                    "not served: GPTQ, AWQ, compressed-tensors int and fp8 formats are "
                    "(nvfp4, and mxfp4 beyond gpt-oss's experts, are not); use such an "
                    "export or the bf16 checkpoint")]


def _architecture(config: dict) -> list[Finding]:
    """What vLLM's registry says of the architecture (imports vLLM)."""
    import os

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # a report, not a start-up log
    from vllm.model_executor.models import ModelRegistry

    archs = config.get("architectures") or []
    if not archs:
        return [Finding("an architecture", False, "config.json names none ('architectures')")]
    arch = archs[0]
    if arch not in ModelRegistry.get_supported_archs():
        return [Finding(f"architecture {arch}", False,
                        "vLLM 0.32 has no implementation of it (stock vLLM neither)")]
    info = ModelRegistry._try_inspect_model_cls(arch)
    found = [Finding(f"architecture {arch}", True,
                     f"vLLM's {info.architecture}" if info else "vLLM's implementation")]
    if info is None:
        return found
    if config.get("is_encoder_decoder") or info.attn_type == "encoder_decoder":
        found.append(
            Finding("encoder-decoder attention", True,
                    "cross-attention on ACCEL_ATTN over each request's cached encoder "
                    "output") if arch in VERIFIED_ENCODER_DECODER else
            Finding("encoder-decoder attention", False,
                    "not verified through the plugin yet (Whisper is); exclude the "
                    "plugin (VLLM_PLUGINS) for stock vLLM CPU"))
    if info.is_pooling_model and not info.is_text_generation_model:
        found.append(Finding("pooling model (embeddings / scores)", True,
                             "vLLM's pooling runner (--runner pooling); encoder-only "
                             "layers through varlen_attention"))
    if info.supports_multimodal:
        if arch in VERIFIED_ENCODER_DECODER:
            found.append(Finding("audio inputs", True,
                                 "vLLM's processor (log-mel features); the audio encoder's "
                                 "attention on varlen_attention; /v1/audio/transcriptions "
                                 "decodes uploads with the plugin's audio extra"))
        elif arch in VERIFIED_AUDIO | VERIFIED_OMNI:
            tower = ("vLLM's own audio tower, its attention on varlen_attention"
                     if arch in VLLM_AUDIO_TOWERS else
                     "transformers' own audio tower (vLLM 0.32 builds it so), its "
                     "attention torch's on the device")
            found.append(Finding("audio inputs", True,
                                 f"vLLM's processor and encoder cache; {tower}"))
            if arch in VERIFIED_OMNI:
                found.append(Finding("image inputs", True,
                                     "vLLM's processor and encoder cache; the vision "
                                     "tower's attention on varlen_attention "
                                     "(AccelMMEncoderAttention)"))
        elif arch in VERIFIED_MULTIMODAL:
            tower = ("transformers' own vision tower (vLLM 0.32 builds it so), its attention "
                     "torch's SDPA on the device" if arch in HF_VISION_TOWERS else
                     "the vision tower's attention on varlen_attention "
                     "(AccelMMEncoderAttention)")
            found.append(Finding("image inputs", True,
                                 f"vLLM's processor and encoder cache; {tower}"))
        else:
            found.append(Finding("multimodal inputs", False,
                                 "not verified through the plugin yet; text-only requests "
                                 "use the plugin's attention; exclude the plugin for images"))
    layer_types = _text_config(config).get("layer_types") or ()
    all_attention = layer_types and all(t in ("attention", "full_attention")
                                        for t in layer_types)
    if (info.is_hybrid and not all_attention) or info.has_inner_state:
        found.append(_recurrent_layers(arch))
    return found


def _remote_code(config: dict, model_type: str) -> list[Finding]:
    """A config class only the checkpoint's own code defines (InternLM2, MiniCPM,
    TeleChat2, Ling, ...): vLLM imports it only with --trust-remote-code."""
    if "AutoConfig" not in (config.get("auto_map") or {}):
        return []
    from transformers import CONFIG_MAPPING
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    if model_type in CONFIG_MAPPING or model_type in _CONFIG_REGISTRY:
        return []
    return [Finding(REMOTE_CODE, True,
                    "pass --trust-remote-code (trust_remote_code=True): vLLM reads the "
                    "config class from the checkpoint; the model is vLLM's own code")]


def _recurrent_layers(arch: str) -> Finding:
    from vllm.model_executor.models import ModelRegistry

    from vllm_accel.preflight import recurrent_layer_kind

    kind = recurrent_layer_kind(ModelRegistry._try_load_model_cls(arch))
    feature = f"state-space layers ({kind})"
    if kind == "Mamba":
        return Finding(feature, False, "not served: vLLM 0.32's CPU build has no "
                       "selective_scan_fwd kernel (stock vLLM CPU neither)")
    if kind == "Gated DeltaNet":
        return Finding(feature, True, "vLLM's CPU kernel on the simulator, bfloat16 only "
                       "(--dtype bfloat16); on the card path the registry's state-space "
                       "kernels; no speculative decoding")
    if kind == "Mamba2":
        return Finding(feature, True, "vLLM's CPU kernels on the simulator; on the card "
                       "path the registry's state-space kernels; no speculative decoding")
    return Finding(feature, True, "vLLM's CPU kernels on the simulator (untested); the card "
                   "path refuses them at startup")


def check(model_dir: str | Path) -> list[Finding]:
    """Every finding for the checkpoint at ``model_dir`` (its config.json)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass a model directory with an HF "
                                "config.json")
    config = json.loads(path.read_text())
    text = _text_config(config)
    model_type = text.get("model_type") or config.get("model_type") or ""
    quant = config.get("quantization_config") or text.get("quantization_config")
    return (_architecture(config) + _remote_code(config, config.get("model_type") or "")
            + _attention(config, text, model_type) + _moe(text, quant)
            + _quantization(quant, model_type))


def report(model_dir: str | Path, as_json: bool = False) -> tuple[str, bool]:
    """(the text or JSON to print, whether the plugin serves the checkpoint)."""
    findings = check(model_dir)
    served = all(f.served for f in findings)
    if as_json:
        return json.dumps({"model": str(model_dir), "served": served,
                           "findings": [asdict(f) for f in findings]}, indent=2), served
    lines = [f"{model_dir}: {'served' if served else 'NOT served'} by vllm_accel"]
    lines += [f"  [{'ok' if f.served else 'missing'}] {f.feature}: {f.how}" for f in findings]
    if not [f for f in findings[1:] if f.feature != REMOTE_CODE]:
        lines.append("  plain causal attention: ACCEL_ATTN (the one-op decoder layer for "
                     "Llama-architecture models on the simulator)")
    return "\n".join(lines), served
