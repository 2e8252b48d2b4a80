"""Emulated against real on this machine (issue 37's validation: colocated, 1P1D push and pull).

    python benchmarks/emulate_vs_real.py --profile FILE [--model DIR] [--deployments colocated push pull]
        [--rates 0 2] [--loads 0.5 0.8] [--repeats 3] [--num-prompts 16] [--input-len 512] [--output-len 64]
        [--range-ratio 0.75] [--core 1] [--result-dir DIR]
    python benchmarks/emulate_vs_real.py --reprofile ...   # a fresh profile beside each repeat

FILE is a profile of kvpush's own engine on this machine, `kvpush profile MODEL -o FILE --torch-threads 1`
(run on one core). With --reprofile there is no FILE: before each repeat that command runs on --core
(the host drifts by a fifth within minutes; a profile is a fixed clock), and the repeat's emulated runs
use the profile taken just before them. --loads adds rates that are fractions of the real deployment's
capacity, measured once per deployment on its first real start (every request of a run at once:
completed requests per second). --range-ratio draws prompt and output lengths from [L * (1 - r),
L * (1 + r)] (kvpush bench --range-ratio): a mixed set of lengths. Per repeat, deployment and rate, the real deployment and the emulated one (every
instance with `--emulate FILE`) take turns, the order alternating, and `kvpush bench` sends both the same
prompts: rate 0 is one request at a time (--max-concurrency 1), any other rate Poisson arrivals.
`colocated` is one `kvpush serve MODEL` on core --core with one torch thread, the client on the other
core; `push` and `pull` are `kvpush up MODEL --prefill 1 --decode 1 --kv-mode push|pull --pin
--emulated-link off` (P on one core, D on the other, one torch thread each; the proxy and the client
unpinned; KV at the host's own speed in both kinds). Prints per rate TTFT p50/p99 and TPOT
p50 of each, emulated over real with a 95% bootstrap interval (clustered over the repeats, the same
prompts paired) and a verdict against the issue's 10%, and each emulated run's validity (lateness p99
within 5% of the median step: bench/emulation.py). Where a cell misses, the profile's clock is what is
wrong for that workload (the real instance's other costs, HTTP and the engine's Python, run in both).
Writes results.json into --result-dir.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from kvpush.bench.demo import ensure_model
from kvpush.bench.machine import machine_line
from kvpush.bench.stats import bootstrap_ci, clustered_ratio_ci, fmt_ci, p50, p99
from kvpush.config import default_model_dir
from kvpush.launcher.launch import ServerProcess, free_port
from kvpush.launcher.up import Deployment

KINDS = ("real", "emulated")
TARGET = 0.10  # issue 37: within 10% of the real figures


@contextmanager
def deployment(kind: str, dep: str, args: argparse.Namespace, model: str, logs: Path, tag: str) -> Iterator[str]:
    """The deployment's URL while it runs; stopped (every process) on the way out."""
    extra = ["--torch-threads", "1", "--compile", "auto", *(["--emulate", args.profile] if kind == "emulated" else [])]
    # (args.profile: with --reprofile, the profile of the repeat under way: run() sets it)
    if dep == "colocated":
        server = ServerProcess(["serve", model, "--port", str(free_port()), *extra], log_path=str(logs / f"{tag}.log"),
                               prefix=["taskset", "-c", str(args.core)]).start()
        try:
            server.wait_healthy(args.start_timeout_s)
            yield server.url
        finally:
            server.stop()
        return
    # what `kvpush up MODEL --kv-mode DEP --pin --emulated-link off` starts: P on one half of the cores, D on the other
    up = Deployment(model, 1, 1, dep, free_port(), extra, [], log_dir=str(logs / tag), pin=True)
    try:
        yield up.start(args.start_timeout_s).url
    finally:
        up.stop()


def bench(url: str, args: argparse.Namespace, rate: float, seed: int, out: Path, label: str, dep: str) -> dict:
    argv = [sys.executable, "-m", "kvpush.cli", "bench", "--base-url", url, "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
            "--num-warmups", "2", "--seed", str(seed), "--result-dir", str(out), "--mode-label", label, "--no-progress",
            *(["--range-ratio", str(args.range_ratio)] if args.range_ratio else []),
            "--request-rate", "inf" if rate == 0 else str(rate), *(["--max-concurrency", "1"] if rate == 0 else [])]
    pin = ["taskset", "-c", "0" if args.core != 0 else "1"] if dep == "colocated" else []
    subprocess.run([*pin, *argv], check=True, timeout=args.timeout_s)
    [path] = sorted(out.glob(f"{label}-*.json"))
    return json.loads(path.read_text())


