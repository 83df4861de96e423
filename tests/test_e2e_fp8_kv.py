"""Reduced-precision KV caches end to end on the default model: fp8
(`--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`, as stock vLLM CPU offers them)
and bf16/fp16 caches under an fp32 model; a clear startup error for a KV dtype
the backend cannot store. (The INT8 cache: test_e2e_int8_kv.py.)

Agreement is teacher-forced against the fp32 model with an fp32 cache: the
reference generates 32 tokens per chat prompt; the fp8-KV engine (same fp32
model, so only the cache differs) scores prompt + those tokens, and its
top-ranked token must be the reference's at the stated share of positions.
" Paris" must rank first after "The capital of France is".
"""

import pytest

from conftest import DEFAULT_MODEL_DEVICE_ENV, SharedEngines, run_engine
from test_e2e_int8_kv import NEW_TOKENS, QUESTIONS  # the same 8 chat prompts x 32 tokens
#: share of the 256 teacher-forced positions where the fp8-KV engine's top token
#: is the fp32 reference's. Measured (AMD EPYC Zen 5): 0.945 (fp8 = e4m3, 3
#: mantissa bits), 0.887 (e5m2, 2 bits), 0.996 (bfloat16), 1.000 (float16); an
#: unscaled-garbage cache scores ~0.
MIN_AGREEMENT = {"fp8": 0.9, "fp8_e5m2": 0.85, "bfloat16": 0.95, "float16": 0.97}


def _spec(default_model, prompts, **llm):
    return {"llm": {"model": str(default_model), "dtype": "float32", "max_model_len": 1024,
                    "seed": 0, **llm},
            "prompts": prompts, "sampling": {"temperature": 0.0, "ignore_eos": True}}


@pytest.fixture(scope="module")
def reference(default_model, tmp_path_factory):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in QUESTIONS]
    spec = _spec(default_model, prompts, enforce_eager=True)
    spec["sampling"]["max_tokens"] = NEW_TOKENS
    results, _ = run_engine(spec, tmp_path_factory.mktemp("fp32"), env=DEFAULT_MODEL_DEVICE_ENV)
    answer = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    paris = tok(" Paris", add_special_tokens=False)["input_ids"]
    assert len(paris) == 1 and paris[0] in answer
    return prompts, [o["token_ids"] for o in results["outputs"]], answer, paris[0]


#: (KV cache dtype, eager): "fp8" (= e4m3) in vLLM's default compiled mode; the others eager
CASES = [("fp8", False), ("fp8_e5m2", True), ("bfloat16", True), ("float16", True)]


@pytest.fixture(scope="module")
def scorers(default_model, reference, tmp_path_factory):
    """One engine per KV dtype, scoring the reference's tokens (prompt log-probs), one
    after another in one process."""
    prompts, generated, answer, _ = reference
    specs = {}
    for kv_cache_dtype, eager in CASES:
        spec = _spec(default_model, [p + g for p, g in zip(prompts, generated)]
                     + [prompts[0] + answer], kv_cache_dtype=kv_cache_dtype,
                     enforce_eager=eager)
        spec["sampling"].update(max_tokens=1, prompt_logprobs=1)
        specs[kv_cache_dtype] = (spec, DEFAULT_MODEL_DEVICE_ENV)
    return SharedEngines(specs, tmp_path_factory.mktemp("scorers"))


@pytest.mark.engine
@pytest.mark.parametrize("kv_cache_dtype,eager", CASES)
def test_kv_cache_dtype_predicts_the_fp32_tokens(kv_cache_dtype, eager, reference, scorers):
    prompts, generated, answer, paris = reference
    scored, log = scorers(kv_cache_dtype)
    assert ("Warming up model for the compilation" in log) == (not eager)
    if kv_cache_dtype.startswith("fp8"):
        assert "paged_prefill_fp8" in log  # the fp8 kernels ran
    agree = sum(top == token
                for out, p, g in zip(scored["outputs"], prompts, generated)
                for top, token in zip(out["prompt_top"][len(p):], g))
    share = agree / (NEW_TOKENS * len(QUESTIONS))
    print(f"{kv_cache_dtype}: teacher-forced agreement {share:.3f}")
    assert share >= MIN_AGREEMENT[kv_cache_dtype], share
    at = len(prompts[0]) + answer.index(paris)
    assert scored["outputs"][-1]["prompt_top"][at] == paris


@pytest.mark.engine
def test_a_kv_dtype_the_backend_cannot_store_fails_at_startup(default_model, tmp_path):
    with pytest.raises(AssertionError) as failed:  # run_engine asserts a clean exit
        run_engine(_spec(default_model, [[1, 2, 3]], kv_cache_dtype="fp8_inc",
                         enforce_eager=True), tmp_path)
    message = str(failed.value)
    assert "--kv-cache-dtype fp8_inc is not supported by vllm_accel's ACCEL_ATTN" in message
    assert "fp8_e5m2" in message and "int8_per_token_head" in message
