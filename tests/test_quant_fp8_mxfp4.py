"""FP8 checkpoints (``quant_method: fp8``, compressed-tensors FP8) through
vllm_accel.quant.fp8, and gpt-oss MXFP4 checkpoints through vllm_accel.quant.mxfp4:
formats dequantized at load.

Oracles:
* dequantization: ``q * s`` in float64 over every e4m3 code, block scales with
  partial edge blocks, per-tensor scales of merged projections;
* vLLM's layers: qkv / gate_up / down loaded through vLLM's own loaders (block and
  per-tensor scales) hold the dense weight the float64 oracle gives, run vLLM's
  unquantized method, and compute ``x @ W.T``;
* engines: tiny Llama FP8 checkpoints written by the test (transformers' /
  DeepSeek's block layout, and per-tensor scales with static activation scales)
  vs HF transformers in float64 on the dequantized weights, teacher-forced: compiled
  float32 and bf16 on the simulator, eager float32 on the virtual GCU. Stock vLLM
  CPU serves these only on CPUs with AMX tiles.
* MXFP4: the test's own e2m1 / e8m0 quantizer, its checkpoint layout checked against
  transformers' own MXFP4 dequantizer; a tiny gpt-oss with MXFP4 experts vs HF float64
  on the dequantized checkpoint, on the simulator and on the virtual GCU.
"""

import json
import random
from pathlib import Path

import pytest
import torch

from conftest import VIRTUAL_GCU_ENV, SharedEngines, assert_bf16_tokens_near_hf, \
    build_tiny_model
from attention_models import build_tiny
from moe_models import assert_matches_hf, build_tiny_moe

from vllm_accel.quant import fp8 as F
from vllm_accel.quant import mxfp4 as MX

E4M3_MAX = 448.0


def quantize_fp8(w: torch.Tensor, block: list[int] | str | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The test's own FP8 quantizer: absmax / 448 per ``[bn, bk]`` block (scales
    ``[ceil(out/bn), ceil(in/bk)]``), per output row (``"channel"``: ``[out, 1]``) or
    per tensor (None: a 0-dim scale)."""
    w = w.float()
    if block == "channel":
        s = (w.abs().amax(1, keepdim=True) / E4M3_MAX).clamp(min=1e-12)
        return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s
    if block is None:
        s = (w.abs().max() / E4M3_MAX).clamp(min=1e-12)
        return (w / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), s
    (o, i), (bn, bk) = w.shape, block
    s = torch.empty(-(-o // bn), -(-i // bk))
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    for r in range(s.shape[0]):
        for c in range(s.shape[1]):
            tile = w[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk]
            s[r, c] = (tile.abs().max() / E4M3_MAX).clamp(min=1e-12)
            q[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = (tile / s[r, c]).clamp(
                -E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s


def dequant_oracle(q: torch.Tensor, s: torch.Tensor, block: list[int] | None) -> torch.Tensor:
    """``q * s`` in float64, each weight with its own block's (or the tensor's) scale."""
    qd = q.double()
    if block is None or block == "channel":
        return qd * s.double()
    (o, i), (bn, bk) = q.shape, block
    rows = torch.arange(o) // bn
    cols = torch.arange(i) // bk
    return qd * s.double()[rows][:, cols]


# ---------------------------------------------------------------------------
# dequantization
# ---------------------------------------------------------------------------


def test_every_e4m3_code_dequantizes_exactly():
    """All 256 codes (NaN stays NaN, +-0, subnormals, +-448) times a scale per row."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(4, 64)
    scales = torch.tensor([[1.0], [0.5], [2.0 ** -9], [3.0]])
    dense = F.dequantize_fp8(codes, scales, 64, torch.float32)
    exact = codes.double() * scales.double()
    assert torch.equal(dense.isnan(), exact.isnan()) and int(dense.isnan().sum()) == 2
    live = ~exact.isnan()
    assert torch.equal(dense.double()[live], exact[live])


