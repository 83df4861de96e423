"""The ``cpu_native`` int4 GEMV (``csrc/int4_gemv.cpp``) on torch's int4 layout vs
``x @ W.T`` in float64, ``W`` built here from the random codes, scales and zero
points (independent of both kernels' unpacking)."""

import pytest
import torch

from conftest import count_native_calls, cpu_has, kernel_calls
from vllm_accel.ops.cpu_native import build as native
from vllm_accel.ops.cpu_native import wint_gemv
from vllm_accel.ops.registry import get_kernel
from vllm_accel.ops.torch_fast import wint_gemm as torch_fast_gemm
from test_quant_torch_fast import make_resident

linear = get_kernel("wint_prepared_linear", "cpu_native")


def prepare(res, dtype):
    """The int4 layout for ``dtype`` activations, whichever the provider would choose
    for them (its choice: ``test_int4_layout_for_the_dtypes_the_kernel_runs``)."""
    return torch_fast_gemm.prepare(res, dtype, int4_act_dtypes=(dtype,))


def test_int4_layout_for_the_dtypes_the_kernel_runs():
    """cpu_native prepares torch's int4 layout for bf16, and for float32 exactly where
    the C++ kernel runs float32 (torch's own float32 and fp16 kernels are scalar
    loops): else the generic layout."""
    res, _ = make_resident(128, 256, 4, 64, False, False, seed=0)
    choose = get_kernel("wint_prepare", "cpu_native")
    assert "int4_weight" in choose(res, torch.bfloat16)
    assert (choose(res, torch.float32) is not None) == wint_gemv.gemv_available()
    assert choose(res, torch.float16) is None


@pytest.fixture
def gemv_calls(monkeypatch):
    """(calls, rows) of the C++ GEMV so far (the op falls back to torch's kernel
    silently)."""
    return kernel_calls(monkeypatch, "int4pack_linear", "accel_int4pack_gemv", 6)


@pytest.fixture
def gemv_f32_calls(monkeypatch):
    """The same for float32 x (its own C entry point)."""
    return kernel_calls(monkeypatch, "int4pack_linear", "accel_int4pack_gemv_f32", 6)


def test_op_dispatches_to_cpp_wherever_the_kernels_build():
    """The op's CPU kernel is the C++ one (no Python per call) whenever the kernel
    library builds; the Python kernel is only the fallback for a failed torch build."""
    assert wint_gemv.NATIVE_DISPATCH == (native.library() is not None)


@pytest.mark.parametrize("tokens,dtype", [(1, torch.bfloat16), (5, torch.bfloat16),
                                          (5, torch.float32)])
def test_python_kernel_matches_the_cpp_kernel(tokens, dtype, monkeypatch):
    """``wint_gemv.int4pack_linear`` (the op's kernel where csrc/torch_ops.cpp cannot
    be built) calls the same C kernel: the same bits, one call with the same rows."""
    entry = "accel_int4pack_gemv_f32" if dtype == torch.float32 else "accel_int4pack_gemv"
    rows = count_native_calls(monkeypatch, entry, 6)
    res, _ = make_resident(128, 256, 4, 64, False, False, seed=tokens)
    prepared = prepare(res, dtype)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    args = (x, prepared["int4_weight"], 64, prepared["int4_scales_zeros"])
    assert torch.equal(wint_gemv.int4pack_linear(*args),
                       torch.ops.vllm_accel.int4pack_linear(*args))
    assert rows == ([tokens] if wint_gemv.gemv_available() else [])


def test_torch_layout_is_read_from_torch():
    """torch packs blocks of 64 outputs where its kernels run AVX-512, 32 where they run
    AVX2 (``ATEN_CPU_CAPABILITY`` or the CPU), and a layout the kernel does not read
    elsewhere (0)."""
    capability = torch.backends.cpu.get_cpu_capability()
    assert wint_gemv.torch_layout() == {"AVX512": 64, "AVX2": 32}.get(capability, 0)


