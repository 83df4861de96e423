"""The model families of ``model_families.py`` (Qwen3, GLM-4 and GLM-4.5, ERNIE 4.5,
Hunyuan and Hunyuan-MoE, OLMo 2/3, OLMoE, EXAONE 4.0, SmolLM3, Seed-OSS, Falcon,
StableLM, Granite 3, dots.llm1, Phi-2, Nemotron, Gemma, Arcee, Gemma 3n, Gemma 4 and its
MoE, GLM-4.7-Flash, MiniMax-M2, K-EXAONE, Granite 3 MoE with a shared expert, Ministral 3,
Arcee Trinity, Hunyuan 3, Granite MoE SWA) through the whole plugin vs HF transformers, on the simulator and on the virtual
GCU, with prefix caching and chunked prefill.

Teacher-forced: each greedy token is HF float64's top-1 given the tokens before it,
its log-prob within 2e-3 nats of HF's. The simulator's engines run one after another
in one process, the virtual GCU's in another (``conftest.SharedEngines``).
"""

import pytest

from attention_models import build_tiny
from conftest import SharedEngines
from model_families import FAMILIES
from moe_models import assert_matches_hf
from test_attention_models import SIM, VIRTUAL, _prompts, _spec

#: compiled on the simulator (vLLM's default): a MoE family with DeepSeek-style routing,
#: one whose global layers skip rope, the Gemma 3n / Gemma 4 families (KV sharing,
#: per-layer embeddings, a head size per layer type, AltUp) and MLA beside MoE
#: (GLM-4.7-Flash), and a MoE model through vLLM's Transformers backend (FlexOlmo);
#: the rest eager, their layers the same ops
COMPILED = ("glm4_moe", "exaone4", "gemma3n_text", "gemma4_text", "gemma4_text_moe",
            "glm4_moe_lite", "flex_olmo")
#: the families with MoE layers (the plugin's MoE method serves them)
MOE = ("glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "olmoe", "granitemoe", "dots1",
       "gemma4_text_moe", "glm4_moe_lite", "minimax_m2", "exaone_moe", "granitemoeshared",
       "afmoe", "hy_v3", "granitemoe_swa", "flex_olmo",
       "laguna")
#: name: (family, path env, compiled)
CASES = {f"{family}-sim-{'compiled' if family in COMPILED else 'eager'}":
         (family, SIM, family in COMPILED) for family in FAMILIES}
CASES |= {f"{family}-virtual": (family, VIRTUAL, False) for family in FAMILIES}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: build_tiny(root / family, family, seed=i, families=FAMILIES)
            for i, family in enumerate(FAMILIES)}


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    specs = {case: (_spec(models[family], _prompts(case), compiled), env)
             for case, (family, env, compiled) in CASES.items()}
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


#: the families whose attention is MLA (the plugin's ACCEL_MLA serves it)
MLA = ("glm4_moe_lite",)


def assert_ran_as_asked(log: str, env: dict, compiled: bool, moe: bool,
                        mla: bool = False) -> None:
    """The engine's log shows the case's mode (compiled or eager), path (the virtual GCU
    or the simulator) and the plugin's attention (ACCEL_MLA's latent cache for MLA) and
    MoE method."""
    assert ("Warming up model for the compilation" in log) == compiled
    if env is VIRTUAL:
        assert "device gcu via virtual" in log
    assert ("ACCEL_MLA: latent cache of" if mla else "ACCEL_ATTN attention kernels:") in log
    if moe:
        assert "AccelFusedMoEMethod" in log


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_family_matches_hf(case, models, engines):
    family, env, compiled = CASES[case]
    results, log = engines(case)
    assert_ran_as_asked(log, env, compiled, family in MOE, family in MLA)
    outputs = [o for batch in results["batch_outputs"] for o in batch]
    assert_matches_hf(models[family], _prompts(case), outputs)
