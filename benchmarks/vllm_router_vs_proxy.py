"""1P1D pull behind vllm-router vs behind kvpush's proxy, side by side.

    python benchmarks/vllm_router_vs_proxy.py [--rates 1] [--num-prompts 24] [--repeats 2]
                                              [--input-len 512] [--output-len 32] [--result-dir DIR]

Two identical 1P1D pull deployments of the bench-preset model, one behind `kvpush proxy`, one behind
`vllm-router --vllm-pd-disaggregation` (`kvpush up --router vllm-router`), all up at once. Per repeat
and rate both front doors get the same prompts (separate pools, so no prefix-cache help), in
alternating order; `kvpush bench` writes one run JSON each, then the comparison table.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from kvpush.bench import cli as bench_cli
from kvpush.bench.report import compare, format_table, load_run
from kvpush.bench.suite import SuiteConfig, bench_args
from kvpush.config import default_model_dir
from kvpush.demo import ensure_model
from kvpush.launch import free_port
from kvpush.server.up import Deployment

FRONTS = ("kvpush-proxy", "vllm-router")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--result-dir", default="kvpush-results/vllm_router_vs_proxy")
    args = ap.parse_args()
    model = args.model or ensure_model(default_model_dir(), "bench")
    cfg = SuiteConfig(model=model, rates=tuple(args.rates), num_prompts=args.num_prompts, repeats=args.repeats,
                      input_len=args.input_len, output_len=args.output_len, result_dir=args.result_dir)
    Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
    serve = ["--torch-threads", "1"]
    deps = {front: Deployment(model, 1, 1, "pull", free_port(), serve, [],
                              router="vllm-router" if front == "vllm-router" else "kvpush",
                              log_dir=os.path.join(cfg.result_dir, "logs", front)) for front in FRONTS}
    runs = []
    try:
        for dep in deps.values():
            dep.start()
        for rep in range(cfg.repeats):
            for k, rate in enumerate(cfg.rates):
                order = FRONTS if (rep + k) % 2 == 0 else FRONTS[::-1]
                for front in order:
                    bargs = bench_args(cfg, deps[front].url, front, rate, cfg.seed + 1000 * rep + k)
                    runs.append(bench_cli._one_run(bargs, 0, rate, model)[1])
    finally:
        for dep in deps.values():
            dep.stop()
    compare([str(p) for p in runs], os.path.join(cfg.result_dir, "compare"))
    print(format_table([load_run(str(p)) for p in runs]))


if __name__ == "__main__":
    main()
