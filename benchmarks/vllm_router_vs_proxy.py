"""1P1D pull behind vllm-router vs behind kvpush's proxy, side by side.

    python benchmarks/vllm_router_vs_proxy.py [--client kvpush-bench|vllm-bench] [--vllm .vllm-peer]
                                              [--schedule alternate|together] [--seed 0]
                                              [--rates 1] [--num-prompts 24] [--repeats 2]
                                              [--input-len 512] [--output-len 32] [--result-dir DIR]

Two identical 1P1D pull deployments of the bench-preset model, one behind `kvpush proxy`, one behind
`vllm-router --vllm-pd-disaggregation` (`kvpush up --router vllm-router`), all up at once. Per repeat
and rate both front doors get the same prompts and arrival times (one seed per repeat and rate;
separate pools, so no prefix-cache help), in alternating order.

The client is `kvpush bench` (default; one run JSON each, then kvpush's comparison table) or, with
`--client vllm-bench`, vLLM's own `vllm bench serve` from the venv made by
scripts/setup-vllm-peer.sh (`make vllm-peer`) (`--vllm`; a benchmark dependency only): random dataset,
`--ignore-eos`, `--save-detailed` result JSONs, parsed here into one table per rate with the ratio
vllm-router / kvpush proxy of TTFT, TPOT and ITL (p50, p99) and a 95% bootstrap interval over the
pooled requests (paired by prompt when every request of both fronts succeeded), "cannot tell" when
the interval spans 1 or when the repeats' own ratios fall on both sides of 1 (the interval treats
requests as independent; on a shared machine the load drifts between runs). `--schedule together`
runs both fronts' clients at the same time, so that both see the same load (recommended on a
shared machine); the default alternates them. Each pair of runs prints the CPU seconds every process
used, which tells more work from less CPU share.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from kvpush.bench import cli as bench_cli
from kvpush.bench.compare import compare
from kvpush.bench.demo import ensure_model
from kvpush.bench.report import fmt_rate, format_table, load_run
from kvpush.bench.stats import Stat, fmt_ci, p50, p99, ratio_ci, verdict
from kvpush.bench.suite import SuiteConfig, bench_args, process_tree_cpu
from kvpush.bench.vllm_client import VllmBench, VllmRun, metric_sums, served_model
from kvpush.config import default_model_dir
from kvpush.launcher.launch import free_port
from kvpush.launcher.up import Deployment

FRONTS = ("kvpush-proxy", "vllm-router")
METRICS = ("ttft", "tpot", "itl")  # per-request milliseconds, see VllmRun
STATS: tuple[tuple[str, Stat], ...] = (("p50", p50), ("p99", p99))


def decode_kv_counters(dep: Deployment) -> str:
    """D's completed KV transfers and local fallbacks (kvpush's /metrics): shows the KV really moved."""
    wanted = ("kvpush_kv_transfers_completed_total", "kvpush_kv_local_fallbacks_total")
    found = {name: sum(metric_sums(inst.url, name, timeout_s=30) for inst in dep.of_role("decode")) for name in wanted}
    return ", ".join(f"{name.removeprefix('kvpush_kv_').removesuffix('_total')} {found.get(name, 0):g}"
                     for name in wanted)


def pooled(runs: list[VllmRun], metric: str) -> list[float]:
    return [v for run in runs for v in run.values[metric]]


def paired(a: list[VllmRun], b: list[VllmRun]) -> bool:
    """Whether the runs pair up prompt by prompt: same count, every request of both succeeded."""
    return len(a) == len(b) and all(all(x.ok) and all(y.ok) and len(x.ok) == len(y.ok) for x, y in zip(a, b, strict=False))


def repeat_ratios(router: list[VllmRun], proxy: list[VllmRun], metric: str, stat: Stat) -> list[float]:
    """``stat`` router / proxy of each repeat on its own (the runs that shared one seed)."""
    return [stat(np.asarray(a.values[metric])) / stat(np.asarray(b.values[metric]))
            for a, b in zip(router, proxy, strict=True) if a.values[metric] and b.values[metric]]


def ratio_cell(router: list[VllmRun], proxy: list[VllmRun], metric: str, stat: Stat) -> str:
    """vllm-router / kvpush proxy of ``stat`` over the pooled requests, with interval and verdict. The
    interval treats requests as independent, which the machine's load drift between runs is not: when
    the repeats' own ratios fall on both sides of 1 the verdict is "cannot tell" whatever it says."""
    a, b = pooled(router, metric), pooled(proxy, metric)
    if not a or not b:
        return "-"
    est, lo, hi = ratio_ci(a, b, stat=stat, paired=metric != "itl" and paired(router, proxy))
    per_repeat = repeat_ratios(router, proxy, metric, stat)
    said = verdict(lo, hi, "router", "proxy")
    if min(per_repeat) < 1.0 < max(per_repeat):
        said = "cannot tell (repeats disagree)"
    return f"{fmt_ci(est, lo, hi, 2)} {said}"


