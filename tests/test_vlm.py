"""Vision-language models through the plugin: a tiny BLIP-2 (BLIP vision tower, Q-Former,
OPT decoder) with its processor built locally, on the simulator (compiled) and the
virtual GCU. Image and text-only requests in one batch, the same image again (vLLM's
encoder cache, prefix caching), teacher-forced against HF float64 on the processor's
inputs; the vision tower's attention runs the plugin's ``varlen_attention``
(``AccelMMEncoderAttention``), not a silent SDPA."""

import pytest

from conftest import VIRTUAL_GCU_ENV, run_engine
from vlm_models import build_tiny_blip2, hf_logprobs, random_image

VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
CASES = {"sim-compiled": ({}, True), "virtual": (VIRTUAL, False)}
#: (prompt, image seed or None); the last repeats the first (encoder and prefix caches)
PROMPTS = [("Question: what is in the picture? Answer:", 1),
           ("Question: say something about France. Answer:", None),
           ("Question: which colour is it? Answer:", 2),
           ("Question: what is in the picture? Answer:", 1)]


@pytest.fixture(scope="module")
def blip2(tmp_path_factory, default_model):
    return build_tiny_blip2(tmp_path_factory.mktemp("vlm") / "blip2", default_model)


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_blip2_images_match_hf(case, blip2, tmp_path):
    env, compiled = CASES[case]
    spec = {"llm": {"model": str(blip2), "dtype": "float32", "enforce_eager": not compiled,
                    "max_model_len": 256, "max_num_seqs": 4, "enable_prefix_caching": True,
                    "seed": 0},
            "mm_prompts": [{"prompt": p, "images": [] if s is None else [s]}
                           for p, s in PROMPTS],
            "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
                         "logprobs": 1}}
    results, log = run_engine(spec, tmp_path, env=env)
    assert ("Warming up model for the compilation" in log) == (compiled and not env)
    if env:
        assert "device gcu via virtual" in log
    assert "Multimodal encoder attention: varlen_attention (torch_fast)" in log
    for (prompt, seed), out in zip(PROMPTS, results["mm_outputs"], strict=True):
        image = None if seed is None else random_image(seed)
        logp, n = hf_logprobs(blip2, prompt, image, out["token_ids"])
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logp[n - 1 + step]
            assert int(row.argmax()) == token, (prompt, seed, step)
            assert abs(top[str(token)] - float(row[token])) <= 2e-3, (prompt, seed, step)
    assert results["mm_outputs"][3]["token_ids"] == results["mm_outputs"][0]["token_ids"]


@pytest.mark.server
def test_chat_api_images_by_data_url_and_local_file(blip2, tmp_path):
    """``/v1/chat/completions`` with an ``image_url``: a base64 data URL and a local
    ``file://`` URL of the same image give the same answer, which the image changes;
    a broken image is a 400 and the server keeps serving."""
    import base64
    import io

    import httpx
    from openai import OpenAI

    from conftest import start_server, stop_server

    image = random_image(1)
    path = tmp_path / "image.png"
    image.save(path)
    data_url = "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()
    proc, url = start_server([str(blip2), "--device", "gcu", "--dtype", "float32",
                              "--max-model-len", "256", "--allowed-local-media-path",
                              str(tmp_path)], tmp_path / "server.log")
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
        assert ask([{"type": "image_url", "image_url": {"url": other_url}}, question]) != by_data
        bad = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                question]}]})
        assert 400 <= bad.status_code < 500, bad.text
        assert ask([{"type": "image_url", "image_url": {"url": data_url}}, question]) == by_data
    finally:
        stop_server(proc)