@pytest.mark.parametrize("shape,block", [((200, 300), [128, 128]), ((96, 64), [32, 16]),
                                         ((130, 70), [64, 64])],
                         ids=["edge-blocks", "small-blocks", "partial-both"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_block_scales_dequantize(shape, block, dtype, monkeypatch):
    """Block scales with partial edge blocks, the rows processed in several steps."""
    monkeypatch.setattr(F, "_ROWS_PER_STEP", 48)
    gen = torch.Generator().manual_seed(shape[0])
    w = torch.randn(shape, generator=gen) * torch.rand(shape[0], 1, generator=gen)
    q, s = quantize_fp8(w, block)
    dense = F.dequantize_fp8(q, F.block_row_scales(s, shape[0], block[0]), block[1], dtype)
    exact = dequant_oracle(q, s, block)
    assert dense.dtype == dtype and dense.shape == shape
    # float32 products rounded to float32, then to dtype: within dtype's half ulp
    # (float16's subnormals below 2^-14: half of their spacing, 2^-25)
    rel = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}[dtype]
    tiny = 2.0 ** -25 if dtype == torch.float16 else 0.0
    assert bool(((dense.double() - exact).abs() <= rel * exact.abs() + tiny).all())
    if dtype == torch.float32:
        assert torch.equal(dense, exact.float())


def test_per_tensor_scales_of_merged_projections():
    """A merged qkv holds one scale per checkpoint tensor: each row gets its own."""
    gen = torch.Generator().manual_seed(1)
    parts = [torch.randn(w, 40, generator=gen) * f for w, f in ((32, 1.0), (16, 0.1), (16, 3.0))]
    qs = [quantize_fp8(p, None) for p in parts]
    q = torch.cat([x for x, _ in qs])
    scales = torch.stack([s for _, s in qs])
    dense = F.dequantize_fp8(q, F.tensor_row_scales(scales, [32, 16, 16]), 40, torch.float32)
    exact = torch.cat([dequant_oracle(x, s, None) for x, s in qs])
    assert torch.equal(dense, exact.float())


# ---------------------------------------------------------------------------
# config and vLLM's layers
# ---------------------------------------------------------------------------


def test_config_claims_fp8_checkpoints(monkeypatch):
    """Every fp8 checkpoint is ours, except ``--quantization fp8`` where vLLM's AMX
    kernels run (they keep the weights in fp8)."""
    cfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    monkeypatch.setattr(F, "vllm_amx_kernels_run", lambda: False)
    for user in (None, "fp8", "gcu_fp8"):
        assert F.AccelFp8Config.override_quantization_method(cfg, user) == "gcu_fp8"
    assert F.AccelFp8Config.override_quantization_method(cfg, "other") is None
    assert F.AccelFp8Config.override_quantization_method({"quant_method": "gptq"}, None) is None
    monkeypatch.setattr(F, "vllm_amx_kernels_run", lambda: True)
    for user in (None, "gcu_fp8"):
        assert F.AccelFp8Config.override_quantization_method(cfg, user) == "gcu_fp8"
    assert F.AccelFp8Config.override_quantization_method(cfg, "fp8") is None
    parsed = F.AccelFp8Config.from_config({**cfg, "modules_to_not_convert": ["lm_head"]})
    assert parsed.weight_block_size == [128, 128] and parsed.ignored_layers == ["lm_head"]
    assert parsed.get_supported_act_dtypes()[0] == torch.float32


@pytest.mark.parametrize("extra,match", [
    ({"fmt": "e5m2"}, "fp8 format 'e5m2'"),
    ({"store_dtype": "mxfp4"}, "store_dtype 'mxfp4'"),
    ({"weight_block_size": [128]}, r"weight_block_size \[128\]"),
    ({"activation_scheme": "per_token"}, "activation scheme 'per_token'"),
])
def test_unsupported_options_name_the_layer_and_fix(extra, match, tp1):
    cfg = F.AccelFp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                        **extra})
    with pytest.raises(ValueError, match=f"model.layers.0.mlp.down_proj.*{match}.*Fix:"):
        tp1.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                              prefix="model.layers.0.mlp.down_proj")


def test_misaligned_merges_fail_with_a_fix(tp1):
    cfg = F.AccelFp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                        "weight_block_size": [128, 128]})
    # k of 64 rows: v's scale rows would start inside k's block
    with pytest.raises(ValueError, match=r"qkv_proj.*\[128, 64, 64\].*128-row.*Fix:"):
        tp1.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                              prefix="model.layers.0.self_attn.qkv_proj")


