"""Compare benchmark runs: a Markdown table per request rate (compare.py adds the plots and writes them).

Runs are grouped by ``(config.request_rate, config.mode)``. Repeats of one group (same mode and
rate, e.g. alternating push/pull runs) are combined by taking the median of each metric over the
repeats; the ``runs`` column says how many there were. Throughput ratios are ``push / pull`` of those
values (above 1 push is better). TTFT and TPOT ratios are the percentile of push's requests pooled
over its repeats over pull's (below 1 push is better), with a 95% bootstrap interval and a verdict:
"push better", "pull better", or "cannot tell" when the interval spans 1. When both modes ran the same prompt sets (alternating repeats with one sample seed
each, as benchmarks/push_vs_pull.py does) the interval is paired: requests are matched by prompt
within a repeat and the repeats are resampled too; otherwise the pooled requests of each mode are
resampled independently.

The critical-path plot stacks, per mode and rate, the same four phases (to prefill, prefill,
handover, to client; see ``kvpush.bench.trace``) so that each bar is the mean TTFT; work that
overlapped the path (D's registration during P's prefill in push) is a separate hatched bar.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpush.bench.metrics import TRACE_EVENTS
from kvpush.bench.stats import Stat, clustered_ratio_ci, fmt_ci, p50, p99, ratio_ci, verdict
from kvpush.bench.trace import PHASES

MODE_ORDER = ("push", "pull", "colocated")
COLUMNS = (
    ("TTFT p50 (ms)", "median_ttft_ms"),
    ("TTFT p99 (ms)", "p99_ttft_ms"),
    ("TPOT p50 (ms)", "median_tpot_ms"),
    ("TPOT p99 (ms)", "p99_tpot_ms"),
    ("req/s", "request_throughput"),
    ("out tok/s", "output_throughput"),
)
Run = dict[str, Any]
Group = tuple[float, str]


def parse_rate(value: Any) -> float:
    """A request rate from JSON: a number, ``"inf"`` or null (= inf)."""
    if value is None:
        return math.inf
    return float(value)


def fmt_rate(rate: float) -> str:
    """``inf`` or the rate in ``%g`` form."""
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _fmt(value: float | None, digits: int = 2) -> str:
    """A table cell: ``-`` for missing values."""
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def load_run(path: str | Path) -> Run:
    """Load one run JSON written by ``kvpush bench``; raise ValueError if it is not one."""
    try:
        run = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read run file {path}: {exc}") from exc
    if not isinstance(run, dict) or not isinstance(run.get("config"), dict) or not isinstance(
        run.get("metrics"), dict
    ):
        raise ValueError(f"{path}: not a kvpush bench run (needs 'config' and 'metrics')")
    try:
        run["config"]["request_rate"] = parse_rate(run["config"].get("request_rate"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad config.request_rate: {exc}") from exc
    run["config"].setdefault("mode", "other")
    return run


def _mode_key(mode: str) -> tuple[int, str]:
    """Sort key: push, pull, colocated first, then the rest by name."""
    return (MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER), mode)


def group_runs(results: Sequence[Run]) -> dict[Group, list[Run]]:
    """Runs keyed by ``(rate, mode)``, in rate order then mode order."""
    groups: dict[Group, list[Run]] = {}
    for run in results:
        cfg = run["config"]
        key = (parse_rate(cfg.get("request_rate")), str(cfg.get("mode", "other")))
        groups.setdefault(key, []).append(run)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0][0], _mode_key(kv[0][1]))))


def median_metric(runs: Sequence[Run], key: str) -> float | None:
    """Median over repeats of one metric; None if no run has it."""
    values = [float(v) for v in (r["metrics"].get(key) for r in runs) if isinstance(v, int | float)]
    return statistics.median(values) if values else None


def ratio(num: float | None, den: float | None) -> float | None:
    """``num / den``, or None if either is missing or ``den`` is 0."""
    if num is None or den is None or den == 0:
        return None
    return num / den


def _row(mode: str, runs: Sequence[Run]) -> str:
    """One Markdown table row for a mode at one rate."""
    done = sum(int(r["metrics"].get("completed", 0)) for r in runs)
    failed = sum(int(r["metrics"].get("failed", 0)) for r in runs)
    sat = sum(bool(r["metrics"].get("saturated")) for r in runs)
    cells = [_fmt(median_metric(runs, key)) for _, key in COLUMNS]
    sat_cell = "no" if sat == 0 else f"yes ({sat}/{len(runs)})"
    return f"| {mode} | {len(runs)} | {done}/{failed} | " + " | ".join(cells) + f" | {sat_cell} |"


def _request_value(r: Any, metric: str) -> float | None:
    """One request's TTFT or TPOT (ms), or None if it failed or has no such value."""
    if not isinstance(r, dict) or not r.get("success") or r.get("ttft_s") is None:
        return None
    if metric == "ttft":
        return float(r["ttft_s"]) * 1000.0
    if int(r.get("output_tokens") or 0) >= 2 and r.get("e2el_s") is not None:
        return (float(r["e2el_s"]) - float(r["ttft_s"])) / (int(r["output_tokens"]) - 1) * 1000.0
    return None