def test_gemv_is_available_exactly_where_the_cpu_has_a_path():
    """Dispatch follows what the CPU reports: the AVX-512 kernel is built in with
    AVX-512F and AVX512-VBMI (float32 FMAs; torch's 64-output layout), its BF16 variant
    only with AVX512-BF16 as well, its int16 variant only with AVX512-VNNI as well, its
    AMX tiles (from 12 rows, and for any batch) only with AMX's bf16 and int8 units and
    AVX512-BF16 as well; without VBMI, the AVX2 kernel (float32 FMAs and int16 VPMADDWD,
    both layouts) with AVX2, FMA and F16C. It is used only where torch packs a layout
    it reads; other CPUs keep torch's kernel (the portable path)."""
    lib = native.library()
    vbmi = cpu_has("avx512f", "avx512vbmi")
    avx2 = not vbmi and cpu_has("avx2", "fma", "f16c")
    blocks = 64 if vbmi else 32 | 64 if avx2 else 0
    assert wint_gemv.gemv_available() == (
        lib is not None and bool(blocks & wint_gemv.torch_layout()))
    if lib is not None:
        bf16 = vbmi and cpu_has("avx512_bf16")
        vnni = vbmi and cpu_has("avx512_vnni")
        amx = bf16 and cpu_has("amx_tile", "amx_bf16", "amx_int8")
        assert lib.accel_int4pack_block_sizes() == blocks
        assert lib.accel_int4pack_gemv_available() == (
            (wint_gemv.FP32_FMA if vbmi or avx2 else 0) | (wint_gemv.BF16_DOT if bf16 else 0)
            | (wint_gemv.I16_DOT if vnni or avx2 else 0) | (wint_gemv.AMX if amx else 0))
        assert lib.accel_int4pack_amx_rows() == (12 if amx else 0)
        assert wint_gemv.amx_rows() == (12 if amx and wint_gemv.gemv_available() else 0)


def test_every_x86_cpu_with_avx2_runs_the_cpp_kernel():
    """No x86 CPU with AVX2 + FMA + F16C (every x86 CPU vLLM's CPU wheel targets: its
    _C_AVX2 build needs them) is left on torch's kernel: where the compiler builds the
    library, the GEMV reads the layout torch packs."""
    if native.library() is not None and cpu_has("avx2", "fma", "f16c"):
        assert wint_gemv.gemv_available()


# bf16 activations: scales and 4-bit's folded zero term rounded to bf16 once, plus
# the output rounding (the same bound as torch's kernel in test_quant_torch_fast).
REL = 1.2e-2


# 5-64: 8-row chunks; with AMX, from 12: pairs of 16-row tiles (63 and 65 partial),
# and any batch
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 5, 7, 12, 15, 16, 63, 64, 65, 300])
@pytest.mark.parametrize("group_size,sym,act_order,k", [
    (32, True, False, 576), (64, False, False, 576), (128, False, True, 512),
    (-1, False, False, 256),  # per channel: one 256-column group
])
def test_matches_float64(group_size, sym, act_order, k, tokens, gemv_calls):
    n = 192  # three 64-row blocks
    res, w = make_resident(n, k, 4, group_size, sym, act_order, seed=tokens * 7 + k)
    prepared = prepare(res, torch.bfloat16)
    assert "int4_weight" in prepared
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    bias = torch.randn(n).bfloat16()
    y = linear(x, prepared, bias)
    ref = x.double() @ w.t() + bias.double()
    magnitude = x.double().abs() @ w.abs().t() + bias.double().abs()
    err = (y.double() - ref).abs()
    assert y.dtype == torch.bfloat16 and y.shape == (tokens, n)
    assert bool((err <= REL * magnitude + 1e-6).all()), (err / magnitude).max()
    native_rows = ((tokens <= wint_gemv.NATIVE_MAX_ROWS or wint_gemv.amx_rows())
                   and wint_gemv.gemv_available())
    assert gemv_calls() == ((1, tokens) if native_rows else (0, 0))


FLOAT32_UNIT_ROUNDOFF = 2.0 ** -24


def float32_sum_bound(roundings: int) -> float:
    """|error| / sum |x w| of a result that went through ``roundings`` float32 roundings
    in sequence (a sum, term by term): 7 sqrt(n) u. Probabilistic rounding-error
    analysis (Higham and Mary, SIAM J. Sci. Comput. 41(5), 2019: independent roundings
    of mean zero): the error exceeds lambda sqrt(n) u sum |x w| with probability at most
    2 exp(-lambda^2 / 2), ~5e-11 per output at lambda = 7 (the worst case, n u, is what
    a single biased rounding pattern would need)."""
    return 7.0 * roundings ** 0.5 * FLOAT32_UNIT_ROUNDOFF


