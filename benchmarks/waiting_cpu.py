"""What does a decode instance pay while requests wait for remote KV? CPU of D's transfer thread,
and the TPOT of a stream D decodes meanwhile, with 0 and with N requests waiting.

    python benchmarks/waiting_cpu.py [--waiting 32] [--repeats 3] [--mode push|pull] [--no-pin]

One 1P1D deployment (`kvpush up --pin`: P and D on separate cores). Each repeat alternates two
phases on the same probe: a 128-token greedy stream alone ("quiet"), and the same stream while N
long prompts (max_tokens 1) queue on P, so that D holds N records waiting for P's prefills
("waiting"). D's transfer-thread CPU is read from its /metrics
(`kvpush_kv_transfer_thread_cpu_seconds`) over each phase and reported as % of one core. Prints
medians with a 95% bootstrap interval and the TPOT ratio with a verdict; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time

import aiohttp

from kvpush.bench.datasets import random_samples
from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import facts
from kvpush.bench.stats import bootstrap_ci, fmt_ci, verdict
from kvpush.bench.suite import AVOID_IDS
from kvpush.config import default_model_dir
from kvpush.launcher.launch import free_port
from kvpush.launcher.up import Deployment

_CPU = re.compile(r"^kvpush_kv_transfer_thread_cpu_seconds_total (\S+)$", re.M)
_WAITING = re.compile(r'^kvpush_kv_transfers\{state="registered"\} (\S+)$', re.M)


async def scrape(s: aiohttp.ClientSession, url: str) -> tuple[float, int]:
    """(transfer-thread CPU seconds, records waiting in REGISTERED) of one instance."""
    async with s.get(url + "/metrics") as r:
        text = await r.text()
    cpu, waiting = _CPU.search(text), _WAITING.search(text)
    return float(cpu.group(1)) if cpu else 0.0, int(float(waiting.group(1))) if waiting else 0


async def probe(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int,
                started: asyncio.Event | None = None) -> float:
    """TPOT (ms) of one greedy stream; sets `started` at its first token."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    async with s.post(url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for raw in r.content:
            if raw.startswith(b"data: {"):
                stamps.append(time.perf_counter())
                if started is not None:
                    started.set()
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1000


async def one_shot(s: aiohttp.ClientSession, url: str, prompt: list[int]) -> None:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}
    async with s.post(url + "/v1/completions", json=body) as r:
        await r.read()


async def phase(s: aiohttp.ClientSession, proxy: str, d_url: str, probe_prompt: list[int], long_prompts: list[list[int]],
                max_tokens: int) -> dict:
    started = asyncio.Event()
    task = asyncio.create_task(probe(s, proxy, probe_prompt, max_tokens, started))
    await started.wait()  # the probe decodes on D from here on
    floods = [asyncio.create_task(one_shot(s, proxy, p)) for p in long_prompts]
    peak, deadline = 0, time.monotonic() + 30
    while long_prompts and peak < len(long_prompts) and time.monotonic() < deadline:  # all registered on D
        peak = max(peak, (await scrape(s, d_url))[1])
        await asyncio.sleep(0.02)
    cpu0, t0 = (await scrape(s, d_url))[0], time.perf_counter()
    tpot = await task
    cpu1, t1 = (await scrape(s, d_url))[0], time.perf_counter()
    waiting_end = (await scrape(s, d_url))[1]
    await asyncio.gather(*floods)
    return {"tpot_ms": tpot, "thread_cpu_pct": 100 * (cpu1 - cpu0) / (t1 - t0), "window_s": t1 - t0,
            "waiting_peak": peak, "waiting_at_end": waiting_end}


async def run(proxy: str, d_url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    avoid = list(AVOID_IDS)
    n = 1 + args.repeats * (2 + args.waiting)
    prompts = [list(x.prompt) for x in random_samples(n, args.input_len, 1, vocab_size=8192, avoid_ids=avoid,
                                                      seed=args.seed)]
    short = [p[:32] for p in prompts[: 2 * args.repeats + 1]]
    longs = prompts[2 * args.repeats + 1:]
    out: dict[str, list[dict]] = {"quiet": [], "waiting": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=1800)) as s:
        await probe(s, proxy, short[-1], 8)  # warm-up
        for i in range(args.repeats):
            order = ("quiet", "waiting") if i % 2 == 0 else ("waiting", "quiet")
            for name in order:
                flood = longs[i * args.waiting:(i + 1) * args.waiting] if name == "waiting" else []
                r = await phase(s, proxy, d_url, short[2 * i + (name == "waiting")], flood, args.output_len)
                out[name].append(r)
                print(f"repeat {i} {name:8s} TPOT {r['tpot_ms']:.2f} ms  D transfer thread "
                      f"{r['thread_cpu_pct']:.2f}% of a core  waiting peak {r['waiting_peak']}", flush=True)
    return out


def summary(out: dict[str, list[dict]]) -> str:
    lines = []
    for name, rows in out.items():
        for key, unit in (("tpot_ms", "ms"), ("thread_cpu_pct", "% core")):
            lines.append(f"{name:8s} {key:15s} {fmt_ci(*bootstrap_ci([r[key] for r in rows]), digits=2)} {unit}")
    q, w = [r["tpot_ms"] for r in out["quiet"]], [r["tpot_ms"] for r in out["waiting"]]
    ratios = [b / a for a, b in zip(q, w, strict=True)]
    med, lo, hi = bootstrap_ci(ratios)
    lines.append(f"TPOT waiting/quiet {fmt_ci(med, lo, hi)}: {verdict(lo, hi, 'waiting', 'quiet')}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--mode", default="push", choices=("push", "pull"))
    ap.add_argument("--waiting", type=int, default=32, help="requests waiting for P while the probe decodes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=1024, help="tokens of each waiting request's prompt")
    ap.add_argument("--output-len", type=int, default=128, help="tokens of the probe stream")
    ap.add_argument("--kv-cache-mb", type=int, default=1024, help="per instance: room for every waiting prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", action="store_true", help="do not put P and D on separate cores")
    ap.add_argument("--out", default="kvpush-results/waiting_cpu.json")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    log_dir = os.path.join(os.path.dirname(args.out) or ".", "logs-waiting")
    os.makedirs(log_dir, exist_ok=True)
    dep = Deployment(model, 1, 1, args.mode, free_port(), ["--torch-threads", "1", "--kv-cache-memory-mb", str(args.kv_cache_mb)], [],
                     log_dir=log_dir,
                     pin=not args.no_pin)
    dep.start()
    try:
        out = asyncio.run(run(dep.url, dep.of_role("decode")[0].url, args))
    finally:
        dep.stop()
    print(summary(out))
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "machine": facts(), "phases": out}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
