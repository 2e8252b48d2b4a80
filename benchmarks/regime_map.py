"""The regime map (docs/results/regime-map.md): every mode side by side per cell.

    python benchmarks/regime_map.py --quick                 # ~10 min: 512/32, loads 50/80%, no prefix / sessions
    python benchmarks/regime_map.py                         # the full grid (about an hour)
    sudo python benchmarks/regime_map.py --link-gbps 0.5    # and again with P and D over a 0.5 Gbit/s link
    sudo python benchmarks/regime_map.py --quick --link-gbps 0.25 --link-only   # only over the slow link
    python benchmarks/regime_map.py --mixed --result-dir kvpush-results/auto_mixed   # auto's target workload
    python benchmarks/regime_map.py --report-only --doc docs/results/regime-map.md   # regenerate its doc section
    python benchmarks/regime_map.py --seed-grid --emulate qwen3-32b-h200-tp8 --time-scale 40 --modes push pull \
        --serve-args "--kv-cache-memory-mb 2048" --rows 1024/64   # the seed's proportions, emulated (issue 37)
    python benchmarks/regime_map.py --confirm kvpush-results/regime_map --result-dir kvpush-results/confirm
        # rerun the cells where auto vs the best fixed mode had a verdict, 2 more runs each, pooled
    python benchmarks/regime_map.py --mixed --auto-variant 'w1=--auto-stall-weight 1'
        # auto's settings side by side: auto+w1 is a deployment of its own on the same prompts
    python benchmarks/regime_map.py --rows 128/256 --same-processes --repeats 2 --twin auto@push auto
        # and an A/A check of the intervals: auto@push#2 and auto#2 rerun their modes on the same prompts

Modes: colocated, pull, push, push-layerwise and auto (one deployment each, all up together; P and D
pinned to separate halves of the cores), and auto+NAME per --auto-variant (auto with other flags). Grid: prompt length x output length x load (a fraction of
the slower of push and pull at full concurrency, measured per length pair) x prefix (fresh prompts,
or multi-turn sessions whose earlier turns D already holds) [x link]. Per cell every mode runs on
the same prompts, --repeats times (quick and mixed: 2, full: 1) with the order of the modes
rotating, requests pooled. Writes regime_map.json (updated after every cell), regime_map.md and
regime_map.png under --result-dir.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from kvpush.argtypes import positive_int
from kvpush.bench.demo import ensure_model
from kvpush.bench.regime import (
    FORCED,
    GRIDS,
    MODES,
    MapConfig,
    check_modes,
    row_names,
    run_map,
    same_processes_modes,
)
from kvpush.bench.regime_confirm import ConfirmError, confirm
from kvpush.bench.regime_report import report
from kvpush.bench.suite import split_variant_flags
from kvpush.config import default_model_dir


def parse_variants(ap: argparse.ArgumentParser, specs: list[str]) -> dict[str, list[str]]:
    """--auto-variant NAME=FLAGS -> {NAME: [flags]}; a name is letters, digits, '-' or '_', the flags the
    proxy's --auto-* ones or the instances' scheduler flags (checked here, not when a process would exit
    at start)."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        name, sep, flags = spec.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_-]+", name) or name in out:
            ap.error(f"--auto-variant {spec!r}: expected NAME=FLAGS with a new NAME of letters, digits, - or _")
        try:
            split_variant_flags(shlex.split(flags))
        except ValueError as exc:
            ap.error(f"--auto-variant {spec!r}: {exc}")
        out[name] = shlex.split(flags)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, made if missing)")
    ap.add_argument("--quick", action="store_true", help="the ~10-minute subset")
    ap.add_argument("--mixed", action="store_true", help="one cell: auto's mixed workload at 70%% of capacity")
    ap.add_argument("--seed-grid", action="store_true",
                    help="the seed's proportions (issue 37; needs --emulate): 1k/4k/16k in, 64 out, loads 25-90%%, "
                         "fresh prompts, prompts D already holds (\"held\") or both P and D hold (\"held-both\")")
    ap.add_argument("--emulate", default="", metavar="PROFILE",
                    help="every instance emulated with this profile, e.g. qwen3-32b-h200-tp8 (kvpush serve --emulate; "
                         "default: none, real instances)")
    ap.add_argument("--time-scale", type=float, default=1.0,
                    help="with --emulate: kvpush serve --time-scale (default 1); the report gives emulated time")
    ap.add_argument("--first-token", choices=["from-prefill", "recompute"], default=None,
                    help="every proxy's --first-token (default: the proxy's own, from-prefill; the seed grid: "
                         "recompute, as vLLM's decode does, so that a D holding the prompt need not wait for P)")
    ap.add_argument("--serve-args", default="",
                    help="extra `kvpush serve` flags of every instance, e.g. \"--kv-cache-memory-mb 4096\" "
                         "(default: none beyond --torch-threads 1)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=[*MODES, *FORCED],
                    help=f"deployments to run side by side (default: {' '.join(MODES)})")
    ap.add_argument("--forced-routes", action="store_true",
                    help="also run each fixed route forced on the auto deployment (auto@push, ...): auto vs the "
                         "best of them compares routing on the same processes")
    ap.add_argument("--same-processes", action="store_true",
                    help="run the fixed modes as routes forced on the auto deployment (auto@push, ...) on the same "
                         "prompts as auto, every prefix cache reset before each run: auto against the routes "
                         "without the speed differences between deployments' processes")
    ap.add_argument("--twin", nargs="+", default=[], metavar="MODE",
                    help="with --same-processes: also run MODE a second time per repeat as mode MODE#2, on the same "
                         "prompts and processes (e.g. auto@push): MODE#2 against MODE is an A/A check of the map's "
                         "intervals, which should find a difference beyond the interval ~5%% of the time")
    ap.add_argument("--link-gbps", type=float, default=None, help="also map over a rate-limited link (root)")
    ap.add_argument("--link-only", action="store_true", help="with --link-gbps: only over the rate-limited link")
    ap.add_argument("--rows", nargs="+", default=[], metavar="IN/OUT",
                    help="only these rows of the grid (prompt/output length, e.g. 2048/256; default: all of the grid's)")
    ap.add_argument("--loads", nargs="+", type=float, default=[], metavar="FRACTION",
                    help="only these loads of the grid (fractions of capacity, e.g. 0.8; default: all of the grid's)")
    ap.add_argument("--prefixes", nargs="+", default=[], metavar="PREFIX",
                    help="only these prefixes of the grid (none, sessions; the seed grid: none, held, held-both; "
                         "default: all of the grid's)")
    ap.add_argument("--run-s", type=float, default=None, help="seconds of load per mode and cell")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs per mode and cell, the order rotating, pooled (default: 2; full grid 1)")
    ap.add_argument("--min-prompts", type=int, default=None)
    ap.add_argument("--max-prompts", type=int, default=None)
    ap.add_argument("--capacity-prompts", type=positive_int, default=MapConfig.capacity_prompts,
                    help="requests sent at once to measure a row's capacity (default: %(default)s; fewer where D "
                         "cannot hold that many prompts' KV at once, e.g. 16k-token prompts)")
    ap.add_argument("--result-dir", default="kvpush-results/regime_map")
    ap.add_argument("--no-pin", action="store_true")
    ap.add_argument("--no-calibrate", action="store_true",
                    help="skip the probe that restarts a deployment started on a slow process (kvpush/bench/calibrate.py)")
    ap.add_argument("--auto-proxy-args", default="", help="extra `kvpush proxy` flags of the auto deployment, "
                                                          "e.g. \"--auto-stall-weight 2\" (one flag alone: --auto-proxy-args=--flag=value)")
    ap.add_argument("--auto-variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also run auto with other --auto-* proxy flags (after --auto-proxy-args, so they override "
                         "them) or other scheduler flags of its instances (--prefill-join-tokens, --max-num-batched-"
                         "tokens, ...) as mode auto+NAME, a deployment of its own on the same prompts, e.g. "
                         "--auto-variant 'w1=--auto-stall-weight 1' (repeatable)")
    ap.add_argument("--confirm", type=Path, default=None, metavar="SCREEN",
                    help="rerun the cells of this map (its result dir or regime_map.json) where auto's TTFT p50 "
                         "or p99 differed from the best fixed mode's (or best forced route's) beyond the interval, --repeats times (default "
                         "2) per mode at the same rate, the verdicts recomputed over its runs and these pooled "
                         "(the screen's settings apply: only --repeats, --result-dir and --no-calibrate are used)")
    ap.add_argument("--report-only", action="store_true", help="only regenerate the report from the JSON")
    ap.add_argument("--doc", "--readme", type=Path, default=None, dest="doc",
                    help="also rewrite this Markdown file's generated section, e.g. docs/results/regime-map.md "
                         "(--readme: the old name; default: none)")
    args = ap.parse_args()
    grid = "seed" if args.seed_grid else "mixed" if args.mixed else "quick" if args.quick else "full"
    if args.seed_grid and not args.emulate:
        ap.error("--seed-grid needs --emulate (e.g. --emulate qwen3-32b-h200-tp8 --time-scale 40)")
    if not args.time_scale > 0:
        ap.error("--time-scale must be positive")
    if args.time_scale != 1.0 and not args.emulate:
        ap.error("--time-scale needs --emulate (it stretches an emulated clock)")
    assert grid in GRIDS
    rows = row_names(grid)
    if any(r not in rows for r in args.rows):
        ap.error(f"--rows: the {grid} grid's rows are {' '.join(rows)}")
    if any(x not in GRIDS[grid]["loads"] for x in args.loads):
        ap.error(f"--loads: the {grid} grid's loads are {' '.join(map(str, GRIDS[grid]['loads']))}")
    if any(x not in GRIDS[grid]["prefixes"] for x in args.prefixes):
        ap.error(f"--prefixes: the {grid} grid's prefixes are {' '.join(GRIDS[grid]['prefixes'])}")
    if args.link_only and args.link_gbps is None:
        ap.error("--link-only needs --link-gbps")
    if args.link_gbps is not None and not args.link_gbps > 0:
        ap.error("--link-gbps must be positive")
    variants = parse_variants(ap, args.auto_variant)
    if (variants or args.twin) and args.confirm is not None:
        ap.error("--auto-variant/--twin and --confirm: a confirmation runs the screen's modes, variants and twins "
                 "included")
    path = Path(args.result_dir) / "regime_map.json"
    command = shlex.join(["python", "benchmarks/regime_map.py", *sys.argv[1:]])
    if args.confirm is not None and not args.report_only:
        screen = args.confirm / "regime_map.json" if args.confirm.is_dir() else args.confirm
        if not screen.is_file():
            ap.error(f"--confirm: no regime map at {screen}")
        if screen.resolve() == path.resolve():
            ap.error("--confirm writes its own map: give it another --result-dir than the screen's")
        if args.repeats is not None and not 1 <= args.repeats <= 50:
            ap.error("--repeats must be 1-50")
        try:
            path = confirm(screen, args.repeats or 2, args.result_dir, not args.no_calibrate, command)
        except ConfirmError as exc:
            ap.error(f"--confirm: {exc}")
    elif not args.report_only:
        model = args.model or ensure_model(default_model_dir(), "bench")
        defaults = MapConfig(model=model)
        run_s, max_prompts = {"quick": (8.0, 40), "mixed": (30.0, 120)}.get(grid, (defaults.run_s,
                                                                                 defaults.max_prompts))
        first_token = args.first_token or ("recompute" if grid == "seed" else None)
        modes = tuple(args.modes) + (FORCED if args.forced_routes and "auto" in args.modes else ())
        if args.same_processes:
            modes = same_processes_modes(modes)
        modes += tuple(f"auto+{name}" for name in variants) + tuple(f"{m}#2" for m in args.twin)
        cfg = MapConfig(model=model, grid=grid, modes=tuple(dict.fromkeys(modes)), link_gbps=args.link_gbps,
                        full_link=not args.link_only,
                        run_s=args.run_s or run_s, min_prompts=args.min_prompts or defaults.min_prompts,
                        max_prompts=args.max_prompts or max_prompts, capacity_prompts=args.capacity_prompts,
                        result_dir=args.result_dir, pin=not args.no_pin, auto_proxy_args=shlex.split(args.auto_proxy_args),
                        auto_variants=variants, calibrate=not args.no_calibrate,
                        repeats=args.repeats or (1 if grid == "full" else 2), rows=tuple(args.rows),
                        loads=tuple(args.loads), prefixes=tuple(args.prefixes), reset_caches=args.same_processes,
                        command=command, emulate=args.emulate, time_scale=args.time_scale,
                        proxy_args=["--first-token", first_token] if first_token else [],
                        serve_args=[*defaults.serve_args, *shlex.split(args.serve_args)])
        try:
            check_modes(cfg)
        except ValueError as exc:
            hint = " (with --same-processes the routes are auto@push, auto@pull, ...)" if args.same_processes else ""
            ap.error(f"--twin: {exc}{hint}")
        path = run_map(cfg)
    print(report(path, args.doc, _image_path(args.doc)))


def _image_path(doc: Path | None) -> Path | None:
    """docs/img/regime_map.png as the doc links it (relative to the doc's folder)."""
    if doc is None:
        return None
    return Path(os.path.relpath(Path("docs/img/regime_map.png").resolve(), doc.resolve().parent))


if __name__ == "__main__":
    main()
