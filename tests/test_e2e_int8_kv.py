"""INT8 KV cache end to end on the default model: `LLM(kv_cache_dtype="int8")`
(the GCU forks' spelling) predicts the same greedy tokens as the bf16 KV cache and
stores ~1.9x the tokens in the same simulated device memory.

Agreement is measured under teacher forcing: the bf16-KV run generates 32 tokens
per prompt; the INT8-KV engine then scores prompt + those tokens, and at each of
the 32 positions its top-ranked token must be the one bf16 chose. (Comparing two
free-running generations would stop at the first bf16 logit tie -- this model's
bf16 logits tie exactly at some positions, so a 1e-3 perturbation flips them.)
The same holds for the chat answer's first token ("L" and "The" tie in bf16 after
"What is the capital of France?"), so Paris is checked teacher-forced too: the
INT8-KV engine must rank " Paris" first after "The capital of France is".
"""

import re

import pytest

from conftest import run_engine

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "How many legs does a spider have?", "Explain photosynthesis in one sentence.",
    "Name three primary colors.", "What is 12 times 12?",
    "Give me a tip for learning to code.", "Why is the sky blue?",
]
NEW_TOKENS = 32


def _run(default_model, tmp_path, kv_cache_dtype, prompts, eager=True, **sampling):
    results, log = run_engine({
        "llm": {"model": str(default_model), "dtype": "bfloat16", "enforce_eager": eager,
                "max_model_len": 1024, "seed": 0, "kv_cache_dtype": kv_cache_dtype},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "ignore_eos": True, **sampling},
    }, tmp_path)
    tokens = re.search(r"Device gcu:0 KV cache: \d+ blocks x \d+ tokens = (\d+) tokens", log)
    return results, int(tokens.group(1)), log


@pytest.mark.engine
def test_int8_kv_predicts_bf16_tokens_and_holds_more(default_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [list(tok.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)) for q in QUESTIONS]
    bf16, bf16_tokens, _ = _run(default_model, tmp_path, "auto", prompts,
                                max_tokens=NEW_TOKENS)
    generated = [o["token_ids"] for o in bf16["outputs"]]
    answer = tok("The capital of France is Paris.", add_special_tokens=False)["input_ids"]
    paris = tok(" Paris", add_special_tokens=False)["input_ids"]
    assert len(paris) == 1 and paris[0] in answer
    # the INT8 engine in vLLM's default mode (torch.compile)
    scored, int8_tokens, log = _run(default_model, tmp_path, "int8",
                                    [p + g for p, g in zip(prompts, generated)]
                                    + [prompts[0] + answer],
                                    eager=False, max_tokens=1, prompt_logprobs=1)
    assert "paged_decode_int8" in log  # the INT8 kernels ran
    assert "attention_step_int8 runs the layer in one call" in log
    assert int8_tokens >= 1.8 * bf16_tokens, (int8_tokens, bf16_tokens)
    agree = sum(
        top == token
        for out, p, g in zip(scored["outputs"], prompts, generated)
        for top, token in zip(out["prompt_top"][len(p):], g)
    )
    print(f"INT8 KV: teacher-forced agreement {agree / (NEW_TOKENS * len(QUESTIONS)):.3f}")
    assert agree >= 0.9 * NEW_TOKENS * len(QUESTIONS), agree
    at = len(prompts[0]) + answer.index(paris[0])
    assert scored["outputs"][-1]["prompt_top"][at] == paris[0]
