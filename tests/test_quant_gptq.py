"""GPTQ checkpoints through ``gcu_gptq`` (vllm_accel.quant.gptq).

Oracles:
* format: the test quantizer's packing (tests/quantizer.py) round-trips and agrees
  with vLLM's own packing helpers (``quant_utils``).
* kernel: ``x @ W.T`` in float64, with ``W`` dequantized from the checkpoint
  tensors unpacked by the quantizer (independent of the library's unpacking).
* vLLM layers: QKV / gate_up / row-parallel layers loaded through vLLM's own
  weight loaders (shard merging) vs the same float64 oracle.
* config: vLLM's ``ModelConfig`` resolves a GPTQ checkpoint to ``gcu_gptq``.
* engine: a tiny Llama quantized by the test quantizer, served by vLLM with our
  method, vs HF transformers greedy on the dequantized float checkpoint.
"""

import json

import pytest
import torch

from conftest import (SharedEngines, add_default_model_engine, build_tiny_model, greedy_spec,
                      hf_greedy, tiny_quant_source)
from quantizer import pack_int32, quantize_checkpoint, quantize_weight, unpack_int32

from vllm_accel.ops.registry import get_kernel, providers_of
from vllm_accel.quant import gptq as G
from vllm_accel.quant import packed

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def oracle_weight(packed: dict, bits: int, fmt: str = "gptq") -> torch.Tensor:
    """float64 ``[out, in]`` from the on-disk tensors, unpacked by the quantizer."""
    q = unpack_int32(packed["qweight"], bits, dim=0).long()  # [in, out]
    z = unpack_int32(packed["qzeros"], bits, dim=1).long() + (1 if fmt == "gptq" else 0)
    g = packed["g_idx"].long()
    return ((q - z[g]).double() * packed["scales"].double()[g]).t()


def check_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, dtype: torch.dtype,
                bias: torch.Tensor | None = None):
    """``y`` vs float64 ``x @ w.T (+ bias)``. Bounds: fp32 accumulation error scales with
    ``|x| @ |w|.T`` (2e-5 of it, i.e. a few hundred ulps over K <= 512); bf16/fp16
    outputs are additionally rounded once (4e-3 / 1e-3 relative)."""
    xd = x.double().reshape(-1, x.shape[-1])
    ref = xd @ w.t() + (0 if bias is None else bias.double())
    scale = xd.abs() @ w.abs().t()
    rel = {torch.float32: 0.0, torch.bfloat16: 4e-3, torch.float16: 1e-3}[dtype]
    err = (y.double().reshape(ref.shape) - ref).abs()
    bound = rel * ref.abs() + 2e-5 * scale + 1e-6
    assert y.dtype == dtype
    assert bool((err <= bound).all()), f"max err {err.max():.3e}, worst ratio {(err / bound).max():.2f}"


