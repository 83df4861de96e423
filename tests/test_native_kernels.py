"""The ``cpu_native`` provider (C++ built at first use): its build and fallbacks,
its cache writers against the torch writers (bit for bit), its readers on head
sizes outside the AVX-512 instantiations (the portable path) and on the INT8
integer path's other head and block sizes (the randomized reader tests in
test_attention_kernels/test_attention_int8 cover 64 and 128),
and its RMSNorm / SiluAndMul against the reference kernels and float64.
"""

import functools
import logging
import math
import re
import subprocess
from pathlib import Path

import pytest
import torch
from paged_cases import assert_within_int8_bound, build, kernel_args
from conftest import kernel_calls
from paged_cases import HKV, TOL, batch_mix, make_case, reference

from vllm_accel.ops import custom_ops  # noqa: F401  (registers the reference ops)
from vllm_accel.ops.reference import attention as _reference  # noqa: F401  (fallbacks)
from vllm_accel.ops.torch_fast import attention as _torch_fast  # noqa: F401
from vllm_accel.ops.cpu_native import attention as attention_native
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.cpu_native import elementwise as custom_ops_native
from vllm_accel.ops.registry import get_kernel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(autouse=True)
def built_library():
    assert native.library() is not None, "the cpu_native kernels did not build"


def test_library_shares_torch_openmp_runtime():
    """Two OpenMP runtimes would each spin a thread pool on the same cores: the
    library's ``libgomp.so.1`` must be the one torch loaded, not the system's.
    (Wheels may vendor their own under other names, e.g. sentencepiece.)"""
    with open("/proc/self/maps") as maps:
        gomp = {line.split()[-1] for line in maps if line.rstrip().endswith("/libgomp.so.1")}
    assert gomp == {str(Path(torch.__file__).parent / "lib" / "libgomp.so.1")}, gomp


def test_loading_keeps_denormals():
    """Linking with -ffast-math would pull in crtfastmath.o, whose constructor sets
    flush-to-zero for the loading thread, silently changing torch's numerics."""
    native.library.cache_clear()
    assert native.library() is not None  # (re)loaded in this thread
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert (tiny * 1.0).item() != 0.0


@pytest.fixture
def small_build(tmp_path, monkeypatch):
    """_build of one small source into an empty cache: the cache key and reuse are
    what these tests check (the real sources' build is the library fixture's)."""
    source = tmp_path / "src" / "small.cpp"
    source.parent.mkdir()
    source.write_text('extern "C" int accel_small() { return 1; }\n')
    monkeypatch.setattr(native, "SOURCES", (source,))
    monkeypatch.setenv("ACCEL_NATIVE_CACHE", str(tmp_path / "cache"))
    return source


def test_build_is_cached_and_keyed(small_build, monkeypatch):
    cxx = native.compiler()
    first = native._build(cxx)
    mtime = first.stat().st_mtime_ns
    assert native._build(cxx) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DACCEL_TEST_KEY",))
    other_flags = native._build(cxx)
    assert other_flags != first  # other flags, other library
    small_build.write_text('extern "C" int accel_small() { return 2; }\n')
    assert native._build(cxx) not in (first, other_flags)  # other source, other library


def test_build_key_changes_with_the_cpu(small_build, monkeypatch):
    """A checkout's cache may meet another CPU next session: a library built for
    one CPU (-march=native) must never be loaded on another."""
    cxx = native.compiler()
    here = native._build(cxx)
    monkeypatch.setattr(native, "cpu_signature", lambda: "x86_64 other cpu avx2")
    assert native._build(cxx) != here


# Half-precision arithmetic (AVX512-FP16: vmulph, vfmadd132sh, ...). Conversions
# (vcvtph2ps, vcvtsh2ss) are fine: arithmetic must stay in float32.
HALF_ARITHMETIC = re.compile(r"\bv(?:fn?m(?:add|sub)\d*|add|sub|mul|div|sqrt|rcp|rsqrt|min|max|"
                             r"scalef|reduce|getexp)[ps]h\b")


@pytest.mark.parametrize("source", native.SOURCES, ids=lambda p: p.name)
def test_no_half_precision_arithmetic_on_fp16_cpus(source, tmp_path):
    """On CPUs with native fp16 units, -ffast-math may narrow float32 math on fp16
    operands into fused fp16 instructions that round differently (it did for
    rotary: one-ulp differences on Sapphire Rapids only). Compiled here for such a
    CPU, whatever CPU runs the test, the kernels must contain no fp16 arithmetic."""
    flags = [f for f in native.FLAGS if not f.startswith("-march=")]
    asm = tmp_path / "out.s"
    subprocess.run([native.compiler(), *flags, "-march=sapphirerapids", "-S", str(source),
                    "-o", str(asm)], check=True, capture_output=True)
    found = sorted(set(HALF_ARITHMETIC.findall(asm.read_text())))
    assert not found, f"{source.name} does fp16 arithmetic on AVX512-FP16 CPUs: {found}"


