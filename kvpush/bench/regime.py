"""The regime map: where push beats pull, where it loses, and whether auto keeps up with the best.

    STARTING (one deployment per mode: colocated, pull, push, push-layerwise, auto; on a rate-limited
       link too with --link-gbps) -> per link and (prompt length, output length): CALIBRATED (every
       deployment probed; one running on a slow process restarted, bench/calibrate.py), CAPACITY (the slower
       of push and pull, every request at once) -> per (load fraction, prefix) cell: every mode in
       rotating order on the same prompts at load x capacity -> SUMMARY (percentiles and ratios with
       95% bootstrap intervals per cell) -> STOPPED (every process, also on error or Ctrl-C)

Prefix "none" draws fresh random prompts; "sessions" sends multi-turn sessions (each turn extends
the previous one, so D - or a colocated server - already holds most of the prompt); "mixed" a third
each of short (length / 4), long (length x 2) and session prompts; "held" serves the run's prompts once
first and resets P's prefix cache, so D holds every prompt and P none; "held-both" keeps P's, so both
hold it (hold_on_decode). A run lasts
about `run_s` seconds (at least `min_prompts`, at most `max_prompts` requests). Ratios whose interval
spans 1.0 are "cannot tell"; a ratio beyond 1.0 on fewer runs a side than MIN_RUNS (or unpaired) is a
"screen": reported, not counted as a verdict.
"""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvpush.bench import cli as bench_cli
from kvpush.bench.calibrate import CalibrationConfig, calibrate
from kvpush.bench.emulation import emulated_serve_args
from kvpush.bench.modes import base, is_twin, parse, variant_name
from kvpush.bench.regime_cells import emulation_summary, hold_on_decode
from kvpush.bench.report import mode_ratio_ci_paired, request_values
from kvpush.bench.stats import Stat, fmt_ci, p50, p99, verdict
from kvpush.bench.suite import (
    Fleet,
    SuiteConfig,
    bench_args,
    measure_capacity,
    reset_prefix_caches,
)

MODES = ("colocated", "pull", "push", "push-layerwise", "auto")
FIXED = ("pull", "push", "push-layerwise")
# Each fixed route forced on the auto deployment itself (X-KVPush-KV-Mode): auto against them compares
# routing on the same processes, without the variance between deployments that auto vs FIXED carries.
# They run their own prompt sets (one deployment's prefix caches would serve repeated prompts), so
# auto vs forced is an unpaired comparison.
FORCED = tuple(f"auto@{m}" for m in FIXED)
ROUTES = ("push", "push-layerwise", "pull", "local")
GRIDS: dict[str, dict[str, tuple]] = {
    "full": {"input_lens": (128, 512, 2048), "output_lens": (32, 256), "loads": (0.25, 0.5, 0.8),
             "prefixes": ("none", "sessions")},
    "quick": {"input_lens": (512,), "output_lens": (32,), "loads": (0.5, 0.8), "prefixes": ("none", "sessions")},
    # auto's target workload: short and long prompts and multi-turn sessions at ~70% of capacity
    "mixed": {"input_lens": (512,), "output_lens": (32,), "loads": (0.7,), "prefixes": ("mixed",)},
    # the seed's proportions (issue 37): an emulated Qwen3-32B rank; fresh prompts, or prompts D already holds
    "seed": {"input_lens": (1024, 4096, 16384), "output_lens": (64,), "loads": (0.25, 0.5, 0.75, 0.9),
             "prefixes": ("none", "held", "held-both")},
}


