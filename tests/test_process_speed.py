"""benchmarks/process_speed.py: the report of how far processes of the same code spread in speed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("process_speed", Path(__file__).parents[1] / "benchmarks/process_speed.py")
assert spec is not None and spec.loader is not None
process_speed = importlib.util.module_from_spec(spec)
sys.modules["process_speed"] = process_speed
spec.loader.exec_module(process_speed)


def test_the_report_separates_spread_within_a_start_from_spread_across_starts() -> None:
    starts = [{"push": {"step_ms": 4.0, "batch_step_ms": 8.0, "prefill_ms": 30.0},
               "auto": {"step_ms": 4.0, "batch_step_ms": 10.0, "prefill_ms": 30.0}},
              {"push": {"step_ms": 4.0, "batch_step_ms": 8.0, "prefill_ms": None},
               "auto": {"step_ms": 4.4, "batch_step_ms": 8.0, "prefill_ms": None}}]
    text = process_speed.report(starts)
    assert "| 1 | auto | 4.40 | 8.00 | - |" in text
    assert "- batch_step_ms: between deployments of one start, max/min 1.25, 1.00; one deployment from start to start 1.00, 1.25" in text
    assert "- prefill_ms: between deployments of one start, max/min 1.00; one deployment from start to start" in text
    assert process_speed.spread([5.0]) is None
