"""Tiny random-weight vision-language checkpoints with their processors, built locally
(no hub), each with the default model's tokenizer and its image tokens added:

- BLIP-2: a BLIP vision tower, a Q-Former of 8 queries, an OPT decoder (PIL processor);
- Qwen2-VL: its vision tower (2D RoPE, 2x2 patch merger), a Qwen2 decoder with M-RoPE,
  dynamic resolution (the image's size sets its token count);
- Qwen2.5-VL: the same with a windowed vision tower (RMSNorm, SwiGLU; one windowed and
  one full-attention block) and time-aligned M-RoPE;
- Qwen3-VL: 16-pixel patches, learned positions interpolated per image, DeepStack
  (a tower block's features added into the decoder's first layer), a Qwen3 decoder with
  interleaved M-RoPE; Qwen3-VL-MoE the same over a Qwen3-MoE decoder (experts saved in
  the released fused layout);
- Gemma 3: a SigLIP tower pooled to 4 tokens an image, a Gemma 3 decoder whose image
  tokens attend to each other both ways;
- GLM-4.1V: its tower (2D RoPE, interpolated positions) and a GLM-4 decoder with
  half-width M-RoPE;
- LLaVA: a CLIP vision tower (CLS dropped, second-to-last layer) through a 2-layer
  projector into a Llama decoder; LLaVA-Next the same with anyres tiles and an
  image-newline embedding;
- InternVL (transformers' own layout, as InternVL3-hf): an InternViT tower, pixel
  shuffle, a Qwen2 decoder, images cut into tiles plus a thumbnail.
- GLM-4.5V: GLM-4.1V's tower over a GLM-4.5 MoE decoder;
- LLaVA-OneVision: a SigLIP tower, anyres tiles unpadded to the image, a Qwen2 decoder;
- Mistral 3 (Mistral Small 3.x): a Pixtral tower (2D rope, an image-break token per
  row), a 2x2 patch merger, a Mistral decoder;
- SmolVLM: a SigLIP tower over tiles plus a global view, pixel shuffle, a Llama decoder
  (its processor needs ``num2words``);
- PaddleOCR-VL: a NaViT-style SigLIP tower, an ERNIE 4.5 decoder with M-RoPE;
- MiniCPM-V 4.6: a SigLIP tower with a window merger after its first layer, image
  slices behind their ids, a Qwen3.5 decoder (Gated DeltaNet, then gated attention).

The Qwen, LLaVA and InternVL processors use torchvision's transforms (vllm_accel's
``torchvision_compat`` makes PyPI's CUDA build import beside CPU torch).
"""

import functools
from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH, QUERIES = 56, 14, 8
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>",
                   "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}
#: the prompt text that stands for one image, per family (BLIP-2's processors put
#: its query tokens first themselves, one image per prompt)
GLM_IMAGE = "<|begin_of_image|><|image|><|end_of_image|>"
PLACEHOLDERS = {"blip2": "", "qwen2_vl": QWEN_IMAGE, "qwen2_5_vl": QWEN_IMAGE,
                "gemma3": "<start_of_image>", "gemma4": "<|image|>",
                "qwen3_vl": QWEN_IMAGE, "qwen3_vl_moe": QWEN_IMAGE, "glm4v": GLM_IMAGE,
                "llava": IMAGE_TOKEN, "llava_next": IMAGE_TOKEN,
                "internvl": INTERNVL_TOKENS["context_image_token"], "mistral3": "[IMG]",
                "smolvlm": "<image>", "glm4v_moe": GLM_IMAGE,
                "llava_onevision": IMAGE_TOKEN,
                "paddleocr_vl": "<|IMAGE_START|><|IMAGE_PLACEHOLDER|><|IMAGE_END|>",
                "minicpmv4_6": "<|image_pad|>"}


def tokenizer_with(default_model: Path, tokens: list[str]):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    tok.add_special_tokens({"additional_special_tokens": tokens})
    return tok


def _peaked(model, std: float = 0.08) -> None:
    """Weights drawn so that logits are peaked (HF's init gives near-ties)."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4 if p is head.weight else std)


def _peaked_model(model_cls, config, seed: int):
    """``model_cls(config)`` drawn from ``seed`` with peaked logits (``_peaked``)."""
    torch.manual_seed(seed)
    model = model_cls(config)
    _peaked(model)
    return model


def tiny_decoder(tok, **extra) -> dict:
    """A tiny decoder's config fields over ``tok``'s vocabulary: hidden 128, two layers,
    4 query / 2 KV heads; ``extra`` adds or overrides."""
    return dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id) | extra


def tiny_tower(**extra) -> dict:
    """A tiny ViT tower's config fields: width 64, two layers of 2 heads, 14-pixel
    patches of 56-pixel images; ``extra`` adds or overrides."""
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, image_size=IMAGE_SIZE, patch_size=PATCH) | extra


def qwen_text_config(tok) -> dict:
    """A tiny decoder with Qwen2-VL's M-RoPE sections (a fresh dict each call)."""
    return tiny_decoder(tok, rope_parameters={"rope_type": "default",
                                              "mrope_section": [4, 6, 6],
                                              "rope_theta": 10000.0})


