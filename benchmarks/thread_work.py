"""What each request costs the transfer threads: loop rounds (wake-ups) and CPU of P's and D's transfer
thread per request, push against pull, under the same load.

    python benchmarks/thread_work.py [--rate 1.0] [--batch 30] [--repeats 4] [--input-len 512] [--output-len 32]

Two 1P1D deployments (push and pull) up at once, each `kvpush up --pin` (P on the first half of the
cores, D on the second). Each repeat sends `--batch` Poisson-spaced streamed requests to one mode, then
the same prompts to the other (the order alternating between repeats), and reads every instance's
`kvpush_kv_transfer_thread_rounds_total` and `..._cpu_seconds_total` from /metrics before and after.
Prints per mode and instance the rounds and CPU milliseconds per request (median over repeats with a
95% bootstrap interval). An idle thread wakes about 5 times a second (its 200 ms doorbell wait), which
is counted too: it is part of what the thread costs while the batch runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random

import aiohttp

from kvpush.bench.datasets import random_samples
from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import facts
from kvpush.bench.stale import metric
from kvpush.bench.stats import bootstrap_ci, fmt_ci
from kvpush.bench.suite import AVOID_IDS
from kvpush.config import default_model_dir
from kvpush.launcher.launch import free_port
from kvpush.launcher.up import Deployment

MODES = ("push", "pull")


def counters(url: str) -> dict[str, float]:
    """The instance's transfer-thread counters (read between batches, never under load)."""
    return {k: metric(url, f"kvpush_kv_transfer_thread_{k}_total") for k in ("rounds", "cpu_seconds")}


async def stream(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    async with s.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _ in r.content:
            pass


async def batch(s: aiohttp.ClientSession, dep: Deployment, prompts: list[list[int]], rate: float,
                max_tokens: int, seed: int) -> dict[str, dict[str, float]]:
    """Per instance role: rounds and CPU ms per request over one batch."""
    roles = {role: dep.of_role(role)[0].url for role in ("prefill", "decode")}
    before = {role: counters(url) for role, url in roles.items()}
    rng, tasks = random.Random(seed), []
    for p in prompts:
        tasks.append(asyncio.create_task(stream(s, dep.url, p, max_tokens)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    out = {}
    for role, url in roles.items():
        after = counters(url)
        out[role] = {"rounds": (after["rounds"] - before[role]["rounds"]) / len(prompts),
                     "cpu_ms": (after["cpu_seconds"] - before[role]["cpu_seconds"]) * 1e3 / len(prompts)}
    return out


async def run(deps: dict[str, Deployment], args: argparse.Namespace) -> dict[str, list[dict]]:
    avoid = list(AVOID_IDS)
    out: dict[str, list[dict]] = {m: [] for m in MODES}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        for mode in MODES:  # warm-up: handshakes, first sizes on each endpoint
            await stream(s, deps[mode].url, list(range(10, 10 + args.input_len)), 2)
        for rep in range(args.repeats):
            prompts = [list(x.prompt) for x in random_samples(args.batch, args.input_len, 1, vocab_size=8192,
                                                              avoid_ids=avoid, seed=args.seed + rep)]
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                r = await batch(s, deps[mode], prompts, args.rate, args.output_len, args.seed + rep)
                out[mode].append(r)
                print(f"repeat {rep} {mode}: " + ", ".join(
                    f"{role} {v['rounds']:.1f} rounds / {v['cpu_ms']:.2f} ms CPU per request" for role, v in r.items()),
                      flush=True)
    return out


def summary(out: dict[str, list[dict]]) -> str:
    lines = ["| mode | instance | transfer-thread rounds per request | transfer-thread CPU ms per request |",
             "|---|---|---|---|"]
    for mode, rows in out.items():
        for role in ("prefill", "decode"):
            cells = [fmt_ci(*bootstrap_ci([r[role][key] for r in rows]), digits=2) for key in ("rounds", "cpu_ms")]
            lines.append(f"| {mode} | {role} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s within a batch")
    ap.add_argument("--batch", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="kvpush-results/thread_work.json")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    log_dir = os.path.join(os.path.dirname(args.out) or ".", "logs-thread-work")
    os.makedirs(log_dir, exist_ok=True)
    deps = {m: Deployment(model, 1, 1, m, free_port(), ["--torch-threads", "1"], [], log_dir=os.path.join(log_dir, m),
                          pin=True) for m in MODES}
    try:
        for dep in deps.values():
            dep.start()
        out = asyncio.run(run(deps, args))
    finally:
        for dep in deps.values():
            dep.stop()
    print(summary(out))
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "machine": facts(), "batches": out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