def float32_roundings(k: int, group: int) -> int:
    """Roundings in each output of the float32 path that runs here. The C++ kernel (any
    x86 CPU with AVX2 or AVX-512) chains ``group`` FMAs of exact products x (q - 8) per
    group and lane, then adds s * sum + z * sum(x) (3 roundings, sum(x) itself one
    chain of ``group``) per group; torch's kernel (elsewhere) dequantizes each weight
    (q - 8) s + z (2 roundings) and adds the k products in one sequential float32 sum."""
    if wint_gemv.gemv_available():
        return 2 * group + 3 * (k // group)
    return k + 2


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("group_size,sym,act_order,k", [
    (32, True, False, 576), (64, False, False, 576), (128, False, True, 512),
    (-1, False, False, 256),
])
def test_float32_matches_float64(group_size, sym, act_order, k, tokens, gemv_f32_calls):
    """float32 x (a float32 model) runs the C++ kernel at any batch (torch's float32
    int4 kernel is a scalar loop, ~70x its bf16 one) within float32 rounding of the
    float64 product (the bound of the summation that runs here); x has a common offset,
    where summing codes as 128+q and taking 136*sum(x) off afterwards would lose ~7
    bits to the cancellation."""
    n = 192
    res, w = make_resident(n, k, 4, group_size, sym, act_order, seed=tokens * 5 + k)
    prepared = prepare(res, torch.float32)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)) + 3.0
    bias = torch.randn(n)
    y = linear(x, prepared, bias)
    ref = x.double() @ w.t() + bias.double()
    magnitude = x.double().abs() @ w.abs().t() + bias.double().abs()
    err = (y.double() - ref).abs()
    assert y.dtype == torch.float32 and y.shape == (tokens, n)
    bound = float32_sum_bound(float32_roundings(k, k if group_size == -1 else group_size))
    assert bool((err <= bound * magnitude).all()), ((err / magnitude).max(), bound)
    assert gemv_f32_calls() == ((1, tokens) if wint_gemv.gemv_available() else (0, 0))


def _run_variant(lib, variant, x, prepared, group):
    """The C kernel called directly with one variant: (return code, y)."""
    tokens, k = x.shape
    n = prepared["int4_scales_zeros"].shape[1]
    y = torch.zeros(tokens, n, dtype=torch.bfloat16)
    rc = lib.accel_int4pack_gemv(
        x.data_ptr(), x.stride(0), prepared["int4_weight"].data_ptr(),
        prepared["int4_scales_zeros"].data_ptr(), y.data_ptr(), y.stride(0), tokens, n, k,
        group, wint_gemv.torch_layout(), variant)
    return rc, y


VARIANTS = pytest.mark.parametrize(
    "variant", [wint_gemv.FP32_FMA, wint_gemv.BF16_DOT, wint_gemv.I16_DOT, wint_gemv.AMX],
    ids=["fp32_fma", "bf16_dot", "i16_dot", "amx"])


@VARIANTS
@pytest.mark.parametrize("tokens", [1, 4, 5, 64])  # streamed GEMV, then slabs
def test_each_variant_matches_float64(variant, tokens):
    """Each way of multiplying (the op takes the best one built), called directly, vs
    float64; a variant this CPU lacks is refused (-5), never run."""
    lib = native.library()
    if lib is None:  # no compiler: nothing to call, and the op keeps torch's kernel
        assert not wint_gemv.gemv_available()
        return
    k, n, group = 256, 128, 64
    res, w = make_resident(n, k, 4, group, False, False, seed=tokens + 31 * variant)
    prepared = prepare(res, torch.bfloat16)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    rc, y = _run_variant(lib, variant, x, prepared, group)
    if not lib.accel_int4pack_gemv_available() & variant:
        assert rc == -5 and not y.any()
        return
    assert rc == 0
    err = (y.double() - x.double() @ w.t()).abs()
    assert bool((err <= REL * (x.double().abs() @ w.abs().t()) + 1e-6).all()), err.max()


