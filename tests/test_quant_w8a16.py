"""Online W8A16 (``--quantization w8a16``) through vllm_accel.quant.w8a16.

Oracles:
* quantizer: the per-channel round-to-nearest definition (every weight within
  half a step; no clipping; bf16 scales exactly representable).
* kernels: ``x @ (codes * scales).T`` in float64 for both GEMMs the resident
  layout runs (``torch._weight_int8pack_mm`` and the tile-dequantizing
  ``wint_linear``), on random shapes.
* vLLM: ``--quantization w8a16`` accepted by vLLM's CLI parser and
  ``ModelConfig``; qkv / gate_up / down loaded through vLLM's weight loaders
  keep no float weight and match the float64 oracle.
* engine: the tiny Llama (and the default model) served with ``--quantization
  w8a16`` vs HF transformers fp32 on the dequantized weights, which the test
  computes itself (per-channel ``absmax / 127``, in float64 for the check).
"""

import json
import random
import re
from pathlib import Path

import pytest
import torch

from conftest import DEFAULT_MODEL_DEVICE_ENV, SharedEngines, build_tiny_model

from vllm_accel.ops.torch_fast import wint_gemm  # noqa: F401  (registers the torch_fast GEMM)
from vllm_accel.quant import w8a16 as Q
from vllm_accel.quant.packed import install_resident, resident_from_signed

OUT_REL = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}
_LINEAR_RE = re.compile(
    r"^.*\.layers\.\d+\.(?:self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


def check_close(y, x, w, dtype, bias=None, extra_rel=0.0):
    """``y`` vs float64 ``x @ w.T (+ bias)``: fp32 accumulation (2e-5 of
    ``|x| @ |w|.T``), output rounding, and ``extra_rel`` of ``|x| @ |w|.T``
    (a kernel that rounds ``x @ w.T`` before adding the bias)."""
    xd = x.double().reshape(-1, x.shape[-1])
    ref = xd @ w.t() + (0 if bias is None else bias.double())
    mag = xd.abs() @ w.abs().t()
    err = (y.double().reshape(ref.shape) - ref).abs()
    bound = OUT_REL[dtype] * ref.abs() + (2e-5 + extra_rel) * mag + 1e-6
    assert y.dtype == dtype
    assert bool((err <= bound).all()), f"max err {err.max():.3e}, worst {(err / bound).max():.2f}"


def dequant_oracle(w: torch.Tensor) -> torch.Tensor:
    """The test's own per-channel int8 RTN of an fp32 weight, in float64."""
    wd = w.double()
    s = (w.float().abs().amax(1) / 127).double()
    s = torch.where(s == 0, torch.ones_like(s), s)
    return torch.round(wd / s[:, None]).clamp(-127, 127) * s[:, None]


# ---------------------------------------------------------------------------
# quantizer and kernel
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_per_channel(scale_dtype):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) * torch.rand(40, 1, generator=gen)
    w[3] = 0
    codes, s = Q.quantize_per_channel(w, scale_dtype)
    assert codes.dtype == torch.int8 and s.dtype == scale_dtype and s.shape == (40,)
    assert int(codes.abs().max()) <= 127
    sd = s.double()
    assert bool((sd >= w.double().abs().amax(1) / 127 * (1 - 1e-7)).all())  # nothing clips
    err = (codes.double() * sd[:, None] - w.double()).abs()
    assert bool((err <= sd[:, None] / 2 * (1 + 1e-6)).all())
    assert float(s[3]) == 1.0 and bool((codes[3] == 0).all())
    if scale_dtype == torch.float32:  # matches the test's own RTN
        assert torch.equal(codes.double() * sd[:, None], dequant_oracle(w))
    else:  # rounded up by at most one ulp of the scale dtype
        live = torch.arange(40) != 3
        amax = w.float().abs().amax(1)[live] / 127
        eps = torch.finfo(scale_dtype).eps
        assert bool((s.float()[live] <= amax * (1 + 2 * eps)).all())