@dataclass
class MapConfig:
    model: str
    grid: str = "quick"
    modes: tuple[str, ...] = MODES
    link_gbps: float | None = None  # also map P and D over a rate-limited link (root)
    full_link: bool = True  # also (or, with a link_gbps, only) the grid at full loopback speed
    run_s: float = 20.0
    min_prompts: int = 12
    max_prompts: int = 40
    capacity_prompts: int = 16
    repeats: int = 1  # per cell: every mode this many times, the order rotating, requests pooled
    turns: int = 4
    turn_len: int = 64
    seed: int = 0
    pin: bool = True
    result_dir: str = "kvpush-results/regime_map"
    command: str = ""  # how the map was run (shown in the report)
    serve_args: list[str] = field(default_factory=lambda: ["--torch-threads", "1"])
    auto_proxy_args: list[str] = field(default_factory=list)  # e.g. ["--auto-stall-weight", "2"]
    # auto+NAME modes, each its own deployment whose proxy gets these flags: routing settings compared
    # side by side on the same prompts (e.g. {"w1": ["--auto-stall-weight", "1"]}; after auto_proxy_args)
    auto_variants: dict[str, list[str]] = field(default_factory=dict)
    calibrate: bool = True  # probe every deployment first and restart a slow process (bench/calibrate.py)
    confirm_of: str = ""  # a confirmation run (bench/regime_confirm.py): the screen's regime_map.json
    rows: tuple[str, ...] = ()  # only these rows of the grid ("2048/256"); empty: every row
    loads: tuple[float, ...] = ()  # only these loads of the grid (0.8); empty: every load
    prefixes: tuple[str, ...] = ()  # only these prefixes of the grid ("none"); empty: every prefix
    # every endpoint's prefix caches reset before each run (POST /reset_prefix_cache): routes forced on
    # the auto deployment then run the fixed modes' prompts, paired (see same_processes_modes)
    reset_caches: bool = False
    proxy_args: list[str] = field(default_factory=list)  # every deployment's proxy (e.g. --first-token recompute)
    emulate: str = ""  # every instance emulated with this profile (kvpush serve --emulate); "" for real ones
    time_scale: float = 1.0  # with emulate: kvpush serve --time-scale


@dataclass(frozen=True)
class Cell:
    link: str
    input_len: int
    output_len: int
    load: float
    prefix: str

    @property
    def name(self) -> str:
        return f"{self.link} {self.input_len}/{self.output_len} {self.load:.0%} {self.prefix}"


def num_prompts(cfg: MapConfig, rate: float) -> int:
    return max(cfg.min_prompts, min(cfg.max_prompts, round(rate * cfg.run_s)))


