"""The virtual GCU (``ACCEL_BACKEND=virtual``): a real ``gcu`` torch device on
host memory whose kernels are the CPU's, driven through the card path.

Device checks run in a fresh interpreter (``virtual_gcu_checks.py``; renaming
PrivateUse1 cannot be undone in-process) against the same computations on CPU
tensors. The engine tests serve models on it through the card worker and runner
(vLLM's GPU model runner) and compare with HF transformers.
"""

import random
import subprocess
import sys

import pytest
import virtual_gcu_checks
from conftest import TESTS, build_tiny_model, hf_greedy, run_engine

VIRTUAL_ENV = {"ACCEL_BACKEND": "virtual", "ACCEL_SIM_DEVICE_MEMORY_GB": "1",
               "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}


@pytest.fixture(scope="module")
def device_checks():
    proc = subprocess.run([sys.executable, str(TESTS / "virtual_gcu_checks.py")],
                          capture_output=True, text=True, timeout=600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CHECK "):
            _, name, verdict = line.split(" ", 2)
            results[name] = verdict
    assert results, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("name", [fn.__name__ for fn in virtual_gcu_checks.CHECKS])
def test_device(name, device_checks):
    assert device_checks.get(name) == "ok", device_checks.get(name, "did not run")


@pytest.mark.engine
def test_tiny_model_on_the_card_path_matches_hf(tmp_path):
    """fp32 greedy tokens of a tiny Llama on the virtual GCU equal HF's; weights
    and KV cache live on the gcu device, sized by the card path's profile run."""
    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 9, 17, 33, 2, 60)]
    results, log = run_engine({
        "llm": {"model": str(src), "dtype": "float32", "skip_tokenizer_init": True,
                "max_model_len": 256, "seed": 0},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False},
    }, tmp_path, env=VIRTUAL_ENV)
    assert "device gcu via virtual GCU" in log
    assert "worker vllm_accel.worker.card_worker.AccelCardWorker" in log
    assert "Model weights on gcu:0 (" in log and "KV cache on gcu:0 (2 layers)" in log
    assert "Device gcu:0 KV cache:" in log
    assert [o["token_ids"] for o in results["outputs"]] == hf_greedy(src, prompts, 16)
