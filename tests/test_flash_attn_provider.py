"""The ``flash_attn`` provider (Enflame's FlashAttention build): probe and adapter.

No FlashAttention build runs on CPU, so the probe must report the module missing
and nothing may register. The adapter (our cache as FlashAttention's strided
``[NB, BS, Hkv, D]`` K/V views) is checked with the fake build in
``tests/fakes/flash_attn``: a float64 implementation of ``flash_attn_varlen_func``'s
documented paged semantics that reads K/V through the views' strides and only the
pages inside each request's window, as the CUDA kernel does. Builds that ignore
strides or fail are refused by the probe. End to end, a bf16 model on the virtual
GCU runs its attention through the fake build and matches HF transformers.
"""

import importlib
import os
import inspect
import sys

import pytest
import torch

from vendor_fakes import FAKES
from paged_cases import TOL, alibi_slopes, batch_mix, free_before_window, make_case, reference

from vllm_accel.ops import registry
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (registers)
from vllm_accel.ops.vendor.flash_attn import FLASH_ATTN_MODULE, probe_flash_attn


@pytest.fixture
def install_build(monkeypatch):
    """Installs the fake build (``tests/fakes/flash_attn``) under Enflame's module name,
    in the variant asked for; returns its call log. Unimported again afterwards."""
    monkeypatch.syspath_prepend(str(FAKES / "flash_attn"))
    module = importlib.import_module(FLASH_ATTN_MODULE)

    def install(**kwargs):
        calls = []
        monkeypatch.setattr(module, "flash_attn_varlen_func", module.make_varlen(calls, **kwargs))
        return calls

    yield install
    for name in ("flash_attn", FLASH_ATTN_MODULE):
        sys.modules.pop(name, None)


def test_probe_without_the_build():
    kernels, why = probe_flash_attn(torch.device("cpu"))
    assert kernels is None
    assert why.startswith(f"{FLASH_ATTN_MODULE} not usable on cpu: not importable"), why
    assert "flash_attn" not in registry.providers_of("paged_prefill")


def test_probe_refuses_a_build_that_ignores_strides(install_build):
    install_build(ignore_strides=True)
    kernels, why = probe_flash_attn(torch.device("cpu"))
    assert kernels is None and "FA3 is wrong" in why and "FA2 is wrong" in why, why


def test_probe_refuses_a_build_that_fails(install_build, monkeypatch):
    install_build()
    module = sys.modules[FLASH_ATTN_MODULE]

    def broken(**kwargs):
        raise RuntimeError("no kernel image for this device")

    broken.__signature__ = inspect.signature(module.flash_attn_varlen_func)
    monkeypatch.setattr(module, "flash_attn_varlen_func", broken)
    kernels, why = probe_flash_attn(torch.device("cpu"))
    assert kernels is None and "FA3 fails: RuntimeError: no kernel image" in why, why