SHAPES = [(1, 64, 48), (5, 96, 40), (3, 576, 960), (17, 1536, 576), (2, 33, 7), (4, 128, 2100)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("provider", ["torch_fast", "reference"])
def test_w8a16_kernels(shape, dtype, provider, monkeypatch):
    """The per-channel codes on the shared resident layout: the ``torch_fast``
    prepared layout (torch's int8pack GEMM for bf16 with ``in % 16 == 0``, its
    fp32 tile op otherwise; test_quant_torch_fast checks the choice), or the
    generic layout and tile kernel with the reference provider."""
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", provider)
    m, k, n = shape
    gen = torch.Generator().manual_seed(hash((shape, str(dtype))) % 2**31)
    w = torch.randn(n, k, generator=gen) * 0.05
    scale_dtype = torch.float32 if dtype == torch.float32 else dtype
    codes, s = Q.quantize_per_channel(w, scale_dtype)
    layer = torch.nn.Module()
    res = resident_from_signed(codes, s, bits=8)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as vLLM loads: the model dtype is the default
    try:
        install_resident(layer, res)
    finally:
        torch.set_default_dtype(prev)
    fused = provider == "torch_fast"  # rounds x @ W.T before adding the bias
    assert layer.wint.provider == ("torch_fast" if fused else None)
    x = torch.randn(2, m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    y = layer.wint(x, bias)
    assert y.shape == (2, m, n)
    check_close(y, x, codes.double() * s.double()[:, None], dtype, bias,
                extra_rel=OUT_REL[dtype] if fused else 0.0)


# ---------------------------------------------------------------------------
# vLLM config and layers
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory):
    root = tmp_path_factory.mktemp("w8a16")
    return build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                            hidden_size=128)


def test_cli_and_model_config_accept_w8a16(tiny_float):
    from vllm.config import LoadConfig, ModelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader.weight_utils import get_quant_config
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_float), "--quantization", "w8a16"])
    assert EngineArgs.from_cli_args(args).quantization == "w8a16"
    mc = ModelConfig(model=str(tiny_float), skip_tokenizer_init=True, dtype="float32",
                     quantization="w8a16")
    assert mc.quantization == "w8a16"
    cfg = get_quant_config(mc, LoadConfig())
    assert isinstance(cfg, Q.AccelW8A16Config)


def test_w8a16_on_quantized_checkpoint_fails(tiny_float, tmp_path):
    from quantizer import quantize_checkpoint
    from vllm.config import ModelConfig

    quantize_checkpoint(tiny_float, tmp_path / "gptq", bits=4, group_size=32)
    with pytest.raises(ValueError, match=r"does not match.*w8a16"):
        ModelConfig(model=str(tmp_path / "gptq"), skip_tokenizer_init=True, dtype="float32",
                    quantization="w8a16")