def _values_by_index(run: Run, metric: str) -> dict[int, float]:
    """Request index -> TTFT or TPOT (ms) of the successful requests of one run."""
    out = {}
    for k, r in enumerate(run.get("requests") or []):
        value = _request_value(r, metric)
        if value is not None:
            out[int(r.get("index", k))] = value
    return out


def request_values(runs: Sequence[Run], metric: str) -> list[float]:
    """Per-request TTFT or TPOT (ms) of the successful requests of ``runs``, pooled."""
    return [v for run in runs for v in _values_by_index(run, metric).values()]


PROMPT_KEYS = ("dataset", "dataset_path", "input_len", "output_len", "range_ratio", "prefix_len", "session_turns",
               "turn_len", "vocab_size", "num_prompts", "num_warmups", "burstiness")


def _prompt_set(run: Run) -> Any:
    """What identifies a run's prompts and arrival times: its sample seed with the workload settings
    that shape the prompts drawn from it (None if no seed was recorded)."""
    info, cfg = run.get("run"), run.get("config") or {}
    seed = info.get("sample_seed") if isinstance(info, dict) else None
    return None if seed is None else (seed, *(str(cfg.get(k)) for k in PROMPT_KEYS))


def paired_groups(a: Sequence[Run], b: Sequence[Run], metric: str) -> list[tuple[list[float], list[float]]] | None:
    """One group per prompt set both sides ran (same seed and workload, once per side): the values of
    the requests that succeeded in both, paired by request index. None when the runs do not pair up
    that way (different prompt sets, one run twice, no seed recorded)."""
    sets_a, sets_b = [_prompt_set(r) for r in a], [_prompt_set(r) for r in b]
    if not a or None in sets_a or None in sets_b or len(set(sets_a)) != len(sets_a) or Counter(sets_a) != Counter(sets_b):
        return None
    by_set = {_prompt_set(r): r for r in b}
    groups = []
    for run in a:
        x, y = _values_by_index(run, metric), _values_by_index(by_set[_prompt_set(run)], metric)
        both = sorted(x.keys() & y.keys())
        groups.append(([x[i] for i in both], [y[i] for i in both]))
    return groups


def mode_ratio_ci(a: Sequence[Run], b: Sequence[Run], metric: str, stat: Stat) -> tuple[float, float, float] | None:
    """``stat`` of mode a's requests / mode b's with a 95% bootstrap interval: paired by prompt when the
    runs share prompt sets (``paired_groups``; with several repeats the repeats are resampled too);
    else over the pooled requests of each side independently. None without values on both sides."""
    found = mode_ratio_ci_paired(a, b, metric, stat)
    return None if found is None else found[0]


def mode_ratio_ci_paired(a: Sequence[Run], b: Sequence[Run], metric: str,
                         stat: Stat) -> tuple[tuple[float, float, float], bool] | None:
    """``mode_ratio_ci`` and whether its interval was the paired one (False: pooled requests, unpaired)."""
    groups = paired_groups(a, b, metric)
    if groups is not None and sum(len(x) for x, _ in groups) >= 2:
        return clustered_ratio_ci(groups, stat=stat), True  # one group: a plain paired bootstrap
    x, y = request_values(a, metric), request_values(b, metric)
    if len(x) < 2 or len(y) < 2:
        return None
    return ratio_ci(x, y, stat=stat), False


def _ratio_cell(push: Sequence[Run], pull: Sequence[Run], key: str) -> str:
    """push/pull of one column; for TTFT and TPOT percentiles with a 95% bootstrap interval
    (``mode_ratio_ci``) and a verdict ("cannot tell" when the interval spans 1)."""
    plain = _fmt(ratio(median_metric(push, key), median_metric(pull, key)), 3)
    metric = "ttft" if "_ttft_" in key else "tpot" if "_tpot_" in key else None
    if metric is None:
        return plain
    ci = mode_ratio_ci(push, pull, metric, p99 if key.startswith("p99") else p50)
    if ci is None:
        return plain
    est, lo, hi = ci
    return f"{fmt_ci(est, lo, hi)} {verdict(lo, hi)}"


