"""Vision-language models through the plugin, tiny random-weight checkpoints with their
processors built locally (``vlm_models``): BLIP-2 (Q-Former), Qwen2-VL (M-RoPE, dynamic
resolution), Qwen2.5-VL (windowed vision tower), Qwen3-VL and Qwen3-VL-MoE (DeepStack,
interleaved M-RoPE), GLM-4.1V and GLM-4.5V (its MoE decoder), Gemma 3 (SigLIP; image
tokens attend to each other both ways), Gemma 4 (its own tower; both ways on the
windowed layers only), LLaVA (CLIP tower), LLaVA-Next (anyres tiles), LLaVA-OneVision
(SigLIP, anyres), InternVL (InternViT, pixel shuffle, tiles), Mistral 3 (Pixtral tower,
image breaks), SmolVLM (tiles behind row/column markers), PaddleOCR-VL (NaViT-style
SigLIP, an ERNIE decoder with M-RoPE) and MiniCPM-V 4.6 (a window merger inside its
tower, a Qwen3.5 decoder with Gated DeltaNet layers, bf16 on the simulator as vLLM's
CPU kernel runs them).

Each on the virtual GCU and (but BLIP-2, for suite time: ``SIM_CASE``) on the
simulator: compiled
where the language model differs (Qwen2-VL's and Qwen3-VL's M-RoPE, Gemma 3's and Gemma
4's two-way image ranges, PaddleOCR-VL's ERNIE M-RoPE), eager for the others (their
decoders compiled in other tests or cases; vision towers run eagerly either way).

Image and text-only requests in one batch, two images of different sizes in one
request, the same image again (vLLM's encoder cache, prefix caching), a video beside an
image (the Qwen families, GLM-4.1V and LLaVA-OneVision: temporal patches, Qwen2.5-VL's
time-scaled positions, Qwen3-VL's and GLM-4.1V's timestamps), teacher-forced against HF
float64 on the processor's inputs (Qwen2.5-VL with a video: on Qwen's own M-RoPE
positions, ``vlm_models._qwen_reference_positions``; PaddleOCR-VL's position grid
resampled as vLLM does, see ``vlm_models._hf_model``); the vision tower's attention runs
the plugin's ``varlen_attention`` (``AccelMMEncoderAttention``), not a silent SDPA,
except in the towers vLLM takes from transformers (``HF_TOWERS``)."""

import functools

import pytest

from conftest import VIRTUAL_GCU_ENV, SharedEngines
from vlm_models import (PLACEHOLDERS, VIDEO_PLACEHOLDERS, build_tiny_blip2, build_tiny_gemma3,
                        build_tiny_gemma4, build_tiny_glm4v, build_tiny_internvl,
                        build_tiny_llava, build_tiny_llava_onevision, build_tiny_minicpmv,
                        build_tiny_mistral3, build_tiny_paddleocr_vl, build_tiny_qwen_vl,
                        build_tiny_smolvlm, hf_logprobs, image_of, random_image, video_of)

VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: case: (path env, compiled, dtype)
CASES = {"sim-compiled": ({}, True, "float32"), "sim-eager": ({}, False, "float32"),
         "virtual": (VIRTUAL, False, "float32"),
         # (MiniCPM-V 4.6's Qwen3.5 decoder: vLLM's CPU Gated DeltaNet kernel is bf16 only)
         "sim-eager-bf16": ({}, False, "bfloat16")}
#: how far a bf16 engine's tokens may sit from the top of HF's (float64 math on the same
#: bf16-rounded weights) and its log-probs from HF's: bf16 activations through a Gated
#: DeltaNet layer, a tower and 4 image tokens per slice (MiniCPM-V 4.6: measured up to
#: 0.17 on an Intel Xeon, every token but one HF's top)
BF16_NATS = 0.25
BUILDERS = {"blip2": build_tiny_blip2, "llava": build_tiny_llava,
            "llava_next": functools.partial(build_tiny_llava, family="llava_next"),
            "internvl": build_tiny_internvl,
            "qwen2_vl": functools.partial(build_tiny_qwen_vl, family="qwen2_vl"),
            "qwen2_5_vl": functools.partial(build_tiny_qwen_vl, family="qwen2_5_vl"),
            "qwen3_vl": functools.partial(build_tiny_qwen_vl, family="qwen3_vl"),
            "qwen3_vl_moe": functools.partial(build_tiny_qwen_vl, family="qwen3_vl_moe"),
            "glm4v": build_tiny_glm4v, "gemma3": build_tiny_gemma3, "gemma4": build_tiny_gemma4,
            "mistral3": build_tiny_mistral3, "smolvlm": build_tiny_smolvlm,
            "glm4v_moe": functools.partial(build_tiny_glm4v, family="glm4v_moe"),
            "llava_onevision": build_tiny_llava_onevision,
            "paddleocr_vl": build_tiny_paddleocr_vl, "minicpmv4_6": build_tiny_minicpmv}


