"""Speculative decoding through the plugin: n-gram prompt lookup, a draft model, an
EAGLE head and DeepSeek's multi-token prediction (MTP) layer, on the simulator (compiled
and eager) and the virtual GCU, each environment's engines one after another in one
process. Greedy tokens with speculation are plain greedy decoding's: each is HF float64's top-1 given the tokens before it (the
plugin's plain greedy is held to the same oracle throughout the suite), and the drafts
were really proposed and accepted (vLLM's spec-decode counters)."""

import random
import shutil

import pytest
import torch

from conftest import VIRTUAL_GCU_ENV, SharedEngines, build_tiny_model
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
    return {"target": target, "draft": draft, "eagle": _eagle_head(root / "eagle"),
            "mtp": _deepseek_with_mtp(root / "deepseek_mtp")}


def _eagle_head(path):
    """An EAGLE-1 head for the target, in the format of the released Llama heads (one
    decoder layer without its input norm, ``fc`` [hidden, 2 * hidden] over the token's
    embedding and the target's hidden state; the target's embedding and LM head shared):
    random weights, so its drafts are mostly rejected and the target's tokens decide."""
    from safetensors.torch import load_file, save_file

    base = build_tiny_model(path, num_heads=4, num_kv_heads=2, head_dim=32, layers=1,
                            seed=6)
    weights = load_file(str(base / "model.safetensors"))
    head = {name.removeprefix("model."): w for name, w in weights.items()
            if name.startswith("model.layers.0.") and "input_layernorm" not in name}
    g = torch.Generator().manual_seed(7)
    hidden = weights["model.embed_tokens.weight"].shape[1]
    head["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5
    (base / "model.safetensors").unlink()
    save_file(head, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


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
    "eagle-sim-compiled": ({"method": "eagle", "num_speculative_tokens": 2}, {}, True),
    "eagle-virtual": ({"method": "eagle", "num_speculative_tokens": 2}, VIRTUAL, False),
}


def _spec(model, speculative, compiled, prompts, max_tokens) -> dict:
    return {"llm": {"model": str(model), "dtype": "float32", "enforce_eager": not compiled,
                    "skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 4,
                    "speculative_config": speculative, "disable_log_stats": False,
                    "seed": 0},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True,
                         "detokenize": False, "logprobs": 1}}


def _case_spec(case, models) -> dict:
    speculative, _, compiled = CASES[case]
    if speculative["method"] in ("draft_model", "eagle"):
        proposer = "draft" if speculative["method"] == "draft_model" else "eagle"
        speculative = {**speculative, "model": str(models[proposer])}
    return _spec(models["target"], speculative, compiled, _prompts(case), 16)


#: MTP engines: env, compiled
MTP_CASES = {"mtp-sim-default": ({}, True), "mtp-virtual": (VIRTUAL, False)}
_MTP_RNG = random.Random(1)
MTP_PROMPTS = [[_MTP_RNG.randrange(3, 512) for _ in range(n)] for n in (5, 17, 33)]


