"""Model families whose released checkpoints carry their own modeling code (ChatGLM,
InternLM2, MiniCPM, MiniCPM3, TeleChat2, Ling 2.0, DeepSeek-MoE:
``remote_code_models.py``) through the whole plugin, on the simulator and the virtual GCU, with prefix caching and chunked
prefill, against stock vLLM CPU (transformers has no class for them, so no HF oracle); and
InternVL in its released layout (vLLM's ``InternVLChatModel``) with images.

Teacher-forced: stock vLLM CPU (no plugin of ours loaded) scores each plugin engine's
prompts and greedy tokens in one prefill (``prompt_logprobs``); every greedy token must
be stock's top-1 given the tokens before it, its log-prob within 2e-3 nats of stock's.
Both run float32, so only kernels' summation order separates them (measured: ~1e-5).
"""

import pytest

from conftest import SharedEngines, run_engines
from remote_code_models import (FAMILIES, MOE, VLLM_CONFIGS, build_tiny_internvl_chat,
                                build_tiny_remote)
from test_attention_models import SIM, VIRTUAL, _prompts, _spec
from test_model_families import assert_ran_as_asked

#: stock vLLM CPU: the plugin allowlist names no plugin of ours
STOCK = {"VLLM_PLUGINS": "lora_filesystem_resolver", "VLLM_CPU_KVCACHE_SPACE": "1"}
#: compiled on the simulator (vLLM's default): MiniCPM3's attention (decompressed
#: latents, padded values, LongRoPE), ChatGLM's (vLLM's own config class) and Ling's
#: MoE; the rest eager, their layers the same ops
COMPILED = ("chatglm", "minicpm3", "bailing_moe")
#: name: (family, path env, compiled)
CASES = {f"{family}-sim-{'compiled' if family in COMPILED else 'eager'}":
         (family, SIM, family in COMPILED) for family in FAMILIES}
CASES |= {f"{family}-virtual": (family, VIRTUAL, False) for family in FAMILIES}
#: the teacher-forced bound: both sides float32
NATS = 2e-3
#: InternVL in its released layout: name -> (path env, compiled)
INTERNVL_CASES = {"internvl_chat-sim-compiled": (SIM, True),
                  "internvl_chat-virtual": (VIRTUAL, False)}
#: its requests: one image (cut into tiles), two images of other sizes in one request,
#: text alone in the same batch, and the first again (vLLM's encoder and prefix caches)
INTERNVL_PROMPTS = [{"prompt": "<image>\nWhat is in the image?", "images": [1]},
                    {"prompt": "Compare <image> and <image>.",
                     "images": [[2, 120, 60], [3, 56, 56]]},
                    {"prompt": "Hello there, how are", "images": []},
                    {"prompt": "<image>\nWhat is in the image?", "images": [1]}]


def _internvl_spec(model, compiled: bool = False) -> dict:
    return {"llm": {"model": str(model), "dtype": "float32", "enforce_eager": not compiled,
                    "max_model_len": 512, "max_num_seqs": 4, "enable_prefix_caching": True,
                    "seed": 0, "trust_remote_code": True, "limit_mm_per_prompt": {"image": 2}},
            "mm_prompts": INTERNVL_PROMPTS,
            "sampling": {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True,
                         "logprobs": 1}}