def per_request(doc: dict) -> dict[str, list[float]]:
    """TTFT and TPOT (ms) per prompt index, successful requests only (NaN where one failed)."""
    n = doc["config"]["num_prompts"]
    ttft, tpot = [float("nan")] * n, [float("nan")] * n
    for r in doc["requests"]:
        if r["success"] and r["ttft_s"] is not None:
            ttft[r["index"]] = 1e3 * r["ttft_s"]
            if r["output_tokens"] > 1 and r["e2el_s"] is not None:
                tpot[r["index"]] = 1e3 * (r["e2el_s"] - r["ttft_s"]) / (r["output_tokens"] - 1)
    return {"ttft": ttft, "tpot": tpot}


def reprofile(args: argparse.Namespace, model: str, out: Path, rep: int) -> str:
    """A fresh profile of kvpush's engine on --core, for one repeat's emulated runs; its path."""
    path = out / f"profile-rep{rep}.json"
    subprocess.run(["taskset", "-c", str(args.core), sys.executable, "-m", "kvpush.cli", "profile", model, "-o",
                    str(path), "--torch-threads", "1", "--compile", "auto"], check=True, timeout=args.timeout_s,
                   stdout=subprocess.DEVNULL)
    return str(path)


def capacity(url: str, args: argparse.Namespace, out: Path, dep: str) -> float:
    """Completed requests per second of a real deployment given every request of a run at once."""
    doc = bench(url, args, float("inf"), args.seed + 99_999, out / f"{dep}-capacity", f"{dep}-capacity", dep)
    return float(doc["metrics"]["request_throughput"])


def rates_of(args: argparse.Namespace, caps: dict[str, float], dep: str) -> list[tuple[str, float]]:
    """(label, requests per second) of every rate: --rates as given, then each --loads fraction of the
    deployment's capacity (0 = one at a time)."""
    return [(f"{r:g}", r) for r in args.rates] + [(f"{f:.0%}", round(f * caps[dep], 3)) for f in args.loads]


def run(args: argparse.Namespace, model: str, out: Path) -> dict:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": machine_line(), "args": vars(args), "runs": [], "capacity": {}, "profiles": []}
    caps: dict[str, float] = results["capacity"]
    for rep in range(args.repeats):
        if args.reprofile:
            args.profile = reprofile(args, model, out, rep)
            results["profiles"].append(args.profile)
            print(f"repeat {rep}: profile {args.profile}", flush=True)
        for dep in args.deployments:
            order = KINDS if rep % 2 == 0 else KINDS[::-1]  # repeat 0 starts real: its capacity sets the loads' rates
            for kind in order:  # one start per kind, deployment and repeat: every rate on it
                with deployment(kind, dep, args, model, logs, f"{dep}-{kind}-rep{rep}") as url:
                    if kind == "real" and args.loads and dep not in caps:
                        caps[dep] = capacity(url, args, out, dep)
                        print(f"{dep}: capacity {caps[dep]:.3f} req/s", flush=True)
                    for k, (label, rate) in enumerate(rates_of(args, caps, dep)):
                        tag = f"{dep}-{kind}-rate{label.replace('%', 'pct')}-rep{rep}"
                        doc = bench(url, args, rate, args.seed + 100 * rep + k, out / tag, tag, dep)
                        results["runs"].append({"deployment": dep, "kind": kind, "rate": label, "rps": rate, "rep": rep,
                                                "values": per_request(doc), "emulation": doc.get("emulation")})
                        print(f"{tag}: TTFT p50 {doc['metrics']['median_ttft_ms']:.1f} ms, TPOT p50 "
                              f"{doc['metrics']['median_tpot_ms']:.2f} ms", flush=True)
    return results


