"""Tiny random-weight speech models with their processors, built locally (no hub), and
their HF float64 oracles: Whisper (encoder-decoder: a Conv1d audio encoder, a decoder
with self- and cross-attention), Qwen2-Audio (audio in, text out: an audio tower in
front of a decoder-only Qwen2) and the Qwen2.5-Omni and Qwen3-Omni thinkers (audio
and images in, text out: an audio tower and Qwen2.5-VL's or Qwen3-VL's vision tower in
front of a Qwen2 or Qwen3-MoE decoder with M-RoPE).

Whisper's tokenizer is the default model's BPE under Whisper's tokenizer class with the
special tokens a transcription prompt names; the feature extractor keeps Whisper's
80 mel bins and 16 kHz but pads to 2 s instead of 30 (200 frames: 100 encoder
positions, vLLM's cross-attention length), so the audio encoder stays cheap.
"""

import functools
from pathlib import Path

import torch

WHISPER_TOKENS = ["<|startoftranscript|>", "<|en|>", "<|de|>", "<|translate|>",
                  "<|transcribe|>", "<|startoflm|>", "<|prev|>", "<|nospeech|>",
                  "<|notimestamps|>"]
#: a transcription's decoder prompt, as vLLM's Whisper writes it
TRANSCRIBE = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"
SAMPLE_RATE = 16000
#: the support table's words for it
WHISPER = ("encoder-decoder: a Conv1d audio encoder attending both ways, decoder layers "
           "with causal self-attention and cross-attention over the cached encoder output")
EOS = 0  # <|endoftext|>: the default model's id 0, Whisper's pad/bos/eos
CHUNK_SECONDS = 2


