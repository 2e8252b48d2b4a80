"""`kvpush bench compare`: comparison.md (report.py's tables) and its PNG plots - TTFT and TPOT against
request rate, and the critical path's phases per mode and rate."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from kvpush.bench.emulation import VALID_FRACTION
from kvpush.bench.machine import cpu_label
from kvpush.bench.report import (
    Run,
    _by_rate,
    _mode_key,
    fmt_rate,
    format_handover,
    format_phases,
    format_table,
    group_runs,
    load_run,
    median_metric,
    phase_means,
)
from kvpush.bench.trace import PHASES


def _rate_axis(rates: Sequence[float]) -> tuple[list[int], list[str]]:
    """Categorical x positions and labels for sorted rates (so ``inf`` gets a place too)."""
    return list(range(len(rates))), [fmt_rate(r) for r in rates]


def _plot_latency(results: Sequence[Run], metric: str, title: str, path: Path) -> Path:
    """p50 and p99 of ``metric`` (ttft or tpot) vs request rate, one line per mode."""
    from matplotlib.figure import Figure

    by_rate = _by_rate(results)
    rates = list(by_rate)
    xs, labels = _rate_axis(rates)
    modes = sorted({mode for by_mode in by_rate.values() for mode in by_mode}, key=_mode_key)
    fig = Figure(figsize=(10, 4), layout="constrained")
    for ax, stat, name in zip(fig.subplots(1, 2), ("median", "p99"), ("p50", "p99"), strict=True):
        for mode in modes:
            ys = [
                median_metric(by_rate[r][mode], f"{stat}_{metric}_ms") if mode in by_rate[r] else None
                for r in rates
            ]
            ax.plot(xs, [math.nan if y is None else y for y in ys], marker="o", label=mode)
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} {name} (ms)")
        ax.set_title(f"{title} {name}")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.savefig(path, format="png", dpi=100)
    return path


def _plot_critical_path(results: Sequence[Run], path: Path) -> Path | None:
    """Per (mode, rate): the critical path as one stacked bar of the same four phases for every
    mode (mean ms; the bar's height is the mean TTFT), and beside it a separate hatched bar for
    work that overlapped it (push: D's leg and registration during P's prefill). None without traces."""
    from matplotlib.figure import Figure

    bars = [(f"{mode}\n@{fmt_rate(rate)}", *phase_means(runs))
            for (rate, mode), runs in sorted(group_runs(results).items(), key=lambda kv: (kv[0][0], _mode_key(kv[0][1])))]
    bars = [bar for bar in bars if bar[1]]
    if not bars:
        return None
    fig = Figure(figsize=(max(6.0, 1.3 * len(bars) + 4), 5), layout="constrained")
    ax = fig.subplots()
    xs = [float(i) for i in range(len(bars))]
    bottoms = [0.0] * len(bars)
    for name in PHASES:
        heights = [phases.get(name, 0.0) for _, phases, _ in bars]
        ax.bar(xs, heights, width=0.55, bottom=bottoms, label=f"critical path: {name}")
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    regs = [(x + 0.4, reg) for x, (_, _, reg) in zip(xs, bars, strict=True) if reg is not None]
    if regs:
        ax.bar([x for x, _ in regs], [r for _, r in regs], width=0.2, color="none", edgecolor="gray", hatch="//",
               label="overlapped, not on the path: D's leg + registration")
    ax.set_xticks(xs, [label for label, _, _ in bars])
    ax.set_ylabel("mean ms per request (stack = TTFT)")
    ax.set_title("TTFT by critical-path phase")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.savefig(path, format="png", dpi=100)
    return path


def plot_all(results: Sequence[Run], out_dir: Path) -> list[Path]:
    """Write the TTFT, TPOT and (if any traces) critical-path PNGs; return their paths."""
    paths = [
        _plot_latency(results, "ttft", "TTFT", out_dir / "ttft_vs_rate.png"),
        _plot_latency(results, "tpot", "TPOT", out_dir / "tpot_vs_rate.png"),
    ]
    critical = _plot_critical_path(results, out_dir / "critical_path.png")
    return paths + ([critical] if critical else [])


def _markdown(results: Sequence[Run], png_names: Sequence[str]) -> str:
    """The whole comparison document."""
    parts = [
        "# kvpush benchmark comparison",
        "",
        f"{len(results)} runs. Repeats of a mode at one rate are combined by the median of each metric.",
        f"Machine: {machines(results)}.",
        *emulated(results),
        "Ratios are push/pull: below 1 push is better for latencies, above 1 for throughputs.",
        "",
        format_table(results),
    ]
    phases = format_phases(results)
    if phases:
        parts += ["## Critical path (mean ms per request; the phases add up to TTFT)", "", phases]
    handover = format_handover(results)
    if handover:
        parts += ["## Handover breakdown (median ms per segment; segments can overlap)", "", handover]
    parts += [f"![{name}]({name})" for name in png_names]
    return "\n".join(parts) + "\n"


def machines(results: Sequence[Run]) -> str:
    """The CPU(s) the runs were made on, named as `kvpush env` names them (runs older than that: unknown)."""
    names = sorted({cpu_label(m) if (m := (r.get("environment") or {}).get("machine")) else "not recorded"
                    for r in results})
    return "; ".join(names)


def emulated(results: Sequence[Run]) -> list[str]:
    """A line naming the emulated runs' profiles and validity (bench/emulation.py); none if every run was real.
    Emulated figures are the emulation's, in emulated time: never a measurement of the hardware profiled."""
    reports = [r.get("emulation") for r in results]
    if not any(reports):
        return []
    profiles = sorted({p for e in reports if e for p in e["profiles"]})
    invalid = sum(1 for e in reports if e and not e["valid"])
    real = sum(1 for e in reports if not e)
    return [f"**Emulated** ({', '.join(profiles)}; emulated time, not a measurement of that hardware): "
            f"{len(results) - real} of {len(results)} runs, {invalid} of them invalid (an instance's step lateness "
            f"p99 over {VALID_FRACTION:.0%} of its median step)."]


def compare(run_files: Sequence[str | Path], out_dir: str | Path) -> tuple[Path, list[Path]]:
    """Write ``comparison.md`` and the PNG plots for ``run_files`` into ``out_dir``."""
    if not run_files:
        raise ValueError("no run files to compare")
    results = [load_run(path) for path in run_files]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pngs = plot_all(results, out)
    md_path = out / "comparison.md"
    md_path.write_text(_markdown(results, [p.name for p in pngs]), encoding="utf-8")
    return md_path, pngs
