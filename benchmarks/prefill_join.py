"""Prefills packed into one step vs one at a time (`--prefill-join-tokens`), on the engine alone.

    python benchmarks/prefill_join.py [--loads 0.5 0.8 1.0] [--requests 60] [--repeats 6] [--model DIR]

A prefill instance's question without the servers around it: prompts of 128, 512 and 1024 tokens
(a third each, random tokens, fresh per repeat) arrive at Poisson times into an LLMEngine that
prefills them (one output token each, as P does); a request arriving during a step joins the queue
after that step, as in the engine core. Two engines on the same checkpoint, one packing every
waiting prompt into a step up to --max-num-batched-tokens (`-1`, vLLM's packing) and one letting
prefills join a step one at a time (`16`, the CPU default); per repeat both run the same arrival
sequence, the order alternating. Load is a fraction of the engine's prefill throughput, measured
first with one burst of the same prompt mix. Prints per load each variant's TTFT (arrival -> first
token) p50 / p90 / p99, the ratio join/pack with a 95% bootstrap interval (paired by request,
repeats resampled: clustered_ratio_ci) and a verdict, per prompt length the p50, and each variant's
busy time (the sum of its steps). One torch thread, the bench preset by default (made if missing).
"""

from __future__ import annotations

import argparse
import random
import time

import numpy as np
import torch

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.bench.stats import clustered_ratio_ci, fmt_ci, p50, p99, verdict
from kvpush.config import EngineConfig, ModelConfig, SchedulerConfig, default_model_dir
from kvpush.engine.engine import LLMEngine
from kvpush.engine.sampling_params import SamplingParams

LENGTHS = (128, 512, 1024)
VARIANTS = {"pack": -1, "join": 16}
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def p90(x: np.ndarray) -> float:
    return float(np.percentile(x, 90))


def prompts(n: int, rng: random.Random, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(LENGTHS[i % len(LENGTHS)])] for i in range(n)]


def run(engine: LLMEngine, batch: list[list[int]], arrivals: list[float], tag: str) -> tuple[list[float], float]:
    """Feed `batch` at `arrivals` (seconds from now); returns each request's TTFT and the time spent in steps."""
    ttft: dict[str, float] = {}
    t0, i, busy = time.perf_counter(), 0, 0.0
    while len(ttft) < len(batch):
        now = time.perf_counter() - t0
        while i < len(batch) and arrivals[i] <= now:
            engine.add_request(f"{tag}-{i}", batch[i], ONE_TOKEN)
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[i] - now))  # idle until the next arrival
            continue
        start = time.perf_counter()
        for out in engine.step():
            if out.new_token_ids and out.request_id not in ttft:
                ttft[out.request_id] = time.perf_counter() - t0 - arrivals[int(out.request_id.rsplit("-", 1)[1])]
        busy += time.perf_counter() - start
    return [ttft[f"{tag}-{k}"] for k in range(len(batch))], busy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--loads", nargs="+", type=float, default=[0.5, 0.8, 1.0])
    ap.add_argument("--requests", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = args.model or ensure_model(default_model_dir(), "bench")
    engines = {name: LLMEngine(EngineConfig(ModelConfig(model), scheduler=SchedulerConfig(prefill_join_tokens=j)))
               for name, j in VARIANTS.items()}
    vocab = next(iter(engines.values())).arch.vocab_size
    rng = random.Random(args.seed)
    burst = prompts(len(LENGTHS) * 6, rng, vocab)
    _, busy = run(engines["pack"], burst, [0.0] * len(burst), "burst")
    rate = len(burst) / busy
    print(machine_line())
    print(f"prefill throughput (one burst of {len(burst)}, packed): {rate:.2f} req/s")
    for load in args.loads:
        runs: dict[str, list[list[float]]] = {name: [] for name in engines}
        lens: list[int] = []
        busy_s = {name: 0.0 for name in engines}
        for rep in range(args.repeats):
            batch = prompts(args.requests, rng, vocab)
            gaps = [rng.expovariate(load * rate) for _ in batch]
            arrivals = list(np.cumsum(gaps) - gaps[0])
            lens += [len(p) for p in batch]
            for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                t, b = run(engines[name], batch, arrivals, f"{load}-{rep}-{name}")
                runs[name].append(t)
                busy_s[name] += b
        report(load, rate, runs, np.array(lens), busy_s)


def report(load: float, rate: float, runs: dict[str, list[list[float]]], lens: np.ndarray,
           busy_s: dict[str, float]) -> None:
    print(f"\nload {load:.0%} ({load * rate:.2f} req/s), {len(runs['pack'])} repeats x {len(runs['pack'][0])} requests")
    pooled = {name: np.concatenate(v) * 1e3 for name, v in runs.items()}
    for name, x in pooled.items():
        by_len = ", ".join(f"{n}: {p50(x[lens == n]):.0f}" for n in LENGTHS)
        print(f"  {name:5s} TTFT p50 {p50(x):6.1f}  p90 {p90(x):6.1f}  p99 {p99(x):6.1f} ms  (p50 by prompt length {by_len}); "
              f"busy {busy_s[name]:.1f} s")
    groups = list(zip(runs["join"], runs["pack"], strict=True))
    for label, stat in (("p50", p50), ("p90", p90), ("p99", p99)):
        est, lo, hi = clustered_ratio_ci(groups, stat)
        print(f"  join/pack TTFT {label} {fmt_ci(est, lo, hi)} {verdict(lo, hi, 'join', 'pack')}")


if __name__ == "__main__":
    main()