#: families given a video prompt too (frames with vLLM's loader metadata, 2 fps)
VIDEO_FAMILIES = set(VIDEO_PLACEHOLDERS)


def prompts(family: str) -> list[tuple[str, list, list]]:
    """(prompt, images as ``image_of`` entries, videos as ``video_of`` entries); the
    fourth repeats the first (encoder and prefix caches). BLIP-2 takes one image per
    prompt; the others get two of different sizes (Qwen's token count follows the
    size); the families that take videos also a 6-frame video (beside an image, but for
    GLM-4.1V)."""
    image = PLACEHOLDERS[family]
    two = ([f"{image}{image}Question: which one is brighter? Answer:", [2, [3, 140, 200]]]
           if family != "blip2" else ["Question: which colour is it? Answer:", [2]])
    cases = [(f"{image}Question: what is in the picture? Answer:", [1], []),
             ("Question: say something about France. Answer:", [], []),
             (*two, []),
             (f"{image}Question: what is in the picture? Answer:", [1], [])]
    if family in VIDEO_FAMILIES:
        # (GLM-4.1V's video alone: HF's model counts a video's frames as image tokens in
        # a prompt with both and refuses it)
        beside = [] if family == "glm4v" else [5]
        cases.append((f"{VIDEO_PLACEHOLDERS[family]}{image * len(beside)}Question: what "
                      "changes between the frames? Answer:", beside, [[1, 6, 84, 56]]))
    return cases


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, default_model):
    built = {}

    def get(family: str):
        if family not in built:
            built[family] = BUILDERS[family](tmp_path_factory.mktemp(family) / family,
                                             default_model)
        return built[family]
    return get


#: family: its simulator case (None: BLIP-2, whose Q-Former is the only part the others
#: do not cover, on the virtual GCU alone; suite time)
SIM_CASE = {"blip2": None, "llava": "sim-eager", "llava_next": "sim-eager",
            "internvl": "sim-eager", "qwen2_vl": "sim-compiled", "qwen2_5_vl": "sim-eager",
            "qwen3_vl": "sim-compiled", "qwen3_vl_moe": "sim-eager",
            "glm4v": "sim-eager", "gemma3": "sim-compiled", "gemma4": "sim-compiled",
            "mistral3": "sim-eager", "smolvlm": "sim-eager", "glm4v_moe": "sim-eager",
            "llava_onevision": "sim-eager", "paddleocr_vl": "sim-compiled",
            "minicpmv4_6": "sim-eager-bf16"}
#: families whose vision tower vLLM 0.32 builds from transformers' own module (Gemma 4:
#: ``AutoModel.from_config``): its attention is transformers' SDPA on the device, not
#: vLLM's encoder attention layer, so not the plugin's ``varlen_attention``
HF_TOWERS = {"gemma4"}
#: (family, path) pairs: every family on the virtual GCU and its simulator case
PAIRS = [(f, c) for f in BUILDERS for c in (SIM_CASE[f], "virtual") if c]


def _spec(model_dir, family: str, case: str) -> dict:
    _, compiled, dtype = CASES[case]
    return {"llm": {"model": str(model_dir), "dtype": dtype,
                    "enforce_eager": not compiled, "max_model_len": 512, "max_num_seqs": 4,
                    "enable_prefix_caching": True, "seed": 0,
                    "limit_mm_per_prompt": {"image": 2 if family != "blip2" else 1}
                    | ({"video": 1} if family in VIDEO_FAMILIES else {})},
            "mm_prompts": [{"prompt": p, "images": images, "videos": videos}
                           for p, images, videos in prompts(family)],
            "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
                         "logprobs": 1}}


