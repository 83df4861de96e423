"""The MoE kernels (ops/*/moe.py) against the float64 oracle (reference/moe.py), and
the oracle's routing against HF transformers' DeepSeek routers."""

import pytest
import torch

from vllm_accel.ops.cpu_native import moe as native_moe
from vllm_accel.ops.reference import moe as reference_moe
from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import moe as _torch_fast  # noqa: F401  (registers)

EXPERT_PROVIDERS = ["torch_fast", "cpu_native"]
#: unit roundoff of each dtype
UNIT = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
# (tokens, experts, hidden, intermediate, top_k): hidden 48 and intermediate 24 are
# not multiples of 32 (vLLM's CPU experts refuse them); 0 tokens (a DP rank's dummy batch)
SHAPES = [(1, 8, 64, 32, 2), (7, 8, 48, 24, 2), (33, 16, 128, 64, 4), (0, 4, 32, 16, 2)]


def _experts(e, h, i, dtype, gen, bias=False):
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
    b13 = (torch.randn(e, 2 * i, generator=gen) * 0.1).to(dtype) if bias else None
    b2 = (torch.randn(e, h, generator=gen) * 0.1).to(dtype) if bias else None
    return w13, w2, b13, b2


def _routing(m, e, k, gen):
    logits = torch.randn(m, e, generator=gen) * 2
    return get_kernel("moe_route", "reference")(logits, k, renormalize=True)


def _max_error(dtype: torch.dtype, k: int) -> float:
    """Error bound relative to an output row's largest entry: an expert rounds to
    ``dtype`` at its gate/up, activation and down outputs (each error at most a unit of
    the row's scale after the down projection's sums, with a factor 2 for the
    activation's slope), the k weighted outputs (weights summing to 1) add in float32,
    and the sum is rounded once more: (3 * 2 + 1) units per expert, k experts."""
    return (7 * k + 1) * UNIT[dtype] if dtype != torch.float32 else 1e-5


