"""compressed-tensors (llmcompressor) checkpoints through ``gcu_compressed_tensors``.

Oracles:
* format: the test quantizer's packing equals the installed ``compressed_tensors``
  package's ``pack_to_int32``, and that package's own
  ``PackedQuantizationCompressor.decompress`` turns our checkpoint tensors into
  the quantizer's dequantized weight; config.json is written by the package's
  ``ModelCompressor.update_config``.
* kernel: ``x @ W.T`` in float64 with ``W`` from compressed_tensors' decompressor.
* vLLM layers: QKV / gate_up / row-parallel layers through vLLM's loaders.
* engine: tiny Llama / the default model quantized by the test quantizer, vs HF
  transformers greedy on the dequantized float checkpoint.
"""

import json

import pytest
import torch

from conftest import (SharedEngines, add_default_model_engine, build_tiny_model, greedy_spec,
                      hf_greedy, tiny_quant_source)
from quantizer import ct_quantization_config, quantize_checkpoint_ct, quantize_ct
from test_quant_awq import LOGPROB_BOUND, logprob_gap
from test_quant_gptq import _load, check_close, tp1  # noqa: F401  (fixture)

from vllm_accel.ops.registry import get_kernel
from vllm_accel.quant import compressed_tensors as CT


def ct_decompress(packed: dict, bits: int, group_size: int, symmetric: bool) -> torch.Tensor:
    """float64 ``[out, in]`` via the compressed_tensors package's decompressor."""
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )

    scheme = ct_quantization_config(bits, group_size, symmetric, []).config_groups["group_0"]
    state = {k: v.clone() for k, v in packed.items()}
    state["weight_scale"] = state["weight_scale"].double()
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"].double()


VARIANTS = [(4, 32, True), (4, 32, False), (4, -1, True), (4, -1, False), (8, -1, True),
            (8, 64, False)]


