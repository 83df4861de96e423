"""Tiny random-weight speech models with their processors, built locally (no hub), and
their HF float64 oracles: Whisper (encoder-decoder: a Conv1d audio encoder, a decoder
with self- and cross-attention), Qwen2-Audio (audio in, text out: an audio tower in
front of a decoder-only Qwen2) and Qwen2.5-Omni's thinker (audio and images in, text
out: its audio tower and Qwen2.5-VL's vision tower in front of a Qwen2 decoder with
M-RoPE).

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
QWEN2_5_OMNI_WORDS = ("the thinker (vLLM serves it, not the talker): an audio tower "
                      "(transformers' module, as vLLM builds it) and Qwen2.5-VL's windowed "
                      "vision tower into a Qwen2 decoder with M-RoPE; audio and images in "
                      "one request")


def build_tiny_qwen2_5_omni(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Qwen2.5-Omni in the released layout (``Qwen2_5OmniModel``, the thinker's weights
    under ``thinker.``; no talker or vocoder weights, which vLLM does not load): a
    2-layer audio tower (d_model 64, 128 mel bins), Qwen2.5-VL's tower (2 blocks, a
    window of 112 pixels, the second block global), a 2-layer Qwen2 decoder with
    M-RoPE; images resized to at most 224x224 pixels."""
    import transformers
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, WhisperFeatureExtractor
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    from vlm_models import qwen_text_config

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=OMNI_TOKENS)
    ids = {name: tok.convert_tokens_to_ids(token) for name, token in OMNI_TOKENS.items()}
    thinker = dict(
        # (untied, as in the released 7B: vLLM reads the text config's flag)
        text_config=qwen_text_config(tok) | dict(tie_word_embeddings=False),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                           out_hidden_size=128, window_size=112, fullatt_block_indexes=[1]),
        audio_config=dict(d_model=64, encoder_layers=2, encoder_attention_heads=2,
                          encoder_ffn_dim=128, num_mel_bins=128, output_dim=128),
        audio_token_index=ids["audio_token"], image_token_index=ids["image_token"],
        video_token_index=ids["video_token"], audio_start_token_id=ids["audio_bos_token"],
        audio_end_token_id=ids["audio_eos_token"],
        vision_start_token_id=ids["vision_bos_token"],
        vision_end_token_id=ids["vision_eos_token"],
        user_token_id=tok.convert_tokens_to_ids("user"))
    config = transformers.Qwen2_5OmniConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen2_5OmniModel"]
    torch.manual_seed(seed)
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration(config.thinker_config)
    with torch.no_grad():  # peaked logits that follow the audio and the image
        for name, p in model.named_parameters():
            if p.dim() < 2 or "embed_positions" in name:
                continue
            p.normal_(0, 0.4 if name.startswith("lm_head") else
                      0.25 if name.startswith("audio_tower") else
                      0.15 if name.startswith("model.") else 0.08)
    path.mkdir(parents=True, exist_ok=True)
    save_file({f"thinker.{k}": v.contiguous() for k, v in model.state_dict().items()},
              path / "model.safetensors", metadata={"format": "pt"})
    config.save_pretrained(path)
    pixels = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}
    transformers.Qwen2_5OmniProcessor(
        image_processor=Qwen2VLImageProcessor(**pixels),
        video_processor=Qwen2VLVideoProcessor(**pixels),
        feature_extractor=WhisperFeatureExtractor(feature_size=128, sampling_rate=SAMPLE_RATE),
        tokenizer=tok, chat_template=tok.chat_template).save_pretrained(path)
    return path


@functools.lru_cache(maxsize=1)
def _hf_qwen2_5_omni(model_dir: str):
    """(processor, HF float64 thinker) from the released layout's ``thinker.`` weights."""
    import transformers
    from safetensors.torch import load_file

    config = transformers.AutoConfig.from_pretrained(model_dir).thinker_config
    model = transformers.Qwen2_5OmniThinkerForConditionalGeneration._from_config(
        config, dtype=torch.float64, attn_implementation="eager")
    weights = load_file(str(Path(model_dir) / "model.safetensors"))
    model.load_state_dict({k.removeprefix("thinker."): v for k, v in weights.items()},
                          strict=True)
    return transformers.AutoProcessor.from_pretrained(model_dir), model.eval()


def hf_qwen2_5_omni_logprobs(model_dir: Path, prompt: str, images: list, audios: list,
                             continuation: list[int]) -> tuple[torch.Tensor, int]:
    """HF float64 log-probs ``[len, vocab]`` of ``prompt`` with ``images`` (PIL) and
    ``audios`` (arrays; their tokens placed by the processor) followed by
    ``continuation``, and the number of positions before the continuation."""
    processor, hf = _hf_qwen2_5_omni(str(model_dir))
    media = ({"images": images} if images else {}) | ({"audio": audios} if audios else {})
    enc = dict(processor(text=prompt, return_tensors="pt", **media) if media
               else processor.tokenizer(prompt, return_tensors="pt"))
    n = enc["input_ids"].shape[1]
    ids = torch.cat((enc.pop("input_ids"), torch.tensor([continuation])), dim=1)
    enc.pop("attention_mask")
    for key in ("pixel_values", "input_features"):
        if key in enc:
            enc[key] = enc[key].double()
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[0]
    return torch.log_softmax(logits.double(), -1), n
