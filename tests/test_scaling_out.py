"""Scaling out through vLLM's own runtime on the simulated GCU, against HF
transformers' greedy tokens: `vllm serve --data-parallel-size 2` (two engines behind
one API server, one simulated device and one core each), and tensor parallel over
two "nodes" (`--nnodes 2 --node-rank 0/1`, two processes on this host over
loopback, gloo collectives), and tensor parallel through Ray
(`--distributed-executor-backend ray`, the ranks as Ray actors)."""

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import (ENGINE_ENV, TESTS, build_tiny_model, free_port, hf_greedy, run_engine,
                      spawn_server, start_server, stop_server)

pytestmark = pytest.mark.server

NEW_TOKENS = 8


def _served_per_engine(base: str) -> dict[str, float]:
    """Finished requests per DP engine, from the server's Prometheus metrics."""
    served: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        m = re.match(r'vllm:request_success_total\{engine="(\d+)".*\} ([\d.]+)$', line)
        if m:
            served[m.group(1)] = served.get(m.group(1), 0.0) + float(m.group(2))
    return served


@pytest.mark.engine
@pytest.mark.tensor_parallel
def test_data_parallel_2_serves_on_both_engines_with_hf_tokens(tmp_path):
    model = build_tiny_model(tmp_path / "tiny", head_std=0.4)
    prompts = [[3 + i, 40 + 7 * i, 5, 9, 11 + i] for i in range(16)]
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    log_path = tmp_path / "dp2.log"
    # The default 48 GiB device: each rank's capacity is then its share of the
    # host's RAM (a small explicit KV cache keeps the test light).
    from vllm_accel import envs

    host_share = psutil.virtual_memory().available / 2**30 * envs.ACCEL_SIM_HOST_MEMORY_FRACTION
    proc, base = start_server([str(model), "--device", "gcu", "--data-parallel-size", "2",
                               "--enforce-eager", "--max-model-len", "512", "--dtype", "float32",
                               "--skip-tokenizer-init",
                               "--kv-cache-memory-bytes", str(256 << 20)],
                              log_path, {"ACCEL_SIM_DEVICE_MEMORY_GB": "48"})
    try:
        def complete(ids):
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": str(model), "prompt": ids, "max_tokens": NEW_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(complete, prompts))
        served = _served_per_engine(base)
    finally:
        stop_server(proc)
    assert got == expected
    assert sorted(served) == ["0", "1"] and sum(served.values()) == 16, served
    assert min(served.values()) > 0, f"one engine served nothing: {served}"
    log = log_path.read_text()
    # vLLM's per-node rules across the DP engines: a core and a memory share each
    cores = set(re.findall(r"local_rank=0, core ids=\[(\d+)\]", log))
    assert cores == {"0", "1"}, cores
    capacities = [float(c) for c in re.findall(r"\(sim\) memory: capacity ([\d.]+) GiB", log)]
    assert len(capacities) == 2 and sum(capacities) <= 1.1 * host_share, (capacities, host_share)


@pytest.mark.engine
@pytest.mark.tensor_parallel
def test_two_node_tensor_parallel_matches_hf_and_a_dead_peer_ends_it(tmp_path):
    """TP=2 with one rank per "node" (node 1 headless), on the 4 q / 2 kv test model:
    HF's greedy tokens; then node 1 dies (its whole process group) and node 0's
    next request fails with the peer's connection named, and node 0 exits non-zero
    within 60 s."""
    model = build_tiny_model(tmp_path / "tiny", head_dim=64, hidden_size=256)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 7, 301, 8, 302, 9, 303]]
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    master = str(free_port())
    common = [str(model), "--device", "gcu", "--tensor-parallel-size", "2", "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", master, "--enforce-eager",
              "--max-model-len", "512", "--dtype", "float32", "--skip-tokenizer-init",
              "--kv-cache-memory-bytes", str(64 << 20)]
    # one core per "node", as two hosts would have their own
    node1 = spawn_server([*common, "--node-rank", "1", "--headless"], tmp_path / "node1.log",
                         {"VLLM_CPU_OMP_THREADS_BIND": "1"})
    try:
        node0, base = start_server([*common, "--node-rank", "0"], tmp_path / "node0.log",
                                   {"VLLM_CPU_OMP_THREADS_BIND": "0"})
        try:
            def complete(ids):
                return httpx.post(f"{base}/v1/completions", timeout=120, json={
                    "model": str(model), "prompt": ids, "max_tokens": NEW_TOKENS,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})

            got = [complete(ids).json()["choices"][0]["token_ids"] for ids in prompts]
            assert got == expected
            os.killpg(node1.pid, signal.SIGKILL)  # the whole node: server and worker
            node1.wait(timeout=30)
            start = time.monotonic()
            assert complete([11, 12, 13]).status_code >= 500
            node0.wait(timeout=60)
            elapsed = time.monotonic() - start
        finally:
            stop_server(node0)
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
    log = (tmp_path / "node0.log").read_text()
    assert node0.returncode not in (0, None) and elapsed < 60, (node0.returncode, elapsed)
    assert re.search(r"Connection (reset|closed) by peer", log), log[-3000:]


def test_multi_node_runs_wait_a_bounded_time_for_peers():
    """torch waits 30 minutes for a missing peer; a multi-node run gets
    MULTI_NODE_TIMEOUT_S unless --distributed-timeout-seconds was given."""
    from types import SimpleNamespace

    from vllm_accel.preflight import MULTI_NODE_TIMEOUT_S, bound_multi_node_wait

    single = SimpleNamespace(nnodes=1, distributed_timeout_seconds=None)
    multi = SimpleNamespace(nnodes=2, distributed_timeout_seconds=None)
    explicit = SimpleNamespace(nnodes=2, distributed_timeout_seconds=20)
    assert [bound_multi_node_wait(c) for c in (single, multi, explicit)] == [False, True, False]
    assert single.distributed_timeout_seconds is None
    assert multi.distributed_timeout_seconds == MULTI_NODE_TIMEOUT_S
    assert explicit.distributed_timeout_seconds == 20