def _ratio_row(by_mode: dict[str, list[Run]]) -> str | None:
    """The push/pull ratio row, if both modes ran at this rate."""
    if "push" not in by_mode or "pull" not in by_mode:
        return None
    cells = [_ratio_cell(by_mode["push"], by_mode["pull"], key) for _, key in COLUMNS]
    return "| **push/pull** | | | " + " | ".join(cells) + " | |"


def _by_rate(results: Sequence[Run]) -> dict[float, dict[str, list[Run]]]:
    """``{rate: {mode: runs}}`` in display order."""
    out: dict[float, dict[str, list[Run]]] = {}
    for (rate, mode), runs in group_runs(results).items():
        out.setdefault(rate, {})[mode] = runs
    return out


def format_table(results: Sequence[Run]) -> str:
    """Markdown tables, one per request rate: latencies and throughput per mode, plus push/pull."""
    header = "| mode | runs | ok/failed | " + " | ".join(name for name, _ in COLUMNS) + " | saturated |"
    rule = "|" + "---|" * (len(COLUMNS) + 4)
    sections = []
    for rate, by_mode in _by_rate(results).items():
        lines = [f"### request rate {fmt_rate(rate)} req/s", "", header, rule]
        lines += [_row(mode, runs) for mode, runs in by_mode.items()]
        ratio_line = _ratio_row(by_mode)
        if ratio_line:
            lines.append(ratio_line)
        sections.append("\n".join(lines))
    return "\n\n".join(sections) + "\n"


def handover_medians(runs: Sequence[Run]) -> dict[str, float]:
    """Segment name -> median over repeats of the per-run median (ms), in trace order."""
    values: dict[str, list[float]] = {}
    for run in runs:
        for seg in run["metrics"].get("handover") or []:
            if isinstance(seg, dict) and isinstance(seg.get("median_ms"), int | float):
                values.setdefault(str(seg.get("name")), []).append(float(seg["median_ms"]))
    order = {name: i for i, name in enumerate(TRACE_EVENTS)}

    def key(name: str) -> tuple[int, int, str]:
        a, _, b = name.partition("->")
        return (order.get(a, len(order)), order.get(b, len(order)), name)

    return {name: statistics.median(values[name]) for name in sorted(values, key=key)}


def format_handover(results: Sequence[Run]) -> str:
    """Markdown table of median handover segments (ms) per (rate, mode); empty if no traces."""
    rows = [(rate, mode, handover_medians(runs)) for (rate, mode), runs in group_runs(results).items()]
    rows = [row for row in rows if row[2]]
    if not rows:
        return ""
    names = list(dict.fromkeys(name for _, _, segs in rows for name in segs))
    lines = [
        "| rate | mode | " + " | ".join(names) + " |",
        "|" + "---|" * (len(names) + 2),
    ]
    for rate, mode, segs in rows:
        lines.append(f"| {fmt_rate(rate)} | {mode} | " + " | ".join(_fmt(segs.get(n)) for n in names) + " |")
    return "\n".join(lines) + "\n"


def phase_means(runs: Sequence[Run]) -> tuple[dict[str, float], float | None]:
    """(phase -> median over repeats of the run's mean ms, median registration ms) from each run's
    ``critical_path``; ({}, None) without traces."""
    values: dict[str, list[float]] = {}
    regs: list[float] = []
    for run in runs:
        cp = run["metrics"].get("critical_path")
        if not isinstance(cp, dict):
            continue
        for name, ms in (cp.get("phases") or {}).items():
            values.setdefault(name, []).append(float(ms))
        if isinstance(cp.get("registration_ms"), int | float):
            regs.append(float(cp["registration_ms"]))
    phases = {n: statistics.median(values[n]) for n in PHASES if n in values}
    return phases, statistics.median(regs) if regs else None


def format_phases(results: Sequence[Run]) -> str:
    """Markdown table of the critical path's phases (mean ms, adding up to TTFT) per (rate, mode)."""
    rows = [(rate, mode, *phase_means(runs)) for (rate, mode), runs in group_runs(results).items()]
    rows = [row for row in rows if row[2]]
    if not rows:
        return ""
    lines = ["| rate | mode | " + " | ".join(PHASES) + " | sum | D registration (overlapped) |",
             "|" + "---|" * (len(PHASES) + 4)]
    for rate, mode, phases, reg in rows:
        cells = [_fmt(phases.get(n)) for n in PHASES]
        lines.append(f"| {fmt_rate(rate)} | {mode} | " + " | ".join(cells) +
                     f" | {_fmt(sum(phases.values()))} | {_fmt(reg)} |")
    return "\n".join(lines) + "\n"