@pytest.mark.parametrize("bits,group_size,symmetric", VARIANTS)
def test_packing_matches_compressed_tensors(bits, group_size, symmetric):
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )

    gen = torch.Generator().manual_seed(bits * 100 + group_size)
    w = torch.randn(36, 128, generator=gen) * 0.1  # 36 rows: a partial zero-point word
    qw = quantize_ct(w, bits, group_size, symmetric)
    packed = qw.pack()
    pf = 32 // bits
    assert packed["weight_packed"].shape == (36, 128 // pf)
    assert torch.equal(packed["weight_packed"], pack_to_int32(qw.q.to(torch.int8), bits))
    assert torch.equal(unpack_from_int32(packed["weight_packed"], bits, (36, 128)),
                       qw.q.to(torch.int8))
    assert packed["weight_shape"].tolist() == [36, 128]
    if symmetric:
        assert "weight_zero_point" not in packed and not qw.zp.any()
    else:
        assert torch.equal(packed["weight_zero_point"],
                           pack_to_int32(qw.zp.to(torch.int8), bits, packed_dim=0))
    ref = ct_decompress(packed, bits, group_size, symmetric)
    assert torch.allclose(qw.dequantize().double(), ref, rtol=1e-6, atol=0)
    qmax = 2 ** (bits - 1) - 1
    assert int(qw.q.max()) <= qmax and int(qw.q.min()) >= -qmax - 1
    assert (qw.dequantize() - w).abs().max() <= qw.scale.max() * 0.51


SHAPES = [(24, 96, 32, 512), (40, 160, 32, 64), (16, 448, 64, 96), (32, 128, -1, 48),
          (8, 256, 128, 512)]


@pytest.mark.parametrize("bits,symmetric", [(4, True), (4, False), (8, True), (8, False)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ct_kernel_vs_float64(bits, symmetric, shape, dtype):
    out, k, group_size, tile_k = shape
    gen = torch.Generator().manual_seed(hash((bits, symmetric, shape)) % 2**31)
    w = torch.randn(out, k, generator=gen) * 0.05
    packed = quantize_ct(w.to(dtype), bits, group_size, symmetric).pack()  # scales in dtype
    gs = k if group_size == -1 else group_size
    zp = packed.get("weight_zero_point")
    res = CT.ct_to_resident(packed["weight_packed"], packed["weight_scale"].float(), zp,
                            bits=bits, group_size=gs, in_features=k)
    assert res.qweight.dtype == torch.uint8
    assert res.qweight.shape == (out, k // 2 if bits == 4 else k)
    assert (res.zeros is None) == symmetric
    ref_w = ct_decompress(packed, bits, group_size, symmetric)
    assert torch.equal(res.dequantize(), ref_w)
    x = torch.randn(3, 5, k, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    y = get_kernel("wint_linear")(x, res.qweight, res.scales, res.zeros, bits=bits,
                                  group_size=res.group_size, bias=bias, tile_k=tile_k)
    check_close(y, x, ref_w, dtype, bias)


# ---------------------------------------------------------------------------
# config, dispatch, errors
# ---------------------------------------------------------------------------


def _cfg(bits=4, group_size=32, symmetric=True, ignore=()):
    d = ct_quantization_config(bits, group_size, symmetric, ["lm_head", *ignore]).model_dump(
        mode="json")
    return {**d, "quant_method": "compressed-tensors"}


def test_config_override():
    C = CT.AccelCompressedTensorsConfig
    d = _cfg()
    assert C.override_quantization_method(d, None) == "gcu_compressed_tensors"
    assert C.override_quantization_method(d, "compressed-tensors") == "gcu_compressed_tensors"
    assert C.override_quantization_method({"quant_method": "awq"}, None) is None
    cfg = C.from_config(d)
    assert cfg.schemes[0].format == "pack-quantized" and cfg.ignore == ["lm_head"]


def _scheme(weights=None, acts=None, fmt="pack-quantized"):
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
         "group_size": 128, "actorder": None, "dynamic": False, "block_structure": None}
    w.update(weights or {})
    return {"config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": acts,
                                          "output_activations": None, "format": fmt}},
            "format": fmt, "ignore": ["lm_head"], "quant_method": "compressed-tensors"}


BAD = {
    "3-bit": (_scheme({"num_bits": 3}), "3-bit weights.*Fix:.*num_bits 4"),
    "nvfp4": (_scheme({"num_bits": 4, "type": "float", "strategy": "tensor_group",
                       "group_size": 16}, fmt="nvfp4-pack-quantized"),
              "float weights other than static symmetric 8-bit.*Fix:"),
    "fp8-packed": (_scheme({"num_bits": 8, "type": "float", "strategy": "channel"}),
                   "fp8 weights in format 'pack-quantized'.*Fix:"),
    "fp8-int8-acts": (_scheme({"num_bits": 8, "type": "float", "strategy": "channel"},
                              acts={"num_bits": 8, "type": "int", "strategy": "token",
                                    "dynamic": True, "symmetric": True},
                              fmt="float-quantized"),
                      "fp8 weights with int8 input activations.*Fix:"),
    "fp8-group": (_scheme({"num_bits": 8, "type": "float", "strategy": "group",
                           "group_size": 128}, fmt="float-quantized"),
                  "fp8 weight strategy 'group'.*Fix:"),
    "actorder-group": (_scheme({"actorder": "group"}), "actorder='group'.*Fix:.*static"),
    "block": (_scheme({"strategy": "block", "block_structure": [128, 128]}),
              "strategy 'block'.*Fix:"),
    "w4a8": (_scheme(acts={"num_bits": 8, "type": "int", "strategy": "token",
                           "dynamic": True, "symmetric": True}, fmt="int-quantized"),
             "not supported.*Fix:"),
    "sparse": ({**_scheme(), "sparsity_config": {"format": "sparse-24-bitmask"}},
               "sparsity.*Fix:"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_schemes_fail_with_layer_and_fix(tp1, case):
    L = tp1
    cfg = CT.AccelCompressedTensorsConfig.from_config(BAD[case][0])
    with pytest.raises(ValueError, match=f"'model.layers.2.mlp.down_proj'.*{BAD[case][1]}"):
        L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                            prefix="model.layers.2.mlp.down_proj", params_dtype=torch.float32)


@pytest.mark.parametrize("preset,layout", [
    ("FP8_DYNAMIC", ("channel", None, False)), ("FP8", ("tensor", None, True)),
    ("FP8_BLOCK", ("block", (128, 128), False))])
def test_fp8_presets_go_to_the_fp8_methods(preset, layout):
    """llmcompressor's FP8 presets (the config its ModelCompressor writes) are served by
    vllm_accel.quant.fp8 (tests/test_quant_fp8_mxfp4.py holds those methods to HF): dense
    layers and experts, with the scale layout of the preset."""
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from vllm_accel.quant import fp8

    qc = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme(preset, ["Linear"])},
                            format="float-quantized", quantization_status="compressed",
                            ignore=["lm_head"]).model_dump(exclude_none=True)
    cfg = CT.AccelCompressedTensorsConfig.from_config(qc)
    method = cfg._linear_method(cfg.schemes[0], "model.layers.0.mlp.down_proj")
    assert type(method) is fp8.AccelFp8LinearMethod
    got = method.layout
    assert (got.strategy, got.block, got.static_input) == layout
    assert got.scale_name == "weight_scale" and got.quant_name == "gcu_compressed_tensors"


def test_w8a8_dispatch_to_int8_helper():
    """int-quantized W8A8 schemes go to vllm_accel.quant.w8a8 with the agreed
    constructor arguments."""
    w8 = {"num_bits": 8, "strategy": "channel", "group_size": None}
    cases = [({"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True,
               "symmetric": True}, ("channel", True, True)),
             ({"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
               "symmetric": False}, ("channel", False, False))]
    from vllm_accel.quant.w8a8 import AccelW8A8LinearMethod

    for acts, (ws, dyn, sym) in cases:
        cfg = CT.AccelCompressedTensorsConfig.from_config(
            _scheme(w8, acts, fmt="int-quantized"))
        m = cfg._linear_method(cfg.schemes[0], "model.layers.0.mlp.down_proj")
        assert type(m) is AccelW8A8LinearMethod
        got = {k: getattr(m, k, None) for k in ("weight_strategy", "input_dynamic",
                                                "input_symmetric")}
        assert got == {"weight_strategy": ws, "input_dynamic": dyn, "input_symmetric": sym}


def test_vllm_layers_targets_ignore_and_merged_shards(tp1):
    L = tp1
    gen = torch.Generator().manual_seed(11)
    d = _cfg(4, 32, False, ignore=["re:.*mlp.down_proj$"])
    cfg = CT.AccelCompressedTensorsConfig.from_config(d)
    pre = "model.layers.0"

    def shard(out, k):
        return quantize_ct(torch.randn(out, k, generator=gen) * 0.05, 4, 32, False).pack()

    x = torch.randn(5, 128, generator=gen)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix=f"{pre}.self_attn.qkv_proj", params_dtype=torch.float32),
         [(shard(128, 128), "q"), (shard(64, 128), "k"), (shard(64, 128), "v")]),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=False, quant_config=cfg,
                                      prefix=f"{pre}.mlp.gate_up_proj",
                                      params_dtype=torch.float32),
         [(shard(256, 128), 0), (shard(256, 128), 1)]),
    ]
    for layer, shards in cases:
        assert type(layer.quant_method) is CT.AccelCTWNA16LinearMethod
        for p, sid in shards:
            _load(layer, p, sid)
        layer.quant_method.process_weights_after_loading(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"wint.qweight", "wint.zeros", "wint.scales"}, names
        w = torch.cat([ct_decompress(p, 4, 32, False) for p, _ in shards])
        check_close(layer(x)[0], x, w, torch.float32)
    down = L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                               prefix=f"{pre}.mlp.down_proj", params_dtype=torch.float32)
    assert type(down.quant_method).__name__ == "UnquantizedLinearMethod"


