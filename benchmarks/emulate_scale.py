"""An emulated xPyD deployment under load: proxy throughput, transfers per second, the ledger and auto (issue 37).

    python benchmarks/emulate_scale.py [--prefill 8] [--decode 8] [--kv-mode auto] [--time-scale 40]
        [--profile qwen3-32b-h200-tp8] [--rates 2 4 8] [--num-prompts 120] [--input-len 512] [--output-len 64]

Starts the deployment `kvpush up MODEL --prefill P --decode D --kv-mode MODE --emulated-link off` starts
(kvpush.launcher.up.Deployment: every instance and the proxy on this machine's cores), each instance with
`--emulate PROFILE --time-scale S --kv-cache-memory-mb M` and the KV deadline and lease stretched by S
(bench/emulation.py's emulated_serve_args),
then per rate runs `kvpush bench` through the proxy and reads every /metrics before and after (the
proxy's, and each instance it lists):

    proxy        requests, routes chosen (auto), shed, rerouted
    instances    transfers completed (counted on D), ledger records by state (live ones and tombstones,
                 kept 300 s to catch late messages), failures by reason,
                 ignored notifications, quarantined blocks, local fallbacks, blocks in use once idle
                 (with the prefix cache's blocks: see below), and each run's validity (lateness p99
                 within 5% of the median step, bench/emulation.py)

Rates are wall-clock requests per second; per emulated second they are S times more. After each run
it waits until no instance has a request running or waiting, so that "records held" and "blocks in
use" are what an idle deployment keeps: a ledger record or a block still held then is a leak, except
blocks the prefix cache keeps (kvpush_prefix_cache_* say how many are cached; a reset frees them:
POST /reset_prefix_cache, done here before the count). Writes results.json and table.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvpush.bench.demo import ensure_model
from kvpush.bench.emulation import emulated_serve_args, instance_urls
from kvpush.bench.machine import machine_line
from kvpush.bench.suite import reset_prefix_caches
from kvpush.config import default_model_dir
from kvpush.launcher.launch import free_port
from kvpush.launcher.up import Deployment

TERMINAL = ("done", "failed", "expired")  # ledger tombstones: kept tombstone_s (300 s) to catch late messages
PROXY = {"requests": "kvpush_proxy_requests_total", "shed": "kvpush_proxy_shed_total",
         "rerouted": "kvpush_proxy_rerouted_total"}
INSTANCE = {"completed": "kvpush_kv_transfers_completed_total", "failures": "kvpush_kv_transfer_failures_total",
            "ignored": "kvpush_kv_ignored_notifications_total", "fallbacks": "kvpush_kv_local_fallbacks_total",
            "records": "kvpush_kv_transfers", "quarantined": "kvpush_kv_quarantined_blocks",
            "blocks_used": "kvpush_kv_blocks_used", "running": "kvpush_num_requests_running",
            "waiting": "kvpush_num_requests_waiting", "waiting_for_kv": "kvpush_num_requests_waiting_for_kv"}


def scrape(url: str) -> list[Any]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return list(text_string_to_metric_families(r.read().decode()))


def total(families: list[Any], name: str, **labels: str) -> float:
    """The sum of a metric's samples (those with these labels)."""
    return sum(s.value for f in families for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def by_label(families: list[Any], name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for f in families:
        for s in f.samples:
            if s.name == name and label in s.labels:
                out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def snapshot(proxy: str) -> dict[str, Any]:
    """Every counter and gauge of interest, the proxy's and summed over its instances (transfers completed:
    over the decode instances, as P and D each count every transfer)."""
    fams = scrape(proxy)
    urls = instance_urls(fams)
    decodes = instance_urls(fams, role="decode")
    inst = [scrape(u) for u in urls]
    out: dict[str, Any] = {k: total(fams, n) for k, n in PROXY.items()}
    out["routes"] = by_label(fams, "kvpush_proxy_kv_mode_chosen_total", "route")
    for key, name in INSTANCE.items():
        out[key] = sum(total(f, name) for u, f in zip(urls, inst, strict=True) if key != "completed" or u in decodes)
    out["failure_reasons"] = {}
    for f in inst:
        for reason, n in by_label(f, "kvpush_kv_transfer_failures_total", "reason").items():
            out["failure_reasons"][reason] = out["failure_reasons"].get(reason, 0.0) + n
    out["records_by_state"] = {}
    for f in inst:
        for state, n in by_label(f, "kvpush_kv_transfers", "state").items():
            out["records_by_state"][state] = out["records_by_state"].get(state, 0.0) + n
    out["instances"] = len(urls)
    return out


def wait_idle(proxy: str, timeout_s: float) -> dict[str, Any]:
    """The snapshot once no instance runs or queues a request (or at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        snap = snapshot(proxy)
        if snap["running"] + snap["waiting"] + snap["waiting_for_kv"] == 0 or time.monotonic() > deadline:
            return snap
        time.sleep(0.5)


def bench(proxy: str, args: argparse.Namespace, rate: float, seed: int, out: Path) -> dict:
    label = f"scale-rate{rate:g}"
    subprocess.run([sys.executable, "-m", "kvpush.cli", "bench", "--base-url", proxy, "--num-prompts",
                    str(args.num_prompts), "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                    "--ignore-eos", "--num-warmups", "8", "--seed", str(seed), "--result-dir", str(out),
                    "--mode-label", label, "--no-progress", "--request-rate", str(rate)],
                   check=True, timeout=args.timeout_s)
    [path] = sorted(out.glob(f"{label}-*.json"))
    return json.loads(path.read_text())


def delta(after: dict[str, Any], before: dict[str, Any], key: str) -> float:
    return float(after[key]) - float(before[key])


def run(args: argparse.Namespace, model: str, out: Path) -> dict:
    serve = [*emulated_serve_args(args.profile, args.time_scale), "--kv-cache-memory-mb", str(args.kv_cache_memory_mb)]
    dep = Deployment(model, args.prefill, args.decode, args.kv_mode, free_port(), serve, [], log_dir=str(out / "logs"))
    # what `kvpush up` would be given to start the same deployment (its --emulated-link off: no netns link)
    command = ["up", model, "--prefill", str(args.prefill), "--decode", str(args.decode), "--kv-mode", args.kv_mode,
               "--emulated-link", "off", *serve]
    results: dict = {"machine": machine_line(), "args": vars(args), "command": command, "rows": []}
    with dep:
        for k, rate in enumerate(args.rates):
            before = wait_idle(dep.url, 60)
            doc = bench(dep.url, args, rate, args.seed + k, out)
            busy = wait_idle(dep.url, 120)
            reset_prefix_caches(dep.url)
            idle = snapshot(dep.url)
            results["rows"].append(row(rate, doc, before, busy, idle, args.time_scale))
            print(json.dumps(results["rows"][-1]), flush=True)
    return results


def row(rate: float, doc: dict, before: dict, after: dict, idle: dict, scale: float) -> dict[str, Any]:
    m, em = doc["metrics"], doc.get("emulation") or {}
    completed = delta(after, before, "completed")
    return {"rate": rate, "ok": m["completed"], "failed": m["failed"], "req_per_s": m["request_throughput"],
            "proxy_requests": delta(after, before, "requests"), "shed": delta(after, before, "shed"),
            "rerouted": delta(after, before, "rerouted"),
            "routes": {r: n - before["routes"].get(r, 0.0) for r, n in after["routes"].items()},
            # per second of the bench's own measured window: the share of the run's requests (warm-ups
            # included) that moved KV, times its request throughput
            "transfers": completed, "transfers_per_s": completed / max(delta(after, before, "requests"), 1.0)
            * m["request_throughput"],
            "failures": {r: n - before["failure_reasons"].get(r, 0.0) for r, n in after["failure_reasons"].items()
                         if n - before["failure_reasons"].get(r, 0.0)},
            "ignored": delta(after, before, "ignored"), "fallbacks": delta(after, before, "fallbacks"),
            "records_held_idle": {k: v for k, v in idle["records_by_state"].items() if k not in TERMINAL},
            "tombstones_added": sum(v - before["records_by_state"].get(k, 0.0)
                                    for k, v in idle["records_by_state"].items() if k in TERMINAL),
            "quarantined_idle": idle["quarantined"],
            "blocks_used_idle": idle["blocks_used"], "valid": em.get("valid"),
            "ttft_p50_emulated_ms": (em.get("emulated_time_ms") or {}).get("median_ttft_ms"),
            "tpot_p50_emulated_ms": (em.get("emulated_time_ms") or {}).get("median_tpot_ms"),
            "time_scale": scale, "instances": after["instances"]}


def table(results: dict) -> str:
    a = results["args"]
    lines = [results["machine"], "", f"`kvpush {' '.join(results['command'])}` (EMULATED: {a['profile']}, x{a['time_scale']:g})",
             "", "| offered req/s | ok/failed | req/s | transfers/s | routes | shed / rerouted | transfer failures | "
             "ignored | live records idle (tombstones added) | quarantined / blocks in use idle | TTFT p50 / TPOT p50 (emulated ms) | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        routes = ", ".join(f"{k} {v:.0f}" for k, v in r["routes"].items() if v) or "-"
        held = ", ".join(f"{k} {v:.0f}" for k, v in r["records_held_idle"].items() if v) or "0"
        fails = ", ".join(f"{k} {v:.0f}" for k, v in r["failures"].items()) or "0"
        lines.append(f"| {r['rate']:g} | {r['ok']}/{r['failed']} | {r['req_per_s']:.2f} | {r['transfers_per_s']:.2f} | "
                     f"{routes} | {r['shed']:.0f} / {r['rerouted']:.0f} | {fails} | {r['ignored']:.0f} | {held} (+{r.get('tombstones_added', 0):.0f}) | "
                     f"{r['quarantined_idle']:.0f} / {r['blocks_used_idle']:.0f} | "
                     f"{r['ttft_p50_emulated_ms'] or 0:.1f} / {r['tpot_p50_emulated_ms'] or 0:.2f} | {r['valid']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--profile", default="qwen3-32b-h200-tp8", help="(default: qwen3-32b-h200-tp8)")
    ap.add_argument("--time-scale", type=float, default=40.0, help="(default: 40)")
    ap.add_argument("--prefill", type=int, default=8, help="prefill instances (default: 8)")
    ap.add_argument("--decode", type=int, default=8, help="decode instances (default: 8)")
    ap.add_argument("--kv-mode", default="auto", choices=["push", "pull", "push-layerwise", "auto"],
                    help="(default: auto)")
    ap.add_argument("--kv-cache-memory-mb", type=int, default=256, help="per instance (default: 256)")
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 4.0, 8.0],
                    help="wall-clock requests per second, one run each (default: 2 4 8)")
    ap.add_argument("--num-prompts", type=int, default=120, help="requests per run (default: 120)")
    ap.add_argument("--input-len", type=int, default=512, help="(default: 512)")
    ap.add_argument("--output-len", type=int, default=64, help="(default: 64)")
    ap.add_argument("--seed", type=int, default=0, help="(default: 0)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="one bench run's limit (default: 1800)")
    ap.add_argument("--result-dir", default="kvpush-results/emulate_scale", help="(default: kvpush-results/emulate_scale)")
    args = ap.parse_args()
    if args.prefill < 1 or args.decode < 1 or not args.time_scale > 0 or any(r <= 0 for r in args.rates):
        ap.error("--prefill and --decode must be >= 1, --time-scale and --rates positive")
    model = args.model or ensure_model(default_model_dir(), "bench")
    out = Path(args.result_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = run(args, model, out)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    text = table(results)
    (out / "table.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
