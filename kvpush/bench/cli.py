"""``kvpush bench`` and ``kvpush bench compare``: argument parsing and the run loop.

One bench invocation runs one measured run per ``--request-rate`` value (several values make a
sweep) against an OpenAI-compatible server, prints one summary line per run and writes one JSON file
per run into ``--result-dir``::

    {"config": {...every argument, request_rate of this run ("inf" or a number), mode...},
     "environment": {"kvpush_version", "git_commit", "cpu_count", "python", "platform", "torch", "nixl"},
     "run": {"started_at", "started_at_unix", "duration_s", "warmups", "warmup_failed", "sample_seed"},
     "metrics": {...BenchmarkMetrics...},
     "requests": [...RequestRecord...],
     "emulation": null, or the profile(s) of emulated instances and whether the run is valid (emulation.py)}

Prompts of the k-th rate of a sweep are drawn with seed ``--seed + k``, and warm-up prompts are
drawn beyond the measured ones, so a server's prefix cache is not warmed by earlier runs or
warm-ups. Exit codes: 0 when every run completed at least one request, 1 when a run aborted or
completed none, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from kvpush.argtypes import positive_float
from kvpush.bench.compare import compare
from kvpush.bench.datasets import (
    DatasetError,
    Sample,
    file_samples,
    mixed_samples,
    random_samples,
    session_samples,
    sharegpt_samples,
)
from kvpush.bench.emulation import add_emulated_time, emulation_report, reset_windows
from kvpush.bench.emulation import describe as describe_emulation
from kvpush.bench.loadgen import BenchmarkAborted, LoadConfig, RunResult, fetch_model, run_load_sync
from kvpush.bench.metrics import BenchmarkMetrics, compute_metrics, parse_slo
from kvpush.bench.report import fmt_rate, format_table, load_run
from kvpush.bench.trace import format_critical_path

DEFAULT_RESULT_DIR = "kvpush-results"
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
_JSON_SCALARS = (str, int, float, bool, type(None))


def _positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = _parse(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    value = _parse(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _rate(text: str) -> float:
    """argparse type: requests per second > 0, or ``inf``."""
    value = _parse(float, text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 or inf, got {text}")
    return value


def _range_ratio(text: str) -> float:
    """argparse type: a float in [0, 1)."""
    value = _parse(float, text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return value


def _token_ids(text: str) -> list[int]:
    """argparse type: comma-separated token ids."""
    return [_parse(int, part) for part in text.split(",") if part.strip()]


def _slo(text: str) -> dict[str, float]:
    """argparse type: ``ttft:MS,tpot:MS,e2el:MS``."""
    try:
        return parse_slo(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _parse(kind: type, text: str) -> Any:
    """``kind(text)`` with an argparse error instead of a ValueError."""
    try:
        return kind(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvpush bench`` flags to ``parser``."""
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server (or proxy) URL")
    add("--model", default=None, help="model name; default: the first of GET /v1/models")
    add("--api-key", default=None, help="sent as a bearer token; never written to results")
    add("--result-dir", default=DEFAULT_RESULT_DIR, help="where the run JSON files go")
    add("--mode-label", default="other", help="label stored as config.mode (push, pull, colocated...)")
    add("--kv-route", default=None, choices=["push", "push-layerwise", "pull", "local"],
        help="send X-KVPush-KV-Mode: a --kv-mode auto proxy takes this route for every request")
    add("--dataset", choices=("random", "sessions", "mixed", "sharegpt", "file"), default="random",
        help="sessions: multi-turn token-id prompts, each turn extending the previous (--session-turns, "
        "--turn-len); mixed: short (input-len/4), long (input-len x 2) and session prompts, a third each")
    add("--dataset-path", default=None, help="ShareGPT JSON or prompt file (one per line)")
    add("--input-len", type=_positive_int, default=DEFAULT_INPUT_LEN, help="random: tokens after the prefix")
    add("--output-len", type=_positive_int, default=None,
        help=f"max_tokens per request (default {DEFAULT_OUTPUT_LEN}; sharegpt: the reply's length)")
    add("--range-ratio", type=_range_ratio, default=0.0, help="random: lengths vary by +-this fraction")
    add("--prefix-len", type=_nonneg_int, default=0, help="random: tokens shared by every prompt")
    add("--session-turns", type=_positive_int, default=4, help="sessions: turns per session")
    add("--turn-len", type=_positive_int, default=64, help="sessions: new tokens per turn (after the answer's)")
    add("--vocab-size", type=_positive_int, default=1000,
        help="random: ids are drawn from [0, vocab-size); the default 1000 fits inside any real "
        "vocabulary (the server's is not queried); exclude special ids with --avoid-token-ids")
    add("--avoid-token-ids", type=_token_ids, default=[], help="random: comma-separated ids never drawn")
    add("--request-rate", type=_rate, nargs="+", default=[math.inf],
        help="requests/s (Poisson), or inf for all at once; several values run a sweep")
    add("--burstiness", type=positive_float, default=1.0, help="gamma shape of arrivals; 1 = Poisson")
    add("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    add("--num-prompts", type=_positive_int, default=100, help="measured requests per run")
    add("--num-warmups", type=_nonneg_int, default=2, help="warm-up requests per run (excluded)")
    add("--ignore-eos", action="store_true", help="generate exactly output-len tokens")
    add("--seed", type=int, default=0, help="seed of prompts and arrivals")
    add("--slo", type=_slo, default={}, help="goodput SLOs in ms, e.g. ttft:500,tpot:50 (also e2el)")
    add("--timeout-s", type=positive_float, default=600.0, help="per-request timeout")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--trace", action="store_true",
        help="print each run's critical path: per-segment table of TTFT from the servers' kvpush_trace")


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvpush bench compare`` arguments to ``parser``."""
    parser.add_argument("runs", nargs="+", help="run JSON files written by kvpush bench")
    parser.add_argument("--out", default=os.path.join(DEFAULT_RESULT_DIR, "compare"), help="output folder")


def _error(message: str, code: int) -> int:
    """Print a CLI error and return ``code``."""
    print(f"kvpush bench: error: {message}", file=sys.stderr)
    return code


def build_samples(args: argparse.Namespace, count: int, seed: int) -> list[Sample]:
    """``count`` samples of the chosen dataset; raises ``DatasetError``."""
    output_len = args.output_len
    if args.dataset == "random":
        return random_samples(
            count, args.input_len, output_len or DEFAULT_OUTPUT_LEN, range_ratio=args.range_ratio,
            prefix_len=args.prefix_len, vocab_size=args.vocab_size, avoid_ids=args.avoid_token_ids,
            seed=seed,
        )
    if args.dataset in ("sessions", "mixed"):
        make = session_samples if args.dataset == "sessions" else mixed_samples
        return make(count, args.input_len, output_len or DEFAULT_OUTPUT_LEN, turns=args.session_turns,
                    turn_len=args.turn_len, vocab_size=args.vocab_size, avoid_ids=args.avoid_token_ids, seed=seed)
    if not args.dataset_path:
        raise DatasetError(f"--dataset-path is required with --dataset {args.dataset}")
    if args.dataset == "sharegpt":
        return sharegpt_samples(args.dataset_path, count, output_len=output_len, seed=seed)
    return file_samples(args.dataset_path, count, output_len=output_len or DEFAULT_OUTPUT_LEN)


def _dist_version(name: str) -> str | None:
    """Installed version of a distribution, without importing it; None if absent."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _package_version() -> str | None:
    """``kvpush.__version__`` when the distribution metadata is missing (a plain checkout)."""
    try:
        import kvpush
    except ImportError:
        return None
    return getattr(kvpush, "__version__", None)


