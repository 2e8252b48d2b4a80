"""One request at a time: TTFT of colocated, push 1P1D and pull 1P1D on the same prompts, with
the critical path of each mode (where every millisecond of TTFT goes).

    python benchmarks/single_ttft.py [--num-prompts 40] [--input-len 512] [--output-len 4] [--pin]

All three deployments are up together; prompt i goes to each mode in turn (order rotated by i),
each request after the previous one ended. Prints TTFT p50 per mode with a 95% bootstrap interval,
the p50 of per-prompt differences against colocated, the paired push/pull ratio with a verdict,
and per mode the critical path: segments that add up to TTFT (their "share" column is the mean
per request) and the work that overlapped it. Writes everything as JSON to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os

import msgspec

from kvpush.bench.datasets import random_samples
from kvpush.bench.demo import ensure_model
from kvpush.bench.interleave import paired_report, run_interleaved
from kvpush.bench.machine import facts
from kvpush.bench.suite import AVOID_IDS, MODES, Fleet, SuiteConfig
from kvpush.bench.trace import analyze, format_critical_path
from kvpush.config import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=8192, help="prompt ids are drawn below this (the bench preset's)")
    ap.add_argument("--pin", action="store_true", help="P and D on separate cores (kvpush up --pin)")
    ap.add_argument("--out", default="kvpush-results/single_ttft.json")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    avoid = list(AVOID_IDS)
    samples = random_samples(args.num_prompts + 2, args.input_len, args.output_len, vocab_size=args.vocab_size,
                             avoid_ids=avoid, seed=args.seed)
    cfg = SuiteConfig(model=model, modes=tuple(args.modes), serve_args=["--torch-threads", "1"], pin=args.pin)
    log_dir = os.path.join(os.path.dirname(args.out) or ".", "logs-single")
    os.makedirs(log_dir, exist_ok=True)
    fleet = Fleet(cfg, log_dir).start()
    try:
        results = asyncio.run(run_interleaved(fleet.urls, samples[2:], model, warmups=samples[:2]))
    finally:
        fleet.stop()
    print(paired_report(results))
    paths = {}
    for mode, recs in results.items():
        cp = analyze(recs)
        paths[mode] = cp
        if cp is not None:
            print(format_critical_path(cp, mode) + "\n")
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "machine": facts(), "critical_path": msgspec.to_builtins(paths),
                   "requests": msgspec.to_builtins(results)}, f)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