def _direct_case(n, k, group, seed):
    """(packed codes, (scale, zero) pairs, float64 W) built here for any even group
    (the prepared layouts only make groups of 32-256), for calling the C kernel."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    s = (torch.rand(k // group, n, generator=g) * 0.02 + 0.005).bfloat16()
    z = (torch.randn(k // group, n, generator=g) * 0.01).bfloat16()
    group_of = torch.arange(k) // group
    w = (codes.double() - 8) * s.double()[group_of].t() + z.double()[group_of].t()
    prepared = {"int4_weight": torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1),
                "int4_scales_zeros": torch.stack((s, z), -1).contiguous()}
    return prepared, w


@pytest.mark.parametrize("tokens", [16, 40])
def test_amx_tiles_on_a_padded_step_and_strided_rows(tokens):
    """The AMX tiles where k is not whole 32-column steps (100 columns, groups of 50:
    every row of x from a zero-padded copy, the weight's last step zero) and rows of x
    strided, vs float64; 40 rows: a pair of tiles and a partial one."""
    lib = native.library()
    if lib is None or not lib.accel_int4pack_gemv_available() & wint_gemv.AMX:
        assert not (native.library() and cpu_has("avx512f", "avx512vbmi", "avx512_bf16",
                                                  "amx_tile", "amx_bf16", "amx_int8"))
        return
    k, n, group = 100, 128, 50
    prepared, w = _direct_case(n, k, group, seed=tokens)
    x = torch.randn(tokens, k + 6, generator=torch.Generator().manual_seed(tokens))
    x = x.bfloat16()[:, 3:k + 3]
    rc, y = _run_variant(lib, wint_gemv.AMX, x, prepared, group)
    assert rc == 0
    err = (y.double() - x.double() @ w.t()).abs()
    assert bool((err <= REL * (x.double().abs() @ w.abs().t()) + 1e-6).all()), err.max()


def _int16_block(group):
    """The int16 variant's x block for a group: the largest even divisor up to 128."""
    step = min(group, 128)
    while group % step or step % 2:
        step -= 1
    return step


# groups: one x block per group (64), two of 96 (192: not a power of two), 128 of 256
@pytest.mark.parametrize("group", [64, 192, 256])
@pytest.mark.parametrize("tokens", [1, 5])
def test_int16_variant_error_is_its_fixed_point_bound(group, tokens):
    """The int16 variant rounds ``x`` to 16-bit fixed point per block of up to 128
    columns: against float64, its error stays within that rounding (1/65534 of each
    block's largest |x| per unit of |W|) plus the bf16 scales and output, with one
    outlier 2**10 times the rest every 64 columns (activations' massive channels), an
    all-zero block and one of subnormals."""
    lib = native.library()
    if lib is None or not lib.accel_int4pack_gemv_available() & wint_gemv.I16_DOT:
        avx2_kernel = not cpu_has("avx512f", "avx512vbmi") and cpu_has("avx2", "fma", "f16c")
        assert not (native.library() and (cpu_has("avx512f", "avx512vbmi", "avx512_vnni")
                                          or avx2_kernel))
        return
    k, n, block = 768, 128, _int16_block(group)
    prepared, w = _direct_case(n, k, group, seed=group + tokens)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, k, generator=gen)
    x[:, ::64] *= 1024.0
    x[:, :block] = 0.0
    x[:, block:2 * block] *= 2.0 ** -130
    x = x.bfloat16()
    rc, y = _run_variant(lib, wint_gemv.I16_DOT, x, prepared, group)
    assert rc == 0
    xd = x.double()
    peaks = xd.abs().reshape(tokens, k // block, block).amax(-1)  # [tokens, blocks]
    w_mass = w.abs().reshape(n, k // block, block).sum(-1)  # [n, blocks]
    fixed_point = peaks @ w_mass.t() / 65534
    ref = xd @ w.t()
    err = (y.double() - ref).abs()
    assert bool((err <= REL * (xd.abs() @ w.abs().t()) + fixed_point + 1e-6).all())
    # apart from what both share (bf16 scales): within the fixed point and the two
    # outputs' bf16 roundings of the exact products (float32 FMAs)
    rc, exact = _run_variant(lib, wint_gemv.FP32_FMA, x, prepared, group)
    assert rc == 0
    gap = (y.double() - exact.double()).abs()
    assert bool((gap <= fixed_point + 2.0 ** -7 * exact.double().abs() + 1e-6).all())


def test_threaded_gemv_matches_float64(gemv_calls):
    """A weight large enough for the GEMV's OpenMP loop (1024 x 1024 codes)."""
    res, w = make_resident(1024, 1024, 4, 128, False, False, seed=9)
    prepared = prepare(res, torch.bfloat16)
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(9)).bfloat16()
    y = linear(x, prepared)
    err = (y.double() - x.double() @ w.t()).abs()
    assert bool((err <= REL * (x.double().abs() @ w.abs().t()) + 1e-6).all())
    assert gemv_calls() == ((1, 1) if wint_gemv.gemv_available() else (0, 0))


def test_bad_shapes_go_to_torch_which_names_them():
    """Inputs the kernel would read out of bounds never reach it (the op is public):
    torch's kernel gets them and raises its own error."""
    res, _ = make_resident(128, 256, 4, 64, False, False, seed=2)
    prepared = prepare(res, torch.bfloat16)
    x = torch.randn(1, 512).bfloat16()  # K twice the weight's
    with pytest.raises(RuntimeError):
        torch.ops.vllm_accel.int4pack_linear(x, prepared["int4_weight"], 64,
                                             prepared["int4_scales_zeros"])


def test_strided_rows_and_the_torch_kernel_agree(gemv_calls):
    """Rows of a wider tensor (vLLM slices fused outputs): the GEMV reads x's row
    stride; its result equals torch's kernel's up to the output rounding."""
    res, _ = make_resident(128, 512, 4, 64, False, False, seed=5)
    prepared = prepare(res, torch.bfloat16)
    wide = torch.randn(3, 1024, generator=torch.Generator().manual_seed(3)).bfloat16()
    x = wide[:, 256:768]
    args = (prepared["int4_weight"], 512 // prepared["int4_scales_zeros"].shape[0],
            prepared["int4_scales_zeros"])
    got = torch.ops.vllm_accel.int4pack_linear(x, *args)
    want = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), *args)
    torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-3)
    assert gemv_calls() == ((1, 3) if wint_gemv.gemv_available() else (0, 0))