@pytest.mark.parametrize("env", [{"ACCEL_NATIVE_CACHE": "off"}, {"CXX": "false", "PATH": ""}])
def test_unbuildable_library_falls_back(env, monkeypatch, tmp_path, caplog):
    """Without a compiler (or switched off) every kernel runs the next provider."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if "CXX" in env:
        monkeypatch.setenv("ACCEL_NATIVE_CACHE", str(tmp_path))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.library() is None
        if "CXX" in env:
            assert "No C++ compiler found" in caplog.text
        x = torch.randn(3, 32, dtype=torch.bfloat16)
        w = torch.randn(32, dtype=torch.bfloat16)
        assert torch.equal(custom_ops_native.rms_norm(x, w, 1e-6),
                           get_kernel("rms_norm", "reference")(x, w, 1e-6))
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_failed_build_warns_and_falls_back(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("ACCEL_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", native.FLAGS + ("-DACCEL_FORCE_ERROR", "-include",
                                                         "/nonexistent/header.h"))
    native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.library() is None
        assert "Could not build the cpu_native" in caplog.text
    finally:
        monkeypatch.undo()
        native.library.cache_clear()


def test_failed_torch_ops_build_warns_and_keeps_the_python_kernels(monkeypatch, caplog):
    """Where the dispatcher kernels (csrc/torch_ops.cpp) cannot be built against
    torch, torch_ops() is None with a warning: the ops keep their Python kernels and
    the attention wrappers call the kernel library through ctypes."""
    def fail(cxx, kernels):
        raise RuntimeError("c++ failed: torch/library.h: No such file or directory")

    monkeypatch.setattr(native, "_build_torch_ops", fail)
    native.torch_ops.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert native.torch_ops() is None
        assert "Could not build the cpu_native torch ops" in caplog.text
        assert "No such file" in caplog.text
    finally:
        monkeypatch.undo()
        native.torch_ops.cache_clear()
    assert native.torch_ops() is not None


# ------------------------------------------------------------------ cache writers


def _write_case(dtype, layout, bs=16, d=64, seed=0):
    reqs = batch_mix("mixed", bs)
    g = torch.Generator().manual_seed(seed)
    n = sum(s for _, s in reqs)
    num_blocks = n // bs + 8
    slots = torch.randperm(num_blocks * bs, generator=g)[:n]
    slots[::7] = -1  # padding rows
    key = torch.randn(n + 3, HKV, d, generator=g).to(dtype)  # 3 rows past the mapping
    value = torch.randn(n + 3, HKV, d, generator=g).to(dtype) * 4
    return key, value, slots, num_blocks


@pytest.fixture(params=["dispatcher", "ctypes"])
def call_path(request, monkeypatch):
    """The kernels through csrc/torch_ops.cpp's ops (wherever that library builds) or
    through ctypes (where it cannot)."""
    assert native.torch_ops() is not None
    if request.param == "ctypes":
        monkeypatch.setattr(attention_native, "_dispatched", lambda: False)
    return request.param


@pytest.mark.parametrize("layout", ["LBHNC", "LHBNC"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_cache_write_bit_exact(int8, dtype, layout, monkeypatch, call_path):
    key, value, slots, num_blocks = _write_case(dtype, layout)
    width = 2 * 64 + (8 if int8 else 0)
    cache_dtype = torch.int8 if int8 else dtype
    if layout == "LHBNC":
        cache = torch.zeros(HKV, num_blocks, 16, width, dtype=cache_dtype).transpose(0, 1)
    else:
        cache = torch.zeros(num_blocks, HKV, 16, width, dtype=cache_dtype)
    ours, theirs = cache.clone(), cache.clone()
    name = "cache_write_int8" if int8 else "cache_write"
    # Slices of a fused qkv output, as vLLM passes K and V: eager passes both
    # slices, compiled graphs a contiguous K and the V slice (other strides).
    qkv = torch.cat([key, value], dim=-1)
    k, v = qkv[..., :64], qkv[..., 64:]
    monkeypatch.setattr(attention_native, "fallback_kernel", _no_fallback)
    for k_in in (k, k.contiguous()):
        ours.zero_(), theirs.zero_()
        getattr(attention_native, name)(k_in, v, ours, slots)
        get_kernel(name, "reference")(k_in, v, theirs, slots)
        assert torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8))  # raw bytes
        assert ours.count_nonzero() > 0


def _no_fallback(name, provider):
    raise AssertionError(f"{provider} {name} fell back to the next provider")


def test_cache_write_rejects_slots_outside_the_cache(call_path):
    key, value, slots, num_blocks = _write_case(torch.float32, "LBHNC")
    cache = torch.zeros(num_blocks, HKV, 16, 2 * 64)
    slots[3] = num_blocks * 16
    with pytest.raises(ValueError, match="outside the cache"):
        attention_native.cache_write(key, value, cache, slots)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_int8_static_scales_bit_exact(dtype):
    key, value, slots, num_blocks = _write_case(dtype, "LBHNC", seed=3)
    cache = torch.zeros(num_blocks, HKV, 16, 2 * 64 + 8, dtype=torch.int8)
    ours, theirs = cache.clone(), cache.clone()
    attention_native.cache_write_int8(key, value, ours, slots, 0.01, 0.02)  # values clip
    get_kernel("cache_write_int8", "reference")(key, value, theirs, slots, 0.01, 0.02)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("d", [40, 80])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_int8_vector_and_tail_bit_exact(dtype, d):
    """The writer's AVX-512 part (whole vectors of 16) and its scalar tail (40 = 2 x 16
    + 8) round exact halves to even, as the torch writer does."""
    g = torch.Generator().manual_seed(d)
    key = torch.randn(24, HKV, d, generator=g).to(dtype)
    value = torch.randn(24, HKV, d, generator=g).to(dtype)
    # max |x| 31.75 makes the scale exactly 0.25, so (m + 0.5) * 0.25 is a tie
    ties = (torch.arange(d) - d // 2 + 0.5) * 0.25
    ties[d // 3] = 31.75
    key[0, :] = ties.to(dtype)
    value[1, :] = -ties.to(dtype)
    slots = torch.randperm(4 * 16, generator=g)[:24]
    cache = torch.zeros(4, HKV, 16, 2 * d + 8, dtype=torch.int8)
    ours, theirs = cache.clone(), cache.clone()
    attention_native.cache_write_int8(key, value, ours, slots)
    get_kernel("cache_write_int8", "reference")(key, value, theirs, slots)
    assert torch.equal(ours, theirs)
    page = ours[slots[0] // 16, 0].flatten()  # K rows [16, d], V rows, scales
    codes = page[slots[0] % 16 * d:][:d].float()
    assert torch.equal(codes[d // 2 - 1:d // 2 + 2], torch.tensor([0.0, 0.0, 2.0]))  # -0.5, 0.5, 1.5


# ------------------------------------------------------------------ readers


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_dispatcher_ops_equal_the_ctypes_path(mix, int8, monkeypatch):
    """The readers through csrc/torch_ops.cpp's op and through ctypes call the same
    kernel: the same bits, and the same error for a block id outside the cache."""
    assert native.torch_ops() is not None
    reqs = batch_mix(mix, 32)
    if int8:
        qs, _, _, block_table, cache, _ = build(reqs, 32, 3, 64, torch.bfloat16, "LHBNC", seed=5)
    else:
        qs, _, _, block_table, cache = make_case(reqs, 32, 3 * HKV, HKV, 64, torch.bfloat16,
                                                 seed=5)
    query = torch.cat(qs)
    query_start_loc, seq_lens = kernel_args(reqs)
    suffix = "_int8" if int8 else ""
    if mix == "decode":
        run = functools.partial(getattr(attention_native, "paged_decode" + suffix), query,
                                cache, block_table, seq_lens, 0.125)
    else:
        run = functools.partial(getattr(attention_native, "paged_prefill" + suffix), query,
                                cache, block_table, query_start_loc, seq_lens, 0.125)
    monkeypatch.setattr(attention_native, "fallback_kernel", _no_fallback)
    outs, errors = [], []
    for dispatched in (True, False):
        monkeypatch.setattr(attention_native, "_dispatched", lambda d=dispatched: d)
        outs.append(run())
        block_table[1, 0] += cache.shape[0]
        with pytest.raises(ValueError, match="ids outside the cache") as error:
            run()
        block_table[1, 0] -= cache.shape[0]
        errors.append(str(error.value))
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    assert errors[0] == errors[1]


def _layer_case(mix, kv, seed=11):
    """An attention layer's inputs for ``mix`` (decodes first, as vLLM orders them):
    metadata, new K/V for each request's newest q_len positions, query and output; and
    the float64 attention of the real rows over each request's K/V with the new rows
    in place, with each row's max|V| (the INT8 bound's scale)."""
    from vllm_accel.ops.attention import AccelAttentionMetadata

    reqs = sorted(batch_mix(mix, 32), key=lambda r: r[0] != 1)
    if kv == "auto":
        qs, ks, vs, block_table, cache = make_case(reqs, 32, 3 * HKV, HKV, 64, torch.bfloat16,
                                                   seed=seed)
    else:
        qs, ks, vs, block_table, cache, _ = build(reqs, 32, 3, 64, torch.bfloat16, "LHBNC",
                                                  seed=seed)
    g = torch.Generator().manual_seed(seed + 2)
    query = torch.cat(qs)
    slots = torch.cat([block_table[i, pos // 32].long() * 32 + pos % 32
                       for i, (q, s) in enumerate(reqs) for pos in [torch.arange(s - q, s)]])
    qkv = torch.randn(len(query), (3 + 2) * HKV, 64, generator=g).to(torch.bfloat16)
    key, value = qkv[:, 3 * HKV:4 * HKV], qkv[:, 4 * HKV:]  # slices of a fused qkv
    query_start_loc, seq_lens = kernel_args(reqs)
    decodes = sum(q == 1 for q, _ in reqs)
    md = AccelAttentionMetadata(
        num_actual_tokens=len(query), num_decodes=decodes, num_decode_tokens=decodes,
        max_seq_len=max(s for _, s in reqs), query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens, block_table=block_table, slot_mapping=slots)
    expected, vmax = [], []
    for q_rows, k, v, (q, s), start in zip(qs, ks, vs, reqs, query_start_loc.tolist()):
        k, v = k.clone(), v.clone()
        k[s - q:], v[s - q:] = key[start:start + q], value[start:start + q]
        expected.append(reference(q_rows, k, v, 0.125))
        vmax.append(v.abs().max().double().expand(q, 1, 1))
    output = torch.full((len(query) + 2, 3 * HKV, 64), 7.0, dtype=torch.bfloat16)  # padded
    query = torch.cat([query, torch.randn(2, 3 * HKV, 64, generator=g).to(torch.bfloat16)])
    return query, key, value, cache, md, output, (torch.cat(expected), torch.cat(vmax))


def _impl(kv, monkeypatch):
    """The backend's impl with the simulator's providers (cpu_native, then torch_fast)."""
    from vllm_accel.ops import registry
    from vllm_accel.ops.attention import AccelAttentionImpl

    monkeypatch.setattr(registry, "_preferred_providers", ("cpu_native", "torch_fast",
                                                           registry.REFERENCE))
    monkeypatch.setattr(registry, "_resolved", {})
    monkeypatch.delenv("ACCEL_KERNEL_PROVIDER", raising=False)
    return AccelAttentionImpl(3 * HKV, 64, 0.125, HKV, None, None, kv)


@pytest.mark.parametrize("kv", ["auto", "int8", "int8-static"])
@pytest.mark.parametrize("mix", ["decode", "mixed", "prefill_ctx"])
def test_attention_step_equals_the_kernels_one_by_one(mix, kv, monkeypatch):
    """The backend runs a layer as one C++ op (cache write + attention into the output):
    the float64 attention over the new K/V within the kernels' bounds, the same cache
    bytes and output bits as the writer and readers called one by one (INT8: dynamic
    scales, or the layer's static ones, which clip here), padded output rows
    untouched, one kernel call for the whole batch."""
    from types import SimpleNamespace

    assert native.torch_ops() is not None
    layer = SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
    query, key, value, cache, md, output, (expected, vmax) = _layer_case(mix,
                                                                         kv.split("-")[0])
    fused, split = (_impl(kv.split("-")[0], monkeypatch) for _ in range(2))
    assert fused._attention_step is not None
    split._attention_step = None
    if kv == "int8-static":
        for impl in (fused, split):
            impl._static_kv_scales = {0: (1.0, 1.0), 1: (0.01, 0.02)}  # layer 1's
    outs, caches = [], []
    calls = kernel_calls(monkeypatch, "cpu_attention_step", "", 0)
    for impl in (fused, split):
        out, kv_cache = output.clone(), cache.clone()
        impl.forward(layer, query, key, value, kv_cache, md, out)
        outs.append(out), caches.append(kv_cache)
    assert calls() == (1, md.num_actual_tokens)
    rows = outs[0][:md.num_actual_tokens]
    if kv == "auto":
        torch.testing.assert_close(rows.double(), expected, **TOL[torch.bfloat16])
    elif kv == "int8":
        assert_within_int8_bound(rows, expected, vmax, torch.bfloat16)
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    assert not torch.equal(caches[0].view(torch.uint8), cache.view(torch.uint8))
    assert torch.equal(outs[0], outs[1])
    assert (outs[0][md.num_actual_tokens:] == 7.0).all()
    if kv == "int8-static":  # the scales reached the op: dynamic ones write other bytes
        dynamic = _impl("int8", monkeypatch)
        kv_cache = cache.clone()
        dynamic.forward(layer, query, key, value, kv_cache, md, output.clone())
        assert not torch.equal(kv_cache.view(torch.uint8), caches[0].view(torch.uint8))


def test_attention_step_declines_without_side_effects(monkeypatch):
    """What the op does not take (a prefill whose causal work the torch matmuls win,
    a 2-D output, no dispatcher library) it leaves alone: False, the cache untouched."""
    query, key, value, cache, md, output, _ = _layer_case("mixed", "auto")
    args = lambda out: (query, key, value, cache, md.slot_mapping, md.block_table,  # noqa: E731
                        md.query_start_loc_cpu, md.seq_lens, out, 0.125)
    before = cache.clone()
    monkeypatch.setattr(attention_native, "PREFILL_NATIVE_MAX_PAIRS", 100)
    assert not attention_native.attention_step(*args(output))
    monkeypatch.undo()
    assert not attention_native.attention_step(*args(output.flatten(1)))
    monkeypatch.setattr(attention_native, "_dispatched", lambda: False)
    assert not attention_native.attention_step(*args(output))
    assert torch.equal(cache, before)


def test_attention_step_rejects_block_ids_outside_the_cache():
    query, key, value, cache, md, output, _ = _layer_case("decode", "auto")
    md.block_table[1, 0] += cache.shape[0]
    with pytest.raises(ValueError, match="accel_paged_attention: the block table holds ids "
                                         "outside the cache"):
        attention_native.attention_step(query, key, value, cache, md.slot_mapping,
                                        md.block_table, md.query_start_loc_cpu, md.seq_lens,
                                        output, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [40, 48, 80])  # 40: not a multiple of 16; 48: no instantiation
@pytest.mark.parametrize("mix", ["decode", "prefill_ctx", "mixed"])
def test_readers_portable_path(mix, d, dtype):
    """Head sizes the AVX-512 path does not take still run in C++, to the oracle."""
    bs, ratio = 32, 3
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, ratio * HKV, HKV, d, dtype,
                                                  seed=d + bs)
    scale = d**-0.5
    qsl = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    out = attention_native.paged_prefill(torch.cat(qs), kv_cache, block_table, qsl, seq_lens,
                                         scale)
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [40, 48, 80])
@pytest.mark.parametrize("mix", ["decode", "prefill_ctx", "mixed"])
def test_int8_readers_portable_path(mix, d, dtype):
    """The INT8 cache on head sizes outside the bf16-dot path, to the same bound as
    test_attention_int8."""
    _check_int8_reader(mix, 32, d, dtype, "LHBNC")


@pytest.mark.parametrize("bs", [16, 256, 512])  # 512: past the integer path's page bound
@pytest.mark.parametrize("d", [32, 96, 256])
@pytest.mark.parametrize("mix", ["decode", "mixed"])
def test_int8_readers_integer_path_head_and_block_sizes(mix, d, bs):
    """bf16 queries on an INT8 cache (the int16 dot path) at the head sizes and
    block sizes the randomized tests leave out, to the same bound."""
    _check_int8_reader(mix, bs, d, torch.bfloat16, "LBHNC")


def _check_int8_reader(mix, bs, d, dtype, layout):
    """The native INT8 prefill reader vs float64 on unquantized K/V, within the
    INT8 bound of test_attention_int8 (3 query heads per KV head)."""
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, cache, _ = build(reqs, bs, 3, d, dtype, layout, seed=d)
    scale = d**-0.5
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    vmax = torch.cat([v.abs().max().double().expand(len(q), 1, 1) for q, v in zip(qs, vs)])
    query_start_loc, seq_lens = kernel_args(reqs)
    out = attention_native.paged_prefill_int8(torch.cat(qs), cache, block_table,
                                              query_start_loc, seq_lens, scale)
    assert_within_int8_bound(out, expected, vmax, dtype)


def _prefill_case(mix, bs, seed, d=64):
    """(prefill args, per-request q/k/v) for the kernels, fp32, 2 query heads per KV head."""
    reqs = batch_mix(mix, bs)
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, 2 * HKV, HKV, d, torch.float32,
                                                  seed=seed)
    qsl = torch.tensor([0] + [q for q, _ in reqs]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    return (torch.cat(qs), kv_cache, block_table, qsl, seq_lens, d**-0.5), (qs, ks, vs)


def _record_fallbacks(monkeypatch):
    """Route the native kernels' fallbacks to torch_fast, recording each one."""
    calls = []
    fast = get_kernel("paged_prefill", "torch_fast")
    monkeypatch.setattr(attention_native, "fallback_kernel",
                        lambda name, provider: lambda *a: calls.append(name) or fast(*a))
    return calls


def test_long_prefill_goes_to_matmul_provider(monkeypatch):
    """Above PREFILL_NATIVE_MAX_PAIRS the torch_fast matmuls run (and agree)."""
    args, _ = _prefill_case("prefill_ctx", 16, seed=11)
    calls = _record_fallbacks(monkeypatch)
    native_out = attention_native.paged_prefill(*args)
    assert calls == []
    monkeypatch.setattr(attention_native, "PREFILL_NATIVE_MAX_PAIRS", 10)
    torch.testing.assert_close(attention_native.paged_prefill(*args), native_out,
                               atol=1e-5, rtol=1e-5)
    assert calls == ["paged_prefill"]


def test_block_size_not_multiple_of_16_falls_back(monkeypatch):
    """The AVX-512 paths read pages 16 rows at a time: block size 8 goes to torch_fast."""
    args, (qs, ks, vs) = _prefill_case("mixed", 8, seed=9)
    calls = _record_fallbacks(monkeypatch)
    out = attention_native.paged_prefill(*args)
    assert calls == ["paged_prefill"]
    scale = args[-1]
    expected = torch.cat([reference(q, k, v, scale) for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_decode_cache_dtype_mismatch_falls_back():
    """A bf16 query over an fp32 cache is outside the C ABI: torch_fast serves it."""
    bs, d = 16, 64
    reqs = batch_mix("decode", bs)
    qs, ks, vs, block_table, kv_cache = make_case(reqs, bs, HKV, HKV, d, torch.float32, seed=5)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    query = torch.cat(qs).to(torch.bfloat16)
    out = attention_native.paged_decode(query, kv_cache, block_table, seq_lens, d**-0.5)
    expected = get_kernel("paged_decode", "torch_fast")(query, kv_cache, block_table, seq_lens,
                                                        d**-0.5)
    assert torch.equal(out, expected)


# ------------------------------------------------------------------ RMSNorm, SiluAndMul

# The elementwise kernels compute in float32 and round once to the model dtype, on
# every CPU. Their oracle is float64: each result is within half an ulp of the
# model dtype (the rounding) plus a float32 slack (sums, reciprocal square roots,
# exp) of the exact value. The reference kernels round after several steps like
# vLLM's forward_native, so they are held to the float64 bound, not bit-compared.
PRECISION = {torch.float32: (24, -126), torch.bfloat16: (8, -126), torch.float16: (11, -14)}
PRECISION_ULP = {dtype: 2.0 ** (1 - digits) for dtype, (digits, _) in PRECISION.items()}


def assert_rounded_once(ours, exact, dtype, fp32_slack=2**-18, abs_slack=0.0):
    """|ours - exact| <= ulp(dtype)/2 at their larger magnitude + fp32_slack * |exact|
    (+ abs_slack, for float32 sums whose terms are larger than the result)."""
    digits, min_exp = PRECISION[dtype]
    ours = ours.double()
    mag = torch.maximum(ours.abs(), exact.abs())
    exponent = torch.clamp(torch.floor(torch.log2(mag.clamp_min(1e-300))), min=min_exp)
    bound = 0.5 * torch.exp2(exponent - (digits - 1)) + fp32_slack * exact.abs() + abs_slack
    err = (ours - exact).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"{int((err > bound).sum())} of {err.numel()} values off by more than half an ulp: "
        f"{ours.flatten()[worst]} vs exact {exact.flatten()[worst]}")


def _rms_float64(x, weight, eps, residual):
    h = x.double() + (0 if residual is None else residual.double())
    out = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight.double()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 576), (3, 5, 1000), (40, 2048)])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("weight", [True, False])
