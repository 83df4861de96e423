"""Speech models through the plugin, tiny random-weight checkpoints with their
processors built locally, on the simulator and the virtual GCU, vs HF
float64 teacher-forced on the processor's features.

Whisper (encoder-decoder): its audio encoder's attention runs the plugin's
``varlen_attention`` (``AccelWhisperEncoderAttention``); the decoder's cross-attention
layers read each request's encoder output from ACCEL_ATTN's paged cache, written on the
request's first step only. Two requests at a time with different lengths, so later
requests prefill beside others' decodes (vLLM's encoder-decoder scheduling: no chunked
prefill, no prefix caching); audio shorter and longer than the 2 s window; a decoder
prompt with a ``<|prev|>`` text (vLLM puts ``<|startoftranscript|>`` before it); the
first request again gives its tokens again. And the OpenAI transcription API on WAV
uploads (``soundfile`` decodes them, PyAV resamples: the plugin's ``audio`` extra).

Qwen2-Audio (audio in, text out): an audio request, two recordings of different lengths
in one request, a text-only request in the same batch, the first again (the same
tokens). Its audio tower is transformers' module (vLLM 0.32 builds it so), its
attention torch's on the device, not the plugin's ``varlen_attention``.

Qwen2.5-Omni and Qwen3-Omni (their thinkers: audio and images in, text out): a
recording and an image in one request, audio alone, two images of different sizes,
text alone, the first again (and for Qwen2.5-Omni a video). Qwen2.5-Omni's audio
tower is transformers' as Qwen2-Audio's; Qwen3-Omni's is vLLM's own, its
``MMEncoderAttention`` the plugin's ``varlen_attention`` as both vision towers' is
(Qwen2.5-VL's and Qwen3-VL's)."""

import pytest

from conftest import VIRTUAL_GCU_ENV, SharedEngines
from speech_models import (EOS, OMNI_AUDIO, OMNI_CLASSES, OMNI_IMAGE, OMNI_VIDEO,
                           QWEN2_AUDIO, SAMPLE_RATE, TRANSCRIBE, audio_of, build_tiny_qwen2_audio,
                           build_tiny_qwen_omni, build_tiny_whisper, decoder_prompt_ids,
                           hf_qwen2_audio_logprobs, hf_qwen_omni_logprobs, hf_tokenizer,
                           hf_whisper_logprobs, random_audio)
from vlm_models import image_of, video_of

SIM = {}
CASES = {"sim-compiled": (SIM, True),
         "virtual": ({**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}, False)}
#: each model's cases: compiled on the simulator, eager on the card
MODEL_CASES = {"whisper": ("sim-compiled", "virtual"), "qwen2_audio": ("sim-compiled", "virtual"),
               "qwen2_5_omni": ("sim-compiled", "virtual"),
               "qwen3_omni_moe": ("sim-compiled", "virtual")}
#: (decoder prompt, audio [seed, samples at 16 kHz], new tokens)
REQUESTS = [(TRANSCRIBE, [1, 32000], 6),
            (TRANSCRIBE, [2, 12000], 12),
            ("<|prev|> the weather in Paris today" + TRANSCRIBE, [3, 40000], 8),
            (TRANSCRIBE, [1, 32000], 6)]
#: Qwen2-Audio's (prompt, audios as [seed, samples]); the last repeats the first
AUDIO_PROMPTS = [(f"{QWEN2_AUDIO}Question: what is said? Answer:", [[1, 32000]]),
                 (f"{QWEN2_AUDIO}{QWEN2_AUDIO}Question: which one is louder? Answer:",
                  [[2, 12000], [3, 48000]]),
                 ("Question: say something about France. Answer:", []),
                 (f"{QWEN2_AUDIO}Question: what is said? Answer:", [[1, 32000]])]


def omni_prompts(family: str) -> list:
    """An Omni family's (prompt, images as [seed, height, width], audios as [seed,
    samples], videos as [seed, frames, height, width]); the fifth repeats the first;
    Qwen2.5-Omni also a 6-frame video (Qwen3-Omni's video and either's
    ``use_audio_in_video``: vLLM 0.32 and transformers 5.19 disagree from the first
    token, stock vLLM CPU the same; not covered). Qwen3-Omni's recordings are whole seconds:
    its audio tower (vLLM's and HF's alike) pads a shorter last 1 s chunk to the
    longest chunk of the batch and its strided convolutions read that padding's
    activations, so such a chunk's last token depends on the recordings encoded beside
    it (0.12 nats on the tiny model beside a 2 s recording, stock vLLM CPU the same;
    alone it matches HF to 1e-5)."""
    short = 16000 if family == "qwen3_omni_moe" else 12000
    both = (f"{OMNI_AUDIO}{OMNI_IMAGE}Question: what is said and shown? Answer:",
            [[3, 70, 90]], [[1, 32000]], [])
    video = [(f"{OMNI_VIDEO}Question: what happens? Answer:", [], [], [[1, 6, 56, 84]])]
    return [both,
            (f"{OMNI_AUDIO}Question: what is said? Answer:", [], [[2, short]], []),
            (f"{OMNI_IMAGE}{OMNI_IMAGE}Question: which is brighter? Answer:",
             [[4, 56, 56], [5, 120, 80]], [], []),
            ("Question: say something about France. Answer:", [], [], []),
            both] + (video if family == "qwen2_5_omni" else [])


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory, default_model):
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "whisper", default_model)