@pytest.mark.parametrize("provider", EXPERT_PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai"])
def test_experts_match_the_float64_oracle(provider, dtype, shape, activation):
    m, e, h, i, k = shape
    gen = torch.Generator().manual_seed(m * 131 + e + h + i)
    x = torch.randn(m, h, generator=gen).to(dtype)
    w13, w2, _, _ = _experts(e, h, i, dtype, gen)
    weights, ids = _routing(m, e, k, gen)
    got = get_kernel("moe_experts", provider)(x, w13, w2, weights, ids, activation=activation)
    want = reference_moe.moe_experts(x, w13, w2, weights, ids, activation=activation,
                                     compute_dtype=torch.float64)
    assert got.shape == (m, h) and got.dtype == dtype
    if m:
        scale = want.double().abs().amax(dim=1, keepdim=True)
        err = (got.double() - want.double()).abs()
        assert bool((err <= _max_error(dtype, k) * scale).all()), float((err / scale).max())


def test_swigluoai_is_vllms():
    """The oracle's swigluoai is vLLM's ``SwigluOAIAndMul`` (gpt-oss: gate and up
    interleaved, both clamped at 7), across the clamps."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.activation import SwigluOAIAndMul

    h = torch.linspace(-12, 12, 2 * 97, dtype=torch.float64).reshape(1, -1)
    h = torch.cat([h, h.flip(-1), torch.randn(5, 194, dtype=torch.float64) * 4])
    with set_current_vllm_config(VllmConfig()):
        want = SwigluOAIAndMul().forward_native(h)
    assert torch.equal(reference_moe.gated_activation(h, "swigluoai"), want)


@pytest.mark.parametrize("provider", EXPERT_PROVIDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).split(".")[-1])
def test_expert_map_bias_and_weight_on_input(provider, dtype):
    """Expert parallel (this rank holds experts 1, 3, 4, 6 of 8 in slots 0-3: the others'
    choices add nothing), expert biases, and the router weight applied to the input
    (Llama 4's top-1)."""
    m, e, h, i = 19, 8, 64, 32
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, h, generator=gen).to(dtype)
    held = [1, 3, 4, 6]
    expert_map = torch.full((e,), -1, dtype=torch.int32)
    expert_map[held] = torch.arange(len(held), dtype=torch.int32)
    w13, w2, b13, b2 = _experts(e, h, i, dtype, gen, bias=True)
    for k, on_input in ((2, False), (1, True)):
        weights, ids = _routing(m, e, k, gen)
        local = dict(w13=w13[held], w2=w2[held], w13_bias=b13[held], w2_bias=b2[held])
        got = get_kernel("moe_experts", provider)(
            x, local["w13"], local["w2"], weights, ids, expert_map=expert_map,
            apply_router_weight_on_input=on_input, w13_bias=local["w13_bias"],
            w2_bias=local["w2_bias"])
        # the oracle on all 8 experts with the others' weights zeroed
        mask = torch.isin(ids, torch.tensor(held))
        want = reference_moe.moe_experts(x, w13, w2, weights * mask, ids,
                                         apply_router_weight_on_input=on_input,
                                         w13_bias=b13, w2_bias=b2)
        if on_input:  # a zero-weighted input still passes the biases: drop those rows
            want = torch.where(mask.any(1, keepdim=True), want, torch.zeros_like(want))
        scale = want.double().abs().amax(dim=1, keepdim=True)
        err = (got.double() - want.double()).abs()
        assert bool((err <= _max_error(dtype, 2) * scale).all()), (k, float(err.max()))


def test_cpu_native_is_one_op_call_per_layer(monkeypatch):
    """The simulator's provider is the C++ op (it counts the experts each call ran)."""
    from conftest import kernel_calls

    assert native_moe.NATIVE_DISPATCH
    calls = kernel_calls(monkeypatch, "cpu_moe_experts", "", 0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w13, w2, _, _ = _experts(8, 64, 32, torch.bfloat16, gen)
    ids = torch.tensor([[0, 5], [5, 2], [0, 2]], dtype=torch.int32)
    get_kernel("moe_experts", "cpu_native")(x, w13, w2, torch.ones(3, 2), ids)
    assert calls() == (1, 3)  # one call, experts 0, 2, 5


def test_cpu_native_rejects_an_expert_id_outside_the_layer():
    gen = torch.Generator().manual_seed(0)
    w13, w2, _, _ = _experts(4, 32, 16, torch.float32, gen)
    with pytest.raises(RuntimeError, match="expert id 9 outside"):
        native_moe.cpu_moe_experts(torch.randn(1, 32), w13, w2, torch.ones(1, 1),
                                   torch.tensor([[9]], dtype=torch.int32), None, None, None,
                                   None, None, "silu", False)


# ---------------------------------------------------------------------------
# routing
# ---------------------------------------------------------------------------

ROUTINGS = {
    # name: kwargs of moe_route
    "softmax-renorm": dict(renormalize=True),  # Mixtral, Qwen3-MoE
    "softmax": dict(renormalize=False),  # Qwen2-MoE
    "sigmoid-renorm": dict(renormalize=True, scoring_func="sigmoid"),
    # DeepSeek-V2: group-limited softmax, no renormalisation, scaled
    "grouped-softmax": dict(renormalize=False, num_expert_group=4, topk_group=2,
                            routed_scaling_factor=16.0),
    # DeepSeek-V3: sigmoid with a correction bias, groups scored by their top two
    "grouped-sigmoid-bias": dict(renormalize=True, scoring_func="sigmoid", num_expert_group=4,
                                 topk_group=2, routed_scaling_factor=2.5, bias=True),
}


@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_torch_fast_routing_is_the_oracle_in_float32(routing):
    kwargs = dict(ROUTINGS[routing])
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(57, 16, generator=gen) * 2
    if kwargs.pop("bias", False):
        kwargs["e_score_correction_bias"] = torch.randn(16, generator=gen) * 0.5
    w64, ids64 = get_kernel("moe_route", "reference")(logits, 4, **kwargs)
    w32, ids32 = get_kernel("moe_route", "torch_fast")(logits, 4, **kwargs)
    assert ids32.dtype == torch.int32 and w32.dtype == torch.float32
    order64, order32 = ids64.sort(1), ids32.sort(1)
    assert torch.equal(order64.values, order32.values)
    assert torch.allclose(w64.gather(1, order64.indices), w32.gather(1, order32.indices),
                          rtol=1e-6, atol=1e-7)
    if kwargs.get("renormalize"):
        scale = kwargs.get("routed_scaling_factor", 1.0)
        assert torch.allclose(w64.sum(1), torch.full((57,), scale), rtol=1e-6)
    if kwargs.get("num_expert_group"):  # every choice lies in the topk_group best groups
        for row in ids64 // 4:
            assert len(set(row.tolist())) <= kwargs["topk_group"]


def _hf_router(kind: str):
    import transformers

    common = dict(hidden_size=32, num_experts_per_tok=4, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5)
    if kind == "v3":
        config = transformers.DeepseekV3Config(n_routed_experts=16, norm_topk_prob=True, **common)
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
        router = DeepseekV3TopkRouter(config)
    else:
        config = transformers.DeepseekV2Config(n_routed_experts=16,
                                               topk_method="group_limited_greedy", **common)
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
        router = DeepseekV2TopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen) * 0.5)
        if kind == "v3":
            router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    return router, torch.randn(40, 32, generator=gen)


@pytest.mark.parametrize("kind", ["v2", "v3"])
@pytest.mark.parametrize("provider", ["reference", "torch_fast"])
def test_routing_matches_hf_deepseek_routers(kind, provider):
    """DeepSeek-V2's group-limited greedy softmax routing and V3's noaux_tc sigmoid
    routing (bias for the choice only, groups by their top two, renormalised, scaled):
    the experts and weights HF's router modules give."""
    router, hidden = _hf_router(kind)
    with torch.no_grad():
        logits, hf_weights, hf_ids = router(hidden)
    weights, ids = get_kernel("moe_route", provider)(
        logits, 4, renormalize=kind == "v3", scoring_func="sigmoid" if kind == "v3" else "softmax",
        num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
        e_score_correction_bias=router.e_score_correction_bias if kind == "v3" else None)
    ours, theirs = ids.long().sort(1), hf_ids.sort(1)
    assert torch.equal(ours.values, theirs.values)
    assert torch.allclose(weights.gather(1, ours.indices), hf_weights.gather(1, theirs.indices),
                          rtol=1e-5, atol=1e-6)