def test_rms_norm(shape, dtype, residual, weight):
    g = torch.Generator().manual_seed(math.prod(shape))
    x = (torch.randn(shape, generator=g) * 3).to(dtype)
    r = torch.randn(shape, generator=g).to(dtype) if residual else None
    w = torch.randn(shape[-1], generator=g).to(dtype) if weight else None
    ours = custom_ops_native.rms_norm(x, w, 1e-6, r)
    theirs = get_kernel("rms_norm", "reference")(x, w, 1e-6, r)
    if residual:
        (ours, ours_res), (theirs, theirs_res) = ours, theirs
        assert torch.equal(ours_res, theirs_res)  # one IEEE addition, rounded once
        assert torch.equal(ours_res, (x.float() + r.float()).to(dtype))
    expected = _rms_float64(x, w, 1e-6, r)
    assert_rounded_once(ours, expected, dtype, fp32_slack=2**-16)
    tol = 1e-5 if dtype == torch.float32 else 2 * PRECISION_ULP[dtype]
    torch.testing.assert_close(theirs.double(), expected, atol=tol, rtol=tol)


def test_rms_norm_strided_rows_and_fallbacks():
    x = torch.randn(6, 2 * 96)[:, :96]  # row stride 192
    w = torch.randn(96)
    torch.testing.assert_close(custom_ops_native.rms_norm(x, w, 1e-5),
                               get_kernel("rms_norm", "reference")(x, w, 1e-5))
    # variance_size and mixed dtypes go to the reference
    ref = get_kernel("rms_norm", "reference")
    assert torch.equal(custom_ops_native.rms_norm(x, w, 1e-5, None, 32), ref(x, w, 1e-5, None, 32))
    xb = x.to(torch.bfloat16)
    assert torch.equal(custom_ops_native.rms_norm(xb, w, 1e-5), ref(xb, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (9, 3072), (2, 3, 130)])
