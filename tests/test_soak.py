"""The soak's 60-second version (benchmarks/soak.py runs 30 minutes): a mixed workload with multi-turn
sessions and client disconnects through 1P1D push and pull at once, real servers and real NIXL.
Nothing fails but the disconnects, every block is free and every ledger empty afterwards, and the
idle instances hold about as many fds and threads as before the load."""

from __future__ import annotations

import json

import pytest

from kvpush.bench.soak import SoakConfig, plot, run_soak

pytestmark = pytest.mark.integration


def test_soak_one_minute(tiny_model, tmp_path):
    cfg = SoakConfig(model=tiny_model, modes=("push", "pull"), duration_s=60, rate=3.0, input_len=48, output_len=12,
                     disconnect_share=0.05, sample_s=3.0, settle_s=0.0, pin=False, result_dir=str(tmp_path),
                     serve_args=["--torch-threads", "1", "--block-size", "8", "--num-blocks", "512",
                                 "--max-model-len", "512"])
    path = run_soak(cfg)
    doc = json.loads(path.read_text())
    s = doc["summary"]
    for mode in cfg.modes:
        t = s["ttft"][mode]
        assert t["errors"] == 0, t["first_errors"]
        assert t["ok"] > 100 and t["disconnected"] > 0, t  # ~180 sent per deployment
        assert t["paired"] > 10 and t["paired_ratio_ci95"][0] <= t["paired_ratio"], t  # 10-s periods, ~30 each
        assert len(t["period_p50_ms"]) == 6 and all(p > 0 for p in t["period_p50_ms"]), t
    assert s["blocks_all_free"] and s["ledgers_empty"], s["end"]
    for name, before in s["idle_before"].items():
        after = s["idle_after"][name]
        assert after["fds"] <= before["fds"] + 32, (name, before, after)  # not one per request
        assert after["threads"] <= before["threads"] + 8, (name, before, after)
    assert len(doc["rows"]) >= 15 and plot(path) is not None
