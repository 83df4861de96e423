"""The ``cpu_native`` bf16 linear (``csrc/bf16_linear.cpp``): float32 FMAs on bf16
weights, AVX512-BF16 dot products for batches of bf16 x where the CPU has them (a
packed-panel GEMM for big ones), and big batches handed to torch's linear where the CPU
has AMX. The op and the C
kernel vs ``x @ W.T`` in float64, and a compiled engine whose linears run it, scored
against HF transformers on the same bf16 weights. (The patch that routes vLLM's CPU
linears to it: test_patches.py.)"""

import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch

from conftest import (assert_bf16_tokens_near_hf, build_tiny_model, count_native_calls, cpu_has,
                      kernel_calls, run_engine)
from vllm_accel.ops.cpu_native import bf16_linear
from vllm_accel.ops.cpu_native import build as native

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def test_kernel_is_built_exactly_on_avx512_or_avx2():
    """Built in with AVX-512 F/BW/VL or with AVX2 + FMA + F16C; its AVX512-BF16 tiles (from 3 rows of bf16 x)
    exactly where the CPU has them, its AMX tiles (from 4 rows) exactly where it has AMX
    (Linux grants the tile state: kernel 5.16+); batches handed to oneDNN only where the
    CPU has AMX (from 640 rows; where the process may not use the tiles, oneDNN may
    not either, and as with AVX512-BF16 alone the kernel keeps every batch), never for
    float32 x: dispatch on what the CPU reports."""
    built = native.library() is not None and (cpu_has("avx512f", "avx512bw", "avx512vl")
                                              or cpu_has("avx2", "fma", "f16c"))
    assert bf16_linear.available() == built
    assert bf16_linear.cpu_has_bf16_units() == (cpu_has("avx512_bf16") or cpu_has("amx_tile"))
    assert bf16_linear.dp_rows() == (3 if built and cpu_has("avx512_bf16") else 0)
    amx = built and cpu_has("amx_tile", "amx_bf16", "avx512_bf16")
    assert bf16_linear.amx_rows() == (4 if amx else 0)
    assert bf16_linear.onednn_rows(torch.bfloat16) == (640 if amx else 0)
    assert bf16_linear.onednn_rows(torch.float32) == 0


@pytest.mark.parametrize("mode", ["auto", "on", "off"])
def test_wanted_follows_the_variable_and_the_cpu(mode, monkeypatch):
    monkeypatch.setenv("ACCEL_BF16_LINEAR", mode)
    expected = {"off": False, "on": bf16_linear.available(),
                "auto": bf16_linear.available()}[mode]
    assert bf16_linear.wanted() == expected


@pytest.fixture
def linear_calls(monkeypatch):
    """(calls, rows) of the C++ kernel so far (the op falls back to F.linear silently)."""
    return kernel_calls(monkeypatch, "bf16_linear", "accel_bf16_linear", 8)


def test_op_dispatches_to_cpp_wherever_the_kernels_build():
    """The op's CPU kernel is the C++ one (no Python per call) whenever the kernel
    library builds; the Python kernel is only the fallback for a failed torch build."""
    assert bf16_linear.NATIVE_DISPATCH == (native.library() is not None)


@pytest.mark.parametrize("m,n,k", [(1, 9, 37), (7, 64, 576), (70, 16, 64)])
def test_python_kernel_matches_the_cpp_kernel(m, n, k, monkeypatch):
    """``bf16_linear.bf16_linear`` (the op's kernel where csrc/torch_ops.cpp cannot be
    built) calls the same C kernel, or hands the same batches to torch's linear: the
    same bits, and one call per op."""
    rows = count_native_calls(monkeypatch, "accel_bf16_linear", 8)
    gen = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    got = bf16_linear.bf16_linear(x, w, bias)
    ref = x.double() @ w.double().T + bias.double()
    assert ((got.double() - ref).abs() <= 2.0**-8 * ref.abs() + 1e-3).all()
    assert torch.equal(got, torch.ops.vllm_accel.bf16_linear(x, w, bias))
    handed_over = 0 < bf16_linear.onednn_rows(torch.bfloat16) <= m
    assert rows == ([m] if bf16_linear.available() and not handed_over else [])