@pytest.fixture(scope="module")
def engines(vlm_dir, tmp_path_factory):
    """Every pair's engine: the simulator's one after another in one process, the
    virtual GCU's in another, when a test first needs one."""
    return SharedEngines({f"{family}-{case}": (_spec(vlm_dir(family), family, case),
                                               CASES[case][0]) for family, case in PAIRS},
                         tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("family,case", PAIRS, ids=[f"{f}-{c}" for f, c in PAIRS])
def test_images_match_hf(family, case, vlm_dir, engines):
    env, compiled, dtype = CASES[case]
    bf16 = dtype == "bfloat16"
    model_dir = vlm_dir(family)
    cases = prompts(family)
    results, log = engines(f"{family}-{case}")
    assert ("Warming up model for the compilation" in log) == (compiled and not env)
    if env:
        assert "device gcu via virtual" in log
    assert ("Multimodal encoder attention: varlen_attention (torch_fast)" in log) == (
        family not in HF_TOWERS)
    for (prompt, images, videos), out in zip(cases, results["mm_outputs"], strict=True):
        logp, n = hf_logprobs(model_dir, prompt, [image_of(i) for i in images],
                              out["token_ids"], videos=[video_of(v) for v in videos],
                              bf16_weights=bf16)
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logp[n - 1 + step]
            if bf16:
                assert float(row.max() - row[token]) <= BF16_NATS, (prompt, images, step)
                assert abs(top[str(token)] - float(row[token])) <= BF16_NATS, (
                    prompt, images, step)
                continue
            assert int(row.argmax()) == token, (prompt, images, step)
            assert abs(top[str(token)] - float(row[token])) <= 2e-3, (prompt, images, step)
    assert results["mm_outputs"][3]["token_ids"] == results["mm_outputs"][0]["token_ids"]


@pytest.mark.server
def test_chat_api_images_by_data_url_and_local_file(vlm_dir, tmp_path):
    """``/v1/chat/completions`` to a Qwen2-VL server with ``image_url`` parts: a base64
    data URL and a local ``file://`` URL of the same image give the same answer, which
    another image, or a second image in the same message, changes; a broken image is
    a 400 and the server keeps serving. Eager: the API's image handling is under test
    here, and ``qwen2_vl-sim-compiled`` above runs the model compiled."""
    import base64
    import io

    import httpx
    from openai import OpenAI

    from conftest import start_server, stop_server

    image = random_image(1)
    path = tmp_path / "image.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    proc, url = start_server([str(vlm_dir("qwen2_vl")), "--device", "gcu", "--dtype",
                              "float32", "--enforce-eager", "--max-model-len", "512",
                              "--allowed-local-media-path",
                              str(tmp_path), "--limit-mm-per-prompt", '{"image": 2}'],
                             tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model = client.models.list().data[0].id

        def ask(content):
            """The answer's tokens and their log-probs (a random model's text barely
            changes with the image; its log-probs do)."""
            out = client.chat.completions.create(
                model=model, temperature=0, max_tokens=8, logprobs=True,
                messages=[{"role": "user", "content": content}])
            return [(t.token, round(t.logprob, 4)) for t in out.choices[0].logprobs.content]

        question = {"type": "text", "text": "What is in the picture?"}
        by_data = ask([{"type": "image_url", "image_url": {"url": data_url}}, question])
        by_file = ask([{"type": "image_url", "image_url": {"url": f"file://{path}"}},
                       question])
        assert by_data == by_file
        other = io.BytesIO()
        random_image(7).save(other, format="PNG")
        other_url = "data:image/png;base64," + base64.b64encode(other.getvalue()).decode()
        other_part = {"type": "image_url", "image_url": {"url": other_url}}
        assert ask([other_part, question]) != by_data
        both = ask([{"type": "image_url", "image_url": {"url": data_url}}, other_part, question])
        assert both not in (by_data, ask([other_part, question]))
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                question]}]})
        assert 400 <= bad.status_code < 500, bad.text
        assert ask([{"type": "image_url", "image_url": {"url": data_url}}, question]) == by_data
    finally:
        stop_server(proc)