def test_silu_and_mul(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype)
    ours = custom_ops_native.silu_and_mul(x)
    theirs = get_kernel("silu_and_mul", "reference")(x)
    d = shape[-1] // 2
    a, b = x[..., :d].double(), x[..., d:].double()
    expected = a * torch.sigmoid(a) * b
    assert_rounded_once(ours, expected, dtype, fp32_slack=2**-20)
    ulp = PRECISION_ULP[dtype]
    torch.testing.assert_close(theirs.double(), expected, atol=4 * ulp, rtol=4 * ulp)


def test_elementwise_fall_back_under_torch_compile():
    """Dynamo cannot trace a ctypes call: compiled graphs get the reference ops."""
    w = torch.randn(64)

    cache = torch.randn(8, 16)
    positions = torch.tensor([3, 1, 7, 0])

    @torch.compile(backend="eager", fullgraph=True)
    def norm_act_rope(x):
        h = custom_ops_native.silu_and_mul(custom_ops_native.rms_norm(x, w, 1e-6))
        return custom_ops_native.rotary_embedding(positions, h, None, cache, 16, 16, True)[0]

    x = torch.randn(4, 64)
    h = get_kernel("silu_and_mul", "reference")(get_kernel("rms_norm", "reference")(x, w, 1e-6))
    expected = get_kernel("rotary_embedding", "reference")(positions, h, None, cache, 16, 16,
                                                           True)[0]
    torch.testing.assert_close(norm_act_rope(x), expected)