@pytest.fixture(scope="module")
def qwen2_audio_dir(tmp_path_factory, default_model):
    return build_tiny_qwen2_audio(tmp_path_factory.mktemp("qwen2_audio") / "qwen2_audio",
                                  default_model)


@pytest.fixture(scope="module")
def omni_dirs(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("omni")
    return {family: build_tiny_qwen_omni(root / family, default_model, family)
            for family in OMNI_CLASSES}


@pytest.fixture(scope="module")
def engines(whisper_dir, qwen2_audio_dir, omni_dirs, tmp_path_factory):
    """Both models' engines on each path: the simulator's in one process, the virtual
    GCU's in another."""
    sampling = {"temperature": 0.0, "ignore_eos": True, "logprobs": 1}
    whisper = {"llm": {"model": str(whisper_dir), "dtype": "float32", "max_model_len": 448,
                       "max_num_seqs": 2, "seed": 0, "limit_mm_per_prompt": {"audio": 1}},
               "audio_prompts": [{"decoder_prompt": p, "audio": audio,
                                  "sampling": {"max_tokens": n}} for p, audio, n in REQUESTS],
               "sampling": sampling}
    qwen2_audio = {"llm": {"model": str(qwen2_audio_dir), "dtype": "float32",
                           "max_model_len": 512, "max_num_seqs": 4, "seed": 0,
                           "enable_prefix_caching": True, "limit_mm_per_prompt": {"audio": 2}},
                   "mm_prompts": [{"prompt": p, "images": [], "audios": audios}
                                  for p, audios in AUDIO_PROMPTS],
                   "sampling": {**sampling, "max_tokens": 8}}
    omni = {family: {"llm": {"model": str(omni_dirs[family]), "dtype": "float32",
                             "max_model_len": 1024, "max_num_seqs": 5, "seed": 0,
                             "enable_prefix_caching": True,
                             "limit_mm_per_prompt": {"audio": 1, "image": 2, "video": 1}},
                     "mm_prompts": [{"prompt": p, "images": images, "audios": audios,
                                     "videos": videos}
                                    for p, images, audios, videos in omni_prompts(family)],
                     "sampling": {**sampling, "max_tokens": 8}} for family in OMNI_CLASSES}
    return SharedEngines({f"{name}-{case}": ({**spec, "llm": {**spec["llm"],
                                                              "enforce_eager": not compiled}},
                                             env)
                          for name, spec in (("whisper", whisper), ("qwen2_audio", qwen2_audio),
                                             *omni.items())
                          for case in MODEL_CASES[name]
                          for env, compiled in [CASES[case]]},
                         tmp_path_factory.mktemp("engines"))


def _assert_tokens_hf_top(out: dict, logp, n: int, request) -> None:
    """Each generated token HF's top-1 after the ``n`` prompt positions, its log-prob
    within 1e-4 nats of HF's (float32 against float64; measured within 2e-5)."""
    for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"], strict=True)):
        row = logp[n - 1 + step]
        assert int(row.argmax()) == token, (request, step)
        assert abs(top[str(token)] - float(row[token])) <= 1e-4, (request, step)


def _ran(engines, model: str, case: str) -> tuple[dict, str]:
    """(results, log) of ``model``'s engine on ``case``'s path, in that path's mode."""
    env, compiled = CASES[case]
    results, log = engines(f"{model}-{case}")
    assert ("Warming up model for the compilation" in log) == compiled
    if env:
        assert "device gcu via virtual" in log
    return results, log


@pytest.mark.engine
@pytest.mark.parametrize("case", MODEL_CASES["whisper"])
def test_whisper_matches_hf(case, whisper_dir, engines):
    results, log = _ran(engines, "whisper", case)
    assert "ACCEL_ATTN: encoder-decoder attention" in log
    assert "Multimodal encoder attention: varlen_attention (torch_fast)" in log
    outputs = results["audio_outputs"]
    for (prompt, audio, new_tokens), out in zip(REQUESTS, outputs, strict=True):
        assert len(out["token_ids"]) == new_tokens
        prompt_ids = decoder_prompt_ids(whisper_dir, prompt)
        assert out["prompt_token_ids"] == prompt_ids
        n = len(prompt_ids)
        logp = hf_whisper_logprobs(whisper_dir, audio_of(audio)[0],
                                   prompt_ids + out["token_ids"])
        _assert_tokens_hf_top(out, logp, n, (prompt, audio))
    assert outputs[3]["token_ids"] == outputs[0]["token_ids"]
    assert len({tuple(o["token_ids"][:6]) for o in outputs[:3]}) == 3  # the audio matters


@pytest.mark.engine
@pytest.mark.parametrize("case", MODEL_CASES["qwen2_audio"])
def test_qwen2_audio_matches_hf(case, qwen2_audio_dir, engines):
    results, log = _ran(engines, "qwen2_audio", case)
    outputs = results["mm_outputs"]
    for (prompt, audios), out in zip(AUDIO_PROMPTS, outputs, strict=True):
        logp, n = hf_qwen2_audio_logprobs(qwen2_audio_dir, prompt,
                                          [audio_of(a)[0] for a in audios], out["token_ids"])
        _assert_tokens_hf_top(out, logp, n, (prompt, audios))
    assert outputs[3]["token_ids"] == outputs[0]["token_ids"]
    assert outputs[0]["token_ids"] != outputs[1]["token_ids"]  # the audio matters


@pytest.mark.engine
@pytest.mark.parametrize("case", [f"{family}-{case}" for family in OMNI_CLASSES
                                  for case in MODEL_CASES[family]])
def test_omni_thinker_matches_hf(case, omni_dirs, engines):
    family, path = case.split("-", 1)
    results, log = _ran(engines, family, path)
    assert "Multimodal encoder attention: varlen_attention" in log
    if family == "qwen3_omni_moe":
        assert "MoE layers: vllm_accel AccelFusedMoEMethod" in log
    outputs = results["mm_outputs"]
    for (prompt, images, audios, videos), out in zip(omni_prompts(family), outputs,
                                                     strict=True):
        logp, n = hf_qwen_omni_logprobs(omni_dirs[family], prompt,
                                        [image_of(i) for i in images],
                                        [audio_of(a)[0] for a in audios], out["token_ids"],
                                        videos=[video_of(v) for v in videos])
        assert len(out["prompt_token_ids"]) == n and len(out["token_ids"]) == 8
        _assert_tokens_hf_top(out, logp, n, (prompt, images, audios, videos))
    assert outputs[4]["token_ids"] == outputs[0]["token_ids"]
    distinct = [o["token_ids"] for i, o in enumerate(outputs) if i != 4]
    assert len(set(map(tuple, distinct))) == len(distinct)  # the media matter


def _wav(audio, rate: int = SAMPLE_RATE) -> tuple[bytes, object]:
    """16-bit PCM WAV bytes of ``audio`` at ``rate`` and the samples a decoder reads
    back from them."""
    import io
    import wave

    import numpy as np

    pcm = np.round(np.clip(audio, -1, 1) * 32767).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return buf.getvalue(), pcm.astype(np.float32) / 32768


@pytest.mark.server
def test_transcriptions_api(whisper_dir, tmp_path):
    """``/v1/audio/transcriptions`` (OpenAI's audio API) of a WAV upload to a Whisper
    server: the text of HF float64's greedy transcription of the decoded samples, up to
    ``--max-model-len``; another recording (22.05 kHz, resampled) gives another text; a file that is no audio
    is a 400 and the server keeps serving. Eager: the API is under test here, and
    ``test_whisper_matches_hf[sim-compiled]`` runs the model compiled."""
    import httpx
    from conftest import start_server, stop_server

    max_len = 24
    proc, url = start_server([str(whisper_dir), "--device", "gcu", "--dtype", "float32",
                              "--enforce-eager", "--max-model-len", str(max_len)],
                             tmp_path / "server.log")
    try:
        def transcribe(data: bytes) -> httpx.Response:
            return httpx.post(f"{url}/v1/audio/transcriptions", timeout=120,
                              files={"file": ("speech.wav", data, "audio/wav")},
                              data={"model": str(whisper_dir), "language": "en",
                                    "temperature": "0"})

        first, samples = _wav(random_audio(1, 32000))
        answer = transcribe(first)
        assert answer.status_code == 200, answer.text
        prompt = decoder_prompt_ids(whisper_dir, TRANSCRIBE)
        ids = list(prompt)
        while len(ids) < max_len:  # HF float64 greedy to EOS or the model length
            ids.append(int(hf_whisper_logprobs(whisper_dir, samples, ids)[-1].argmax()))
            if ids[-1] == EOS:
                break
        expected = hf_tokenizer(whisper_dir).decode(ids[len(prompt):], skip_special_tokens=True)
        assert answer.json()["text"] == expected
        other = transcribe(_wav(random_audio(4, 33000), rate=22050)[0])  # PyAV resamples
        assert other.status_code == 200 and other.json()["text"] != expected
        bad = transcribe(b"not a recording")
        assert bad.status_code == 400 and "audio" in bad.text.lower(), bad.text
        assert transcribe(first).json()["text"] == expected
    finally:
        stop_server(proc)