@pytest.fixture
def tp1(monkeypatch):
    """vLLM linear layers outside an engine: a single rank, no process groups.
    Pins the ``reference`` provider, whose generic resident layout the layer
    test inspects (test_w8a16_kernels covers the fused one)."""
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "reference")
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    import vllm.model_executor.parameter as P
    from vllm.config import VllmConfig, set_current_vllm_config

    for mod in (L, P, V):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
    with set_current_vllm_config(VllmConfig()):
        yield L


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_layers_quantize_online(tp1, tiny_float, dtype):
    """qkv, gate_up (with bias) and down through vLLM's loaders: float weight
    dropped, int8 codes + scales kept, output = x @ (codes * scales).T."""
    from safetensors.torch import load_file
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    L = tp1
    state = load_file(tiny_float / "model.safetensors")
    cfg = Q.AccelW8A16Config()
    pre = "model.layers.0"
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 128, generator=gen).to(dtype)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix=f"{pre}.self_attn.qkv_proj", params_dtype=dtype),
         [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")], x),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=True, quant_config=cfg,
                                      prefix=f"{pre}.mlp.gate_up_proj", params_dtype=dtype),
         [("mlp.gate_proj", 0), ("mlp.up_proj", 1)], x),
        (L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                             prefix=f"{pre}.mlp.down_proj", params_dtype=dtype),
         [("mlp.down_proj", None)], torch.randn(5, 256, generator=gen).to(dtype)),
    ]
    for layer, shards, inp in cases:
        assert type(layer.quant_method) is Q.AccelW8A16LinearMethod
        for name, sid in shards:
            t = state[f"{pre}.{name}.weight"]
            if sid is None:
                layer.weight.weight_loader(layer.weight, t)
            else:
                layer.weight.weight_loader(layer.weight, t, sid)
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
        layer.quant_method.process_weights_after_loading(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"wint.qweight", "wint.scales"} | ({"bias"} if layer.bias is not None
                                                         else set()), names
        assert not hasattr(layer, "weight") and layer.wint.zeros is None  # symmetric
        assert layer.wint.qweight.dtype == torch.uint8 and layer.wint.scales.shape[1] == 1
        w = torch.cat([state[f"{pre}.{n}.weight"].to(dtype) for n, _ in shards]).double()
        scales = layer.wint.scales.double()[:, 0]
        if dtype == torch.bfloat16:  # scales held exactly as the model dtype rounded them
            assert torch.equal(scales, scales.to(dtype).double())
        dq = (layer.wint.qweight.double() - 128) * scales[:, None]
        assert bool(((dq - w).abs() <= scales[:, None] / 2 * 1.000001).all())
        if dtype == torch.float32:
            assert torch.equal(dq, dequant_oracle(w.float()))
        y = layer(inp)[0]
        check_close(y, inp, dq, dtype, layer.bias, extra_rel=OUT_REL[dtype])
    # embeddings and lm_head stay in full precision; MoE fails with a fix
    assert cfg.get_quant_method(VocabParallelEmbedding(512, 128), "model.embed_tokens") is None
    assert cfg.get_quant_method(ParallelLMHead(512, 128), "lm_head") is None

    class FusedMoE(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="model.layers.0.mlp.experts.*MoE.*Fix:"):
        cfg.get_quant_method(FusedMoE(), "model.layers.0.mlp.experts")


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------


def write_dequant(src: Path, dst: Path, dtype: torch.dtype) -> None:
    """The oracle checkpoint: every decoder Linear replaced by its per-channel
    int8 dequantization (of the weight cast to ``dtype``, with ``dtype`` scales
    rounded up as the library documents), stored in fp32."""
    from safetensors.torch import load_file, save_file

    from quantizer import _copy_side_files

    dst.mkdir(parents=True, exist_ok=True)
    state = load_file(src / "model.safetensors")
    out = {}
    for name, t in state.items():
        if _LINEAR_RE.match(name):
            w = t.to(dtype).float()
            s = w.abs().amax(1) / 127
            s = torch.where(s == 0, torch.ones_like(s), s)
            if dtype != torch.float32:  # round the scale up to a dtype value
                r = s.to(dtype).float()
                s = torch.where(r < s, torch.nextafter(s.to(dtype), torch.tensor(
                    float("inf"), dtype=dtype)).float(), r)
            out[name] = (torch.round(w / s[:, None]).clamp(-127, 127) * s[:, None]).float()
        else:
            out[name] = t.float()
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    _copy_side_files(src, dst)


def _spec(model, prompts, new_tokens, dtype):
    return {"llm": {"model": str(model), "dtype": dtype, "enforce_eager": True,
                    "skip_tokenizer_init": True, "max_model_len": 1024, "seed": 0,
                    "quantization": "w8a16"},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True,
                         "detokenize": False, "logprobs": 1}}


