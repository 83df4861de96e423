"""Tiny random-weight Llama/Qwen2 models through the whole plugin path vs HF.

Exercises GQA, several block sizes, continuous batching (few sequence slots, so
requests join and leave mid-flight) and chunked prefill (small token budget, so
prefills are split and mixed with decodes). fp32 greedy must match HF exactly,
eager and (one case) under torch.compile, vLLM's default, there also after a
restart that loads the compiled graph from vLLM's compile cache.
"""

import os
import random

import pytest

from conftest import build_tiny_model, hf_greedy, run_engine

CASES = {
    # name: (arch, heads, kv_heads, head_dim, block_size, kernel provider, compiled)
    "llama-gqa4-bs16": ("llama", 4, 1, 16, 16, "torch_fast", False),
    # the simulated GCU's default: C++ kernels (head size 32: the AVX-512 path)
    "qwen2-gqa3-bs32": ("qwen2", 6, 2, 32, 32, "cpu_native", False),
    # the C++ kernels inside a torch.compile'd model (custom ops in the graph)
    "llama-gqa3-bs64-native-compiled": ("llama", 6, 2, 32, 64, "cpu_native", True),
    # the obvious per-request kernels, forced through ACCEL_KERNEL_PROVIDER
    "llama-gqa2-bs128-reference": ("llama", 4, 2, 16, 128, "reference", False),
    # the Triton kernels, forced, in Triton's interpreter (no CPU backend)
    "qwen2-gqa2-bs16-triton": ("qwen2", 4, 2, 16, 16, "triton", False),
}
# (what a CPU without AVX-512 runs, as such a CPU: test_as_cpu.py)
KERNEL_MODULES = {"cpu_native": "cpu_native.attention", "torch_fast": "torch_fast.attention",
                  "reference": "reference.attention", "triton": "triton.paged_attention"}


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_tiny_model_matches_hf(case, tmp_path):
    arch, heads, kv_heads, head_dim, block_size, provider, compiled = CASES[case]
    model = build_tiny_model(tmp_path / case, arch=arch, num_heads=heads,
                             num_kv_heads=kv_heads, head_dim=head_dim)
    rng = random.Random(case)
    lengths = [3, 17, 40, 70, 129, 5, 64, 1]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]
    spec = {
        "llm": {"model": str(model), "dtype": "float32", "enforce_eager": not compiled,
                "skip_tokenizer_init": True, "block_size": block_size,
                "max_model_len": 512, "max_num_seqs": 3, "max_num_batched_tokens": 48,
                "enable_chunked_prefill": True, "seed": 0},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False},
    }
    env = {"ACCEL_KERNEL_PROVIDER": provider,
           **({"TRITON_INTERPRET": "1"} if provider == "triton" else {}),
           # this test's own compile cache: the first start compiles, a restart loads
           **({"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")} if compiled else {})}
    results, log = run_engine(spec, tmp_path, env=env)
    assert results["platform"] == "AccelPlatform"
    assert f"vllm_accel.ops.{KERNEL_MODULES[provider]}.paged_decode" in log
    assert ("Warming up model for the compilation" in log) == compiled
    march = os.environ.get("ACCEL_NATIVE_MARCH", "").strip() or "native"
    assert (f"cpu_native kernels built for -march={march}" in log) == (march != "native")
    if arch == "llama":  # fp32 linears are not the one-op layer's (models/llama.py)
        assert ("Llama decoder layers: vLLM's forward for 2 of 2 (a linear that is neither a "
                "plain bf16 one") in log
    expected = hf_greedy(model, prompts, 16)
    got = [o["token_ids"] for o in results["outputs"]]
    assert got == expected
    if compiled:
        # a restart loads the graph vLLM saved instead of compiling it again
        # (patches.py: "compiled model never loads from vLLM's compile cache on CPU")
        assert "saved AOT compiled function" in log
        results, log = run_engine(spec, tmp_path, env=env)
        assert "Directly load AOT compilation" in log, log[-4000:]
        assert "Compiling model again" not in log
        assert [o["token_ids"] for o in results["outputs"]] == expected
