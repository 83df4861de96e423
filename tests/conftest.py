"""Shared fixtures: tiny random-weight models, the default model, engine runs."""

import functools
import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

TESTS = Path(__file__).parent
# Small simulated GCU for engine tests (1 GiB): its KV cache is allocated, zeroed and
# handed to vLLM's block pool at every engine start, ~1 s of a tiny engine's start
# at 4 GiB on 2 cores (Intel Xeon with AMX, 2026-12-05).
# EngineCore runs inside the engine_run process (vLLM's in-process client): on 2
# cores that halves an engine test (one interpreter fewer importing torch and
# vLLM while the others start). Tokens do not depend on it; the server tests,
# tensor parallel (worker processes) and tests that pass "1" keep vLLM's default
# multiprocess engine.
# Multiprocess engines keep vLLM's reserved EngineCore core where they have two
# (under `make test` each engine has its xdist worker's core, `on_worker_core`);
# test_cpu_native_bf16_linear's compiled engine runs the default, shared core.
ENGINE_ENV = {"ACCEL_SIM_DEVICE_MEMORY_GB": "1", "VLLM_LOGGING_LEVEL": "INFO",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "ACCEL_SIM_SHARE_SCHEDULER_CORE": "off"}
#: the default model in float32 on the simulator (every test engine of it is float32):
#: its 0.6 GiB of weights and 0.22 GiB activation reserve leave ENGINE_ENV's 1 GiB
#: device under 0.1 GiB of KV cache
DEFAULT_MODEL_DEVICE_ENV = {"ACCEL_SIM_DEVICE_MEMORY_GB": "2"}
#: every public torch.cuda entry point raises for vLLM / vllm_accel callers
#: (tests/forbid_cuda/sitecustomize.py): proves the card path makes no CUDA call
FORBID_CUDA_ENV = {"ACCEL_TEST_FORBID_CUDA": "1", "PYTHONPATH": str(TESTS / "forbid_cuda")}
#: the virtual GCU through the card path, with the CUDA guard
VIRTUAL_GCU_ENV = {"ACCEL_BACKEND": "virtual", "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
                   **FORBID_CUDA_ENV}


VLLM = str(Path(sys.executable).parent / "vllm")

#: the slowest files first (summed seconds each in `make test`'s xdist part, AMD EPYC
#: Zen 4, 2 cores, 2026-12-07): `make test` runs two pytest-xdist workers that take whole
#: files in this order (`--no-loadscope-reorder`: xdist would otherwise start the files
#: with the most tests first, which left the engine-heavy ones running alone at the
#: end), so no long file starts last
SLOW_FILES = ("test_vlm.py", "test_attention_models.py", "test_as_cpu.py",  # 260-340 s
              "test_e2e_fp8_kv.py", "test_pooling_server.py", "test_quant_compiled.py",
              "test_state_space_models.py", "test_moe_engine.py", "test_model_families.py",
              "test_spec_decode.py", "test_server.py", "test_e2e_scheduling.py",  # 130-165
              "test_remote_code_families.py",
              "test_moe_quant.py", "test_lora.py", "test_reliability.py", "test_e2e_tiny.py",
              "test_virtual_gcu.py", "test_backend_faithful.py", "test_e2e_default_model.py",
              "test_speech_models.py", "test_rerankers.py",
              "test_fused_layer.py", "test_quant_w8a8.py", "test_quant_fp8_mxfp4.py",  # 90-125
              "test_quant_gptq.py", "test_triton_kernels.py", "test_repack_cache.py",
              "test_e2e_int8_kv.py", "test_registration.py", "test_quant_awq.py",
              "test_quant_compressed_tensors.py", "test_scaling_out.py", "test_preflight.py",
              "test_models.py", "test_model_check.py")