# ---------------------------------------------------------------------------
# format level
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_pack_roundtrip_and_vllm_helpers(bits):
    from vllm.model_executor.layers.quantization.utils import quant_utils as qu
    from vllm.scalar_type import scalar_types

    gen = torch.Generator().manual_seed(bits)
    k, n = 64, 48
    q = torch.randint(0, 2**bits, (k, n), generator=gen, dtype=torch.int32)
    rows, cols = pack_int32(q, bits, dim=0), pack_int32(q, bits, dim=1)
    assert rows.dtype == torch.int32 and rows.shape == (k * bits // 32, n)
    assert cols.shape == (k, n * bits // 32)
    assert torch.equal(unpack_int32(rows, bits, dim=0), q)
    assert torch.equal(unpack_int32(cols, bits, dim=1), q)
    # the library's own unpacking
    assert torch.equal(packed.unpack_int32(rows, bits, dim=0), q)
    assert torch.equal(packed.unpack_int32(cols, bits, dim=1), q)
    # vLLM's packing helpers (GPTQ qweight = pack_rows, qzeros = pack_cols)
    assert torch.equal(qu.gptq_pack(q, bits, k, n), rows)
    assert torch.equal(qu.pack_cols(q, bits, k, n), cols)
    assert torch.equal(qu.unpack_cols(cols, bits, k, n), q)
    wtype = scalar_types.uint4 if bits == 4 else scalar_types.uint8
    assert torch.equal(qu.pack_quantized_values_into_int32(q, wtype, packed_dim=0), rows)
    assert torch.equal(qu.unpack_quantized_values_into_int32(rows, wtype, packed_dim=0), q)


@pytest.mark.parametrize("bits,group_size,sym,desc_act",
                         [(4, 32, False, True), (4, -1, True, False), (8, 64, True, True),
                          (8, 32, False, False)])
def test_quantizer_tensors(bits, group_size, sym, desc_act):
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(40, 128, generator=gen) * 0.1
    perm = torch.randperm(128, generator=gen) if desc_act else None
    qw = quantize_weight(w, bits, group_size, sym, perm=perm)
    gs = 128 if group_size == -1 else group_size
    n_groups = 128 // gs
    assert torch.bincount(qw.g_idx.long(), minlength=n_groups).tolist() == [gs] * n_groups
    if perm is not None:  # groups formed in act order
        assert torch.equal(qw.g_idx[perm].long(), torch.arange(128) // gs)
    else:
        assert torch.equal(qw.g_idx.long(), torch.arange(128) // gs)
    if sym:
        assert bool((qw.zeros == 2 ** (bits - 1)).all())
    # RTN error: within one quantization step of the group's scale
    step = qw.scales.float()[qw.g_idx.long()].t()
    assert bool(((w - qw.dequantize()).abs() <= step * 1.0001).all())
    packed = qw.pack("gptq")
    assert packed["qweight"].shape == (128 * bits // 32, 40)
    assert packed["qzeros"].shape == (n_groups, 40 * bits // 32)
    assert packed["scales"].dtype == torch.float16 and packed["g_idx"].dtype == torch.int32
    # v1 stores zero - 1; v2 stores zero
    assert torch.equal(unpack_int32(packed["qzeros"], bits, dim=1) + 1, qw.zeros)
    v2 = qw.pack("gptq_v2")
    assert torch.equal(unpack_int32(v2["qzeros"], bits, dim=1), qw.zeros)
    assert torch.equal(oracle_weight(packed, bits).float(), qw.dequantize())


@pytest.fixture(scope="module")
def tiny_gptq(tmp_path_factory):
    """Tiny Llama (hidden 128, head_dim 32, 4 heads / 2 kv heads, 2 layers),
    quantized 4-bit group 32 asym act-order, plus its dequantized oracle."""
    root = tmp_path_factory.mktemp("gptq")
    src = build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    layers = quantize_checkpoint(src, root / "gptq", bits=4, group_size=32, sym=False,
                                 desc_act=True, dequant_dst=root / "dequant", seed=0)
    return root, layers


def test_checkpoint_files(tiny_gptq):
    from safetensors.torch import load_file

    root, layers = tiny_gptq
    config = json.loads((root / "gptq" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "sym": False,
        "checkpoint_format": "gptq", "static_groups": False, "true_sequential": True,
        "damp_percent": 0.01, "lm_head": False}
    qc = json.loads((root / "gptq" / "quantize_config.json").read_text())
    assert qc["bits"] == 4 and qc["checkpoint_format"] == "gptq"
    assert "quantization_config" not in json.loads((root / "dequant" / "config.json").read_text())
    state = load_file(root / "gptq" / "model.safetensors")
    assert len(layers) == 2 * 7
    q = "model.layers.0.self_attn.q_proj"
    assert state[f"{q}.qweight"].shape == (16, 128) and state[f"{q}.qweight"].dtype == torch.int32
    assert state[f"{q}.qzeros"].shape == (4, 16)
    assert state[f"{q}.scales"].shape == (4, 128)
    assert state[f"{q}.g_idx"].shape == (128,)
    assert f"{q}.weight" not in state and "lm_head.weight" in state
    assert state["model.layers.1.mlp.down_proj.qweight"].shape == (256 // 8, 128)
    # q/k/v (and gate/up) share an act order, as in real GPTQ; o_proj has its own
    gi = {n: state[f"model.layers.0.{n}.g_idx"] for n in
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj")}
    assert torch.equal(gi["self_attn.q_proj"], gi["self_attn.k_proj"])
    assert not torch.equal(gi["self_attn.q_proj"], gi["self_attn.o_proj"])
    dq = load_file(root / "dequant" / "model.safetensors")
    assert torch.equal(dq[f"{q}.weight"], layers[q].dequantize())


# ---------------------------------------------------------------------------
# kernel level
# ---------------------------------------------------------------------------

# (out, in, group_size, tile_k): odd group counts (3, 5, 7), a single group,
# tiles narrower than a group, and tiles spanning several groups.
SHAPES = [(24, 96, 32, 512), (40, 160, 32, 64), (16, 448, 64, 96), (32, 128, -1, 48),
          (8, 256, 128, 512)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gptq_linear_kernel(bits, sym, desc_act, shape, dtype):
    out, k, group_size, tile_k = shape
    gen = torch.Generator().manual_seed(hash((bits, sym, desc_act, shape)) % 2**31)
    w = torch.randn(out, k, generator=gen) * 0.05
    perm = torch.randperm(k, generator=gen) if desc_act else None
    packed = quantize_weight(w, bits, group_size, sym, perm=perm).pack("gptq")
    res = G.gptq_to_resident(packed["qweight"], packed["qzeros"], packed["scales"],
                             packed["g_idx"], bits=bits, group_size=group_size)
    assert (res.perm is not None) == (desc_act and group_size != -1)
    assert (res.zeros is None) == sym and res.g_idx is None
    x = torch.randn(3, 5, k, generator=gen).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    y = get_kernel("wint_linear")(x, res.qweight, res.scales, res.zeros, bits=bits,
                                  group_size=res.group_size, perm=res.perm, bias=bias,
                                  tile_k=tile_k)
    assert y.shape == (3, 5, out)
    check_close(y, x, oracle_weight(packed, bits), dtype, bias)


def test_kernel_uneven_groups_and_fp16():
    """General g_idx path (groups of uneven sizes, as a row-parallel rank sees
    under act-order) and fp16 activations."""
    gen = torch.Generator().manual_seed(7)
    out, k, n_groups, bits = 24, 96, 5, 4
    g_idx = torch.randint(0, n_groups, (k,), generator=gen)
    codes = torch.randint(0, 16, (out, k), generator=gen)
    zeros = torch.randint(0, 16, (out, n_groups), generator=gen).to(torch.float16)
    scales = (torch.rand(out, n_groups, generator=gen) * 0.02 + 0.001).to(torch.float16)
    perm = torch.argsort(g_idx, stable=True)
    w = (codes - zeros.double()[:, g_idx]) * scales.double()[:, g_idx]
    x = torch.randn(4, k, generator=gen).to(torch.float16)
    y = packed.wint_linear(x, G.pack_nibbles(codes[:, perm]), scales, zeros, bits=bits,
                      group_size=32, perm=perm, g_idx=g_idx[perm].to(torch.int32), tile_k=40)
    check_close(y, x, w, torch.float16)


def test_resident_layout_and_v2():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=gen) * 0.05
    perm = torch.randperm(128, generator=gen)
    qw = quantize_weight(w, 4, 32, False, perm=perm, min_zero=0)
    v2 = qw.pack("gptq_v2")
    res = G.gptq_to_resident(v2["qweight"], v2["qzeros"], v2["scales"].float(), v2["g_idx"],
                             bits=4, group_size=32, checkpoint_format="gptq_v2")
    nb = res.nbytes()
    # 4-bit codes two per byte; fp16 scales/zeros per (out, group); int64 perm
    assert res.qweight.dtype == torch.uint8 and nb["qweight"] == 64 * 128 // 2
    assert res.scales.dtype == torch.float16 and nb["scales"] == nb["zeros"] == 64 * 4 * 2
    assert nb["perm"] == 128 * 8
    x = torch.randn(2, 128, generator=gen)
    y = packed.wint_linear(x, res.qweight, res.scales, res.zeros, bits=4, group_size=32,
                      perm=res.perm)
    check_close(y, x, oracle_weight(v2, 4, fmt="gptq_v2"), torch.float32)
    # absent g_idx (all -1, the loader's placeholder) = contiguous groups
    res2 = G.gptq_to_resident(v2["qweight"], v2["qzeros"], v2["scales"],
                              torch.full((128,), -1, dtype=torch.int32), bits=4, group_size=32,
                              checkpoint_format="gptq_v2")
    assert res2.perm is None
    assert "reference" in providers_of("wint_linear")


# ---------------------------------------------------------------------------
# vLLM config and layers (no engine)
# ---------------------------------------------------------------------------


def test_config_override_and_validation():
    cfg_dict = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True,
                "sym": False, "checkpoint_format": "gptq"}
    C = G.AccelGPTQConfig
    assert C.override_quantization_method(cfg_dict, None) == "gcu_gptq"
    assert C.override_quantization_method(cfg_dict, "gptq") == "gcu_gptq"
    assert C.override_quantization_method(cfg_dict, "auto_gptq") is None  # explicit choice
    assert C.override_quantization_method({"quant_method": "awq"}, None) is None
    assert C.get_min_capability() == -1
    assert set(C.get_supported_act_dtypes()) == {torch.float32, torch.bfloat16, torch.float16}
    cfg = C.from_config(cfg_dict)
    assert cfg.layer_params("model.layers.0.mlp.down_proj") == G.GPTQLayerParams(4, 32, True, False, "gptq")
    # GPTQModel dynamic rules: skip, or override per layer
    dyn = C.from_config({**cfg_dict, "dynamic": {"-:.*down_proj": {},
                                                 r"+:.*\.1\..*": {"bits": 8, "group_size": 64}}})
    assert dyn.layer_params("model.layers.0.mlp.down_proj") is None
    assert dyn.layer_params("model.layers.1.mlp.gate_up_proj").bits == 8
    for bad, msg in ((dict(bits=3), "3-bit"), (dict(checkpoint_format="marlin"), "marlin")):
        with pytest.raises(ValueError, match=f"model.layers.0.mlp.down_proj.*{msg}.*Fix:"):
            C.from_config({**cfg_dict, **bad}).layer_params("model.layers.0.mlp.down_proj")
    assert list(C.get_checkpoint_weight_mapper().apply([("a.g_idx", 1)])) == [("a.g_idx", 1)]


def test_model_config_resolves_gcu_gptq(tiny_gptq):
    from vllm.config import ModelConfig

    root, _ = tiny_gptq
    for user in (None, "gptq"):
        mc = ModelConfig(model=str(root / "gptq"), skip_tokenizer_init=True, dtype="float32",
                         quantization=user)
        assert mc.quantization == "gcu_gptq", user
    # the quantized layers are learnt from the checkpoint's int32 tensors
    cfg = G.AccelGPTQConfig.from_config(mc.hf_config.quantization_config)
    cfg.maybe_update_config(str(root / "gptq"))
    assert "model.layers.1.self_attn.v_proj" in cfg.modules_in_block_to_quantize
    assert not any("lm_head" in m or "embed" in m for m in cfg.modules_in_block_to_quantize)


@pytest.fixture
def tp1(monkeypatch):
    """vLLM linear layers outside an engine: a single rank, no process groups.
    Pins the ``reference`` kernel provider, whose generic resident layout these
    layer tests inspect (an earlier in-process test may have set the simulator's
    preference for ``torch_fast``, whose prepared layout test_quant_torch_fast and
    the engine tests cover)."""
    monkeypatch.setenv("ACCEL_KERNEL_PROVIDER", "reference")
    import vllm.model_executor.layers.linear as L
    import vllm.model_executor.parameter as P
    from vllm.config import VllmConfig, set_current_vllm_config

    for mod in (L, P):
        monkeypatch.setattr(mod, "get_tensor_model_parallel_rank", lambda: 0)
        monkeypatch.setattr(mod, "get_tensor_model_parallel_world_size", lambda: 1)
    with set_current_vllm_config(VllmConfig()):
        yield L


def _load(layer, packed: dict, shard_id=None):
    for name, t in packed.items():
        p = getattr(layer, name)
        if shard_id is None:
            p.weight_loader(p, t)
        else:
            p.weight_loader(p, t, shard_id)


def test_vllm_layers_load_merged_shards(tp1, tiny_gptq):
    """qkv (q/k/v of different widths), gate_up and down through vLLM's weight
    loaders, from the tiny checkpoint's own layer 0, vs the float64 oracle."""
    L = tp1
    root, layers = tiny_gptq
    from safetensors.torch import load_file

    state = load_file(root / "gptq" / "model.safetensors")
    cfg = G.AccelGPTQConfig(bits=4, group_size=32, desc_act=True, sym=False)
    pre = "model.layers.0"

    def packed(name):
        return {s: state[f"{pre}.{name}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx")}

    x = torch.randn(5, 128)
    cases = [
        (L.QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=cfg,
                             prefix=f"{pre}.self_attn.qkv_proj", params_dtype=torch.float32),
         [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v")], x),
        (L.MergedColumnParallelLinear(128, [256, 256], bias=False, quant_config=cfg,
                                      prefix=f"{pre}.mlp.gate_up_proj",
                                      params_dtype=torch.float32),
         [("mlp.gate_proj", 0), ("mlp.up_proj", 1)], x),
        (L.RowParallelLinear(256, 128, bias=False, quant_config=cfg,
                             prefix=f"{pre}.mlp.down_proj", params_dtype=torch.float32),
         [("mlp.down_proj", None)], torch.randn(5, 256)),
    ]
    for layer, shards, inp in cases:
        assert type(layer.quant_method) is G.AccelGPTQLinearMethod
        for name, sid in shards:
            _load(layer, packed(name), sid)
        layer.quant_method.process_weights_after_loading(layer)
        names = {n for n, _ in layer.named_parameters()}
        assert names == {"wint.qweight", "wint.zeros", "wint.scales", "wint.perm"}, names
        assert layer.wint.qweight.dtype == torch.uint8
        w = torch.cat([oracle_weight(packed(n), 4) for n, _ in shards])
        check_close(layer(inp)[0], inp, w, torch.float32)


def test_merged_shards_with_different_act_order_raise(tp1):
    L = tp1
    cfg = G.AccelGPTQConfig(bits=8, group_size=32, desc_act=True, sym=True)
    layer = L.MergedColumnParallelLinear(64, [32, 32], bias=False, quant_config=cfg,
                                         prefix="model.layers.3.mlp.gate_up_proj",
                                         params_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    for sid in (0, 1):
        qw = quantize_weight(torch.randn(32, 64, generator=gen), 8, 32, True,
                             perm=torch.randperm(64, generator=gen))
        if sid == 0:
            _load(layer, qw.pack(), sid)
        else:
            with pytest.raises(ValueError, match="gate_up_proj.*different act-order.*Fix:"):
                _load(layer, qw.pack(), sid)


def test_group_size_must_divide_input(tp1):
    L = tp1
    cfg = G.AccelGPTQConfig(bits=4, group_size=64, desc_act=False, sym=True)
    with pytest.raises(ValueError, match="model.layers.0.mlp.down_proj.*group_size 64 does "
                                         "not divide.*96.*Fix:"):
        L.RowParallelLinear(96, 64, bias=False, quant_config=cfg,
                            prefix="model.layers.0.mlp.down_proj", params_dtype=torch.float32)


# ---------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------

ENGINE_CASES = {
    # name: (quantize kwargs, user --quantization, kernel provider); float32 models, for
    # which torch_fast keeps 4-bit weights in the generic layout (torch's int4 kernel
    # is a scalar loop for float32) and 8-bit ones run its tile op
    "w4-g32-asym-actorder": (dict(bits=4, group_size=32, sym=False, desc_act=True), None,
                             "torch_fast"),
    "w8-perchannel-sym": (dict(bits=8, group_size=-1, sym=True, desc_act=False), "gptq",
                          "torch_fast"),
    # the generic layout and the tile-dequantizing kernel, forced
    "w4-g32-asym-actorder-reference": (dict(bits=4, group_size=32, sym=False, desc_act=True),
                                       None, "reference"),
    # a bf16 model: torch_fast's int4 layout and torch's int4 kernel (what a card
    # without vendor GEMMs runs for bf16 models)
    "w4-g32-asym-actorder-bf16": (dict(bits=4, group_size=32, sym=False, desc_act=True), None,
                                  "torch_fast"),
}
RUNNING_KERNEL = {"w4-g32-asym-actorder": "wint_linear[reference] x8",
                  "w8-perchannel-sym": "wint_prepared_linear[torch_fast] x8",
                  "w4-g32-asym-actorder-reference": "wint_linear[reference] x8",
                  "w4-g32-asym-actorder-bf16": "wint_prepared_linear[torch_fast] x8"}
#: the cases whose engines run bf16: compared with HF fp32 by teacher-forced logprobs
#: (free-running greedy tokens drift apart at bf16's near-ties)
BF16_CASES = {"w4-g32-asym-actorder-bf16"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory, default_model):
    """Each tiny case's checkpoint and the default model's (4-bit group 64 asym
    act-order, the most involved GPTQ variant), and their engines: those of one kernel
    provider one after another in one process. ``(SharedEngines, {name: (dequantized
    checkpoint, prompts)})``."""
    from test_quant_awq import DEFAULT_PROMPTS

    root = tmp_path_factory.mktemp("gptq")
    specs, cases = {}, {}
    for case, (qkw, user_quant, provider) in ENGINE_CASES.items():
        src, prompts = tiny_quant_source(root, case)
        quantize_checkpoint(src, root / case / "gptq", dequant_dst=root / case / "dq", **qkw)
        cases[case] = (root / case / "dq", prompts)
        llm = {"quantization": user_quant} if user_quant else {}
        if case in BF16_CASES:
            llm["dtype"] = "bfloat16"
        specs[case] = (greedy_spec(root / case / "gptq", prompts, 16, max_model_len=256,
                                   logprobs=case in BF16_CASES, **llm),
                       {"ACCEL_KERNEL_PROVIDER": provider})
    quantize_checkpoint(default_model, root / "default" / "gptq", bits=4, group_size=64,
                        sym=False, desc_act=True, dequant_dst=root / "default" / "dq")
    add_default_model_engine(specs, cases, default_model, root / "default" / "gptq",
                             root / "default" / "dq", DEFAULT_PROMPTS, None)
    return SharedEngines(specs, root), cases


@pytest.mark.engine
@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_gptq_matches_hf_on_dequantized(case, engines):
    shared, cases = engines
    dequant, prompts = cases[case]
    results, log = shared(case)
    assert results["platform"] == "AccelPlatform"
    assert "quantization=gcu_gptq" in log
    running = next(line for line in log.splitlines() if "AccelGPTQLinearMethod serves" in line)
    assert RUNNING_KERNEL[case] in running and "kernels" in running, running
    assert "gcu_gptq qkv_proj" in log and "gcu_gptq down_proj" in log
    if case in BF16_CASES:
        from test_cpu_native_int4_gemv import BF16_LOGPROB_BOUND
        from test_quant_awq import logprob_gap

        gap = logprob_gap(dequant, prompts, results)
        print(f"{case}: max logprob gap vs HF fp32 {gap:.3e}")
        assert gap <= BF16_LOGPROB_BOUND
        return
    expected = hf_greedy(dequant, prompts, 16)
    got = [o["token_ids"] for o in results["outputs"]]
    pairs = [(a, b) for g, e in zip(got, expected) for a, b in zip(g, e)]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    print(f"{case}: {agree:.1%} of {len(pairs)} positions agree; exact sequences "
          f"{sum(g == e for g, e in zip(got, expected))}/{len(got)}")
    assert agree >= 0.9, (got, expected)


@pytest.mark.engine
def test_engine_gptq_default_model(engines, default_model):
    """SmolLM2-135M, GPTQ 4-bit group 64 asym act-order (the most involved GPTQ
    variant): 8 prompts x 32 greedy tokens vs HF on the dequantized weights."""
    from test_quant_awq import LOGPROB_BOUND, _agreement, logprob_gap
    from transformers import AutoTokenizer

    shared, cases = engines
    dequant, prompts = cases["default"]
    results, log = shared("default")
    assert "quantization=gcu_gptq" in log and "serves 120 gcu_gptq layers" in log
    expected = hf_greedy(dequant, prompts, 32)
    got = [o["token_ids"] for o in results["outputs"]]
    agree, n = _agreement(got, expected)
    gap = logprob_gap(dequant, prompts, results)
    print(f"gptq default model: {agree:.1%} of {n} positions agree; max logprob gap {gap:.2e}")
    tok = AutoTokenizer.from_pretrained(default_model)
    assert agree >= 0.9, [tok.decode(g) for g in got]
    assert gap <= LOGPROB_BOUND