@pytest.mark.parametrize("n,dtype", [(80, torch.bfloat16), (80, torch.float32),
                                     (128, torch.float16)])
def test_shapes_and_dtypes_it_does_not_take_use_torch(n, dtype, gemv_calls, gemv_f32_calls):
    """Rows not in whole blocks of the layout (64 or 32 outputs), or fp16 activations:
    torch's kernel, same result."""
    res, w = make_resident(n, 256, 4, 64, True, False, seed=n)
    prepared = prepare(res, dtype)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    y = linear(x, prepared)
    err = (y.double() - x.double() @ w.t()).abs()
    assert bool((err <= REL * (x.double().abs() @ w.abs().t()) + 1e-6).all())
    assert gemv_calls() == (0, 0) and gemv_f32_calls() == (0, 0)


def test_traces_as_one_op():
    """torch.compile keeps the GEMV as one call (its fake kernel gives the shape)."""
    res, _ = make_resident(64, 256, 4, 64, False, False, seed=1)
    prepared = prepare(res, torch.bfloat16)
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: linear(x, prepared), fullgraph=True, dynamic=True,
                             backend="aot_eager")
    for tokens in (1, 9):
        x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens)).bfloat16()
        torch.testing.assert_close(compiled(x), linear(x, prepared), rtol=0, atol=0)


#: max |vLLM logprob - HF logprob| of each generated token, teacher-forced on vLLM's
#: tokens: vLLM runs bf16 (activations, KV cache, scales rounded to bf16), HF fp32 on
#: the dequantized weights. Measured on this 2-layer model: 2.3e-2; with the GEMV's
#: zero term off by one code (135 for 136), 4.2.
BF16_LOGPROB_BOUND = 0.1