#: the tiny Qwen vision towers: Qwen2.5-VL's (a window of 112 pixels, the second block
#: global) and Qwen3-VL's (16-pixel patches, learned positions interpolated from an 8x8
#: grid, the first block's features added into the decoder's first layer: DeepStack);
#: the Omni thinkers take them too
QWEN_TOWERS = {
    "qwen2_5_vl": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                       out_hidden_size=128, window_size=112, fullatt_block_indexes=[1]),
    "qwen3_vl": dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                     out_hidden_size=128, patch_size=16, num_position_embeddings=64,
                     deepstack_visual_indexes=[0]),
}


def qwen3_text_config(tok, moe: bool = False) -> dict:
    """Qwen3-VL's tiny decoder (q/k norms over heads of 32, interleaved M-RoPE); ``moe``:
    Qwen3-MoE's experts (top-2 of 8; 48 wide, so no expert matrix is square and a
    wrong transpose cannot load; HF's router always renormalises, vLLM reads the flag,
    which released configs carry)."""
    text = qwen_text_config(tok) | dict(head_dim=32, rope_parameters={
        "rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True,
        "rope_theta": 10000.0})
    if moe:
        text |= dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                     decoder_sparse_step=1, norm_topk_prob=True)
    return text


def build_tiny_qwen_vl(path: Path, default_model: Path, family: str = "qwen2_vl",
                       seed: int = 0) -> Path:
    """Qwen2-VL (``family="qwen2_vl"``), Qwen2.5-VL (``"qwen2_5_vl"``), Qwen3-VL
    (``"qwen3_vl"``) or Qwen3-VL-MoE (``"qwen3_vl_moe"``); images are resized to at most
    224x224 pixels (Qwen3-VL: 256x256; up to 64 image tokens)."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tok = tokenizer_with(default_model, QWEN_TOKENS)
    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id",
                    "video_token_id"), tok.convert_tokens_to_ids(QWEN_TOKENS), strict=True))
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=64, hidden_size=128, num_heads=2, mlp_ratio=2)
        config_cls, model_cls = transformers.Qwen2VLConfig, \
            transformers.Qwen2VLForConditionalGeneration
        processor_cls = transformers.Qwen2VLProcessor
    elif family == "qwen2_5_vl":
        vision = QWEN_TOWERS["qwen2_5_vl"]
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, \
            transformers.Qwen2_5_VLForConditionalGeneration
        processor_cls = transformers.Qwen2_5_VLProcessor
    else:  # (Qwen3-VL-MoE: Qwen3-VL's tower over a Qwen3-MoE decoder)
        vision = QWEN_TOWERS["qwen3_vl"]
        moe = family == "qwen3_vl_moe"
        config_cls = transformers.Qwen3VLMoeConfig if moe else transformers.Qwen3VLConfig
        model_cls = (transformers.Qwen3VLMoeForConditionalGeneration if moe
                     else transformers.Qwen3VLForConditionalGeneration)
        processor_cls = transformers.Qwen3VLProcessor
    text = (qwen3_text_config(tok, moe=family == "qwen3_vl_moe")
            if family.startswith("qwen3_vl") else qwen_text_config(tok))
    config = config_cls(text_config=text, vision_config=vision, **ids)
    torch.manual_seed(seed)
    model = model_cls(config)
    _peaked(model)
    model.save_pretrained(path)
    if family == "qwen3_vl_moe":
        _released_expert_layout(path / "model.safetensors")
    pixels = {"min_pixels": 56 * 56, "max_pixels": 224 * 224}
    if family.startswith("qwen3_vl"):
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor)

        # (released Qwen3-VL normalizes images and videos alike, to [-1, 1]: vLLM
        # normalizes both on the device with the image processor's values)
        pixels = dict(patch_size=16, min_pixels=64 * 64, max_pixels=256 * 256,
                      image_mean=[0.5] * 3, image_std=[0.5] * 3)
        video = Qwen3VLVideoProcessor(patch_size=16)
    else:
        video = Qwen2VLVideoProcessor(**pixels)
    processor_cls(image_processor=Qwen2VLImageProcessor(**pixels), tokenizer=tok,
                  video_processor=video).save_pretrained(path)
    return path


GLM_TOKENS = ["<|begin_of_image|>", "<|end_of_image|>", "<|image|>", "<|begin_of_video|>",
              "<|end_of_video|>", "<|video|>"]


def build_tiny_glm4v(path: Path, default_model: Path, family: str = "glm4v",
                     seed: int = 0) -> Path:
    """GLM-4.1V (``family="glm4v"``): its vision tower (2D RoPE and learned positions
    interpolated from a 4x4 grid, 2x2 patch merger), a GLM-4 decoder with half-width
    M-RoPE; dynamic resolution as Qwen2-VL's (images resized to at most 224x224
    pixels). GLM-4.5V (``"glm4v_moe"``): the same tower over a GLM-4.5 MoE decoder
    (sigmoid top-2 of 8 with correction bias, routed scaling 2.5, a shared expert, the
    first layer dense)."""
    import transformers
    from transformers.models.glm4v.image_processing_glm4v import Glm4vImageProcessor
    from transformers.models.glm4v.video_processing_glm4v import Glm4vVideoProcessor

    tok = tokenizer_with(default_model, GLM_TOKENS)
    ids = dict(zip(("image_start_token_id", "image_end_token_id", "image_token_id",
                    "video_start_token_id", "video_end_token_id", "video_token_id"),
                   tok.convert_tokens_to_ids(GLM_TOKENS), strict=True))
    text = qwen_text_config(tok) | dict(head_dim=32, rope_parameters={
        "rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5})
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=128, image_size=56)
    moe = family == "glm4v_moe"
    if moe:
        text |= dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                     n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     use_qk_norm=False)  # (released configs name it; vLLM reads it)
    config = (transformers.Glm4vMoeConfig if moe else transformers.Glm4vConfig)(
        text_config=text, vision_config=vision, **ids)
    model = _peaked_model(transformers.Glm4vMoeForConditionalGeneration if moe
                          else transformers.Glm4vForConditionalGeneration, config, seed)
    with torch.no_grad():  # (HF inits the router's correction bias to zeros)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.1)
    model.save_pretrained(path)
    size = {"shortest_edge": 56 * 56, "longest_edge": 224 * 224}
    transformers.Glm4vProcessor(image_processor=Glm4vImageProcessor(size=size), tokenizer=tok,
                                video_processor=Glm4vVideoProcessor()).save_pretrained(path)
    return path


GEMMA3_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                 "image_token": "<image_soft_token>"}


def build_tiny_gemma3(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Gemma 3 (multimodal): a SigLIP tower of 56x56 images pooled to 4 tokens, a Gemma 3
    decoder (a window on alternate layers) whose image tokens attend to each other both
    ways (HF's blockwise mask; vLLM's mm-prefix ranges)."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=GEMMA3_TOKENS)
    # (Gemma's vocabulary has runs of newlines as tokens; vLLM's processor merges the
    # ones around an image into them)
    tok.add_tokens(["\n", "\n\n", "\n\n\n", "\n\n\n\n"])
    ids = tok.convert_tokens_to_ids(list(GEMMA3_TOKENS.values()))
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                query_pre_attn_scalar=32, sliding_window=21,
                layer_types=["sliding_attention", "full_attention"],
                max_position_embeddings=2048, bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=0)
    vision = dict(image_size=56, patch_size=14, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=2, vision_use_head=False)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision,
                                       mm_tokens_per_image=4, boi_token_id=ids[0],
                                       eoi_token_id=ids[1], image_token_id=ids[2])
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config)
    _peaked(model)
    with torch.no_grad():  # (Gemma scales embeddings by sqrt(hidden): a narrower head)
        model.get_output_embeddings().weight.normal_(0, 0.1)
    model.save_pretrained(path)
    _released_clip_layout(path / "model.safetensors")  # (SigLIP's, as CLIP's)
    transformers.Gemma3Processor(
        image_processor=transformers.Gemma3ImageProcessor(size={"height": 56, "width": 56}),
        tokenizer=tok, image_seq_length=4).save_pretrained(path)
    return path


#: Gemma 4's special tokens (its processor wants the audio ones named too)
GEMMA4_TOKENS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
                 "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def build_tiny_gemma4(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Gemma 4 (multimodal): its vision tower (2-D rope, 3x3 pooling to the smallest
    budget of 70 soft tokens per image), a Gemma 4 decoder of four layers, windowed and
    global in turn (head sizes 32 and 64), whose image tokens attend to each other both
    ways on the windowed layers only (``use_bidirectional_attention="vision"``: vLLM
    clears the ranges on the global ones); no audio tower."""
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=GEMMA4_TOKENS)
    ids = dict(zip(GEMMA4_TOKENS, tok.convert_tokens_to_ids(list(GEMMA4_TOKENS.values()))))
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                global_head_dim=64, sliding_window=21,
                layer_types=["sliding_attention", "full_attention"] * 2,
                hidden_size_per_layer_input=0, use_bidirectional_attention="vision",
                max_position_embeddings=2048, final_logit_softcapping=30.0,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    vision = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=32, patch_size=16,
                  pooling_kernel_size=3, default_output_length=70)
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None,
                                       boi_token_id=ids["boi_token"],
                                       eoi_token_id=ids["eoi_token"],
                                       image_token_id=ids["image_token"])
    torch.manual_seed(seed)
    model = transformers.Gemma4ForConditionalGeneration(config)
    _peaked(model)
    with torch.no_grad():  # image tokens on the scale of the text's (scaled) embeddings
        model.model.embed_vision.embedding_projection.weight.normal_(0, 0.6)
    model.save_pretrained(path)
    transformers.Gemma4Processor(
        feature_extractor=transformers.Gemma4AudioFeatureExtractor(),
        image_processor=transformers.Gemma4ImageProcessor(max_soft_tokens=70),
        video_processor=transformers.Gemma4VideoProcessor(), tokenizer=tok,
        image_seq_length=70).save_pretrained(path)
    return path