@pytest.mark.engine
def test_node_0_without_its_peer_fails_within_the_timeout(tmp_path):
    """Node 0 of two, node 1 never started: the rendezvous gives up after
    --distributed-timeout-seconds (the store's own count, not the wall time, which
    the worker's start under a loaded machine dominates), saying how many ranks
    joined, and vllm serve exits non-zero."""
    model = build_tiny_model(tmp_path / "tiny", head_dim=64, hidden_size=256)
    start = time.monotonic()
    node0 = spawn_server([str(model), "--device", "gcu", "--tensor-parallel-size", "2",
                          "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                          "--master-port", str(free_port()), "--distributed-timeout-seconds",
                          "5", "--enforce-eager", "--skip-tokenizer-init",
                          "--kv-cache-memory-bytes", str(64 << 20), "--port", str(free_port())],
                         tmp_path / "node0.log")
    try:
        node0.wait(timeout=300)
    finally:
        stop_server(node0)
    log = (tmp_path / "node0.log").read_text()
    assert node0.returncode not in (0, None), log[-3000:]
    waited = re.search(r"Timed out after (\d+) seconds waiting for clients\. 1/2 clients joined",
                       log)
    assert waited and int(waited[1]) <= 10, log[-3000:]
    print(f"node 0 gave up after {time.monotonic() - start:.0f} s")


def _ray_tp2_spec(model: Path, prompts: list[list[int]], **llm) -> dict:
    return {"llm": {"model": str(model), "dtype": "float32", "skip_tokenizer_init": True,
                    "max_model_len": 512, "seed": 0, "tensor_parallel_size": 2,
                    "distributed_executor_backend": "ray",
                    "kv_cache_memory_bytes": 64 << 20, **llm},
            "prompts": prompts,
            "sampling": {"temperature": 0.0, "max_tokens": NEW_TOKENS, "ignore_eos": True,
                         "detokenize": False}}


def test_ray_backend_maps_to_our_executor_and_refuses_the_older_one(monkeypatch):
    """`ray` becomes vLLM's Ray executor V2 with our devices declared; vLLM's older
    Ray executor (not wired here) is refused before any engine starts."""
    from vllm_accel.preflight import StartupError, ray_executor_cls
    from vllm_accel.worker.ray_executor import AccelRayExecutor

    assert ray_executor_cls() is AccelRayExecutor and AccelRayExecutor.uses_ray
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "0")
    with pytest.raises(StartupError, match="unset it"):
        ray_executor_cls()


@pytest.mark.engine
@pytest.mark.tensor_parallel
def test_ray_tensor_parallel_matches_hf_with_one_core_per_rank(tmp_path):
    """TP=2 through Ray (eager: the compiled TP=2 engine is test_moe_engine's expert
    parallel one), no Ray cluster running: the executor starts a local Ray instance
    with the engine's 2 simulated devices declared; HF's greedy tokens; each rank's
    model thread is bound to its own core with one torch thread (Ray starts actors
    unbound)."""
    model = build_tiny_model(tmp_path / "tiny", head_dim=64, hidden_size=256)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], [300, 7, 301, 8, 302, 9, 303]]
    expected = hf_greedy(model, prompts, NEW_TOKENS)
    result, log = run_engine({**_ray_tp2_spec(model, prompts, enforce_eager=True),
                              "worker_threads": True,
                              "engine_until_exit": True},
                             tmp_path, env={"RAY_ADDRESS": ""})
    assert "starting a local Ray instance with this engine's 2 devices" in log, log[-3000:]
    assert [o["token_ids"] for o in result["outputs"]] == expected
    # at exit the executor stops its actors before Ray's own atexit shutdown: else
    # vLLM's ray.kill finds Ray gone, starts a second instance and may segfault
    assert log.count("Started a local Ray instance") == 1, log[-3000:]
    assert "Failed to kill actor" not in log, log[-3000:]
    workers = result["worker_threads"]
    assert sorted(w["cores"] for w in workers) == [[0], [1]], workers
    assert [w["threads"] for w in workers] == [1, 1], workers


@pytest.mark.engine
@pytest.mark.tensor_parallel
def test_ray_cluster_with_too_few_device_slots_fails_fast_naming_the_fix(tmp_path):
    """A running Ray cluster that declares 1 device slot, TP=2: the engine stops at
    once with the count and the `ray start --num-gpus` fix (vLLM alone would wait 30
    minutes for the placement group)."""
    model = build_tiny_model(tmp_path / "tiny", head_dim=64, hidden_size=256)
    ray = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray, "start", "--head", "--num-cpus", "2", "--num-gpus", "1",
                    "--include-dashboard=false", "--disable-usage-stats"],
                   check=True, capture_output=True, timeout=120)
    try:
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps(_ray_tp2_spec(model, [[5, 6, 7]],
                                                               enforce_eager=True)))
        start = time.monotonic()
        proc = subprocess.run([sys.executable, str(TESTS / "engine_run.py"), str(spec)],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, **ENGINE_ENV})
        elapsed = time.monotonic() - start
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120)
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "ENGINE_RESULT" not in log, log[-3000:]
    assert "declares 1 device slots" in log and "--num-gpus 2" in log, log[-3000:]
    assert elapsed < 120, elapsed