@pytest.mark.engine
def test_compiled_bf16_engine_runs_the_gemv_and_matches_hf(tmp_path):
    """vLLM's default mode, bf16, a GPTQ 4-bit model on the simulator: each decoder
    layer runs as one C++ op (inductor's code calls it once a layer and no int4 op)
    whose four linears take the C++ kernel for every batch (decode and these
    prompts' prefills, all up to 64 rows), and the logprobs of the generated tokens
    match HF transformers' fp32 logprobs on the dequantized weights."""
    import random
    import re

    from conftest import build_tiny_model, run_engine
    from quantizer import quantize_checkpoint
    from test_quant_awq import logprob_gap

    src = build_tiny_model(tmp_path / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)  # qkv 256, o 128, gate_up 512, down 128 rows
    quantize_checkpoint(src, tmp_path / "gptq", bits=4, group_size=32, sym=False,
                        desc_act=False, dequant_dst=tmp_path / "dequant")
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 23, 11)]
    results, log = run_engine({
        "llm": {"model": str(tmp_path / "gptq"), "dtype": "bfloat16", "skip_tokenizer_init": True,
                "max_model_len": 256, "seed": 0},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                     "detokenize": False, "logprobs": 1},
        "worker_kernel_calls": ["int4pack_linear", "cpu_decoder_layer"],
    }, tmp_path, env={"TORCH_LOGS": "output_code", "VLLM_DISABLE_COMPILE_CACHE": "1"})
    assert "Warming up model for the compilation" in log
    assert "wint_prepared_linear[cpu_native]" in log and "serves 8 gcu_gptq layers" in log
    code = [line.split("[__output_code]", 1)[1] for line in log.splitlines()
            if "[__output_code]" in line]
    int4_calls = [line for line in code
                  if re.match(r"^(?!\s*#).*?\bvllm_accel\.int4pack_linear\.default\(", line)]
    layer_calls = [line for line in code
                   if re.match(r"^(?!\s*#).*?\bvllm_accel\.llama_layer\.default\(", line)]
    if native.torch_ops() is None:  # no C++ ops library: vLLM's layers, the op a linear
        assert len(int4_calls) == 8 and not layer_calls, (layer_calls, int4_calls)
    else:
        assert "each runs as one C++ op (vllm_accel::cpu_decoder_layer), 2 layers" in log
        assert len(layer_calls) == 2 and not int4_calls, (layer_calls, int4_calls)
        (counts,) = results["worker_kernel_calls"]
        assert counts["cpu_decoder_layer"][0] >= 2 * 15, counts  # each decode step's 2 layers
        if wint_gemv.gemv_available():  # the four linears inside each layer op
            assert counts["int4pack_linear"][0] >= 4 * counts["cpu_decoder_layer"][0], counts
    gap = logprob_gap(tmp_path / "dequant", prompts, results)
    print(f"bf16 compiled GPTQ engine: max logprob gap vs HF fp32 {gap:.3e}")
    assert gap <= BF16_LOGPROB_BOUND


@VARIANTS
@pytest.mark.parametrize("tokens", [3, 6])  # streamed GEMV, slabs
def test_non_finite_x_gives_non_finite_rows_only(variant, tokens):
    """A NaN or inf in a row of ``x`` makes that row's outputs NaN/inf (the int16
    variant's fixed point would otherwise round it to a finite code), and only that
    row's: the other rows of the batch stay exact."""
    lib = native.library()
    if lib is None:  # no compiler: nothing to call, and the op keeps torch's kernel
        assert not wint_gemv.gemv_available()
        return
    k, n, group = 256, 128, 64
    res, w = make_resident(n, k, 4, group, False, False, seed=3)
    prepared = prepare(res, torch.bfloat16)
    x = torch.randn(tokens, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[0, 70] = float("nan")
    x[1, 200] = float("inf")
    rc, y = _run_variant(lib, variant, x, prepared, group)
    if not lib.accel_int4pack_gemv_available() & variant:
        assert rc == -5
        return
    assert rc == 0
    assert not y[0].isfinite().any() and not y[1].isfinite().any()
    err = (y[2:].double() - x[2:].double() @ w.t()).abs()
    assert bool((err <= REL * (x[2:].double().abs() @ w.abs().t()) + 1e-6).all())