def _run(kernels, mix, bs, ratio, dtype, layout, seed, **features):
    """Prefill and decode of ``mix`` through the kernels vs the float64 oracle."""
    prefill, decode = kernels
    hkv, d = 2, 64
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, cache = make_case(reqs, bs, ratio * hkv, hkv, d, dtype, seed,
                                               layout=layout)
    if "sliding_window" in features:
        free_before_window(cache, block_table, reqs, features["sliding_window"])
    if "alibi_slopes" in features:
        features["alibi_slopes"] = alibi_slopes(ratio * hkv)
    starts = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    expected = torch.cat([reference(q, k, v, d ** -0.5, **features)
                          for q, k, v in zip(qs, ks, vs)])
    out = prefill(torch.cat(qs), cache, block_table, starts, seq_lens, d ** -0.5, **features)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])
    if mix == "decode":
        out = decode(torch.cat(qs), cache, block_table, seq_lens, d ** -0.5, **features)
        torch.testing.assert_close(out.double(), expected, **TOL[dtype])


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("mix", ["decode", "prefill_ctx", "mixed"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adapter_reads_our_cache_in_place(install_build, layout, mix, dtype):
    calls = install_build()
    kernels, why = probe_flash_attn(torch.device("cpu"))
    assert "(FA3) matched the oracle" in why and "sliding_window, logits_soft_cap" in why, why
    assert "alibi" not in why  # FA3 has no ALiBi
    del calls[:]
    _run(kernels, mix, 16, 3, dtype, layout, seed=len(mix))
    assert calls == [3] * (2 if mix == "decode" else 1)


@pytest.mark.parametrize("features", [{"sliding_window": 21}, {"logits_soft_cap": 5.0}])
def test_windows_and_soft_caps_run_in_the_build(install_build, features):
    """A window over freed (NaN) pages reads only the window's pages."""
    calls = install_build()
    kernels, _ = probe_flash_attn(torch.device("cpu"))
    del calls[:]
    _run(kernels, "prefill_ctx", 16, 2, torch.bfloat16, "LHBNC", seed=5, **features)
    _run(kernels, "decode", 32, 1, torch.bfloat16, "LBHNC", seed=6, **features)
    assert calls == [3] * 3


def test_alibi_runs_in_an_fa2_build_and_goes_on_from_fa3(install_build):
    calls = install_build(takes_version=False)
    kernels, why = probe_flash_attn(torch.device("cpu"))
    assert "(FA?) matched" in why and "alibi_slopes" in why, why
    del calls[:]
    _run(kernels, "mixed", 16, 2, torch.bfloat16, "LBHNC", seed=7, alibi_slopes=True)
    assert calls == [2]  # the stand-in's default version
    calls = install_build()
    kernels, _ = probe_flash_attn(torch.device("cpu"))
    del calls[:]
    _run(kernels, "mixed", 16, 2, torch.bfloat16, "LBHNC", seed=7, alibi_slopes=True)
    assert calls == []  # the next provider (here the reference) ran it


def test_outside_the_contract_goes_to_the_next_provider(install_build):
    """float32 caches, sinks, pages of 8 tokens: not FlashAttention's."""
    calls = install_build()
    kernels, _ = probe_flash_attn(torch.device("cpu"))
    del calls[:]
    _run(kernels, "decode", 16, 2, torch.float32, "LBHNC", seed=8)
    _run(kernels, "mixed", 8, 2, torch.bfloat16, "LBHNC", seed=9)
    _run(kernels, "mixed", 16, 2, torch.bfloat16, "LBHNC", seed=10,
         sinks=torch.tensor([0.5, -1.0, 2.0, 0.0]))
    assert calls == []


@pytest.mark.engine
def test_bf16_model_on_the_virtual_gcu_runs_its_attention_in_the_build(tmp_path):
    """The card path with the fake build importable: the probe registers it on the
    virtual GCU, prefill (chunked: 32-token steps, so later chunks read cached context)
    and decode run through it, and vLLM's logprobs of its tokens match HF
    transformers' fp32 ones (teacher-forced) within the bf16 bound."""
    import random

    from conftest import VIRTUAL_GCU_ENV, build_tiny_model, run_engine
    from test_cpu_native_int4_gemv import BF16_LOGPROB_BOUND
    from test_quant_awq import logprob_gap

    model = build_tiny_model(tmp_path / "model", num_heads=4, num_kv_heads=2, head_dim=32,
                             hidden_size=128)
    rng = random.Random(12)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 70)]
    env = {**VIRTUAL_GCU_ENV, "FAKE_FLASH_ATTN_REPORT": "1",
           "PYTHONPATH": os.pathsep.join((str(FAKES / "flash_attn"),
                                          VIRTUAL_GCU_ENV["PYTHONPATH"]))}
    results, log = run_engine({
        "llm": {"model": str(model), "dtype": "bfloat16", "skip_tokenizer_init": True,
                "max_model_len": 256, "max_num_batched_tokens": 32, "seed": 0,
                "enforce_eager": True},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
    }, tmp_path, env=env)
    assert "device gcu via virtual" in log
    assert ("flash_attn:paged_prefill,paged_decode: registered (flash_attn.vllm_flash_attn "
            "(FA3) matched the oracle on gcu") in log
    assert "flash_attn.flash_paged_decode" in log and "flash_attn.flash_paged_prefill" in log
    report = [line for line in log.splitlines() if line.startswith("FAKE_FLASH_ATTN ")][-1]
    _, _, decode, _, prefill, _, version = report.split()
    assert version == "3"
    # beyond the probe's 10 calls: 2 layers x 15 decode steps; 2 layers x 4+ prefill steps
    assert int(decode) >= 30 and int(prefill) >= 8, report
    gap = logprob_gap(model, prompts, results)
    print(f"bf16 on the virtual GCU through the fake FlashAttention build: max logprob gap "
          f"vs HF fp32 {gap:.3e}")
    assert gap <= BF16_LOGPROB_BOUND
