"""Goodput under overload: an instance sheds (429 + Retry-After) instead of queueing without bound.

    python benchmarks/overload.py [--deployments colocated push] [--loads 0.5 1 1.5 2 3]
        [--duration-s 20] [--capacity RPS] [--ttft-slo-ms 2000] [--tpot-slo-ms 250]
        [--input-len 256] [--output-len 16] [--serve-args "--max-waiting 4 ..."] [--no-pin]
        [--result-dir kvpush-results/overload]

Starts a colocated server and a 1P1D push deployment (P and D pinned to separate halves of the cores
unless --no-pin) on the bench-preset model, all up at once. Per deployment it first measures capacity,
its saturated throughput (completed requests per second while --probe-rps is offered, far more than
it serves; the rest is shed), unless --capacity gives it, then offers Poisson load at each fraction of it for
--duration-s, the deployments alternating at every level on the same prompts. Per level: goodput
(requests meeting both the TTFT and the TPOT SLO, per second of offered load), completed (also per
second), shed (429/503) and how fast each shed answer came, other failures, TTFT and TPOT of the
completed, and the RSS of every instance after the level. Targets (issue 15): at 200% and 300% every
request completes or is shed within 100 ms, and goodput is at least 90% of goodput at 100%. Writes
overload.json and overload.png to --result-dir.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

from kvpush.bench.datasets import random_samples
from kvpush.bench.demo import ensure_model
from kvpush.bench.loadgen import LoadConfig, fetch_model, run_load
from kvpush.bench.machine import facts
from kvpush.bench.metrics import meets_slo, summarize, tpot_s
from kvpush.bench.soak import process_figures
from kvpush.bench.suite import AVOID_IDS, Fleet, SuiteConfig
from kvpush.config import default_model_dir

SERVE_ARGS = "--torch-threads 1 --max-num-seqs 8 --max-num-batched-tokens 256 --max-waiting 4 --max-waiting-tokens 1024"
SHED = (429, 503)
SHED_WITHIN_S = 0.1


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--deployments", nargs="+", default=["colocated", "push"], choices=["colocated", "push", "pull"])
    ap.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0, 3.0],
                    help="offered load as fractions of capacity (1.0 must be among them)")
    ap.add_argument("--duration-s", type=float, default=20.0, help="offered load per level")
    ap.add_argument("--capacity", type=float, default=None, help="requests/s at 100%% (default: measured)")
    ap.add_argument("--probe-rps", type=float, default=20.0, help="offered load of the capacity probe (far above it)")
    ap.add_argument("--probe-s", type=float, default=10.0, help="duration of the capacity probe")
    ap.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    ap.add_argument("--tpot-slo-ms", type=float, default=250.0)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--serve-args", default=SERVE_ARGS, help="flags for every `kvpush serve`")
    ap.add_argument("--no-pin", action="store_true", help="let P and D share cores")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="kvpush-results/overload")
    args = ap.parse_args()
    if 1.0 not in args.loads:
        ap.error("--loads must include 1.0 (goodput at 100% is the reference)")
    return args


def samples(args: argparse.Namespace, n: int, seed: int):
    return random_samples(n, args.input_len, args.output_len, vocab_size=args.vocab_size, avoid_ids=AVOID_IDS,
                          seed=seed)


def load_config(url: str, model: str, rate: float, concurrency: int | None = None) -> LoadConfig:
    return LoadConfig(base_url=url, model=model, request_rate=rate, max_concurrency=concurrency, ignore_eos=True,
                      timeout_s=300.0, progress=False)


def measure_capacity(args: argparse.Namespace, url: str, model: str) -> float:
    """The saturated throughput: completed requests per second while offered far more (the rest is shed)."""
    cfg = LoadConfig(**{**load_config(url, model, args.probe_rps).__dict__, "num_warmups": 2})
    n = round(args.probe_rps * args.probe_s)
    result = asyncio.run(run_load(samples(args, n, args.seed + 999), cfg))
    return sum(r.success for r in result.records) / result.duration_s


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its descendants, MiB."""
    return process_figures(pid)["rss_mib"]


