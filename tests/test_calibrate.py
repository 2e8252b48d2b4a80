"""The side-by-side runs' process check (kvpush/bench/calibrate.py): which deployment counts as slow,
and the probe and restart on a real colocated server and a real 1P1D push deployment."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpush.bench.calibrate import CalibrationConfig, Probe, calibrate, probe, slow
from kvpush.bench.suite import Fleet, SuiteConfig


def test_a_slow_step_or_prefill_is_named_and_push_layerwise_prefill_is_not_judged():
    probes = {"colocated": Probe(3.8, None), "pull": Probe(3.9, 100.0), "push": Probe(5.0, 101.0),
              "push-layerwise": Probe(3.8, 140.0), "auto": Probe(3.85, 130.0)}
    found = slow(probes, 1.15)
    assert set(found) == {"push", "auto"}, found
    assert found["push"].startswith("step 5.00 ms") and found["auto"].startswith("prefill 130.00 ms")
    assert slow({"push": Probe(9.0, 500.0)}, 1.15) == {}  # nothing to compare with
    assert slow({"a": Probe(None, None), "b": Probe(4.0, None)}, 1.15) == {}


def test_a_process_slow_only_with_a_batch_is_named_too():
    """Alone every D steps alike; with 8 requests at once one of them is 30% slower."""
    probes = {m: Probe(4.0, 30.0, batch) for m, batch in (("push", 8.0), ("pull", 8.2), ("auto", 10.5))}
    assert slow(probes, 1.15) == {"auto": "batched step 10.50 ms > 1.15 x median 8.20"}


def test_calibration_probes_every_endpoint_and_restarts_the_slow_ones(tiny_model: str, tmp_path: Path):
    fleet = Fleet(SuiteConfig(model=tiny_model, modes=("colocated", "push"), serve_args=["--torch-threads", "1"]),
                  str(tmp_path)).start()
    try:
        cfg = CalibrationConfig(tiny_model, requests=2, prompt_len=24, output_len=6, tries=1, vocab_size=1024,
                                slow_ratio=10.0, batch=3)
        rounds = calibrate(fleet, cfg)
        assert len(rounds) == 1 and rounds[0]["slow"] == {} and rounds[0]["restarted"] == []
        probes = rounds[0]["probes"]
        assert probes["colocated"]["step_ms"] > 0 and probes["colocated"]["prefill_ms"] is None
        assert probes["push"]["step_ms"] > 0 and probes["push"]["prefill_ms"] > 0  # P's stamps came back
        assert probes["push"]["batch_step_ms"] > 0 and probes["colocated"]["batch_step_ms"] > 0
        # ratio 0: every endpoint is "slow": restarted once, probed again, then kept as it is
        pids = {m: fleet.deployments["push"].proxy.proc.pid for m in ("push",)}
        rounds = calibrate(fleet, CalibrationConfig(**{**cfg.__dict__, "slow_ratio": 0.0}))
        assert len(rounds) == 2 and set(rounds[0]["restarted"]) == {"colocated", "push"}
        assert rounds[1]["restarted"] == [] and set(rounds[1]["slow"]) == {"colocated", "push"}
        assert fleet.deployments["push"].proxy.proc.pid != pids["push"]  # new processes, same URL
        assert probe(fleet.urls["push"], None, cfg, np.random.default_rng(1)).prefill_ms is not None  # serving
    finally:
        fleet.stop()


def test_the_suite_checks_the_processes_before_it_measures(tmp_path: Path, monkeypatch):
    import kvpush.bench.suite as suite

    calls: list[object] = []

    class FakeFleet:
        def __init__(self, cfg: SuiteConfig, log_dir: str) -> None:
            self.deployments: dict = {}

        def start(self) -> FakeFleet:
            calls.append("start")
            return self

        def stop(self) -> None:
            calls.append("stop")

    monkeypatch.setattr(suite, "Fleet", FakeFleet)
    monkeypatch.setattr(suite, "idle_cpu", lambda fleet, seconds: calls.append("idle") or {})
    monkeypatch.setattr(suite, "calibrate", lambda fleet, cfg, seed: calls.append(("check", cfg.prompt_len)) or [])
    monkeypatch.setattr(suite, "compare", lambda runs, out: (tmp_path / "compare.md", []))
    for name in ("format_table", "format_phases", "format_handover"):
        monkeypatch.setattr(suite, name, lambda docs: "")
    for on, expect in ((True, ["start", ("check", 128), "idle", "stop"]), (False, ["start", "idle", "stop"])):
        calls.clear()
        suite.run_suite(SuiteConfig(model="m", repeats=0, input_len=128, calibrate=on, result_dir=str(tmp_path)))
        assert calls == expect