@pytest.fixture
def tp1(monkeypatch):
    """vLLM linear layers outside an engine: a single rank, no process groups."""
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.layers.vocab_parallel_embedding as V
    import vllm.model_executor.parameter as P
    import vllm.distributed as D
    from vllm.config import VllmConfig, set_current_vllm_config

    for mod in (L, P, V, D):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
    with set_current_vllm_config(VllmConfig()):
        yield L


@pytest.mark.parametrize("block", [[64, 32], None], ids=["block", "per-tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_layers_load_and_run_dense(tp1, block, dtype, monkeypatch):
    """qkv, gate_up (with bias) and down through vLLM's loaders: the fp8 weight and its
    scales are gone, the dense weight handed to vLLM's unquantized method is the float64
    oracle's (rounded to ``dtype``), and the layer runs that method (vLLM's CPU dispatch
    here); ``ignored_layers`` stay unquantized."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    handed = {}
    dispatch = UnquantizedLinearMethod.process_weights_after_loading

    def recorded(self, layer):
        handed[layer.prefix] = (layer.weight.data.clone(),
                                {n for n, _ in layer.named_parameters()})
        dispatch(self, layer)

    monkeypatch.setattr(UnquantizedLinearMethod, "process_weights_after_loading", recorded)
    L = tp1
    static = block is None
    cfg = F.AccelFp8Config.from_config({
        "quant_method": "fp8", "activation_scheme": "static" if static else "dynamic",
        "weight_block_size": block, "ignored_layers": ["model.layers.0.mlp.skipped"]})
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 128, generator=gen).to(dtype)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix="model.layers.0.self_attn.qkv_proj", params_dtype=dtype),
         [("q", 128), ("k", 64), ("v", 64)], x),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=True, quant_config=cfg,
                                      prefix="model.layers.0.mlp.gate_up_proj",
                                      params_dtype=dtype),
         [(0, 256), (1, 256)], x),
        (L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                             prefix="model.layers.0.mlp.down_proj", params_dtype=dtype),
         [(None, 128)], torch.randn(5, 256, generator=gen).to(dtype)),
    ]
    for layer, shards, inp in cases:
        assert type(layer.quant_method) is F.AccelFp8LinearMethod
        exact = []
        for sid, rows in shards:
            w = torch.randn(rows, layer.input_size, generator=gen) * 0.1
            q, s = quantize_fp8(w, block)
            exact.append(dequant_oracle(q, s, block))
            scale = layer.weight_scale_inv if block else layer.weight_scale
            for param, t in ((layer.weight, q), (scale, s)):
                if sid is None:
                    param.weight_loader(param, t)
                else:
                    param.weight_loader(param, t, sid)
            if static:
                layer.input_scale.weight_loader(layer.input_scale, torch.tensor(0.02),
                                                *(() if sid is None else (sid,)))
        if layer.bias is not None:
            layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=gen))
        layer.quant_method.process_weights_after_loading(layer)
        assert type(layer.quant_method) is UnquantizedLinearMethod
        dense, names = handed[layer.prefix]
        assert names == {"weight"} | ({"bias"} if layer.bias is not None else set()), names
        assert dense.dtype == dtype
        assert torch.equal(dense, torch.cat(exact).float().to(dtype))
        ref = inp.double() @ dense.double().t()
        if layer.bias is not None:
            ref = ref + layer.bias.double()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(inp)[0].double(), ref, rtol=tol, atol=tol)
    skipped = L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                                  prefix="model.layers.0.mlp.skipped")
    assert type(skipped.quant_method) is UnquantizedLinearMethod


# ---------------------------------------------------------------------------
# MXFP4
# ---------------------------------------------------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=torch.float64)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The test's own MXFP4 quantizer of ``[..., R, C]``: per 32 weights along C a power
    of two ``2 ** e`` with ``e = floor(log2 amax) - 2`` (6, e2m1's largest, is 1.5 *
    2 ** 2), each weight the nearest e2m1 value of ``w / 2 ** e`` (saturating). Returns
    (codes uint8 ``[..., R, C/2]`` low nibble first, e8m0 scales uint8 ``[..., R, C/32]``,
    the float64 dequantized weight)."""
    blocks = w.double().unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2,
                    torch.zeros_like(amax))
    q = blocks / torch.exp2(e).unsqueeze(-1)
    idx = (q.unsqueeze(-1) - E2M1).abs().argmin(-1)  # ties and zeros: the first code
    dq = (E2M1[idx] * torch.exp2(e).unsqueeze(-1)).flatten(-2)
    idx = idx.flatten(-2).to(torch.uint8)
    codes = idx[..., 0::2] | (idx[..., 1::2] << 4)
    return codes, (e + 127).to(torch.uint8), dq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantizes_exactly(dtype):
    """Every e2m1 code in every nibble, exponents from 2^-20 to 2^20, zero blocks."""
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(3, 40, 128, generator=gen) * torch.exp2(
        torch.randint(-20, 20, (3, 40, 1), generator=gen).float())
    w[0, 0] = 0
    w[1, 1, :32] = torch.tensor(E2M1.tolist() * 2, dtype=torch.float32)  # each code, twice
    codes, scales, dq = quantize_mxfp4(w)
    got = MX.dequantize_mxfp4(codes, scales, dtype)
    assert got.dtype == dtype and got.shape == w.shape
    assert torch.equal(got.double(), dq)  # e2m1 times a power of two: exact in bf16


def write_mxfp4_checkpoint(src: Path, dst: Path, dequant: Path) -> None:
    """A gpt-oss checkpoint ``src`` with its experts in OpenAI's MXFP4 layout
    (``gate_up_proj_blocks`` ``[E, 2I, H/32, 16]``, ``..._scales`` ``[E, 2I, H/32]``,
    gate and up rows interleaved as in the float ``[E, H, 2I]``; ``down_proj_*`` likewise
    over ``[E, H, I]`` rows), the rest float as in the released checkpoints; and the
    oracle ``dequant``: the float checkpoint with the dequantized experts."""
    from safetensors.torch import load_file, save_file

    from quantizer import _copy_side_files

    state = load_file(src / "model.safetensors")
    out, oracle = {}, {}
    for name, t in state.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            rows = t.transpose(1, 2)  # [E, out, in]
            codes, scales, dq = quantize_mxfp4(rows)
            out[f"{name}_blocks"] = codes.unflatten(-1, (-1, 16)).contiguous()
            out[f"{name}_scales"] = scales.contiguous()
            oracle[name] = dq.transpose(1, 2).float().contiguous()
        else:
            out[name] = oracle[name] = t
    config = json.loads((src / "config.json").read_text())
    quant = {"quant_method": "mxfp4",
             "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                        "model.embed_tokens", "lm_head"]}
    for path, tensors, extra in ((dst, out, {"quantization_config": quant}),
                                 (dequant, oracle, {})):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        _copy_side_files(src, path)


def test_mxfp4_checkpoint_layout_is_transformers(tmp_path):
    """transformers' own MXFP4 dequantizer reads the test's checkpoint as the oracle
    does (nibble order, block and row layout, the [E, H, 2I] transpose)."""
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src = build_tiny_moe(tmp_path / "float", "gpt_oss")
    write_mxfp4_checkpoint(src, tmp_path / "mx", tmp_path / "dq")
    packed, oracle = (load_file(tmp_path / d / "model.safetensors") for d in ("mx", "dq"))
    for proj in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{proj}"
        hf = convert_moe_packed_tensors(packed[f"{name}_blocks"], packed[f"{name}_scales"],
                                        dtype=torch.float32)
        assert torch.equal(hf, oracle[name])


def test_mxfp4_claims_gpt_oss_only(monkeypatch):
    from types import SimpleNamespace

    C = MX.AccelMxfp4Config
    oss, llama = SimpleNamespace(model_type="gpt_oss"), SimpleNamespace(model_type="llama")
    monkeypatch.setattr(MX, "vllm_amx_kernels_run", lambda: False)
    for method in ("mxfp4", "gpt_oss_mxfp4"):
        for user in (None, "mxfp4", "gpt_oss_mxfp4", "gcu_mxfp4"):
            assert C.override_quantization_method({"quant_method": method}, user,
                                                  oss) == "gcu_mxfp4"
    assert C.override_quantization_method({"quant_method": "mxfp4"}, None, llama) is None
    assert C.override_quantization_method({"quant_method": "fp8"}, None, oss) is None
    # vLLM's AMX experts: only when asked for by vLLM's name
    monkeypatch.setattr(MX, "vllm_amx_kernels_run", lambda: True)
    for user in (None, "gcu_mxfp4"):
        assert C.override_quantization_method({"quant_method": "mxfp4"}, user,
                                              oss) == "gcu_mxfp4"
    assert C.override_quantization_method({"quant_method": "mxfp4"}, "mxfp4", oss) is None


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

#: the quantized linears (and MoE experts' projections; Mixtral names them w1/w2/w3;
#: DeepSeek's MLA projections)
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "w1", "w2", "w3", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def write_fp8_checkpoint(src: Path, dst: Path, dequant: Path, *, block: list[int] | None,
                         ignored: tuple[str, ...] = (), ct_preset: str | None = None) -> None:
    """``src`` quantized to FP8 (block scales ``weight_scale_inv``, or per-tensor
    ``weight_scale`` with a static ``input_scale``), except the ``ignored`` linears;
    with ``ct_preset``, an llmcompressor export of that preset instead (its config
    written by compressed_tensors' ``ModelCompressor``; ``FP8_DYNAMIC``: per-channel
    ``weight_scale``, routers ignored); and the oracle ``dequant``: the same model
    with each weight ``q * s`` in float32."""
    from safetensors.torch import load_file, save_file

    from quantizer import _copy_side_files

    if ct_preset is not None:
        block = "channel"
    state = load_file(src / "model.safetensors")
    out, oracle = {}, {}
    for name, t in state.items():
        module = name.rsplit(".", 1)[0]
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in _PROJ \
                and module not in ignored:
            q, s = quantize_fp8(t, block)
            out[name] = q
            scale_name = "weight_scale_inv" if isinstance(block, list) else "weight_scale"
            out[f"{module}.{scale_name}"] = s
            if block is None:
                out[f"{module}.input_scale"] = torch.tensor(0.05)
            oracle[name] = dequant_oracle(q, s, block).float()
        else:
            out[name] = oracle[name] = t
    config = json.loads((src / "config.json").read_text())
    if ct_preset is not None:
        from compressed_tensors.compressors import ModelCompressor
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme

        for path, tensors in ((dst, out), (dequant, oracle)):
            path.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
            (path / "config.json").write_text(json.dumps(config, indent=2))
            _copy_side_files(src, path)
        ModelCompressor(quantization_config=QuantizationConfig(
            config_groups={"group_0": preset_name_to_scheme(ct_preset, ["Linear"])},
            format="float-quantized", quantization_status="compressed",
            ignore=["lm_head", "re:.*mlp.gate$"])).update_config(str(dst))
        return
    for path, tensors, quant in (
            (dst, out, {"quant_method": "fp8", "fmt": "e4m3",
                        "activation_scheme": "dynamic" if block else "static",
                        **({"weight_block_size": block} if block else {}),
                        **({"ignored_layers": list(ignored)} if ignored else {})}),
            (dequant, oracle, None)):
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(
            {**config, **({"quantization_config": quant} if quant else {})}, indent=2))
        _copy_side_files(src, path)


def _spec(model: Path, prompts, dtype: str, eager: bool) -> dict:
    return {"llm": {"model": str(model), "dtype": dtype, "enforce_eager": eager,
                    "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True,
                         "detokenize": False, "logprobs": 1}}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """``(SharedEngines, {key: (oracle checkpoint, prompts)})``: block FP8 compiled in
    float32 (one linear left in float by ``ignored_layers``) and bf16 on the
    simulator, per-tensor FP8 with static activation scales on the virtual GCU;
    llmcompressor's FP8_DYNAMIC Qwen3-MoE compiled and block-FP8 DeepSeek-V3 on the
    simulator, a per-tensor Mixtral on the virtual GCU; gpt-oss with MXFP4 experts on
    both."""
    root = tmp_path_factory.mktemp("fp8")
    src = build_tiny_model(root / "float", num_heads=2, num_kv_heads=2, head_dim=64,
                           hidden_size=128, norm_spread=0.3, head_std=0.2)
    rng = random.Random("fp8")
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 11, 40)]
    write_fp8_checkpoint(src, root / "block", root / "block-dq", block=[128, 128],
                         ignored=("model.layers.1.mlp.down_proj",))
    write_fp8_checkpoint(src, root / "tensor", root / "tensor-dq", block=None)
    # MoE: Mixtral's experts with per-tensor scales (DeepSeek-V3's below: blocks)
    qwen3 = build_tiny_moe(root / "qwen3_moe", "qwen3_moe", moe_intermediate_size=64)
    mixtral = build_tiny_moe(root / "mixtral", "mixtral")
    write_fp8_checkpoint(mixtral, root / "moe-tensor", root / "moe-tensor-dq", block=None)
    # llmcompressor's FP8_DYNAMIC (per-channel weights) on the Qwen3-MoE
    write_fp8_checkpoint(qwen3, root / "ct-moe", root / "ct-moe-dq", block=None,
                         ct_preset="FP8_DYNAMIC")
    # DeepSeek-V3 in 32 x 32 blocks: MLA's projections (q_a and kv_a merged), the
    # dense first layer, shared and routed experts; the router left in float
    deepseek = build_tiny(root / "deepseek_v3", "deepseek_v3")
    write_fp8_checkpoint(deepseek, root / "ds-block", root / "ds-block-dq", block=[32, 32])
    # gpt-oss with MXFP4 experts
    oss = build_tiny_moe(root / "gpt_oss", "gpt_oss")
    write_mxfp4_checkpoint(oss, root / "mxfp4", root / "mxfp4-dq")
    specs = {"block-fp32": (_spec(root / "block", prompts, "float32", eager=False), None),
             "mxfp4-sim": (_spec(root / "mxfp4", prompts, "float32", eager=False), None),
             # (eager: its dequantized graph is the float DeepSeek-V3's, which
             # test_attention_models.py compiles; FP8 compiles in the cases above)
             "deepseek-v3-block": (_spec(root / "ds-block", prompts, "float32", eager=True),
                                   None),
             "mxfp4-virtual": (_spec(root / "mxfp4", prompts, "float32", eager=True),
                               VIRTUAL_GCU_ENV),
             "block-bf16": (_spec(root / "block", prompts, "bfloat16", eager=False), None),
             "ct-moe": (_spec(root / "ct-moe", prompts, "float32", eager=False), None),
             "tensor-virtual": (_spec(root / "tensor", prompts, "float32", eager=True),
                                VIRTUAL_GCU_ENV),
             "moe-tensor-virtual": (_spec(root / "moe-tensor", prompts, "float32", eager=True),
                                    VIRTUAL_GCU_ENV)}
    cases = {"block-fp32": (root / "block-dq", prompts), "block-bf16": (root / "block-dq", prompts),
             "mxfp4-sim": (root / "mxfp4-dq", prompts),
             "mxfp4-virtual": (root / "mxfp4-dq", prompts),
             "deepseek-v3-block": (root / "ds-block-dq", prompts),
             "ct-moe": (root / "ct-moe-dq", prompts),
             "tensor-virtual": (root / "tensor-dq", prompts),
             "moe-tensor-virtual": (root / "moe-tensor-dq", prompts)}
    return SharedEngines(specs, root), cases


