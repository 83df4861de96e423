#!/usr/bin/env python
"""Load test of a running OpenAI-compatible server (loopback): concurrent
streaming clients, a share of them disconnecting mid-stream, for several rounds;
then, once the server is idle, the KV-cache usage and running/waiting request
gauges from ``/metrics`` -- both must be back to 0 (nothing leaks).

Prints one line per round (throughput, TTFT, errors) and a summary; ``--json``
saves everything. Exit status 1 when a request that was not disconnected on
purpose failed or came back short, or when the gauges stay above 0.

Example (against `make serve`, default port):
  python benchmarks/load.py --base-url http://127.0.0.1:8000 --clients 32 --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

GAUGES = ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting")


async def _one(client: httpx.AsyncClient, url: str, model: str, index: int, tokens: int,
               disconnect_after: int | None) -> dict:
    """One streaming completion; with ``disconnect_after``, drop the connection
    after that many chunks."""
    # (the usage chunk counts the tokens: a chunk can carry several when the server
    # streams faster than this client reads)
    body = {"model": model, "prompt": f"Request {index}: tell a long story about the sea.",
            "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, chunks, made = None, 0, None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"ok": False, "error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    made = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0].get("text") is not None:
                    chunks += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                if disconnect_after is not None and chunks >= disconnect_after:
                    return {"ok": True, "disconnected": True, "ttft": ttft, "tokens": chunks}
    except httpx.HTTPError as e:
        return {"ok": False, "error": repr(e)}
    complete = made == tokens
    return {"ok": complete, "disconnected": False, "ttft": ttft, "tokens": made or 0,
            "error": None if complete else f"{made} of {tokens} tokens ({chunks} chunks)"}


def _gauges(url: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in GAUGES:
            values[name] = values.get(name, 0.0) + float(line.split()[-1])
    return values


async def _round(url: str, model: str, clients: int, tokens: int, disconnect_every: int,
                 offset: int) -> dict:
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(
            _one(client, url, model, offset + i, tokens,
                 tokens // 4 if disconnect_every and i % disconnect_every == disconnect_every - 1
                 else None)
            for i in range(clients)))
        elapsed = time.perf_counter() - start
    finished = [r for r in results if r["ok"] and not r.get("disconnected")]
    ttfts = [r["ttft"] for r in results if r.get("ttft") is not None]
    return {"elapsed_s": elapsed, "requests": clients, "completed": len(finished),
            "disconnected": sum(bool(r.get("disconnected")) for r in results),
            "errors": [r["error"] for r in results if not r["ok"]],
            "out_tok_s": sum(r["tokens"] for r in results if r["ok"]) / elapsed,
            "ttft_median_s": statistics.median(ttfts) if ttfts else None,
            "ttft_max_s": max(ttfts) if ttfts else None}


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--clients", type=int, default=32, help="concurrent streams per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--disconnect-every", type=int, default=4,
                   help="every Nth client drops its stream after a quarter of its "
                   "tokens (0: none)")
    p.add_argument("--idle-timeout", type=float, default=60.0,
                   help="seconds to wait for the gauges to reach 0 after the last round")
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    url = args.base_url.rstrip("/")
    model = _model(url)
    rounds = []
    for r in range(args.rounds):
        result = asyncio.run(_round(url, model, args.clients, args.max_tokens,
                                    args.disconnect_every, r * args.clients))
        rounds.append(result)
        ttft = result["ttft_median_s"]
        print(f"round {r}: {result['completed']}/{result['requests'] - result['disconnected']} "
              f"completed, {result['disconnected']} disconnected, {len(result['errors'])} "
              f"errors, {result['out_tok_s']:.1f} out tok/s, TTFT median "
              f"{'-' if ttft is None else f'{ttft:.2f}'} s, {result['elapsed_s']:.1f} s",
              flush=True)
    deadline = time.time() + args.idle_timeout
    while True:
        gauges = _gauges(url)
        if all(v == 0 for v in gauges.values()) or time.time() > deadline:
            break
        time.sleep(0.5)
    failed = [e for r in rounds for e in r["errors"]]
    leaked = {k: v for k, v in gauges.items() if v != 0}
    print(f"after idle: {', '.join(f'{k}={v:g}' for k, v in sorted(gauges.items()))}")
    print(f"summary: {sum(r['completed'] for r in rounds)} completed, "
          f"{sum(r['disconnected'] for r in rounds)} disconnected on purpose, "
          f"{len(failed)} failed{': ' + '; '.join(failed[:5]) if failed else ''}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rounds": rounds, "gauges_after_idle": gauges}, f, indent=1)
    return 1 if failed or leaked or len(gauges) < len(GAUGES) else 0


if __name__ == "__main__":
    sys.exit(main())
