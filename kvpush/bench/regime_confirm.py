"""Confirming the regime map: the cells where auto's TTFT p50 or p99 came out different from the best
fixed mode's (or, on a `--same-processes` map, the best forced route's) beyond the interval (worse or
better; screens included), run again.

Why: a full-grid cell runs each mode once (12-40 requests) and its interval resamples those requests,
so whatever moved a whole run - the machine's load in that minute (+-15% here from one minute to the
next), a process running slow - reads as a difference between the modes. The confirmation runs each
flagged cell `repeats` more times at the screen's rate, on fresh prompt sets (the repeats after the
screen's), the order of the modes rotating, and recomputes every ratio over the screen's runs and the
new ones pooled. The paired ratios (push/pull, auto against each fixed mode: the same prompts) then
resample runs, then requests within them (the clustered bootstrap), so their interval carries the
drift between runs; with three runs a pooled verdict needs the runs to agree (a resample draws one
run three times about one time in nine). Ratios against routes forced on auto's deployment, which
ran other prompts (unless the map reset the caches before each run, --same-processes), stay unpaired
over the pooled requests. Cells flagged either way are rerun, so
that the confirmation cannot only take verdicts away from one side; the screen's verdicts stay next
to the pooled ones. The confirmation starts its own deployments: auto's cost model starts cold in
the first flagged cell and learns only from the flagged cells, where the screen's auto had the whole
map behind it (a problem that comes from auto's history, as a route abandoned cells earlier, is not
reproduced; the screen's run of the cell is in the pool).

    LOADED (the screen's regime_map.json; its run documents, found by mode and prompt seed) -> FLAGGED
    -> per link: STARTED (every deployment), CALIBRATED (the process check) -> per flagged cell:
    RUN (repeats x every mode) -> POOLED (the summary over the screen's and the new runs) -> STOPPED
    (every process, also on error or Ctrl-C)
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from kvpush.bench import cli as bench_cli
from kvpush.bench.calibrate import calibrate
from kvpush.bench.regime import (
    ROUTES,
    Cell,
    MapConfig,
    cell_runs,
    link_dir,
    open_link,
    paired_forced,
    row_suite,
    run_seed,
    start_fleet,
    summarize,
    write_map,
)
from kvpush.bench.suite import Fleet, SuiteConfig
from kvpush.errors import KVPushError

JUDGED = ("ttft_p50", "ttft_p99")  # auto vs the best fixed mode: the map's target metrics


def flagged(cells: list[dict]) -> list[int]:
    """Indices of the cells whose auto vs best-fixed (or, --same-processes, best forced route) TTFT p50 or
    p99 differs beyond the interval (either way, screens included)."""
    def judged(c: dict, key: str) -> bool:
        return any(isinstance(r := (c.get(group) or {}).get(key), dict) and r.get("verdict") != "cannot tell"
                   for group in ("auto_vs_best", "auto_vs_forced"))

    return [i for i, c in enumerate(cells) if any(judged(c, k) for k in JUDGED)]


def screen_config(doc: dict, **changes: Any) -> MapConfig:
    """The screen's MapConfig (keys it does not know dropped), with `changes`."""
    known = {f.name for f in fields(MapConfig)}
    kept: dict[str, Any] = {k: v for k, v in doc["config"].items() if k in known}
    kept["modes"] = tuple(kept.get("modes", MapConfig.modes))
    return replace(MapConfig(**kept), **changes)


class ConfirmError(KVPushError):
    """The screen cannot be confirmed as it is (its runs are missing or ambiguous, or it is a confirmation)."""


class ScreenRuns:
    """The screen's run documents of one link folder, by (mode, prompt seed). Run files are never
    overwritten, so the folder may also hold runs of maps written there before: a cell's runs are
    told apart by rate and lengths too, and must be exactly as many as the screen's summary counts."""

    def __init__(self, folder: Path) -> None:
        self.docs: dict[tuple[str, int], list[dict]] = {}
        for path in sorted(folder.glob("*.json")):
            doc = json.loads(path.read_text())
            seed = (doc.get("run") or {}).get("sample_seed")
            mode = (doc.get("config") or {}).get("mode")
            if isinstance(seed, int) and isinstance(mode, str):
                self.docs.setdefault((mode, seed), []).append(doc)

    def of_cell(self, cfg: MapConfig, index: int, screen_cell: dict, modes: list[str],
                repeats: int) -> dict[str, list[dict]]:
        """Each mode's runs of the screen's cell `index` (repeats 0 .. repeats - 1). Raises
        ConfirmError when a repeat matches more than one run, or a mode has another number of runs
        than the screen's summary says it ran."""
        out = {}
        for m in modes:
            runs = []
            for rep in range(repeats):
                match = [d for d in self.docs.get((m, run_seed(cfg, index, rep, m)), []) if _of_cell(d, screen_cell)]
                if len(match) > 1:
                    raise ConfirmError(f"{screen_cell['name']}: {len(match)} runs of {m} with the same prompts")
                runs += match
            expected = int((screen_cell["modes"].get(m) or {}).get("runs", 0))
            if len(runs) != expected:
                raise ConfirmError(f"{screen_cell['name']}: found {len(runs)} run(s) of {m} in the screen's "
                                   f"runs folder, its summary counts {expected}")
            out[m] = runs
        return out