def test_model_config_resolves_and_config_json(tmp_path):
    from vllm.config import ModelConfig

    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    quantize_checkpoint_ct(src, tmp_path / "ct", bits=4, group_size=32, symmetric=False,
                           ignore=["re:.*layers\\.1\\.mlp\\..*"])
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert qc["quantization_status"] == "compressed" and "version" in qc
    g = qc["config_groups"]["group_0"]
    assert g["format"] == "pack-quantized" and g["targets"] == ["Linear"]
    assert g["weights"]["num_bits"] == 4 and g["weights"]["symmetric"] is False
    assert g["weights"]["strategy"] == "group" and g["weights"]["group_size"] == 32
    assert qc["ignore"] == ["lm_head", "re:.*layers\\.1\\.mlp\\..*"]
    from safetensors.torch import load_file

    state = load_file(tmp_path / "ct" / "model.safetensors")
    assert "model.layers.1.mlp.down_proj.weight" in state
    assert state["model.layers.0.mlp.down_proj.weight_packed"].dtype == torch.int32
    for user in (None, "compressed-tensors"):
        mc = ModelConfig(model=str(tmp_path / "ct"), skip_tokenizer_init=True,
                         dtype="float32", quantization=user)
        assert mc.quantization == "gcu_compressed_tensors", user


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------


