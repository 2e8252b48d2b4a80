"""benchmarks/aa_check.py: same-mode run pairs compared as the regime map compares two modes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("aa_check", Path(__file__).parents[1] / "benchmarks/aa_check.py")
assert spec is not None and spec.loader is not None
aa_check = importlib.util.module_from_spec(spec)
sys.modules["aa_check"] = aa_check
spec.loader.exec_module(aa_check)


def write_run(folder: Path, name: str, mode: str, seed: int, started: float, ttft_ms: float) -> None:
    config = {"input_len": 128, "output_len": 32, "dataset": "random", "request_rate": 1.0, "mode_label": mode,
              "seed": seed}
    reqs = [{"index": i, "success": True, "ttft_s": ttft_ms * (0.9 + 0.2 * i / 29) / 1e3,
             "e2el_s": 0.5, "output_tokens": 32} for i in range(30)]
    (folder / name).write_text(json.dumps({"config": config, "run": {"started_at_unix": started}, "requests": reqs}))


def test_same_mode_pairs_count_as_beyond_only_when_their_runs_differ(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "runs" / "full"
    folder.mkdir(parents=True)
    write_run(folder, "push-rate1.0-a.json", "push", 1, 1.0, 40.0)
    write_run(folder, "push-rate1.0-b.json", "push", 2, 2.0, 40.0)  # the same: cannot tell
    write_run(folder, "pull-rate1.0-a.json", "pull", 1, 1.0, 40.0)
    write_run(folder, "pull-rate1.0-b.json", "pull", 2, 2.0, 60.0)  # 1.5x apart: beyond
    write_run(folder, "auto-rate1.0-a.json", "auto", 1, 1.0, 40.0)  # one run: no pair
    counts = aa_check.check([tmp_path])
    assert counts["ttft_p50"] == {"pairs": 2, "beyond": 1}
    assert aa_check.main([str(tmp_path)]) == 0
    assert "ttft_p50: 1 of 2 same-mode run pairs beyond" in capsys.readouterr().out


def test_twins_of_a_map_are_counted_from_its_own_comparisons(tmp_path: Path, capsys) -> None:
    """A map run with --twin carries MODE#2 vs MODE per cell ("aa"); aa_check counts their verdicts."""
    (tmp_path / "runs" / "full").mkdir(parents=True)
    write_run(tmp_path / "runs" / "full", "auto-rate1.0-a.json", "auto", 1, 1.0, 40.0)
    same = {"verdict": "cannot tell", "runs": 2}
    beyond = {"verdict": "auto better", "runs": 2}
    cells = [{"aa": {"auto#2": {"ttft_p50": same, "ttft_p99": beyond, "tpot_p50": same}}},
             {"aa": {"auto#2": {"ttft_p50": same, "ttft_p99": same, "tpot_p50": None}}}, {}]
    (tmp_path / "regime_map.json").write_text(json.dumps({"cells": cells}))
    assert aa_check.twin_check([tmp_path]) == {("tpot_p50", 2): [0, 1], ("ttft_p50", 2): [0, 2], ("ttft_p99", 2): [1, 2]}
    assert aa_check.main([str(tmp_path)]) == 0
    assert "ttft_p99: 1 of 2 twins with 2 run(s) a side (MODE#2 vs MODE" in capsys.readouterr().out


def test_subsets_compare_a_twin_with_its_mode_on_every_subset_of_their_repeats(tmp_path: Path, capsys) -> None:
    """Twin and mode on two prompt sets: equal on the first, 1.5x apart on the second. One run a side:
    two comparisons, one beyond; both runs a side: one comparison. A run without a seed pairs with nothing."""
    folder = tmp_path / "runs" / "full"
    folder.mkdir(parents=True)
    for mode, slow in (("auto@push", 1.0), ("auto@push#2", 1.5)):
        for seed, factor in ((0, 1.0), (1, slow)):
            name = f"{mode.replace('@', '_').replace('#', '_')}-rate1.0-{seed}.json"
            write_run(folder, name, mode, 7, float(seed), 40.0 * factor)
            doc = json.loads((folder / name).read_text())
            doc["run"]["sample_seed"] = seed
            (folder / name).write_text(json.dumps(doc))
    write_run(folder, "auto_push_2-rate1.0-x.json", "auto@push#2", 7, 9.0, 40.0)  # no seed: left out
    found = aa_check.subset_check([tmp_path])
    assert found[("ttft_p50", 1)] == [1, 2]
    assert found[("ttft_p50", 2)][1] == 1 and ("ttft_p50", 3) not in found
    assert aa_check.main([str(tmp_path), "--subsets"]) == 0
    assert "ttft_p50: 1 of 2 twin comparisons on 1 run(s) a side" in capsys.readouterr().out
