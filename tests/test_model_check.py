"""``python -m vllm_accel.tools.models check MODEL_DIR``: from config.json alone, whether
the plugin serves a checkpoint, with which kernels, or what is missing and the nearest
workaround. The configs come from HF transformers' config classes (no weights)."""

import json
import subprocess
import sys

import pytest

from vllm_accel.tools.model_check import check


@pytest.fixture(autouse=True)
def _inspect_in_process(monkeypatch):
    """vLLM inspects each architecture in a fresh interpreter (to keep CUDA out of
    the caller; ~2.5 s each from cold caches); here, with no CUDA, in this one. The
    CLI test below runs the tool as users do, subprocess and all."""
    from vllm.model_executor.models import registry

    monkeypatch.setattr(registry, "_run_in_subprocess", lambda fn: fn())


def _write(tmp_path, name: str, config_cls: str, **kwargs):
    import transformers

    config = getattr(transformers, config_cls)(**kwargs)
    model_dir = tmp_path / name
    model_dir.mkdir()
    config.to_json_file(model_dir / "config.json")
    return model_dir



#: name -> (config class, architecture, kwargs, served, text each finding list must have)
CASES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4096), True,
                ["sliding window 4096 on 32 of 32 layers"]),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {}, True,
               ["sliding window 4096 on 13 of 26 layers", "soft-cap 50.0"]),
    "qwen2-no-window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=False), True,
                        []),
    "bloom": ("BloomConfig", "BloomForCausalLM", {}, True, ["ALiBi"]),
    "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM", {}, True,
                    ["attention sinks", "sliding window 128 on 18 of 24 layers"]),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", dict(num_hidden_layers=8), True,
               ["chunked local attention (chunks of 8192) on 6 of 8 layers"]),
    "gemma3n": ("Gemma3nTextConfig", "Gemma3nForCausalLM", {}, True,
                ["sliding window 512 on 28 of 35 layers",
                 "KV cache shared by the last 15 of 35 layers"]),
    "gemma4-moe": ("Gemma4TextConfig", "Gemma4ForCausalLM",
                   dict(num_hidden_layers=6, attention_k_eq_v=True, global_head_dim=512,
                        enable_moe_block=True, num_experts=128, top_k_experts=8), True,
                   ["sliding window 512 on 5 of 6 layers", "head sizes 256 and 512 by layer",
                    "mixture of experts (128 experts, top-8)"]),
    "bert": ("BertConfig", "BertModel", {}, True, ["pooling model"]),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {}, True,
                  ["mixture of experts (128 experts, top-8)"]),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {}, True,
                    ["MLA (kv_lora_rank 512", "ACCEL_MLA", "mixture of experts (64 experts"]),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {}, True,
                ["swigluoai", "attention sinks"]),
    "gpt_oss-mxfp4": ("GptOssConfig", "GptOssForCausalLM",
                      dict(quantization_config={"quant_method": "mxfp4"}), True,
                      ["swigluoai", "gpt-oss MXFP4 MoE experts", "gcu_mxfp4"]),
    "mamba": ("MambaConfig", "MambaForCausalLM", {}, False,
              ["state-space layers (Mamba)", "selective_scan_fwd"]),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(layer_types=["mamba", "attention"], num_hidden_layers=2), True,
                         ["state-space layers (Mamba2", "registry's state-space kernels"]),
    "granitemoehybrid-attention-only": (
        "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
        dict(layer_types=["attention", "attention"], num_hidden_layers=2), True, []),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", {}, True,
             ["state-space layers (linear-attention / short-convolution)",
              "card path refuses them"]),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {}, True,
                ["state-space layers (Gated DeltaNet)", "--dtype bfloat16"]),
    # (its language model is Qwen3.5's, built from another vLLM model module)
    "minicpmv4_6": ("MiniCPMV4_6Config", "MiniCPMV4_6ForConditionalGeneration", {}, True,
                    ["state-space layers (Gated DeltaNet)", "--dtype bfloat16",
                     "image inputs: vLLM's processor"]),
    "qwen2_vl": ("Qwen2VLConfig", "Qwen2VLForConditionalGeneration", {}, True,
                 ["image inputs: vLLM's processor"]),
    "llava_next": ("LlavaNextConfig", "LlavaNextForConditionalGeneration", {}, True,
                   ["image inputs: vLLM's processor"]),
    "gemma4-vision": ("Gemma4Config", "Gemma4ForConditionalGeneration",
                      dict(audio_config=None), True,
                      ["image inputs: vLLM's processor", "transformers' own vision tower"]),
    "idefics3": ("Idefics3Config", "Idefics3ForConditionalGeneration", {}, False,
                 ["multimodal inputs: not verified"]),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", {}, True,
                ["encoder-decoder attention: cross-attention on ACCEL_ATTN",
                 "audio inputs: vLLM's processor"]),
    "qwen2_audio": ("Qwen2AudioConfig", "Qwen2AudioForConditionalGeneration", {}, True,
                    ["audio inputs: vLLM's processor", "transformers' own audio tower"]),
    "qwen2_5_omni": ("Qwen2_5OmniConfig", "Qwen2_5OmniModel", {}, True,
                     ["audio inputs: vLLM's processor", "transformers' own audio tower",
                      "image inputs: vLLM's processor", "varlen_attention"]),
    "qwen3_omni_moe": ("Qwen3OmniMoeConfig", "Qwen3OmniMoeForConditionalGeneration", {}, True,
                       ["audio inputs: vLLM's processor and encoder cache; vLLM's own audio",
                        "image inputs: vLLM's processor", "mixture of experts"]),
    "fp8-llama": ("LlamaConfig", "LlamaForCausalLM",
                  dict(quantization_config={"quant_method": "fp8"}), True,
                  ["fp8 weights", "dequantized at load"]),
    "mxfp4-llama": ("LlamaConfig", "LlamaForCausalLM",
                    dict(quantization_config={"quant_method": "mxfp4"}), False,
                    ["mxfp4 weights", "not served"]),
    "gptq-mixtral": ("MixtralConfig", "MixtralForCausalLM",
                     dict(quantization_config={"quant_method": "gptq", "bits": 4}), True,
                     ["gptq MoE experts", "gptq weights"]),
    "awq-mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    dict(quantization_config={"quant_method": "awq", "bits": 4}), True,
                    ["awq MoE experts", "AWQ experts"]),
    "fp8-mixtral": ("MixtralConfig", "MixtralForCausalLM",
                    dict(quantization_config={"quant_method": "fp8"}), True,
                    ["fp8 MoE experts", "FP8 experts"]),
    "mxfp4-mixtral": ("MixtralConfig", "MixtralForCausalLM",
                      dict(quantization_config={"quant_method": "mxfp4"}), False,
                      ["mxfp4 MoE experts", "not served: GPTQ, AWQ"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_findings(case, tmp_path):
    config_cls, arch, kwargs, served, expected = CASES[case]
    model_dir = _write(tmp_path, case, config_cls, architectures=[arch], **kwargs)
    findings = check(model_dir)
    text = "\n".join(f"{f.feature}: {f.how}" for f in findings)
    assert all(f.served for f in findings) == served, text
    assert findings[0].feature == f"architecture {arch}" and findings[0].served
    for piece in expected:
        assert piece in text, text
    # a "missing" finding always says what to do instead
    for f in findings:
        if not f.served:
            assert any(word in f.how for word in ("VLLM_", "use ", "exclude", "not served")), f


@pytest.mark.parametrize("family", ["chatglm", "internlm2", "bailing_moe"])
def test_remote_code_checkpoints_name_trust_remote_code(family, tmp_path):
    """A checkpoint whose config class is its own code (``auto_map``) is served with
    --trust-remote-code, which the report names; ChatGLM's config class is vLLM's own,
    so, though its releases carry ``auto_map`` too, it needs no flag."""
    from remote_code_models import build_tiny_remote

    model_dir = build_tiny_remote(tmp_path / family, family)
    config = json.loads((model_dir / "config.json").read_text())
    assert "AutoConfig" in config.setdefault(
        "auto_map", {"AutoConfig": "configuration_chatglm.ChatGLMConfig"})
    (model_dir / "config.json").write_text(json.dumps(config))
    findings = check(model_dir)
    text = "\n".join(f"{f.feature}: {f.how}" for f in findings)
    assert all(f.served for f in findings), text
    assert ("--trust-remote-code" in text) == (family != "chatglm"), text
    if family == "bailing_moe":
        assert "mixture of experts (8 experts, top-2)" in text, text


def test_auto_map_on_a_type_transformers_knows_needs_no_flag(tmp_path):
    """``auto_map`` beside a model type transformers has a class for (a Qwen2 export
    that kept its remote code): transformers' class serves, no flag named."""
    model_dir = _write(tmp_path, "qwen2", "Qwen2Config", architectures=["Qwen2ForCausalLM"],
                       auto_map={"AutoConfig": "configuration_qwen.QWenConfig"})
    text = "\n".join(f"{f.feature}: {f.how}" for f in check(model_dir))
    assert "auto_map" in (model_dir / "config.json").read_text()
    assert "--trust-remote-code" not in text, text


def test_verified_vision_language_architectures_are_the_tested_ones():
    """``models check`` calls image inputs served for exactly the architectures
    test_vlm.py holds to HF (and InternVL's released layout, held to stock vLLM)."""
    from test_vlm import BUILDERS
    from vlm_models import HF_CLASSES

    from vllm_accel.tools.model_check import VERIFIED_MULTIMODAL

    assert len(HF_CLASSES) == len(BUILDERS)  # (one class for each family test_vlm builds)
    assert VERIFIED_MULTIMODAL == set(HF_CLASSES.values()) | {"InternVLChatModel"}


def test_cli_exit_codes_and_json(tmp_path):
    """Exit 0 for a served checkpoint, 1 for one that is not (with --json: the
    findings), 2 for a directory without config.json."""
    served = _write(tmp_path, "served", "MistralConfig", architectures=["MistralForCausalLM"],
                    sliding_window=64)
    missing = _write(tmp_path, "missing", "MambaConfig", architectures=["MambaForCausalLM"])
    cli = [sys.executable, "-m", "vllm_accel.tools.models", "check"]
    ok = subprocess.run(cli + [str(served)], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "served by vllm_accel" in ok.stdout, ok.stdout + ok.stderr
    assert "[ok] sliding window 64" in ok.stdout
    bad = subprocess.run(cli + [str(missing), "--json"], capture_output=True, text=True,
                         timeout=300)
    assert bad.returncode == 1, bad.stderr
    report = json.loads(bad.stdout)
    assert report["served"] is False
    assert any(not f["served"] and "state-space" in f["feature"] for f in report["findings"])
    none = subprocess.run(cli + [str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert none.returncode == 2 and "config.json" in none.stderr


def test_verified_omni_architectures_are_the_tested_ones():
    """``models check`` calls audio and image inputs served for the Omni architectures
    test_speech_models.py holds to HF (plus ``Qwen2_5OmniForConditionalGeneration``,
    the other name vLLM registers for the same thinker class)."""
    from speech_models import OMNI_CLASSES
    from vllm.model_executor.models import ModelRegistry

    from vllm_accel.tools.model_check import VERIFIED_OMNI

    tested = {arch for _, _, arch in OMNI_CLASSES.values()}
    assert tested <= VERIFIED_OMNI
    for alias in VERIFIED_OMNI - tested:
        assert any(ModelRegistry.models[alias] == ModelRegistry.models[arch]
                   for arch in tested), alias
