"""AutoAWQ (GEMM) checkpoints through ``gcu_awq`` (vllm_accel.quant.awq).

Oracles:
* format: the test quantizer's AWQ packing (tests/quantizer.py) is decoded by
  vLLM's own AWQ -> standard conversion (``auto_awq._convert_awq_to_standard_format``)
  to the same codes and zero points.
* kernel: ``x @ W.T`` in float64, ``W`` dequantized from the on-disk tensors
  unpacked by the quantizer (independent of the library's unpacking).
* vLLM layers: QKV / gate_up / row-parallel layers loaded through vLLM's weight
  loaders vs the same float64 oracle; skipped layers stay unquantized.
* engine: tiny Llama and the default model (SmolLM2-135M) quantized by the test
  quantizer, served by vLLM with our method, vs HF transformers greedy on the
  dequantized float checkpoint.
"""

import json

import pytest
import torch

from conftest import (SharedEngines, add_default_model_engine, build_tiny_model, greedy_spec,
                      hf_greedy, tiny_quant_source)
from quantizer import quantize_awq, quantize_checkpoint_awq, unpack_awq, unpack_int32
from test_quant_gptq import _load, check_close, tp1  # noqa: F401  (fixture)

from vllm_accel.ops.registry import get_kernel
from vllm_accel.quant import awq as A


def oracle_weight(packed: dict, group_size: int) -> torch.Tensor:
    """float64 ``[out, in]`` from the on-disk AWQ tensors, unpacked by the quantizer."""
    q = unpack_awq(packed["qweight"]).long()  # [in, out]
    z = unpack_awq(packed["qzeros"]).long()  # [G, out]
    g = torch.arange(q.shape[0]) // group_size
    return ((q - z[g]).double() * packed["scales"].double()[g]).t()


# ---------------------------------------------------------------------------
# format level
# ---------------------------------------------------------------------------


def test_awq_packing_matches_vllm_conversion(tp1):
    from vllm.model_executor.layers.quantization import auto_awq

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen) * 0.1
    qw = quantize_awq(w, 32)
    packed = qw.pack()
    assert packed["qweight"].shape == (128, 6) and packed["qweight"].dtype == torch.int32
    assert packed["qzeros"].shape == (4, 6) and packed["scales"].shape == (4, 48)
    assert packed["scales"].dtype == torch.float16
    # round trip, and the interleaved order is not the plain one
    assert torch.equal(unpack_awq(packed["qweight"]).t(), qw.q)
    assert not torch.equal(unpack_int32(packed["qweight"], 4, dim=1).t(), qw.q)
    # vLLM's own AWQ decoder: -> GPTQ-like qweight [in/8, out], qzeros [out/8, G]
    layer = torch.nn.Module()
    layer.register_parameter("qweight", torch.nn.Parameter(packed["qweight"].clone(),
                                                            requires_grad=False))
    layer.register_parameter("qzeros", torch.nn.Parameter(packed["qzeros"].clone(),
                                                           requires_grad=False))
    auto_awq._convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    assert torch.equal(unpack_int32(layer.qweight.data, 4, dim=0).t(), qw.q)
    assert torch.equal(unpack_int32(layer.qzeros.data, 4, dim=0), qw.zeros)
    # the library's decoder agrees
    assert torch.equal(A.unpack_awq(packed["qweight"]), unpack_awq(packed["qweight"]))
    # quantizer's dequantization == oracle from the packed tensors
    assert torch.equal(qw.dequantize().double(), oracle_weight(packed, 32))
    assert (qw.dequantize() - w).abs().max() <= qw.scales.float().max() * 0.51


# ---------------------------------------------------------------------------
# kernel level
# ---------------------------------------------------------------------------

