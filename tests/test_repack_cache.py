"""The on-disk repack cache (vllm_accel.quant.repack_cache).

Unit level: hit/miss by content (not by path), invalidation on a changed tensor
or parameter, disabling, corrupt entries, concurrent writers (separate
processes), and that a hit is faster than the conversion on a real-sized layer.
Engine level: a second start of the same checkpoint reuses every layer (logged),
and a checkpoint with one modified tensor repacks exactly that layer.
"""

import re
import time

import pytest
import torch

from conftest import build_tiny_model, run_engine
from quantizer import quantize_awq, quantize_checkpoint_awq, quantize_weight

from vllm_accel.quant import awq as A
from vllm_accel.quant import gptq as G
from vllm_accel.quant import repack_cache as RC


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "repack"
    monkeypatch.setenv("ACCEL_REPACK_CACHE", str(root))
    RC.stats.reset()
    yield root
    RC.stats.reset()


def _awq_sources(seed=0, out=64, k=128):
    gen = torch.Generator().manual_seed(seed)
    p = quantize_awq(torch.randn(out, k, generator=gen) * 0.05, 32).pack()
    p["scales"] = p["scales"].float()
    return p


def _convert_counter(src):
    calls = []

    def convert():
        calls.append(1)
        return A.awq_to_resident(src["qweight"], src["qzeros"], src["scales"], bits=4,
                                 group_size=32)

    return convert, calls