def _mtp_spec(case, models) -> dict:
    return _spec(models["mtp"], {"method": "mtp", "num_speculative_tokens": 1},
                 MTP_CASES[case][1], MTP_PROMPTS, 12)


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    """Each environment's engines one after another in one process. vLLM's Prometheus
    logger unregisters the previous engine's collectors, so each engine's spec-decode
    counters are its own: the draft-model engines run after the EAGLE and MTP ones,
    whose random heads' rejected drafts would break their accepted == drafted otherwise."""
    specs = {case: (_case_spec(case, models), CASES[case][1]) for case in CASES}
    specs.update({case: (_mtp_spec(case, models), MTP_CASES[case][0]) for case in MTP_CASES})
    # The n-gram engines last: their proposer imports numba, whose llvmlite library
    # object answers any attribute, and vLLM's scan of sys.modules when a later CPU
    # engine registers its Triton-kernel overrides then fails on it (vLLM 0.32;
    # a script that starts two engines after an n-gram one fails the same way).
    ordered = sorted(specs, key=lambda case: (case.startswith("ngram"),
                                              case.startswith("draft")))
    return SharedEngines({case: specs[case] for case in ordered},
                         tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_speculative_greedy_is_plain_greedy(case, models, engines):
    speculative, env, compiled = CASES[case]
    results, log = engines(case)
    assert ("Warming up model for the compilation" in log) == (compiled and not env)
    if env:
        assert "device gcu via virtual" in log
    counters = results["spec_decode"]
    drafted = counters.get("vllm:spec_decode_num_draft_tokens", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafted > 0, counters  # (the repeated phrases give prompt lookup its n-grams)
    if speculative["method"] == "draft_model":  # the target's copy drafts its tokens
        assert accepted == drafted, counters
    if speculative["method"] == "eagle":  # (vLLM's EAGLE proposer loaded our head)
        assert "Detected EAGLE model without its own lm_head" in log
    assert_matches_hf(models["target"], _prompts(case), results["outputs"])


def _deepseek_with_mtp(path):
    """A tiny DeepSeek-V3 (MLA, sigmoid-routed experts) with one MTP layer, laid out as
    the released checkpoints are: the MTP block as layer ``num_hidden_layers`` (a
    decoder layer HF built as a third layer), with its ``enorm``/``hnorm``, ``eh_proj``,
    ``shared_head`` and a copy of the embedding. HF runs the two-layer model (it skips
    the MTP tensors); vLLM's DeepSeekMTP drafts from them (random: mostly rejected)."""
    import json

    from safetensors.torch import load_file, save_file

    from attention_models import build_tiny

    build_tiny(path, "deepseek_v3", layers=3, seed=3)
    weights = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config.update(num_hidden_layers=2, num_nextn_predict_layers=1)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    g = torch.Generator().manual_seed(9)
    mtp = "model.layers.2."
    weights.update({
        mtp + "embed_tokens.weight": weights["model.embed_tokens.weight"].clone(),
        mtp + "enorm.weight": torch.ones(hidden), mtp + "hnorm.weight": torch.ones(hidden),
        mtp + "eh_proj.weight": torch.randn(hidden, 2 * hidden, generator=g) * (2 * hidden) ** -0.5,
        mtp + "shared_head.norm.weight": torch.ones(hidden),
        mtp + "shared_head.head.weight": weights["lm_head.weight"].clone()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path


@pytest.mark.engine
@pytest.mark.parametrize("case", list(MTP_CASES))
def test_mtp_greedy_is_plain_greedy(case, models, engines):
    """``--speculative-config '{"method": "mtp"}'`` on a DeepSeek-V3 checkpoint with an MTP
    layer: vLLM's DeepSeekMTP proposer (MLA with a query LoRA and MoE on the plugin's
    kernels) drafts, and greedy tokens stay HF float64's top-1, compiled on the
    simulator."""
    results, log = engines(case)
    assert "Detected MTP model" in log
    assert ("Warming up model for the compilation" in log) == MTP_CASES[case][1]
    assert results["spec_decode"].get("vllm:spec_decode_num_draft_tokens", 0) > 0
    assert_matches_hf(models["mtp"], MTP_PROMPTS, results["outputs"])


@pytest.mark.server
def test_serve_ngram_speculation_over_the_openai_api(models, tmp_path):
    """``vllm serve --speculative-config`` (n-gram): completions through the OpenAI
    client are HF's greedy tokens, and the server's metrics show drafts proposed and
    accepted."""
    import httpx
    from openai import OpenAI

    from conftest import hf_greedy, start_server, stop_server

    target = models["target"]
    prompts = _prompts("serve")
    expected = hf_greedy(target, prompts, 16)
    speculative = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
                   '"prompt_lookup_min": 2}')
    proc, url = start_server([str(target), "--device", "gcu", "--dtype", "float32",
                              "--max-model-len", "256", "--skip-tokenizer-init",
                              "--speculative-config", speculative], tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        got = [client.completions.create(
            model=str(target), prompt=ids, max_tokens=16, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0].token_ids
            for ids in prompts]
        assert got == expected
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        counts = {name: sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                            if line.startswith(name))
                  for name in ("vllm:spec_decode_num_draft_tokens_total",
                               "vllm:spec_decode_num_accepted_tokens_total")}
        assert all(v > 0 for v in counts.values()), counts
    finally:
        stop_server(proc)
