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
