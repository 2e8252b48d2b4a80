"""Push vs pull vs colocated across request rates, with repeats (docs/results/push-vs-pull.md: its tables and plots).

    python benchmarks/push_vs_pull.py [--rates 0.5 1 2 4] [--num-prompts 50] [--repeats 4]
                                      [--input-len 512] [--output-len 32] [--result-dir DIR] [--no-pin]
    python benchmarks/push_vs_pull.py --modes pull push --capacity-fractions 0.5 0.8 --output-len 128

Starts a colocated server and a 1P1D deployment per KV mode on the bench-preset model, runs every
mode at every rate (modes alternating on the same prompts within a repeat), and writes run JSONs,
comparison.md and PNG plots under the result directory. By default P and D are pinned to separate
halves of the cores (`kvpush up --pin`) and each cell gets 50 x 4 = 200 requests, enough for a
stable p99; push/pull ratios come with 95% bootstrap intervals and a verdict. With
--capacity-fractions the rates are fractions of the 1P1D capacity, measured first (every request
sent at once to each disaggregated deployment; the slower one's completed req/s).
"""

from __future__ import annotations

import argparse

from kvpush.bench.demo import ensure_model
from kvpush.bench.suite import SuiteConfig, run_suite
from kvpush.config import default_model_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0])
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=4, help="repeats x num-prompts = requests per cell (200: stable p99)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--capacity-fractions", type=float, nargs="+", default=[],
                    help="instead of --rates: fractions of the 1P1D capacity measured first (e.g. 0.5 0.8)")
    ap.add_argument("--modes", nargs="+", default=["colocated", "pull", "push"])
    ap.add_argument("--result-dir", default="kvpush-results/push_vs_pull")
    ap.add_argument("--no-pin", action="store_true", help="let P and D share cores (default: pinned, kvpush up --pin)")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the probe that restarts a deployment started on a slow process (kvpush/bench/calibrate.py)")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    run_suite(SuiteConfig(model=model, modes=tuple(args.modes), rates=tuple(args.rates),
                          num_prompts=args.num_prompts, repeats=args.repeats, input_len=args.input_len,
                          output_len=args.output_len, result_dir=args.result_dir,
                          serve_args=["--torch-threads", "1"], pin=not args.no_pin,
                          capacity_fractions=tuple(args.capacity_fractions), calibrate=not args.no_calibrate))


if __name__ == "__main__":
    main()
