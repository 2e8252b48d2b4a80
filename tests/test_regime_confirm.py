"""The regime map's confirmation pass on synthetic runs: which cells it reruns, how it finds the screen's
runs of a cell, that it pools them with its own (runs resampled, so the drift between runs widens the
interval), and its report section. The deployments are stand-ins: what runs there is the map's own
code (tests/test_calibrate.py and the map's runs exercise real fleets)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvpush.bench import regime_confirm
from kvpush.bench.regime import FIXED, Cell, MapConfig, run_seed, summarize
from kvpush.bench.regime_confirm import ConfirmError, ScreenRuns, confirm, flagged
from kvpush.bench.regime_report import report
from kvpush.bench.suite import SuiteConfig

CELL = Cell("full", 512, 32, 0.5, "none")
MODES = ("pull", "push", "push-layerwise", "auto")


def run_doc(mode: str, seed: int, ttfts_ms: list[float], rate: float = 1.5) -> dict:
    """A run document as bench/cli.py writes it: its mode, rate, prompt seed and workload, its requests."""
    reqs = [{"index": i, "success": True, "ttft_s": t / 1e3, "e2el_s": t / 1e3 + 0.08, "output_tokens": 9}
            for i, t in enumerate(ttfts_ms)]
    return {"config": {"mode": mode, "dataset": "random", "input_len": CELL.input_len, "output_len": CELL.output_len,
                       "request_rate": rate},
            "run": {"sample_seed": seed}, "metrics": {"completed": len(reqs), "failed": 0}, "requests": reqs}


def screen_cell(modes: tuple[str, ...], runs: int = 1) -> dict:
    """What the screen's summary says of CELL: its rate and each mode's number of runs."""
    return {"name": CELL.name, "cell": asdict(CELL), "rate": 1.5, "modes": {m: {"runs": runs} for m in modes}}


def ttfts(center: float, n: int = 30) -> list[float]:
    return [center * (0.95 + 0.1 * ((i * 7) % n) / n) for i in range(n)]


def verdicts(p50: str, p99: str = "cannot tell") -> dict:
    return {"auto_vs_best": {"best": "push", "ttft_p50": {"ratio": 1.1, "lo": 1.05, "hi": 1.2, "verdict": p50},
                             "ttft_p99": {"ratio": 1.0, "lo": 0.9, "hi": 1.1, "verdict": p99}}}


def test_cells_with_a_verdict_either_way_are_rerun():
    cells = [verdicts("cannot tell"), verdicts("push better"), verdicts("cannot tell", "auto better"), {"name": "x"},
             verdicts("auto better")]
    assert flagged(cells) == [1, 2, 4]
    same = {"auto_vs_forced": verdicts("auto@push better")["auto_vs_best"]}  # a --same-processes map's cell
    assert flagged([{"auto_vs_forced": verdicts("cannot tell")["auto_vs_best"]}, same]) == [1]


def test_the_screens_runs_of_a_cell_are_found_by_mode_prompt_seed_and_rate(tmp_path: Path):
    cfg = MapConfig(model="m", seed=0)
    modes = (*MODES, "auto@push")
    folder = tmp_path / "runs" / "full"
    folder.mkdir(parents=True)
    for index in (3, 4):
        for mode in modes:
            doc = run_doc(mode, run_seed(cfg, index, 0, mode), ttfts(100 + index))
            (folder / f"{mode}-{index}.json").write_text(json.dumps(doc))
    old = run_doc("push", run_seed(cfg, 3, 0, "push"), ttfts(500), rate=0.7)  # an older map's run in the folder
    (folder / "push-old.json").write_text(json.dumps(old))
    found = ScreenRuns(folder).of_cell(cfg, 3, screen_cell(modes), list(modes), repeats=1)
    assert set(found) == set(modes) and all(len(v) == 1 for v in found.values())
    assert all(d["requests"][0]["ttft_s"] == pytest.approx(0.103 * 0.95) for v in found.values() for d in v)
    assert run_seed(cfg, 3, 0, "auto@push") != run_seed(cfg, 3, 0, "push")  # forced routes: their own prompts
    with pytest.raises(ConfirmError, match="found 0 run"):  # a cell whose runs are not there
        ScreenRuns(folder).of_cell(cfg, 5, screen_cell(modes), list(modes), repeats=1)
    (folder / "push-again.json").write_text(json.dumps(run_doc("push", run_seed(cfg, 3, 0, "push"), ttfts(90))))
    with pytest.raises(ConfirmError, match="2 runs of push"):  # two runs of the same prompts and rate
        ScreenRuns(folder).of_cell(cfg, 3, screen_cell(modes), list(modes), repeats=1)


def test_confirmation_pools_its_runs_with_the_screens_and_reports_both(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """The screen's one run had auto 10% slower than push, a verdict; the confirmation's run has them
    equal. Pooled, the runs are resampled too, and the interval spans 1: the drift between the runs
    is in it. The screen's verdict stays next to the pooled one."""
    cfg = MapConfig(model="m", grid="quick", modes=MODES, seed=0, result_dir=str(tmp_path / "screen"))
    screen_runs = {m: [run_doc(m, run_seed(cfg, 0, 0, m), ttfts(110 if m == "auto" else 100 if m == "push" else 130))]
                   for m in MODES}
    folder = tmp_path / "screen" / "runs" / "full"
    folder.mkdir(parents=True)
    for m, docs in screen_runs.items():
        (folder / f"{m}.json").write_text(json.dumps(docs[0]))
    quiet = summarize(Cell("full", 512, 32, 0.8, "none"), 2.0, screen_runs, {})
    for key in ("ttft_p50", "ttft_p99"):  # a cell the confirmation leaves alone
        quiet["auto_vs_best"][key]["verdict"] = "cannot tell"
    screen = summarize(CELL, 1.5, screen_runs, {"push": 30})
    screen["capacity"] = 3.0
    assert screen["auto_vs_best"]["best"] == "push" and screen["auto_vs_best"]["ttft_p50"]["verdict"] == "push better"
    path = tmp_path / "screen" / "regime_map.json"
    path.write_text(json.dumps({"config": asdict(cfg), "cells": [screen, quiet]}))

    class Fleet:
        stopped = False

        def stop(self) -> None:
            Fleet.stopped = True

    calls = []

    def cell_runs(cfg, suite, fleet, cell, rate, index, first_rep=0):
        calls.append((cell, rate, index, first_rep, cfg.repeats))
        assert (suite.input_len, suite.output_len) == (cell.input_len, cell.output_len)
        return ({m: [run_doc(m, run_seed(cfg, index, first_rep, m), ttfts(100 if m in ("auto", "push") else 130))]
                 for m in MODES}, {"push": 25.0, "local": 5.0})

    monkeypatch.setattr(regime_confirm, "start_fleet", lambda cfg, name, link: (SuiteConfig(model="m"), Fleet(), None))
    monkeypatch.setattr(regime_confirm, "cell_runs", cell_runs)
    monkeypatch.setattr(regime_confirm, "calibrate", lambda fleet, probe, seed: [])
    out = confirm(path, 1, str(tmp_path / "confirm"), command="python benchmarks/regime_map.py --confirm x")
    assert calls == [(CELL, 1.5, 0, 1, 1)] and Fleet.stopped  # only the flagged cell, after the screen's repeat
    doc = json.loads(out.read_text())
    (c,) = doc["cells"]
    assert doc["flagged"] == [0] and doc["config"]["confirm_of"] == str(path)
    assert {m["runs"] for m in c["modes"].values()} == {2} and c["routes"]["push"] == 55
    pooled = c["auto_vs_best"]["ttft_p50"]
    assert pooled["ratio"] == pytest.approx(1.05, abs=0.02) and pooled["verdict"] == "cannot tell"
    assert c["screen"]["auto_vs_best"]["ttft_p50"]["verdict"] == "push better" and c["capacity"] == 3.0
    assert set(c["auto_vs_each"]) == set(FIXED)
    text = report(out)
    assert "regime-map:quick-confirm:begin" in text and "confirmation of" in text
    assert "screen: push better -> 1.05" in text  # the screen's one-run difference, then the pooled ratio
    with pytest.raises(ConfirmError, match="is a confirmation itself"):
        confirm(out, 1, str(tmp_path / "again"))


def test_a_confirmation_says_when_its_code_differs_from_the_screens():
    from kvpush.bench.regime_confirm import code_change

    assert code_change({"git_commit": "a", "git_dirty": False}, {"git_commit": "a", "git_dirty": False}) == ""
    assert code_change({"git_commit": "a"}, {"git_commit": "b"}) == "the screen ran commit a, this runs b"
    assert code_change({"git_commit": "a", "git_dirty": True}, {"git_commit": "a", "git_dirty": False}) == \
        "the screen's tree had uncommitted changes to a"