def _served(engine):
    """The engine's (results, log), having checked that W8A16 served its linears."""
    results, log = engine
    assert results["platform"] == "AccelPlatform"
    assert "quantization=w8a16" in log
    assert "AccelW8A16LinearMethod serves" in log
    assert "w8a16 qkv_proj" in log and "w8a16 down_proj" in log
    return results, log


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model):
    """A tiny checkpoint per dtype and the default model, each with its dequantized
    oracle copy, and their engines, which run one after another in one process:
    ``(SharedEngines, {name: (dequantized checkpoint, prompts)})``."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("w8a16")
    specs, cases = {}, {}
    for dtype in ENGINE_DTYPES:
        src = build_tiny_model(root / dtype / "float", num_heads=4, num_kv_heads=2,
                               head_dim=32, hidden_size=128)
        write_dequant(src, root / dtype / "dq", getattr(torch, dtype))
        rng = random.Random(dtype)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 9, 17, 33, 2, 60)]
        cases[dtype] = (root / dtype / "dq", prompts)
        specs[dtype] = (_spec(src, prompts, 16, dtype), DEFAULT_MODEL_DEVICE_ENV)
    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok(p)["input_ids"] for p in DEFAULT_PROMPTS]
    write_dequant(Path(default_model), root / "default" / "dq", torch.float32)
    cases["default"] = (root / "default" / "dq", prompts)
    # one process for all (one environment): the default model's device size
    specs["default"] = (_spec(default_model, prompts, 32, "float32"), DEFAULT_MODEL_DEVICE_ENV)
    return SharedEngines(specs, root), cases


def _compare(name, results, dequant, prompts, new_tokens):
    """Agreement with HF fp32 on the dequantized weights, teacher-forced: at each
    of vLLM's positions, is its token HF's greedy choice on the same prefix? (A
    free-running comparison stops meaning anything at the first bf16 near-tie.)
    Also the largest |log-prob| gap of vLLM's tokens."""
    from quantizer_int8 import hf_oracle

    got = [o["token_ids"] for o in results["outputs"]]
    vllm_lp = [[step[str(t)] for t, step in zip(o["token_ids"], o["logprobs"])]
               for o in results["outputs"]]
    expected, hf_lp, hf_choice = hf_oracle(dequant, prompts, new_tokens, score=got)
    pairs = [(a, b) for g, c in zip(got, hf_choice) for a, b in zip(g, c)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    lp_diff = max(abs(a - b) for va, ha in zip(vllm_lp, hf_lp) for a, b in zip(va, ha))
    print(f"{name}: {agree:.1%} of {len(pairs)} teacher-forced positions agree with HF on "
          f"the dequantized weights; free-running exact sequences "
          f"{sum(g == e for g, e in zip(got, expected))}/{len(got)}; "
          f"max |d logprob| {lp_diff:.2e}")
    return agree, lp_diff


#: teacher-forced log-prob of vLLM's tokens vs HF fp32 on the dequantized weights
LOGPROB_BOUND = {"float32": 1e-3, "bfloat16": 0.15}


ENGINE_DTYPES = ("float32", "bfloat16")


@pytest.mark.engine
@pytest.mark.parametrize("dtype", ENGINE_DTYPES)
def test_engine_w8a16_matches_hf_on_dequantized(dtype, engines):
    shared, cases = engines
    dequant, prompts = cases[dtype]
    results, log = _served(shared(dtype))
    if dtype == "bfloat16":  # the fast int8 GEMM ran
        assert "resident" in log and "bfloat16 scales" in log
    agree, lp_diff = _compare(f"tiny w8a16 {dtype}", results, dequant, prompts, 16)
    assert agree >= 0.9
    assert lp_diff <= LOGPROB_BOUND[dtype]


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "import numpy as np\n",
]


@pytest.mark.engine
def test_engine_w8a16_default_model(engines):
    """SmolLM2-135M with --quantization w8a16 (fp32 activations), 8 prompts x 32
    new tokens vs HF fp32 on the dequantized weights; resident bytes logged."""
    shared, cases = engines
    dequant, prompts = cases["default"]
    results, log = _served(shared("default"))
    m = re.search(r"resident quantized weights ([\d.]+) MiB \(checkpoint packing [\d.]+ MiB, "
                  r"fp16 ([\d.]+) MiB", log)
    assert m and float(m.group(1)) < 0.52 * float(m.group(2))  # int8 + scales vs fp16
    agree, lp_diff = _compare("default-model w8a16 fp32", results, dequant, prompts, 32)
    assert agree >= 0.9
    assert lp_diff <= 0.01