def _served(engine, dtype: str, layers: int, moe_layers: int = 0,
            method: str = "gcu_fp8"):
    results, log = engine
    assert results["platform"] == "AccelPlatform"
    assert f"quantization={method}" in log
    assert (f"gcu_fp8: {layers} fp8 linears and the experts of {moe_layers} MoE layers "
            f"dequantized at load to {dtype}") in log
    return results, log


@pytest.mark.engine
@pytest.mark.parametrize("key", ["block-fp32", "tensor-virtual"])
def test_engine_fp8_float32_matches_hf(key, engines):
    """Teacher-forced vs HF float64 on the dequantized weights: HF's top-1, log-probs
    within 2e-3 nats (the weights are the oracle's, rounded to float32 alike)."""
    shared, cases = engines
    # 2 layers x (qkv, o, gate_up, down), less the ignored down_proj of layer 1
    results, log = _served(shared(key), "float32", 7 if key.startswith("block") else 8)
    if key == "block-fp32":
        assert "Warming up model for the compilation" in log
    model, prompts = cases[key]
    assert_matches_hf(model, prompts, results["outputs"])


@pytest.mark.engine
def test_engine_fp8_bf16_compiled_runs_the_bf16_layer(engines):
    """bf16 on the simulator: the dequantized layers are plain bf16 linears, so the
    decoder layers run as the one C++ op of a bf16 model where that kernel is built;
    tokens near HF's on the same bf16 weights."""
    from vllm_accel.ops.cpu_native import bf16_linear

    shared, cases = engines
    results, log = _served(shared("block-bf16"), "bfloat16", 7)
    if bf16_linear.available():
        assert "each runs as one C++ op (vllm_accel::cpu_decoder_layer), 2 layers" in log
    model, prompts = cases["block-bf16"]
    # bf16 activations rounded at every stage of the 2 layers, each by up to 2^-8 of
    # logits of magnitude up to ~6 here (head_std 0.2): a few hundredths of a nat
    # apiece, and the AVX2 and AVX512-BF16 kernels round differently (0.055 seen held
    # to AVX2)
    assert_bf16_tokens_near_hf(model, prompts, results["outputs"], nats=0.1)