ELEMENTWISE_OPS = {"cpu_rms_norm": "accel_rms_norm", "cpu_silu_and_mul": "accel_silu_and_mul",
                   "cpu_rotary_embedding": "accel_rotary"}


def _elementwise_counters(monkeypatch):
    """Per elementwise C++ op, a function giving its (calls, rows) since now."""
    return {op: kernel_calls(monkeypatch, op, symbol, 0) for op, symbol in ELEMENTWISE_OPS.items()}


def test_elementwise_ops_give_the_ctypes_bits_in_one_dispatcher_call(monkeypatch):
    """The eager kernels' C++ ops (csrc/torch_ops.cpp: the checks and the C kernels
    without Python checks or a ctypes call) give the bits of the ctypes path they
    replace, each call counted as one completed op: RMSNorm with and without residual
    and weight, SiluAndMul, rotary with and without key (partial rotary too)."""
    if not custom_ops_native.NATIVE_DISPATCH:  # torch_ops not built: the ctypes path runs
        assert native.torch_ops() is None
        return
    counters = _elementwise_counters(monkeypatch)
    g = torch.Generator().manual_seed(11)
    x, r = (torch.randn(5, 96, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(96, generator=g).bfloat16()
    q, k = torch.randn(5, 4 * 32, generator=g).bfloat16(), torch.randn(5, 2 * 32, generator=g).bfloat16()
    cache32, cache16 = torch.randn(16, 32).bfloat16(), torch.randn(16, 16).bfloat16()
    positions = torch.tensor([3, 0, 15, 7, 7])
    cases = [("rms_norm", (x, w, 1e-6)), ("rms_norm", (x, None, 1e-6, r)),
             ("silu_and_mul", (x,)),
             ("rotary_embedding", (positions, q, k, cache32, 32, 32, True)),
             ("rotary_embedding", (positions, q, None, cache16, 32, 16, False))]
    dispatched = [getattr(custom_ops_native, name)(*args) for name, args in cases]
    assert {op: count() for op, count in counters.items()} == {
        "cpu_rms_norm": (2, 10), "cpu_silu_and_mul": (1, 5), "cpu_rotary_embedding": (2, 10)}
    monkeypatch.setattr(custom_ops_native, "NATIVE_DISPATCH", False)
    for (name, args), ours in zip(cases, dispatched):
        theirs = getattr(custom_ops_native, name)(*args)
        ours, theirs = ((t,) if isinstance(t, torch.Tensor) else t for t in (ours, theirs))
        assert len(ours) == len(theirs), name
        for a, b in zip(ours, theirs):
            assert (a is None and b is None) or torch.equal(a, b), name


def test_elementwise_ops_decline_what_the_c_kernels_do_not_take(monkeypatch):
    """Inputs the C kernels do not take: the op returns None with nothing written (no
    op counted), and the provider runs the next one (the reference)."""
    if not custom_ops_native.NATIVE_DISPATCH:
        assert native.torch_ops() is None
        return
    counters = _elementwise_counters(monkeypatch)
    ops = torch.ops.vllm_accel
    x = torch.randn(6, 96).bfloat16()
    assert ops.cpu_rms_norm(x.t(), None, 1e-6, None) == (None, None)  # column stride
    assert ops.cpu_rms_norm(x, torch.randn(96), 1e-6, None) == (None, None)  # weight dtype
    assert ops.cpu_rms_norm(x, None, 1e-6, x[:3]) == (None, None)  # residual shape
    assert ops.cpu_silu_and_mul(x[:, :95]) is None  # odd width
    assert ops.cpu_silu_and_mul(torch.randn(3, 8, dtype=torch.float64)) is None
    cache, q = torch.randn(16, 32).bfloat16(), torch.randn(4, 64).bfloat16()
    positions = torch.tensor([0, 1, 2, 3])
    assert ops.cpu_rotary_embedding(positions, q, q[:3], cache, 32, 32, True) == (None, None)
    assert ops.cpu_rotary_embedding(positions.int(), q, None, cache, 32, 32, True) == (None, None)
    assert ops.cpu_rotary_embedding(torch.tensor([0, 1, 2, 16]), q, None, cache, 32, 32,
                                    True) == (None, None)  # outside the cache
    assert all(count() == (0, 0) for count in counters.values())
    w32 = torch.randn(96)
    assert torch.equal(custom_ops_native.rms_norm(x, w32, 1e-6),
                       get_kernel("rms_norm", "reference")(x, w32, 1e-6))


def _rotary_float64(positions, x, cache, head_size, rot, neox, dtype=torch.float64):
    x = x.to(dtype).reshape(x.shape[0], -1, head_size)
    cos, sin = cache.to(dtype)[positions].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    r = x[..., :rot]
    x1, x2 = (r[..., : rot // 2], r[..., rot // 2:]) if neox else (r[..., 0::2], r[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot_out = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((rot_out, x[..., rot:]), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot", [64, 32])  # 32: partial rotary, channels 32.. pass through
@pytest.mark.parametrize("with_key", [True, False])
def test_rotary_embedding(dtype, neox, rot, with_key):
    g = torch.Generator().manual_seed(rot + neox)
    num_tokens, heads, kv_heads, d = 70, 6, 2, 64
    cache = torch.randn(512, rot, generator=g).to(dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=g)
    # Q and K sliced out of a fused qkv row, as the attention layers pass them.
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * d, generator=g).to(dtype)
    q, k = qkv[:, : heads * d], qkv[:, heads * d : (heads + kv_heads) * d]
    k = k if with_key else None
    before = qkv.clone()
    ours = custom_ops_native.rotary_embedding(positions, q, k, cache, d, rot, neox)
    theirs = get_kernel("rotary_embedding", "reference")(positions, q, k, cache, d, rot, neox)
    assert torch.equal(qkv, before)  # functional: inputs untouched
    for o, t, x in zip(ours, theirs, (q, k)):
        if x is None:
            assert o is None and t is None
            continue
        assert o.shape == x.shape
        # Products of two bf16/fp16 values are exact in float32, so float32 math
        # rounded once is the same on every CPU, fused multiply-add or not.
        if dtype != torch.float32:
            once = _rotary_float64(positions, x.float(), cache.float(), d, rot, neox,
                                   dtype=torch.float32)
            assert torch.equal(o, once.to(dtype).reshape(x.shape))
        expected = _rotary_float64(positions, x, cache, d, rot, neox).reshape(x.shape)
        # float32 inputs: the products are rounded, so cancellation leaves their error
        terms = x.abs().max().double() * cache.abs().max().double()
        assert_rounded_once(o, expected, dtype,
                            abs_slack=2**-23 * terms if dtype == torch.float32 else 0.0)
        # the reference rounds each product: its error scales with the products
        tol = 1e-5 if dtype == torch.float32 else 4 * PRECISION_ULP[dtype]
        torch.testing.assert_close(t.double(), expected, atol=tol * 4, rtol=tol)


def test_rotary_bad_positions_get_the_reference_error():
    cache = torch.randn(16, 32)
    q = torch.randn(3, 2 * 32)
    with pytest.raises(IndexError):
        custom_ops_native.rotary_embedding(torch.tensor([0, 5, 16]), q, None, cache, 32, 32, True)


def test_reader_rejects_block_tables_it_cannot_trust():
    """Out-of-range reads would not raise in C++: the entry point checks first."""
    bs, d = 16, 64
    reqs = batch_mix("decode", bs)
    qs, _, _, block_table, kv_cache = make_case(reqs, bs, HKV, HKV, d, torch.float32, seed=2)
    query = torch.cat(qs)
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32)
    too_long = seq_lens.clone()
    too_long[0] = block_table.shape[1] * bs + 1
    with pytest.raises(ValueError, match="more blocks than the block table has"):
        attention_native.paged_decode(query, kv_cache, block_table, too_long, 0.1)
    bad_ids = block_table.clone()
    bad_ids[1, 0] = kv_cache.shape[0]
    with pytest.raises(ValueError, match="holds ids outside the cache"):
        attention_native.paged_decode(query, kv_cache, bad_ids, seq_lens, 0.1)


def test_rotary_positions_outside_the_cache_are_the_reference_errors(monkeypatch):
    """The C++ kernel checks positions before writing anything; an out-of-range one
    goes to the next provider, which raises its indexing error."""
    cache = torch.randn(8, 16)
    query = torch.randn(2, 32)
    calls = []
    monkeypatch.setattr(custom_ops_native, "fallback_kernel",
                        lambda name, provider: lambda *a: calls.append(name) or (a[1], a[2]))
    out, _ = custom_ops_native.rotary_embedding(torch.tensor([3, 8]), query, None, cache,
                                                16, 16, True)
    assert calls == ["rotary_embedding"] and out is query
    out, _ = custom_ops_native.rotary_embedding(torch.tensor([3, 7]), query, None, cache,
                                                16, 16, True)
    assert calls == ["rotary_embedding"] and out is not query