def _clip_llava(family: str, tok, seed: int):
    """A LLaVA (``family="llava"``) or LLaVA-Next (``"llava_next"``: 2x2 tiles at most
    plus the base image, an image-newline embedding) model over a 2-layer CLIP tower
    of 56x56 images."""
    import transformers

    vision = transformers.CLIPVisionConfig(**tiny_tower(projection_dim=64))
    text = transformers.LlamaConfig(**tiny_decoder(tok))
    common = dict(vision_config=vision.to_dict(), text_config=text.to_dict(),
                  image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
                  image_seq_length=(IMAGE_SIZE // PATCH) ** 2)
    torch.manual_seed(seed)
    if family == "llava":
        return transformers.LlavaForConditionalGeneration(transformers.LlavaConfig(**common))
    config = transformers.LlavaNextConfig(image_grid_pinpoints=GRID_PINPOINTS, **common)
    model = transformers.LlavaNextForConditionalGeneration(config)
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    return model


#: LLaVA-Next's tilings of a 56-pixel tower: 1x1 to 2x2 tiles
GRID_PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112]]


def build_tiny_llava(path: Path, default_model: Path, family: str = "llava",
                     seed: int = 0) -> Path:
    """LLaVA-1.5 (16 tokens an image) or LLaVA-Next (anyres: up to 4 tiles of 16 tokens
    plus the base image's and a newline per row), saved in the released layout."""
    import transformers
    from transformers.models.clip.image_processing_clip import CLIPImageProcessor
    from transformers.models.llava_next.image_processing_llava_next import (
        LlavaNextImageProcessor)

    tok = tokenizer_with(default_model, [IMAGE_TOKEN])
    model = _clip_llava(family, tok, seed)
    _peaked(model)
    model.save_pretrained(path)
    _released_clip_layout(path / "model.safetensors")
    size = dict(size={"shortest_edge": IMAGE_SIZE},
                crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    if family == "llava":
        processor_cls, image_processor = transformers.LlavaProcessor, CLIPImageProcessor(**size)
    else:
        processor_cls = transformers.LlavaNextProcessor
        image_processor = LlavaNextImageProcessor(image_grid_pinpoints=GRID_PINPOINTS, **size)
    processor_cls(image_processor=image_processor, tokenizer=tok, patch_size=PATCH,
                  vision_feature_select_strategy="default", num_additional_image_tokens=1,
                  image_token=IMAGE_TOKEN).save_pretrained(path)
    return path


def build_tiny_internvl(path: Path, default_model: Path, seed: int = 0) -> Path:
    """InternVL in transformers' own layout (InternVL3-hf): an InternViT tower of 56x56
    tiles, pixel shuffle to 4 tokens a tile, a Qwen2 decoder; images cut into up to 4
    tiles plus a thumbnail."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.got_ocr2.image_processing_got_ocr2 import GotOcr2ImageProcessor
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=INTERNVL_TOKENS)
    vision = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=128, image_size=[IMAGE_SIZE] * 2, patch_size=[PATCH] * 2)
    text = transformers.Qwen2Config(**tiny_decoder(tok))
    tokens = (IMAGE_SIZE // PATCH // 2) ** 2
    config = transformers.InternVLConfig(
        vision_config=vision, text_config=text.to_dict(), image_seq_length=tokens,
        image_token_id=tok.context_image_token_id, downsample_ratio=0.5,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(config)
    _peaked(model)
    model.save_pretrained(path)
    tile = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    transformers.InternVLProcessor(
        image_processor=GotOcr2ImageProcessor(size=tile, crop_to_patches=True, min_patches=1,
                                              max_patches=4),
        tokenizer=tok, video_processor=InternVLVideoProcessor(size=tile),
        image_seq_length=tokens).save_pretrained(path)
    return path


PIXTRAL_TOKENS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]


def build_tiny_mistral3(path: Path, default_model: Path, seed: int = 0) -> Path:
    """Mistral 3: a Pixtral tower (2D rope; images up to 112 pixels on the long side,
    an image-break token after each row of patches and an image-end token), a 2x2
    patch merger, a Mistral decoder."""
    import transformers
    from transformers.models.pixtral.image_processing_pixtral import PixtralImageProcessor

    tok = tokenizer_with(default_model, PIXTRAL_TOKENS)
    vision = tiny_tower(model_type="pixtral", head_dim=32, image_size=112)
    text = tiny_decoder(tok, model_type="mistral", head_dim=32, sliding_window=None)
    config = transformers.Mistral3Config(
        vision_config=vision, text_config=text, spatial_merge_size=2,
        image_token_index=tok.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
    model = _peaked_model(transformers.Mistral3ForConditionalGeneration, config, seed)
    model.save_pretrained(path)
    transformers.PixtralProcessor(
        image_processor=PixtralImageProcessor(size={"longest_edge": 112},
                                              patch_size={"height": 14, "width": 14}),
        tokenizer=tok, patch_size=14, spatial_merge_size=2).save_pretrained(path)
    return path


SMOLVLM_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>",
                  "<end_of_utterance>"]


def build_tiny_smolvlm(path: Path, default_model: Path, seed: int = 0) -> Path:
    """SmolVLM: a SigLIP tower of 56x56 tiles, pixel shuffle (scale 2) to 4 tokens a
    tile, a Llama decoder; an image cut into tiles of at most 56 pixels plus a global
    view, each tile's tokens behind its row/column marker."""
    import transformers
    from transformers.models.smolvlm.image_processing_smolvlm import SmolVLMImageProcessor
    from transformers.models.smolvlm.video_processing_smolvlm import SmolVLMVideoProcessor

    tok = tokenizer_with(default_model, SMOLVLM_TOKENS)
    vision = tiny_tower()
    text = tiny_decoder(tok, model_type="llama", pad_token_id=0)
    config = transformers.SmolVLMConfig(
        vision_config=vision, text_config=text, scale_factor=2, pad_token_id=0,
        image_token_id=tok.convert_tokens_to_ids("<image>"))
    model = _peaked_model(transformers.SmolVLMForConditionalGeneration, config, seed)
    model.save_pretrained(path)
    transformers.SmolVLMProcessor(
        image_processor=SmolVLMImageProcessor(size={"longest_edge": 2 * IMAGE_SIZE},
                                              max_image_size={"longest_edge": IMAGE_SIZE}),
        video_processor=SmolVLMVideoProcessor(), tokenizer=tok,
        image_seq_len=(IMAGE_SIZE // PATCH // 2) ** 2).save_pretrained(path)
    return path


def build_tiny_llava_onevision(path: Path, default_model: Path, seed: int = 0) -> Path:
    """LLaVA-OneVision: a SigLIP tower of 56x56 tiles (every patch kept), anyres tiles
    of up to 2x2 unpadded to the image's aspect with a newline per row (``anyres_max_9``
    shrinks none at this size), a Qwen2 decoder."""
    import transformers
    from transformers.models.llava_onevision.image_processing_llava_onevision import (
        LlavaOnevisionImageProcessor)
    from transformers.models.llava_onevision.video_processing_llava_onevision import (
        LlavaOnevisionVideoProcessor)

    tok = tokenizer_with(default_model, [IMAGE_TOKEN, "<video>"])
    vision = tiny_tower(model_type="siglip_vision_model", vision_use_head=False)
    text = tiny_decoder(tok, model_type="qwen2", rope_parameters=None)
    config = transformers.LlavaOnevisionConfig(
        vision_config=vision, text_config=text, image_grid_pinpoints=GRID_PINPOINTS,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN),
        video_token_index=tok.convert_tokens_to_ids("<video>"))
    model = _peaked_model(transformers.LlavaOnevisionForConditionalGeneration, config, seed)
    with torch.no_grad():
        model.model.image_newline.normal_(0, 1)
    model.save_pretrained(path)
    _released_clip_layout(path / "model.safetensors")  # (SigLIP's, as CLIP's)
    tile = {"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    transformers.LlavaOnevisionProcessor(
        image_processor=LlavaOnevisionImageProcessor(size=tile,
                                                     image_grid_pinpoints=GRID_PINPOINTS),
        video_processor=LlavaOnevisionVideoProcessor(size=tile), tokenizer=tok,
        num_image_tokens=(IMAGE_SIZE // PATCH) ** 2, vision_feature_select_strategy="full",
        ).save_pretrained(path)
    return path


PADDLEOCR_TOKENS = {"image_token": "<|IMAGE_PLACEHOLDER|>", "video_token": "<|video_pad|>",
                    "vision_start_token": "<|IMAGE_START|>",
                    "vision_end_token": "<|IMAGE_END|>"}


def build_tiny_paddleocr_vl(path: Path, default_model: Path, seed: int = 0) -> Path:
    """PaddleOCR-VL: a NaViT-style SigLIP tower (2D rope, learned positions
    interpolated per image, dynamic resolution, 2x2 merger), an ERNIE 4.5 decoder with
    M-RoPE; images resized to at most 112x112 pixels."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.paddleocr_vl.image_processing_paddleocr_vl import (
        PaddleOCRVLImageProcessor)

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=PADDLEOCR_TOKENS)
    ids = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id",
                    "vision_end_token_id"),
                   tok.convert_tokens_to_ids(list(PADDLEOCR_TOKENS.values())), strict=True))
    vision = tiny_tower()
    text = qwen_text_config(tok) | dict(head_dim=32, pad_token_id=0)
    config = transformers.PaddleOCRVLConfig(text_config=text, vision_config=vision,
                                            tie_word_embeddings=False, **ids)
    model = _peaked_model(transformers.PaddleOCRVLForConditionalGeneration, config, seed)
    model.save_pretrained(path)
    transformers.PaddleOCRVLProcessor(
        image_processor=PaddleOCRVLImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112),
        tokenizer=tok).save_pretrained(path)
    return path


MINICPMV_TOKENS = {"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                   "image_start_token": "<image>", "image_end_token": "</image>",
                   "slice_start_token": "<slice>", "slice_end_token": "</slice>",
                   "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>"}


def build_tiny_minicpmv(path: Path, default_model: Path, seed: int = 0) -> Path:
    """MiniCPM-V 4.6: a tower of 112-pixel slices (its window merger after the first
    layer), an image cut into up to 4 slices plus the whole, a Qwen3.5 decoder (a Gated
    DeltaNet layer of 2 key / 4 value heads of 128, vLLM's CPU kernel's size, then gated
    attention)."""
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessor)
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import (
        MiniCPMV4_6VideoProcessor)

    tok = AutoTokenizer.from_pretrained(default_model, extra_special_tokens=MINICPMV_TOKENS)
    vision = tiny_tower(image_size=112)
    text = tiny_decoder(tok, model_type="qwen3_5_text", head_dim=32, linear_num_key_heads=2,
                        linear_num_value_heads=4, linear_key_head_dim=128,
                        linear_value_head_dim=128,
                        layer_types=["linear_attention", "full_attention"], pad_token_id=0)
    config = transformers.MiniCPMV4_6Config(
        text_config=text, vision_config=vision, insert_layer_id=0, image_size=112,
        image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
        video_token_id=tok.convert_tokens_to_ids("<|video_pad|>"))
    model = _peaked_model(transformers.MiniCPMV4_6ForConditionalGeneration, config, seed)
    model.save_pretrained(path)
    transformers.MiniCPMV4_6Processor(
        image_processor=MiniCPMV4_6ImageProcessor(scale_resolution=112, max_slice_nums=4),
        video_processor=MiniCPMV4_6VideoProcessor(scale_resolution=112), tokenizer=tok,
        ).save_pretrained(path)
    return path


def _released_clip_layout(file: Path) -> None:
    """transformers 5 saves LLaVA's CLIP tower (Gemma 3's SigLIP) as
    ``vision_tower.<...>``; the released checkpoints and vLLM's loader have
    ``vision_tower.vision_model.<...>``."""
    from safetensors.torch import load_file, save_file

    prefix = "vision_tower."
    tensors = {(prefix + "vision_model." + k[len(prefix):] if k.startswith(prefix) else k): v
               for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})


def _released_expert_layout(file: Path) -> None:
    """transformers 5 saves Qwen3-VL-MoE's fused experts as it holds them
    (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``); the released checkpoints
    and vLLM's loader have them transposed (transformers transposes them at load)."""
    from safetensors.torch import load_file, save_file

    tensors = {k: (v.transpose(1, 2).contiguous() if k.endswith(("experts.gate_up_proj",
                                                                 "experts.down_proj"))
                   else v) for k, v in load_file(file).items()}
    save_file(tensors, file, metadata={"format": "pt"})


def build_tiny_blip2(path: Path, default_model: Path, seed: int = 0) -> Path:
    import transformers
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tok = tokenizer_with(default_model, [IMAGE_TOKEN])
    vision = transformers.Blip2VisionConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=PATCH)
    qformer = transformers.Blip2QFormerConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        encoder_hidden_size=64)
    text = transformers.OPTConfig(
        vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, ffn_dim=256,
        num_attention_heads=4, max_position_embeddings=512, word_embed_proj_dim=128,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
    config = transformers.Blip2Config(
        vision_config=vision.to_dict(), qformer_config=qformer.to_dict(),
        text_config=text.to_dict(), num_query_tokens=QUERIES,
        image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = transformers.Blip2ForConditionalGeneration(config)
    _peaked(model)
    model.save_pretrained(path, safe_serialization=True)
    transformers.Blip2Processor(
        image_processor=BlipImageProcessorPil(size={"height": IMAGE_SIZE,
                                                    "width": IMAGE_SIZE}),
        tokenizer=tok, num_query_tokens=QUERIES).save_pretrained(path)
    return path


def random_image(seed: int, height: int = 70, width: int = 90):
    """A noise image (PIL) of ``height`` x ``width`` pixels, resized by the processor."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))


def image_of(entry):
    """An engine spec's image: a seed, or ``[seed, height, width]``."""
    return random_image(*entry) if isinstance(entry, list) else random_image(entry)


QWEN_VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
#: the prompt text that stands for one video, per family that takes videos
VIDEO_PLACEHOLDERS = {"qwen2_vl": QWEN_VIDEO, "qwen2_5_vl": QWEN_VIDEO, "qwen3_vl": QWEN_VIDEO,
                      "qwen3_vl_moe": QWEN_VIDEO,
                      "glm4v": "<|begin_of_video|><|video|><|end_of_video|>",
                      "llava_onevision": "<video>"}
VIDEO_FPS = 2.0


def random_video(seed: int, frames: int, height: int, width: int):
    """Noise frames ``[frames, height, width, 3]`` (uint8, as vLLM's video loaders give)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return (rng.random((frames, height, width, 3)) * 255).astype("uint8")


def video_metadata(frames: int) -> dict:
    """What vLLM's video loader reports for a clip of ``frames`` frames, all kept, at
    ``VIDEO_FPS`` (Qwen2.5-VL's temporal positions, Qwen3-VL's and GLM-4.1V's timestamps
    read it; ``do_sample_frames`` is vLLM's own key, which the HF processor does not take)."""
    return {"fps": VIDEO_FPS, "total_num_frames": frames, "duration": frames / VIDEO_FPS,
            "frames_indices": list(range(frames)), "video_backend": "opencv",
            "do_sample_frames": False}


def video_of(entry):
    """An engine spec's video, ``[seed, frames, height, width]``, as vLLM takes it:
    (frames, metadata)."""
    return random_video(*entry), video_metadata(entry[1])


HF_CLASSES = {"blip-2": "Blip2ForConditionalGeneration",
              "qwen2_vl": "Qwen2VLForConditionalGeneration",
              "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
              "qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
              "glm4v": "Glm4vForConditionalGeneration",
              "gemma3": "Gemma3ForConditionalGeneration",
              "gemma4": "Gemma4ForConditionalGeneration",
              "llava": "LlavaForConditionalGeneration",
              "llava_next": "LlavaNextForConditionalGeneration",
              "internvl": "InternVLForConditionalGeneration",
              "mistral3": "Mistral3ForConditionalGeneration",
              "smolvlm": "SmolVLMForConditionalGeneration",
              "glm4v_moe": "Glm4vMoeForConditionalGeneration",
              "llava_onevision": "LlavaOnevisionForConditionalGeneration",
              "paddleocr_vl": "PaddleOCRVLForConditionalGeneration",
              "minicpmv4_6": "MiniCPMV4_6ForConditionalGeneration"}


@functools.lru_cache(maxsize=2)
def _hf_model(model_dir: str, bf16_weights: bool = False):
    """(processor, HF float64 model, model type); ``bf16_weights``: the weights rounded
    to bf16 first, as a bf16 engine holds them."""
    import transformers

    model_type = transformers.AutoConfig.from_pretrained(model_dir).model_type
    model = getattr(transformers, HF_CLASSES[model_type]).from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager",
        experts_implementation="eager")  # (HF's grouped matmul has no float64)
    if bf16_weights:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    if model_type == "paddleocr_vl":
        # transformers 5.19 resamples PaddleOCR-VL's learned position grid with
        # align_corners=True, vLLM 0.32 (stock as well) with False: a systematic
        # 2-5e-3 nats on image prompts of the tiny model that is neither the plugin's
        # nor a kernel's. The oracle takes vLLM's convention, the rest stays HF's.
        for module in model.modules():
            if hasattr(module, "interpolation_align_corners"):
                module.interpolation_align_corners = False
    return transformers.AutoProcessor.from_pretrained(model_dir), model, model_type


def _qwen_reference_positions(hf, ids, enc) -> torch.Tensor:
    """Qwen2.5-VL's M-RoPE positions ``[3, 1, len]`` by Qwen's rule (vLLM's too): text
    after an image or video starts one past the largest position so far. transformers
    5.19 advances by the image's larger side only, which under-counts a video whose
    temporal positions (``tokens_per_second`` apart a second) reach further."""
    config = hf.config
    merge = config.vision_config.spatial_merge_size
    per_second = config.vision_config.tokens_per_second
    grids = {1: iter(enc.get("image_grid_thw", [])), 2: iter(enc.get("video_grid_thw", []))}
    seconds = iter(enc.get("second_per_grid_ts", []))
    kinds = torch.cat((enc["mm_token_type_ids"][0],
                       torch.zeros(ids.shape[1] - enc["mm_token_type_ids"].shape[1],
                                   dtype=enc["mm_token_type_ids"].dtype)))
    parts, start, i = [], 0, 0
    while i < len(kinds):
        kind, j = int(kinds[i]), i
        while j < len(kinds) and int(kinds[j]) == kind:
            j += 1
        if kind == 0:
            parts.append(torch.arange(j - i).expand(3, -1) + start)
        else:
            interval = per_second * float(next(seconds)) if kind == 2 else 1
            parts.append(hf.model.get_vision_position_ids(start, next(grids[kind]), 1, merge,
                                                          interval))
        start = int(parts[-1].max()) + 1
        i = j
    return torch.cat(parts, dim=1).unsqueeze(1)


def hf_logprobs(model_dir: Path, prompt: str, images: list, continuation: list[int],
                videos: list = (), bf16_weights: bool = False):
    """HF float64 log-probs ``[len, vocab]`` of ``prompt`` with ``images`` (PIL) and
    ``videos`` (``video_of``'s pairs; their tokens placed by the processor) followed by
    ``continuation`` (the weights rounded to bf16 with ``bf16_weights``), and the number
    of positions before the continuation."""
    processor, hf, model_type = _hf_model(str(model_dir), bf16_weights)
    if videos:
        enc = dict(processor(text=prompt, images=images or None,
                             videos=[frames for frames, _ in videos],
                             video_metadata=[{k: v for k, v in meta.items()
                                              if k != "do_sample_frames"}
                                             for _, meta in videos],
                             do_sample_frames=False, return_tensors="pt"))
        enc["pixel_values_videos"] = enc["pixel_values_videos"].double()
    elif images:
        enc = dict(processor(text=prompt, images=images, return_tensors="pt"))
    else:
        enc = dict(processor.tokenizer(prompt, return_tensors="pt"))
    n = enc["input_ids"].shape[1]
    tail = torch.tensor([continuation])
    ids = torch.cat((enc.pop("input_ids"), tail), dim=1)
    enc.pop("attention_mask", None)
    if "pixel_values" in enc:
        enc["pixel_values"] = enc["pixel_values"].double()
    if model_type == "qwen2_5_vl" and videos:
        enc["position_ids"] = _qwen_reference_positions(hf, ids, enc)
    if "mm_token_type_ids" in enc:  # Qwen's M-RoPE positions: text after the prompt
        enc["mm_token_type_ids"] = torch.cat(
            (enc["mm_token_type_ids"], torch.zeros_like(tail)), dim=1)
    with torch.no_grad():
        if model_type == "blip-2" and not images:  # BLIP-2's forward needs an image
            lm = hf.language_model
            logits = (lm if hasattr(lm, "lm_head") else hf)(input_ids=ids).logits[0]
        else:
            logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **enc).logits[0]
    return torch.log_softmax(logits.double(), -1), n
