"""The virtual card: a real torch device on host memory whose kernels are the
CPU's, driven through the card path -- as a GCU (``ACCEL_BACKEND=virtual``,
torch_gcu's contract) and as an SG2260 (``ACCEL_BACKEND=virtual-sophtpu``,
torch_tpu's contract, CHIP_MAP and sccl included).

Device checks run in a fresh interpreter (``virtual_device_checks.py``; renaming
PrivateUse1 cannot be undone in-process) against the same computations on CPU
tensors. The engine tests serve models on it through the card worker and runner
(vLLM's GPU model runner) and compare with HF transformers.
"""

import os
import random
import subprocess
import sys
import textwrap

import pytest
import virtual_device_checks
from conftest import (FORBID_CUDA_ENV, TESTS, SharedEngines, build_tiny_model, hf_greedy,
                      run_engine)
from quantizer import quantize_checkpoint, quantize_checkpoint_awq
from quantizer_int8 import quantize_checkpoint_int8

VIRTUAL_ENV = {"ACCEL_BACKEND": "virtual", "ACCEL_SIM_DEVICE_MEMORY_GB": "1",
               "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
# Local ranks 0, 1 on chips 6, 7: the card path must pass local ranks and let
# torch_tpu map them.
SOPHTPU_ENV = {**VIRTUAL_ENV, "ACCEL_BACKEND": "virtual-sophtpu", "ACCEL_DEVICE": "sophtpu",
               "CHIP_MAP": "6,7"}
FLAVOURS = {"gcu": (VIRTUAL_ENV, "gcu", ["gcu:0", "gcu:1"], "eccl"),
            "sophtpu": (SOPHTPU_ENV, "tpu", ["tpu:6", "tpu:7"], "sccl")}


@pytest.fixture(scope="module")
def device_checks():
    results = {}
    for flavour in ("gcu", "sophtpu"):
        proc = subprocess.run([sys.executable, str(TESTS / "virtual_device_checks.py"), flavour],
                              capture_output=True, text=True, timeout=600)
        for line in proc.stdout.splitlines():
            if line.startswith("CHECK "):
                _, name, verdict = line.split(" ", 2)
                results[flavour, name] = verdict
        assert results, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("flavour,name", [
    *(("gcu", fn.__name__) for fn in virtual_device_checks.CHECKS),
    *(("sophtpu", fn.__name__) for fn in virtual_device_checks.SOPHTPU_CHECKS)])
def test_device(flavour, name, device_checks):
    verdict = device_checks.get((flavour, name), "did not run")
    assert verdict == "ok", verdict


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """4 query / 2 KV heads, hidden 256: real column/row shards at TP=2."""
    root = tmp_path_factory.mktemp("virtual")
    model = build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=64,
                             hidden_size=256, layers=2, seed=3)
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 64, 2, 120)]
    return model, prompts, hf_greedy(model, prompts, 16)


def _spec(model, prompts, **llm):
    return {
        "llm": {"model": str(model), "dtype": "float32", "skip_tokenizer_init": True,
                "max_model_len": 256, "seed": 0, **llm},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False},
    }


def _generate(model, prompts, tmp_path, env, **llm):
    return run_engine(_spec(model, prompts, **llm), tmp_path, env=env)


@pytest.mark.engine
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tiny_model_on_the_card_path_matches_hf(flavour, tiny, tmp_path):
    """fp32 greedy tokens on the virtual card equal HF's; weights and KV cache
    live on the device, sized by the card path's profile run."""
    env, device_name, devices, _ = FLAVOURS[flavour]
    model, prompts, expected = tiny
    results, log = _generate(model, prompts, tmp_path, env)
    assert f"device {flavour} via virtual " in log
    assert (f"Rank 0 on {devices[0]}: worker vllm_accel.worker.card_worker.AccelCardWorker, "
            "model runner vllm_accel.worker.card_model_runner.AccelCardModelRunner") in log
    assert f"Model weights on {devices[0]} (" in log
    assert f"KV cache on {devices[0]} (2 layers)" in log
    assert f"Device {flavour}:0 KV cache:" in log  # local rank 0
    assert [o["token_ids"] for o in results["outputs"]] == expected


@pytest.mark.engine
@pytest.mark.tensor_parallel
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_tensor_parallel_over_the_vendor_collectives_matches_hf(flavour, tiny, tmp_path):
    """TP=2: two virtual cards, one worker process each, collectives over the
    vendor's backend (eccl / sccl with its chip map) on device tensors; the
    tokens equal HF's (so TP=1's, test above)."""
    env, _, devices, collectives = FLAVOURS[flavour]
    model, prompts, expected = tiny
    results, log = _generate(model, prompts, tmp_path, env, tensor_parallel_size=2)
    assert f"backend={collectives}" in log
    for rank, device in enumerate(devices):
        assert f"Model weights on {device} (" in log and f"Worker_TP{rank}" in log
    assert [o["token_ids"] for o in results["outputs"]] == expected


