"""`vllm serve MODEL --device gcu` (the real console script) and OpenAI clients.

One server per backend: the simulated GCU, and the virtual GCU through the card
path (with every torch.cuda entry point raising for vLLM and vllm_accel); every
test talks to each over loopback. Bad requests must get a 4xx while the server
keeps serving.
"""

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from conftest import (DEFAULT_MODEL_DEVICE_ENV, TESTS, VIRTUAL_GCU_ENV, VLLM, start_server,
                      stop_server)

pytestmark = pytest.mark.server

BACKEND_ENV = {
    "sim": DEFAULT_MODEL_DEVICE_ENV,
    "virtual": VIRTUAL_GCU_ENV,
}


@pytest.fixture(scope="module", params=list(BACKEND_ENV))
def server(request, default_model, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    # float32 like `make serve`: bf16 ties exactly on this chat's first token
    proc, base = start_server(
        [str(default_model), "--device", "gcu", "--enforce-eager", "--max-model-len", "2048",
         "--dtype", "float32"], log_path, BACKEND_ENV[request.param])
    yield {"base": base, "proc": proc, "log": log_path, "model": str(default_model),
           "backend": request.param}
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [server["model"]]
    assert httpx.get(server["base"] + "/health").status_code == 200
    log = server["log"].read_text()
    if server["backend"] == "sim":
        assert "vllm_accel: device gcu via simulated GCU" in log
    else:
        assert "vllm_accel: device gcu via virtual GCU" in log
        assert ("Rank 0 on gcu:0: worker vllm_accel.worker.card_worker.AccelCardWorker, model "
                "runner vllm_accel.worker.card_model_runner.AccelCardModelRunner") in log
        assert "Model weights on gcu:0 (" in log and "KV cache on gcu:0 (30 layers)" in log
        assert "torch.cuda entry points raise for vLLM and vllm_accel" in log

        _assert_no_cuda_call(server)


def _assert_no_cuda_call(server) -> None:
    assert "FORBIDDEN_CUDA_CALL" not in server["log"].read_text()


def test_chat_answers_paris_and_stream_matches(server, client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    reply = client.chat.completions.create(model=server["model"], messages=messages,
                                           temperature=0, max_tokens=32)
    text = reply.choices[0].message.content
    assert "Paris" in text
    stream = client.chat.completions.create(model=server["model"], messages=messages,
                                            temperature=0, max_tokens=32, stream=True)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(chunks) > 2
    assert "".join(chunks) == text


def test_completion_logprobs_n_and_stop(server, client):
    model = server["model"]
    out = client.completions.create(model=model, prompt="The capital of France is",
                                    max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == out.usage.completion_tokens == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    for token, top in zip(lp.tokens, lp.top_logprobs):
        assert top[token] == pytest.approx(max(top.values()))

    two = client.completions.create(model=model, prompt="My favourite fruit is", n=2,
                                    max_tokens=12, temperature=1.0, seed=1)
    assert len(two.choices) == 2 and {c.index for c in two.choices} == {0, 1}

    counted = client.completions.create(model=model, prompt="1, 2, 3, 4,", max_tokens=30,
                                        temperature=0, stop=[" 7"])
    choice = counted.choices[0]
    assert choice.finish_reason == "stop"
    assert " 7" not in choice.text and "6" in choice.text


def test_bad_requests_get_4xx_and_server_keeps_serving(server, client):
    model = server["model"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi " * 3000, max_tokens=4)
    assert server["proc"].poll() is None
    ok = client.completions.create(model=model, prompt="Hello", max_tokens=4, temperature=0)
    assert ok.usage.completion_tokens == 4


def test_metrics_count_our_tokens(server, client):
    client.completions.create(model=server["model"], prompt="Count:", max_tokens=3)
    metrics = httpx.get(server["base"] + "/metrics").text
    generated = [line for line in metrics.splitlines()
                 if line.startswith("vllm:generation_tokens_total")]
    assert generated and float(generated[0].split()[-1]) >= 3


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([VLLM, *args], capture_output=True, text=True, timeout=300)


# The CLI clients against the simulator's server only: what they exercise is client
# side, and the virtual card's server answers chat and completions in the tests above.
@pytest.mark.parametrize("server", ["sim"], indirect=True)
def test_vllm_chat_and_complete_cli(server):
    url = server["base"] + "/v1"
    chat = _cli("chat", "--url", url, "--quick", "What is the capital of France?")
    assert chat.returncode == 0, chat.stderr[-3000:]
    # `vllm chat` samples with the server's defaults, so only check a reply came.
    assert f"Using model: {server['model']}" in chat.stdout
    assert len(chat.stdout.strip().splitlines()) >= 2
    complete = _cli("complete", "--url", url, "--max-tokens", "8", "--quick", "The capital of France is")
    assert complete.returncode == 0, complete.stderr[-3000:]
    assert complete.stdout.strip()


@pytest.mark.parametrize("server", ["sim"], indirect=True)
def test_vllm_bench_serve(server):
    bench = _cli("bench", "serve", "--base-url", server["base"], "--model", server["model"],
                 "--dataset-name", "random", "--num-prompts", "4", "--random-input-len", "16",
                 "--random-output-len", "8", "--seed", "0")
    assert bench.returncode == 0, (bench.stdout + bench.stderr)[-3000:]
    assert "Successful requests:                     4" in bench.stdout


def test_load_with_disconnects_leaves_nothing_behind(server, tmp_path):
    """benchmarks/load.py, small: 8 concurrent streams x 2 rounds, every 4th
    dropped mid-stream; every other request completes and, once idle, KV usage
    and the running/waiting gauges are back to 0."""
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(TESTS.parent / "benchmarks" / "load.py"),
                           "--base-url", server["base"], "--clients", "8", "--rounds", "2",
                           "--max-tokens", "24", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["completed"] for r in report["rounds"]] == [6, 6]
    assert [r["disconnected"] for r in report["rounds"]] == [2, 2]
    assert report["gauges_after_idle"]["vllm:kv_cache_usage_perc"] == 0
    assert server["proc"].poll() is None
    if server["backend"] == "virtual":  # the last test: the card path served all of the above
        _assert_no_cuda_call(server)


def test_engine_killed_mid_request_fails_fast(server):
    """The module's last test (it ends this server): EngineCore killed while a
    request streams. The stream fails, /health stops answering 200, and the
    server exits non-zero within 60 s -- no hang."""
    import threading

    import psutil

    core = next(p for p in psutil.Process(server["proc"].pid).children(recursive=True)
                if "EngineCore" in " ".join(p.cmdline()))
    streamed, outcome = threading.Event(), {}

    def stream():
        body = {"model": server["model"], "prompt": "Tell me a long story.", "stream": True,
                "max_tokens": 2000, "ignore_eos": True}
        try:
            with httpx.stream("POST", server["base"] + "/v1/completions", json=body,
                              timeout=120) as response:
                outcome["status"] = response.status_code
                for line in response.iter_lines():
                    streamed.set()
                    compact = line.replace(" ", "")
                    if '"finish_reason":"length"' in compact:
                        outcome["completed"] = True
                    if compact.startswith('data:{"error"'):
                        outcome["error"] = line
        except httpx.HTTPError as e:
            outcome["error"] = repr(e)

    reader = threading.Thread(target=stream)
    reader.start()
    assert streamed.wait(120)
    core.kill()
    killed_at = time.time()
    reader.join(120)
    assert not reader.is_alive()
    # the stream did not complete, and the failure reached the client
    assert not outcome.get("completed") and "error" in outcome, outcome
    try:
        health = httpx.get(server["base"] + "/health", timeout=10).status_code
    except httpx.HTTPError:
        health = None
    assert health != 200
    server["proc"].wait(timeout=max(1, 60 - (time.time() - killed_at)))
    assert server["proc"].returncode != 0
