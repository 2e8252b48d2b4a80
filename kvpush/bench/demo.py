"""`kvpush demo`, the README's main job: push vs pull vs colocated on the bench-preset model.

Creates the model if missing, starts a colocated server and a 1P1D deployment per KV mode, runs a
short sweep of request rates (modes alternating on the same prompts), prints the comparison and
the handover breakdown, and writes JSON and PNGs to ./kvpush-results/. About 3-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os

from kvpush.bench.suite import SuiteConfig, run_suite
from kvpush.config import default_model_dir
from kvpush.flags import DEMO_RATES
from kvpush.launcher.placement import available_cpus


def ensure_model(model_dir: str, preset: str) -> str:
    path = os.path.join(model_dir, preset)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from kvpush.models.make_model import make_model

        print(f"kvpush demo: creating the {preset} model in {path}", flush=True)
        make_model(path, preset=preset, seed=0)
    return path


def run_demo(args: argparse.Namespace) -> int:
    model = ensure_model(args.model_dir or default_model_dir(), "bench")
    cfg = SuiteConfig(model=model, rates=tuple(args.rates or DEMO_RATES), num_prompts=args.num_prompts,
                      input_len=512, output_len=32, result_dir=args.result_dir,
                      serve_args=["--torch-threads", "1"], pin=not args.no_pin and len(available_cpus()) >= 2)
    runs, table, plots = run_suite(cfg)
    print(f"\nkvpush demo: {len(runs)} runs in {cfg.result_dir}; table {table}; plots "
          + ", ".join(str(p) for p in plots))
    return 0
