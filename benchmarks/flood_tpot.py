"""Does HTTP work slow the engine? TPOT of one streaming request, quiet vs under an HTTP flood.

    python benchmarks/flood_tpot.py [--model DIR] [--repeats 3] [--flood-concurrency 32]

The engine runs in its own process, so health checks, model listings, rejected requests (bad
JSON, prompts over the context limit, which are tokenized first) and client disconnects handled by
the API process should not show up in the decode loop. One colocated server on the bench preset;
a 128-token streaming greedy request is timed alone and under the flood, alternating, several
times; medians and the ratio are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import aiohttp

from kvpush.config import default_model_dir
from kvpush.demo import ensure_model
from kvpush.launch import ServerProcess, free_port


async def stream_tpot(session: aiohttp.ClientSession, url: str, max_tokens: int) -> float:
    body = {"prompt": "The engine loop is measured here", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


async def flood(session: aiohttp.ClientSession, url: str, stop: asyncio.Event, counter: list[int]) -> None:
    long_prompt = "word " * 20000
    kinds = [("GET", "/health", None), ("GET", "/v1/models", None), ("POST", "/v1/completions", b"{broken"),
             ("POST", "/v1/completions", json.dumps({"prompt": long_prompt}).encode()),
             ("POST", "/v1/completions", json.dumps({"prompt": "x", "temperature": -3}).encode())]
    i = 0
    while not stop.is_set():
        method, path, data = kinds[i % len(kinds)]
        i += 1
        async with session.request(method, url + path, data=data) as r:
            await r.read()
        counter[0] += 1


async def measure(url: str, repeats: int, concurrency: int, max_tokens: int) -> None:
    quiet: list[float] = []
    loud: list[float] = []
    rates: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        await stream_tpot(s, url, 8)  # warm-up
        for _ in range(repeats):
            quiet.append(await stream_tpot(s, url, max_tokens))
            stop, counter = asyncio.Event(), [0]
            tasks = [asyncio.create_task(flood(s, url, stop, counter)) for _ in range(concurrency)]
            t0 = time.perf_counter()
            loud.append(await stream_tpot(s, url, max_tokens))
            rates.append(counter[0] / (time.perf_counter() - t0))
            stop.set()
            await asyncio.gather(*tasks)
    q, f = statistics.median(quiet), statistics.median(loud)
    print(f"\nTPOT alone: median {q:.2f} ms {[round(x, 2) for x in quiet]}")
    print(f"TPOT under a flood of {statistics.median(rates):.0f} HTTP requests/s "
          f"({concurrency} clients): median {f:.2f} ms {[round(x, 2) for x in loud]}")
    print(f"ratio flood / alone: {f / q:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--flood-concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    port = free_port()
    with ServerProcess(["serve", model, "--port", str(port), "--torch-threads", "1"]) as server:
        server.wait_healthy(300)
        asyncio.run(measure(server.url, args.repeats, args.flood_concurrency, args.max_tokens))


if __name__ == "__main__":
    main()
