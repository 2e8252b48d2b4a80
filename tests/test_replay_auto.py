"""benchmarks/replay_auto.py: auto's cost model replayed over a (synthetic) regime map's auto runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("replay_auto", Path(__file__).parents[1] / "benchmarks/replay_auto.py")
assert spec is not None and spec.loader is not None
replay_auto = importlib.util.module_from_spec(spec)
sys.modules["replay_auto"] = replay_auto  # (its dataclasses look their module up)
spec.loader.exec_module(replay_auto)


def request(i: int, route: str, ttft_s: float, start: float, p_time_s: float = 0.03) -> dict:
    """One answered request of a 1P1D auto run: P took p_time_s, the rest of the TTFT after it."""
    trace = {"proxy_received": start, "d_leg_sent": start, "api_received": start, "first_token": start + ttft_s,
             "p_api_received": start, "p_prefill_done": start + p_time_s}
    estimates = {"push": 40.0, "pull": 45.0}
    return {"index": i, "success": True, "ttft_s": ttft_s, "e2el_s": ttft_s + 0.1, "sent_unix": start,
            "kvpush_trace": trace,
            "kvpush_route": {"route": route, "forced": False, "reason": "cheapest", "tokens": 512,
                             "d_prefix_tokens": 0, "p_prefix_tokens": 0, "p_waiting": 0, "d_running": 0,
                             "p_queue_tokens": 0, "d_queue_tokens": 0, "estimates_ms": estimates}}


def result_dir(tmp_path: Path, requests: list[dict]) -> Path:
    (tmp_path / "runs/full").mkdir(parents=True)
    config = {"input_len": 512, "output_len": 32, "dataset": "random", "request_rate": 1.0}
    (tmp_path / "runs/full/auto-rate1.0-1.json").write_text(json.dumps({"config": config, "requests": requests}))
    (tmp_path / "runs/full/push-rate1.0-1.json").write_text(json.dumps({"config": config, "requests": []}))
    cell = {"name": "full 512/32 50% none", "rate": 1.0, "auto_vs_best": {"best": "pull"},
            "cell": {"link": "full", "input_len": 512, "output_len": 32, "load": 0.5, "prefix": "none"}}
    (tmp_path / "regime_map.json").write_text(json.dumps({"cells": [cell]}))
    return tmp_path


def test_replay_learns_the_runs_answers_in_order_and_scores_the_cheapest_route(tmp_path: Path) -> None:
    # push measured at 80 ms, pull at 40: once learned, the model's cheapest is pull, the cell's best
    reqs = [request(i, "push" if i % 2 else "pull", 0.080 if i % 2 else 0.040, 1000.0 + i) for i in range(40)]
    out = tmp_path / "replay.json"
    assert replay_auto.main([str(result_dir(tmp_path, reqs)), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["cells"][0]
    assert row["cell"] == "full 512/32 50% none" and row["best"] == "pull" and row["decisions"] == 40
    assert row["picks"]["pull"] >= 30 and row["agree"] == pytest.approx(row["picks"]["pull"] / 40)
    assert row["est_err"] < row["est_err_as_run"]  # the recorded 40/45 ms were wrong for push
    assert json.loads(out.read_text())["settings"] == {}


def test_an_answer_is_learned_only_after_it_ended(tmp_path: Path) -> None:
    """Two requests at once: the second is decided before the first's answer, so it cannot use it."""
    reqs = [request(0, "push", 0.5, 1000.0), request(1, "push", 0.5, 1000.001)]
    events = replay_auto.events([json.loads((result_dir(tmp_path, reqs) / "runs/full/auto-rate1.0-1.json").read_text())])
    assert [(e[1], e[2]["index"]) for e in events] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_no_runs_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no runs"):
        replay_auto.main([str(result_dir(tmp_path, [])), "--mode", "auto_w1"])


def fixed_runs(tmp_path: Path, ttft_s: dict[str, float], n: int) -> None:
    """The fixed modes' and colocated's runs of the cell, on the same prompts as auto's (seed, index)."""
    config = {"input_len": 512, "output_len": 32, "dataset": "random", "request_rate": 1.0}
    for mode, ttft in ttft_s.items():
        reqs = [{**request(i, mode, ttft, 2000.0 + i), "kvpush_route": None} for i in range(n)]
        (tmp_path / f"runs/full/{mode}-rate1.0-2.json").write_text(json.dumps({"config": config, "requests": reqs}))


def test_choices_are_scored_on_the_fixed_deployments_answers_to_the_same_prompts(tmp_path: Path) -> None:
    """Auto took pull (60 ms) where push answered in 40: the run's choices score 1.5x the best fixed
    mode; the replayed model, starting on push and learning pull's 60 ms, picks push: ~1.0x."""
    reqs = [request(i, "pull", 0.060, 1000.0 + i) for i in range(30)]
    d = result_dir(tmp_path, reqs)
    fixed_runs(d, {"push": 0.040, "pull": 0.060, "push-layerwise": 0.050, "colocated": 0.030}, 30)
    cell = json.loads((d / "regime_map.json").read_text())
    cell["cells"][0]["auto_vs_best"]["best"] = "push"
    (d / "regime_map.json").write_text(json.dumps(cell))
    out = tmp_path / "replay.json"
    assert replay_auto.main([str(d), "--json", str(out)]) == 0
    row = json.loads(out.read_text())["cells"][0]
    assert row["scored"] == 30
    assert row["vs_best"]["as run"] == pytest.approx(1.5) and row["vs_best"]["auto"] == pytest.approx(1.5)
    assert row["vs_best"]["chosen"] == pytest.approx(1.0) and row["vs_best"]["oracle"] == pytest.approx(0.75)


def test_learning_from_the_picked_routes_answers_closes_the_loop(tmp_path: Path) -> None:
    """The run's push answers were fast (40 ms) but the push deployment measured 100 ms for the same
    prompts and pull 30: learning what was taken keeps push; learning what the pick would have met
    moves the model to pull (found by exploring)."""
    reqs = [request(i, "push", 0.040, 1000.0 + i) for i in range(60)]
    d = result_dir(tmp_path, reqs)
    fixed_runs(d, {"push": 0.100, "pull": 0.030, "push-layerwise": 0.100, "colocated": 0.100}, 60)
    taken, picked = tmp_path / "taken.json", tmp_path / "picked.json"
    assert replay_auto.main([str(d), "--json", str(taken)]) == 0
    assert replay_auto.main([str(d), "--learn", "picked", "--json", str(picked)]) == 0
    pull = [json.loads(f.read_text())["cells"][0]["picks"].get("pull", 0) for f in (taken, picked)]
    assert pull[0] <= 5 and pull[1] > 30, pull  # (taken: pull only when exploring)