def _agreement(got, expected):
    pairs = [(a, b) for g, e in zip(got, expected) for a, b in zip(g, e)]
    return sum(a == b for a, b in pairs) / len(pairs), len(pairs)


ENGINE_CASES = {
    # name: (bits, group_size, symmetric, ignore)
    "w4a16-g32-sym": (4, 32, True, []),
    "w4a16-channel-asym-ignore": (4, -1, False, ["re:.*layers\\.1\\.mlp\\..*"]),
    "w8a16-channel-sym": (8, -1, True, []),
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model):
    """Each tiny case's checkpoint and the default model's (W4A16 group 64 asym), and
    their engines, which run one after another in one process with one repack cache:
    ``(SharedEngines, {name: (dequantized checkpoint, prompts)})``."""
    from test_quant_awq import DEFAULT_PROMPTS

    root = tmp_path_factory.mktemp("ct")
    env = {"ACCEL_REPACK_CACHE": str(root / "repack")}
    specs, cases = {}, {}
    for case, (bits, group_size, symmetric, ignore) in ENGINE_CASES.items():
        src, prompts = tiny_quant_source(root, case)
        quantize_checkpoint_ct(src, root / case / "ct", bits=bits, group_size=group_size,
                               symmetric=symmetric, ignore=ignore,
                               dequant_dst=root / case / "dq")
        cases[case] = (root / case / "dq", prompts)
        specs[case] = (greedy_spec(root / case / "ct", prompts, 16, max_model_len=256), env)
    quantize_checkpoint_ct(default_model, root / "default" / "ct", bits=4, group_size=64,
                           symmetric=False, dequant_dst=root / "default" / "dq")
    add_default_model_engine(specs, cases, default_model, root / "default" / "ct",
                             root / "default" / "dq", DEFAULT_PROMPTS, env)
    return SharedEngines(specs, root), cases


@pytest.mark.engine
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_ct_matches_hf_on_dequantized(case, engines):
    shared, cases = engines
    ignore = ENGINE_CASES[case][3]
    dequant, prompts = cases[case]
    results, log = shared(case)
    assert results["platform"] == "AccelPlatform"
    assert "quantization=gcu_compressed_tensors" in log
    assert "AccelCTWNA16LinearMethod serves" in log and "wint_prepared_linear[cpu_native]" in log
    n_quant = 6 if ignore else 8
    assert f"serves {n_quant} gcu_compressed_tensors layers" in log
    expected = hf_greedy(dequant, prompts, 16)
    got = [o["token_ids"] for o in results["outputs"]]
    agree, n = _agreement(got, expected)
    gap = logprob_gap(dequant, prompts, results)
    print(f"ct {case}: {agree:.1%} of {n} positions agree; max logprob gap {gap:.2e}")
    assert agree >= 0.9, (got, expected)
    assert gap <= LOGPROB_BOUND


@pytest.mark.engine
def test_engine_ct_w4a16_default_model(engines, default_model):
    """SmolLM2-135M, W4A16 group 64 asym: 8 prompts x 32 greedy tokens vs HF on
    the dequantized weights (>= 90%)."""
    from transformers import AutoTokenizer

    shared, cases = engines
    dequant, prompts = cases["default"]
    results, log = shared("default")
    assert "serves 120 gcu_compressed_tensors layers" in log
    expected = hf_greedy(dequant, prompts, 32)
    got = [o["token_ids"] for o in results["outputs"]]
    agree, n = _agreement(got, expected)
    gap = logprob_gap(dequant, prompts, results)
    print(f"ct default model: {agree:.1%} of {n} positions agree; exact sequences "
          f"{sum(g == e for g, e in zip(got, expected))}/{len(got)}; max logprob gap {gap:.2e}")
    tok = AutoTokenizer.from_pretrained(default_model)
    assert agree >= 0.9, [tok.decode(g) for g in got]
    assert gap <= LOGPROB_BOUND


def test_group_size_must_divide_input(tp1):
    L = tp1
    cfg = CT.AccelCompressedTensorsConfig.from_config(_scheme({"group_size": 64}))
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.*group_size 64 does "
                                         "not divide.*96.*Fix:"):
        L.RowParallelLinear(96, 64, bias=False, quant_config=cfg,
                            prefix="model.layers.0.mlp.down_proj", params_dtype=torch.float32)
