"""Mixture-of-experts models through the whole plugin (ops/moe.py) vs HF transformers:
tiny random-weight Mixtral, Qwen2-MoE (a gated shared expert and a dense layer),
Qwen3-MoE and gpt-oss (swigluoai experts with biases, attention sinks) checkpoints, on
the simulator and on the virtual GCU (the card path), eager and compiled; expert
parallel at TP=2; an INT8 KV cache with MoE."""

import random
import re

import pytest

from conftest import VIRTUAL_GCU_ENV, SharedEngines, assert_bf16_tokens_near_hf, run_engine
from moe_models import assert_matches_hf, build_tiny_moe

SIM = {}
#: the Triton fused-MoE kernel (and attention), forced, in Triton's interpreter
TRITON = {"ACCEL_KERNEL_PROVIDER": "triton", "TRITON_INTERPRET": "1"}
VIRTUAL = {**VIRTUAL_GCU_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: name: (family, path env, compiled, dtype)
CASES = {
    "mixtral-sim-eager": ("mixtral", SIM, False, "float32"),
    "qwen2_moe-sim-compiled": ("qwen2_moe", SIM, True, "float32"),
    "qwen3_moe-sim-compiled-bf16": ("qwen3_moe", SIM, True, "bfloat16"),
    "mixtral-virtual-eager": ("mixtral", VIRTUAL, False, "float32"),
    "qwen2_moe-virtual-eager": ("qwen2_moe", VIRTUAL, False, "float32"),
    # (vLLM's default mode: the card path runs it eagerly, saying so)
    "qwen3_moe-virtual-default": ("qwen3_moe", VIRTUAL, True, "float32"),
    "mixtral-sim-triton": ("mixtral", TRITON, False, "float32"),
    "gpt_oss-sim-compiled": ("gpt_oss", SIM, True, "float32"),
    "gpt_oss-virtual-eager": ("gpt_oss", VIRTUAL, False, "float32"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {family: build_tiny_moe(root / family, family, seed=i)
            for i, family in enumerate(("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"))}


def _prompts(seed, lengths=(3, 17, 40, 70, 5, 33)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


def _spec(model, prompts, dtype, compiled, **llm):
    return {
        "llm": {"model": str(model), "dtype": dtype, "enforce_eager": not compiled,
                "skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 4,
                "max_num_batched_tokens": 64, "enable_prefix_caching": True, "seed": 0, **llm},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
    }


def _case_spec(models, case):
    family, env, compiled, dtype = CASES[case]
    spec = _spec(models[family], _prompts(case), dtype, compiled)
    if env is TRITON:
        spec["llm"]["max_num_batched_tokens"] = 32  # chunked prefill: pairs past 2 blocks
    if env is SIM:
        spec["worker_kernel_calls"] = ["cpu_moe_experts"]
    return spec


def _int8_kv_spec(models):
    return _spec(models["mixtral"], _prompts("int8", lengths=(12, 50)), "float32", False,
                 kv_cache_dtype="int8")


@pytest.fixture(scope="module")
def engines(models, tmp_path_factory):
    """The single-process engines: those of one environment one after another in one
    process, when a test first needs one."""
    specs = {case: (_case_spec(models, case), CASES[case][1]) for case in CASES}
    specs["int8-kv"] = (_int8_kv_spec(models), SIM)
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_moe_model_matches_hf(case, models, engines):
    """Greedy tokens are HF float64's top-1 (teacher-forced) with its log-probs, through
    the plugin's MoE method: on the simulator its C++ experts op (counted), on the card
    path the torch_fast experts inside vLLM's moe_forward op; forced, the Triton
    fused-MoE kernel (interpreted)."""
    family, env, compiled, dtype = CASES[case]
    prompts = _prompts(case)
    results, log = engines(case)
    assert ("Warming up model for the compilation" in log) == (compiled and env is SIM)
    assert ("runs eagerly (no torch.compile" in log) == (compiled and env is VIRTUAL)
    assert "AccelFusedMoEMethod" in log
    if env is SIM:
        calls, experts = results["worker_kernel_calls"][0]["cpu_moe_experts"]
        assert calls > 0 and experts >= calls
    elif env is TRITON:
        assert "experts triton" in log
    else:
        assert "device gcu via virtual" in log
    if dtype == "float32":
        assert_matches_hf(models[family], prompts, results["outputs"])
    else:
        # bf16 activations rounded at every stage (~0.1 nats seen at logits of spread ~5)
        assert_bf16_tokens_near_hf(models[family], prompts, results["outputs"], nats=0.2)


@pytest.mark.engine
@pytest.mark.tensor_parallel
@pytest.mark.parametrize("path", ["sim", "virtual"])
def test_expert_parallel_tp2_matches_hf(path, models, tmp_path):
    """``--enable-expert-parallel`` at TP=2: each rank holds half the experts (vLLM's
    expert map), the runner all-reduces; tokens and log-probs stay HF's. The simulator
    compiles (vLLM's default; the suite's compiled tensor-parallel engine)."""
    prompts = _prompts("ep", lengths=(9, 31, 4))
    spec = _spec(models["qwen3_moe"], prompts, "float32", path == "sim",
                 tensor_parallel_size=2, enable_expert_parallel=True)
    results, log = run_engine(spec, tmp_path, env=SIM if path == "sim" else VIRTUAL)
    assert ("Warming up model for the compilation" in log) == (path == "sim")
    assert "[EP Rank 0/2] Expert parallelism is enabled" in log
    for rank in (0, 1):
        assert re.search(rf"Worker_TP{rank}_EP{rank} .*AccelFusedMoEMethod, 8 of 16 experts here",
                         log)
    assert_matches_hf(models["qwen3_moe"], prompts, results["outputs"])


@pytest.mark.engine
def test_int8_kv_with_moe_keeps_hf_tokens(models, engines):
    """An INT8 KV cache under the MoE layers: each greedy token HF float64's top-1, its
    log-prob within the INT8 cache's noise (0.1 nats) of HF's."""
    prompts = _prompts("int8", lengths=(12, 50))
    results, log = engines("int8-kv")
    assert "paged_decode_int8" in log  # the INT8 kernels ran
    _, err = assert_matches_hf(models["mixtral"], prompts, results["outputs"], nats=0.1)
    print(f"INT8 KV with MoE: HF's top-1 throughout, log-prob error up to {err:.3f} nats")
