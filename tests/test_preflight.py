"""Startup errors whose last line names the file, path or setting and the fix:
checked on real processes (`LLM(...)` in vLLM's default multiprocess engine), since
what matters is the line the user reads last, not only the exception type."""

import json
import os
import subprocess
import sys

import pytest

from conftest import ENGINE_ENV, TESTS, build_tiny_model
from vllm_accel import preflight


def _fails(model, tmp_path, env=None, **llm) -> str:
    """Run an engine that must fail at startup; the last line of its output."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({
        "llm": {"model": str(model), "dtype": "float32", "skip_tokenizer_init": True,
                "max_model_len": 128, "enforce_eager": True, **llm},
        "prompts": [[5, 6, 7]], "sampling": {"max_tokens": 2, "detokenize": False}}))
    proc = subprocess.run([sys.executable, str(TESTS / "engine_run.py"), str(spec)],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENGINE_ENV,
                               "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})})
    assert proc.returncode != 0
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("preflight") / "tiny", head_dim=64,
                            hidden_size=256, seed=1)


def test_truncated_safetensors_is_named(tiny, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 1000])
    last = _fails(broken, tmp_path)
    assert f"{weights} is truncated" in last and "re-download or re-convert" in last.lower()


def test_missing_local_path_is_named(tmp_path):
    missing = tmp_path / "models" / "nope"
    last = _fails(missing, tmp_path)
    assert f"Model path '{missing}' does not exist" in last and "make setup" in last


def test_weights_larger_than_the_simulated_device_name_the_fix(tiny, tmp_path):
    last = _fails(tiny, tmp_path, env={"ACCEL_SIM_DEVICE_MEMORY_GB": "0.002"})
    assert "more than the 0.002 GiB each device has" in last
    assert "ACCEL_SIM_DEVICE_MEMORY_GB" in last and "--tensor-parallel-size" in last


def test_more_ranks_than_cores_says_how_many(tmp_path):
    ranks = len(os.sched_getaffinity(0)) + 1
    # heads divisible by the rank count, or vLLM rejects the split first
    model = build_tiny_model(tmp_path / "heads", num_heads=ranks, num_kv_heads=ranks,
                             head_dim=16)
    last = _fails(model, tmp_path, tensor_parallel_size=ranks)
    assert f"{ranks} simulated GCU ranks were asked for" in last
    assert f"may use {ranks - 1} CPU core(s)" in last and "Lower --tensor-parallel-size" in last


def test_weight_estimate_counts_floats_at_the_model_dtype(tiny):
    fp32 = preflight.check_weights(str(tiny), 4)
    assert fp32 == sum(f.stat().st_size for f in tiny.glob("*.safetensors")) - _headers(tiny)
    assert preflight.check_weights(str(tiny), 2) * 2 == fp32


def _headers(model) -> int:
    import struct

    total = 0
    for f in model.glob("*.safetensors"):
        total += 8 + struct.unpack("<Q", f.read_bytes()[:8])[0]
    return total


def test_repo_ids_are_not_mistaken_for_paths(tmp_path):
    for model in ("gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", str(tmp_path)):
        preflight.check_model_path(model)
    for model in (str(tmp_path / "x"), "./no-such-model", "models/org/name"):
        with pytest.raises(ValueError, match="does not exist"):
            preflight.check_model_path(model)
