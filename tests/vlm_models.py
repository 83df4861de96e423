"""Tiny random-weight vision-language checkpoints with their processors, built locally
(no hub): BLIP-2 (a BLIP vision tower, a Q-Former of 8 queries, an OPT decoder). The
tokenizer is the default model's with an ``<image>`` token added; the image processor is
transformers' PIL one. (vLLM 0.32's Qwen2-VL, LLaVA and InternVL modules import
torchvision, which does not load beside the CPU torch wheel: BLIP-2's do not.)
"""

from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH, QUERIES = 56, 14, 8


def build_tiny_blip2(path: Path, default_model: Path, seed: int = 0) -> Path:
    import transformers
    from transformers import AutoTokenizer
    from transformers.models.blip.image_processing_pil_blip import BlipImageProcessorPil

    tok = AutoTokenizer.from_pretrained(default_model)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
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
    head = model.get_output_embeddings()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.4 if p is head.weight else 0.08)
    model.save_pretrained(path, safe_serialization=True)
    transformers.Blip2Processor(
        image_processor=BlipImageProcessorPil(size={"height": IMAGE_SIZE,
                                                    "width": IMAGE_SIZE}),
        tokenizer=tok, num_query_tokens=QUERIES).save_pretrained(path)
    return path


def random_image(seed: int, size=(70, 90)):
    """A noise image (PIL) of ``size`` pixels (height, width), resized by the processor."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray((rng.random((*size, 3)) * 255).astype("uint8"))


def hf_logprobs(model_dir: Path, prompt: str, image, continuation: list[int]):
    """HF float64 log-probs ``[len, vocab]`` of ``prompt`` (with ``image``'s query
    tokens, as the processor places them) followed by ``continuation``, and the number
    of positions before the continuation."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_dir)
    hf = transformers.Blip2ForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float64, attn_implementation="eager")
    if image is None:
        ids = processor.tokenizer(prompt, return_tensors="pt")["input_ids"]
        kwargs = {}
    else:
        enc = processor(text=prompt, images=[image], return_tensors="pt")
        ids, kwargs = enc["input_ids"], {"pixel_values": enc["pixel_values"].double()}
    n = ids.shape[1]
    ids = torch.cat((ids, torch.tensor([continuation])), dim=1)
    with torch.no_grad():
        if image is None:
            logits = hf.language_model(input_ids=ids).logits[0] if hasattr(
                hf.language_model, "lm_head") else hf(input_ids=ids).logits[0]
        else:
            logits = hf(input_ids=ids, **kwargs).logits[0]
    return torch.log_softmax(logits.double(), -1), n