def _paired(runs: list[dict], rate: float, metric: str, stat) -> str:
    """`runs` of one deployment."""
    groups = []
    for rep in sorted({r["rep"] for r in runs}):
        cell = {r["kind"]: np.asarray(r["values"][metric]) for r in runs if r["rate"] == rate and r["rep"] == rep}
        if len(cell) == 2:
            ok = ~np.isnan(cell["emulated"]) & ~np.isnan(cell["real"])
            groups.append((cell["emulated"][ok], cell["real"][ok]))
    est, lo, hi = clustered_ratio_ci(groups, stat)
    within = "within 10%" if 1 - TARGET <= lo and hi <= 1 + TARGET else (
        "off by more than 10%" if hi < 1 - TARGET or lo > 1 + TARGET else "cannot tell")
    return f"{fmt_ci(est, lo, hi, 2)} {within}"


def table(results: dict) -> str:
    lines = [results["machine"], "",
             "| deployment | rate | metric | real (ms) | emulated (ms) | emulated / real [95% CI] |",
             "|---|---|---|---|---|---|"]
    for dep in results["args"]["deployments"]:
        runs = [r for r in results["runs"] if r["deployment"] == dep]
        for rate in dict.fromkeys(r["rate"] for r in runs):
            for metric, stat, name in (("ttft", p50, "TTFT p50"), ("ttft", p99, "TTFT p99"), ("tpot", p50, "TPOT p50")):
                cells = []
                for kind in KINDS:
                    values = np.asarray(sum((r["values"][metric] for r in runs if r["rate"] == rate
                                             and r["kind"] == kind), []))
                    values = values[~np.isnan(values)]
                    cells.append(fmt_ci(*bootstrap_ci(values, stat), 1) if values.size else "-")
                what = "one at a time" if rate == "0" else f"{rate} of capacity" if rate.endswith("%") else f"{rate}/s"
                lines.append(f"| {dep} | {what} | {name} | {cells[0]} | "
                             f"{cells[1]} | {_paired(runs, rate, metric, stat)} |")
    runs = results["runs"]
    validity = [r["emulation"]["valid"] for r in runs if r["kind"] == "emulated" and r["emulation"]]
    lines += ["", f"Emulated runs valid (lateness p99 within 5% of the median step): {sum(validity)} of {len(validity)}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None,
                    help="a profile of kvpush's engine on this machine (kvpush profile; default: none, --reprofile)")
    ap.add_argument("--reprofile", action="store_true",
                    help="profile kvpush's engine on --core before each repeat, for that repeat's emulated runs "
                         "(default: off, --profile for every run)")
    ap.add_argument("--loads", type=float, nargs="+", default=[],
                    help="also these fractions of the real deployment's measured capacity, e.g. 0.5 0.8 (default: none)")
    ap.add_argument("--range-ratio", type=float, default=0.0,
                    help="prompt and output lengths drawn within +-this fraction of --input-len/--output-len: a mixed "
                         "set of lengths (default: 0, every prompt alike)")
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--deployments", nargs="+", choices=["colocated", "push", "pull"], default=["colocated"],
                    help="what to compare, real against emulated (default: colocated)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.0],
                    help="request rates per second; 0 = one at a time (default: 0)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per kind and rate (default: 3)")
    ap.add_argument("--num-prompts", type=int, default=16, help="requests per run (default: 16)")
    ap.add_argument("--input-len", type=int, default=512, help="prompt tokens (default: 512)")
    ap.add_argument("--output-len", type=int, default=64, help="output tokens (default: 64)")
    ap.add_argument("--core", type=int, default=1, help="the instances' core; the client takes another (default: 1)")
    ap.add_argument("--seed", type=int, default=0, help="first prompt seed (default: 0)")
    ap.add_argument("--start-timeout-s", type=float, default=300.0, help="an instance's start-up limit (default: 300)")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="one bench run's limit (default: 900)")
    ap.add_argument("--result-dir", default="kvpush-results/emulate_vs_real",
                    help="(default: kvpush-results/emulate_vs_real)")
    args = ap.parse_args()
    if (args.profile is None) == (not args.reprofile):
        ap.error("give one of --profile FILE and --reprofile")
    if any(not 0 < f <= 1 for f in args.loads) or not 0 <= args.range_ratio < 1:
        ap.error("--loads must be in (0, 1] and --range-ratio in [0, 1)")
    if args.profile is not None and not Path(args.profile).is_file():
        ap.error(f"no profile at {args.profile}: `kvpush profile MODEL -o FILE --torch-threads 1` makes one")
    model = args.model or ensure_model(default_model_dir(), "bench")
    out = Path(args.result_dir)
    results = run(args, model, out)
    (out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    text = table(results)
    (out / "table.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