def code_change(screen_env: dict, env: dict) -> str:
    """What differs between the code the screen ran and this one (commit, or an uncommitted tree on
    either side); empty when nothing known does."""
    a, b = screen_env.get("git_commit"), env.get("git_commit")
    if a != b:
        return f"the screen ran commit {a}, this runs {b}"
    dirty = [who for who, e in (("the screen's", screen_env), ("this", env)) if e.get("git_dirty")]
    return f"{' and '.join(dirty)} tree had uncommitted changes to {a}" if dirty else ""


def _of_cell(doc: dict, screen_cell: dict) -> bool:
    """Whether a run document has the cell's lengths and rate."""
    cfg, cell = doc.get("config") or {}, screen_cell["cell"]
    rate = cfg.get("request_rate")
    return (cfg.get("input_len"), cfg.get("output_len")) == (cell["input_len"], cell["output_len"]) \
        and isinstance(rate, (int, float)) and math.isclose(rate, float(screen_cell["rate"]), rel_tol=1e-9)


def confirm(screen: Path, repeats: int, result_dir: str, calibrate_first: bool = True, command: str = "") -> Path:
    """Rerun the screen's flagged cells (see the module docstring); writes result_dir/regime_map.json
    (updated after every cell, the pooled summaries with the screen's verdicts under "screen")."""
    doc = json.loads(screen.read_text())
    if doc["config"].get("confirm_of"):
        raise ConfirmError(f"{screen} is a confirmation itself: confirm its screen, {doc['config']['confirm_of']}")
    screen_repeats = int(doc["config"].get("repeats", 1))
    code = code_change(doc.get("environment") or {}, bench_cli.environment())
    if code:
        print(f"regime map --confirm: {code}: the pooled runs may route differently", file=sys.stderr, flush=True)
    cfg = screen_config(doc, repeats=repeats, result_dir=result_dir, calibrate=calibrate_first, command=command,
                        confirm_of=str(screen))
    todo = flagged(doc["cells"])
    out = Path(result_dir) / "regime_map.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    calibration: dict[str, list[dict]] = {}
    started = time.time()

    def save() -> None:
        write_map(out, {**doc["config"], **asdict(cfg)}, started, calibration, results, flagged=todo,
                  screen_environment=doc.get("environment"), code_change=code)

    for link_name in dict.fromkeys(doc["cells"][i]["cell"]["link"] for i in todo):
        cells = [i for i in todo if doc["cells"][i]["cell"]["link"] == link_name]
        found = ScreenRuns(screen.parent / "runs" / link_dir(link_name))
        before = {i: found.of_cell(cfg, i, doc["cells"][i], list(cfg.modes), screen_repeats) for i in cells}
        link = None if link_name == "full" or cfg.link_gbps is None else open_link(cfg.link_gbps)
        try:
            base, fleet, probe = start_fleet(cfg, link_name, link)
            try:
                if cfg.calibrate:
                    calibration[link_name] = calibrate(fleet, probe, cfg.seed)
                    save()
                for i in cells:
                    results.append(_confirm_cell(cfg, doc["cells"][i], i, base, fleet, before[i], screen_repeats))
                    save()
            finally:
                fleet.stop()
        finally:
            if link is not None:
                link.close()
    save()
    return out


def _confirm_cell(cfg: MapConfig, screen_cell: dict, index: int, base: SuiteConfig, fleet: Fleet,
                  before: dict[str, list[dict]], screen_repeats: int) -> dict[str, Any]:
    """The cell's new repeats, summarized with the screen's runs of it (`before`)."""
    cell, rate = Cell(**screen_cell["cell"]), float(screen_cell["rate"])
    runs, routes = cell_runs(cfg, row_suite(base, cell.input_len, cell.output_len), fleet, cell, rate, index,
                             first_rep=screen_repeats)
    pooled = {m: before.get(m, []) + new for m, new in runs.items()}
    moved = {r: routes.get(r, 0.0) + float((screen_cell.get("routes") or {}).get(r, 0.0)) for r in ROUTES}
    summary = summarize(cell, rate, pooled, moved, paired_forced(cfg))
    summary.update(index=index, capacity=screen_cell.get("capacity"),
                   screen={k: screen_cell.get(k) for k in ("modes", "push_vs_pull", "auto_vs_best", "auto_vs_forced",
                                                           "variants", "aa")})
    return summary
