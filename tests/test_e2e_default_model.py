"""The default model (SmolLM2-135M-Instruct) offline through `LLM(...)` on the
simulated GCU and on the virtual GCU (the card path): fp32 greedy tokens must
equal HF transformers `generate`."""

import re

import pytest

from conftest import VIRTUAL_GCU_ENV, hf_greedy, run_engine

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
    "Explain photosynthesis in one sentence.",
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def workload(default_model):
    """(tokenizer, 8 prompts, HF's greedy continuations)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    chat_ids = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                tokenize=True, return_dict=False)
        for q in CHAT_QUESTIONS
    ]
    prompts = [tok(p)["input_ids"] for p in RAW_PROMPTS] + [list(ids) for ids in chat_ids]
    return tok, prompts, hf_greedy(default_model, prompts, NEW_TOKENS)


def _assert_matches_hf(results, workload):
    tok, prompts, expected = workload
    got = [o["token_ids"] for o in results["outputs"]]
    for prompt, g, e in zip(prompts, got, expected):
        assert g == e, f"prompt {tok.decode(prompt)!r}: vLLM {tok.decode(g)!r} vs HF {tok.decode(e)!r}"
    assert "Paris" in results["chat"][0]


def _spec(default_model, prompts, **llm):
    return {
        "llm": {"model": str(default_model), "dtype": "float32", "max_model_len": 1024,
                "seed": 0, **llm},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True},
        "chat": [[{"role": "user", "content": "What is the capital of France?"}]],
    }


@pytest.mark.engine
def test_default_model_matches_hf_and_answers_paris(default_model, workload, tmp_path):
    results, log = run_engine(_spec(default_model, workload[1], enforce_eager=True), tmp_path,
                              env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})  # vLLM's default engine

    assert results["platform"] == "AccelPlatform"
    assert "(EngineCore pid=" in log  # a separate EngineCore process, as users run it
    assert ("worker vllm_accel.worker.sim_worker.AccelSimWorker, model runner "
            "vllm_accel.worker.sim_model_runner.AccelSimModelRunner") in log
    # Our kernels and memory accounting ran in the worker.
    assert "GCU_ATTN attention kernels: vllm_accel.ops.attention_native" in log
    capacity = re.search(r"Device gcu:0 \(sim\) memory: capacity ([\d.]+) GiB", log)
    assert capacity and float(capacity.group(1)) == pytest.approx(4.0)
    weights = re.search(r"weights ([\d.]+) GiB", log)
    assert weights and float(weights.group(1)) >= 0.25  # 135M params, >= 2 bytes each
    assert re.search(r"Device gcu:0 KV cache: \d+ blocks x 64 tokens", log)
    _assert_matches_hf(results, workload)


@pytest.mark.engine
def test_default_model_on_the_virtual_gcu_matches_hf(default_model, workload, tmp_path):
    """The card path (card worker, vLLM's GPU model runner, our attention and
    ops on gcu tensors), with every torch.cuda entry point raising for vLLM and
    vllm_accel."""
    results, log = run_engine(_spec(default_model, workload[1]), tmp_path, env=VIRTUAL_GCU_ENV)
    assert "device gcu via virtual GCU" in log and "Model weights on gcu:0 (" in log
    assert "torch.cuda entry points raise" in log and "FORBIDDEN_CUDA_CALL" not in log
    _assert_matches_hf(results, workload)
