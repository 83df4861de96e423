"""LoRA adapters through the plugin: ``enable_lora`` with several adapters in one batch
on the simulator (vLLM's default mode, which runs LoRA eagerly) and the virtual GCU,
each request's tokens teacher-forced against HF float64 on the base weights with its
adapter merged (``W + scale * B @ A``, the merge PEFT's ``merge_and_unload`` does); and ``vllm serve --lora-modules`` with
runtime loading and unloading, a bad adapter refused with a 4xx while the server keeps
serving.

Adapters are written in PEFT's format (``adapter_config.json`` +
``adapter_model.safetensors``) by the test, on attention and MLP projections.
"""

import json
import random
import shutil

import httpx
import pytest
import torch

from conftest import (VIRTUAL_GCU_ENV, build_tiny_model, run_engine, start_server,
                      stop_server)
from moe_models import assert_matches_hf
from quantizer import _copy_side_files

RANK = 8
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj")


def write_adapter(base, path, seed: int, rank: int = RANK, alpha: int = 16,
                  targets=TARGETS):
    """A PEFT LoRA adapter for the Llama checkpoint at ``base`` (random A and B: B is not
    zero, so the adapter changes the output) and, next to it, ``path``-merged: the base
    with the adapter merged in, the oracle's weights."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors, merged = {}, dict(weights)
    for name, w in weights.items():
        module = name.rsplit(".", 1)[0]
        if not name.endswith(".weight") or module.rsplit(".", 1)[-1] not in targets:
            continue
        out_f, in_f = w.shape
        a = torch.randn(rank, in_f, generator=g) * in_f ** -0.5
        b = torch.randn(out_f, rank, generator=g) * 0.1
        tensors[f"base_model.model.{module}.lora_A.weight"] = a
        tensors[f"base_model.model.{module}.lora_B.weight"] = b
        merged[name] = (w.double() + (alpha / rank) * b.double() @ a.double()).float()
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
        "base_model_name_or_path": str(base), "fan_in_fan_out": False}))
    merged_dir = path.with_name(path.name + "-merged")
    shutil.copytree(base, merged_dir)
    save_file({k: v.contiguous() for k, v in merged.items()},
              str(merged_dir / "model.safetensors"), metadata={"format": "pt"})
    return path, merged_dir


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory, default_model):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(root / "base", num_heads=4, num_kv_heads=2, head_dim=32,
                            head_std=0.4, seed=3)
    _copy_side_files(default_model, base)  # (the server tokenizes: the default model's)
    adapters = {name: write_adapter(base, root / name, seed)
                for seed, name in enumerate(("a", "b"))}
    return base, adapters


def _prompts(seed, lengths=(5, 29, 12, 40, 3, 17)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in lengths]


#: (vLLM's default mode: its CPU config pass, ours too, runs LoRA eagerly, and says so)
CASES = {"sim": ({}, True), "virtual": ({**VIRTUAL_GCU_ENV,
                                         "ACCEL_SIM_DEVICE_MEMORY_GB": "1"}, False)}


def _lora_spec(model, prompts, which, adapters, compiled):
    """An engine spec: request ``i`` with adapter ``which[i]`` (None: the base alone)."""
    return {
        "llm": {"model": str(model), "dtype": "float32", "enforce_eager": not compiled,
                "skip_tokenizer_init": True, "max_model_len": 256, "max_num_seqs": 8,
                "enable_lora": True, "max_loras": 2, "max_lora_rank": RANK, "seed": 0},
        "prompts": prompts,
        "lora_requests": [None if w is None else [w, i + 1, str(adapters[w][0])]
                          for i, w in enumerate(which)],
        "sampling": {"temperature": 0.0, "max_tokens": 10, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
        "worker_kernel_calls": ["cpu_lora_linear"],
    }


def _assert_each_adapter_matches_hf(base, adapters, prompts, which, outputs):
    """Each request vs HF float64 on ``base`` with its adapter merged (or on ``base``)."""
    for adapter in ("a", "b", None):
        rows = [i for i, w in enumerate(which) if w == adapter]
        model = base if adapter is None else adapters[adapter][1]
        assert_matches_hf(model, [prompts[i] for i in rows], [outputs[i] for i in rows],
                          nats=2e-3)


@pytest.mark.engine
@pytest.mark.parametrize("case", list(CASES))
def test_adapters_in_one_batch_match_hf_with_the_adapter_merged(case, lora_models, tmp_path):
    """Requests with adapter a, adapter b and none, mixed in one batch (max_loras 2)."""
    env, compiled = CASES[case]
    base, adapters = lora_models
    prompts = _prompts(case)
    which = ["a", "b", None, "a", "b", None]
    results, log = run_engine(_lora_spec(base, prompts, which, adapters, compiled), tmp_path,
                              env=env)
    # the simulator's layers take the C++ kernel, one call per layer and step; the card
    # path has no cpu_native provider
    (counts,) = results["worker_kernel_calls"]
    assert (counts.get("cpu_lora_linear", [0])[0] > 0) == (not env), counts
    assert "Warming up model for the compilation" not in log
    assert ("LoRA runs eagerly on the gcu" in log) == (compiled and not env)
    if env:
        assert "device gcu via virtual" in log
    _assert_each_adapter_matches_hf(base, adapters, prompts, which, results["outputs"])


#: base-weight formats under the adapters: (quantizer, its arguments, what serves it,
#: path env)
QUANTIZED_BASES = {
    "gptq-w4-g32-sim": ("quantize_checkpoint", dict(bits=4, group_size=32, sym=False),
                        "quantization=gcu_gptq", {}),
    "awq-w4-g32-virtual": ("quantize_checkpoint_awq", dict(group_size=32),
                           "quantization=gcu_awq", CASES["virtual"][0]),
}


@pytest.mark.engine
@pytest.mark.parametrize("fmt", list(QUANTIZED_BASES))
def test_adapters_on_a_quantized_base_match_hf_merged(fmt, lora_models, tmp_path):
    """Adapters over GPTQ / AWQ 4-bit base weights (the base's linears on the plugin's
    int4 kernels, the adapters' products added by the LoRA ops), mixed with a request
    without adapter, on the simulator and the virtual GCU (vLLM's default mode: LoRA
    runs eagerly): each matches HF float64 on the dequantized base with its adapter
    merged."""
    import quantizer

    base, _ = lora_models
    quantize, kwargs, served, env = QUANTIZED_BASES[fmt]
    dequant = tmp_path / "dequant"
    getattr(quantizer, quantize)(base, tmp_path / "quant", dequant_dst=dequant, **kwargs)
    adapters = {name: write_adapter(dequant, tmp_path / name, seed + 5)
                for seed, name in enumerate(("a", "b"))}
    prompts = _prompts(fmt, lengths=(5, 29, 12, 40))
    which = ["a", "b", None, "a"]
    results, log = run_engine(
        _lora_spec(tmp_path / "quant", prompts, which, adapters, compiled=True), tmp_path,
        env=env)
    assert served in log
    assert ("device gcu via virtual" in log) == bool(env)
    _assert_each_adapter_matches_hf(dequant, adapters, prompts, which, results["outputs"])


@pytest.mark.server
def test_serve_lora_modules_runtime_updates_and_bad_adapters(lora_models, tmp_path):
    """--lora-modules a=PATH serves ``a`` as a model; /v1/load_lora_adapter adds ``b`` at
    run time and /v1/unload_lora_adapter removes it; an adapter of a rank above
    --max-lora-rank, one made for another base model (vLLM alone would serve it, wrong)
    and a missing path are 4xx errors; the server keeps serving."""
    from openai import OpenAI

    base, adapters = lora_models
    too_big, _ = write_adapter(base, tmp_path / "rank16", seed=9, rank=16)
    # an adapter trained for another base (hidden 64, not 128)
    other_base, _ = write_adapter(build_tiny_model(tmp_path / "other", head_dim=16, seed=4),
                                  tmp_path / "other-adapter", seed=10)
    proc, url = start_server(
        [str(base), "--device", "gcu", "--dtype", "float32", "--enable-lora",
         "--max-lora-rank", str(RANK), "--max-loras", "2", "--max-model-len", "256",
         "--lora-modules", f"a={adapters['a'][0]}", "--enforce-eager"],
        tmp_path / "server.log", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert {"a", str(base)} <= {m.id for m in client.models.list().data}
        prompt = _prompts("serve", lengths=(12,))[0]

        def tokens(model):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                            temperature=0)
            return out.choices[0].text

        base_text, a_text = tokens(str(base)), tokens("a")
        assert base_text != a_text  # the adapter changes the output
        r = httpx.post(f"{url}/v1/load_lora_adapter",
                       json={"lora_name": "b", "lora_path": str(adapters["b"][0])})
        assert r.status_code == 200, r.text
        b_text = tokens("b")
        assert b_text not in (base_text, a_text)
        bad = httpx.post(f"{url}/v1/load_lora_adapter",
                         json={"lora_name": "big", "lora_path": str(too_big)})
        assert bad.status_code == 400 and "--max-lora-rank 16" in bad.text, bad.text
        missing = httpx.post(f"{url}/v1/load_lora_adapter",
                             json={"lora_name": "gone", "lora_path": str(tmp_path / "none")})
        assert 400 <= missing.status_code < 500, missing.text
        other = httpx.post(f"{url}/v1/load_lora_adapter",
                           json={"lora_name": "other", "lora_path": str(other_base)})
        assert other.status_code == 400 and "made for another base model" in other.text, \
            other.text
        assert ("mlp.down_proj.lora_A.weight is [8, 128], but the model's down_proj takes "
                "256 features") in other.text
        r = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert r.status_code == 200, r.text
        assert "b" not in {m.id for m in client.models.list().data}
        assert tokens("a") == a_text and tokens(str(base)) == base_text  # still serving
    finally:
        stop_server(proc)


@pytest.mark.server
def test_serve_refuses_a_startup_adapter_made_for_another_base(lora_models, tmp_path):
    """``--lora-modules`` with an adapter for a narrower base: the server stops at
    startup naming the tensor (vLLM alone serves it, with garbage)."""
    from conftest import spawn_server

    base, _ = lora_models
    other, _ = write_adapter(build_tiny_model(tmp_path / "other", head_dim=16, seed=4),
                             tmp_path / "other-adapter", seed=10)
    log = tmp_path / "server.log"
    proc = spawn_server([str(base), "--device", "gcu", "--dtype", "float32", "--enable-lora",
                         "--max-lora-rank", str(RANK), "--max-model-len", "256",
                         "--enforce-eager", "--lora-modules", f"x={other}"], log)
    assert proc.wait(timeout=300) != 0
    assert ("LoRA adapter 'x' does not fit this model: base_model.model.model.layers.0.mlp."
            "down_proj.lora_A.weight is [8, 128]") in log.read_text()


@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_lora_ops_skip_tokens_without_an_adapter(provider):
    """``lora_shrink`` / ``lora_expand`` vs float64 per-token products; tokens with slot
    -1 (no adapter) get nothing. vLLM 0.32's CPU ops index slot -1 as the last slot
    (the reason for ops/lora.py): checked too, so the wrapper can go when that is fixed."""
    from vllm.lora.ops.torch_ops import bgmv_shrink

    from vllm_accel.ops import lora as _lora  # noqa: F401  (registers the ops)
    from vllm_accel.ops.registry import get_kernel

    g = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out = 3, 8, 64, 48
    lora_a = torch.randn(slots, 1, rank, d_in, generator=g)
    lora_b = torch.randn(slots, 1, d_out, rank, generator=g)
    x = torch.randn(6, d_in, generator=g)
    idx = torch.tensor([0, -1, 2, 1, -1, 2])
    mid = torch.full((6, rank), float("nan"))
    get_kernel("lora_shrink", provider)(x, lora_a, mid, idx, 0.5)
    want_mid = torch.stack([torch.zeros(rank, dtype=torch.float64) if i < 0
                            else 0.5 * lora_a[i, 0].double() @ x[t].double()
                            for t, i in enumerate(idx.tolist())])
    torch.testing.assert_close(mid.double(), want_mid, atol=1e-5, rtol=1e-5)
    y = torch.ones(6, d_out + 10)
    get_kernel("lora_expand", provider)(mid, lora_b, y, idx, 5, d_out, True)
    want = torch.ones(6, d_out + 10, dtype=torch.float64)
    for t, i in enumerate(idx.tolist()):
        if i >= 0:
            want[t, 5:5 + d_out] += lora_b[i, 0].double() @ mid[t].double()
    torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    vllm_mid = torch.zeros(6, rank)
    bgmv_shrink(x, lora_a, vllm_mid, idx, 0.5)
    assert torch.allclose(vllm_mid[1], 0.5 * lora_a[-1, 0] @ x[1], atol=1e-5)  # slot -1: last


@pytest.mark.parametrize("provider", ["reference", "torch_fast", "cpu_native"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rank,slices", [(8, (48, 16, 16)), (16, (40,)), (4, (33, 7))])
def test_lora_linear_matches_float64(provider, dtype, rank, slices):
    """``lora_linear`` (a whole layer: every output slice, each token's adapter) vs
    float64 per-token products: tokens of slot -1 and the columns past the slices keep
    their values; each result within the dtype's rounding of the output."""
    from vllm_accel.ops import lora as _lora  # noqa: F401  (registers the ops)
    from vllm_accel.ops.registry import get_kernel

    g = torch.Generator().manual_seed(rank)
    slots, d_in, rows = 3, 72, 7
    lora_a = tuple(torch.randn(slots, 1, rank, d_in, generator=g).to(dtype) for _ in slices)
    lora_b = tuple((torch.randn(slots, 1, n + 3, rank, generator=g) / rank).to(dtype)
                   for n in slices)  # (vLLM's B may have rows past the slice)
    x = torch.randn(rows, d_in, generator=g).to(dtype)
    idx = torch.tensor([0, -1, 2, 1, -1, 2, 0, 1, 2])  # longer than the batch, as vLLM's
    y0 = torch.randn(rows, sum(slices) + 5, generator=g).to(dtype)
    y = y0.clone()
    get_kernel("lora_linear", provider)(y, x, lora_a, lora_b, idx, 0.5, slices)
    want = y0.double()
    for t, slot in enumerate(idx.tolist()[:rows]):
        offset = 0
        for a, b, n in zip(lora_a, lora_b, slices):
            if slot >= 0:
                h = 0.5 * a[slot, 0].double() @ x[t].double()
                want[t, offset:offset + n] += b[slot, 0, :n].double() @ h
            offset += n
    tol = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(y[[1, 4]], y0[[1, 4]]) and torch.equal(y[:, -5:], y0[:, -5:])


def test_cpu_native_lora_linear_runs_in_cpp_and_sees_new_adapter_weights(monkeypatch):
    """The simulator's ``lora_linear`` reaches the C++ kernel (one call for the layer),
    and after vLLM writes another adapter into a slot in place (``copy_``, as its
    ``set_lora`` does) the next call uses it: the transposed copy is made again."""
    from conftest import kernel_calls

    from vllm_accel.ops import lora as _lora  # noqa: F401  (registers the ops)
    from vllm_accel.ops.registry import get_kernel

    calls = kernel_calls(monkeypatch, "cpu_lora_linear", "accel_lora_linear", 5)
    g = torch.Generator().manual_seed(1)
    lora_a = (torch.randn(2, 1, 8, 32, generator=g),)
    lora_b = (torch.randn(2, 1, 24, 8, generator=g),)
    x, idx = torch.randn(3, 32, generator=g), torch.tensor([1, 0, 1])

    def run():
        y = torch.zeros(3, 24)
        get_kernel("lora_linear", "cpu_native")(y, x, lora_a, lora_b, idx, 1.0, (24,))
        ref = torch.zeros(3, 24)
        get_kernel("lora_linear", "reference")(ref, x, lora_a, lora_b, idx, 1.0, (24,))
        torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-4)
        return y

    first = run()
    lora_b[0][1, 0].copy_(torch.randn(24, 8, generator=g))  # a new adapter in slot 1
    second = run()
    assert torch.equal(first[1], second[1]) and not torch.allclose(first[0], second[0])
    assert calls() == (2, 6), calls()
