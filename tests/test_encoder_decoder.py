"""Encoder-decoder models through the plugin: a tiny random-weight Whisper (its
processor built locally) compiled on the simulator and eager on the virtual GCU, vs HF
float64 teacher-forced on the processor's features.

Its audio encoder's attention runs the plugin's ``varlen_attention``
(``AccelWhisperEncoderAttention``); the decoder's cross-attention layers read each
request's encoder output from ACCEL_ATTN's paged cache, written on the request's first
step only. Two requests at a time with different lengths, so later requests prefill
beside others' decodes (vLLM's encoder-decoder scheduling: no chunked prefill, no
prefix caching); audio shorter and longer than the 2 s window; a decoder prompt with a
``<|prev|>`` text (vLLM puts ``<|startoftranscript|>`` before it); the first request again gives its tokens again."""

import pytest

from conftest import VIRTUAL_GCU_ENV, SharedEngines
from speech_models import (EOS, SAMPLE_RATE, TRANSCRIBE, audio_of, build_tiny_whisper,
                           decoder_prompt_ids, hf_tokenizer, hf_whisper_logprobs, random_audio)

CASES = {"sim-compiled": ({}, True),
         "virtual": ({**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}, False)}
#: (decoder prompt, audio [seed, samples at 16 kHz], new tokens)
REQUESTS = [(TRANSCRIBE, [1, 32000], 6),
            (TRANSCRIBE, [2, 12000], 12),
            ("<|prev|> the weather in Paris today" + TRANSCRIBE, [3, 40000], 8),
            (TRANSCRIBE, [1, 32000], 6)]


@pytest.fixture(scope="module")
def whisper_dir(tmp_path_factory, default_model):
    return build_tiny_whisper(tmp_path_factory.mktemp("whisper") / "whisper", default_model)


@pytest.fixture(scope="module")
def engines(whisper_dir, tmp_path_factory):
    spec = {"llm": {"model": str(whisper_dir), "dtype": "float32", "max_model_len": 448,
                    "max_num_seqs": 2, "seed": 0, "limit_mm_per_prompt": {"audio": 1}},
            "audio_prompts": [{"decoder_prompt": p, "audio": audio,
                               "sampling": {"max_tokens": n}} for p, audio, n in REQUESTS],
            "sampling": {"temperature": 0.0, "ignore_eos": True, "logprobs": 1}}
    return SharedEngines({case: ({**spec, "llm": {**spec["llm"], "enforce_eager": not compiled}},
                                 env) for case, (env, compiled) in CASES.items()},
                         tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("case", CASES)
def test_whisper_matches_hf(case, whisper_dir, engines):
    env, compiled = CASES[case]
    results, log = engines(case)
    assert ("Warming up model for the compilation" in log) == compiled
    if env:
        assert "device gcu via virtual" in log
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
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logp[n - 1 + step]
            assert int(row.argmax()) == token, (prompt, audio, step)
            assert abs(top[str(token)] - float(row[token])) <= 1e-4, (prompt, audio, step)
    assert outputs[3]["token_ids"] == outputs[0]["token_ids"]
    assert len({tuple(o["token_ids"][:6]) for o in outputs[:3]}) == 3  # the audio matters


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