# (bf16 x from 3 rows runs the AVX512-BF16 tiles where the CPU has them, from 24 their
# packed-panel GEMM, and 70 rows go to torch's linear where it has AMX:
# test_c_kernel_... covers those in the kernel)
# rows: 1 and 5 stream the weight (one tile), 7/13 widen it into the buffer (tiles of 6 +
# tails), 70 spans two 64-row blocks of x; outputs 9 and 130 end in a partial block of
# 4, inputs 37 and 100 in a partial 16-column chunk
SHAPES = [(1, 9, 37), (5, 130, 100), (7, 64, 576), (13, 9, 100), (70, 130, 37)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_op_matches_float64(m, n, k, dtype, linear_calls):
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
    # x as a slice of a wider tensor (row stride > k), with a bias on every other case
    x = torch.randn(m, k + 3, generator=gen).to(dtype)[:, 1:k + 1]
    bias = torch.randn(n, generator=gen).to(dtype) if (m + n) % 2 else None
    got = torch.ops.vllm_accel.bf16_linear(x, w, bias)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # float32 sums (K terms) and one rounding to x's dtype
    tol = UNIT_ROUNDOFF[dtype] * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert got.dtype == dtype and got.shape == (m, n)
    assert ((got.double() - ref).abs() <= tol + 1e-30).all(), (got.double() - ref).abs().max()
    handed_over = 0 < bf16_linear.onednn_rows(dtype) <= m
    assert linear_calls() == ((1, m) if bf16_linear.available() and not handed_over else (0, 0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32],
                         ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("batch,m,n,k", [(16, 1, 512, 128), (5, 3, 130, 37), (3, 27, 9, 100)])
def test_batched_op_matches_float64(batch, m, n, k, dtype, monkeypatch):
    """vllm_accel::cpu_bf16_bmm (MLA's absorbed-weight products: one weight per head)
    on the strides vLLM passes: x a head-major view of token-major rows, out a
    transposed view; every head in one call of the kernel, within the 2-D op's bound."""
    gen = torch.Generator().manual_seed(batch * 100 + m)
    x = torch.randn(m, batch, k, generator=gen).to(dtype).transpose(0, 1)
    w = torch.randn(batch, n, k, generator=gen).to(torch.bfloat16)
    out = torch.empty(m, batch, n, dtype=dtype).transpose(0, 1)
    if native.torch_ops() is None:  # (no dispatcher library: MLA keeps torch's bmm)
        from types import SimpleNamespace

        from vllm_accel.ops.cpu_native import mla as native_mla
        layer = SimpleNamespace(W_UK_T=w.transpose(1, 2), W_UV=w.transpose(1, 2))
        assert not native_mla.takes_absorbed_weights(layer)
        return
    calls = kernel_calls(monkeypatch, "cpu_bf16_bmm", "", 0)
    torch.ops.vllm_accel.cpu_bf16_bmm(x, w, out)
    ref = torch.bmm(x.double(), w.double().transpose(1, 2))
    tol = UNIT_ROUNDOFF[dtype] * ref.abs() + k * 2.0**-23 * torch.bmm(
        x.double().abs(), w.double().abs().transpose(1, 2))
    assert ((out.double() - ref).abs() <= tol + 1e-30).all(), (out.double() - ref).abs().max()
    assert calls() == ((1, batch * m) if bf16_linear.available() else (0, 0))
    # a float32 weight is torch's bmm
    w32 = w.float()
    torch.ops.vllm_accel.cpu_bf16_bmm(x, w32, out)
    torch.testing.assert_close(out, torch.bmm(x, w32.transpose(1, 2).to(dtype)))


def _c_kernel(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The C kernel itself (no hand-over to oneDNN), on a row-strided x."""
    m, k = x.shape
    y = x.new_empty((m, w.shape[0]))
    b = None if bias is None else bias.float().contiguous()
    rc = native.library().accel_bf16_linear(
        x.data_ptr(), x.stride(0), native.dtype_code(x.dtype), w.data_ptr(), w.stride(0),
        None if b is None else b.data_ptr(), y.data_ptr(), y.stride(0), m, w.shape[0], k)
    assert rc == 0
    return y


# rows: 1 and 2 stream through the float32 tile; from 3, bf16 x runs the AVX512-BF16
# tiles where built (3 and 6 one tile, 13 two of 6 and a tail), from 24 their packed-
# panel GEMM (27: two tiles of 12 and a tail; 270: two 256-row blocks); outputs 9 and 130
# end in a partial panel of 32, 130's in its second half; inputs 37 and 100 end in a
# partial 32-column step, 64 does not. With AMX, from 4 rows: 6 and 13 one 16-row tile
# of x, 17 and 27 two (the second nearly empty), 40 a pair and one, 270 two 256-row
# blocks; outputs 8 and 9 one partial weight tile, 48 a block of 32 and one of 16, 130 a
# partial last block, 300 two chunks of weight blocks (the second ending in a partial
# one); inputs 576 and 64 whole 32-column steps (the weight read in place),
# 37 and 100 a padded copy
C_SHAPES = [(1, 9, 37), (2, 130, 100), (3, 130, 64), (6, 8, 100), (13, 130, 37),
            (17, 48, 576), (27, 130, 100), (40, 48, 64), (40, 300, 100), (270, 9, 64)]


@pytest.mark.skipif(not bf16_linear.available(), reason="needs AVX-512 F/BW/VL or AVX2 + FMA + F16C (kernel not built)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("m,n,k", C_SHAPES)
def test_c_kernel_matches_float64_at_every_batch(m, n, k, dtype):
    """Every batch size through the C kernel, whichever tiles this CPU has, including
    the ones the op hands to oneDNN."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k + 5, generator=gen).to(torch.bfloat16)[:, 2:k + 2]  # row stride > k
    x = torch.randn(m, k + 3, generator=gen).to(dtype)[:, 1:k + 1]
    bias = torch.randn(n, generator=gen) if m % 2 else None
    got = _c_kernel(x, w, bias)
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    tol = UNIT_ROUNDOFF[dtype] * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    assert ((got.double() - ref).abs() <= tol + 1e-30).all(), (got.double() - ref).abs().max()


@pytest.mark.skipif(not bf16_linear.available(), reason="needs AVX-512 F/BW/VL or AVX2 + FMA + F16C (kernel not built)")
def test_op_hands_big_bf16_batches_to_onednn_only_where_the_cpu_has_amx(linear_calls):
    """From ``onednn_rows`` rows of bf16 x the op's answer is torch's linear, bit for
    bit, without the kernel; on a CPU without AMX (0: never) every batch runs the
    kernel."""
    rows = bf16_linear.onednn_rows(torch.bfloat16) or 300
    w = torch.randn(40, 96).to(torch.bfloat16)
    x = torch.randn(rows, 96).to(torch.bfloat16)
    got = torch.ops.vllm_accel.bf16_linear(x, w, None)
    if bf16_linear.onednn_rows(torch.bfloat16):
        assert torch.equal(got, torch.nn.functional.linear(x, w)) and linear_calls() == (0, 0)
        got = torch.ops.vllm_accel.bf16_linear(x[:rows - 1], w, None)
        assert linear_calls() == (1, rows - 1)
    else:
        assert linear_calls() == (1, rows)
    torch.testing.assert_close(got.float(), (x[:got.shape[0]].double() @ w.double().T).float(),
                               rtol=2**-7, atol=1e-3)


def test_op_takes_batched_x_and_empty_batches(linear_calls):
    w = torch.randn(24, 40).to(torch.bfloat16)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    got = torch.ops.vllm_accel.bf16_linear(x, w, None)
    assert got.shape == (2, 3, 24)
    torch.testing.assert_close(got.float(), x.float() @ w.float().T, rtol=2**-7, atol=1e-3)
    assert torch.ops.vllm_accel.bf16_linear(x[:, :0], w, None).shape == (2, 0, 24)
    assert linear_calls() == ((1, 6) if bf16_linear.available() else (0, 0))  # empty: none


def test_op_falls_back_to_torch_for_what_the_kernel_does_not_take(linear_calls):
    """A bias that is not ``[N]``, an empty K, a non-bf16 or column-strided weight:
    ``F.linear``'s answer (or its error), never the kernel."""
    x = torch.randn(3, 40).to(torch.bfloat16)
    w = torch.randn(24, 40).to(torch.bfloat16)
    with pytest.raises(RuntimeError):
        torch.ops.vllm_accel.bf16_linear(x, w, torch.zeros(23, dtype=torch.bfloat16))
    bias = torch.ones(24, dtype=torch.bfloat16)
    empty = torch.ops.vllm_accel.bf16_linear(x[:, :0], w[:, :0], bias)
    assert empty.shape == (3, 24) and torch.equal(empty.float(), torch.ones(3, 24))
    for weight in (w.float(), torch.randn(40, 24).to(torch.bfloat16).T):
        got = torch.ops.vllm_accel.bf16_linear(x, weight, None)
        torch.testing.assert_close(got.float(), x.float() @ weight.float().T, rtol=2**-7, atol=1e-3)
    assert linear_calls() == (0, 0)


def test_op_traces_into_one_call_under_compile():
    w = torch.randn(48, 64).to(torch.bfloat16)

    def fn(x):
        return torch.relu(torch.ops.vllm_accel.bf16_linear(x, w, None)) * 2

    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="aot_eager")
    for rows in (1, 6):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        torch.testing.assert_close(compiled(x), fn(x))


#: inductor's generated code calling our ops
BF16_LINEAR_CALL = re.compile(r"^(?!\s*#).*?\bvllm_accel\.bf16_linear\.default\(")
LLAMA_LAYER_CALL = re.compile(r"^(?!\s*#).*?\bvllm_accel\.llama_layer\.default\(")
ONEDNN_CALL = re.compile(r"^(?!\s*#).*?\bonednn_mm\(")


@pytest.mark.engine
def test_compiled_engine_runs_the_kernel_and_matches_hf(tmp_path):
    """vLLM's default mode on a tiny bf16 model with default settings: every
    linear of the decoder runs the op (inside the one op a decoder layer is,
    models/llama.py; no oneDNN GEMM), and the
    engine's greedy tokens, teacher-forced through HF transformers on the same bf16
    weights (float32 math), are HF's top token or within 0.05 nats of it, with the
    engine's logprob of each within 0.05 of HF's. vLLM's multiprocess engine, as a
    user runs it: on 2+ cores the lone device's worker runs in EngineCore's process
    with a thread on every core (ACCEL_SIM_SHARE_SCHEDULER_CORE=on)."""
    model = build_tiny_model(tmp_path / "tiny", num_heads=4, num_kv_heads=2, head_dim=32,
                             hidden_size=128, norm_spread=0.3)
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 17, 40)]
    results, log = run_engine(
        {"llm": {"model": str(model), "dtype": "bfloat16", "skip_tokenizer_init": True,
                 "max_model_len": 256, "seed": 0},
         "prompts": prompts,
         "sampling": {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True,
                      "detokenize": False, "logprobs": 1},
         "worker_kernel_calls": ["bf16_linear", "cpu_decoder_layer"], "worker_threads": True},
        tmp_path, env={"ACCEL_SIM_DEVICE_MEMORY_GB": "1", "TORCH_LOGS": "output_code",
                       "VLLM_DISABLE_COMPILE_CACHE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
                       "ACCEL_SIM_SHARE_SCHEDULER_CORE": "on",
                       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})
    assert "Warming up model for the compilation" in log
    cores = len(os.sched_getaffinity(0))
    if cores > 1:
        assert "the lone simulated gcu runs its worker in EngineCore's process" in log
        assert "Rank 0 on cpu: worker" in log and "(Worker pid=" not in log
        assert re.search(r"\(EngineCore pid=\d+\) .*Rank 0 on cpu: worker", log)
        assert [w["threads"] for w in results["worker_threads"]] == [cores]
    code = [line.split("[__output_code]", 1)[1] for line in log.splitlines()
            if "[__output_code]" in line]
    layer_calls = [line for line in code if LLAMA_LAYER_CALL.match(line)]
    assert not [line for line in code if BF16_LINEAR_CALL.match(line)]
    if bf16_linear.available():
        assert "bf16 Linear layers run the cpu_native kernel (ACCEL_BF16_LINEAR=auto; " in log
        assert "each runs as one C++ op (vllm_accel::cpu_decoder_layer), 2 layers" in log
        assert len(layer_calls) == 2, layer_calls  # one op a decoder layer
        assert not [line for line in code if ONEDNN_CALL.match(line)]
        (counts,) = results["worker_kernel_calls"]
        assert counts["cpu_decoder_layer"][0] >= 2 * 15, counts  # each decode step's 2 layers
        # the layers' four linears ran this kernel inside the layer op
        assert counts["bf16_linear"][0] >= 4 * counts["cpu_decoder_layer"][0], counts
    else:
        assert not layer_calls

    assert_bf16_tokens_near_hf(model, prompts, results["outputs"])


def test_kernel_benchmark_builds_with_the_plugins_flags():
    """benchmarks/bf16_linear_rows.py builds the kernel without importing the plugin:
    its copy of the flags must be build.py's, or its numbers are another kernel's."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "bf16_linear_rows.py"
    spec = importlib.util.spec_from_file_location("bf16_linear_rows", path)
    bench = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(path.parent))
    assert bench.FLAGS == native.FLAGS