def level(args: argparse.Namespace, url: str, model: str, load: float, capacity: float, seed: int) -> dict:
    rate = load * capacity
    n = max(2, round(rate * args.duration_s))
    result = asyncio.run(run_load(samples(args, n, seed), load_config(url, model, rate)))
    recs = result.records
    ok = [r for r in recs if r.success]
    shed = [r for r in recs if r.status in SHED]
    failed = [r for r in recs if not r.success and r.status not in SHED]
    slo = {"ttft": args.ttft_slo_ms, "tpot": args.tpot_slo_ms}
    shed_ms = [1000 * r.status_s for r in shed if r.status_s is not None]
    return {
        "load": load, "offered_rps": rate, "requests": n, "completed": len(ok), "shed": len(shed),
        "failed": len(failed), "goodput_rps": sum(meets_slo(r, slo) for r in ok) / (n / rate),
        "completed_rps": len(ok) / (n / rate),
        "shed_answer_ms": summarize(shed_ms), "shed_answer_max_ms": max(shed_ms, default=None),
        "shed_later_than_100ms": sum(ms > 1000 * SHED_WITHIN_S for ms in shed_ms),
        "ttft_ms": summarize([1000 * r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": summarize([1000 * t for r in ok if (t := tpot_s(r)) is not None]),
        "errors": sorted({r.error[:160] for r in failed + shed})[:5],
        "slow_sheds": [f"{1000 * r.status_s:.0f} ms: {r.error[:160]}" for r in shed
                       if r.status_s is not None and r.status_s > SHED_WITHIN_S][:10],
    }


def verdict(levels: list[dict]) -> dict:
    """The issue's targets for one deployment."""
    at_100 = next(lv["goodput_rps"] for lv in levels if lv["load"] == 1.0)
    high = [lv for lv in levels if lv["load"] >= 2.0]
    answered = all(lv["failed"] == 0 and lv["shed_later_than_100ms"] == 0 for lv in high)
    kept = all(lv["goodput_rps"] >= 0.9 * at_100 for lv in high)
    return {"goodput_at_100_rps": at_100, "every_request_completed_or_shed_within_100ms": answered,
            "goodput_at_least_90pct_of_100": kept}


def plot(doc: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, dep in doc["deployments"].items():
        loads = [100 * lv["load"] for lv in dep["levels"]]
        ax.plot(loads, [lv["goodput_rps"] for lv in dep["levels"]], marker="o", label=f"{name} goodput")
        ax.plot(loads, [lv["offered_rps"] for lv in dep["levels"]], linestyle=":", color=ax.lines[-1].get_color(),
                label=f"{name} offered")
        ax2.plot(loads, [100 * lv["shed"] / lv["requests"] for lv in dep["levels"]], marker="o", label=name)
    ax.set(xlabel="offered load (% of capacity)", ylabel="requests/s",
           title=f"goodput (TTFT <= {doc['slo']['ttft_ms']:g} ms, TPOT <= {doc['slo']['tpot_ms']:g} ms)")
    ax2.set(xlabel="offered load (% of capacity)", ylabel="% of requests", title="shed (429/503)")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main() -> None:
    args = parse_args()
    model_path = args.model or ensure_model(default_model_dir(), "bench")
    args.vocab_size = json.loads((Path(model_path) / "config.json").read_text())["vocab_size"]
    out_dir = Path(args.result_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    cfg = SuiteConfig(model=model_path, modes=tuple(args.deployments), serve_args=shlex.split(args.serve_args),
                      pin=not args.no_pin)
    fleet = Fleet(cfg, str(out_dir / "logs")).start()
    doc: dict = {"machine": facts(), "command": "python benchmarks/overload.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                 "serve_args": args.serve_args, "slo": {"ttft_ms": args.ttft_slo_ms, "tpot_ms": args.tpot_slo_ms},
                 "input_len": args.input_len, "output_len": args.output_len, "duration_s": args.duration_s,
                 "deployments": {}}
    try:
        models = {name: asyncio.run(fetch_model(url)) for name, url in fleet.urls.items()}
        for name, url in fleet.urls.items():
            capacity = args.capacity or measure_capacity(args, url, models[name])
            doc["deployments"][name] = {"capacity_rps": capacity, "levels": []}
            print(f"{name}: capacity {capacity:.2f} req/s", flush=True)
        for k, load in enumerate(args.loads):
            names = list(fleet.urls)
            for name in names[k % len(names):] + names[: k % len(names)]:  # alternate who goes first
                dep = doc["deployments"][name]
                lv = level(args, fleet.urls[name], models[name], load, dep["capacity_rps"], args.seed + k)
                lv["rss_mb"] = {inst: round(tree_rss_mb(p.proc.pid), 1) for inst, p in fleet.instances().items()
                                if inst.startswith(name) and p.proc is not None}
                dep["levels"].append(lv)
                print(f"{name} {100 * load:.0f}%: offered {lv['offered_rps']:.2f}/s, goodput {lv['goodput_rps']:.2f}/s, "
                      f"completed {lv['completed']}, shed {lv['shed']} (p99 answer "
                      f"{lv['shed_answer_ms']['p99'] or 0:.1f} ms), failed {lv['failed']}, "
                      f"TTFT p50 {lv['ttft_ms']['median'] or 0:.0f} ms", flush=True)
    finally:
        fleet.stop()
    for name, dep in doc["deployments"].items():
        dep["verdict"] = verdict(dep["levels"])
        print(f"{name}: {dep['verdict']}")
    (out_dir / "overload.json").write_text(json.dumps(doc, indent=1))
    print(f"wrote {out_dir / 'overload.json'} and {plot(doc, out_dir / 'overload.png')}")


if __name__ == "__main__":
    main()