# (out, in, group_size, tile_k): odd group counts (3, 5, 7), a single group,
# tiles narrower than a group, tiles spanning several groups.
SHAPES = [(24, 96, 32, 512), (40, 160, 32, 64), (16, 448, 64, 96), (32, 128, -1, 48),
          (8, 256, 128, 512)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_awq_kernel_vs_float64(shape, dtype):
    out, k, group_size, tile_k = shape
    gs = k if group_size == -1 else group_size
    gen = torch.Generator().manual_seed(hash(shape) % 2**31)
    w = torch.randn(out, k, generator=gen) * 0.05
    packed = quantize_awq(w, group_size).pack()
    res = A.awq_to_resident(packed["qweight"], packed["qzeros"], packed["scales"].float(),
                            bits=4, group_size=gs)
    assert res.qweight.dtype == torch.uint8 and res.qweight.shape == (out, k // 2)
    assert res.scales.dtype == torch.float16 and res.scales.shape == (out, k // gs)
    assert res.zeros is not None and res.perm is None
    assert torch.equal(res.dequantize(), oracle_weight(packed, gs))
    x = torch.randn(3, 5, k, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    y = get_kernel("wint_linear")(x, res.qweight, res.scales, res.zeros, bits=4,
                                  group_size=res.group_size, bias=bias, tile_k=tile_k)
    check_close(y, x, oracle_weight(packed, gs), dtype, bias)


# ---------------------------------------------------------------------------
# config and vLLM layers
# ---------------------------------------------------------------------------

AWQ_CFG = {"quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4,
           "version": "gemm", "modules_to_not_convert": None}


def test_config_override_and_validation():
    C = A.AccelAWQConfig
    assert C.override_quantization_method(AWQ_CFG, None) == "gcu_awq"
    assert C.override_quantization_method(AWQ_CFG, "awq") == "gcu_awq"
    assert C.override_quantization_method(AWQ_CFG, "auto_awq") is None  # explicit choice
    assert C.override_quantization_method({"quant_method": "gptq"}, None) is None
    cfg = C.from_config(AWQ_CFG)
    assert (cfg.weight_bits, cfg.group_size, cfg.zero_point, cfg.version) == (4, 32, True, "gemm")
    legacy = C.from_config({"w_bit": 4, "q_group_size": 64, "zero_point": True,
                            "version": "GEMM"})
    assert (legacy.group_size, legacy.version) == (64, "gemm")
    prefix = "model.layers.0.mlp.down_proj"
    for bad, msg in ((dict(bits=3), "3-bit.*w_bit=4"), (dict(version="gemv"), "gemv.*GEMM"),
                     (dict(zero_point=False), "zero_point.*zero_point=True")):
        with pytest.raises(ValueError, match=f"{prefix}.*{msg}"):
            C.from_config({**AWQ_CFG, **bad}).validate(prefix)


def test_vllm_layers_load_merged_shards_and_skip(tp1, tmp_path):
    """qkv, gate_up and down through vLLM's weight loaders vs float64; a layer in
    modules_to_not_convert gets vLLM's unquantized method."""
    L = tp1
    gen = torch.Generator().manual_seed(5)
    cfg = A.AccelAWQConfig(bits=4, group_size=32, zero_point=True,
                           modules_to_not_convert=["mlp.down_proj"])
    pre = "model.layers.0"

    def packed(out, k):
        return quantize_awq(torch.randn(out, k, generator=gen) * 0.05, 32).pack()

    x = torch.randn(5, 128, generator=gen)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix=f"{pre}.self_attn.qkv_proj", params_dtype=torch.float32),
         [(packed(128, 128), "q"), (packed(64, 128), "k"), (packed(64, 128), "v")]),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=False, quant_config=cfg,
                                      prefix=f"{pre}.mlp.gate_up_proj",
                                      params_dtype=torch.float32),
         [(packed(256, 128), 0), (packed(256, 128), 1)]),
    ]
    for layer, shards in cases:
        assert type(layer.quant_method) is A.AccelAWQLinearMethod
        for p, sid in shards:
            _load(layer, p, sid)
        layer.quant_method.process_weights_after_loading(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"wint.qweight", "wint.zeros", "wint.scales"}, names
        w = torch.cat([oracle_weight(p, 32) for p, _ in shards])
        check_close(layer(x)[0], x, w, torch.float32)
    down = L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                               prefix=f"{pre}.mlp.down_proj", params_dtype=torch.float32)
    assert type(down.quant_method).__name__ == "UnquantizedLinearMethod"
    assert down.weight.dtype == torch.float32


def test_group_size_must_divide_input(tp1):
    L = tp1
    cfg = A.AccelAWQConfig(bits=4, group_size=64, zero_point=True)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.*group_size 64 does "
                                         "not divide.*96.*Fix:"):
        L.RowParallelLinear(96, 64, bias=False, quant_config=cfg,
                            prefix="model.layers.0.mlp.down_proj", params_dtype=torch.float32)


def test_model_config_resolves_gcu_awq_and_learns_quantized_layers(tmp_path):
    from vllm.config import ModelConfig

    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    quantize_checkpoint_awq(src, tmp_path / "awq", group_size=32,
                            modules_to_not_convert=["layers.1.mlp"])
    cfg_json = json.loads((tmp_path / "awq" / "config.json").read_text())
    assert cfg_json["quantization_config"] == {
        "quant_method": "awq", "zero_point": True, "group_size": 32, "bits": 4,
        "version": "gemm", "modules_to_not_convert": ["layers.1.mlp"]}
    for user in (None, "awq"):
        mc = ModelConfig(model=str(tmp_path / "awq"), skip_tokenizer_init=True,
                         dtype="float32", quantization=user)
        assert mc.quantization == "gcu_awq", user
    cfg = A.AccelAWQConfig.from_config(mc.hf_config.quantization_config)
    cfg.maybe_update_config(str(tmp_path / "awq"))
    assert "model.layers.0.mlp.down_proj" in cfg.quantized_modules
    assert "model.layers.1.mlp.down_proj" not in cfg.quantized_modules


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

def _agreement(got, expected):
    pairs = [(a, b) for g, e in zip(got, expected) for a, b in zip(g, e)]
    return sum(a == b for a, b in pairs) / len(pairs), len(pairs)