@pytest.mark.engine
def test_engine_fp8_moe_matches_hf(engines):
    """Mixtral's FP8 experts (per-tensor scales, one for w1 and w3 each) and attention
    linears dequantized, on the virtual GCU: teacher-forced vs HF float64 on the
    dequantized checkpoint."""
    shared, cases = engines
    key = "moe-tensor-virtual"
    results, log = _served(shared(key), "float32", 4, moe_layers=2)  # qkv, o per layer
    model, prompts = cases[key]
    assert_matches_hf(model, prompts, results["outputs"])


@pytest.mark.engine
def test_engine_compressed_tensors_fp8_dynamic_moe_matches_hf(engines):
    """llmcompressor's FP8_DYNAMIC export of the Qwen3-MoE (per-channel fp8 weights,
    dynamic fp8 activations, routers ignored), compiled: the compressed-tensors config
    hands its linears and experts to the fp8 methods; teacher-forced vs HF float64 on
    the dequantized checkpoint."""
    shared, cases = engines
    results, log = _served(shared("ct-moe"), "float32", 4, moe_layers=2,
                           method="gcu_compressed_tensors")
    model, prompts = cases["ct-moe"]
    assert_matches_hf(model, prompts, results["outputs"])


@pytest.mark.engine
@pytest.mark.parametrize("key", ["mxfp4-sim", "mxfp4-virtual"])
def test_engine_gpt_oss_mxfp4_matches_hf(key, engines):
    """A gpt-oss checkpoint with MXFP4 experts (swigluoai, biases, sinks, windows): its
    experts dequantized into the plugin's unquantized experts, compiled on the simulator
    (the C++ experts op) and eager on the virtual GCU; teacher-forced vs HF float64 on
    the dequantized checkpoint."""
    shared, cases = engines
    results, log = shared(key)
    assert ("Warming up model for the compilation" in log) == (key == "mxfp4-sim")
    assert results["platform"] == "AccelPlatform" and "quantization=gcu_mxfp4" in log
    assert "gcu_mxfp4: the experts of 2 MoE layers dequantized at load to float32" in log
    model, prompts = cases[key]
    assert_matches_hf(model, prompts, results["outputs"])


@pytest.mark.engine
def test_engine_deepseek_v3_fp8_matches_hf(engines):
    """DeepSeek-V3's FP8 layout (block scales on MLA's projections, q_a and kv_a merged,
    the dense layer, shared and routed experts; the router in float): MLA's
    absorbed weights are made from the dequantized kv_b_proj; teacher-forced vs HF
    float64 on the dequantized checkpoint."""
    shared, cases = engines
    # layer 0: fused qkv_a, q_b, kv_b, o, gate_up, down; layer 1: the four attention
    # projections and the shared expert's two
    results, log = _served(shared("deepseek-v3-block"), "float32", 12, moe_layers=1)
    model, prompts = cases["deepseek-v3-block"]
    assert_matches_hf(model, prompts, results["outputs"])
