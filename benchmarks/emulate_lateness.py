"""What the host costs an emulated step (docs/emulation.md, "What the host costs"): per profile, the
lateness (actual end - modelled end) of decode steps and of prefill steps, offline, one core.

    python benchmarks/emulate_lateness.py [--model models/tiny] [--profiles qwen3-32b-h200-tp8 qwen3-8b-h100]
        [--prompts 16] [--input-len 1024] [--output-len 64] [--time-scale 1.0] [--out FILE.json]

Each profile runs the same prompts through `LLM(MODEL, emulate=PROFILE)`; every step is classed as a
prefill step (some request computes more than one token) or a decode step, with its modelled duration
and its lateness. A run is valid for #37's rule when lateness p99 is at most 5% of the median step.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.config import default_model_dir
from kvpush.emulate.lateness import quantile
from kvpush.engine.llm import LLM
from kvpush.engine.sampling_params import SamplingParams


def run_profile(model: str, profile: str, prompts: list[list[int]], output_len: int, time_scale: float) -> dict:
    llm = LLM(model, emulate=profile, time_scale=time_scale, block_size=16, kv_cache_memory_mb=1024)
    runner = llm.engine.runner
    steps: list[tuple[bool, float, float]] = []  # (prefill, modelled s, lateness s)
    execute = runner.execute

    def timed(scheduled):
        before = runner.lateness.steps
        out = execute(scheduled)
        if runner.lateness.steps > before:
            steps.append((any(n > 1 for _, n in scheduled), runner.lateness.recent_steps[-1],
                          runner.lateness.recent[-1]))
        return out

    runner.execute = timed
    t0 = time.monotonic()
    llm.generate(prompts, SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True))
    wall = time.monotonic() - t0
    out = {"profile": profile, "wall_s": wall, "steps": len(steps)}
    for kind, is_prefill in (("decode", False), ("prefill", True)):
        mod = [m for p, m, _ in steps if p is is_prefill]
        late = [x for p, _, x in steps if p is is_prefill]
        out[kind] = {"steps": len(mod), "modelled_p50_ms": 1e3 * quantile(mod, 0.5),
                     "lateness_p50_ms": 1e3 * quantile(late, 0.5), "lateness_p99_ms": 1e3 * quantile(late, 0.99),
                     "lateness_max_ms": 1e3 * max(late, default=0.0)}
    every = [m for _, m, _ in steps]
    late_all = [x for _, _, x in steps]
    out["valid"] = quantile(late_all, 0.99) <= 0.05 * quantile(every, 0.5)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="tokenizer and vocabulary (default: the tiny preset, made if missing)")
    ap.add_argument("--profiles", nargs="+", default=["qwen3-32b-h200-tp8", "qwen3-8b-h100"],
                    help="shipped profile names or files (default: qwen3-32b-h200-tp8 qwen3-8b-h100)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per run (default: 16)")
    ap.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default: 1024)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    ap.add_argument("--time-scale", type=float, default=1.0, help="--time-scale of the runs (default: 1.0)")
    ap.add_argument("--seed", type=int, default=0, help="prompt seed (default: 0)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here (default: none)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = args.model or str(ensure_model(default_model_dir(), "tiny"))
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(10, 1000, size=args.input_len).tolist() for _ in range(args.prompts)]
    results = {"machine": machine_line(), "args": vars(args), "runs": []}
    print(f"# {results['machine']}", flush=True)
    print("| profile | decode steps: median modelled / lateness p50 / p99 (ms) | prefill steps: median modelled / "
          "lateness p50 / p99 / max (ms) | valid (p99 <= 5% of median step) |")
    print("|---|---|---|---|")
    for profile in args.profiles:
        r = run_profile(model, profile, prompts, args.output_len, args.time_scale)
        results["runs"].append(r)
        d, p = r["decode"], r["prefill"]
        print(f"| `{profile}` | {d['modelled_p50_ms']:.2f} / {d['lateness_p50_ms']:.2f} / {d['lateness_p99_ms']:.2f} | "
              f"{p['modelled_p50_ms']:.1f} / {p['lateness_p50_ms']:.1f} / {p['lateness_p99_ms']:.1f} / "
              f"{p['lateness_max_ms']:.1f} | {'yes' if r['valid'] else 'no'} |", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