def _git(*args: str) -> str | None:
    """A git command's output in the package's folder (kvpush/), or None (no git, not a checkout)."""
    try:
        proc = subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), *args],
                              capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _git_commit() -> str | None:
    """HEAD of the git checkout holding this package, or None."""
    return _git("rev-parse", "HEAD") or None


def _git_dirty() -> bool | None:
    """Whether the package's tracked files differ from HEAD (a run from an uncommitted tree), or None."""
    out = _git("status", "--porcelain", "--untracked-files=no", "--", ".")
    return None if out is None else bool(out)


def environment() -> dict[str, Any]:
    """Where a run was made: versions (from package metadata), git commit, CPUs, and the machine's facts
    (machine.py: the CPU, torch's build and threads, huge pages, the kernel paths; `kvpush env`)."""
    from kvpush.bench.machine import facts

    return {
        "machine": facts(),
        "kvpush_version": _dist_version("kvpush") or _package_version(),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": _dist_version("torch"),
        "nixl": _dist_version("nixl"),
    }


def _json_rate(rate: float) -> float | str:
    """A rate for JSON: ``"inf"`` instead of a non-standard Infinity."""
    return "inf" if math.isinf(rate) else rate


def run_config(args: argparse.Namespace, rate: float, model: str) -> dict[str, Any]:
    """Every JSON-able argument, with this run's rate, the model and the mode label; no API key."""
    config: dict[str, Any] = {}
    for key, value in vars(args).items():
        if isinstance(value, _JSON_SCALARS) or (
            isinstance(value, list | dict) and all(isinstance(v, _JSON_SCALARS) for v in value)
        ):
            config[key] = value
    config["request_rates"] = [_json_rate(r) for r in args.request_rate]
    config["request_rate"] = _json_rate(rate)
    config["model"] = model
    config["mode"] = args.mode_label
    config["api_key"] = "***" if args.api_key else None
    return config


def run_document(
    args: argparse.Namespace, rate: float, model: str, seed: int, result: RunResult, metrics: BenchmarkMetrics
) -> dict[str, Any]:
    """The JSON document of one run."""
    return {
        "config": run_config(args, rate, model),
        "environment": environment(),
        "run": {
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(result.started_at_unix)),
            "started_at_unix": result.started_at_unix,
            "duration_s": result.duration_s,
            "warmups": result.warmups,
            "warmup_failed": result.warmup_failed,
            "sample_seed": seed,
        },
        "metrics": msgspec.to_builtins(metrics),
        "requests": msgspec.to_builtins(result.records),
    }