def _routes(url: str) -> dict[str, float]:
    """The auto proxy's route counters (kvpush_proxy_kv_mode_chosen_total)."""
    out = dict.fromkeys(ROUTES, 0.0)
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvpush_proxy_kv_mode_chosen_total{"):
                route = line.split('route="', 1)[1].split('"', 1)[0]
                out[route] = float(line.rsplit(" ", 1)[1])
    return out


def run_cell(cfg: MapConfig, suite: SuiteConfig, fleet: Fleet, cell: Cell, rate: float, index: int) -> dict[str, Any]:
    """Every mode on the same prompts at `rate`, cfg.repeats times; requests pooled per mode."""
    return summarize(cell, rate, *cell_runs(cfg, suite, fleet, cell, rate, index), paired_forced=paired_forced(cfg))


def paired_forced(cfg: MapConfig) -> tuple[str, ...]:
    """The forced routes of the map that ran the fixed modes' prompts (run_seed): compared with them."""
    return tuple(m for m in FORCED if m in cfg.modes and (cfg.reset_caches or not shares_auto_deployment(cfg.modes, m)))


def run_seed(cfg: MapConfig, index: int, rep: int, mode: str) -> int:
    """The prompt set (and arrival times) of the cell's `index`-th position, repeat `rep`, for `mode`."""
    seed = cfg.seed + 1000 * index + rep
    if base(mode) in FORCED and shares_auto_deployment(cfg.modes, mode) and not cfg.reset_caches:
        seed += 100 * (1 + FORCED.index(base(mode)))  # auto's deployment would serve repeated prompts from its caches
    return seed


def same_processes_modes(modes: tuple[str, ...]) -> tuple[str, ...]:
    """`--same-processes`: each fixed mode runs as its route forced on the auto deployment (auto@X), next
    to auto itself (and colocated, its own server): every route on the same P and D processes, so that
    no deployment's process speed (5-10% apart between processes of the same code) enters auto against
    the routes. With reset_caches, on the same prompts."""
    out = [m for m in modes if m == "colocated"] + ["auto"]
    return tuple(out + [f"auto@{m}" for m in FIXED if m in modes or f"auto@{m}" in modes])


def shares_auto_deployment(modes: tuple[str, ...], mode: str) -> bool:
    """Whether another of `modes` runs on the auto deployment that forced `mode` runs on. If none does,
    the forced route gets the fixed modes' prompts: auto@push vs push is then paired, and measures
    what an all-modes deployment costs a route against the deployment of that route alone."""
    return any(m != mode and parse(m).deployment == "auto" for m in modes)


def cell_runs(cfg: MapConfig, suite: SuiteConfig, fleet: Fleet, cell: Cell, rate: float, index: int,
              first_rep: int = 0) -> tuple[dict[str, list[dict]], dict[str, float]]:
    """Repeats first_rep .. first_rep + cfg.repeats - 1 of the cell: every mode on the same prompts, in
    an order that rotates from repeat to repeat and cell to cell (each repeat draws fresh prompts).
    Returns each mode's run documents and the routes auto's proxy chose meanwhile."""
    modes = [m for m in cfg.modes if m in fleet.urls]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    routes = dict.fromkeys(ROUTES, 0.0)
    for rep in range(first_rep, first_rep + cfg.repeats):
        k = (index + rep) % len(modes)
        for mode in modes[k:] + modes[:k]:
            doc, moved = _run_mode(cfg, suite, fleet, cell, rate, mode, run_seed(cfg, index, rep, mode))
            runs[mode].append(doc)
            for r, n in moved.items():
                routes[r] += n
    return runs, routes


def _run_mode(cfg: MapConfig, suite: SuiteConfig, fleet: Fleet, cell: Cell, rate: float, mode: str,
              seed: int) -> tuple[dict, dict[str, float]]:
    """One mode's run; for auto also the routes its proxy chose meanwhile."""
    args = bench_args(suite, fleet.urls[mode], mode, rate, seed)
    args.num_prompts = num_prompts(cfg, rate)
    args.result_dir = os.path.join(cfg.result_dir, "runs", link_dir(cell.link))
    if cell.prefix in ("sessions", "mixed"):
        args.dataset, args.session_turns, args.turn_len = cell.prefix, cfg.turns, cfg.turn_len
    if cfg.reset_caches:
        reset_prefix_caches(fleet.urls[mode])
    if cell.prefix in ("held", "held-both"):
        hold_on_decode(fleet, mode, args, rate, cfg.model, keep_on_prefill=cell.prefix == "held-both")
    before = _routes(fleet.urls[mode]) if mode == "auto" else None  # a variant's: from its requests (summarize)
    doc, _ = bench_cli._one_run(args, 0, rate, cfg.model)
    after = _routes(fleet.urls[mode]) if before is not None else None
    return doc, ({r: after[r] - before[r] for r in ROUTES} if after and before else {})


def _pct(values: list[float], stat: Stat) -> float | None:
    return float(stat(np.asarray(values))) if values else None


def _ratio(a: list[dict], b: list[dict], metric: str, stat: Stat, a_name: str, b_name: str) -> dict[str, Any] | None:
    found = mode_ratio_ci_paired(a, b, metric, stat)
    if found is None:
        return None
    (est, lo, hi), paired = found  # "runs": 1 = an interval over one run's requests, which an A/A check finds
    return {"ratio": est, "lo": lo, "hi": hi, "verdict": verdict(lo, hi, a_name, b_name),  # overconfident
            "text": fmt_ci(est, lo, hi), "runs": min(len(a), len(b)), "paired": paired}


def summarize(cell: Cell, rate: float, runs: dict[str, list[dict]], routes: dict[str, float],
              paired_forced: tuple[str, ...] = ()) -> dict[str, Any]:
    """Per mode (requests of its runs pooled): requests, failures, TTFT p50/p99, TPOT p50 (ms);
    push/pull, auto/best-fixed and auto/each-fixed ratios; per auto variant (auto+NAME) its ratios to
    auto and to each fixed mode, and the routes its measured requests took."""
    runs = {m: docs for m, docs in runs.items() if docs}
    emulation = emulation_summary(runs)
    scale = 1.0 / emulation["time_scale"] if emulation else 1.0  # emulated runs: ms of emulated time
    ttft = {m: [v * scale for v in request_values(docs, "ttft")] for m, docs in runs.items()}
    tpot = {m: [v * scale for v in request_values(docs, "tpot")] for m, docs in runs.items()}
    modes = {m: {"runs": len(docs), "completed": sum(int(d["metrics"].get("completed", 0)) for d in docs),
                 "failed": sum(int(d["metrics"].get("failed", 0)) for d in docs),
                 "ttft_p50_ms": _pct(ttft[m], p50), "ttft_p99_ms": _pct(ttft[m], p99),
                 "tpot_p50_ms": _pct(tpot[m], p50)} for m, docs in runs.items()}
    out: dict[str, Any] = {"cell": asdict(cell), "name": cell.name, "rate": rate, "modes": modes, "routes": routes}
    if emulation:
        out["emulation"] = emulation
    if "push" in runs and "pull" in runs:
        out["push_vs_pull"] = _compare(runs, "push", "pull")
    elif "auto@push" in runs and "auto@pull" in runs:  # --same-processes: the routes on auto's processes
        out["push_vs_pull"] = {k: r and {**r, "verdict": r["verdict"].replace("auto@", "")}
                               for k, r in _compare(runs, "auto@push", "auto@pull").items()}
    fixed = [m for m in FIXED if m in runs and modes[m]["ttft_p50_ms"] is not None]
    if "auto" in runs and fixed:
        best = _fastest(fixed, modes)
        out["auto_vs_best"] = {"best": best, **_compare(runs, "auto", best)}
        out["auto_vs_each"] = {m: _compare(runs, "auto", m) for m in fixed}
    forced = [m for m in FORCED if m in runs and modes[m]["ttft_p50_ms"] is not None]
    if "auto" in runs and forced:
        best = _fastest(forced, modes)
        out["auto_vs_forced"] = {"best": best, **_compare(runs, "auto", best)}
        if not fixed:  # --same-processes: the routes stand for the fixed modes (the mixed target's "each")
            out["auto_vs_each"] = {m: _compare(runs, "auto", m) for m in forced}
    if pairs := [m for m in forced if m in paired_forced and parse(m).route in runs]:  # the deployment's cost
        out["forced_vs_fixed"] = {m: _compare(runs, m, str(parse(m).route)) for m in pairs}
    if twins := [m for m in runs if is_twin(m) and base(m) in runs]:  # A/A: a mode against itself
        out["aa"] = {m: {**_compare(runs, m, base(m)), "routes": routes_taken(runs[m])} for m in twins}
    variants = [m for m in runs if variant_name(m) is not None and parse(m).own_deployment]
    if variants:
        out["variants"] = {v: {"routes": routes_taken(runs[v]),
                               "vs_auto": _compare(runs, v, "auto") if "auto" in runs else None,
                               "vs_each": {m: _compare(runs, v, m) for m in fixed}} for v in variants}
    return out


def routes_taken(docs: list[dict]) -> dict[str, float]:
    """How many of these runs' requests took each route (their answers' kvpush_route)."""
    out = dict.fromkeys(ROUTES, 0.0)
    for doc in docs:
        for r in doc.get("requests") or ():
            route = (r.get("kvpush_route") or {}).get("route")
            if route in out:
                out[route] += 1
    return out


# Runs a side a paired verdict needs to be more than a screen. The A/A check of kvpush-results/aa17 (twins on
# the same prompts and processes, paired intervals; ad hoc subsets of its 3 runs): beyond the 95% interval with
# 1 run a side TTFT p50 13%, p99 37%, TPOT p50 43%; with 2 runs 6%, 15%, 19%; with 3 runs 0, 6, 11% (of 18).
# Checked on one deployment's processes only: modes on separate deployments add the 5-10% between processes
# (benchmarks/process_speed.py), which more runs of the same processes do not average out. An unpaired
# interval (prompt sets that differ) resamples requests only, whatever the runs: always a screen.
MIN_RUNS = {"ttft_p50": 2, "ttft_p99": 3, "tpot_p50": 3}


def _compare(runs: dict[str, list[dict]], a: str, b: str) -> dict[str, dict[str, Any] | None]:
    """a/b ratios of TTFT p50, TTFT p99 and TPOT p50, each with its interval and verdict; "screen" where
    the verdict rests on fewer runs a side than MIN_RUNS asks (it says where to look, not what holds)."""
    out = {"ttft_p50": _ratio(runs[a], runs[b], "ttft", p50, a, b),
           "ttft_p99": _ratio(runs[a], runs[b], "ttft", p99, a, b),
           "tpot_p50": _ratio(runs[a], runs[b], "tpot", p50, a, b)}
    for key, r in out.items():
        if r is not None:
            r["screen"] = r["runs"] < MIN_RUNS[key] or not r["paired"]
    return out


def _fastest(candidates: list[str], modes: dict[str, dict]) -> str:
    """The mode with the lowest TTFT p50."""
    return min(candidates, key=lambda m: float(modes[m]["ttft_p50_ms"] or 0.0))


def row_names(grid: str) -> list[str]:
    """A grid's rows as "IN/OUT" (prompt length / output length), in order."""
    return [f"{i}/{o}" for i in GRIDS[grid]["input_lens"] for o in GRIDS[grid]["output_lens"]]


def grid_rows(cfg: MapConfig) -> list[tuple[int, int]]:
    """The grid's (prompt length, output length) rows, in order; only cfg.rows where given."""
    names = [r for r in row_names(cfg.grid) if not cfg.rows or r in cfg.rows]
    return [(int(i), int(o)) for i, o in (r.split("/") for r in names)]


def cells_for(cfg: MapConfig, link: str, input_len: int, output_len: int) -> list[Cell]:
    grid = GRIDS[cfg.grid]
    return [Cell(link, input_len, output_len, load, prefix) for load in grid["loads"] for prefix in grid["prefixes"]
            if (not cfg.loads or load in cfg.loads) and (not cfg.prefixes or prefix in cfg.prefixes)]


def start_fleet(cfg: MapConfig, link_name: str, link: Any) -> tuple[SuiteConfig, Fleet, CalibrationConfig]:
    """Every deployment of cfg.modes up (over `link`, or none), logs under result_dir/logs/<link>; with
    the suite settings they share and the process check's probe."""
    base = SuiteConfig(model=cfg.model, modes=cfg.modes, serve_args=[*emulated_args(cfg), *cfg.serve_args], pin=cfg.pin,
                       auto_proxy_args=cfg.auto_proxy_args, auto_variants=cfg.auto_variants, proxy_args=cfg.proxy_args,
                       capacity_prompts=cfg.capacity_prompts, result_dir=cfg.result_dir, seed=cfg.seed)
    log_dir = os.path.join(cfg.result_dir, "logs", link_dir(link_name))
    os.makedirs(log_dir, exist_ok=True)
    fleet = Fleet(base, log_dir, link).start()
    probe = CalibrationConfig.for_prompts(cfg.model, GRIDS[cfg.grid]["input_lens"][0], base.vocab_size)
    return base, fleet, probe


def emulated_args(cfg: MapConfig) -> list[str]:
    """`kvpush serve` flags of the map's emulated instances (none for real ones); cfg.serve_args come after
    these and override them."""
    return emulated_serve_args(cfg.emulate, cfg.time_scale) if cfg.emulate else []


def row_suite(base: SuiteConfig, input_len: int, output_len: int) -> SuiteConfig:
    return SuiteConfig(**{**base.__dict__, "input_len": input_len, "output_len": output_len})


def link_dir(link_name: str) -> str:
    """The folder a link's runs and logs go to ("full", "0.25Gbit_s")."""
    return link_name.replace(" ", "").replace("/", "_")


def map_link(cfg: MapConfig, link_name: str, link: Any, results: list[dict], save: Callable[[], None],
             calibration: dict[str, list[dict]]) -> None:
    """Start the fleet (over `link`, or none), check its processes (calibration), then every cell of the
    grid on it."""
    base, fleet, probe = start_fleet(cfg, link_name, link)
    try:
        for input_len, output_len in grid_rows(cfg):
            if cfg.calibrate:  # a process can also turn slow while it serves: checked again every row
                calibration[f"{link_name} {input_len}/{output_len}"] = calibrate(fleet, probe, cfg.seed)
                save()
            suite = row_suite(base, input_len, output_len)
            capacity = measure_capacity(suite, fleet, reset_caches=cfg.reset_caches)
            print(f"[{link_name} {input_len}/{output_len}] capacity {capacity:.3f} req/s", flush=True)
            for cell in cells_for(cfg, link_name, input_len, output_len):
                rate = round(cell.load * capacity, 4)
                summary = run_cell(cfg, suite, fleet, cell, rate, len(results))
                summary["capacity"] = capacity
                results.append(summary)
                save()
    finally:
        fleet.stop()


def open_link(gbps: float) -> Any:
    """P and D's rate-limited link (root only); the caller closes it."""
    from kvpush.launcher.netlink import LinkConfig, RateLimitedLink, require_root

    require_root()
    return RateLimitedLink(LinkConfig(gbps=gbps)).start()


def write_map(path: Path, config: dict, started: float, calibration: dict, cells: list[dict], **extra: Any) -> None:
    """A map's regime_map.json as it stands (rewritten after every cell)."""
    doc = {"config": config, "environment": bench_cli.environment(), "elapsed_s": time.time() - started,
           **extra, "calibration": calibration, "cells": cells}
    path.write_text(json.dumps(doc, indent=1))


def check_modes(cfg: MapConfig) -> None:
    """Raise ValueError for modes the map cannot run: a name of none of bench/modes.py's forms, or a twin
    (M#N) whose M is not in the map or whose runs would not start from empty prefix caches (a twin runs
    M's prompts on M's processes: without reset_caches it would be served from M's caches)."""
    for mode in cfg.modes:
        name = parse(mode)
        if name.twin and name.base not in cfg.modes:
            raise ValueError(f"twin {mode}: {name.base} is not one of the map's modes")
        if name.twin and not cfg.reset_caches:
            raise ValueError(f"twin {mode}: needs every prefix cache reset before each run (--same-processes)")


def run_map(cfg: MapConfig) -> Path:
    """Run the map; writes (and keeps updating) regime_map.json; returns its path."""
    check_modes(cfg)
    Path(cfg.result_dir).mkdir(parents=True, exist_ok=True)
    path = Path(cfg.result_dir) / "regime_map.json"
    results: list[dict] = []
    calibration: dict[str, list[dict]] = {}
    started = time.time()

    def save() -> None:  # instance_flags: every instance's extra `kvpush serve` flags, as started
        write_map(path, asdict(cfg), started, calibration, results,
                  instance_flags=[*emulated_args(cfg), *cfg.serve_args])

    if cfg.full_link or cfg.link_gbps is None:
        map_link(cfg, "full", None, results, save, calibration)
    if cfg.link_gbps is not None:
        link = open_link(cfg.link_gbps)
        try:
            map_link(cfg, f"{cfg.link_gbps:g} Gbit/s", link, results, save, calibration)
        finally:
            link.close()
    save()
    return path