def _case_spec(model, case, compiled, family):
    spec = _spec(model, _prompts(case), compiled)
    if family not in VLLM_CONFIGS:  # the checkpoint's configuration module
        spec["llm"]["trust_remote_code"] = True
    return spec


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("remote_code")
    return {family: build_tiny_remote(root / family, family, seed=i)
            for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def internvl_chat(tmp_path_factory, default_model):
    return build_tiny_internvl_chat(tmp_path_factory.mktemp("internvl") / "internvl_chat",
                                    default_model)


@pytest.fixture(scope="module")
def engines(models, internvl_chat, tmp_path_factory):
    specs = {case: (_case_spec(models[family], case, compiled, family), env)
             for case, (family, env, compiled) in CASES.items()}
    specs |= {case: (_internvl_spec(internvl_chat, compiled), env)
              for case, (env, compiled) in INTERNVL_CASES.items()}
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="module")
def stock_scores(models, internvl_chat, engines, tmp_path_factory):
    """case -> stock vLLM CPU's (results, log) scoring that case's sequences (prompt +
    the plugin's greedy tokens), and InternVL's own greedy run ("internvl_chat"), every
    one in one stock process."""
    specs = {}
    for case, (family, _, _) in CASES.items():
        results, _ = engines(case)
        spec = _case_spec(models[family], case, False, family)
        outputs = [o for batch in results["batch_outputs"] for o in batch]
        prompts = [p for batch in spec.pop("prompt_batches") for p in batch]
        sequences = [p + o["token_ids"] for p, o in zip(prompts, outputs, strict=True)]
        # (one prefill a sequence; stock vLLM CPU's attention takes its own block size)
        spec["llm"].update(enable_prefix_caching=False, max_num_batched_tokens=256)
        spec["llm"].pop("block_size")
        spec["prompts"] = sequences
        spec["sampling"] = {"temperature": 0.0, "max_tokens": 1, "detokenize": False,
                            "prompt_logprobs": 1}
        specs[case] = spec
    specs["internvl_chat"] = _internvl_spec(internvl_chat)
    return run_engines(specs, tmp_path_factory.mktemp("stock"), env=STOCK)


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_stock_vllm(case, engines, stock_scores):
    family, env, compiled = CASES[case]
    results, log = engines(case)
    assert_ran_as_asked(log, env, compiled, family in MOE)
    stock, stock_log = stock_scores[case]
    assert stock is not None, stock_log[-6000:]
    assert stock["platform"] == "CpuPlatform"
    outputs = [o for batch in results["batch_outputs"] for o in batch]
    prompts = _prompts(case)  # (the engine's prompt batches, in order)
    worst = 0.0
    for prompt, out, scored in zip(prompts, outputs, stock["outputs"], strict=True):
        assert len(out["token_ids"]) == len(out["logprobs"]) == 12
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"],
                                                strict=True)):
            position = len(prompt) + step
            assert scored["prompt_top"][position] == token, (len(prompt), step)
            err = abs(top[str(token)] - scored["prompt_logprobs"][position])
            worst = max(worst, err)
            assert err <= NATS, (len(prompt), step, err)
    print(f"{case}: worst log-prob gap to stock vLLM CPU {worst:.2e}")


@pytest.mark.engine
@pytest.mark.parametrize("case", list(INTERNVL_CASES))
def test_internvl_chat_images_match_stock_vllm(case, engines, stock_scores):
    """InternVL's released layout (vLLM's InternVLChatModel, its own processor and
    InternViT) with images: the plugin's greedy tokens are stock vLLM CPU's, each
    log-prob within 2e-3 nats (free-running: the prompts' image tokens are the
    processor's), the tower's attention on the plugin's varlen_attention."""
    results, log = engines(case)
    env, compiled = INTERNVL_CASES[case]
    assert ("Warming up model for the compilation" in log) == compiled
    if env is VIRTUAL:
        assert "device gcu via virtual" in log
    assert "Multimodal encoder attention: varlen_attention" in log
    stock, stock_log = stock_scores["internvl_chat"]
    assert stock is not None, stock_log[-6000:]
    assert stock["platform"] == "CpuPlatform"
    for ours, theirs in zip(results["mm_outputs"], stock["mm_outputs"], strict=True):
        assert ours["token_ids"] == theirs["token_ids"]
        for mine, its in zip(ours["logprobs"], theirs["logprobs"], strict=True):
            (token, logprob), = mine.items()
            assert abs(logprob - its[token]) <= NATS, (token, logprob, its[token])