def vllm_table(results: dict[float, dict[str, list[VllmRun]]]) -> str:
    """Markdown: per rate, each front's pooled p50/p99 and the ratio row."""
    names = [f"{m.upper()} {s}" for m in METRICS for s, _ in STATS]
    lines = ["| rate | front door | runs | ok/failed | " + " | ".join(f"{n} (ms)" for n in names) + " |",
             "|" + "---|" * (len(names) + 4)]
    notes: list[str] = []
    for rate, by_front in results.items():
        for front in FRONTS:
            runs = by_front[front]
            ok, failed = sum(r.completed for r in runs), sum(r.failed for r in runs)
            cells = [f"{float(fn(np.asarray(pooled(runs, m)))):.1f}" if pooled(runs, m) else "-"
                     for m in METRICS for _, fn in STATS]
            lines.append(f"| {fmt_rate(rate)} | {front} | {len(runs)} | {ok}/{failed} | " + " | ".join(cells) + " |")
        cells = [ratio_cell(by_front["vllm-router"], by_front["kvpush-proxy"], m, fn) for m in METRICS for _, fn in STATS]
        lines.append(f"| {fmt_rate(rate)} | **router/proxy** | | | " + " | ".join(cells) + " |")
        for m in ("ttft", "tpot"):
            each = repeat_ratios(by_front["vllm-router"], by_front["kvpush-proxy"], m, p50)
            notes.append(f"rate {fmt_rate(rate)}: router/proxy {m.upper()} p50 per repeat: "
                         + ", ".join(f"{x:.2f}" for x in each))
    return "\n".join([*lines, "", *notes]) + "\n"


def cpu_seconds(deps: dict[str, Deployment]) -> dict[str, float]:
    """CPU seconds so far of each front door and instance (with its children), by name."""
    out = {}
    for front, dep in deps.items():
        for name, proc in (("front", dep.proxy), *zip(dep.roles, dep.instances, strict=True)):
            if proc.proc is not None:
                out[f"{front}/{name}"] = process_tree_cpu(proc.proc.pid)
    return out


def run_pair(benches: list[VllmBench], together: bool) -> list[VllmRun]:
    """Both fronts' runs, one after the other or at the same time."""
    try:
        if together:
            for b in benches:
                b.start()
            return [b.finish() for b in benches]
        return [b.start().finish() for b in benches]
    finally:
        for b in benches:
            b.stop()


def run_vllm_client(args: argparse.Namespace, cfg: SuiteConfig, deps: dict[str, Deployment], model: str) -> str:
    """Every repeat and rate through both fronts (alternating order, or together); returns the table."""
    served = {front: served_model(dep.url) for front, dep in deps.items()}
    results: dict[float, dict[str, list[VllmRun]]] = {r: {f: [] for f in FRONTS} for r in cfg.rates}
    for rep in range(cfg.repeats):
        for k, rate in enumerate(cfg.rates):
            seed = cfg.seed + 1000 * rep + k
            order = FRONTS if (rep + k) % 2 == 0 else FRONTS[::-1]
            benches = [VllmBench(args.vllm, deps[f].url, served[f], model, cfg, rate, seed,
                                 f"{f}-rate{fmt_rate(rate)}-rep{rep}") for f in order]
            before = cpu_seconds(deps)
            for front, run in zip(order, run_pair(benches, args.schedule == "together"), strict=True):
                results[rate][front].append(run)
            after = cpu_seconds(deps)
            print("CPU s used: " + ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in after), flush=True)
    for by_front in results.values():
        for runs in by_front.values():
            for run in runs:
                for err in sorted(set(run.errors))[:3]:
                    print(f"{run.path.name}: failed request: {err[:300]}")
    for front, dep in deps.items():
        print(f"{front}: decode instance: {decode_kv_counters(dep)}")
    return vllm_table(results)


def run_kvpush_client(cfg: SuiteConfig, deps: dict[str, Deployment], model: str) -> str:
    runs = []
    for rep in range(cfg.repeats):
        for k, rate in enumerate(cfg.rates):
            for front in (FRONTS if (rep + k) % 2 == 0 else FRONTS[::-1]):
                bargs = bench_args(cfg, deps[front].url, front, rate, cfg.seed + 1000 * rep + k)
                runs.append(bench_cli._one_run(bargs, 0, rate, model)[1])
    compare([str(p) for p in runs], os.path.join(cfg.result_dir, "compare"))
    return format_table([load_run(str(p)) for p in runs])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--client", choices=("kvpush-bench", "vllm-bench"), default="kvpush-bench")
    ap.add_argument("--vllm", default=".vllm-peer", help="the vLLM peer's directory (make vllm-peer; default: .vllm-peer)")
    ap.add_argument("--schedule", choices=("alternate", "together"), default="alternate",
                    help="vllm-bench: the two fronts' runs one after the other (order alternating per repeat) "
                         "or at the same time (both see the same machine load)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0])
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default="kvpush-results/vllm_router_vs_proxy")
    args = ap.parse_args()
    if args.client == "vllm-bench" and not os.access(os.path.join(args.vllm, "venv", "bin", "vllm"), os.X_OK):
        ap.error(f"--client vllm-bench needs {args.vllm}/venv/bin/vllm (scripts/setup-vllm-peer.sh (`make vllm-peer`))")
    if args.schedule == "together" and args.client != "vllm-bench":
        ap.error("--schedule together needs --client vllm-bench")
    model = args.model or ensure_model(default_model_dir(), "bench")
    cfg = SuiteConfig(model=model, rates=tuple(args.rates), num_prompts=args.num_prompts, repeats=args.repeats,
                      input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                      result_dir=os.path.abspath(args.result_dir))
    Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
    serve = ["--torch-threads", "1"]
    deps = {front: Deployment(model, 1, 1, "pull", free_port(), serve, [],
                              router="vllm-router" if front == "vllm-router" else "kvpush",
                              log_dir=os.path.join(cfg.result_dir, "logs", front)) for front in FRONTS}
    try:
        for dep in deps.values():
            dep.start()
        if args.client == "vllm-bench":
            table = run_vllm_client(args, cfg, deps, model)
        else:
            table = run_kvpush_client(cfg, deps, model)
    finally:
        for dep in deps.values():
            dep.stop()
    Path(cfg.result_dir, "table.md").write_text(table, encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()