def _gptq(src, dst):
    quantize_checkpoint(src, dst, bits=4, group_size=64, sym=False, desc_act=True)


def _awq(src, dst):
    quantize_checkpoint_awq(src, dst, group_size=64)


def _w8a8(src, dst):
    quantize_checkpoint_int8(src, dst)


QUANTIZED = {"gptq-actorder": _gptq, "awq": _awq, "ct-w8a8": _w8a8}
SIM_ENV = {"ACCEL_BACKEND": "sim", "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}


@pytest.fixture(scope="module")
def quantized_engines(tiny, tmp_path_factory):
    """Each quantized checkpoint (written once) on the virtual GCU and on the simulator
    (eager), with an INT8 KV cache: the virtual GCU's engines one after another in one
    process, the simulator's in another."""
    model, prompts, _ = tiny
    root = tmp_path_factory.mktemp("quantized")
    specs = {}
    for name, write in QUANTIZED.items():
        write(model, root / name)
        specs["virtual-" + name] = (_spec(root / name, prompts, kv_cache_dtype="int8"),
                                    VIRTUAL_ENV)
        specs["sim-" + name] = (_spec(root / name, prompts, kv_cache_dtype="int8",
                                      enforce_eager=True), SIM_ENV)
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.parametrize("name", list(QUANTIZED))
def test_quantized_with_int8_kv_gives_the_simulator_tokens(name, quantized_engines):
    """Our quant methods and the INT8 KV cache on device tensors: the same greedy
    tokens as the simulated GCU (fp32, same kernels' numerics)."""
    virtual, log = quantized_engines("virtual-" + name)
    assert "int8_per_token_head" in log and "KV cache on gcu:0" in log
    simulated, _ = quantized_engines("sim-" + name)
    assert ([o["token_ids"] for o in virtual["outputs"]]
            == [o["token_ids"] for o in simulated["outputs"]])


@pytest.mark.engine
def test_weights_larger_than_the_device_fail_at_startup_naming_the_fix(tiny, tmp_path):
    model, prompts, _ = tiny
    spec = {"llm": {"model": str(model), "dtype": "float32", "skip_tokenizer_init": True,
                    "max_model_len": 256}, "prompts": prompts[:1],
            "sampling": {"max_tokens": 1}}
    with pytest.raises(AssertionError) as failed:  # run_engine asserts a clean exit
        run_engine(spec, tmp_path, env={**VIRTUAL_ENV, "ACCEL_SIM_DEVICE_MEMORY_GB": "0.002"})
    message = str(failed.value)
    assert "do not fit device gcu:0" in message
    assert "ACCEL_SIM_DEVICE_MEMORY_GB" in message and "--tensor-parallel-size" in message


def test_the_cuda_guard_raises_for_vllm_and_vllm_accel_only():
    """tests/forbid_cuda, which the virtual-card engine and server tests run
    under, can fail: functions and classes of torch.cuda raise for the card
    path's callers."""
    code = textwrap.dedent("""
        import torch
        for caller, call in [("vllm.v1.worker.probe", "torch.cuda.is_available()"),
                             ("vllm.v1.worker.probe", "torch.cuda.Event()"),
                             ("vllm_accel.worker.probe", "torch.cuda.Stream()"),
                             ("triton.probe", "torch.cuda.is_available()")]:
            try:
                exec(call, {"__name__": caller, "torch": torch})
                print(caller, call, "ran")
            except RuntimeError as e:
                print(caller, call, "raised" if "FORBIDDEN_CUDA_CALL" in str(e) else e)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **FORBID_CUDA_ENV})
    assert proc.stdout.splitlines() == [
        "vllm.v1.worker.probe torch.cuda.is_available() raised",
        "vllm.v1.worker.probe torch.cuda.Event() raised",
        "vllm_accel.worker.probe torch.cuda.Stream() raised",
        "triton.probe torch.cuda.is_available() ran"], proc.stderr


def test_no_compiler_is_a_clear_error_naming_the_fix(monkeypatch):
    from vllm_accel.backends.virtual import build

    monkeypatch.setattr(build, "compiler", lambda: None)
    build.load_library.cache_clear()
    with pytest.raises(RuntimeError, match="needs a C.. compiler .*install one .*or set CXX"):
        build.load_library()
    build.load_library.cache_clear()
