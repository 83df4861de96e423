"""Scaling out through vLLM's own runtime: `vllm serve --data-parallel-size 2` on
the simulated GCU (two engines behind one API server, one simulated device and one
core each), against HF transformers' greedy tokens."""

import concurrent.futures
import os
import re
import subprocess
import time

import httpx
import psutil
import pytest

from conftest import ENGINE_ENV, hf_greedy
from test_server import VLLM, _free_port

pytestmark = pytest.mark.server

NEW_TOKENS = 8


def _start(args: list[str], log_path, env: dict) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([VLLM, "serve", *args, "--host", "127.0.0.1", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **ENGINE_ENV,
                                 "VLLM_ENABLE_V1_MULTIPROCESSING": "1", **env})
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError(f"server not healthy in time:\n{log_path.read_text()[-5000:]}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _served_per_engine(base: str) -> dict[str, float]:
    """Finished requests per DP engine, from the server's Prometheus metrics."""
    served: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        m = re.match(r'vllm:request_success_total\{engine="(\d+)".*\} ([\d.]+)$', line)
        if m:
            served[m.group(1)] = served.get(m.group(1), 0.0) + float(m.group(2))
    return served


@pytest.mark.engine
def test_data_parallel_2_serves_on_both_engines_with_hf_tokens(default_model, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model)
    prompts = [tok(f"Question {i}: the capital of France is")["input_ids"] for i in range(16)]
    expected = hf_greedy(default_model, prompts, NEW_TOKENS)
    log_path = tmp_path / "dp2.log"
    # The default 48 GiB device: each rank's capacity is then its share of the
    # host's RAM (a small explicit KV cache keeps the test light).
    host_share = (psutil.virtual_memory().available / 2**30
                  * float(os.environ.get("ACCEL_SIM_HOST_MEMORY_FRACTION", "0.6")))
    proc, base = _start([str(default_model), "--device", "gcu", "--data-parallel-size", "2",
                         "--enforce-eager", "--max-model-len", "512", "--dtype", "float32",
                         "--kv-cache-memory-bytes", str(256 << 20)],
                        log_path, {"ACCEL_SIM_DEVICE_MEMORY_GB": "48"})
    try:
        def complete(ids):
            r = httpx.post(f"{base}/v1/completions", timeout=300, json={
                "model": str(default_model), "prompt": ids, "max_tokens": NEW_TOKENS,
                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
            r.raise_for_status()
            return r.json()["choices"][0]["token_ids"]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(complete, prompts))
        served = _served_per_engine(base)
    finally:
        _stop(proc)
    assert got == expected
    assert sorted(served) == ["0", "1"] and sum(served.values()) == 16, served
    assert min(served.values()) > 0, f"one engine served nothing: {served}"
    log = log_path.read_text()
    # vLLM's per-node rules across the DP engines: a core and a memory share each
    cores = set(re.findall(r"local_rank=0, core ids=\[(\d+)\]", log))
    assert cores == {"0", "1"}, cores
    capacities = [float(c) for c in re.findall(r"\(sim\) memory: capacity ([\d.]+) GiB", log)]
    assert len(capacities) == 2 and sum(capacities) <= 1.1 * host_share, (capacities, host_share)
