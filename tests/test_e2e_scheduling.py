"""Chunked prefill and prefix caching on the default model: exact same greedy
tokens as a run without them (fp32), with the prefix cache really hit, on the
simulated GCU and through the card path on the virtual GCU."""

import random

import pytest

from conftest import DEFAULT_MODEL_DEVICE_ENV, SharedEngines

NEW_TOKENS = 24


CITIES = [("Paris", "France"), ("Rome", "Italy"), ("Madrid", "Spain"), ("Berlin", "Germany"),
          ("Lisbon", "Portugal"), ("Vienna", "Austria"), ("Athens", "Greece"),
          ("Warsaw", "Poland"), ("Dublin", "Ireland"), ("Prague", "Czechia")]


def _text(tok, rng: random.Random, n_tokens: int) -> list[int]:
    """Natural-language prompt of exactly ``n_tokens`` tokens (peaked next-token
    distributions: random token ids make near-ties that fp32 rounding can flip)."""
    sentences = []
    while len(tok("".join(sentences))["input_ids"]) < n_tokens:
        city, country = rng.choice(CITIES)
        sentences.append(f"{city} is the capital of {country}, and {rng.randint(2, 90)} "
                         f"museums there tell the story of its people. ")
    return tok("".join(sentences))["input_ids"][:n_tokens]


@pytest.fixture(scope="module")
def workload(default_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    rng = random.Random(3)
    system = _text(tok, rng, 700)  # shared "system prompt"
    long_prompt = _text(tok, rng, 1100)
    shorts = [_text(tok, rng, n) for n in (5, 40, 90)]
    shared = [system + _text(tok, rng, n) for n in (10, 30, 65)]
    # Batch 1 primes the prefix cache; batch 2 must then hit it.
    return {"prompts": [long_prompt, *shorts], "prompt_batches": [shared[:1], shared[1:]]}


#: engine settings of each run (the simulator's unless "virtual")
RUNS = {
    "baseline": dict(enable_chunked_prefill=False, max_num_batched_tokens=2048,
                     enable_prefix_caching=False),
    # 64-token budget: the 1100-token prompt takes many steps while the short
    # requests decode in the same steps.
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
                    enable_prefix_caching=False),
    "cached": dict(enable_prefix_caching=True),
    "virtual": dict(enable_chunked_prefill=True, max_num_batched_tokens=64,
                    enable_prefix_caching=True),
}
VIRTUAL = {"ACCEL_BACKEND": "virtual", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


@pytest.fixture(scope="module")
def engines(default_model, tmp_path_factory, workload):
    """The simulator's three engines in one process, the virtual GCU's in another."""
    def spec(llm):
        return {"llm": {"model": str(default_model), "dtype": "float32", "enforce_eager": True,
                        "max_model_len": 2048, "seed": 0, "disable_log_stats": False, **llm},
                "sampling": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True},
                **workload}
    return SharedEngines({name: (spec(llm), {**DEFAULT_MODEL_DEVICE_ENV,
                                             **(VIRTUAL if name == "virtual" else {})})
                          for name, llm in RUNS.items()}, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def baseline(engines):
    return engines("baseline")[0]


@pytest.mark.engine
def test_chunked_prefill_matches_unchunked(engines, baseline):
    chunked = engines("chunked")[0]
    assert chunked["outputs"] == baseline["outputs"]
    assert chunked["batches"] == baseline["batches"]


@pytest.mark.engine
def test_prefix_caching_matches_and_hits(engines, baseline):
    cached = engines("cached")[0]
    assert cached["outputs"] == baseline["outputs"]
    assert cached["batches"] == baseline["batches"]
    _assert_hits(cached)
    assert baseline["prefix_cache"].get("vllm:prefix_cache_hits", 0) == 0


def _assert_hits(results):
    hits = results["prefix_cache"]["vllm:prefix_cache_hits"]
    queries = results["prefix_cache"]["vllm:prefix_cache_queries"]
    # Two requests reuse at least the 640 tokens of whole 64-token system blocks.
    assert hits >= 2 * 640 and queries > hits


@pytest.mark.engine
def test_chunked_prefill_and_prefix_caching_on_the_virtual_gcu(engines, baseline):
    """Both at once through the card path (GPU model runner, our attention on gcu
    tensors): the simulator's unchunked, uncached tokens, and real cache hits."""
    both = engines("virtual")[0]
    assert both["outputs"] == baseline["outputs"]
    assert both["batches"] == baseline["batches"]
    _assert_hits(both)
