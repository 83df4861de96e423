"""Tensor parallel across simulated GCUs: two simulated devices, one worker
process each, gloo collectives, vs the same checkpoint at TP=1 and vs HF.

The model has 4 query / 2 KV heads (so each rank holds 2 query heads and one KV
head) and a wider hidden size (256) than the unit-test models, so the column-
and row-parallel shards are real matrices. Quantized checkpoints of the same model
cover the quantized paths under TP: GPTQ act-order (the row-parallel layers need
every group's scales on every rank), AWQ (packed columns split by output, groups by
input rows) and compressed-tensors W4A16 asym (packed zero points split along the
output dim). Every engine runs in one process, one after another (``SharedEngines``;
each TP=2 engine starts its own two workers); a quantized MoE checkpoint TP=2 must
refuse joins them. Marked ``tensor_parallel``: ``make test`` runs these on the whole
machine after the rest.
"""

import random

import pytest

from conftest import SharedEngines, build_tiny_model, run_engine
from moe_models import assert_matches_hf, build_tiny_moe
from quantizer import quantize_checkpoint, quantize_checkpoint_awq, quantize_checkpoint_ct
from test_moe_quant import _spec as moe_spec

#: each rank's simulated device: small, so two ranks' KV caches stay modest in host RAM
TP_ENV = {"ACCEL_SIM_DEVICE_MEMORY_GB": "1"}
#: checkpoint format -> (quantization method vLLM logs, writer of the checkpoint and
#: its dequantized float oracle, or None for the float model itself)
FORMATS = {
    "fp32": (None, None),
    "gptq4-actorder": ("gcu_gptq", lambda src, dst, dq: quantize_checkpoint(
        src, dst, bits=4, group_size=64, sym=False, desc_act=True, dequant_dst=dq)),
    "awq4": ("gcu_awq", lambda src, dst, dq: quantize_checkpoint_awq(
        src, dst, group_size=64, dequant_dst=dq)),
    "ct-w4a16-asym": ("gcu_compressed_tensors", lambda src, dst, dq: quantize_checkpoint_ct(
        src, dst, bits=4, group_size=64, symmetric=False, dequant_dst=dq)),
}
#: the quantized MoE case that TP=2 must refuse (its engine fails at startup)
MOE_ACT_ORDER = "moe-gptq4-actorder-tp2"
_RNG = random.Random(7)
PROMPTS = [[_RNG.randrange(3, 512) for _ in range(n)] for n in (5, 23, 64, 2, 120)]


def _spec(model, tp: int) -> dict:
    return {
        "llm": {"model": str(model), "dtype": "float32", "enforce_eager": True,
                "skip_tokenizer_init": True, "max_model_len": 256, "seed": 0,
                "tensor_parallel_size": tp},
        "prompts": PROMPTS,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
    }


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """format -> (checkpoint, its float oracle)."""
    root = tmp_path_factory.mktemp("tp")
    src = build_tiny_model(root / "float", num_heads=4, num_kv_heads=2, head_dim=64,
                           hidden_size=256, layers=2, seed=3, head_std=0.4)
    out = {}
    for fmt, (_, write) in FORMATS.items():
        if write is None:
            out[fmt] = (src, src)
        else:
            write(src, root / fmt, root / f"{fmt}-dequant")
            out[fmt] = (root / fmt, root / f"{fmt}-dequant")
    moe = build_tiny_moe(root / "moe-float", "qwen3_moe", seed=7)
    quantize_checkpoint(moe, root / "moe-q", bits=4, group_size=16, desc_act=True)
    out[MOE_ACT_ORDER] = (root / "moe-q", None)
    return out


@pytest.fixture(scope="module")
def engines(checkpoints, tmp_path_factory):
    specs = {f"{fmt}-tp{tp}": (_spec(checkpoints[fmt][0], tp), TP_ENV)
             for fmt in FORMATS for tp in (1, 2)}
    specs[MOE_ACT_ORDER] = (moe_spec(checkpoints[MOE_ACT_ORDER][0], [[1, 2, 3]], False,
                                     tensor_parallel_size=2), TP_ENV)
    return SharedEngines(specs, tmp_path_factory.mktemp("engines"))


@pytest.mark.engine
@pytest.mark.tensor_parallel
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_tp2_matches_tp1_and_hf(fmt, checkpoints, engines):
    """The same greedy tokens at TP=2 as at TP=1, and each TP=2 token HF float64's
    top-1 given the tokens before it (on the dequantized weights for quantized
    checkpoints), its log-prob within 2e-3 nats of HF's."""
    tp1, _ = engines(f"{fmt}-tp1")
    tp2, log = engines(f"{fmt}-tp2")
    # Two ranks, each with its own simulated device and memory budget.
    for rank in (0, 1):
        assert f"Device gcu:{rank} (sim) memory: capacity 1.0 GiB" in log
        assert f"Worker_TP{rank}" in log
    method = FORMATS[fmt][0]
    if method:
        assert f"quantization={method}" in log
    assert tp2["platform"] == "AccelPlatform"
    assert ([o["token_ids"] for o in tp2["outputs"]]
            == [o["token_ids"] for o in tp1["outputs"]])
    assert_matches_hf(checkpoints[fmt][1], PROMPTS, tp2["outputs"])


@pytest.mark.engine
@pytest.mark.tensor_parallel
def test_gptq_moe_tensor_parallel_act_order_fails_naming_the_fix(engines):
    """Act-order down projections of experts sharded by rows would need every group's
    scales on each rank: refused at startup, naming expert parallel as the fix."""
    with pytest.raises(AssertionError) as err:  # SharedEngines: this engine failed
        engines(MOE_ACT_ORDER)
    assert "act-order" in str(err.value) and "--enable-expert-parallel" in str(err.value)


@pytest.mark.engine
def test_pipeline_parallel_is_a_clear_error(tmp_path):
    model = build_tiny_model(tmp_path / "float")
    with pytest.raises(AssertionError) as failure:
        run_engine({
            "llm": {"model": str(model), "dtype": "float32", "enforce_eager": True,
                    "skip_tokenizer_init": True, "max_model_len": 128,
                    "pipeline_parallel_size": 2},
            "prompts": [[5, 6, 7]], "sampling": {"max_tokens": 2},
        }, tmp_path, env=TP_ENV)
    log = str(failure.value)
    assert "pipeline_parallel_size=2 is not supported" in log
    assert "--tensor-parallel-size" in log