def build_tiny_whisper(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Whisper with 2 encoder and 2 decoder layers, d_model 128 (2 heads of 64, as
    vLLM's CPU kernels need for the stock-vLLM comparison); tied output embeddings."""
    from transformers import (WhisperConfig, WhisperFeatureExtractor,
                              WhisperForConditionalGeneration, WhisperProcessor,
                              WhisperTokenizerFast)

    eot = "<|endoftext|>"
    tok = WhisperTokenizerFast(tokenizer_file=str(default_model / "tokenizer.json"),
                               unk_token=eot, bos_token=eot, eos_token=eot)
    tok.add_special_tokens({"additional_special_tokens": WHISPER_TOKENS})
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE,
                                       chunk_length=CHUNK_SECONDS)
    eot_id = tok.convert_tokens_to_ids(eot)
    assert eot_id == EOS
    config = WhisperConfig(
        vocab_size=len(tok), num_mel_bins=80, d_model=128, encoder_layers=2,
        decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=256, decoder_ffn_dim=256,
        max_source_positions=features.nb_max_frames // 2, max_target_positions=448,
        decoder_start_token_id=tok.convert_tokens_to_ids("<|startoftranscript|>"),
        pad_token_id=eot_id, bos_token_id=eot_id, eos_token_id=eot_id,
        begin_suppress_tokens=None, suppress_tokens=None)
    torch.manual_seed(seed)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():  # peaked logits that move with the audio (HF's init: near-ties)
        for name, p in model.named_parameters():
            if name.endswith("encoder.embed_positions.weight"):
                continue  # Whisper's fixed sinusoids
            if p.dim() > 1:
                p.normal_(0, 0.1 if "embed_tokens" in name else 0.25)
        model.model.decoder.layer_norm.weight.fill_(3.0)
    model.save_pretrained(path)
    WhisperProcessor(feature_extractor=features, tokenizer=tok).save_pretrained(path)
    return path


def random_audio(seed: int, samples: int):
    """Noise of ``samples`` 16 kHz samples (float32; the processor pads or cuts it)."""
    import numpy as np

    return (np.random.default_rng(seed).standard_normal(samples) * 0.1).astype(np.float32)


def audio_of(entry):
    """An engine spec's audio, ``[seed, samples]``, as vLLM takes it: (array, rate)."""
    return random_audio(*entry), SAMPLE_RATE


@functools.lru_cache(maxsize=1)
def _hf_whisper(model_dir: str):
    from transformers import WhisperForConditionalGeneration, WhisperProcessor

    model = WhisperForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager").eval()
    return WhisperProcessor.from_pretrained(model_dir), model


def hf_whisper_logprobs(model_dir: Path, audio, decoder_ids: list[int]) -> torch.Tensor:
    """HF float64 log-probs ``[len, vocab]`` of the decoder reading ``decoder_ids``, the
    encoder reading ``audio``."""
    processor, hf = _hf_whisper(str(model_dir))
    features = processor.feature_extractor(audio, sampling_rate=SAMPLE_RATE,
                                           return_tensors="pt").input_features.double()
    with torch.no_grad():
        logits = hf(input_features=features, decoder_input_ids=torch.tensor([decoder_ids])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def hf_tokenizer(model_dir: Path):
    return _hf_whisper(str(model_dir))[0].tokenizer


def decoder_prompt_ids(model_dir: Path, decoder_prompt: str) -> list[int]:
    """The decoder's prompt as vLLM builds it: the text's tokens, no special tokens
    added, after Whisper's ``<|startoftranscript|>`` where the text does not begin with
    it (vLLM puts the decoder start token first)."""
    processor, hf = _hf_whisper(str(model_dir))
    ids = processor.tokenizer(decoder_prompt, add_special_tokens=False).input_ids
    start = hf.config.decoder_start_token_id
    return ids if ids[0] == start else [start, *ids]


QWEN2_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
#: the support table's words for it
QWEN2_AUDIO_WORDS = ("a Whisper-style audio tower (transformers' module, as vLLM builds it) "
                     "pooled and projected into a Qwen2 decoder")


def build_tiny_qwen2_audio(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Qwen2-Audio: a 2-layer audio tower (d_model 64) over Whisper's 30 s log-mel window
    (vLLM's processor expects 3000 frames), a projector, a 2-layer Qwen2 decoder; saved
    in the released layout (``language_model.model.*``, as vLLM loads it)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

    from vlm_models import qwen_text_config, tokenizer_with

    tok = tokenizer_with(default_model, ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"])
    features = WhisperFeatureExtractor(feature_size=80, sampling_rate=SAMPLE_RATE)
    text = qwen_text_config(tok)
    text.pop("rope_parameters")  # (M-RoPE's: a plain Qwen2 decoder here)
    config = transformers.Qwen2AudioConfig(
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=128, num_mel_bins=80,
                          max_source_positions=features.nb_max_frames // 2),
        text_config=dict(model_type="qwen2", **text),
        audio_token_index=tok.convert_tokens_to_ids("<|AUDIO|>"))
    torch.manual_seed(seed)
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    with torch.no_grad():  # peaked logits that follow the audio
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.endswith("audio_tower.embed_positions.weight"):
                continue
            p.normal_(0, 0.4 if name.endswith("lm_head.weight") else
                      0.25 if name.startswith("audio_tower") else
                      0.5 if name.startswith("multi_modal_projector") else 0.15)
    model.save_pretrained(path)
    weights = path / "model.safetensors"
    save_file({k.replace("language_model.model.model.", "language_model.model."): v
               for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
    Qwen2AudioProcessor(feature_extractor=features, tokenizer=tok,
                        chat_template=tok.chat_template).save_pretrained(path)
    return path


@functools.lru_cache(maxsize=1)
def _hf_qwen2_audio(model_dir: str):
    import transformers

    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager").eval()
    return transformers.AutoProcessor.from_pretrained(model_dir), model


def hf_qwen2_audio_logprobs(model_dir: Path, prompt: str, audios: list,
                            continuation: list[int]) -> tuple[torch.Tensor, int]:
    """HF float64 log-probs ``[len, vocab]`` of ``prompt`` with ``audios`` (arrays; their
    tokens placed by the processor) followed by ``continuation``, and the number of
    positions before the continuation."""
    processor, hf = _hf_qwen2_audio(str(model_dir))
    if audios:
        enc = dict(processor(text=prompt, audio=audios, sampling_rate=SAMPLE_RATE,
                             return_tensors="pt"))
        enc["input_features"] = enc["input_features"].double()
    else:
        enc = dict(processor.tokenizer(prompt, return_tensors="pt"))
    n = enc["input_ids"].shape[1]
    ids = torch.cat((enc.pop("input_ids"), torch.tensor([continuation])), dim=1)
    enc.pop("attention_mask")
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[0]
    return torch.log_softmax(logits.double(), -1), n


#: Qwen2.5-Omni's special tokens, as its released tokenizer names them
OMNI_TOKENS = {"image_token": "<|IMAGE|>", "audio_token": "<|AUDIO|>",
               "video_token": "<|VIDEO|>", "vision_bos_token": "<|vision_bos|>",
               "vision_eos_token": "<|vision_eos|>", "audio_bos_token": "<|audio_bos|>",
               "audio_eos_token": "<|audio_eos|>"}
OMNI_AUDIO = "<|audio_bos|><|AUDIO|><|audio_eos|>"
OMNI_IMAGE = "<|vision_bos|><|IMAGE|><|vision_eos|>"
OMNI_VIDEO = "<|vision_bos|><|VIDEO|><|vision_eos|>"
#: the support table's words for each Omni family
OMNI_WORDS = {
    "qwen2_5_omni": "the thinker (vLLM serves it, not the talker): an audio tower "
                    "(transformers' module, as vLLM builds it) and Qwen2.5-VL's windowed "
                    "vision tower into a Qwen2 decoder with M-RoPE; audio and images in one "
                    "request",
    "qwen3_omni_moe": "the thinker: vLLM's own audio tower (three strided convolutions per "
                      "1 s chunk, attention on varlen_attention) and Qwen3-VL's vision tower "
                      "(DeepStack) into a Qwen3-MoE decoder (top-2 of 8) with interleaved "
                      "M-RoPE; audio and images in one request",
}
#: each Omni family's (HF config class, HF thinker class, released architecture)
OMNI_CLASSES = {
    "qwen2_5_omni": ("Qwen2_5OmniConfig", "Qwen2_5OmniThinkerForConditionalGeneration",
                     "Qwen2_5OmniModel"),
    "qwen3_omni_moe": ("Qwen3OmniMoeConfig", "Qwen3OmniMoeThinkerForConditionalGeneration",
                       "Qwen3OmniMoeForConditionalGeneration"),
}


def _omni_thinker_config(tok, family: str) -> dict:
    """The tiny thinker's fields: a 2-layer audio tower (d_model 64, 128 mel bins), a
    2-block vision tower, a 2-layer decoder; untied LM head (as released: vLLM reads
    the text config's flag)."""
    from vlm_models import QWEN_TOWERS, qwen3_text_config, qwen_text_config

    ids = {name: tok.convert_tokens_to_ids(token) for name, token in OMNI_TOKENS.items()}
    audio = dict(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                 num_mel_bins=128, output_dim=128)
    if family == "qwen2_5_omni":
        text = qwen_text_config(tok) | dict(tie_word_embeddings=False)
        vision = QWEN_TOWERS["qwen2_5_vl"]
        tokens = dict(audio_token_index=ids["audio_token"],
                      image_token_index=ids["image_token"],
                      video_token_index=ids["video_token"])
    else:
        text = qwen3_text_config(tok, moe=True) | dict(tie_word_embeddings=False)
        # (vLLM reads the learned position grid as image_size / patch_size, as released
        # configs carry it)
        vision = QWEN_TOWERS["qwen3_vl"] | dict(image_size=128, apply_vit_abs_pos_embed=True)
        audio |= dict(downsample_hidden_size=32)
        tokens = dict(audio_token_id=ids["audio_token"], image_token_id=ids["image_token"],
                      video_token_id=ids["video_token"])
    return dict(text_config=text, vision_config=vision, audio_config=audio, **tokens,
                audio_start_token_id=ids["audio_bos_token"],
                audio_end_token_id=ids["audio_eos_token"],
                vision_start_token_id=ids["vision_bos_token"],
                vision_end_token_id=ids["vision_eos_token"],
                user_token_id=tok.convert_tokens_to_ids("user"))


def _per_expert(weights: dict) -> dict:
    """transformers 5's fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj
    [E, H, I]``) in the released per-expert layout (``experts.{e}.gate_proj.weight``...)."""
    out = {}
    for name, w in weights.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, (gate, up) in enumerate(t.chunk(2, 0) for t in w):
                out[f"{name[:-12]}{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{name[:-12]}{e}.up_proj.weight"] = up.contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e, down in enumerate(w):
                out[f"{name[:-9]}{e}.down_proj.weight"] = down.contiguous()
        else:
            out[name] = w.contiguous()
    return out


def _fused_experts(weights: dict) -> dict:
    """``_per_expert``'s inverse (what transformers 5's modules hold)."""
    out, experts = {}, {}
    for name, w in weights.items():
        head, sep, tail = name.partition("mlp.experts.")
        if not sep:
            out[name] = w
            continue
        index, proj = tail.split(".")[:2]
        experts.setdefault(head, {}).setdefault(proj, {})[int(index)] = w
    for head, projs in experts.items():
        stack = {proj: torch.stack([ws[e] for e in sorted(ws)]) for proj, ws in projs.items()}
        out[f"{head}mlp.experts.gate_up_proj"] = torch.cat((stack["gate_proj"],
                                                            stack["up_proj"]), dim=1)
        out[f"{head}mlp.experts.down_proj"] = stack["down_proj"]
    return out


def build_tiny_qwen_omni(path: Path, default_model: Path, family: str = "qwen2_5_omni",
                         seed: int = 0) -> Path:
    """Qwen2.5-Omni (``family="qwen2_5_omni"``) or Qwen3-Omni (``"qwen3_omni_moe"``) in
    the released layout (the thinker's weights under ``thinker.``, experts one by one;
    no talker or vocoder weights, which vLLM does not load); images resized to at most
    224x224 pixels (Qwen3-Omni: 256x256)."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    config_cls, thinker_cls, arch = OMNI_CLASSES[family]
    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=OMNI_TOKENS)
    config = getattr(transformers, config_cls)(
        thinker_config=_omni_thinker_config(tok, family), enable_audio_output=False)
    config.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, thinker_cls)(config.thinker_config)
    with torch.no_grad():  # peaked logits that follow the audio and the image
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed_positions" in name:
                continue
            p.normal_(0, 0.4 if name.startswith("lm_head") else
                      0.25 if name.startswith("audio_tower") else
                      0.15 if name.startswith("model.") else 0.08)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_per_expert({f"thinker.{k}": v for k, v in model.state_dict().items()}),
              path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    pixels = ({"min_pixels": 56 * 56, "max_pixels": 224 * 224} if family == "qwen2_5_omni"
              else dict(patch_size=16, min_pixels=64 * 64, max_pixels=256 * 256,
                        image_mean=[0.5] * 3, image_std=[0.5] * 3))
    getattr(transformers, config_cls.replace("Config", "Processor"))(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE),
        tokenizer=tok, chat_template=tok.chat_template).save_pretrained(path)
    return path


@functools.lru_cache(maxsize=2)
def _hf_qwen_omni(model_dir: str):
    """(processor, HF float64 thinker) from the released layout's ``thinker.`` weights."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(model_dir)
    thinker_cls = next(cls for config_cls, cls, _ in OMNI_CLASSES.values()
                       if type(config).__name__ == config_cls)
    model = getattr(transformers, thinker_cls)._from_config(
        config.thinker_config, dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager")  # (HF's grouped matmul has no float64)
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    model.load_state_dict(_fused_experts({k.removeprefix("thinker."): v
                                          for k, v in weights.items()}), strict=True)
    return transformers.AutoProcessor.from_pretrained(model_dir), model.eval()


def hf_qwen_omni_logprobs(model_dir: Path, prompt: str, images: list, audios: list,
                          continuation: list[int], videos: list = ()) -> tuple[torch.Tensor, int]:
    """HF float64 log-probs ``[len, vocab]`` of ``prompt`` with ``images`` (PIL),
    ``audios`` (arrays) and ``videos`` (``video_of``'s pairs; their tokens placed by the
    processor) followed by ``continuation``, and the number of positions before the
    continuation."""
    processor, hf = _hf_qwen_omni(str(model_dir))
    media = ({"images": images} if images else {}) | ({"audio": audios} if audios else {})
    if videos:
        media |= dict(videos=[frames for frames, _ in videos], do_sample_frames=False,
                      video_metadata=[{k: v for k, v in meta.items() if k != "do_sample_frames"}
                                      for _, meta in videos])
    enc = dict(processor(text=prompt, return_tensors="pt", **media) if media
               else processor.tokenizer(prompt, return_tensors="pt"))
    n = enc["input_ids"].shape[1]
    ids = torch.cat((enc.pop("input_ids"), torch.tensor([continuation])), dim=1)
    enc.pop("attention_mask")
    for key in ("pixel_values", "pixel_values_videos", "input_features"):
        if key in enc:
            enc[key] = enc[key].double()
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[0]
    return torch.log_softmax(logits.double(), -1), n