def pytest_collection_modifyitems(items):
    """Slow files first, each file's tests in their own order (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOW_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FILES)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_server(args: list[str], log_path: Path, env: dict | None = None) -> subprocess.Popen:
    """``vllm serve ARGS`` (the real console script, vLLM's multiprocess engine) in
    its own process group, so a test can kill it whole like a dead host; under
    ``make test`` on this xdist worker's core (``on_worker_core``)."""
    return subprocess.Popen([VLLM, "serve", *args], stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, **ENGINE_ENV,
                                 "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **(env or {})},
                            preexec_fn=on_worker_core())


def start_server(args: list[str], log_path: Path, env: dict | None = None,
                 timeout: float = 300) -> tuple[subprocess.Popen, str]:
    """``vllm serve ARGS`` on a free loopback port, once /health answers: (process, base URL)."""
    port = free_port()
    proc = spawn_server([*args, "--host", "127.0.0.1", "--port", str(port)], log_path, env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(
                f"server exited {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError(f"server not healthy in time:\n{log_path.read_text()[-5000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(autouse=True, scope="session")
def _private_repack_cache(tmp_path_factory):
    """Keep the tests' repack-cache entries out of the user's cache (engine
    subprocesses inherit it); tests about the cache set their own directory."""
    os.environ.setdefault("ACCEL_REPACK_CACHE", str(tmp_path_factory.mktemp("repack-cache")))


#: /proc/cpuinfo flags and the macros a compiler defines where its -march enables them
_FLAG_MACROS = {
    "avx2": "__AVX2__", "fma": "__FMA__", "f16c": "__F16C__", "avx512f": "__AVX512F__",
    "avx512bw": "__AVX512BW__", "avx512vl": "__AVX512VL__", "avx512vbmi": "__AVX512VBMI__",
    "avx512_vnni": "__AVX512VNNI__", "avx512_bf16": "__AVX512BF16__",
    "avx512_fp16": "__AVX512FP16__", "amx_tile": "__AMX_TILE__", "amx_bf16": "__AMX_BF16__",
    "amx_int8": "__AMX_INT8__", "avx_vnni": "__AVXVNNI__",
}


@functools.cache
def _build_target_macros() -> frozenset[str] | None:
    """The macros of the -march the kernels are built for (``ACCEL_NATIVE_MARCH``), as
    the compiler defines them; None for ``native`` (this CPU's flags)."""
    march = os.environ.get("ACCEL_NATIVE_MARCH", "").strip() or "native"
    if march == "native":
        return None
    from vllm_accel.ops.cpu_native import build as native

    out = subprocess.run([native.compiler(), f"-march={march}", "-dM", "-E", "-x", "c++",
                          os.devnull], capture_output=True, text=True, check=True).stdout
    return frozenset(line.split()[1] for line in out.splitlines() if line.startswith("#define"))


def cpu_has(*flags: str) -> bool:
    """Whether the kernels may use every one of ``flags``: /proc/cpuinfo lists it (what
    the kernels dispatch on) and the -march they are built for enables it
    (``ACCEL_NATIVE_MARCH``, which ``benchmarks/as_cpu.py avx2`` holds to x86-64-v3);
    for AMX flags, also whether the OS grants this process AMX tile state (torch asks
    with the kernels' ``arch_prctl`` request; ``benchmarks/as_cpu.py`` refuses it)."""
    if any(f.startswith("amx") for f in flags) and not torch._C._cpu._init_amx():
        return False
    macros = _build_target_macros()
    if macros is not None and not all(_FLAG_MACROS[f] in macros for f in flags):
        return False
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(flags) <= set(line.split(":", 1)[1].split())
    return False


def count_native_calls(monkeypatch, symbol: str, rows_arg: int) -> list:
    """Records argument ``rows_arg`` of each call of the cpu_native library's
    ``symbol`` (the ops fall back to torch silently); stays empty without a library."""
    from vllm_accel.ops.cpu_native import build as native

    lib = native.library()
    calls = []
    if lib is None:
        return calls
    real = getattr(lib, symbol)

    def counted(*args):
        calls.append(args[rows_arg])
        return real(*args)

    monkeypatch.setattr(lib, symbol, counted)
    return calls


def kernel_calls(monkeypatch, op: str, symbol: str, rows_arg: int):
    """A function returning ``(calls, rows summed)`` of the C kernel behind
    ``vllm_accel::<op>`` since this call (the ops fall back to torch silently):
    counted by the op's C++ kernel (csrc/torch_ops.cpp) or, where that library is
    not built, at the Python kernel's ctypes call of ``symbol``."""
    import ctypes

    from vllm_accel.ops.cpu_native import build as native

    ops = native.torch_ops()
    if ops is None:
        rows = count_native_calls(monkeypatch, symbol, rows_arg)
        return lambda: (len(rows), sum(rows))

    def counted():
        rows = ctypes.c_int64()
        calls = ops.accel_torch_ops_kernel_calls(op.encode(), ctypes.byref(rows))
        return calls, rows.value

    start = counted()
    return lambda: tuple(now - then for now, then in zip(counted(), start))


def _xdist_worker_core() -> int | None:
    """The core of this pytest-xdist worker (``make test`` runs one per core), or None
    outside xdist or with more workers than cores."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if workers < 2 or not worker.startswith("gw") or len(cores) < workers:
        return None
    return cores[int(worker[2:]) % len(cores)]


def on_worker_core():
    """A ``preexec_fn`` putting a child process (and its children) on this xdist
    worker's core, or None outside xdist. vLLM binds a lone CPU worker to the first
    core it may use: a server or multiprocess engine of the worker on core 1 ran its
    model on core 0, beside the engines of the worker there (the node-0 timeout test,
    39 s alone, took 106-180 s in the suite; AMD EPYC Zen 4)."""
    core = _xdist_worker_core()
    return None if core is None else functools.partial(os.sched_setaffinity, 0, {core})


def _engine_pin(spec: dict, env: dict):
    """Where an engine of one rank runs under xdist (``on_worker_core``'s
    ``preexec_fn``, or None for the whole machine): the simulator's worker
    runs a thread on every core it may use, so two xdist workers' engines ran four
    OpenMP threads on two cores, each barrier waiting for a descheduled thread (a
    default-model engine test took 4-6x its time alone). Engines with more ranks
    or a check of their cores keep the whole machine."""
    llm = spec.get("llm", {})
    single = all(llm.get(f"{kind}_parallel_size", 1) == 1
                 for kind in ("tensor", "pipeline", "data"))
    if not single or spec.get("worker_threads") or "VLLM_CPU_OMP_THREADS_BIND" in env:
        return None
    return on_worker_core()


def _engine_process(spec_file_content: dict, core_spec: dict, tmp_path: Path,
                    env: dict | None, timeout: int, **streams) -> subprocess.CompletedProcess:
    """tests/engine_run.py on ``spec_file_content`` in the engine environment, pinned to
    the core ``core_spec``'s engine gets (``_engine_pin``)."""
    spec_file = tmp_path / f"spec-{os.getpid()}-{len(list(tmp_path.iterdir()))}.json"
    spec_file.write_text(json.dumps(spec_file_content))
    run_env = {**os.environ, **ENGINE_ENV, **(env or {})}
    return subprocess.run(
        [sys.executable, str(TESTS / "engine_run.py"), str(spec_file)], text=True,
        timeout=timeout, env=run_env, preexec_fn=_engine_pin(core_spec, run_env), **streams)


def run_engine(spec: dict, tmp_path: Path, env: dict | None = None, timeout: int = 600):
    """Run tests/engine_run.py with ``spec``; returns (results, combined log)."""
    proc = _engine_process(spec, spec, tmp_path, env, timeout, capture_output=True)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    marker = "ENGINE_RESULT "
    line = next(line for line in proc.stdout.splitlines() if line.startswith(marker))
    return json.loads(line[len(marker):]), log


def run_engines(specs: dict[str, dict], tmp_path: Path, env: dict | None = None,
                timeout_each: int = 300) -> dict[str, tuple[dict | None, str]]:
    """Run several engines one after another in one engine_run.py process (same
    environment; each engine shut down before the next): ``{key: (results or None
    where that engine failed, its own log)}``. What separate ``run_engine`` calls give,
    less each later engine's interpreter start and imports."""
    proc = _engine_process({"engines": specs}, next(iter(specs.values())), tmp_path, env,
                           timeout_each * len(specs), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT)
    out: dict[str, tuple[dict | None, str]] = {}
    key, lines = None, []
    for line in proc.stdout.splitlines() + ["ENGINE_BEGIN "]:
        if line.startswith("ENGINE_BEGIN "):
            if key is not None:
                results = next((json.loads(line_.split(" ", 2)[2]) for line_ in lines
                                if line_.startswith(f"ENGINE_RESULT {key} ")), None)
                out[key] = (results, "\n".join(lines))
            key, lines = line.split(" ", 1)[1], []
        else:
            lines.append(line)
    tail = proc.stdout[-6000:]
    for key in specs:  # engines the process never reached (it died): its end
        out.setdefault(key, (None, f"the engine process ended (rc {proc.returncode}) before "
                                   f"this engine ran:\n{tail}"))
    return out


class SharedEngines:
    """A test module's engines, ``{key: (spec, env)}``: the first test that asks for
    one runs every engine of that environment (simulator, virtual GCU, ...) in one
    process (``run_engines``); each test then checks its own engine's results and log."""

    def __init__(self, engines: dict[str, tuple[dict, dict | None]], tmp_path: Path):
        self.engines, self.tmp_path = engines, tmp_path
        self.outcomes: dict[str, tuple[dict | None, str]] = {}

    def __call__(self, key: str) -> tuple[dict, str]:
        """(results, log) of engine ``key``; fails the test where that engine failed."""
        if key not in self.outcomes:
            env = self.engines[key][1]
            group = {k: spec for k, (spec, e) in self.engines.items()
                     if e == env and k not in self.outcomes}
            self.outcomes.update(run_engines(group, self.tmp_path, env=env))
        results, log = self.outcomes[key]
        assert results is not None, log[-6000:]
        return results, log


def build_tiny_model(path: Path, arch: str = "llama", num_heads: int = 4,
                     num_kv_heads: int = 2, head_dim: int = 16, hidden_size: int | None = None,
                     layers: int = 2, vocab: int = 512, seed: int = 0,
                     norm_spread: float = 0.0, head_std: float = 0.08) -> Path:
    """A random-weight Llama/Qwen2/Qwen3 checkpoint (a few MB) written as HF safetensors;
    ``norm_spread`` > 0 draws the RMSNorm weights from N(1, norm_spread) instead of HF's
    all-ones init (so swapping two norms changes the output); ``head_std`` is the LM
    head's: its logits' spread is ``head_std * sqrt(hidden)`` (0.08 at hidden 128: about
    0.9, so the top two tokens are ~0.25 nats apart on average; 0.4: ~4.5, far from
    ties that kernels' rounding, or an INT8 KV cache's, could flip)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    hidden = hidden_size or num_heads * head_dim
    common = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )
    config = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[arch](**common)
    config.dtype = torch.float32
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Wider weights than the default init, so logits are far from ties.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                p.normal_(0, head_std if name == "lm_head.weight" else 0.08)
            elif norm_spread and "norm" in name:
                p.normal_(1.0, norm_spread)
    model.save_pretrained(path, safe_serialization=True)
    return path


def tiny_quant_source(root: Path, case: str) -> tuple[Path, list[list[int]]]:
    """A quantization file's tiny float checkpoint for ``case`` (4 heads, 2 KV heads,
    hidden 128) and six prompts of 2 to 60 random tokens seeded by the case's name."""
    src = build_tiny_model(root / case / "float", num_heads=4, num_kv_heads=2, head_dim=32,
                           hidden_size=128)
    rng = random.Random(case)
    return src, [[rng.randrange(3, 512) for _ in range(n)] for n in (4, 9, 17, 33, 2, 60)]


def greedy_spec(model: Path, prompts: list[list[int]], new_tokens: int, *,
                max_model_len: int, tokenizer: bool = False, logprobs: bool = True,
                **llm) -> dict:
    """An eager float32 engine's spec: greedy ``new_tokens`` per prompt (with the
    chosen tokens' log-probs); ``tokenizer`` False: token ids only."""
    sampling = {"temperature": 0.0, "max_tokens": new_tokens, "ignore_eos": True}
    if not tokenizer:
        llm["skip_tokenizer_init"] = True
        sampling["detokenize"] = False
    if logprobs:
        sampling["logprobs"] = 1
    return {"llm": {"model": str(model), "dtype": "float32", "enforce_eager": True,
                    "max_model_len": max_model_len, "seed": 0, **llm},
            "prompts": prompts, "sampling": sampling}


def add_default_model_engine(specs: dict, cases: dict, default_model: Path, quantized: Path,
                             dequant: Path, texts: list[str], env: dict | None) -> None:
    """Adds the default model's quantized checkpoint to a quantization file's shared
    engines as ``"default"``: ``texts`` tokenized, 32 greedy tokens with log-probs;
    ``cases["default"]`` is (its dequantized oracle checkpoint, the prompts)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok(text)["input_ids"] for text in texts]
    cases["default"] = (dequant, prompts)
    specs["default"] = (greedy_spec(quantized, prompts, 32, max_model_len=512, tokenizer=True),
                        env)


@pytest.fixture(scope="session")
def default_model() -> Path:
    from vllm_accel.tools.models import prepare_default_model

    return prepare_default_model()


def assert_bf16_tokens_near_hf(model_dir: Path, prompts: list[list[int]], outputs: list[dict],
                               nats: float = 0.05) -> None:
    """Each generated token of a bf16 engine (``outputs``: engine_run's, with ``logprobs``
    1), teacher-forced through HF transformers on the same bf16 weights in float32
    math: HF's top token or within ``nats`` of it, its logprob within ``nats`` of HF's
    (bf16 logits tie, so free-running greedy agreement is no test)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).float()
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out["token_ids"]])).logits[0]
        logp = torch.log_softmax(logits.double(), -1)
        for step, (token, top) in enumerate(zip(out["token_ids"], out["logprobs"])):
            row = logp[len(prompt) - 1 + step]
            assert row.max() - row[token] <= nats, (len(prompt), step)
            assert abs(top[str(token)] - row[token].item()) <= nats, (len(prompt), step)


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers fp32 greedy continuation token ids (the oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # like vLLM's ignore_eos
    model.generation_config.pad_token_id = 0
    return greedy_batch(model, prompts, max_new_tokens)


def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """``model.generate`` greedy continuations of all ``prompts`` in one left-padded
    batch (pad positions masked out): the default model's 8 test prompts x 32 tokens
    give the tokens of one prompt at a time, in 3.5 s instead of 16.5 s on 2 cores."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new_tokens)
    return [row[width:].tolist() for row in gen]


#: torch's threads in this process before any test changed them
DEFAULT_TORCH_THREADS = torch.get_num_threads()
#: the kernel suites (kernels vs float64 oracles): under xdist their tests other than
#: engine tests keep torch's default threads, so the kernels' work still splits across
#: threads there
KERNEL_SUITE_FILES = {"test_native_kernels.py", "test_attention_kernels.py",
                      "test_attention_int8.py", "test_attention_features.py",
                      "test_mla_kernels.py", "test_moe_kernels.py",
                      "test_cpu_native_bf16_linear.py", "test_cpu_native_int4_gemv.py",
                      "test_quant_w8a8.py"}


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Under `make test` (an xdist worker per core) a test computes on one thread, as
    the engines do (``_engine_pin``): with torch's default of a thread per core, the
    test's own OpenMP threads (HF oracles, quantizing checkpoints) spun on the core
    where the other worker's engine ran, slowing both (test_quant_w8a8 beside
    test_moe_quant, every test on one thread: 151 s -> 126 s, 24% less CPU time, AMD
    EPYC Zen 5). The kernel suites' other tests keep the default. Set before the
    test's fixtures run."""
    if _xdist_worker_core() is None:
        return
    kernels = item.path.name in KERNEL_SUITE_FILES and not any(
        item.get_closest_marker(m) for m in ("engine", "server", "tensor_parallel"))
    threads = DEFAULT_TORCH_THREADS if kernels else 1
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