def _same(a, b):
    for name in ("qweight", "scales", "zeros", "perm", "g_idx"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and torch.equal(x, y), name
    assert (a.bits, a.group_size, a.in_features, a.out_features) == (
        b.bits, b.group_size, b.in_features, b.out_features)


def test_miss_then_hit_and_content_invalidation(cache):
    src = _awq_sources()
    convert, calls = _convert_counter(src)
    first = RC.cached_resident("awq", {"bits": 4, "group_size": 32}, src, convert)
    again = RC.cached_resident("awq", {"bits": 4, "group_size": 32},
                               {k: v.clone() for k, v in src.items()}, convert)
    assert len(calls) == 1 and (RC.stats.repacked, RC.stats.reused) == (1, 1)
    _same(first, again)
    assert len(list(cache.glob("awq-*.safetensors"))) == 1
    # one changed code -> a new key, a miss, a second entry
    changed = {k: v.clone() for k, v in src.items()}
    changed["qweight"][3, 1] ^= 0x10
    convert2, calls2 = _convert_counter(changed)
    RC.cached_resident("awq", {"bits": 4, "group_size": 32}, changed, convert2)
    assert len(calls2) == 1 and len(list(cache.glob("awq-*.safetensors"))) == 2
    # a changed conversion parameter is a different entry too
    RC.cached_resident("awq", {"bits": 4, "group_size": 64}, src, convert)
    assert len(calls) == 2
    # nothing left behind by the atomic writes
    assert not list(cache.glob(".*tmp"))


def test_key_is_content_not_path():
    src = _awq_sources()
    k1 = RC.content_key("awq", {"g": 32}, src)
    assert k1 == RC.content_key("awq", {"g": 32}, {k: v.clone() for k, v in src.items()})
    assert k1 != RC.content_key("gptq", {"g": 32}, src)
    other = _awq_sources(seed=1)
    assert k1 != RC.content_key("awq", {"g": 32}, other)
    # same bytes, different dtype/shape -> different key
    view = dict(src, qweight=src["qweight"].view(torch.float32))
    assert k1 != RC.content_key("awq", {"g": 32}, view)


def test_disabled(tmp_path, monkeypatch):
    for off in ("off", "0", ""):
        monkeypatch.setenv("ACCEL_REPACK_CACHE", off)
        assert RC.cache_dir() is None
    RC.stats.reset()
    src = _awq_sources()
    convert, calls = _convert_counter(src)
    for _ in range(2):
        RC.cached_resident("awq", {}, src, convert)
    assert len(calls) == 2 and RC.stats.reused == 0
    RC.stats.reset()


def test_corrupt_entry_is_a_miss_and_rewritten(cache):
    src = _awq_sources()
    convert, calls = _convert_counter(src)
    good = RC.cached_resident("awq", {}, src, convert)
    (entry,) = cache.glob("awq-*.safetensors")
    entry.write_bytes(entry.read_bytes()[:100])  # truncated
    again = RC.cached_resident("awq", {}, src, convert)
    assert len(calls) == 2
    _same(good, again)
    third = RC.cached_resident("awq", {}, src, convert)
    assert len(calls) == 2  # the rewritten entry is valid
    _same(good, third)


WRITER = """
import sys, torch
sys.path.insert(0, {tests!r})
from quantizer import quantize_awq
from vllm_accel.quant import awq as A, repack_cache as RC
gen = torch.Generator().manual_seed(0)
p = quantize_awq(torch.randn(64, 128, generator=gen) * 0.05, 32).pack()
p["scales"] = p["scales"].float()
res = RC.cached_resident("awq", {{}}, p, lambda: A.awq_to_resident(
    p["qweight"], p["qzeros"], p["scales"], bits=4, group_size=32))
print("SUM", int(res.qweight.long().sum()), RC.stats.reused, RC.stats.repacked)
"""


def test_concurrent_writers_same_key(tmp_path):
    """Separate processes (like TP ranks of replicated layers) writing one entry
    at once: each gets a correct result and the final entry is complete."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = WRITER.format(tests=str(Path(__file__).parent))
    env = {**os.environ, "ACCEL_REPACK_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    src = _awq_sources(0)
    expect = A.awq_to_resident(src["qweight"], src["qzeros"], src["scales"], bits=4,
                               group_size=32)
    sums = [int(next(line for line in o[0].splitlines() if line.startswith("SUM")).split()[1])
            for o in outs]
    assert sums == [int(expect.qweight.long().sum())] * 4
    (entry,) = tmp_path.glob("awq-*.safetensors")
    assert not list(tmp_path.glob(".*tmp"))
    got = RC._read(entry, RC.content_key("awq", {}, src))
    _same(got, expect)


def test_hit_is_faster_than_conversion(cache):
    """A 2048 x 2048 GPTQ act-order layer: reading the entry (hash + file read)
    beats unpacking/reordering/packing (best of 3 each)."""
    gen = torch.Generator().manual_seed(0)
    p = quantize_weight(torch.randn(2048, 2048, generator=gen) * 0.05, 4, 128, False,
                        perm=torch.randperm(2048, generator=gen)).pack()
    src = {"qweight": p["qweight"], "qzeros": p["qzeros"], "scales": p["scales"].float(),
           "g_idx": p["g_idx"]}

    def convert():
        return G.gptq_to_resident(src["qweight"], src["qzeros"], src["scales"], src["g_idx"],
                                  bits=4, group_size=128)

    conv_t, hit_t = [], []
    for _ in range(3):
        t = time.perf_counter()
        convert()
        conv_t.append(time.perf_counter() - t)
    RC.cached_resident("gptq", {}, src, convert)  # miss: writes the entry
    for _ in range(3):
        t = time.perf_counter()
        res = RC.cached_resident("gptq", {}, src, convert)
        hit_t.append(time.perf_counter() - t)
    assert RC.stats.reused == 3
    _same(res, convert())
    print(f"convert {min(conv_t) * 1e3:.1f} ms, cache hit {min(hit_t) * 1e3:.1f} ms")
    assert min(hit_t) < min(conv_t)


# ---------------------------------------------------------------------------
# engine
# ---------------------------------------------------------------------------

SUMMARY = re.compile(r"repack cache (\S+): (\d+) layers reused / (\d+) repacked \(([\w, -]+)\) "
                     r"in ([\d.]+) s")


def _start(model, tmp_path, cache_dir):
    results, log = run_engine({
        "llm": {"model": str(model), "dtype": "float32", "enforce_eager": True,
                "skip_tokenizer_init": True, "max_model_len": 128, "seed": 0},
        "prompts": [[5, 6, 7, 8, 9]],
        "sampling": {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True,
                     "detokenize": False},
    }, tmp_path, env={"ACCEL_REPACK_CACHE": str(cache_dir)})
    m = SUMMARY.search(log)
    assert m, log[-3000:]
    assert m.group(1) == str(cache_dir)
    print(m.group(0))
    return int(m.group(2)), int(m.group(3)), results["outputs"][0]["token_ids"]


@pytest.mark.engine
def test_engine_second_start_reuses_and_changed_checkpoint_repacks(tmp_path):
    from safetensors.torch import load_file, save_file

    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    model = tmp_path / "awq"
    quantize_checkpoint_awq(src, model, group_size=32)
    cache_dir = tmp_path / "repack"
    reused, repacked, first_tokens = _start(model, tmp_path, cache_dir)
    assert (reused, repacked) == (0, 8)  # 2 layers x (qkv, o, gate_up, down)
    reused, repacked, tokens = _start(model, tmp_path, cache_dir)
    assert (reused, repacked) == (8, 0) and tokens == first_tokens
    # modify one tensor of one layer (down_proj of layer 1): only that layer repacks
    state = load_file(model / "model.safetensors")
    state["model.layers.1.mlp.down_proj.scales"] = state["model.layers.1.mlp.down_proj.scales"] * 2
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    reused, repacked, _ = _start(model, tmp_path, cache_dir)
    assert (reused, repacked) == (7, 1)