#: max |vLLM logprob - HF logprob| of each generated token (teacher-forced on
#: vLLM's tokens). Both run the same dequantized weights in fp32; only the
#: summation order differs (tile-wise dequant GEMM vs one matmul). Measured:
#: ~2.5e-6 on the 2-layer tiny models, ~4e-5 on SmolLM2-135M (30 layers); 5e-4
#: leaves >10x margin while a wrong group, zero point or column order moves
#: logprobs by far more than that.
LOGPROB_BOUND = 5e-4


def logprob_gap(model_dir, prompts, results) -> float:
    """Largest gap between the logprobs vLLM reported for its generated tokens and
    HF transformers' fp32 logprobs of the same tokens (same prefixes)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    worst = 0.0
    with torch.no_grad():
        for ids, out in zip(prompts, results["outputs"]):
            toks = out["token_ids"]
            seq = torch.tensor([list(ids) + toks[:-1]])
            logits = model(seq).logits[0, len(ids) - 1:].double()
            ref = torch.log_softmax(logits, -1)[torch.arange(len(toks)), torch.tensor(toks)]
            got = torch.tensor([step[str(t)] for step, t in zip(out["logprobs"], toks)],
                               dtype=torch.float64)
            worst = max(worst, float((got - ref).abs().max()))
    return worst


ENGINE_CASES = {
    # name: (group_size, modules_to_not_convert, user --quantization)
    "g32-skip-layer1-mlp": (32, ["layers.1.mlp"], None),
    "g128": (128, None, "awq"),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model):
    """Each tiny case's checkpoint and the default model's (AWQ 4-bit group 64), and
    their engines, which run one after another in one process with one repack cache:
    ``(SharedEngines, {name: (dequantized checkpoint, prompts)})``."""
    root = tmp_path_factory.mktemp("awq")
    env = {"ACCEL_REPACK_CACHE": str(root / "repack")}
    specs, cases = {}, {}
    for case, (group_size, skip, user_quant) in ENGINE_CASES.items():
        src, prompts = tiny_quant_source(root, case)
        quantize_checkpoint_awq(src, root / case / "awq", group_size=group_size,
                                modules_to_not_convert=skip, dequant_dst=root / case / "dq")
        cases[case] = (root / case / "dq", prompts)
        specs[case] = (greedy_spec(root / case / "awq", prompts, 16, max_model_len=256,
                                   **({"quantization": user_quant} if user_quant else {})),
                       env)
    quantize_checkpoint_awq(default_model, root / "default" / "awq", group_size=64,
                            dequant_dst=root / "default" / "dq")
    add_default_model_engine(specs, cases, default_model, root / "default" / "awq",
                             root / "default" / "dq", DEFAULT_PROMPTS, env)
    return SharedEngines(specs, root), cases


@pytest.mark.engine
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_awq_matches_hf_on_dequantized(case, engines):
    shared, cases = engines
    skip = ENGINE_CASES[case][1]
    dequant, prompts = cases[case]
    results, log = shared(case)
    assert results["platform"] == "AccelPlatform"
    assert "quantization=gcu_awq" in log
    assert "AccelAWQLinearMethod serves" in log and "wint_prepared_linear[cpu_native]" in log
    assert "gcu_awq qkv_proj" in log and "gcu_awq o_proj" in log
    # layer 1's MLP stayed float: 2 layers x (qkv, o) + layer 0 x (gate_up, down)
    n_quant = 6 if skip else 8
    assert f"serves {n_quant} gcu_awq layers" in log
    expected = hf_greedy(dequant, prompts, 16)
    got = [o["token_ids"] for o in results["outputs"]]
    agree, n = _agreement(got, expected)
    gap = logprob_gap(dequant, prompts, results)
    print(f"awq {case}: {agree:.1%} of {n} positions agree; max logprob gap {gap:.2e}")
    assert agree >= 0.9, (got, expected)
    assert gap <= LOGPROB_BOUND


@pytest.mark.engine
def test_engine_awq_default_model(engines, default_model):
    """SmolLM2-135M, AWQ 4-bit group 64 (576 and 1536 are multiples of 64):
    8 prompts x 32 greedy tokens vs HF on the dequantized weights (>= 90%)."""
    from transformers import AutoTokenizer

    shared, cases = engines
    dequant, prompts = cases["default"]
    results, log = shared("default")
    assert "quantization=gcu_awq" in log and "serves 120 gcu_awq layers" in log
    expected = hf_greedy(dequant, prompts, 32)
    got = [o["token_ids"] for o in results["outputs"]]
    agree, n = _agreement(got, expected)
    gap = logprob_gap(dequant, prompts, results)
    print(f"awq default model: {agree:.1%} of {n} positions agree; exact sequences "
          f"{sum(g == e for g, e in zip(got, expected))}/{len(got)}; max logprob gap {gap:.2e}")
    tok = AutoTokenizer.from_pretrained(default_model)
    assert agree >= 0.9, [tok.decode(g) for g in got]
    assert gap <= LOGPROB_BOUND


DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "The largest planet in our solar system is",
    "To make a cup of tea, first",
    "import numpy as np\n\ndef mean(xs):",
]