def write_run(doc: dict[str, Any], result_dir: str | Path, label: str, rate: float) -> Path:
    """Write ``doc`` as ``LABEL-rateRATE-YYYYmmdd-HHMMSS.json`` (never overwriting); return the path."""
    out = Path(result_dir)
    out.mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", label.replace("#", "-twin")) or "run"  # auto#2: auto-twin2
    stem = f"{safe}-rate{fmt_rate(rate)}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = out / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = out / f"{stem}-{n}.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(doc), indent=1))
    return path


def summary_line(label: str, rate: float, m: BenchmarkMetrics) -> str:
    """One console line per run."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    sat = " SATURATED" if m.saturated else ""
    return (
        f"[{label}] rate {fmt_rate(rate)}: {m.completed} ok, {m.failed} failed, "
        f"{m.request_throughput:.2f} req/s, {m.output_throughput:.1f} tok/s, "
        f"TTFT p50 {ms(m.median_ttft_ms)} p99 {ms(m.p99_ttft_ms)} ms, "
        f"TPOT p50 {ms(m.median_tpot_ms)} p99 {ms(m.p99_tpot_ms)} ms{sat}"
    )


def _one_run(args: argparse.Namespace, k: int, rate: float, model: str) -> tuple[dict[str, Any], Path]:
    """Run the k-th rate of the sweep and write its JSON; raises DatasetError/BenchmarkAborted."""
    seed = args.seed + k
    if args.dataset in ("sessions", "mixed"):  # warm-ups outside the sessions: they must not pre-fill later turns' prefixes
        measured = build_samples(args, args.num_prompts, seed)
        warm = random_samples(args.num_warmups, args.input_len, args.output_len or DEFAULT_OUTPUT_LEN,
                              vocab_size=args.vocab_size, avoid_ids=args.avoid_token_ids,
                              seed=seed + 7_777_777) if args.num_warmups else []
    else:
        samples = build_samples(args, args.num_prompts + args.num_warmups, seed)
        measured, warm = samples[: args.num_prompts], samples[args.num_prompts :]
    cfg = LoadConfig(
        base_url=args.base_url, model=model, request_rate=rate, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, num_warmups=args.num_warmups, ignore_eos=args.ignore_eos,
        seed=seed, api_key=args.api_key, timeout_s=args.timeout_s, progress=not args.no_progress,
        kv_route=getattr(args, "kv_route", None),
    )
    not_reset = reset_windows(args.base_url, args.api_key)  # emulated: the verdict is over this run (+ warm-ups)
    result = run_load_sync(measured, cfg, warm or None)
    metrics = compute_metrics(result.records, result.duration_s, rate, args.slo)
    doc = run_document(args, rate, model, seed, result, metrics)
    doc["emulation"] = emulation_report(args.base_url, window_not_reset=not_reset)  # None: real instances
    add_emulated_time(doc["emulation"], doc["metrics"])
    path = write_run(doc, args.result_dir, args.mode_label, rate)
    print(f"{summary_line(args.mode_label, rate, metrics)}{describe_emulation(doc['emulation'])} -> {path}", flush=True)
    if getattr(args, "trace", False):
        cp = metrics.critical_path
        print(format_critical_path(cp, f"{args.mode_label} @ {fmt_rate(rate)} req/s") if cp is not None
              else "critical path: no request carried a complete kvpush_trace", flush=True)
    return doc, path


def run_bench(args: argparse.Namespace) -> int:
    """Run every requested rate; return the exit code (see the module docstring)."""
    try:
        build_samples(args, 1, args.seed)  # fail fast on a bad dataset, before any traffic
        model = args.model or asyncio.run(fetch_model(args.base_url, args.api_key))
    except DatasetError as exc:
        return _error(str(exc), 2)
    except BenchmarkAborted as exc:
        return _error(str(exc), 1)
    docs = []
    for k, rate in enumerate(args.request_rate):
        try:
            doc, _ = _one_run(args, k, rate, model)
        except (DatasetError, BenchmarkAborted, OSError) as exc:
            return _error(f"rate {fmt_rate(rate)}: {exc}", 1)
        docs.append(doc)
    if len(docs) > 1:
        print(format_table(docs))
    return 0 if all(d["metrics"]["completed"] > 0 for d in docs) else 1


def run_compare(args: argparse.Namespace) -> int:
    """Write the comparison of ``args.runs`` into ``args.out`` and print the table."""
    try:
        md_path, pngs = compare(args.runs, args.out)
        print(format_table([load_run(path) for path in args.runs]))
    except (ValueError, OSError) as exc:
        return _error(str(exc), 1)
    print(f"wrote {md_path}" + "".join(f", {p}" for p in pngs))
    return 0
