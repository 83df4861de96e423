"""Speculative decoding through the plugin: n-gram prompt lookup and a draft model, on
the simulator (compiled and eager) and the virtual GCU. Greedy tokens with speculation
are plain greedy decoding's: each is HF float64's top-1 given the tokens before it (the
plugin's plain greedy is held to the same oracle throughout the suite), and the drafts
were really proposed and accepted (vLLM's spec-decode counters)."""

import random
import shutil

import pytest

from conftest import VIRTUAL_GCU_ENV, build_tiny_model, run_engine
from moe_models import assert_matches_hf

VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    target = build_tiny_model(root / "target", num_heads=4, num_kv_heads=2, head_dim=32,
                              layers=2, head_std=0.4, seed=5)
    # the draft: a copy of the target (its own engine, KV cache and proposer), so every
    # draft is accepted and a wrong draft path shows as a rejected or wrong token
    draft = root / "draft"
    shutil.copytree(target, draft)
    return target, draft


def _prompts(seed):
    """Repetitive prompts (a phrase several times), where prompt lookup finds drafts."""
    rng = random.Random(seed)
    out = []
    for n in (6, 9, 4):
        phrase = [rng.randrange(3, 512) for _ in range(n)]
        out.append(phrase * 4)
    return out


#: name: (speculative config (the draft model's path filled in), env, compiled)
CASES = {
    "ngram-sim-compiled": ({"method": "ngram", "num_speculative_tokens": 3,
                            "prompt_lookup_max": 4, "prompt_lookup_min": 2}, {}, True),
    "draft-sim-eager": ({"method": "draft_model", "num_speculative_tokens": 2}, {}, False),
    "ngram-virtual": ({"method": "ngram", "num_speculative_tokens": 3,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2}, VIRTUAL, False),
    "draft-virtual": ({"method": "draft_model", "num_speculative_tokens": 2}, VIRTUAL, False),
}


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_greedy_is_plain_greedy(case, models, tmp_path):
    speculative, env, compiled = CASES[case]
    target, draft = models
    if speculative["method"] == "draft_model":
        speculative = {**speculative, "model": str(draft)}
    prompts = _prompts(case)
    spec = {"llm": {"model": str(target), "dtype": "float32", "enforce_eager": not compiled,
                    "skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 4,
                    "speculative_config": speculative, "disable_log_stats": False,
                    "seed": 0},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                         "detokenize": False, "logprobs": 1}}
    results, log = run_engine(spec, tmp_path, env=env)
    assert ("Warming up model for the compilation" in log) == (compiled and not env)
    if env:
        assert "device gcu via virtual" in log
    counters = results["spec_decode"]
    drafted = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafted > 0, counters  # (the repeated phrases give prompt lookup its n-grams)
    if speculative["method"] == "draft_model":  # the target's copy drafts its tokens
        assert accepted == drafted, counters
    assert_matches_hf(target, prompts, results["outputs"])
