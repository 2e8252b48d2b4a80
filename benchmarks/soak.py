"""The soak (#15): 30 minutes of a mixed workload through 1P1D push and pull (deployments up together),
1% of clients disconnecting mid-stream, every resource sampled over time.

    python benchmarks/soak.py [--minutes 30] [--modes push pull] [--load 0.7] [--rate R]

--load is the share of the measured 1P1D capacity (the soak's own mix of prompts, every request at once)
offered in all, split evenly over the deployments; --rate sets the per-deployment rate directly.
Writes soak.json and soak.png under --result-dir and prints the summary: RSS growth from the first
sixth of the run to its end, fds and threads, TTFT p50 of the last sixth against the second, the end
state (every block free, every ledger empty). The arrival schedule repeats every --period-s (default: a
sixth of the run) with fresh prompt contents, so the last period's requests pair one to one with the
second period's: the paired ratio of their TTFT p50s, with its interval, is the drift figure.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpush.bench.demo import ensure_model
from kvpush.bench.soak import SoakConfig, plot, run_soak
from kvpush.bench.suite import Fleet, SuiteConfig, measure_capacity
from kvpush.config import default_model_dir


def capacity(model: str, input_len: int, output_len: int, result_dir: str, seed: int) -> float:
    """1P1D capacity on the soak's own mix (short, long and multi-turn prompts), every request at once."""
    cfg = SuiteConfig(model=model, modes=("push", "pull"), input_len=input_len, output_len=output_len,
                      dataset="mixed", vocab_size=SoakConfig.vocab_size, serve_args=["--torch-threads", "1"],
                      pin=True, result_dir=result_dir, seed=seed)
    fleet = Fleet(cfg, str(Path(result_dir) / "logs-capacity")).start()
    try:
        return measure_capacity(cfg, fleet)
    finally:
        fleet.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--modes", nargs="+", default=["push", "pull"])
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--rate", type=float, default=None, help="requests/s per deployment (skips the capacity probe)")
    ap.add_argument("--period-s", type=float, default=None,
                    help="the arrival schedule repeats with this period (default: a sixth of the run)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0, help="arrivals, disconnects and prompts")
    ap.add_argument("--result-dir", default="kvpush-results/soak")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    rate = args.rate
    if rate is None:
        cap = capacity(model, args.input_len, SoakConfig.output_len, args.result_dir, args.seed)
        rate = round(args.load * cap / len(args.modes), 3)
        print(f"capacity {cap:.2f} req/s -> {rate} req/s per deployment", flush=True)
    path = run_soak(SoakConfig(model=model, modes=tuple(args.modes), duration_s=args.minutes * 60, rate=rate,
                               input_len=args.input_len, seed=args.seed, period_s=args.period_s,
                               result_dir=args.result_dir))
    png = plot(path)
    print(json.dumps(json.loads(path.read_text())["summary"], indent=1))
    print(f"series: {path}; plot: {png}")


if __name__ == "__main__":
    main()
